"""Timing the kernels on a GPU: forward throughput in TFLOP/s, and decode time against the gather;
and ``paged_decode_batch``, a decode step's inputs over a paged cache, for timing on any device.

Attention costs 4 * d floating-point operations per (query, key) pair it computes (2 * d for
q . k, 2 * d for p * v); under a causal mask only the visible pairs count, about half. The
interpreter that runs the kernels on a CPU executes them one program at a time in NumPy, so its
timings say nothing about the kernels: these functions refuse anything but CUDA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.bench import compare, measure
from labkit.kernels import flash_attention, paged_decode
from labkit.kernels.runtime import interpreted
from labkit.kernels.tiled import naive_attention
from labkit.paged_attention import paged_attention

NEEDS_CUDA = "kernel timings need a CUDA GPU: on a CPU the kernels run in Triton's interpreter, for correctness only"


def require_cuda(device: torch.device) -> None:
    """Raise, saying why, unless ``device`` is a CUDA GPU with the kernels compiled for it."""
    if torch.device(device).type != "cuda" or interpreted():
        raise RuntimeError(NEEDS_CUDA)


def attention_flops(batch: int, heads: int, n_queries: int, n_keys: int, dim: int, causal: bool) -> float:
    """4 * d per computed (query, key) pair; causal: query i of the last T sees S - T + i + 1 keys."""
    pairs = n_queries * n_keys
    if causal:
        pairs = n_queries * (n_keys - n_queries) + n_queries * (n_queries + 1) // 2
    return 4.0 * batch * heads * pairs * dim


def forward_speeds(lengths: list[int], dims: list[int], device: torch.device, batch_tokens: int = 16384,
                   heads: int = 16, causal: bool = True, naive_limit: int = 4096, repeats: int = 20) -> list[dict]:
    """TFLOP/s of the Triton kernel, SDPA and naive attention, fp16, batch = batch_tokens / length;
    naive attention only up to ``naive_limit`` tokens (its score matrix grows as N^2)."""
    require_cuda(device)
    rows = []
    for dim in dims:
        for n in lengths:
            batch = max(1, batch_tokens // n)
            q, k, v = (torch.randn(batch, heads, n, dim, device=device, dtype=torch.float16) for _ in range(3))
            pair = compare(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                           lambda: flash_attention(q, k, v, causal=causal), labels=("sdpa", "triton"),
                           warmup=3, repeats=repeats, device=device)  # alternated: A B A B
            timings = [pair.b, pair.a]
            if n <= naive_limit:
                timings.append(measure(lambda: naive_attention(q, k, v, causal), warmup=3, repeats=repeats,
                                       label="naive", device=device))
            flops = attention_flops(batch, heads, n, n, dim, causal)
            rows += [dict(impl=t.label, n=n, dim=dim, batch=batch, ms=t.median_s * 1e3,
                          tflops=flops / t.median_s / 1e12) for t in timings]
    return rows


def paged_decode_batch(lengths: torch.Tensor, heads: int, kv_heads: int, dim: int, block_size: int, *,
                       layers: tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu", generator: torch.Generator | None = None) -> tuple:
    """One decode step's inputs for sequences of ``lengths``: q ``[B, heads, dim]``, random key and
    value pools ``[*layers, num_blocks, block_size, kv_heads, dim]`` with room for every sequence's
    longest table, that many blocks in shuffled order as the tables ``[B, width]``, and ``lengths``."""
    batch, width = len(lengths), -(-int(lengths.max()) // block_size)
    random = dict(generator=generator, device=device, dtype=dtype)
    shape = (*layers, batch * width, block_size, kv_heads, dim)
    tables = torch.randperm(batch * width, generator=generator, device=device).view(batch, width)
    k, v = torch.randn(shape, **random), torch.randn(shape, **random)
    return torch.randn(batch, heads, dim, **random), k, v, tables, lengths.to(device)


def decode_speeds(lengths: list[int], device: torch.device, batch: int = 32, heads: int = 32, kv_heads: int = 8,
                  dim: int = 128, block_size: int = 16, repeats: int = 50) -> list[dict]:
    """One decode step's attention over a paged cache (fp16, every sequence ``length`` tokens,
    blocks in shuffled order): the Triton kernel against gathering the blocks, then attending."""
    require_cuda(device)
    rows = []
    for length in lengths:
        q, *pools, tables, lengths_t = paged_decode_batch(torch.full((batch,), length), heads, kv_heads, dim,
                                                          block_size, dtype=torch.float16, device=device)
        kv_bytes = 2 * batch * length * kv_heads * dim * 2
        pair = compare(lambda: paged_attention(q, *pools, tables, lengths_t),
                       lambda: paged_decode(q, *pools, tables, lengths_t), labels=("gather", "triton"),
                       warmup=3, repeats=repeats, device=device)
        rows += [dict(impl=t.label, length=length, us=t.median_s * 1e6, gb_per_s=kv_bytes / t.median_s / 1e9)
                 for t in (pair.b, pair.a)]
    return rows
