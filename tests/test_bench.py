"""labkit.bench: warm-up and repeat counts, alternation, and the statistics it reports."""
from __future__ import annotations

import statistics

import pytest

from labkit.bench import Comparison, Timing, compare, format_seconds, measure


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
