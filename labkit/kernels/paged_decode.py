"""Paged attention for decoding, in Triton: one new query per sequence, keys and values read
through the block table straight from the paged cache's pools.

The reference (``labkit.paged_attention.paged_attention``) first gathers each sequence's blocks into a
contiguous ``[B, n_kv_heads, L, d]`` copy and then attends; this kernel never makes the copy.
One program serves one (sequence, KV head): the ``group`` query heads that share that KV head
(GQA) are its rows, so each key and value is read once for all of them. It walks the sequence
``TILE`` positions at a time (several blocks per step: a block of 16 is too little work to hide
the latency of reading it), looking up where each position lives,

    block = table[b, pos // block_size],   slot = pos % block_size,   key = k_pool[block, slot, kv_head, :]

and folds each tile into a running maximum, sum and output (online softmax, as in the forward
kernel), with two ``tl.dot`` products (the rows are padded to the 16 that ``tl.dot`` needs): on
tensor cores for fp16 and bf16, exact (``"ieee"``) for fp32. Positions at or past the sequence's
length are masked, so lengths in a batch vary freely and the last block may be partly filled.
"""
from __future__ import annotations

import torch
from torch import Tensor

from labkit.kernels.runtime import check_device, interpreted, tl, triton, unit_last_stride
from labkit.validate import check_paged_decode
from labkit.kernels.flash import log2_scale, padded, row_bytes


@triton.jit
def paged_decode_kernel(Q, KPool, VPool, Tables, Lengths, Out, scale_log2e,
                        stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                        stride_tb, stride_ob, stride_oh, group,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr):
    b, kv_head = tl.program_id(0), tl.program_id(1)
    members = tl.arange(0, ROWS)  # rows past `group` are padding: zero queries, never stored
    heads = kv_head * group + members  # the query heads that read this KV head
    dims = tl.arange(0, BLOCK_D)
    q_mask = (members[:, None] < group) & (dims[None, :] < HEAD_DIM)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    length = tl.load(Lengths + b)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    k_head, v_head = KPool + kv_head * stride_kh + dims[None, :], VPool + kv_head * stride_vh + dims[None, :]
    for first in range(0, length, TILE):
        positions = first + tl.arange(0, TILE)
        filled = positions < length  # the last block may be partly written
        block = tl.load(Tables + b * stride_tb + positions // BLOCK_SIZE, mask=filled, other=0).to(tl.int64)
        slot = positions % BLOCK_SIZE
        kv_mask = filled[:, None] & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_head + block[:, None] * stride_kb + slot[:, None] * stride_ks, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e  # k: [TILE, BLOCK_D]
        scores = tl.where(filled[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + block[:, None] * stride_vb + slot[:, None] * stride_vs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + dims[None, :], out.to(Out.dtype.element_ty),
             mask=q_mask)


def decode_tile(block_size: int, dim: int, dtype: torch.dtype) -> int:
    """Positions per step: 128 for fp16 rows of up to 128 elements, fewer for wider rows so that two
    pipelined stages of the K and V tiles stay within 128 KiB of shared memory; at least one block."""
    return max(block_size, min(128, 32768 // row_bytes(dim, dtype)))


def paged_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, lengths: Tensor,
                 scale: float | None = None, ranges: bool = True) -> Tensor:
    """What ``labkit.paged_attention.paged_attention`` computes, without gathering: ``q`` ``[B, n_heads, d]``
    attends to the first ``lengths[b]`` keys and values of sequence b, read from the pools
    ``[num_blocks, block_size, n_kv_heads, d]`` through ``block_tables`` ``[B, max_blocks]``.
    ``ranges=False`` skips checking the block ids and lengths, which reads them on the host: what a
    CUDA graph's recording cannot do (``labkit.paged_graphs`` fills them itself)."""
    check_paged_decode(q, k_pool, v_pool, block_tables, lengths, ranges=ranges)
    check_device(q, k_pool, v_pool, block_tables, lengths)
    (batch, heads, dim), (_, block_size, kv_heads, _) = q.shape, k_pool.shape
    if block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two for this kernel")
    q, k_pool, v_pool = unit_last_stride(q, k_pool, v_pool)
    out = torch.empty_like(q)
    group = heads // kv_heads
    paged_decode_kernel[(batch, kv_heads)](
        q, k_pool, v_pool, block_tables, lengths, out, log2_scale(scale, dim), *q.stride()[:2], *k_pool.stride()[:3],
        *v_pool.stride()[:3], block_tables.stride(0), *out.stride()[:2], group, HEAD_DIM=dim,
        BLOCK_D=padded(dim), ROWS=padded(group), BLOCK_SIZE=block_size,
        TILE=decode_tile(block_size, dim, q.dtype), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=1 if interpreted() else 4, num_stages=2)
    return out
