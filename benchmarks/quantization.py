"""Weight bytes and validation perplexity of the target model under each quantization scheme.

    python benchmarks/quantization.py [--windows 128] [--calibration 32] [--repeats 15]

Every scheme quantizes the projections of the model's blocks (the embedding, tied to the LM head,
stays fp16 unless the scheme says "+ head"). Printed per scheme:
- bytes of the quantized projections (codes, scales, zeros) and their ratio to the same projections
  in fp16; bytes of the whole model (everything else at fp16) and its ratio;
- validation perplexity over ``--windows`` windows of 256 tokens (the same windows for every
  scheme), its change against fp16 weights, and the mean per-window loss difference against fp16
  with its standard error (the windows are paired, so this is the test of whether a change is real);
Then GPTQ against rounding at g128: the share of RTN's perplexity increase it recovers, and each
projection's relative output error on held-out validation text. Then decode speed, steps timed in
turn: one decode step of the target (context 128) with fp32 weights, INT8 and INT4 g64 dequantized
in PyTorch, and INT4 g64 through the fused kernel (``labkit.kernels.int4_linear``), whose greedy
output must equal the PyTorch path's; and the same weight formats on a stack of layers with
Llama-3.1-8B's block shapes (random weights, ``--stack-blocks`` blocks: larger than any CPU cache,
so a step reads its weights from memory, as decode does on a GPU). On a CUDA GPU, also the Triton
kernel against fp16 ``F.linear`` at batch 1 on a Llama-2-7B-shaped MLP layer (50 calls a CUDA graph). Last, the outlier
model (``labkit.outliers``) at INT4 g128: RTN, GPTQ and AWQ against its fp32 perplexity
(``--skip-outliers`` leaves it out: it takes a few minutes).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import math
from typing import Callable

import torch

import labkit
from labkit.bench import alternate
from labkit.corpus import token_ids
from labkit.device import device_name
from labkit.generate import decode_step
from labkit.generate import SamplingParams, stream
from labkit.kernels.int4_linear import why_not_int4_linear
from labkit.quant import QuantLinear, Scheme, output_errors, quantize_model, use_fused, weight_bytes
from labkit.shapes import SHAPES, projection_shapes
from labkit.train import random_batch, window_losses

SCHEMES = {
    "INT8 per-channel sym": (Scheme(8, None, True), "rtn", False),
    "INT4 g32 asym RTN": (Scheme(4, 32), "rtn", False),
    "INT4 g64 asym RTN": (Scheme(4, 64), "rtn", False),
    "INT4 g128 asym RTN": (Scheme(4, 128), "rtn", False),
    "INT4 g64 sym RTN": (Scheme(4, 64, True), "rtn", False),
    "INT4 g128 sym RTN": (Scheme(4, 128, True), "rtn", False),
    "INT4 g64 asym GPTQ": (Scheme(4, 64), "gptq", False),
    "INT4 g128 asym GPTQ": (Scheme(4, 128), "gptq", False),
    "INT4 g64 asym RTN + head": (Scheme(4, 64), "rtn", True),
}


DTYPE = "fp32"  # the full-precision weights the quantized formats are compared with, on a CPU


def projection_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of the quantized layers as stored, and the same layers' weights at fp16."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return sum(m.nbytes for m in layers), sum(2 * m.in_features * m.out_features for m in layers)


def check_fused(layers: list, xs: list | None = None) -> None:
    """Stop, saying why, unless every INT4 layer takes the fused kernel for a decode step's input
    (else the "fused" rows would time the PyTorch path under the fused kernel's name)."""
    for i, layer in enumerate(layers):
        x = xs[i] if xs else torch.zeros(1, layer.in_features)
        reason = why_not_int4_linear(x, layer.packed, layer.scales, layer.zeros,
                                     layer.scheme.group_size or layer.in_features)
        if reason:
            raise SystemExit(f"the fused INT4 kernel does not apply to layer {i} here, so it cannot be timed: {reason}")


def layer_stack(shapes: list[tuple[str, int, int]], dtype: torch.dtype, device: torch.device) -> dict:
    """A decode step through random layers of these shapes, batch 1, in each weight format: a
    callable per format (the quantized ones sharing their codes) and the bytes of each format's weights."""
    generator = torch.Generator(device).manual_seed(0)
    linears = [torch.nn.Linear(n_in, n_out, bias=False, device=device, dtype=dtype) for _, n_out, n_in in shapes]
    for linear in linears:
        torch.nn.init.normal_(linear.weight, std=0.02, generator=generator)
    xs = [torch.randn(1, n_in, device=device, dtype=dtype, generator=generator) for _, _, n_in in shapes]
    int8 = [QuantLinear.from_linear(linear, Scheme(8, None, True)) for linear in linears]
    int4 = [QuantLinear.from_linear(linear, Scheme(4, 64)) for linear in linears]
    unfused = [copy.copy(layer) for layer in int4]  # the same buffers, the PyTorch path
    use_fused(torch.nn.ModuleList(unfused), False)
    check_fused(int4, xs)

    def step(layers: list) -> Callable[[], list]:
        return lambda: [layer(x) for layer, x in zip(layers, xs)]
    formats = {DTYPE: linears, "INT8 per-channel (PyTorch)": int8, "INT4 g64 (PyTorch)": unfused,
               "INT4 g64 (fused)": int4}
    nbytes = {name: sum(layer.weight.nbytes if isinstance(layer, torch.nn.Linear) else layer.nbytes
                        for layer in layers) for name, layers in formats.items()}
    return {"steps": {name: step(layers) for name, layers in formats.items()}, "bytes": nbytes}



def decode_speed(model: torch.nn.Module, int8: torch.nn.Module, int4: torch.nn.Module, repeats: int,
                 stack_blocks: int) -> dict[str, float]:
    """Decode steps timed in turn on the target and on a larger-than-cache stack; the fused/fp32 ratios."""
    unfused = use_fused(copy.deepcopy(int4), False)
    check_fused([m for m in int4.modules() if isinstance(m, QuantLinear)])
    params = SamplingParams(max_new_tokens=48, stop_at_eos=False)
    same = list(stream(int4, [5, 9, 2, 7], params)) == list(stream(unfused, [5, 9, 2, 7], params))
    steps = {DTYPE: model, "INT8 per-channel (PyTorch)": int8, "INT4 g64 (PyTorch)": unfused, "INT4 g64 (fused)": int4}
    timed = alternate({name: decode_step(m, 128) for name, m in steps.items()}, warmup=5, repeats=repeats,
                      device="cpu")
    print(f"\none decode step of the target at context 128, timed in turn ({repeats} repeats; greedy output of the "
          f"fused INT4 model {'identical to' if same else 'DIFFERENT from'} the PyTorch path's, 48 tokens):")
    print(f"  {'weights':<28}{'median':>9}{'min':>9}{'vs ' + DTYPE:>9}")
    for name, t in timed.items():
        print(f"  {name:<28}{t.median_s * 1e3:7.2f} ms{t.min_s * 1e3:7.2f} ms{timed[DTYPE].median_s / t.median_s:8.2f}x")
    shapes = projection_shapes(SHAPES["Llama-3.1-8B"]) * stack_blocks
    stack = layer_stack(shapes, torch.float32, torch.device("cpu"))
    slow = {name: fn for name, fn in stack["steps"].items() if "PyTorch" in name}
    fast = alternate({name: fn for name, fn in stack["steps"].items() if name not in slow}, warmup=2,
                     repeats=max(repeats // 2, 5), device="cpu")
    fast |= alternate(slow, warmup=1, repeats=3, device="cpu")  # seconds each: dequantizing 10^8 weights
    print(f"\na stack of {stack_blocks} Llama-3.1-8B-shaped blocks' projections ({len(shapes)} layers, random "
          f"weights), batch 1, timed in turn:")
    print(f"  {'weights':<28}{'MB':>8}{'median':>11}{'vs ' + DTYPE:>9}{'GB/s':>7}")
    for name in stack["steps"]:
        t, nbytes = fast[name], stack["bytes"][name]
        print(f"  {name:<28}{nbytes / 1e6:8.0f}{t.median_s * 1e3:8.1f} ms{fast[DTYPE].median_s / t.median_s:8.2f}x"
              f"{nbytes / t.median_s / 1e9:7.1f}")
    return {"target": timed[DTYPE].median_s / timed["INT4 g64 (fused)"].median_s,
            "stack": fast[DTYPE].median_s / fast["INT4 g64 (fused)"].median_s, "identical": same}


def gpu_layer(repeats: int, calls: int = 50) -> None:
    """On CUDA: the Triton INT4 kernel, in each of its forms at its defaults, against fp16 F.linear at
    batch 1 on a Llama-2-7B MLP layer (4096 -> 11008), each as ``calls`` calls in one CUDA graph, so
    that the kernels are timed, not their launches."""
    from labkit.cuda_graphs import repeated
    from labkit.kernels.int4_matmul import GPU_FORM, KERNELS, int4_matmul
    device = torch.device("cuda")
    linear = torch.nn.Linear(4096, 11008, bias=False, device=device, dtype=torch.float16)
    layer = QuantLinear.from_linear(linear, Scheme(4, 64))
    x = torch.randn(1, 4096, device=device, dtype=torch.float16)
    steps = {"fp16 F.linear": repeated(lambda: torch.nn.functional.linear(x, linear.weight), calls, device)}
    for form in KERNELS:
        steps[f"INT4 g64 ({form})"] = repeated(lambda form=form: int4_matmul(x, layer.packed, layer.scales,
                                                                             layer.zeros, 64, form), calls, device)
    timed = alternate(steps, warmup=3, repeats=repeats, device=device)
    print(f"\n{device_name(device)}: a 4096 -> 11008 layer at batch 1, fp16 against INT4 g64, {calls} calls per graph:")
    for name, t in timed.items():
        print(f"  {name:<20}{t.median_s / calls * 1e6:8.1f} us a call")
    fp16_s = timed["fp16 F.linear"].median_s
    print("  goal >= 2.5x: " + ", ".join(f"{fp16_s / timed[f'INT4 g64 ({form})'].median_s:.2f}x ({form}"
                                         + (", the library's form on a GPU)" if form == GPU_FORM else ")")
                                         for form in KERNELS))


def outlier_figures(windows: int, calibration: int) -> dict[str, float]:
    """The outlier model at INT4 g128 (``labkit.outliers.measure``): perplexities, RTN's loss increase
    with its standard error, and the share of it GPTQ and AWQ recover."""
    from labkit import outliers
    stats = outliers.measure(windows, calibration)
    ppl = outliers.perplexities(stats)
    print(f"\nthe outlier model (labkit.outliers: {len(outliers.CHANNELS)} channels x{outliers.FACTOR:g}), INT4 g128 "
          f"asym, {windows} windows, {calibration} calibration windows:")
    figures = {name: outliers.against_fp32(stats, name) for name in ("RTN", "GPTQ", "AWQ")}
    for name, (gap, error, recovered) in figures.items():
        print(f"  {name:<5} perplexity {ppl[name]:8.3f} (fp32 {ppl['fp32']:.3f}), loss {gap:+.4f} +- {error:.4f} "
              f"nats per window" + (f", recovers {recovered:.0%} of RTN's increase" if recovered is not None else ""))
    rtn_gap, rtn_error, _ = figures["RTN"]
    return {"rtn_sigmas": rtn_gap / rtn_error, "gptq": figures["GPTQ"][2], "awq": figures["AWQ"][2]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=128, help="validation windows of 256 tokens")
    parser.add_argument("--calibration", type=int, default=32, help="GPTQ calibration windows of 256 tokens")
    parser.add_argument("--repeats", type=int, default=15, help="timed decode steps per model")
    parser.add_argument("--stack-blocks", type=int, default=2, help="Llama-3.1-8B-shaped blocks in the stack")
    parser.add_argument("--outlier-windows", type=int, default=128, help="validation windows for the outlier model")
    parser.add_argument("--skip-outliers", action="store_true", help="leave out the outlier model")
    args = parser.parse_args(argv)
    model, tokenizer = labkit.load("target", device="cpu")
    val_ids, train_ids = token_ids(tokenizer, "validation"), token_ids(tokenizer, "train")
    calibration, _ = random_batch(train_ids, args.calibration, 256, torch.Generator().manual_seed(0))
    held_out, _ = random_batch(val_ids, 4, 256, torch.Generator().manual_seed(1))
    print(f"{datetime.date.today()}  {device_name(torch.device('cpu'))}  torch {torch.__version__}")
    print(f"target {model.num_parameters():,} parameters; perplexity over {args.windows} validation windows "
          f"of 256 tokens; GPTQ calibrated on {args.calibration} training windows\n")

    fp16 = copy.deepcopy(model).half().float()
    base = window_losses(fp16, val_ids, 256, args.windows)
    ppl = {"fp16": math.exp(base.mean())}
    models = {}
    print(f"{'scheme':<26}{'layers MB':>10}{'ratio':>7}{'model MB':>10}{'ratio':>7}{'perplexity':>12}{'change':>9}"
          f"{'d loss vs fp16':>22}")
    print(f"{'fp16':<26}{'':>17}{weight_bytes(model) / 1e6:>10.2f}{1:>6.2f}x{ppl['fp16']:>12.3f}")
    ratios = {}
    for name, (scheme, method, head) in SCHEMES.items():
        models[name] = quantize_model(model, scheme, method, calibration if method == "gptq" else None, head)
        losses = window_losses(models[name], val_ids, 256, args.windows)
        ppl[name] = math.exp(losses.mean())
        diff = losses - base
        stored, as_fp16 = projection_bytes(models[name])
        total = weight_bytes(models[name])
        ratios[name] = (as_fp16 / stored, weight_bytes(model) / total)
        print(f"{name:<26}{stored / 1e6:>10.2f}{ratios[name][0]:>6.2f}x{total / 1e6:>10.2f}{ratios[name][1]:>6.2f}x"
              f"{ppl[name]:>12.3f}{ppl[name] / ppl['fp16'] - 1:>+9.3%}"
              f"{diff.mean():>+12.5f} +- {diff.std() / math.sqrt(len(diff)):.5f}")

    rtn, gptq = "INT4 g128 asym RTN", "INT4 g128 asym GPTQ"
    recovered = (ppl[rtn] - ppl[gptq]) / (ppl[rtn] - ppl["fp16"])
    errors = {name: output_errors(model, models[name], held_out) for name in (rtn, gptq)}
    share = torch.tensor([errors[gptq][k] / errors[rtn][k] for k in errors[rtn]])
    print(f"\nGPTQ g128: recovers {recovered:.0%} of RTN's perplexity increase; each projection's relative output "
          f"error on held-out text is {share.median():.2f} of RTN's (median over {len(share)} layers, "
          f"{share.min():.2f} to {share.max():.2f})")

    speed = decode_speed(model, models["INT8 per-channel sym"], models["INT4 g64 asym RTN"], args.repeats,
                         args.stack_blocks)
    if torch.cuda.is_available():
        gpu_layer(args.repeats)
    outlier = None if args.skip_outliers else outlier_figures(args.outlier_windows, args.calibration)

    g64 = "INT4 g64 asym RTN"
    print("\ngoals:")
    print(f"  INT4 g64 weights >= 3.5x smaller than fp16: quantized layers {ratios[g64][0]:.2f}x, whole model "
          f"{ratios[g64][1]:.2f}x (embedding fp16), {ratios[g64 + ' + head'][1]:.2f}x (embedding and head INT4)")
    print(f"  INT4 g64 perplexity <= 5% above fp16: {ppl[g64] / ppl['fp16'] - 1:+.3%} "
          f"({ppl[g64 + ' + head'] / ppl['fp16'] - 1:+.3%} with the head)")
    print(f"  GPTQ recovers >= half of RTN's increase at g128: {recovered:.0%}")
    print(f"  fused INT4 g64 decode step at least as fast as fp32 on the target: {speed['target']:.2f}x; at least "
          f"2x on the stack larger than the cache: {speed['stack']:.2f}x; greedy output unchanged: "
          f"{'yes' if speed['identical'] else 'NO'}")
    if outlier:
        print(f"  outlier model, g128: RTN's loss increase {outlier['rtn_sigmas']:.1f} standard errors; GPTQ recovers "
              f"{outlier['gptq']:.0%}, AWQ {outlier['awq']:.0%} of RTN's perplexity increase (goal: each >= 50%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
