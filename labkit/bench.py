"""Timing done properly, on any device.

A timing runs the callable a few times to warm up (caches, allocator, lazy init), then
``repeats`` times for real, and reports the median and the spread (interquartile range).
On a GPU each call is bracketed by CUDA events and synchronized, because kernel launches
return before the work is done; on the CPU ``time.perf_counter`` is exact enough.

``compare`` times two callables side by side, alternating A B A B, so that drift in the
machine (turbo, thermal, other processes) hits both alike; quote the ratio of medians.
``alternate`` does the same for any number of callables.
``peak_memory`` measures the most tensor memory a callable holds at once.
``nonnegative_polyfit`` fits a cost model to timings without letting noise make a cost negative.
"""
from __future__ import annotations

import itertools
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from labkit.device import device_name, get_device, synchronize


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one callable, and the device they were taken on."""

    label: str
    device: str
    times_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def spread_s(self) -> float:
        """Interquartile range (75th minus 25th percentile) of the repeats."""
        if len(self.times_s) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.times_s, n=4, method="inclusive")
        return q3 - q1

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    def __str__(self) -> str:
        return (f"{self.label}: median {format_seconds(self.median_s)} "
                f"(IQR {format_seconds(self.spread_s)}, n={len(self.times_s)}) on {self.device}")


@dataclass(frozen=True)
class Comparison:
    """Two timings taken alternately in one run; ``speedup`` is how many times faster b is."""

    a: Timing
    b: Timing

    @property
    def speedup(self) -> float:
        return self.a.median_s / self.b.median_s

    def __str__(self) -> str:
        return f"{self.a}\n{self.b}\n{self.b.label} is {self.speedup:.2f}x as fast as {self.a.label}"


def format_seconds(seconds: float) -> str:
    """1.5e-05 -> '15.0 us', 0.25 -> '250.0 ms'."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds * 1e9:.0f} ns"


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """A function that runs ``fn`` once and returns its duration in seconds on ``device``."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"cannot time on {device}: torch sees no CUDA GPU here "
                         "(labkit.get_device() picks what there is)")
    if device.type == "cuda":
        def cuda_time(fn: Callable[[], Any]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return cuda_time

    def wall_time(fn: Callable[[], Any]) -> float:
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - start
    return wall_time


def _check_counts(warmup: int, repeats: int) -> None:
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be 0 or more")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")


def measure(fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 10, label: str = "fn",
            device: torch.device | str | None = None) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones."""
    _check_counts(warmup, repeats)
    device = torch.device(device) if device is not None else get_device()
    run_once = _timer(device)
    for _ in range(warmup):
        fn()
    times = tuple(run_once(fn) for _ in range(repeats))
    return Timing(label, device_name(device), times)


def alternate(fns: dict[str, Callable[[], Any]], *, warmup: int = 2, repeats: int = 10,
              device: torch.device | str | None = None) -> dict[str, Timing]:
    """Time several callables in turn (A B C A B C ...), so that drift in the machine hits all
    alike; a timing per label."""
    _check_counts(warmup, repeats)
    if not fns:
        raise ValueError("give at least one callable to time")
    device = torch.device(device) if device is not None else get_device()
    run_once = _timer(device)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {label: [] for label in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            times[label].append(run_once(fn))
    name = device_name(device)
    return {label: Timing(label, name, tuple(t)) for label, t in times.items()}


def compare(fn_a: Callable[[], Any], fn_b: Callable[[], Any], *, labels: tuple[str, str] = ("A", "B"),
            warmup: int = 2, repeats: int = 10, device: torch.device | str | None = None) -> Comparison:
    """Time two callables alternately (A B A B ...) and return both timings."""
    if labels[0] == labels[1]:
        raise ValueError(f"the two labels must differ, not both {labels[0]!r}")
    timings = alternate(dict(zip(labels, (fn_a, fn_b))), warmup=warmup, repeats=repeats, device=device)
    return Comparison(*timings.values())


class _LiveTensors(TorchDispatchMode):
    """Counts the bytes of tensors created while active, as long as they (or views of them) live."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, int] = {}  # storage address -> tensors alive that use it

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                self._track(tensor, inputs)
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key not in self.refs:
            if key in inputs or not size:  # a view of (or a write into) a tensor made before: nothing allocated
                return
            self.refs[key] = 0
            self.live += size
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(tensor, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= size


def peak_memory(fn: Callable[[], Any], device: torch.device | str | None = None) -> int:
    """The most bytes of tensor memory that ``fn()`` held at once, beyond what existed before it
    ran. On CUDA from the allocator's peak counter, after one untimed call: a first call can
    allocate what stays for good (cuBLAS's workspace, tens of MiB), which is not ``fn``'s memory.
    On the CPU by following every tensor that torch's operators create until it is freed."""
    device = torch.device(device) if device is not None else get_device()
    if device.type == "cuda":
        fn()
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    if device.type != "cpu":
        raise ValueError(f"peak_memory measures cuda or cpu, not {device.type}")
    with _LiveTensors() as live:
        fn()
    return live.peak


def nonnegative_polyfit(x: Sequence[float], y: Sequence[float], degree: int) -> np.ndarray:
    """Least-squares polynomial coefficients, highest power first as ``np.polyval`` takes them,
    none of them negative: a time that grows with x as a + b x + c x^2 has a, b, c >= 0, and
    ``np.polyfit`` on noisy timings can return a negative c and predict negative seconds.
    Fits every subset of the powers by least squares and keeps the closest fit whose
    coefficients are all >= 0 (exact, and cheap for the low degrees of a cost model)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if degree < 0 or len(x) != len(y) or len(x) <= degree:
        raise ValueError(f"a fit of degree {degree} needs a degree >= 0, as many x as y, and more points than "
                         f"the degree; got {len(x)} x and {len(y)} y")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("the points to fit must be finite: a timing is missing (nan) or infinite")
    powers = np.vander(x, degree + 1)
    scale = np.linalg.norm(powers, axis=0)  # each column scaled to norm 1, as np.polyfit does, for conditioning
    scale[scale == 0] = 1.0
    best, best_error = np.zeros(degree + 1), float(np.sum(y ** 2))
    for kept in itertools.product([False, True], repeat=degree + 1):
        coefficients = np.zeros(degree + 1)
        if any(kept):
            columns = list(kept)
            scaled = powers[:, columns] / scale[columns]
            coefficients[columns] = np.linalg.lstsq(scaled, y, rcond=None)[0] / scale[columns]
        error = float(np.sum((powers @ coefficients - y) ** 2))
        if coefficients.min() >= 0 and error < best_error:
            best, best_error = coefficients, error
    return best
