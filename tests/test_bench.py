"""labkit.bench: warm-up and repeat counts, alternation, and the statistics it reports."""
from __future__ import annotations

import statistics

import pytest
import torch

from labkit.bench import Comparison, Timing, compare, format_seconds, measure, peak_memory


def test_measure_warms_up_then_times_each_repeat():
    calls = []
    timing = measure(lambda: calls.append(1), warmup=3, repeats=7, device="cpu", label="noop")
    assert len(calls) == 10
    assert len(timing.times_s) == 7 and all(t >= 0 for t in timing.times_s)
    assert timing.device.startswith("cpu") and timing.label == "noop"


def test_compare_alternates_a_and_b():
    order = []
    result = compare(lambda: order.append("a"), lambda: order.append("b"), warmup=1, repeats=4, device="cpu")
    assert order == ["a", "b"] * 5
    assert len(result.a.times_s) == len(result.b.times_s) == 4


def test_statistics_match_an_independent_computation():
    times = (0.5, 0.1, 0.3, 0.2, 0.9, 0.4)
    timing = Timing("x", "cpu", times)
    assert timing.median_s == pytest.approx(0.35)
    ordered = sorted(times)
    # inclusive quartiles by linear interpolation over positions 0..n-1
    q = lambda p: ordered[int(p * 5)] + (p * 5 - int(p * 5)) * (ordered[int(p * 5) + 1] - ordered[int(p * 5)])
    assert timing.spread_s == pytest.approx(q(0.75) - q(0.25))
    assert timing.min_s == 0.1
    assert statistics.median(times) == timing.median_s


def test_speedup_is_the_ratio_of_medians():
    slow, fast = Timing("slow", "cpu", (2.0, 2.0, 2.0)), Timing("fast", "cpu", (0.5, 0.5, 0.5))
    assert Comparison(slow, fast).speedup == pytest.approx(4.0)
    assert "4.00x" in str(Comparison(slow, fast))


@pytest.mark.parametrize("bad", [dict(warmup=-1), dict(repeats=0)])
def test_bad_counts_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        measure(lambda: None, device="cpu", **bad)


def test_format_seconds():
    assert format_seconds(2.5) == "2.5 s"
    assert format_seconds(0.25) == "250.0 ms"
    assert format_seconds(1.5e-5) == "15.0 us"
    assert format_seconds(3e-8) == "30 ns"


def test_peak_memory_follows_tensors_until_they_are_freed():
    a = torch.randn(256, 256)  # made before: not counted, nor are views of it

    def two_at_once():
        x = torch.empty(1000, dtype=torch.float32)  # 4,000 bytes
        y = torch.empty(500, dtype=torch.float64)  # 4,000 bytes, while x lives: peak 8,000
        del x, y
        z = torch.empty(1500, dtype=torch.float32)  # 6,000 bytes after both were freed
        return a[:10].sum() + z.sum()
    assert peak_memory(two_at_once, "cpu") == 8000  # z and the sums come after x and y are gone
    assert peak_memory(lambda: a.T @ a, "cpu") == 256 * 256 * 4


def test_peak_memory_keeps_a_tensor_alive_through_its_views():
    def view_outlives():
        x = torch.empty(1000)
        view = x[:10]
        del x
        torch.empty(1000)  # x's storage is still held by the view: 8,000 bytes at once
        return view
    assert peak_memory(view_outlives, "cpu") == 8000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_peak_memory_on_cuda_leaves_out_what_a_first_call_keeps():
    a = torch.randn(256, 256, device="cuda")  # the first matmul of a process allocates cuBLAS's workspace
    assert peak_memory(lambda: a.T @ a, "cuda") == 256 * 256 * 4
