"""The fused INT4 linear layer that the rest of labkit calls: ``int4_linear(x, packed, scales, zeros,
group_size)`` is ``F.linear(x, quant.dequantize(...))`` without the dequantized weight, for a decode
step (1 to 8 rows of activations). On a CPU it runs the C++ operator
(``labkit.kernels.int4_matmul_cpu``, fp32 activations); on a CUDA GPU the Triton kernel
(``labkit.kernels.int4_matmul``, fp16, bf16 or fp32).

``why_not_int4_linear`` says whether the fused path applies to given inputs: ``None``, or the
reason it does not (too many rows, a dtype or device it has no kernel for, a layout it cannot read,
a gradient to record), so that a caller such as ``QuantLinear`` takes the fused path when it can
and dequantizes in PyTorch otherwise:

    if why_not_int4_linear(x, packed, scales, zeros, group_size) is None:
        return int4_linear(x, packed, scales, zeros, group_size, check=False)
    return F.linear(x, dequantized_weight)
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from labkit.answers import answer_to
from labkit.kernels.int4_matmul_cpu import MAX_ROWS, build
from labkit.kernels.runtime import MISSING
from labkit.validate import check_int4_matmul


@functools.cache
def _cpu_build_problem() -> str | None:
    """Why the C++ operator cannot be built or loaded here (no C++ compiler, say), or None once it is:
    tried once per process (it builds the operator, or loads its cached build)."""
    try:
        build()
    except RuntimeError as error:
        return str(error)
    return None


def _kernel_dtypes(device: torch.device) -> tuple[torch.dtype, ...] | str:
    """The activation dtypes a fused kernel takes on ``device``, or why there is none there."""
    if device.type == "cpu":
        return _cpu_build_problem() or (torch.float32,)
    if device.type != "cuda":
        return f"there is no fused INT4 kernel for {device.type} (only for the CPU and CUDA GPUs)"
    if MISSING is not None:
        return MISSING
    return (torch.float16, torch.bfloat16, torch.float32)


def why_not_int4_linear(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int
                        ) -> str | None:
    """None if ``int4_linear`` can compute this; otherwise why not, in a sentence. ``x`` ``[..., in]``,
    contiguous, with at most 8 rows in its leading dimensions; the weight as ``QuantLinear`` keeps it:
    ``packed`` uint8 ``[out, in / 2]``, fp16 ``scales`` and ``zeros`` ``[out, in / group_size]``."""
    dtypes = _kernel_dtypes(x.device)
    if isinstance(dtypes, str):
        return dtypes
    try:
        check_int4_matmul(x, packed, scales, zeros, group_size, dtypes, MAX_ROWS)
    except ValueError as problem:
        return str(problem)
    return None


@answer_to("ex06b.1", "ex06.3")  # the fused kernel whose inner loop ex06b.1 writes, and a forward for ex06.3
def int4_linear(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                check: bool = True) -> Tensor:
    """``x @ W.T`` for the INT4 weight W = (code - zero) * scale (``quant.dequantize``), never built:
    ``x`` ``[..., in]`` with at most 8 rows in all, to ``[..., out]`` in x's dtype. ValueError with
    ``why_not_int4_linear``'s reason where it does not apply; ``check=False`` skips that check, for a
    caller that has just had None from it (which has also built the C++ operator)."""
    if check and (reason := why_not_int4_linear(x, packed, scales, zeros, group_size)):
        raise ValueError(reason)
    if x.device.type == "cpu":  # built (or found not to build) by the check: _cpu_build_problem
        return torch.ops.labkit.int4_matmul(x, packed, scales, zeros, group_size)
    from labkit.kernels.int4_matmul import int4_matmul  # here: it needs Triton, which a CPU may lack
    return int4_matmul(x, packed, scales, zeros, group_size)
