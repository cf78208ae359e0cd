"""Loads outside a kernel's tensors, caught in Triton's interpreter: what ``compute-sanitizer``'s
memcheck does on a GPU; and the lanes a mask leaves out, made as undefined as a GPU's.

A masked-out lane of ``tl.load`` reads nothing, so a mask one index too wide (``keys <= S``
for ``keys < S``) reads one element past a tensor. The values it reads are often dropped later
(a score set to -inf, a column never stored), so no output shows the slip; on a GPU it is a read
of another allocation, or an illegal memory access where the tensor ends a page. In the
interpreter every load is a NumPy array of addresses and a mask, so ``watched_loads`` can check
each address it reads against the elements of the tensors the kernel was given. A read that lands on
another element of a watched tensor (one dim past a row of a contiguous tensor is the next row's
first) is inside the tensors and not caught: padding a tensor's rows makes such a slip visible."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

from labkit.kernels.runtime import interpreted, require_triton


def _addresses(tensor: torch.Tensor) -> np.ndarray:
    """The address of every element of ``tensor`` (a view: only its own elements)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(tensor.shape, tensor.stride()):
        offsets = offsets[..., None] + torch.arange(size, dtype=torch.int64) * stride
    addresses = tensor.data_ptr() + offsets.flatten().numpy().astype(np.uint64) * np.uint64(tensor.element_size())
    return np.unique(addresses)


def _index(tensor: torch.Tensor, address: int) -> tuple[int, ...] | None:
    """The index in ``tensor``'s strides of the element at ``address`` (at or after its first), which
    may lie outside its shape (a key past S): each axis takes what its stride divides, the largest
    stride first. None for an address that is not on an element's boundary."""
    offset, remainder = divmod(address - tensor.data_ptr(), tensor.element_size())
    if remainder:
        return None
    index = [0] * tensor.dim()
    for axis in sorted(range(tensor.dim()), key=lambda a: -tensor.stride(a)):
        if tensor.stride(axis):
            index[axis], offset = divmod(offset, tensor.stride(axis))
    return tuple(index)


def _memory(tensor: torch.Tensor) -> tuple[int, int]:
    """The first and one-past-the-last address of the allocation that ``tensor`` is a view of."""
    start = tensor.untyped_storage().data_ptr()
    return start, start + tensor.untyped_storage().nbytes()


def _within(name: str, tensor: torch.Tensor, address: int) -> str:
    if address < tensor.data_ptr():
        return f"{tensor.data_ptr() - address} bytes before {name}'s first element"
    index = _index(tensor, address)
    where = f"{name}{list(index)}" if index is not None else f"{address - tensor.data_ptr()} bytes into {name}"
    return f"{where}, outside {name}'s shape {list(tensor.shape)}"


def describe(tensors: dict[str, torch.Tensor], address: int) -> str:
    """Where ``address`` lies: as an index of the tensor whose allocation holds it (the one that
    starts nearest below it, if several do), or in bytes past the allocation that ends nearest below it."""
    spans = {name: _memory(t) for name, t in tensors.items()}
    holding = {name: tensors[name] for name, (start, end) in spans.items() if start <= address < end}
    if holding:
        name, tensor = max(holding.items(), key=lambda item: (item[1].data_ptr() <= address, item[1].data_ptr()))
        return _within(name, tensor, address)
    ends = {name: end for name, (_, end) in spans.items() if end <= address}
    if not ends:
        return "an address before the memory of every tensor the kernel was given"
    name = max(ends, key=ends.get)
    return f"memory that no tensor holds, {address - ends[name]} bytes past the end of {name}'s"


def _poisoned(ptrs):
    """What a load without ``other`` gives its masked-off lanes here: NaN, or an integer type's largest
    value (bf16 is held in 16-bit unsigned integers, where that is a NaN too). On a GPU they hold whatever their
    registers held, where the interpreter would give zeros, which hide a missing ``other=0.0``."""
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype
    kind = _get_np_dtype(ptrs.get_element_ty())
    fill = np.nan if np.issubdtype(kind, np.floating) else True if kind == np.bool_ else np.iinfo(kind).max
    return TensorHandle(np.full(ptrs.data.shape, fill, dtype=kind), ptrs.get_element_ty())


@contextmanager
def watched_loads(**tensors: torch.Tensor) -> Iterator[list[str]]:
    """Within the block, check every address that an interpreted Triton kernel loads (its mask's
    true lanes) against the elements of ``tensors`` (named as the kernel's arguments). Yields a list
    that gets, per load that read outside them, how many elements it read there and the first
    (``describe``). A load without ``other`` gives its masked-off lanes NaN (``_poisoned``), as
    undefined as a GPU's. Needs the interpreter: on a GPU, run compute-sanitizer."""
    require_triton()
    if not interpreted():
        raise RuntimeError("watched_loads checks the loads of Triton's interpreter (TRITON_INTERPRET=1); "
                           "on a GPU, run the program under compute-sanitizer")
    if not tensors:
        raise ValueError("watched_loads needs the tensors a kernel may read, by name: watched_loads(X=x, ...)")
    from triton.runtime.interpreter import interpreter_builder
    allowed = np.unique(np.concatenate([_addresses(t) for t in tensors.values()]))
    strays: list[str] = []
    load = interpreter_builder.create_masked_load

    def checked(ptrs, mask, other, *args, **kwargs):
        read = ptrs.data[np.broadcast_to(mask.data.astype(bool), ptrs.data.shape)]  # a mask may hold 0/1 ints
        outside = read[~np.isin(read, allowed)]
        if outside.size:
            strays.append(f"{outside.size} element{'s' * (outside.size > 1)} outside the tensors; the first: "
                          f"{describe(tensors, int(outside[0]))}")
        return load(ptrs, mask, _poisoned(ptrs) if other is None else other, *args, **kwargs)

    patched_before = "create_masked_load" in vars(interpreter_builder)
    interpreter_builder.create_masked_load = checked
    try:
        yield strays
    finally:
        if patched_before:
            interpreter_builder.create_masked_load = load
        else:
            del interpreter_builder.create_masked_load  # the class's method again
