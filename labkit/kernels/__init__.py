"""Attention kernels in Triton: a FlashAttention-style forward pass and a paged decode step.

On a CUDA GPU the kernels compile to native code. Without one, Triton's interpreter runs them
on the CPU, one program instance after another, in NumPy: far too slow to time, but exact, which
is what the tests and the notebook need. The choice has to be made before triton is imported
(``labkit.kernels.runtime`` makes it), and ``import labkit`` imports this package (exercise 07's
cases use it), so the choice comes first.

Without triton installed the package still imports: ``MISSING`` says what is missing, and the
kernels raise it when called. ``labkit.kernels.tiled`` (the same algorithm in plain PyTorch)
needs no Triton at all, nor does ``labkit.kernels.paged_decode_cpu``, the paged decode step in
C++ for the engine on a CPU (imported on its own: it builds with a C++ compiler on first use).
``labkit.kernels.int4_linear`` (also imported on its own) is the fused INT4 linear layer for decode:
``int4_matmul_cpu`` (C++) on a CPU, ``int4_matmul`` (Triton) on a GPU. ``labkit.kernels.bounds``
checks, in the interpreter, that a kernel loads only inside the tensors it was given.
"""
from __future__ import annotations

from typing import Any

import torch

from labkit.kernels.runtime import MISSING, check_device, interpreted, require_triton, tl, triton, unit_last_stride
from labkit.kernels.tiled import online_softmax_update, reference_attention, tile_map, tiled_attention

if MISSING is None:
    from labkit.kernels.flash import flash_attention, flash_attention_kernel
    from labkit.kernels.paged_decode import paged_decode, paged_decode_kernel
else:  # pragma: no cover
    def flash_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise ImportError(MISSING)

    paged_decode = flash_attention
    flash_attention_kernel = paged_decode_kernel = None

__all__ = ["MISSING", "check_device", "flash_attention", "flash_attention_kernel", "interpreted",
           "online_softmax_update", "paged_decode", "paged_decode_kernel", "reference_attention", "require_triton",
           "tile_map", "tiled_attention", "tl", "triton", "unit_last_stride"]
