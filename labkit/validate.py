"""Checks of what users hand labkit, made where it enters (a request, a prompt, a setting, the
operands of an attention function or kernel), with errors that name the problem. Inside, once
checked, values are trusted: a forward pass does not check again what admission checked."""
from __future__ import annotations

import argparse
import math
from numbers import Integral
from typing import Any, Callable, Sequence

import torch
from torch import Tensor


def is_int(value: object) -> bool:
    """An int, or an integer scalar of numpy's; not a bool, though Python counts it as one."""
    # a plain int first: the check of Integral, an abstract class, takes a microsecond, and the engine
    # checks a count for every running request at every step, and every token of a block it names
    return type(value) is int or (isinstance(value, Integral) and not isinstance(value, bool))


def option_in(kind: type, low: float, high: float = math.inf, above: bool = False) -> Callable[[str], Any]:
    """A command-line option's type (argparse's ``type=``): a ``kind`` (int or float) from ``low``
    (``above``: more than ``low``) to ``high``, else the option's own error, which names it (exit
    code 2), before anything starts."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if (value is None or (isinstance(value, float) and not math.isfinite(value))  # nan and inf; any int compares
                or not (low < value if above else low <= value) or not value <= high):
            where = f"more than {low}" if above else f"of at least {low}"
            where += f" and at most {high}" if high < math.inf else ""
            kind_name = "an int" if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind_name} {where}")
        return value
    return parse


def check_ints(**values: object) -> None:
    """ValueError naming the first of ``values`` that is not an int."""
    for name, value in values.items():
        if not is_int(value):
            raise ValueError(f"{name}={value!r} must be an int")


def check_counts(**values: object) -> None:
    """ValueError naming the first of ``values`` that is not an int of at least 1 (a count of things)."""
    check_ints(**values)
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")


def check_positions(positions: Tensor) -> None:
    """TypeError unless ``positions`` is a ``[batch, T]`` tensor, what a cache of rows plans a step from."""
    if not isinstance(positions, Tensor) or positions.dim() != 2:
        raise TypeError(f"plan takes the step's positions as a [batch, T] tensor, got {positions!r:.80}")


def as_token_ids(tokens: Sequence[int], vocab_size: int | None = None) -> list[int]:
    """``tokens`` as a list of ints; a ValueError naming the problem where they are not token ids
    (of a vocabulary of ``vocab_size``, if given)."""
    if isinstance(tokens, Tensor):
        raise ValueError("token ids must be a list of ints, not a tensor (tensor.tolist() makes one)")
    ids = list(tokens)
    for t in ids:
        if not is_int(t) or t < 0:
            raise ValueError(f"token ids must be non-negative ints: got {t!r}")
        if vocab_size is not None and t >= vocab_size:
            raise ValueError(f"token {t} is outside the vocabulary of {vocab_size}")
    return ids


def generation_prompts(prompts: Sequence[Sequence[int]], new_tokens: int, vocab_size: int,
                       max_seq_len: int) -> list[list[int]]:
    """``prompts`` as lists of token ids of a vocabulary of ``vocab_size``, each fitting a context of
    ``max_seq_len`` with ``new_tokens`` (at least 1) new ones: a ValueError naming the first problem,
    before a generation that runs elsewhere (in other processes) starts."""
    check_counts(new_tokens=new_tokens)
    if isinstance(prompts, Tensor):
        raise ValueError("prompts must be a list of lists of token ids, not a tensor (tensor.tolist() makes one)")
    if len(prompts) == 0:
        raise ValueError("there must be a prompt (got 0)")
    ids = [as_token_ids(prompt, vocab_size) for prompt in prompts]
    room = max_seq_len - new_tokens + 1
    if (bad := next((p for p in ids if not 1 <= len(p) <= room), None)) is not None:
        raise ValueError(f"a prompt of {len(bad)} tokens with {new_tokens} new ones does not fit: prompts "
                         f"need 1..max_seq_len - new_tokens + 1 = {room} tokens")
    return ids


def check_eos(eos_id: object, vocab_size: int) -> None:
    """ValueError unless ``eos_id`` is None (no end token) or a token id of the vocabulary: any other
    value would never equal a generated token, and generation would silently run past the end."""
    if eos_id is not None and (not is_int(eos_id) or not 0 <= eos_id < vocab_size):
        raise ValueError(f"eos_id={eos_id!r} must be a token id in 0..{vocab_size - 1} or None "
                         "(labkit.generate.eos_id_of(tokenizer) finds it)")


DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_heads_and_dtype(heads: int, kv_heads: int, *tensors: Tensor,
                          dtypes: tuple[torch.dtype, ...] = DTYPES) -> None:
    """What the attention kernels need of their operands: whole groups of query heads per KV head,
    and one dtype of ``dtypes`` for all of them."""
    if heads % kv_heads:
        raise ValueError(f"n_heads={heads} is not a multiple of n_kv_heads={kv_heads}")
    found = [t.dtype for t in tensors]
    if len(set(found)) != 1 or found[0] not in dtypes:
        raise ValueError(f"the inputs must share one dtype of {dtypes}, got {', '.join(map(str, found))}")


def check_paged_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor,
                       lengths: Tensor, dtypes: tuple[torch.dtype, ...] = DTYPES, ranges: bool = True) -> None:
    """What a paged decode kernel (Triton's, or the CPU's in C++) needs: q ``[B, n_heads, d]``,
    pools ``[num_blocks, block_size, n_kv_heads, d]``, integer ``block_tables`` ``[B, max_blocks]``
    naming blocks of the pools, and each of the ``lengths`` ``[B]`` at least 1 and within its table.
    ``ranges=False`` leaves the block ids and the lengths, which take reading the tensors, to a kernel
    that checks them itself."""
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"expected q [B, n_heads, d] and pools [num_blocks, block_size, n_kv_heads, d], got "
                         f"q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}")
    (batch, heads, dim), (num_blocks, block_size, kv_heads, pool_dim) = q.shape, k_pool.shape
    if min(heads, dim, num_blocks, block_size, kv_heads) < 1:
        raise ValueError(f"q {tuple(q.shape)} and the pools {tuple(k_pool.shape)} must have no empty dimension but B")
    if pool_dim != dim:
        raise ValueError(f"q has head dimension {dim} but the pools hold {pool_dim}")
    check_heads_and_dtype(heads, kv_heads, q, k_pool, v_pool, dtypes=dtypes)
    if batch < 1 or block_tables.dim() != 2 or block_tables.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"expected at least one sequence, block_tables [B={batch}, max_blocks] and lengths "
                         f"[{batch}], got {tuple(block_tables.shape)} and {tuple(lengths.shape)}")
    if any(t.is_floating_point() or t.is_complex() or t.dtype == torch.bool for t in (block_tables, lengths)):
        raise ValueError(f"block_tables and lengths must hold integers, got {block_tables.dtype} and {lengths.dtype}")
    if not ranges:
        return
    found = [x.long() for pair in (torch.aminmax(lengths), torch.aminmax(block_tables)) for x in pair]
    shortest, longest, first, last = torch.stack(found).tolist()  # one read: on a GPU each read waits for it
    if shortest < 1 or longest > block_tables.shape[1] * block_size:
        raise ValueError(f"every length must be in [1, {block_tables.shape[1] * block_size}] (the slots the tables "
                         f"name), got {lengths.tolist()}")
    if first < 0 or last >= num_blocks:
        raise ValueError(f"block_tables name blocks {first}..{last}, but the pools hold blocks 0..{num_blocks - 1}")


def check_int4_matmul(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                      dtypes: tuple[torch.dtype, ...] = DTYPES, max_rows: int | None = None) -> None:
    """What a fused INT4 matmul kernel (the CPU's in C++, or Triton's) needs: activations ``x``
    ``[..., in]`` of one of ``dtypes``, whose leading dimensions hold 1 to ``max_rows`` rows in all;
    ``packed`` uint8 ``[out, in / 2]``, two 4-bit codes a byte (``quant.pack_int4``); fp16 ``scales``
    and ``zeros`` ``[out, in / group_size]`` (``zeros`` None: a symmetric grid); ``group_size`` a
    multiple of 8 dividing ``in``; one device; contiguous tensors; no gradient to record. ValueError
    naming the first problem found. (It runs at every call of a layer, so it reads only shapes and flags.)"""
    weights = (packed, scales) if zeros is None else (packed, scales, zeros)
    if x.dim() < 1 or any(t.dim() != 2 for t in weights):
        raise ValueError(f"expected x [..., in], packed [out, in / 2], scales and zeros [out, groups], got x "
                         f"{tuple(x.shape)}, packed {tuple(packed.shape)}, scales {tuple(scales.shape)}")
    if x.dtype not in dtypes:
        raise ValueError(f"x is {x.dtype}; this kernel takes {', '.join(map(str, dtypes))}")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError("x requires grad, and the fused kernel has no backward: call it under torch.no_grad()")
    rows, in_features, out_features = x.shape[:-1].numel(), x.shape[-1], packed.shape[0]
    if not 1 <= rows <= (max_rows or rows):
        raise ValueError(f"x has {rows} rows; the fused kernel takes 1 to {max_rows} (decode, or a few tokens): "
                         f"dequantize and use F.linear for more")
    if packed.dtype != torch.uint8 or packed.shape[1] * 2 != in_features:
        raise ValueError(f"packed must be uint8 [out, in / 2] = [{out_features}, {in_features / 2:g}] (two 4-bit "
                         f"codes a byte), got {packed.dtype} {tuple(packed.shape)}")
    if not is_int(group_size) or group_size < 8 or group_size % 8 or in_features % group_size:
        raise ValueError(f"group_size={group_size!r} must be a multiple of 8 that divides in_features={in_features}")
    expected = (out_features, in_features // group_size)
    for name, tensor in (("scales", scales), ("zeros", zeros)):
        if tensor is not None and (tensor.dtype != torch.float16 or tensor.shape != expected):
            raise ValueError(f"{name} must be float16 [out, in / group_size] = {list(expected)}, got "
                             f"{tensor.dtype} {tuple(tensor.shape)}")
    if any(t.device != x.device for t in weights):
        raise ValueError(f"the tensors are on different devices: x on {x.device}, the weight's on "
                         f"{sorted({str(t.device) for t in weights})}")
    for name, tensor in (("x", x), ("packed", packed), ("scales", scales), ("zeros", zeros)):
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {tensor.stride()}); .contiguous() makes a copy "
                             f"that is")
