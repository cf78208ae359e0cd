"""Exercises of notebook 00: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

from exercise_cells import fails


def test_lab00_plausible_mistakes_fail():
    def without_c(m, n, k, b=2):  # the output's bytes left out: close to the answer at m = 1
        return 2 * m * n * k / (b * (m * k + k * n))
    result = fails("ex00.1", without_c, "decode step", "A (1 x k) and C (1 x n) count too")
    assert "expected 0.999512, got 0.999756" in result.message, result.message  # off in the 4th digit, as it says

    def max_of_the_two(intensity, peak_flops, bandwidth):  # the larger limit instead of the smaller
        return max(peak_flops, intensity * bandwidth)
    result = fails("ex00.2", max_of_the_two, "H100, decode (I = 1)",
                   "far below the ridge the memory system is the limit")
    assert "got 9.89e+14" in result.message, result.message  # the peak, where memory allows I x bandwidth

    def fixed_ridge(intensity, peak_flops, bandwidth):  # a T4's ridge, about 200, for every machine
        return intensity * bandwidth if intensity < 200 else peak_flops
    fails("ex00.2", fixed_ridge, "H100, a little below the ridge", "at I = peak / bandwidth for the machine given")

    def ridge_twice_as_far(intensity, peak_flops, bandwidth):  # the crossing at twice the ridge: past the peak between
        return intensity * bandwidth if intensity < 2 * peak_flops / bandwidth else peak_flops
    fails("ex00.2", ridge_twice_as_far, "H100, a little above the ridge", "the peak is the limit already")


def test_the_first_hint_says_which_way_an_answer_off_in_the_4th_digit_is_off():
    def c_twice(m, n, k, bytes_per_element=2):  # C read and written: too many bytes, just below the answer
        return 2 * m * n * k / (bytes_per_element * (m * k + k * n + 2 * m * n))
    fails("ex00.1", c_twice, "decode step", "one below it counts bytes twice")
