"""Fused INT4 dequantize-and-multiply in Triton, for decode on a GPU: ``x`` ``[rows, in]`` (fp16,
bf16 or fp32; 1 to 8 rows) times a weight kept as packed 4-bit codes, read as codes and dequantized
in registers, never written out in full precision:

    y[r, o] = sum_i x[r, i] * (code[o, i] - zero[o, g(i)]) * scale[o, g(i)]        g(i) = i // group_size

A program computes ``BLOCK_N`` output features for every row. It walks the input dimension
``GROUPS`` whole groups at a time, as a ``[BLOCK_N, GROUPS, group_size / 2]`` tile of bytes (the
even column in each low nibble, the odd one in the high nibble). Each step loads each group's
scale and zero point once and broadcasts them, and turns codes into floats without a conversion
instruction: a code OR'd into the bits of 2^23 (fp32: ``0x4B000000``) or of 1024.0 (fp16:
``0x6400``) reads as that number plus the code. Then it multiplies, in one of two forms:

- ``gemv``, on the ordinary cores: one fp32 multiply-add per code and x, summed along each group;
  the zero point and the scale are applied once per group, as ``scale * (sum(code x) - zero sum(x))``.
- ``dot``, on the tensor cores: each weight dequantized in registers, its code's float less 1024
  (in fp32, 2^23) then ``code * scale - zero * scale`` (in fp16, ``HADD2`` and ``HFMA2`` each do
  two weights at once), then two ``tl.dot`` of ``[BLOCK_N, step]`` weights (the even columns', the
  odd columns') by x transposed, its rows padded to 16, the smallest tile a tensor core
  multiplies. At one row, 15 of those 16 columns are zeros: wasted arithmetic, which a tensor core
  has to spare; one of its instructions does a whole tile's multiply-adds. fp16 activations
  multiply in fp16; bf16 in tf32, which holds a bf16 activation exactly and keeps 10 bits of the
  weights' mantissa (bf16 has 7); fp32 in fp32 (exact, but on the ordinary cores). A step's codes
  must fit in registers: at most ``DOT_MAX_BYTES`` a thread (at the defaults, groups of up to 256
  inputs).

Which is faster is for a GPU to say. A GPU runs decode's matrix-vector product at the rate it issues
instructions as much as at the rate its memory delivers bytes (``labkit.kernels.issue``): the
``gemv`` form takes about 11 instructions per code at its defaults, the ``dot`` form about 5. But
the first ``tl.dot`` form timed on an H100 ran far slower than its instruction count alone allowed,
and the first ``gemv`` form, at 26 per code, ran at 0.62x fp16 ``F.linear`` (BENCHMARKS.md, issue
35). ``benchmarks/int4_gpu_sweep.py`` times both; ``--instructions`` counts them without a GPU.

``SPLIT_K`` programs share each feature tile, each taking every ``SPLIT_K``-th step and writing an
fp32 partial sum that ``int4_matmul`` adds up, so that a layer with few outputs still puts every
multiprocessor to work. By default the ``dot`` form, whose programs are few and large, takes
enough for two programs per multiprocessor, and ``gemv`` one a tile.

``STAGES`` is the depth of the loop's copy pipeline. At 1, a step loads its codes, scales and zero
points when it starts, and its warps wait for memory before they compute. At 2 or more, Triton's
software pipeliner copies the next ``STAGES - 1`` steps' codes, scales and zero points into shared
memory asynchronously (``cp.async``: ``LDGSTS`` in the machine code) while the present step
computes, so that more bytes are on their way from memory at once, for a few more instructions a
code and about ``STAGES - 1`` more steps' bytes of shared memory. Left to itself, Triton pipelines
the loads that feed ``tl.dot`` (the ``dot`` form's) and not the ``gemv`` form's; the loop asks for
its depth explicitly (``tl.range``), and ``DEFAULT_STAGES`` keeps each form as it was timed.

On this lab's CPUs it runs in Triton's interpreter (tests only); on a CPU, labkit uses the C++
operator ``labkit.kernels.int4_matmul_cpu``. ``labkit.kernels.int4_linear`` chooses between them.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from labkit.kernels.int4_matmul_cpu import MAX_ROWS  # one limit on both devices; prefill dequantizes
from labkit.kernels.runtime import check_device, interpreted, tl, triton
from labkit.validate import check_int4_matmul, is_int


@triton.jit
def _code_values(codes, SHIFT: tl.constexpr, MATH: tl.constexpr):
    """The 4-bit codes at bit ``SHIFT`` of ``codes`` (bytes) as values of type MATH (fp16 or fp32),
    with no conversion instruction: a code OR'd into the bits of 1024.0 (fp16) or 2^23 (fp32), read
    as a float, is that number plus the code."""
    BITS: tl.constexpr = tl.int16 if MATH == tl.float16 else tl.int32
    MAGIC: tl.constexpr = 0x6400 if MATH == tl.float16 else 0x4B000000
    BIAS: tl.constexpr = 1024.0 if MATH == tl.float16 else 8388608.0
    return (((codes.to(BITS) >> SHIFT) & 15) | MAGIC).to(MATH, bitcast=True) - BIAS


@triton.jit
def int4_gemv_kernel(X, Packed, Scales, Zeros, Out, rows, out_features, in_features,
                     HAS_ZEROS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                     PADDED: tl.constexpr, GROUPS: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr):
    # every tensor is contiguous: rows of in_features (x), in_features / 2 (packed), groups (scales,
    # zeros) and out_features (Out: [SPLIT_K, rows, out_features], fp32 partial sums if SPLIT_K > 1);
    # PADDED: a group's bytes rounded up to a power of two, as a tile's sides must be
    HALF: tl.constexpr = GROUP // 2  # bytes per group
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.arange(0, ROWS)  # rows past `rows` are padding: zero activations, never stored
    in_group = tl.arange(0, PADDED)
    feature_ok, row_ok = features < out_features, row < rows
    n_groups = in_features // GROUP
    weight_rows = features.to(tl.int64)  # int64: out * in / 2 can pass 2^31
    acc = tl.zeros([ROWS, BLOCK_N, GROUPS], tl.float32)
    for first in tl.range(tl.program_id(1) * GROUPS, n_groups, GROUPS * SPLIT_K, num_stages=STAGES):
        group = first + tl.arange(0, GROUPS)
        group_ok = group < n_groups
        byte = group[:, None] * HALF + in_group[None, :]  # [GROUPS, PADDED]: byte j holds columns 2j and 2j + 1
        byte_ok = group_ok[:, None] & (in_group < HALF)[None, :]
        ok = feature_ok[:, None] & group_ok[None, :]  # [BLOCK_N, GROUPS]
        codes = tl.load(Packed + weight_rows[:, None, None] * (in_features // 2) + byte[None, :, :],
                        mask=feature_ok[:, None, None] & byte_ok[None, :, :], other=0)
        at = weight_rows[:, None] * n_groups + group[None, :]
        scale = tl.load(Scales + at, mask=ok, other=0.0).to(tl.float32)
        zero = tl.load(Zeros + at, mask=ok, other=0.0).to(tl.float32) if HAS_ZEROS else 8.0
        low, high = _code_values(codes, 0, tl.float32), _code_values(codes, 4, tl.float32)  # even, odd columns
        for r in tl.static_range(ROWS):  # the tile is read once for every row
            pairs = X + r * in_features + 2 * byte[:, :, None] + tl.arange(0, 2)[None, None, :]
            x_even, x_odd = tl.split(tl.load(pairs, mask=byte_ok[:, :, None] & (r < rows), other=0.0).to(tl.float32))
            dots = tl.sum(low * x_even[None] + high * x_odd[None], axis=2)  # [BLOCK_N, GROUPS]: sum of code * x
            x_sums = tl.sum(x_even + x_odd, axis=1)  # [GROUPS]: each group's sum of x, shared by the features
            sums = (dots - zero * x_sums[None, :]) * scale  # sum of (code - zero) * scale * x
            acc = tl.where(row[:, None, None] == r, acc + sums[None], acc)
    out = Out + tl.program_id(1) * rows * out_features + row[:, None] * out_features + features[None, :]
    tl.store(out, tl.sum(acc, axis=2).to(Out.dtype.element_ty), mask=row_ok[:, None] & feature_ok[None, :])


@triton.jit
def int4_dot_kernel(X, Packed, Scales, Zeros, Out, rows, out_features, in_features,
                    HAS_ZEROS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                    PADDED: tl.constexpr, GROUPS: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr):
    # every tensor is contiguous: rows of in_features (x), in_features / 2 (packed), groups (scales,
    # zeros) and out_features (Out: [SPLIT_K, rows, out_features], fp32 partial sums if SPLIT_K > 1);
    # PADDED: a group's bytes rounded up to a power of two, as a tile's sides must be; ROWS >= 16
    HALF: tl.constexpr = GROUP // 2  # bytes per group
    STEP: tl.constexpr = GROUPS * PADDED  # bytes per step, padding included
    # the weights' type, in their arithmetic and in the product: fp16 for fp16 activations (tensor
    # cores); fp32 for bf16 (tensor cores in tf32, which holds a bf16 activation exactly) and for
    # fp32 (exact)
    MATH: tl.constexpr = tl.float16 if X.dtype.element_ty == tl.float16 else tl.float32
    PRECISION: tl.constexpr = "ieee" if X.dtype.element_ty == tl.float32 else "tf32"
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.arange(0, ROWS)  # rows past `rows` are padding: zero activations, never stored
    row_ok = row < rows
    n_groups = in_features // GROUP
    # the weights are read unmasked, at indices kept in bounds: a tile's features past the last, a
    # step's groups past the last and a group's padding read real codes again, and multiply zeros of x
    weight_rows = tl.minimum(features, out_features - 1).to(tl.int64)  # int64: out * in / 2 can pass 2^31
    in_group = tl.arange(0, PADDED) if PADDED == HALF else tl.minimum(tl.arange(0, PADDED), HALF - 1)
    acc = tl.zeros([BLOCK_N, ROWS], tl.float32)
    for first in tl.range(tl.program_id(1) * GROUPS, n_groups, GROUPS * SPLIT_K, num_stages=STAGES):
        group = first + tl.arange(0, GROUPS)
        at = tl.minimum(group, n_groups - 1)
        byte = at[:, None] * HALF + in_group[None, :]  # [GROUPS, PADDED]: byte j holds columns 2j and 2j + 1
        codes = tl.load(Packed + weight_rows[:, None, None] * (in_features // 2) + byte[None, :, :])
        params = weight_rows[:, None] * n_groups + at[None, :]
        scale = tl.load(Scales + params).to(tl.float32)
        zero = tl.load(Zeros + params).to(tl.float32) if HAS_ZEROS else 8.0
        scale_m, offset = scale.to(MATH)[:, :, None], (zero * scale).to(MATH)[:, :, None]
        # weight = code * scale - zero * scale: a fused multiply-add per code (HFMA2: two in fp16)
        low = tl.reshape(_code_values(codes, 0, MATH) * scale_m - offset, [BLOCK_N, STEP])
        high = tl.reshape(_code_values(codes, 4, MATH) * scale_m - offset, [BLOCK_N, STEP])
        x = X + row[None, :] * in_features + 2 * tl.reshape(byte, [STEP])[:, None]  # [STEP, ROWS]: x transposed
        x_ok = tl.reshape((group < n_groups)[:, None] & (tl.arange(0, PADDED) < HALF)[None, :], [STEP])
        x_ok = x_ok[:, None] & row_ok[None, :]
        acc = tl.dot(low, tl.load(x, mask=x_ok, other=0.0).to(MATH), acc, input_precision=PRECISION)
        acc = tl.dot(high, tl.load(x + 1, mask=x_ok, other=0.0).to(MATH), acc, input_precision=PRECISION)
    out = Out + tl.program_id(1) * rows * out_features + row[None, :] * out_features + features[:, None]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=(features < out_features)[:, None] & row_ok[None, :])


KERNELS = {"gemv": int4_gemv_kernel, "dot": int4_dot_kernel}
# the form and launch parameters on a GPU: the matrix-vector form at one of the two best of
# benchmarks/int4_gpu_sweep.py on an H100 (session 33, BENCHMARKS.md: 1.67x fp16 F.linear on a
# 4096 -> 11008 layer, 1.63x with bf16, 1.61x on 11008 -> 4096, where the form's first defaults,
# 4 features a program, made 1.20x, 1.20x, 1.16x), one program a feature tile; the tensor-core
# form's, a guess from its instruction counts and registers, with default_split_k (1.20x, 0.90x,
# 1.14x there; none of its 12 likeliest configurations reached the sweep's best 8). In the
# interpreter, where every program costs time, few large programs.
GPU_FORM = "gemv"
# features per program, inputs per step, warps
GPU_DEFAULTS = {"gemv": (16, 512, 4), "dot": (128, 128, 4)}
# stages of the loop's copy pipeline (the interpreter ignores them), each form's as timed on an H100
# (session 33): the matrix-vector form's loads feed no tl.dot, and Triton's default of 3 stages left
# its loop unpipelined; the tensor-core form's it pipelined 3 deep. Other depths are untimed:
# benchmarks/int4_gpu_sweep.py times them first.
DEFAULT_STAGES = {"gemv": 1, "dot": 3}
INTERPRETER_BLOCK_N, INTERPRETER_GROUPS = 16, 2
DOT_MIN = 16  # tl.dot's smallest tile side: features per program, and bytes per step
DOT_MAX_BYTES = 128  # bytes of codes per thread and step the tensor-core form holds in registers: more spill


class DotTileTooLarge(ValueError):
    """A step too large for the tensor-core form, which holds its dequantized weights in registers."""


class Launch(NamedTuple):
    """How the kernel runs: its form, output features per program, groups per step, programs per
    feature tile (None: ``default_split_k`` at the call), warps per program, and stages of its loop's
    copy pipeline."""
    form: str
    block_n: int
    groups: int
    split_k: int | None
    num_warps: int
    num_stages: int


def launch_parameters(group_size: int, form: str | None = None, block_n: int | None = None,
                      groups: int | None = None, split_k: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, on_gpu: bool | None = None) -> Launch:
    """The ``Launch`` for a layer of ``group_size``: the given parameters
    checked (ValueError naming the first that is not a form, not a positive integer, not a power of
    two where the kernel needs one, or outside what the tensor-core form takes), the others filled
    in with the defaults for a GPU (``on_gpu``; by default, unless Triton interprets) or for the
    interpreter. The form defaults to ``GPU_FORM``, or to "gemv" where the "dot" form cannot hold
    a step of the layer's groups (``DotTileTooLarge``); ``split_k`` stays None for the "dot" form
    on a GPU if not given: ``default_split_k`` sets it from the layer and the GPU."""
    if form is None:
        try:
            return launch_parameters(group_size, GPU_FORM, block_n, groups, split_k, num_warps, num_stages, on_gpu)
        except DotTileTooLarge:
            form = "gemv"
    if form not in KERNELS:
        raise ValueError(f"form={form!r}: the INT4 kernel comes as {' or '.join(map(repr, KERNELS))}")
    _check_integers(block_n=block_n, groups=groups, split_k=split_k, num_warps=num_warps, num_stages=num_stages)
    on_gpu = not interpreted() if on_gpu is None else on_gpu
    gpu_block_n, gpu_inputs, gpu_warps = GPU_DEFAULTS[form]
    padded = padded_group_bytes(group_size)
    default_groups = gpu_inputs // group_size if on_gpu else INTERPRETER_GROUPS
    if form == "dot":
        default_groups = max(default_groups, DOT_MIN // padded)
    block_n = int(block_n or (gpu_block_n if on_gpu else INTERPRETER_BLOCK_N))
    groups = int(groups or triton.next_power_of_2(max(1, default_groups)))
    num_warps = int(num_warps or (gpu_warps if on_gpu else 1))
    if form == "dot":
        _check_dot(block_n, groups * padded, num_warps)
    split_k = int(split_k) if split_k else (None if on_gpu and form == "dot" else 1)
    return Launch(form, block_n, groups, split_k, num_warps, int(num_stages or DEFAULT_STAGES[form]))


def padded_group_bytes(group_size: int) -> int:
    """A group's bytes in a tile (two codes a byte), rounded up to a power of two, as a tile's sides must be."""
    return triton.next_power_of_2(group_size // 2)


def _check_integers(**values: int | None) -> None:
    """ValueError naming the first of ``values`` given that is not a positive integer, or (all but
    split_k and num_stages) not a power of two."""
    for name, value in values.items():
        if value is None:
            continue  # a default
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
        if name not in ("split_k", "num_stages") and value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two (Triton's tile sides and warp counts are)")


def _check_dot(block_n: int, step_bytes: int, num_warps: int) -> None:
    """ValueError if the tensor-core form cannot take these: tiles smaller than tl.dot's, or
    (``DotTileTooLarge``) a step too large to hold in registers."""
    per_thread = block_n * step_bytes // (32 * num_warps)
    if per_thread > DOT_MAX_BYTES:
        raise DotTileTooLarge(f"{block_n} features x {step_bytes} bytes a step over {num_warps} warps are {per_thread} "
                              f"bytes of codes a thread; the 'dot' form holds them in registers and takes at most "
                              f"{DOT_MAX_BYTES} (fewer features or groups a step, or more warps; 'gemv' takes any)")
    if block_n < DOT_MIN:
        raise ValueError(f"block_n={block_n}: tl.dot multiplies tiles of at least {DOT_MIN} features")
    if step_bytes < DOT_MIN:
        raise ValueError(f"a step of {step_bytes} bytes: tl.dot needs at least {DOT_MIN}; take more groups a step")


@functools.lru_cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_split_k(out_features: int, in_features: int, group_size: int, block_n: int, groups: int,
                    device: torch.device) -> int:
    """Programs per feature tile on ``device``'s GPU: enough for two programs per multiprocessor, at
    most one per step of the loop."""
    tiles, steps = triton.cdiv(out_features, block_n), triton.cdiv(in_features // group_size, groups)
    index = torch.cuda.current_device() if device.index is None else device.index
    return max(1, min(steps, triton.cdiv(2 * _multiprocessors(index), tiles)))


def kernel_constants(form: str, rows: int, group_size: int, block_n: int, groups: int, split_k: int,
                     has_zeros: bool, num_stages: int | None = None) -> dict:
    """The compile-time arguments of ``form``'s kernel for ``rows`` rows of activations and these
    launch parameters: the rows padded to a power of two, and to 16 for tl.dot; ``num_stages`` by
    default the form's ``DEFAULT_STAGES``."""
    padded_rows = triton.next_power_of_2(rows)
    return dict(HAS_ZEROS=has_zeros, ROWS=max(DOT_MIN, padded_rows) if form == "dot" else padded_rows,
                BLOCK_N=block_n, GROUP=group_size, PADDED=padded_group_bytes(group_size), GROUPS=groups,
                SPLIT_K=split_k, STAGES=num_stages or DEFAULT_STAGES[form])


def kernel_types(dtype: str, split_k: int = 1) -> dict[str, str]:
    """The Triton types of either kernel's pointers for ``dtype`` activations ("fp16", "bf16" or
    "fp32"), to compile it for a named GPU (``runtime.compile_for_gpu``): its output is fp32 partial
    sums when ``split_k`` programs share a tile."""
    return {"X": f"*{dtype}", "Packed": "*u8", "Scales": "*fp16", "Zeros": "*fp16",
            "Out": "*fp32" if split_k > 1 else f"*{dtype}"}


def int4_matmul(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                form: str | None = None, block_n: int | None = None, groups: int | None = None,
                split_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> Tensor:
    """``x`` ``[..., in]`` (1 to 8 rows in all) times the INT4 weight held as ``packed`` codes
    ``[out, in / 2]`` and fp16 ``scales`` and ``zeros`` ``[out, in / group_size]`` (``zeros`` None: a
    symmetric grid, zero point 8), transposed: ``[..., out]`` in x's dtype. ``form``: "gemv" or
    "dot" (the module's docstring); ``block_n`` output features per program and ``groups`` groups
    per step (powers of two); ``split_k`` programs per feature tile; ``num_warps`` per program;
    ``num_stages`` of the loop's copy pipeline (``DEFAULT_STAGES``: 1, none, in the "gemv" form; 3 in "dot").
    Defaults (``launch_parameters``): on a GPU, ``GPU_FORM`` ("gemv" where a "dot" step would not
    fit in registers) at its ``GPU_DEFAULTS`` (inputs per step over the group size, rounded up to a
    power of two, are the groups), with one program a tile in the "gemv" form and
    ``default_split_k`` in the "dot" form; in the interpreter 16 features, 2 groups (in the "dot"
    form at least 16 bytes of them), one program a tile and 1 warp."""
    check_int4_matmul(x, packed, scales, zeros, group_size, max_rows=MAX_ROWS)
    check_device(*(t for t in (x, packed, scales, zeros) if t is not None))
    form, block_n, groups, split_k, num_warps, num_stages = launch_parameters(group_size, form, block_n, groups,
                                                                              split_k, num_warps, num_stages)
    (out_features, _), in_features = packed.shape, x.shape[-1]
    split_k = split_k or default_split_k(out_features, in_features, group_size, block_n, groups, x.device)
    rows = x.view(-1, in_features)
    out = torch.empty(split_k, len(rows), out_features, dtype=x.dtype if split_k == 1 else torch.float32,
                      device=x.device)
    KERNELS[form][(triton.cdiv(out_features, block_n), split_k)](
        rows, packed, scales, scales if zeros is None else zeros, out, len(rows), out_features, in_features,
        **kernel_constants(form, len(rows), group_size, block_n, groups, split_k, zeros is not None, num_stages),
        num_warps=num_warps)
    summed = out[0] if split_k == 1 else out.sum(0).to(x.dtype)
    return summed.view(*x.shape[:-1], out_features)
