"""A FlashAttention-style forward kernel in Triton.

One program computes one tile of ``BLOCK_M`` query rows of one (batch, head): it loads its
queries once, then walks over the keys and values ``BLOCK_N`` at a time, folding each tile of
scores into a running maximum, sum and output (online softmax, see ``labkit.kernels.tiled``).
The ``[T, S]`` score matrix never exists in memory: each tile lives in registers and SRAM.

- Scores are scaled by log2(e) / sqrt(d) so the kernel can use exp2, the GPU's native exponential.
- Causal: queries are the last T of S positions (a prefill after a cached prefix, or T = S);
  a program stops at the last key tile any of its queries sees, so tiles above the diagonal are
  skipped, not masked; only the tiles that cross the diagonal or the end of S pay for a mask.
  Programs take their row tiles last first, so the longest (causal) rows start earliest.
- GQA: query head h reads KV head h // (n_heads / n_kv_heads).
- Any lengths: rows past T and keys past S are masked, so neither needs to be a multiple of a
  tile; a head dimension that is not a power of two is padded to one (``BLOCK_D``) and masked.
- On a GPU, ``tl.dot`` runs on tensor cores: fp32 inputs in TF32 (a 10-bit mantissa, as
  torch's ``allow_tf32``), so fp32 results agree with PyTorch's to about 1e-3 there, and to
  float32 rounding in the interpreter.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from labkit.kernels.runtime import check_device, interpreted, tl, triton, unit_last_stride
from labkit.validate import check_heads_and_dtype

LOG2E = 1.4426950408889634


def log2_scale(scale: float | None, dim: int) -> float:
    """The score scale (1/sqrt(d) unless given) times log2(e): the kernels exponentiate with exp2."""
    return (1 / math.sqrt(dim) if scale is None else scale) * LOG2E


def padded(size: int) -> int:
    """A size (a head dimension, a number of rows) rounded up to the power of two that a block of
    it spans, at least 16: the smallest block ``tl.dot`` takes."""
    return max(16, triton.next_power_of_2(size))


def row_bytes(dim: int, dtype: torch.dtype) -> int:
    """Bytes of one row of a K or V tile: the head dimension, padded, in ``dtype``. Tile sizes are
    chosen by it, so that the tiles fit in a GPU's shared memory."""
    return torch.finfo(dtype).bits // 8 * padded(dim)


@triton.jit
def flash_attention_kernel(Q, K, V, Out, scale_log2e,
                           stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                           stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                           n_heads, group, T, S,
                           CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tile, batch_head = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)
    b, h = (batch_head // n_heads).to(tl.int64), batch_head % n_heads  # int64: b * stride can pass 2^31
    kv_head = h // group  # GQA: `group` query heads share one KV head
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + dims[None, :],
                mask=(rows[:, None] < T) & (dims[None, :] < HEAD_DIM), other=0.0)
    K += b * stride_kb + kv_head * stride_kh
    V += b * stride_vb + kv_head * stride_vh
    position = rows + S - T  # each query's position among the keys: the queries are the last T
    first_position = tile * BLOCK_M + S - T  # keys after it are in the future of some row of this tile
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running maximum of each row's scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running, unnormalised output
    end = S
    if CAUSAL:  # no query of this tile sees a key after its last row's position
        end = tl.minimum(S, (tile + 1) * BLOCK_M + S - T)
    for start in range(0, end, BLOCK_N):
        keys = start + cols
        k_t = tl.load(K + keys[None, :] * stride_kt + dims[:, None],
                      mask=(keys[None, :] < S) & (dims[:, None] < HEAD_DIM), other=0.0)  # [BLOCK_D, BLOCK_N]
        scores = tl.dot(q, k_t) * scale_log2e  # in log2 units: exp2 below is exp of the true score
        partly_masked = start + BLOCK_N > S
        if CAUSAL:
            partly_masked = partly_masked | (start + BLOCK_N - 1 > first_position)
        if partly_masked:  # only tiles on the diagonal or at the end of S pay for the mask
            visible = keys[None, :] < S
            if CAUSAL:
                visible = visible & (keys[None, :] <= position[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old maximum
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + keys[:, None] * stride_vt + dims[None, :],
                    mask=(keys[:, None] < S) & (dims[None, :] < HEAD_DIM), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_ot + dims[None, :],
             out.to(Out.dtype.element_ty), mask=(rows[:, None] < T) & (dims[None, :] < HEAD_DIM))


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected q [B, n_heads, T, d] and k, v [B, n_kv_heads, S, d], got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    (batch, heads, n_queries, dim), (kv_batch, kv_heads, n_keys, kv_dim) = q.shape, k.shape
    if kv_batch != batch or kv_dim != dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch size or head dimension")
    check_heads_and_dtype(heads, kv_heads, q, k, v)
    if min(n_queries, n_keys) < 1:
        raise ValueError(f"need at least one query and one key, got T={n_queries}, S={n_keys}")
    if causal and n_queries > n_keys:
        raise ValueError(f"causal attention takes the queries as the last T of S positions: T={n_queries} > S={n_keys}")
    if dim > 256:
        raise ValueError(f"head dimension {dim} is above the 256 this kernel holds in registers")


def tiles(dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """BLOCK_M, BLOCK_N, warps and pipeline stages. On a GPU the queries' tile and ``stages``
    tiles of K and V must fit in shared memory (227 KiB on an H100, 163 KiB on an A100), so wider
    rows (bytes per element x padded head size) take smaller tiles and fewer stages."""
    if interpreted():
        return 32, 32, 4, 1
    width = row_bytes(dim, dtype)
    if width <= 256:
        return 128, 64, 4 if dim <= 64 else 8, 3
    return (64, 32, 4, 2) if width <= 512 else (32, 32, 4, 1)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, kernel=None) -> Tensor:
    """softmax(q k^T * scale) v for ``q`` ``[B, n_heads, T, d]`` and ``k``, ``v``
    ``[B, n_kv_heads, S, d]``, the layout of ``torch.nn.functional.scaled_dot_product_attention``;
    ``scale`` defaults to 1/sqrt(d). ``kernel`` swaps in another kernel with the same
    signature as ``flash_attention_kernel`` (the notebook's exercise)."""
    _check_shapes(q, k, v, causal)
    check_device(q, k, v)
    (batch, heads, n_queries, dim), n_keys = q.shape, k.shape[2]
    default_m, default_n, warps, stages = tiles(dim, q.dtype)
    block_m, block_n = block_m or default_m, block_n or default_n
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size > 256 or size & (size - 1):
            raise ValueError(f"{name}={size} must be a power of two from 16 (the smallest tile tl.dot takes) to 256")
    q, k, v = unit_last_stride(q, k, v)
    out = torch.empty_like(q)
    grid = (triton.cdiv(n_queries, block_m), batch * heads)
    (kernel or flash_attention_kernel)[grid](
        q, k, v, out, log2_scale(scale, dim), *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        heads, heads // k.shape[1], n_queries, n_keys, CAUSAL=causal, HEAD_DIM=dim,
        BLOCK_D=padded(dim), BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages)
    return out
