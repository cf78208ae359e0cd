"""The Triton attention kernels: correctness everywhere, timings on a CUDA GPU.

    python benchmarks/attention_kernels.py [--lengths 512 1024 2048 4096 8192] [--dims 64 128]

First the kernels are checked against PyTorch (forward against scaled_dot_product_attention,
paged decode against gathering the blocks) at a few small shapes; on a machine without a GPU
they run in Triton's interpreter, and the script stops there, saying timings need CUDA.

On a GPU: the forward kernel against SDPA and naive attention, fp16, causal, 16 heads, batch =
16,384 tokens / sequence length, in TFLOP/s (visible pairs only), with the ratio to SDPA (goal:
at least 0.7 at 4,096 tokens, head dimension 64); then one decode step's attention over a paged
cache (32 sequences, 32 query heads, 8 KV heads, head dimension 128, blocks of 16 in shuffled
order), the kernel against the gather reference, in microseconds and GB/s of K and V read.
"""
from __future__ import annotations

import argparse
import datetime
import sys

import torch

from labkit.device import device_name, get_device
from labkit.kernels import flash_attention, interpreted, paged_decode, reference_attention
from labkit.kernels.speed import NEEDS_CUDA, decode_speeds, forward_speeds
from labkit.paged_attention import paged_attention

GOAL = (4096, 64, 0.7)  # length, head dimension, least fraction of SDPA's forward throughput


def check(device: torch.device) -> float:
    """The largest error of either kernel against PyTorch over a few shapes, fp32 and fp16; on a
    GPU also at lengths that span many of its (larger) default tiles."""
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    shapes = [(torch.float32, (4, 2, 45, 70, 64)), (torch.float16, (4, 1, 40, 40, 128))]
    if device.type == "cuda":
        shapes += [(torch.float16, (8, 2, 1000, 1000, 64)), (torch.float16, (8, 8, 700, 1500, 128))]
    for dtype, (heads, kv_heads, n_queries, n_keys, dim) in shapes:
        q = torch.randn(1, heads, n_queries, dim, generator=generator).to(device, dtype)
        k, v = (torch.randn(1, kv_heads, n_keys, dim, generator=generator).to(device, dtype) for _ in range(2))
        out = flash_attention(q, k, v, causal=True)
        worst = max(worst, (out.float() - reference_attention(q, k, v, causal=True)).abs().max().item())
        pools = [torch.randn(12, 16, kv_heads, dim, generator=generator).to(device, dtype) for _ in range(2)]
        tables = torch.randperm(12, generator=generator).view(2, 6).to(device)
        lengths = torch.tensor([7, 90], device=device)
        out = paged_decode(q[:, :, 0].expand(2, -1, -1).contiguous(), *pools, tables, lengths)
        expected = paged_attention(q[:, :, 0].expand(2, -1, -1).float(), *(p.float() for p in pools), tables, lengths)
        worst = max(worst, (out.float() - expected).abs().max().item())
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--decode-lengths", type=int, nargs="+", default=[512, 2048, 8192])
    args = parser.parse_args(argv)
    device = get_device()
    print(f"{datetime.date.today()}  {device_name(device)}  torch {torch.__version__}  "
          f"triton {'interpreter' if interpreted() else 'compiled'}")
    worst = check(device)
    print(f"correctness: largest |kernel - PyTorch| over the check shapes = {worst:.2e}")
    if worst > 1e-2:
        print("FAILED: the kernels disagree with PyTorch")
        return 1
    if device.type != "cuda" or interpreted():
        print(NEEDS_CUDA)
        return 0
    rows = forward_speeds(args.lengths, args.dims, device)
    print(f"\nforward, fp16, causal, 16 heads, batch x length = 16,384 tokens\n"
          f"{'d':>4}{'length':>8}{'triton TFLOP/s':>16}{'sdpa TFLOP/s':>14}{'naive TFLOP/s':>15}{'triton/sdpa':>13}")
    speed = {(r["impl"], r["n"], r["dim"]): r["tflops"] for r in rows}
    for dim in args.dims:
        for n in args.lengths:
            naive = speed.get(("naive", n, dim))
            print(f"{dim:>4}{n:>8}{speed['triton', n, dim]:>16.1f}{speed['sdpa', n, dim]:>14.1f}"
                  f"{(f'{naive:.1f}' if naive else '-'):>15}{speed['triton', n, dim] / speed['sdpa', n, dim]:>12.2f}x")
    n, dim, goal = GOAL
    if ("triton", n, dim) in speed:
        ratio = speed["triton", n, dim] / speed["sdpa", n, dim]
        print(f"goal: triton >= {goal} x sdpa at {n} tokens, d={dim}: {ratio:.2f} ({'met' if ratio >= goal else 'missed'})")
    print(f"\npaged decode, fp16, 32 sequences, 32 query heads / 8 KV heads, d=128, blocks of 16\n"
          f"{'length':>8}{'triton us':>11}{'gather us':>11}{'triton GB/s':>13}{'gather GB/s':>13}{'speedup':>9}")
    decode = {(r["impl"], r["length"]): r for r in decode_speeds(args.decode_lengths, device)}
    for length in args.decode_lengths:
        mine, ref = decode["triton", length], decode["gather", length]
        print(f"{length:>8}{mine['us']:>11.1f}{ref['us']:>11.1f}{mine['gb_per_s']:>13.0f}{ref['gb_per_s']:>13.0f}"
              f"{ref['us'] / mine['us']:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
