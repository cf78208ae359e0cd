"""Fused INT4 dequantize-and-multiply in Triton, for decode on a GPU: ``x`` ``[rows, in]`` (fp16,
bf16 or fp32; 1 to a few rows) times a weight kept as packed 4-bit codes, read as codes and
dequantized in registers, never written out in full precision:

    y[r, o] = sum_i x[r, i] * (code[o, i] - zero[o, g(i)]) * scale[o, g(i)]        g(i) = i // group_size

One program computes ``BLOCK_N`` output features for all rows. It walks the input dimension
``BLOCK_K`` columns at a time: it loads the ``[BLOCK_N, BLOCK_K / 2]`` bytes of codes (the even
column in each low nibble, the odd one in the high nibble), the scale and zero point of each code's
group, and dequantizes the two halves, ``(code - zero) * scale`` in fp32, rounded to x's dtype
(as the PyTorch path does); then the even columns of x multiply the low halves and the odd columns
the high halves, in two ``tl.dot`` (tensor cores for fp16 and bf16; the rows are padded to the 16
that ``tl.dot`` needs). A decode step reads each weight once: 4.5 bits (g64, with its scale and
zero) instead of 16, which is what makes a memory-bound step faster.

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
                       HAS_ZEROS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr):
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
        x_even = tl.load(X + row[:, None] * in_features + 2 * byte[None, :], mask=x_ok, other=0.0)
        x_odd = tl.load(X + row[:, None] * in_features + 2 * byte[None, :] + 1, mask=x_ok, other=0.0)
        acc += tl.dot(x_even, tl.trans(low.to(x_even.dtype)), input_precision=PRECISION)
        acc += tl.dot(x_odd, tl.trans(high.to(x_odd.dtype)), input_precision=PRECISION)
    tl.store(Out + row[:, None] * out_features + features[None, :], acc.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & feature_ok[None, :])


def int4_matmul(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                block_n: int | None = None, block_k: int | None = None) -> Tensor:
    """``x`` ``[..., in]`` (1 to 8 rows in all) times the INT4 weight held as ``packed`` codes
    ``[out, in / 2]`` and fp16 ``scales`` and ``zeros`` ``[out, in / group_size]`` (``zeros`` None: a
    symmetric grid, zero point 8), transposed: ``[..., out]`` in x's dtype. ``block_n`` output features
    per program and ``block_k`` inputs per step (powers of two, at least 16 and 32): 64 and 256 on a
    GPU, 16 and 32 in the interpreter, where every program costs time."""
    check_int4_matmul(x, packed, scales, zeros, group_size, max_rows=MAX_ROWS)
    check_device(*(t for t in (x, packed, scales, zeros) if t is not None))
    block_n = block_n or (16 if interpreted() else 64)
    block_k = block_k or (32 if interpreted() else 256)
    (out_features, _), in_features = packed.shape, x.shape[-1]
    rows = x.view(-1, in_features)
    out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
    # ROWS=16: the rows padded to the smallest tile tl.dot takes, which MAX_ROWS fits
    int4_matmul_kernel[(triton.cdiv(out_features, block_n),)](
        rows, packed, scales, scales if zeros is None else zeros, out, len(rows), out_features, in_features,
        group_size, HAS_ZEROS=zeros is not None, ROWS=16, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=1 if interpreted() else 4)
    return out
