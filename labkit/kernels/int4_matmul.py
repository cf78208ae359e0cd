"""Fused INT4 dequantize-and-multiply in Triton, for decode on a GPU: ``x`` ``[rows, in]`` (fp16,
bf16 or fp32; 1 to 8 rows) times a weight kept as packed 4-bit codes, read as codes and dequantized
in registers, never written out in full precision:

    y[r, o] = sum_i x[r, i] * (code[o, i] - zero[o, g(i)]) * scale[o, g(i)]        g(i) = i // group_size

One program computes ``BLOCK_N`` output features for every row. It walks the input dimension
``GROUPS`` whole groups at a time, as a ``[BLOCK_N, GROUPS, group_size / 2]`` tile of bytes (the
even column in each low nibble, the odd one in the high nibble), and for each step:

- loads each group's scale and zero point once, as a ``[BLOCK_N, GROUPS]`` tile, and broadcasts them;
- turns a code into a float without a conversion instruction: ``code | 0x4B000000`` read as a
  float is exactly ``2**23 + code``, so one subtraction of ``2**23`` gives the code;
- multiplies the codes by x (loaded once per step as pairs, split into the even and odd columns)
  and sums each group's products; the zero point and the scale are applied once per group, as
  ``scale * (sum(code * x) - zero * sum(x))``, with each group's ``sum(x)`` shared by the features
  (zero points need not be whole numbers);
- keeps a ``[rows, BLOCK_N, GROUPS]`` fp32 accumulator and sums it across groups only at the end.

``SPLIT_K`` programs share each feature tile, each taking every ``SPLIT_K``-th step and writing
an fp32 partial sum that ``int4_matmul`` adds up, so that a layer with few outputs still puts
enough loads in flight on a large GPU.

It is a matrix-vector product, written as elementwise products and sums rather than ``tl.dot``:
at one row, tl.dot's 16-row minimum tile wastes 15/16 of its work. On a GPU its speed is set by
how many instructions it issues per code as much as by its bytes (``labkit.kernels.issue``).
The first matrix-vector form loaded a scale and a zero point per byte of codes, found each code's
group by integer arithmetic, converted each code with its own instruction and summed across
threads at every step; it ran 0.62x fp16 ``F.linear`` on an H100. This form issues fewer than
half as many instructions per code (BENCHMARKS.md, issue 35; ``benchmarks/int4_gpu_sweep.py
--instructions`` counts them).

On this lab's CPUs it runs in Triton's interpreter (tests only); on a CPU, labkit uses the C++
operator ``labkit.kernels.int4_matmul_cpu``. ``labkit.kernels.int4_linear`` chooses between them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from labkit.kernels.int4_matmul_cpu import MAX_ROWS  # one limit on both devices; prefill dequantizes
from labkit.kernels.runtime import check_device, interpreted, tl, triton
from labkit.validate import check_int4_matmul, is_int


@triton.jit
def int4_matmul_kernel(X, Packed, Scales, Zeros, Out, rows, out_features, in_features,
                       HAS_ZEROS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                       PADDED: tl.constexpr, GROUPS: tl.constexpr, SPLIT_K: tl.constexpr):
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
        # code | 0x4B000000, read as a float, is 2^23 + code: minus 2^23, the code, with no conversion
        low = ((codes & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # the even columns' codes
        high = ((codes >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # the odd columns'
        for r in tl.static_range(ROWS):  # the tile is read once for every row
            pairs = X + r * in_features + 2 * byte[:, :, None] + tl.arange(0, 2)[None, None, :]
            x_even, x_odd = tl.split(tl.load(pairs, mask=byte_ok[:, :, None] & (r < rows), other=0.0).to(tl.float32))
            dots = tl.sum(low * x_even[None] + high * x_odd[None], axis=2)  # [BLOCK_N, GROUPS]: sum of code * x
            x_sums = tl.sum(x_even + x_odd, axis=1)  # [GROUPS]: each group's sum of x, shared by the features
            sums = (dots - zero * x_sums[None, :]) * scale  # sum of (code - zero) * scale * x
            acc = tl.where(row[:, None, None] == r, acc + sums[None], acc)
    out = Out + tl.program_id(1) * rows * out_features + row[:, None] * out_features + features[None, :]
    tl.store(out, tl.sum(acc, axis=2).to(Out.dtype.element_ty), mask=row_ok[:, None] & feature_ok[None, :])


# launch parameters on a GPU: the best measured for the first matrix-vector form on an H100 (this
# form's best is for benchmarks/int4_gpu_sweep.py to find); in the interpreter, where every program
# costs time, few large programs
GPU_BLOCK_N, GPU_INPUTS_PER_STEP, GPU_WARPS = 4, 512, 4
INTERPRETER_BLOCK_N, INTERPRETER_GROUPS = 16, 2


def launch_parameters(group_size: int, block_n: int | None = None, groups: int | None = None, split_k: int = 1,
                      num_warps: int | None = None, on_gpu: bool | None = None) -> tuple[int, int, int, int]:
    """``(block_n, groups, split_k, num_warps)`` for a layer of ``group_size``: the given ones checked
    (ValueError naming the first that is not a positive integer, or not a power of two where the
    kernel needs one), the others filled in with the defaults for a GPU (``on_gpu``; by default,
    unless Triton interprets) or for the interpreter."""
    for name, value in (("block_n", block_n), ("groups", groups), ("split_k", split_k), ("num_warps", num_warps)):
        if value is None and name != "split_k":
            continue  # a default, below
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
        if name != "split_k" and value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two (Triton's tile sides and warp counts are)")
    on_gpu = not interpreted() if on_gpu is None else on_gpu
    default_groups = triton.next_power_of_2(max(1, GPU_INPUTS_PER_STEP // group_size)) if on_gpu else INTERPRETER_GROUPS
    return (int(block_n or (GPU_BLOCK_N if on_gpu else INTERPRETER_BLOCK_N)), int(groups or default_groups),
            int(split_k), int(num_warps or (GPU_WARPS if on_gpu else 1)))


def kernel_constants(rows: int, group_size: int, block_n: int, groups: int, split_k: int, has_zeros: bool) -> dict:
    """The kernel's compile-time arguments for ``rows`` rows of activations and these launch parameters."""
    return dict(HAS_ZEROS=has_zeros, ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n, GROUP=group_size,
                PADDED=triton.next_power_of_2(group_size // 2), GROUPS=groups, SPLIT_K=split_k)


def kernel_types(dtype: str, split_k: int = 1) -> dict[str, str]:
    """The Triton types of the kernel's pointers for ``dtype`` activations ("fp16", "bf16" or "fp32"),
    to compile it for a named GPU (``runtime.compile_for_gpu``): its output is fp32 partial sums
    when ``split_k`` programs share a tile."""
    return {"X": f"*{dtype}", "Packed": "*u8", "Scales": "*fp16", "Zeros": "*fp16",
            "Out": "*fp32" if split_k > 1 else f"*{dtype}"}


def int4_matmul(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                block_n: int | None = None, groups: int | None = None, split_k: int = 1,
                num_warps: int | None = None) -> Tensor:
    """``x`` ``[..., in]`` (1 to 8 rows in all) times the INT4 weight held as ``packed`` codes
    ``[out, in / 2]`` and fp16 ``scales`` and ``zeros`` ``[out, in / group_size]`` (``zeros`` None: a
    symmetric grid, zero point 8), transposed: ``[..., out]`` in x's dtype. ``block_n`` output features
    per program and ``groups`` groups per step (powers of two); ``split_k`` programs per feature tile;
    ``num_warps`` per program. Defaults (``launch_parameters``): on a GPU 4 features, 512 / group_size
    groups a step (rounded up to a power of two) and 4 warps; 16 features, 2 groups and 1 warp in the
    interpreter."""
    check_int4_matmul(x, packed, scales, zeros, group_size, max_rows=MAX_ROWS)
    check_device(*(t for t in (x, packed, scales, zeros) if t is not None))
    block_n, groups, split_k, num_warps = launch_parameters(group_size, block_n, groups, split_k, num_warps)
    (out_features, _), in_features = packed.shape, x.shape[-1]
    rows = x.view(-1, in_features)
    out = torch.empty(split_k, len(rows), out_features, dtype=x.dtype if split_k == 1 else torch.float32,
                      device=x.device)
    int4_matmul_kernel[(triton.cdiv(out_features, block_n), split_k)](
        rows, packed, scales, scales if zeros is None else zeros, out, len(rows), out_features, in_features,
        **kernel_constants(len(rows), group_size, block_n, groups, split_k, zeros is not None), num_warps=num_warps)
    summed = out[0] if split_k == 1 else out.sum(0).to(x.dtype)
    return summed.view(*x.shape[:-1], out_features)
