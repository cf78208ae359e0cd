"""The Triton INT4 kernel's two forms (``gemv`` on the ordinary cores, ``dot`` on the tensor cores)
and launch parameters (features per program, groups per step, warps, programs per feature tile,
stages of the loop's copy pipeline) on a CUDA GPU, swept against fp16 F.linear at batch 1 (issue
35's goal: at least 2.5x; ``--dtype bf16`` sets bf16 activations against bf16 F.linear), each
configuration timed as 50 calls in one CUDA graph. Prints the best configurations of each layer shape with their bandwidth, and where each
form's defaults stand. Each configuration compiles first (a second or two), so the sweep stops at
--budget seconds per shape.

    python benchmarks/int4_gpu_sweep.py --shapes 4096x11008 11008x4096 --budget 100

Without a GPU, ``--instructions`` compiles the kernel for an H100 (sm_90) at each configuration and
counts the machine instructions (SASS) in its loop, per 4-bit code, with the time that issuing them
alone would take on an H100 (a floor: it assumes every scheduler issues at every cycle;
``labkit.kernels.issue``):

    python benchmarks/int4_gpu_sweep.py --instructions

(Through commit 4a84ebf the kernel multiplied with tl.dot, loading a scale and a zero point per byte
of codes and converting each code; through e299b08 the matrix-vector form did the same and summed
across threads at every step; BENCHMARKS.md, issue 35.)
"""
import argparse
import itertools
import os
import sys
import time

if __name__ == "__main__" and "--instructions" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"  # compile for a GPU, which Triton can do without one

import torch
import torch.nn.functional as F

from labkit.bench import alternate
from labkit.cuda_graphs import repeated
from labkit.device import device_name
from labkit.kernels.int4_matmul import GPU_FORM, KERNELS, default_split_k, int4_matmul, launch_parameters
from labkit.kernels.issue import int4_loop
from labkit.presets import ISSUE_RATES, gpu
from labkit.kernels.runtime import triton
from labkit.quant import QuantLinear, Scheme

CALLS = 50
GROUP = 64
H100 = ISSUE_RATES["H100-SXM"]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# each form's defaults on a GPU (form, block_n, groups, split_k, warps, stages; split_k None:
# int4_matmul's default_split_k), the library's GPU_FORM first
DEFAULTS = sorted((launch_parameters(GROUP, form, on_gpu=True) for form in KERNELS),
                  key=lambda config: config[0] != GPU_FORM)
# every configuration: the defaults first, then the untimed that may feed memory better (the best
# gemv tiles of session 33's sweep with their loads pipelined, which Triton had not done, then with
# their walk over the inputs split among programs; the tensor-core form at other depths than the 3
# it was timed at), then those with fewer instructions per code (BENCHMARKS.md), then the rest, so
# that a sweep cut short by its budget has timed the likeliest
BEST_GEMV = ((16, 8, 4), (8, 8, 1), (16, 16, 4), (8, 8, 2))
LIKELY = ([("gemv", bn, groups, split, warps, stages) for stages in (3, 2, 4) for split in (1, 2)
           for bn, groups, warps in BEST_GEMV]
          + [("gemv", bn, groups, split, warps, 1) for split in (2, 4) for bn, groups, warps in BEST_GEMV]
          + [("dot", bn, groups, None, warps, stages) for stages in (4, 2) for bn in (128, 64) for groups in (2, 4)
             for warps in (4, 8)]
          + [("dot", bn, groups, None, warps, 3) for bn in (128, 256, 64) for groups in (2, 4) for warps in (4, 8)]
          + [("gemv", bn, groups, 1, warps, 1) for bn in (16, 8, 4) for groups in (16, 8, 4) for warps in (2, 4)])
ALL = ([("dot", bn, groups, split, warps, stages) for stages in (3, 1) for split in (None, 1, 2, 4, 8)
        for bn in (64, 128, 256, 32) for groups in (1, 2, 4, 8) for warps in (4, 8)]
       + [("gemv", bn, groups, split, warps, stages) for stages in (1, 3) for split in (1, 2, 4)
          for bn in (16, 8, 4, 2) for groups in (16, 8, 4) for warps in (2, 4, 1, 8)])


def with_split(config, in_f, out_f, device):
    """``config`` with the split that ``int4_matmul`` would take for it on this layer where it is None."""
    form, bn, groups, split, warps, stages = config
    return form, bn, groups, split or default_split_k(out_f, in_f, GROUP, bn, groups, device), warps, stages


def sweep(in_f, out_f, budget_s, device, name):
    """Every configuration on an ``in_f -> out_f`` layer with ``name`` activations ("fp16" or "bf16")
    until ``budget_s`` runs out; the best 8."""
    t_start = time.monotonic()
    dtype = DTYPES[name]
    linear = torch.nn.Linear(in_f, out_f, bias=False, device=device, dtype=dtype)
    layer = QuantLinear.from_linear(linear, Scheme(4, GROUP))
    x = torch.randn(1, in_f, device=device, dtype=dtype)
    full = repeated(lambda: F.linear(x, linear.weight), CALLS, device)
    want = F.linear(x.float(), layer.dequantized_weight().float())
    defaults = [with_split(config, in_f, out_f, device) for config in DEFAULTS]
    rows = []
    for config in dict.fromkeys(with_split(config, in_f, out_f, device) for config in DEFAULTS + LIKELY + ALL):
        if time.monotonic() - t_start > budget_s:
            print("  sweep budget spent", flush=True)
            break
        try:
            def call(config=config):
                return int4_matmul(x, layer.packed, layer.scales, layer.zeros, GROUP, *config)
            err = (call().float() - want).abs().max().item()
            t = alternate({"full": full, "int4": repeated(call, CALLS, device)}, warmup=3, repeats=15, device=device)
            ratio = t["full"].median_s / t["int4"].median_s
            rows.append((ratio, config, t["int4"].median_s / CALLS * 1e6, t["full"].median_s / CALLS * 1e6, err))
        except Exception as exc:  # a config Triton cannot compile or launch (registers, shared memory)
            print(f"  {label(config)}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    rows.sort(key=lambda r: r[0], reverse=True)
    nbytes = layer.nbytes  # codes, scales and zero points
    print(f"{in_f} -> {out_f}, {name} activations: best of {len(rows)} configs (INT4 bytes {nbytes / 1e6:.1f} MB, "
          f"{name} {2 * in_f * out_f / 1e6:.1f} MB; max error against fp32 on the dequantized weight)")
    for ratio, config, us, full_us, err in rows[:8]:
        print(f"  {label(config)}: {us:6.1f} us ({nbytes / us / 1e3:5.0f} GB/s)  {name} F.linear {full_us:5.1f} us "
              f"({2 * in_f * out_f / full_us / 1e3:5.0f} GB/s)  {ratio:.2f}x  err {err:.3g}", flush=True)
    for default in defaults:
        timed = [r for r in rows if r[1] == default]
        if timed:
            print(f"  the {default[0]} form's defaults ({label(default)}): {timed[0][0]:.2f}x"
                  + (" (the library's)" if default[0] == GPU_FORM else ""), flush=True)


def label(config):
    """A configuration in words."""
    form, bn, groups, split, warps, stages = config
    return f"{form:4} BN {bn:3} groups {groups:2} warps {warps} split {split} stages {stages}"


def instructions(shapes):
    """Instructions per code in each form's loop at each configuration (batch 1, g64, fp16), and the
    time issuing them would take on an H100 for each layer size (``labkit.kernels.issue``)."""
    print(f"the INT4 kernels compiled for sm_90 (triton {triton.__version__}), one row, g{GROUP}, fp16; "
          "the machine instructions in their loops, per thread and step:")
    codes = {}  # one floor per layer size: its name and input features
    for i, o in (map(int, s.split("x")) for s in shapes):
        codes.setdefault(i * o, (f"{i}->{o}", i))
    bandwidth = gpu("H100-SXM").bandwidth
    for n, (name, in_f) in codes.items():
        int4_bytes, fp16_bytes = n * Scheme(4, GROUP).bits_per_weight(in_f) / 8, 2 * n
        print(f"  {name}: INT4 g{GROUP} {int4_bytes / 1e6:.1f} MB, read at the datasheet's {bandwidth / 1e12:.2f} TB/s "
              f"in {int4_bytes / bandwidth * 1e6:.1f} us; fp16 {fp16_bytes / 1e6:.1f} MB in "
              f"{fp16_bytes / bandwidth * 1e6:.1f} us")
    print("  (async: loads copied to shared memory by cp.async, LDGSTS, which a pipelined loop issues)")
    print("  form   BN groups warps stages  instr  per code  loads  async  barriers   "
          + "   ".join(f"floor, {name} ({n / 1e6:.0f}M codes)" for n, (name, _) in codes.items()))
    configs = ([("gemv", *c) for c in itertools.product((2, 4, 8, 16), (4, 8, 16), (2, 4, 8), (1, 3))]
               + [("dot", *c) for c in itertools.product((32, 64, 128, 256), (1, 2, 4, 8), (4, 8), (1, 3))])
    for form, bn, groups, warps, stages in configs:
        try:
            counts, each = int4_loop(form, bn, groups, warps, stages, GROUP)
        except Exception as exc:  # a configuration Triton cannot compile: say so, and go on
            print(f"  {form:4} {bn:4} {groups:6} {warps:5} {stages:6}   {type(exc).__name__}: {str(exc)[:120]}",
                  flush=True)
            continue
        loads = sum(n for op, n in counts.items() if op.startswith("LDG") and op != "LDGDEPBAR")
        copies = sum(n for op, n in counts.items() if op.startswith("LDGSTS"))
        barriers = sum(n for op, n in counts.items() if op.startswith("BAR"))
        floors = [f"{H100.floor_s(n * each) * 1e6:26.1f} us" for n in codes]
        print(f"  {form:4} {bn:4} {groups:6} {warps:5} {stages:6} {sum(counts.values()):6} {each:9.2f} {loads:6} "
              f"{copies:6} {barriers:9}   " + "   ".join(floors), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--shapes", nargs="+", default=["4096x11008", "11008x4096"], help="IN x OUT")
    parser.add_argument("--budget", type=float, default=100, help="seconds per shape")
    parser.add_argument("--dtype", choices=DTYPES, default="fp16",
                        help="the activations' and the full-precision layer's (issue 35's goal is against fp16)")
    parser.add_argument("--instructions", action="store_true",
                        help="count the loop's instructions for an H100; no GPU needed")
    args = parser.parse_args(argv)
    start = time.monotonic()
    if args.instructions:
        instructions(args.shapes)
    else:
        if not torch.cuda.is_available():
            parser.error("the sweep times the kernel on a CUDA GPU; without one, --instructions counts its "
                         "instructions")
        device = torch.device("cuda")
        print(device_name(device), "torch", torch.__version__, "triton", triton.__version__, flush=True)
        for shape in args.shapes:
            sweep(*map(int, shape.split("x")), args.budget, device, args.dtype)
    print(f"took {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
