"""FlashAttention's algorithm in plain PyTorch, one tile at a time: what the Triton kernel does.

Attention softmax(q k^T / sqrt(d)) v needs, for each query row, the maximum and the sum over
all its scores before any weight is known. Online softmax gets them in one pass over tiles of
keys: keep per row a running maximum m, a running sum l of exp(s - m) and an unnormalised
output acc. For the next tile of scores s (``[rows, n]``) and values v (``[n, d]``):

    m' = max(m, max_j s_j)          alpha = exp(m - m')        p = exp(s - m')
    l' = alpha * l + sum_j p_j      acc' = alpha * acc + p v

and after the last tile the output is acc / l. Only one tile of scores exists at a time, so
memory grows with the sequence length N, not N^2. Under a causal mask a tile whose keys all
come after every query of its row tile is never computed: about half the work is skipped.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from labkit.answers import answer_to
from labkit.model import attention, causal_mask


@answer_to("ex07.1")
def online_softmax_update(m: Tensor, l: Tensor, acc: Tensor, scores: Tensor,
                          values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Fold one tile into the running state: ``m``, ``l`` ``[rows]`` and ``acc`` ``[rows, d]``
    with the tile's ``scores`` ``[rows, n]`` (scaled, -inf where masked) and ``values`` ``[n, d]``.
    Start from m = -inf, l = 0, acc = 0; the output is acc / l after the last tile."""
    m_new = torch.maximum(m, scores.amax(dim=-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, alpha * l + p.sum(dim=-1), alpha[:, None] * acc + p @ values


def _visible(rows: range, cols: range, causal: bool, offset: int) -> Tensor:
    """Which (query, key) pairs of a tile are attended: all, or, when causal, key <= query + offset."""
    if not causal:
        return torch.ones(len(rows), len(cols), dtype=torch.bool)
    return torch.arange(cols.start, cols.stop)[None, :] <= torch.arange(rows.start, rows.stop)[:, None] + offset


def tile_map(n_queries: int, n_keys: int, block_m: int, block_n: int, causal: bool) -> Tensor:
    """``[row tiles, key tiles]``: 2 where a tile is computed with every pair visible, 1 where it
    is computed with a mask (the diagonal), 0 where it is skipped. Queries are the last
    ``n_queries`` of ``n_keys`` positions, as in a prefill that follows a cached prefix."""
    offset = n_keys - n_queries
    states = torch.zeros(math.ceil(n_queries / block_m), math.ceil(n_keys / block_n), dtype=torch.long)
    for i in range(states.shape[0]):
        rows = range(i * block_m, min((i + 1) * block_m, n_queries))
        for j in range(states.shape[1]):
            visible = _visible(rows, range(j * block_n, min((j + 1) * block_n, n_keys)), causal, offset)
            states[i, j] = 2 if visible.all() else int(visible.any())
    return states


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, block_m: int = 64,
                    block_n: int = 64) -> Tensor:
    """Attention of one head, ``q`` ``[T, d]`` over ``k``, ``v`` ``[S, d]`` (T <= S when causal:
    the queries are the last T positions), a ``block_m`` x ``block_n`` tile of scores at a time."""
    (n_queries, dim), n_keys = q.shape, k.shape[0]
    if causal and n_queries > n_keys:
        raise ValueError(f"causal attention needs n_queries <= n_keys, got {n_queries} > {n_keys}")
    out = torch.empty_like(q)
    for first in range(0, n_queries, block_m):
        rows = range(first, min(first + block_m, n_queries))
        m = torch.full((len(rows),), -math.inf, dtype=q.dtype, device=q.device)
        l, acc = torch.zeros_like(m), torch.zeros(len(rows), dim, dtype=q.dtype, device=q.device)
        end = min(n_keys, rows.stop + n_keys - n_queries) if causal else n_keys  # later tiles are all masked
        for start in range(0, end, block_n):
            cols = range(start, min(start + block_n, end))
            scores = q[first:rows.stop] @ k[start:cols.stop].T / math.sqrt(dim)
            visible = _visible(rows, cols, causal, n_keys - n_queries).to(q.device)
            m, l, acc = online_softmax_update(m, l, acc, scores.masked_fill(~visible, -math.inf), v[start:cols.stop])
        out[first:rows.stop] = acc / l[:, None]
    return out


def last_positions_mask(n_queries: int, n_keys: int, device: torch.device) -> Tensor:
    """``[1, 1, T, S]``, True where a query may see a key under a causal mask when the T queries
    are the last T of the S positions (a prefill after a cached prefix, or T = S)."""
    positions = torch.arange(n_keys, device=device)[None]
    return causal_mask(positions[:, n_keys - n_queries:], positions)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
    """PyTorch's scaled_dot_product_attention (through ``labkit.model.attention``) for ``q``
    ``[B, n_heads, T, d]`` and ``k``, ``v`` ``[B, n_kv_heads, S, d]``; when causal, the queries
    are the last T positions. Computed in float32 whatever the inputs' dtype."""
    mask = last_positions_mask(q.shape[2], k.shape[2], q.device) if causal else None
    return attention(q.float(), k.float(), v.float(), mask)


def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
    """Attention as the formula reads, the whole ``[B, n_heads, T, S]`` score matrix in memory:
    what FlashAttention avoids. Shapes and causal convention as in ``reference_attention``."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~last_positions_mask(q.shape[2], k.shape[2], q.device), -math.inf)
    return torch.softmax(scores, dim=-1) @ v
