"""Paged decode attention on the CPU, in C++: what the Triton kernel of ``paged_decode`` does on a
GPU, for the engine when it runs on a CPU.

``labkit.paged`` attends by gathering each sequence's blocks into a contiguous copy first
(``gather_kv``), then calling SDPA. On a CPU that copy is a large part of a decode step. This
operator (``paged_decode_cpu.cpp``) reads each key and value row straight from the pools through
the block table, from memory once for all the query heads that share it, and runs the sequences
in parallel on torch's own threads. It is fp32 only, the CPU model's default dtype.

It is compiled the first time ``build`` is called (``labkit.kernels.cpp_build``: a C++ compiler
with OpenMP, about 10 s, then cached on disk in ``build_directory``), so that later runs load it at
once. The engine uses it only when asked (``Engine(..., decode_kernel=paged_decode_cpu)``): the
pure-PyTorch path stays the default, and is the reference the tests compare this with.
``-ffast-math`` lets the softmax's ``exp`` be vectorised; it is safe here, since every length is at
least 1 and the largest score is subtracted, so no infinity or NaN arises.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from labkit.kernels import cpp_build
from labkit.kernels.runtime import unit_last_stride
from labkit.validate import check_paged_decode

SOURCE = Path(__file__).with_suffix(".cpp")
NAME = "labkit_paged_decode_cpu"


def build_directory() -> Path:
    """Where the operator is built and cached (``cpp_build.build_directory``)."""
    return cpp_build.build_directory(NAME)


def build(verbose: bool = False) -> str:
    """Compile (or load the cached build of) the operator, once per process, and say which it did
    (``cpp_build.build_operator``); RuntimeError, saying why, where it cannot be built."""
    return cpp_build.build_operator(NAME, SOURCE, "paged_decode", "C++ paged decode operator",
                             "the engine runs without it (decode_kernel=None)", verbose)


def paged_decode_cpu(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, lengths: Tensor,
                     scale: float | None = None) -> Tensor:
    """What ``labkit.paged_attention.paged_attention`` computes, without gathering, on the CPU in fp32:
    ``q`` ``[B, n_heads, d]`` attends to the first ``lengths[b]`` keys and values of sequence b,
    read from the pools ``[num_blocks, block_size, n_kv_heads, d]`` through ``block_tables``
    ``[B, max_blocks]``: only the entries a sequence reads, its first ceil(lengths[b] / block_size),
    must name blocks of the pools; the rest are never read. Builds the operator on first use (``build``)."""
    devices = {t.device.type for t in (q, k_pool, v_pool, block_tables, lengths)}
    if devices != {"cpu"}:
        raise ValueError(f"paged_decode_cpu runs on the CPU, got tensors on {sorted(devices)}: on a GPU use "
                         f"labkit.kernels.paged_decode")
    # the operator checks each length and each block it reads itself, in its loop over them:
    # reading the tensors here as well took about 7 us a call, once per layer of every engine step
    check_paged_decode(q, k_pool, v_pool, block_tables, lengths, dtypes=(torch.float32,), ranges=False)
    build()
    q, k_pool, v_pool = unit_last_stride(q, k_pool, v_pool)
    return torch.ops.labkit.paged_decode(q, k_pool, v_pool, block_tables, lengths,
                                         q.shape[-1] ** -0.5 if scale is None else scale)
