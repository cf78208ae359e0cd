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
projection's relative output error on held-out validation text; and one decode step (context 128)
for fp32, INT8 and INT4 weights, dequantized in PyTorch on this device.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import math

import torch

import labkit
from labkit.bench import measure
from labkit.corpus import token_ids
from labkit.device import device_name
from labkit.generate import decode_step
from labkit.quant import QuantLinear, Scheme, output_errors, quantize_model, weight_bytes
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


def projection_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of the quantized layers as stored, and the same layers' weights at fp16."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return sum(m.nbytes for m in layers), sum(2 * m.in_features * m.out_features for m in layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=128, help="validation windows of 256 tokens")
    parser.add_argument("--calibration", type=int, default=32, help="GPTQ calibration windows of 256 tokens")
    parser.add_argument("--repeats", type=int, default=15, help="timed decode steps per model")
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

    print(f"\none decode step at context 128, weights dequantized in PyTorch ({args.repeats} repeats, median):")
    for name in ("fp32", "INT8 per-channel sym", "INT4 g64 asym RTN"):
        m = model if name == "fp32" else models[name]
        step = measure(decode_step(m, 128), warmup=5, repeats=args.repeats, device="cpu").median_s
        print(f"  {name:<22}{step * 1e3:7.2f} ms")

    g64 = "INT4 g64 asym RTN"
    print("\ngoals:")
    print(f"  INT4 g64 weights >= 3.5x smaller than fp16: quantized layers {ratios[g64][0]:.2f}x, whole model "
          f"{ratios[g64][1]:.2f}x (embedding fp16), {ratios[g64 + ' + head'][1]:.2f}x (embedding and head INT4)")
    print(f"  INT4 g64 perplexity <= 5% above fp16: {ppl[g64] / ppl['fp16'] - 1:+.3%} "
          f"({ppl[g64 + ' + head'] / ppl['fp16'] - 1:+.3%} with the head)")
    print(f"  GPTQ recovers >= half of RTN's increase at g128: {recovered:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
