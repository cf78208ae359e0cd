"""Exercises of notebook 00: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

from labkit.check import FAILED, run_cases
from labkit.exercises import get


def test_lab00_plausible_mistakes_fail():
    def without_c(m, n, k, b=2):  # the output's bytes left out: close to the answer at m = 1
        return 2 * m * n * k / (b * (m * k + k * n))
    result = run_cases(get("ex00.1"), without_c)
    assert result.status == FAILED and result.failed_case.startswith("decode step"), result.message
    assert "A (1 x k) and C (1 x n) count too" in result.message, result.message

    def max_of_the_two(intensity, peak_flops, bandwidth):  # the larger limit instead of the smaller
        return max(peak_flops, intensity * bandwidth)
    result = run_cases(get("ex00.2"), max_of_the_two)
    assert result.status == FAILED and "far below the ridge" in result.message, result.message
