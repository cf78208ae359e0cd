"""Fused INT4 dequantize-and-multiply on the CPU, in C++: the decode step's linear layers read
4-bit codes (half a byte a weight) instead of fp32 weights (four bytes), and never rebuild the
full-precision weight.

``QuantLinear`` in plain PyTorch unpacks and dequantizes every weight at every call, so that an
INT4 decode step was slower than fp32. This operator (``int4_matmul_cpu.cpp``) computes, for
activations ``x`` ``[..., in]`` (1 to 8 rows in all: decode, or a few tokens to verify),

    y[r, o] = sum_i x[r, i] * (code[o, i] - zero[o, g(i)]) * scale[o, g(i)]        g(i) = i // group_size

straight from the packed codes: two per byte, the even column in the low nibble; fp16 scales and
zero points per group (none stored for a symmetric grid: zero point 8). The output features run in
parallel on torch's threads, each one by one thread, so the result does not depend on their number.

How the inner loop is written, and why. A row of codes is read a block at a time: 16 32-bit words
of 8 codes (64 bytes, 128 inputs) with AVX-512, 8 words with AVX2. One word per vector lane:
nibble k of lane l in block b holds input 8 (16 b + l) + k. The activations are rearranged once per
call to match (for each k, the 16 inputs that nibble k multiplies), with each word's sum of inputs.
Per block, the 8 nibbles are shifted out, masked and converted to floats once, then used for
every row:

    acc += s * (sum_k code_k * x_k  -  z * sum_k x_k)          (= sum_k (code_k - z) * s * x_k)

The lane's scale s and zero point z (those of its word's group) are picked from the row's scales
by one permute instruction: with groups of 64, lanes 0-7 take one group's and 8-15 the next's.
Nothing is summed across lanes until the row ends. The code uses GCC's vector types (``float
__attribute__((vector_size(64)))``), which the compiler keeps in the widest registers the build
flags allow (``labkit.kernels.cpp_build``).

Plain loops (``#pragma omp simd``) were tried first and were 1.5 to 3 times as slow. GCC 12 widens
bytes to floats badly. It vectorises such a loop 64 bytes at a time, so a group of 64 codes (32
bytes) ran as scalar code. In 16-lane loops over arrays it kept the lanes in memory and reloaded
them at every step. And summing each group across lanes cost as much as the multiplications.
A hand-written AVX-512 version (intrinsics, not kept) was no faster than this one.

What the compiler made of it (``objdump -d`` of the built library, ``output_feature<1>``'s loop):
on this AVX-512 machine (Intel Xeon, ``torch.backends.cpu.get_cpu_capability()`` AVX512), 14
``vpsrad``, 16 ``vpandd``, 16 ``vcvtdq2ps``, 8 ``vmulps``, 10 ``vfmadd*ps`` and 4 ``vpermps``,
all on zmm registers. Built as torch would for AVX2 (``ATEN_CPU_CAPABILITY=avx2``), the same on ymm
registers; without vector extensions (``default``), SSE on xmm. All three builds give the same
results to float rounding.

BENCHMARKS.md (issue 35's section) records what it gains: ``benchmarks/quantization.py`` times a
decode step with it against fp32 and the PyTorch path, on the target and on layers larger than
the cache. Group sizes must be multiples of
8 (a word's codes share a group); ``in`` need not fill whole blocks (the last is padded with zeros).

It is compiled the first time ``build`` is called (``labkit.kernels.cpp_build``: a C++ compiler with
OpenMP, about 10 s, then cached on disk in ``build_directory``). ``-ffast-math`` lets the compiler
reassociate the sums; every value is finite. Callers use ``labkit.kernels.int4_linear``, which
chooses this operator on a CPU and ``labkit.kernels.int4_matmul`` (Triton) on a GPU.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from labkit.kernels import cpp_build
from labkit.validate import check_int4_matmul

SOURCE = Path(__file__).with_suffix(".cpp")
NAME = "labkit_int4_matmul_cpu"
MAX_ROWS = 8  # the operator's limit (MAX_ROWS in the .cpp); the Triton kernel keeps to it too


def build_directory() -> Path:
    """Where the operator is built and cached (``cpp_build.build_directory``)."""
    return cpp_build.build_directory(NAME)


def build(verbose: bool = False) -> str:
    """Compile (or load the cached build of) the operator, once per process, and say which it did
    (``cpp_build.build_operator``); RuntimeError, saying why, where it cannot be built."""
    return cpp_build.build_operator(NAME, SOURCE, "int4_matmul", "C++ INT4 matmul operator",
                             "QuantLinear runs without it", verbose)


def int4_matmul_cpu(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int) -> Tensor:
    """``x`` ``[..., in]`` (float32, 1 to 8 rows in all) times the INT4 weight held as ``packed`` codes
    ``[out, in / 2]`` and fp16 ``scales`` and ``zeros`` ``[out, in / group_size]`` (``zeros`` None: a
    symmetric grid), transposed: ``[..., out]``, float32. Builds the operator on first use (``build``)."""
    check_int4_matmul(x, packed, scales, zeros, group_size, dtypes=(torch.float32,), max_rows=MAX_ROWS)
    if x.device.type != "cpu":
        raise ValueError(f"int4_matmul_cpu runs on the CPU, got tensors on {x.device}: on a GPU use "
                         f"labkit.kernels.int4_matmul")
    build()
    return torch.ops.labkit.int4_matmul(x, packed, scales, zeros, group_size)
