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
needs no Triton at all, nor does ``labkit.kernels.paged_decode_cpu``, the paged decode step in
C++ for the engine on a CPU (imported on its own: it builds with a C++ compiler on first use).
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


DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_heads_and_dtype(heads: int, kv_heads: int, *tensors: torch.Tensor,
                          dtypes: tuple[torch.dtype, ...] = DTYPES) -> None:
    """What the attention kernels need of their operands: whole groups of query heads per KV head,
    and one dtype of ``dtypes`` for all of them."""
    if heads % kv_heads:
        raise ValueError(f"n_heads={heads} is not a multiple of n_kv_heads={kv_heads}")
    found = [t.dtype for t in tensors]
    if len(set(found)) != 1 or found[0] not in dtypes:
        raise ValueError(f"the inputs must share one dtype of {dtypes}, got {', '.join(map(str, found))}")


def check_paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                       lengths: torch.Tensor, dtypes: tuple[torch.dtype, ...] = DTYPES, ranges: bool = True) -> None:
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


def unit_last_stride(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors, copied only where needed so that their last dimension is contiguous: the
    kernels pass every other stride but step along the head dimension by 1."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


if MISSING is None:
    from labkit.kernels.flash import flash_attention, flash_attention_kernel
    from labkit.kernels.paged_decode import paged_decode, paged_decode_kernel
else:  # pragma: no cover
    def flash_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise ImportError(MISSING)

    paged_decode = flash_attention
    flash_attention_kernel = paged_decode_kernel = None

__all__ = ["DTYPES", "MISSING", "check_device", "check_heads_and_dtype", "check_paged_decode", "flash_attention",
           "flash_attention_kernel", "interpreted", "online_softmax_update", "paged_decode", "paged_decode_kernel",
           "reference_attention", "require_triton", "tile_map", "tiled_attention", "tl", "triton", "unit_last_stride"]
