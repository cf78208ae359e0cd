"""Fused INT4 dequantize-and-multiply in Triton, for decode on a GPU: ``x`` ``[rows, in]`` (fp16,
bf16 or fp32; 1 to a few rows) times a weight kept as packed 4-bit codes, read as codes and
dequantized in registers, never written out in full precision:

    y[r, o] = sum_i x[r, i] * (code[o, i] - zero[o, g(i)]) * scale[o, g(i)]        g(i) = i // group_size

One program computes ``BLOCK_N`` output features for every row (1 to 8, padded to a power of two).
It walks the input dimension ``BLOCK_K`` columns at a time: it loads the ``[BLOCK_N, BLOCK_K / 2]``
bytes of codes (the even column in each low nibble, the odd one in the high nibble) and the scale
and zero point of each code's group, dequantizes the two halves in fp32, ``(code - zero) * scale``,
multiplies them by the even and odd columns of x and sums along the tile, accumulating in fp32.
A decode step reads each weight once: 4.5 bits (g64, with its scale and zero) instead of 16.

It is a matrix-vector product, written as elementwise products and sums rather than ``tl.dot``:
at one row, tl.dot's 16-row minimum tile wastes 15/16 of its work, and moving the dequantized tile
into the tensor cores' layout costs more than the arithmetic. On an H100 this form ran several
times faster than the tl.dot one at its best launch parameters, yet slower than fp16 ``F.linear``
(BENCHMARKS.md, issue 35: ``benchmarks/int4_gpu_sweep.py``): it is bound by its load
instructions, one byte per code and a scale and a zero point per code, not by its bytes. Production
INT4 kernels read codes packed in int32 words with wide loads, load each group's scale and zero
point once, and split the input dimension across programs so that more loads are in flight.

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
def int4_matmul_kernel(X, Packed, Scales, Zeros, Out, rows, out_features, in_features, group_size,
                       HAS_ZEROS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # every tensor is contiguous: rows of in_features (x), in_features / 2 (packed), groups (scales,
    # zeros) and out_features (out)
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.arange(0, ROWS)  # rows past `rows` are padding: zero activations, never stored
    pairs = tl.arange(0, BLOCK_K // 2)  # byte j of a tile holds columns 2j (low nibble) and 2j + 1 (high)
    feature_ok, row_ok = features < out_features, row < rows
    weight_rows = features[:, None].to(tl.int64)  # int64: out * in / 2 can pass 2^31
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for first in range(0, in_features // 2, BLOCK_K // 2):
        byte = first + pairs
        byte_ok = byte < in_features // 2
        weight_ok = feature_ok[:, None] & byte_ok[None, :]
        codes = tl.load(Packed + weight_rows * (in_features // 2) + byte[None, :], mask=weight_ok, other=0)
        group = weight_rows * (in_features // group_size) + (2 * byte // group_size)[None, :]
        scale = tl.load(Scales + group, mask=weight_ok, other=0.0).to(tl.float32)
        zero = tl.load(Zeros + group, mask=weight_ok, other=0.0).to(tl.float32) if HAS_ZEROS else 8.0
        low = ((codes & 15).to(tl.float32) - zero) * scale  # [BLOCK_N, BLOCK_K / 2]: the even columns' weights
        high = ((codes >> 4).to(tl.float32) - zero) * scale  # the odd columns'
        x_ok = row_ok[:, None] & byte_ok[None, :]
        x_even = tl.load(X + row[:, None] * in_features + 2 * byte[None, :], mask=x_ok, other=0.0).to(tl.float32)
        x_odd = tl.load(X + row[:, None] * in_features + 2 * byte[None, :] + 1, mask=x_ok, other=0.0).to(tl.float32)
        acc += tl.sum(low[None, :, :] * x_even[:, None, :] + high[None, :, :] * x_odd[:, None, :], axis=2)
    tl.store(Out + row[:, None] * out_features + features[None, :], acc.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & feature_ok[None, :])


def int4_matmul(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                block_n: int | None = None, block_k: int | None = None) -> Tensor:
    """``x`` ``[..., in]`` (1 to 8 rows in all) times the INT4 weight held as ``packed`` codes
    ``[out, in / 2]`` and fp16 ``scales`` and ``zeros`` ``[out, in / group_size]`` (``zeros`` None: a
    symmetric grid, zero point 8), transposed: ``[..., out]`` in x's dtype. ``block_n`` output features
    per program and ``block_k`` inputs per step (powers of two, ``block_k`` at least 2): 4 and 512 on
    a GPU (the fastest measured on an H100), 16 and 32 in the interpreter, where every program costs time."""
    check_int4_matmul(x, packed, scales, zeros, group_size, max_rows=MAX_ROWS)
    check_device(*(t for t in (x, packed, scales, zeros) if t is not None))
    block_n = block_n or (16 if interpreted() else 4)
    block_k = block_k or (32 if interpreted() else 512)
    (out_features, _), in_features = packed.shape, x.shape[-1]
    rows = x.view(-1, in_features)
    out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
    int4_matmul_kernel[(triton.cdiv(out_features, block_n),)](
        rows, packed, scales, scales if zeros is None else zeros, out, len(rows), out_features, in_features,
        group_size, HAS_ZEROS=zeros is not None, ROWS=triton.next_power_of_2(len(rows)), BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=1 if interpreted() else 4)
    return out
