"""Attention through block tables, in plain PyTorch: the reference that the paged cache runs, that
notebook 03's exercise rebuilds and that the decode kernels (``labkit.kernels``) are checked against.

A sequence's token at position p lives in slot

    slot = table[p // block_size] * block_size + p % block_size

of a layer's pool ``[num_blocks, block_size, n_kv_heads, head_dim]`` (``slot_mapping``). To attend,
``gather_kv`` copies a sequence's blocks, in table order, into one contiguous tensor, and plain
attention runs over it; a decode kernel reads the blocks in place instead. Gathered sequences are
padded to the longest in their call, so ``length_groups`` splits a step's into calls of similar length.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from labkit.answers import answer_to
from labkit.memory import blocks_for
from labkit.model import attention
from labkit.validate import check_paged_decode

# q [B, n_heads, d], k_pool, v_pool, block_tables, lengths -> [B, n_heads, d]: as paged_attention
DecodeKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@answer_to("ex03.1")
def slot_mapping(block_tables: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Cache slots ``[B, T]`` for ``positions`` ``[B, T]`` of the sequences whose block tables are
    the rows of ``block_tables`` ``[B, max_blocks]``; position -1 (padding) maps to -1."""
    clamped = positions.clamp(min=0)
    blocks = block_tables.gather(1, clamped // block_size)
    return torch.where(positions >= 0, blocks * block_size + clamped % block_size, -1)


@answer_to("ex03.4")
def gather_kv(pool: Tensor, block_tables: Tensor, length: int) -> Tensor:
    """Positions 0..length-1 of each sequence, ``[B, n_kv_heads, length, head_dim]``, read from a
    layer's pool ``[num_blocks, block_size, n_kv_heads, head_dim]`` a whole block at a time
    through the block tables ``[B, >= ceil(length / block_size)]``."""
    batch, (_, size, heads, dim) = block_tables.shape[0], pool.shape
    ids = block_tables[:, :blocks_for(length, size)].flatten()
    blocks = pool.flatten(1).index_select(0, ids)  # one row per block: far faster than pool[tables]
    return blocks.view(batch, -1, heads, dim)[:, :length].transpose(1, 2)


@answer_to("ex03.4")
def attend_blocks(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, mask: Tensor) -> Tensor:
    """Attention of ``q`` ``[B, n_heads, T, head_dim]`` over the first ``S = mask.shape[-1]`` keys
    and values of each sequence, gathered from the pools through ``block_tables``, where
    ``mask`` ``[B, 1, T, S]`` allows."""
    length = mask.shape[-1]
    return attention(q, gather_kv(k_pool, block_tables, length), gather_kv(v_pool, block_tables, length), mask)


@answer_to("ex03.4")
def paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, lengths: Tensor) -> Tensor:
    """Decode attention, one new query per sequence: ``q`` ``[B, n_heads, head_dim]`` attends
    to the first ``lengths[b]`` keys and values of sequence b, gathered from the pools
    ``[num_blocks, block_size, n_kv_heads, head_dim]`` through ``block_tables`` ``[B, max_blocks]``.
    Checked as the decode kernels check their operands (``labkit.validate.check_paged_decode``)."""
    check_paged_decode(q, k_pool, v_pool, block_tables, lengths, dtypes=(q.dtype,))
    mask = torch.arange(int(lengths.max()), device=q.device)[None] < lengths[:, None]
    return attend_blocks(q[:, :, None], k_pool, v_pool, block_tables, mask[:, None, None])[:, :, 0]


def length_groups(lengths: Sequence[int], overhead: int) -> list[list[int]]:
    """Split the indices of ``lengths`` into groups of similar length, to be attended one group
    at a time, each padded to its longest: the split, among groups of consecutive lengths in
    sorted order, that minimises the padded slots (members x longest, summed over the groups)
    plus ``overhead`` slots per group, the fixed cost of one more call. Dynamic programming
    over the sorted lengths, longest group first."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best, cut = [0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):  # the first ``end`` sorted lengths, last group ending there
        longest = lengths[order[end - 1]]
        for start in range(end):
            cost = best[start] + (end - start) * longest + overhead
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return groups
