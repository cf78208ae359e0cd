"""Cached against naive greedy generation, and how close decode comes to memory bandwidth.

    python benchmarks/kv_cache.py [--model target] [--prompt 16] [--new-tokens 512] [--repeats 3]

1. Both loops generate ``--new-tokens`` from the same ``--prompt``-token prompt, batch 1, fp32,
   timed alternately (naive, cached, naive, ...); the outputs must be identical.
2. Decode bandwidth: bytes one decode step moves (every matmul weight, the KV cache read and
   written, ``labkit.cost.forward_bytes``) over its median time, at the middle of that
   generation, against the copy bandwidth of this device (``labkit.hardware``, 256 MiB: from
   memory). Then against a copy whose source and destination together are the size of those
   bytes: a last-level cache that holds the model serves it (and the decode step) faster.
3. For comparison, the same weights streamed by the model's matrix-vector products alone, one
   token through each weight matrix in turn with nothing else in between.
"""
from __future__ import annotations

import argparse
import datetime

import torch

import labkit
from labkit import cost
from labkit.bench import compare, measure
from labkit.device import device_name
from labkit.generate import SamplingParams, decode_step, stream
from labkit.hardware import measure_bandwidth


def matvecs_alone(model: torch.nn.Module):
    """One token through every Linear of the model in turn, and nothing else."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    x = {m: torch.randn(1, m.in_features) for m in linears}

    def run() -> None:
        with torch.no_grad():
            for m in linears:
                m(x[m])
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="target")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cpu")
    model, tokenizer = labkit.load(args.model, device=device)
    config = model.config
    text = tokenizer.encode('def is_prime(n):\n    """Return True if n is a prime number."""').ids
    prompt = (text * args.prompt)[:args.prompt]
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_at_eos=False)
    naive = lambda: list(stream(model, prompt, params, use_cache=False))
    cached = lambda: list(stream(model, prompt, params))

    same = naive() == cached()
    result = compare(naive, cached, labels=("naive", "cached"), warmup=0, repeats=args.repeats, device=device)
    print(f"{datetime.date.today()}  {device_name(device)}  torch {torch.__version__}  "
          f"model {args.model} ({model.num_parameters():,} parameters, fp32)")
    print(f"{args.new_tokens} new tokens from a {args.prompt}-token prompt; greedy outputs identical: {same}\n")
    print(f"{'':<10}{'median s':>10}{'IQR s':>8}{'tokens/s':>10}")
    for timing in (result.a, result.b):
        print(f"{timing.label:<10}{timing.median_s:>10.2f}{timing.spread_s:>8.2f}{args.new_tokens / timing.median_s:>10.1f}")
    print(f"cached / naive speed: {result.speedup:.1f}x")

    context = args.prompt + args.new_tokens // 2
    step_s = measure(decode_step(model, context), warmup=5, repeats=100, device=device).median_s
    alone_s = measure(matvecs_alone(model), warmup=5, repeats=100, device=device).median_s
    copy = measure_bandwidth(device, 256 << 20, repeats=10)
    step_bytes = cost.forward_bytes(config, 1, context, weight_bytes=4, kv_dtype="fp32")
    weight_bytes = cost.matmul_weights(config) * 4
    step_rate, alone_rate = step_bytes / step_s, weight_bytes / alone_s
    print(f"\ncopy bandwidth (read + write, 256 MiB): {copy / 1e9:.1f} GB/s")
    print(f"decode step at position {context}: {step_s * 1e3:.2f} ms, {step_bytes / 1e6:.1f} MB "
          f"-> {step_rate / 1e9:.1f} GB/s = {step_rate / copy:.2f} of copy bandwidth")
    print(f"its matrix-vector products alone: {alone_s * 1e3:.2f} ms, {weight_bytes / 1e6:.1f} MB "
          f"-> {alone_rate / 1e9:.1f} GB/s = {alone_rate / copy:.2f} of copy bandwidth")
    resident = measure_bandwidth(device, step_bytes // 2, repeats=20)
    print(f"copy of {step_bytes / 2e6:.1f} MB into {step_bytes / 2e6:.1f} MB (the step's bytes in all, which a large "
          f"last-level cache may hold): {resident / 1e9:.1f} GB/s; the decode step reaches "
          f"{step_rate / resident:.2f} of it, the matrix-vector products {alone_rate / resident:.2f}")


if __name__ == "__main__":
    main()
