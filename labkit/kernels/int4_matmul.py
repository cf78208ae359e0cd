"""Fused INT4 dequantize-and-multiply in Triton, for decode on a GPU: ``x`` ``[rows, in]`` (fp16,
bf16 or fp32; 1 to 8 rows) times a weight kept as packed 4-bit codes, read as codes and dequantized
in registers, never written out in full precision:

    y[r, o] = sum_i x[r, i] * (code[o, i] - zero[o, g(i)]) * scale[o, g(i)]        g(i) = i // group_size

One program computes ``BLOCK_N`` output features for every row. It walks the input dimension
``GROUPS`` whole groups at a time, as a ``[BLOCK_N, GROUPS, group_size / 2]`` tile of bytes (the
even column in each low nibble, the odd one in the high nibble), and for each step:

- loads each group's scale and zero point once, as a ``[BLOCK_N, GROUPS]`` tile, and broadcasts them;
- turns a code into a float without a conversion instruction: ``code | 0x4B000000`` read as a
  float is exactly ``2**23 + code``, so one subtraction of ``2**23 + zero`` gives ``code - zero``;
- multiplies by x (loaded once per step as pairs, split into the even and odd columns) and sums
  each group's products, then multiplies the group's sum by its scale: one multiply per group,
  not per code;
- keeps a ``[rows, BLOCK_N, GROUPS]`` fp32 accumulator and sums it across groups only at the end.

``SPLIT_K`` programs share each feature tile, each taking every ``SPLIT_K``-th step and writing
an fp32 partial sum that ``int4_matmul`` adds up, so that a layer with few outputs still puts
enough loads in flight on a large GPU.

It is a matrix-vector product, written as elementwise products and sums rather than ``tl.dot``:
at one row, tl.dot's 16-row minimum tile wastes 15/16 of its work. On a GPU its speed is set by
how many instructions it issues per code as much as by its bytes (``labkit.kernels.issue``). The
first matrix-vector form loaded a scale and a zero point per code, divided to find each code's
group, converted each code with its own instruction and summed across threads at every step; it
ran 0.62x fp16 ``F.linear`` on an H100. This form issues about a third as many instructions per
code (BENCHMARKS.md, issue 35; ``benchmarks/int4_gpu_sweep.py --instructions`` counts them).

On this lab's CPUs it runs in Triton's interpreter (tests only); on a CPU, labkit uses the C++
operator ``labkit.kernels.int4_matmul_cpu``. ``labkit.kernels.int4_linear`` chooses between them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from labkit.kernels.int4_matmul_cpu import MAX_ROWS  # one limit on both devices; prefill dequantizes
from labkit.kernels.runtime import check_device, interpreted, tl, triton
from labkit.validate import check_int4_matmul


@triton.jit
def int4_matmul_kernel(X, Packed, Scales, Zeros, Out, rows, out_features, in_features,
                       HAS_ZEROS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                       GROUPS: tl.constexpr, SPLIT_K: tl.constexpr):
    # every tensor is contiguous: rows of in_features (x), in_features / 2 (packed), groups (scales,
    # zeros) and out_features (Out: [SPLIT_K, rows, out_features], fp32 partial sums if SPLIT_K > 1)
    HALF: tl.constexpr = GROUP // 2  # bytes per group
    PADDED: tl.constexpr = triton.next_power_of_2(HALF)  # a tile's sides are powers of two
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.arange(0, ROWS)  # rows past `rows` are padding: zero activations, never stored
    in_group = tl.arange(0, PADDED)
    feature_ok, row_ok = features < out_features, row < rows
    n_groups = in_features // GROUP
    weight_rows = features.to(tl.int64)  # int64: out * in / 2 can pass 2^31
    acc = tl.zeros([ROWS, BLOCK_N, GROUPS], tl.float32)
    for first in range(tl.program_id(1) * GROUPS, n_groups, GROUPS * SPLIT_K):
        group = first + tl.arange(0, GROUPS)
        group_ok = group < n_groups
        byte = group[:, None] * HALF + in_group[None, :]  # [GROUPS, PADDED]: byte j holds columns 2j and 2j + 1
        byte_ok = group_ok[:, None] & (in_group < HALF)[None, :]
        ok = feature_ok[:, None] & group_ok[None, :]  # [BLOCK_N, GROUPS]
        codes = tl.load(Packed + weight_rows[:, None, None] * (in_features // 2) + byte[None, :, :],
                        mask=feature_ok[:, None, None] & byte_ok[None, :, :], other=0).to(tl.int32)
        at = weight_rows[:, None] * n_groups + group[None, :]
        scale = tl.load(Scales + at, mask=ok, other=0.0).to(tl.float32)
        zero = tl.load(Zeros + at, mask=ok, other=0.0).to(tl.float32) if HAS_ZEROS else 8.0
        offset = (zero + 8388608.0)[:, :, None]  # 2^23 + zero, subtracted from 2^23 + code
        low = ((codes & 15) | 0x4B000000).to(tl.float32, bitcast=True) - offset  # the even columns' code - zero
        high = ((codes >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - offset  # the odd columns'
        for r in tl.static_range(ROWS):  # the tile is read once for every row
            pairs = X + r * in_features + 2 * byte[:, :, None] + tl.arange(0, 2)[None, None, :]
            x_even, x_odd = tl.split(tl.load(pairs, mask=byte_ok[:, :, None] & (r < rows), other=0.0).to(tl.float32))
            sums = tl.sum(low * x_even[None] + high * x_odd[None], axis=2) * scale  # [BLOCK_N, GROUPS]
            acc = tl.where(row[:, None, None] == r, acc + sums[None], acc)
    out = Out + tl.program_id(1) * rows * out_features + row[:, None] * out_features + features[None, :]
    tl.store(out, tl.sum(acc, axis=2).to(Out.dtype.element_ty), mask=row_ok[:, None] & feature_ok[None, :])


def int4_matmul(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                block_n: int | None = None, groups: int | None = None, split_k: int = 1,
                num_warps: int | None = None) -> Tensor:
    """``x`` ``[..., in]`` (1 to 8 rows in all) times the INT4 weight held as ``packed`` codes
    ``[out, in / 2]`` and fp16 ``scales`` and ``zeros`` ``[out, in / group_size]`` (``zeros`` None: a
    symmetric grid, zero point 8), transposed: ``[..., out]`` in x's dtype. ``block_n`` output features
    per program and ``groups`` groups per step (powers of two); ``split_k`` programs per feature tile;
    ``num_warps`` per program. GPU defaults 4, 512 inputs a step and 4 warps (the best measured for
    the first matrix-vector form on an H100; this form's best is for the sweep to find); 16, 2 and 1
    in the interpreter, where every program costs time."""
    check_int4_matmul(x, packed, scales, zeros, group_size, max_rows=MAX_ROWS)
    check_device(*(t for t in (x, packed, scales, zeros) if t is not None))
    block_n = block_n or (16 if interpreted() else 4)
    groups = groups or (2 if interpreted() else triton.next_power_of_2(max(1, 512 // group_size)))
    (out_features, _), in_features = packed.shape, x.shape[-1]
    rows = x.view(-1, in_features)
    out = torch.empty(split_k, len(rows), out_features, dtype=x.dtype if split_k == 1 else torch.float32,
                      device=x.device)
    int4_matmul_kernel[(triton.cdiv(out_features, block_n), split_k)](
        rows, packed, scales, scales if zeros is None else zeros, out, len(rows), out_features, in_features,
        HAS_ZEROS=zeros is not None, ROWS=triton.next_power_of_2(len(rows)), BLOCK_N=block_n, GROUP=group_size,
        GROUPS=groups, SPLIT_K=split_k, num_warps=num_warps or (1 if interpreted() else 4))
    summed = out[0] if split_k == 1 else out.sum(0).to(x.dtype)
    return summed.view(*x.shape[:-1], out_features)
