"""Attention kernels in Triton: a FlashAttention-style forward pass and a paged decode step.

On a CUDA GPU the kernels compile to native code. Without one, Triton's interpreter runs them
on the CPU, one program instance after another, in NumPy: far too slow to time, but exact, which
is what the tests and the notebook need. The choice has to be made before triton is imported
(``triton.language``'s own functions, ``tl.max`` and ``tl.sum`` among them, are defined then), so
importing this package sets ``TRITON_INTERPRET=1`` (unless it is set already) when torch sees no
CUDA GPU, and only then imports triton: the device comes from torch, not from Triton's driver.
``import labkit`` imports this package (exercise 07's cases use it), so the choice comes first.

Without triton installed the package still imports: ``MISSING`` says what is missing, and the
kernels raise it when called. ``labkit.kernels.tiled`` (the same algorithm in plain PyTorch)
needs no Triton at all.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from labkit.kernels.tiled import online_softmax_update, reference_attention, tile_map, tiled_attention

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    triton = tl = None
    MISSING: str | None = (f"Triton is not installed ({error}); install it with `pip install triton` "
                           "(Linux) to run the kernels. labkit.kernels.tiled works without it.")
else:
    MISSING = None


def interpreted() -> bool:
    """Whether Triton kernels run in the interpreter (on the CPU) rather than compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def require_triton() -> None:
    """Raise ImportError, saying what is missing, when Triton is not installed."""
    if MISSING is not None:
        raise ImportError(MISSING)


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device, and one the kernels can run on: CUDA, or the CPU under the interpreter."""
    require_triton()
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"the tensors are on different devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not interpreted():
        raise ValueError("the tensors are on the CPU but Triton is compiling for a GPU: set TRITON_INTERPRET=1 "
                         "before importing triton to run the kernels in its interpreter, or move them to cuda")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"Triton kernels run on cuda (or on the CPU in the interpreter), not {device.type}")


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
           "tile_map", "tiled_attention", "tl", "triton"]
