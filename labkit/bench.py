"""Timing done properly, on any device.

A timing runs the callable a few times to warm up (caches, allocator, lazy init), then
``repeats`` times for real, and reports the median and the spread (interquartile range).
On a GPU each call is bracketed by CUDA events and synchronized, because kernel launches
return before the work is done; on the CPU ``time.perf_counter`` is exact enough.

``compare`` times two callables side by side, alternating A B A B, so that drift in the
machine (turbo, thermal, other processes) hits both alike; quote the ratio of medians.
``alternate`` does the same for any number of callables.

A busy machine (a browser, an editor, a video call) only ever makes a run slower, so a timing
reports its minimum beside its median, and says in plain words when its spread is too large to
trust (``Timing.warning``). ``choose_threads`` picks the CPU thread count by measuring the step a
notebook is about to time; ``trust`` checks a result against what physics allows and says "rerun"
instead of drawing a conclusion from an impossible figure. ``busy_cpus`` makes a machine busy on
purpose, to see all of this happen.

``peak_memory`` measures the most tensor memory a callable holds at once.
``nonnegative_polyfit`` fits a cost model to timings without letting noise make a cost negative.
"""
from __future__ import annotations

import itertools
import math
import os
import select
import statistics
import subprocess
import sys
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from labkit.device import device_name, get_device, synchronize
from labkit.validate import check_counts, check_ints


# a spread (IQR) above this fraction of the median is too large to read the median as "the" time:
# on a quiet machine a repeated step of these labs varies by a few percent
NOISY_SPREAD = 0.25


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
    def quartiles_s(self) -> tuple[float, float]:
        """The 25th and 75th percentiles of the repeats."""
        if len(self.times_s) < 2:
            return self.times_s[0], self.times_s[0]
        q1, _, q3 = statistics.quantiles(self.times_s, n=4, method="inclusive")
        return q1, q3

    @property
    def spread_s(self) -> float:
        """Interquartile range (75th minus 25th percentile) of the repeats."""
        q1, q3 = self.quartiles_s
        return q3 - q1

    @property
    def min_s(self) -> float:
        """The least disturbed run: other programs only ever add time, so on a busy machine the
        minimum is closer to what the code costs than the median."""
        return min(self.times_s)

    @property
    def noisy(self) -> bool:
        """Whether the spread is too large for the median to be read as the time."""
        return self.spread_s > NOISY_SPREAD * self.median_s

    @property
    def warning(self) -> str:
        """What a noisy timing means and what to do, in plain words; empty when it is steady."""
        if not self.noisy:
            return ""
        return (f"{self.label}: the spread is large (IQR {self.spread_s / self.median_s:.0%} of the median), so the "
                f"median is not a reliable time: {_disturbance(self.device)}. Rerun it; meanwhile the minimum, the "
                "least disturbed run, is the better estimate.")

    def __str__(self) -> str:
        line = (f"{self.label}: median {format_seconds(self.median_s)} (min {format_seconds(self.min_s)}, "
                f"IQR {format_seconds(self.spread_s)}, n={len(self.times_s)}) on {self.device}")
        return line + (f"\n  warning: {self.warning}" if self.noisy else "")


def _accelerated(device: str) -> bool:
    """Whether a timing's device (as ``device_name`` writes it) is a GPU: its time is launched from the CPU."""
    return device.startswith(("cuda", "mps"))


def _disturbance(device: str) -> str:
    """What most likely disturbed a timing on ``device``, in plain words."""
    if _accelerated(device):
        return ("the CPU thread that launches the GPU's work was held up (by other programs, or by Python itself), "
                "or the GPU changed its clock speed")
    return "other programs were probably using the CPU; close what you can"


@dataclass(frozen=True)
class Comparison:
    """Two timings taken alternately in one run; ``speedup`` is how many times faster b is."""

    a: Timing
    b: Timing

    @property
    def speedup(self) -> float:
        return self.a.median_s / self.b.median_s

    @property
    def speedup_of_minima(self) -> float:
        """The speedup of the least disturbed runs: the one to believe when either timing is noisy."""
        return self.a.min_s / self.b.min_s

    def __str__(self) -> str:
        return (f"{self.a}\n{self.b}\n{self.b.label} is {self.speedup:.2f}x as fast as {self.a.label} "
                f"({self.speedup_of_minima:.2f}x by the minima)")


def quartile_errors(timings: Sequence[Timing], scale: float = 1.0) -> np.ndarray:
    """Error bars from the median down to the 25th and up to the 75th percentile, shaped
    [2, len(timings)] as matplotlib's ``yerr`` takes them; ``scale`` converts seconds (1e3: ms)."""
    medians = np.array([t.median_s for t in timings])
    quartiles = np.array([t.quartiles_s for t in timings]).reshape(len(timings), 2)
    return np.stack([medians - quartiles[:, 0], quartiles[:, 1] - medians]) * scale


def not_faster(slow: Timing, fast: Timing) -> bool:
    """Whether ``slow`` is no faster than ``fast`` beyond noise (its 75th percentile is at least
    ``fast``'s 25th): the test for "A does B's work and more, so A cannot take less time"."""
    return slow.quartiles_s[1] >= fast.quartiles_s[0]


def trust(expectations: Mapping[str, bool], timings: Sequence[Timing] = ()) -> bool:
    """Check a measured result against what must hold (``{"a cached step is no slower than a naive
    one": cached <= naive}``). When something fails, say that the measurement is not
    trustworthy and should be rerun, and what failed; return whether everything held, so that a
    notebook draws its conclusion only from a result that makes physical sense."""
    failed = [claim for claim, holds in expectations.items() if not holds]
    if not failed:
        return True
    noisy = [t.label for t in timings if t.noisy]
    busy = (f" The timings of {', '.join(noisy)} spread widely: the machine was busy." if noisy else "")
    on_cpu = not any(_accelerated(t.device) for t in timings)
    print(f"WARNING: this measurement is not trustworthy: rerun it{' (close other programs first)' if on_cpu else ''}."
          + busy)
    for claim in failed:
        print(f"  should hold, but the measurement says otherwise: {claim}")
    return False


def format_number(value: float) -> str:
    """A figure as a reader expects it, thousands grouped: three significant digits below 100 (0.0123, 4.56, 78.9),
    the whole number from 100 up (5,410)."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def format_bytes(nbytes: float, binary: bool = True) -> str:
    """A size in the largest unit it fills, its figure as ``format_number`` writes it: 1536 -> '1.5 KiB',
    3 * 2**30 -> '3 GiB'; ``binary=False`` for powers of 1000, as bandwidths are quoted: 2.5e9 -> '2.5 GB'."""
    base, suffix = (1024, "iB") if binary else (1000, "B")
    for power, prefix in ((3, "G"), (2, "M"), (1, "K" if binary else "k")):
        if abs(nbytes) >= base ** power:
            return f"{format_number(nbytes / base ** power)} {prefix}{suffix}"
    return f"{format_number(nbytes)} B"


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


def _check_rounds(warmup: int, repeats: int) -> None:
    """ValueError unless ``warmup`` is an int of 0 or more and ``repeats`` one of at least 1."""
    check_ints(warmup=warmup)
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be 0 or more")
    check_counts(repeats=repeats)


def measure(fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 10, label: str = "fn",
            device: torch.device | str | None = None, min_seconds: float = 0.0) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones, and more until the timed
    calls have taken ``min_seconds`` of wall time (a disturbance of a second or so then shows)."""
    _check_rounds(warmup, repeats)
    if not 0 <= min_seconds < math.inf:
        raise ValueError(f"min_seconds={min_seconds} must be a finite number of seconds, 0 or more")
    device = torch.device(device) if device is not None else get_device()
    run_once = _timer(device)
    for _ in range(warmup):
        fn()
    times, start = [], time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_seconds:
        times.append(run_once(fn))
    return Timing(label, device_name(device), tuple(times))


def alternate(fns: dict[str, Callable[[], Any]], *, warmup: int = 2, repeats: int = 10,
              device: torch.device | str | None = None) -> dict[str, Timing]:
    """Time several callables in turn (A B C A B C ...), so that drift in the machine hits all
    alike; a timing per label."""
    _check_rounds(warmup, repeats)
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


# the threads torch would use by itself (one per core, or OMP_NUM_THREADS), before any choice
_DEFAULT_THREADS = torch.get_num_threads()


def thread_counts() -> list[int]:
    """The thread counts worth trying: 1, 2, 4 ... and torch's default (6 cores: 1, 2, 4, 6)."""
    return sorted({2 ** i for i in range(_DEFAULT_THREADS.bit_length()) if 2 ** i < _DEFAULT_THREADS}
                  | {_DEFAULT_THREADS})


def time_thread_counts(step: Callable[[], Any], counts: Sequence[int], *, repeats: int = 9,
                       device: torch.device | str | None = None) -> dict[int, Timing]:
    """Time ``step`` at each thread count, in turn (1, 2, ..., 1, 2, ...); torch's thread count is
    left as it was, even when ``step`` raises or the run is interrupted."""
    before = torch.get_num_threads()

    def at(count: int) -> Callable[[], Any]:
        def run() -> Any:
            torch.set_num_threads(count)
            return step()
        return run
    try:
        timings = alternate({str(n): at(n) for n in counts}, warmup=1, repeats=repeats, device=device)
    finally:
        torch.set_num_threads(before)
    return {n: timings[str(n)] for n in counts}


NEAR_THREADS = 0.03  # 75th percentiles this close are a tie, which the fewer threads win


def tied(timings: Mapping[int, Timing]) -> list[int]:
    """The thread counts whose 75th percentile (the time a step keeps to three runs in four, fast and
    steady at once) is the lowest or within ``NEAR_THREADS`` of it, fewest first."""
    lowest = min(timing.quartiles_s[1] for timing in timings.values())
    return sorted(n for n, timing in timings.items() if timing.quartiles_s[1] <= lowest * (1 + NEAR_THREADS))


def steadiest(timings: Mapping[int, Timing]) -> int:
    """The thread count with the lowest 75th percentile, or, where several tie (``tied``), the fewest:
    they leave more cores to everything else."""
    return tied(timings)[0]


def choose_threads(step: Callable[[], Any], *, repeats: int = 9, device: torch.device | str | None = None,
                   verbose: bool = True) -> int:
    """Measure ``step`` (a small-model decode step, say) at 1, 2, 4 ... threads and torch's default,
    alternately, and keep the steadiest count (``steadiest``). On a laptop whose cores other
    programs share, one thread is often both faster and steadier for a small model, because
    every thread must wait for the slowest at each operation; on an idle many-core machine more
    threads win. Sets torch's thread count and returns it; on a GPU it changes nothing."""
    device = torch.device(device) if device is not None else get_device()
    if device.type != "cpu":
        return torch.get_num_threads()
    counts = thread_counts()
    if len(counts) == 1:
        torch.set_num_threads(counts[0])
        if verbose:
            print(f"torch may use {counts[0]} thread here (OMP_NUM_THREADS or the core count): nothing to choose")
        return counts[0]
    timings = time_thread_counts(step, counts, repeats=repeats, device=device)
    ties = tied(timings)
    best = ties[0]  # as steadiest() chooses: the fewest of the tied counts
    torch.set_num_threads(best)
    if verbose:
        rows = "; ".join(f"{n} thread{'s' * (n > 1)} median {t.median_s * 1e3:.3g} ms, 75th percentile "
                         f"{t.quartiles_s[1] * 1e3:.3g} ms" for n, t in timings.items())
        why = ("the lowest 75th percentile" if len(ties) == 1 else
               f"{' and '.join(map(str, ties))} threads are within {NEAR_THREADS:.0%} of each other's 75th "
               "percentile: a tie, which the fewest threads win")
        print(f"CPU threads, measured on this step: {rows}. Using {best} ({why}).")
    return best


# one busy core: writes a byte to its stdout once it is about to spin (so that busy_cpus knows it
# started), then spins until its time is up or its parent is gone (a kernel killed by a restart
# leaves no spinning orphan); plain Python, so it starts at once and imports nothing of labkit's
_SPIN = """
import os, sys, time
parent, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
os.write(1, b"!")
os.close(1)
while time.monotonic() < end and os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


@contextmanager
def busy_cpus(count: int, max_seconds: float = 600.0) -> Iterator[None]:
    """Run ``count`` processes that each keep a core busy, as a browser or a video call would,
    for as long as the ``with`` block lasts (and never beyond ``max_seconds``). The block starts
    only once every process has said that it is spinning, however long a busy machine takes to
    start them."""
    if not 1 <= count <= 64:
        raise ValueError(f"count={count}: give between 1 and 64 busy processes")
    hogs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            hogs.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(os.getpid()), str(max_seconds)],
                                         stdout=subprocess.PIPE))
        for hog in hogs:
            _wait_until_spinning(hog)
        yield
    finally:
        for hog in hogs:  # all killed first: an interrupt while waiting for one leaves none spinning
            hog.kill()
        for hog in hogs:
            hog.wait()
            hog.stdout.close()


SPIN_START_S = 60.0  # the longest a busy process may take to start spinning


def _wait_until_spinning(hog: subprocess.Popen) -> None:
    """Block until the busy process ``hog`` writes its byte; RuntimeError if it ended without one, or
    (where the system can wait on a pipe with a limit: not Windows) took over ``SPIN_START_S``."""
    if os.name != "nt" and not select.select([hog.stdout], [], [], SPIN_START_S)[0]:
        raise RuntimeError(f"a busy process did not start spinning within {SPIN_START_S:g} s")
    if not hog.stdout.read(1):
        raise RuntimeError(f"a busy process ended (exit code {hog.wait()}) before it started spinning: "
                           f"check that {sys.executable} runs")


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
