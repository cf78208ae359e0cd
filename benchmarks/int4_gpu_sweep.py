"""On a CUDA GPU: the Triton INT4 kernel's launch parameters (features per program, inputs per
step, warps) swept against fp16 F.linear at batch 1 (issue 35's goal: at least 2.5x), each
configuration timed as 50 calls in one CUDA graph. Prints the best configurations of each layer
shape with their bandwidth, and where the library's defaults stand. Each configuration compiles
first (a second or two), so the sweep stops at --budget seconds per shape.

    python benchmarks/int4_gpu_sweep.py --shapes 4096x11008 11008x4096 --budget 100

(Through commit 4a84ebf the kernel multiplied with tl.dot, and this script swept that form and the
matrix-vector form the kernel now has: BENCHMARKS.md, issue 35.)
"""
import argparse
import time

import torch
import torch.nn.functional as F

from labkit.bench import alternate
from labkit.cuda_graphs import record
from labkit.device import device_name
from labkit.kernels.int4_matmul import int4_matmul_kernel, int4_matmul
from labkit.kernels.runtime import triton
from labkit.quant import QuantLinear, Scheme

CALLS = 50
dev = torch.device("cuda")
GRID = [(bn, bk, w) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024) for w in (1, 2, 4)]
DEFAULT = (4, 512, 4)  # int4_matmul's block_n, block_k and warps on a GPU


def graphed(call):
    """``CALLS`` calls of ``call`` recorded as one CUDA graph, its replay returned."""
    return record(lambda: [call() for _ in range(CALLS)], dev)[0].replay


def sweep(in_f, out_f, budget_s):
    """Every configuration on an ``in_f -> out_f`` layer until ``budget_s`` runs out; the best 8."""
    t_start = time.monotonic()
    linear = torch.nn.Linear(in_f, out_f, bias=False, device=dev, dtype=torch.float16)
    layer = QuantLinear.from_linear(linear, Scheme(4, 64))
    x = torch.randn(1, in_f, device=dev, dtype=torch.float16)
    out = torch.empty(1, out_f, device=dev, dtype=torch.float16)
    fp16 = graphed(lambda: F.linear(x, linear.weight))
    rows = []
    for bn, bk, w in GRID:
        if time.monotonic() - t_start > budget_s:
            print("  sweep budget spent", flush=True)
            break
        try:
            def call(bn=bn, bk=bk, w=w):
                int4_matmul_kernel[(triton.cdiv(out_f, bn),)](
                    x, layer.packed, layer.scales, layer.zeros, out, 1, out_f, in_f, 64, HAS_ZEROS=True, ROWS=1,
                    BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
            call()
            torch.cuda.synchronize()
            want = int4_matmul(x, layer.packed, layer.scales, layer.zeros, 64)
            err = (out.float() - want.float()).abs().max().item()
            g = graphed(call)
            t = alternate({"fp16": fp16, "int4": g}, warmup=3, repeats=15, device=dev)
            ratio = t["fp16"].median_s / t["int4"].median_s
            rows.append((ratio, bn, bk, w, t["int4"].median_s / CALLS * 1e6, t["fp16"].median_s / CALLS * 1e6, err))
        except Exception as exc:  # a config Triton cannot compile (shared memory, shapes)
            print(f"  {bn} {bk} {w}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    rows.sort(reverse=True)
    nbytes = out_f * in_f / 2 + 2 * 2 * out_f * in_f / 64
    print(f"{in_f} -> {out_f}: best of {len(rows)} configs (INT4 bytes {nbytes / 1e6:.1f} MB, fp16 {2 * in_f * out_f / 1e6:.1f} MB)")
    for ratio, bn, bk, w, us, fp_us, err in rows[:8]:
        print(f"  BN {bn:3} BK {bk:3} warps {w}: {us:6.1f} us ({nbytes / us / 1e3:6.0f} GB/s)  fp16 {fp_us:6.1f} us "
              f"({2 * in_f * out_f / fp_us / 1e3:6.0f} GB/s)  {ratio:.2f}x  max err vs library {err:.3g}", flush=True)
    default = [r for r in rows if r[1:4] == DEFAULT]
    if default:
        print(f"  the library's defaults (BN, BK, warps = {DEFAULT}): {default[0][0]:.2f}x", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["4096x11008", "11008x4096"], help="IN x OUT")
    parser.add_argument("--budget", type=float, default=100, help="seconds per shape")
    args = parser.parse_args(argv)
    print(device_name(dev), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    start = time.monotonic()
    for shape in args.shapes:
        sweep(*map(int, shape.split("x")), args.budget)
    print(f"sweep took {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
