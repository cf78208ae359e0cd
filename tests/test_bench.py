"""labkit.bench: warm-up and repeat counts, alternation, and the statistics it reports."""
from __future__ import annotations

import os
import statistics
import time

import numpy as np
import pytest
import torch

from labkit import bench
from labkit.bench import (Comparison, Timing, alternate, compare, format_bytes, format_number, format_seconds, measure,
                          nonnegative_polyfit, peak_memory)


def test_measure_warms_up_then_times_each_repeat():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.05 if len(calls) <= 3 else 0.005)  # the warm-up calls are the slow ones
    timing = measure(fn, warmup=3, repeats=7, device="cpu", label="noop")
    assert len(calls) == 10
    assert len(timing.times_s) == 7 and all(0.005 <= t < 0.05 for t in timing.times_s), timing.times_s
    assert timing.device.startswith("cpu") and timing.label == "noop"


def test_compare_alternates_a_and_b():
    order = []
    result = compare(lambda: order.append("a"), lambda: order.append("b"), warmup=1, repeats=4, device="cpu")
    assert order == ["a", "b"] * 5
    assert len(result.a.times_s) == len(result.b.times_s) == 4
    with pytest.raises(ValueError, match="labels must differ"):
        compare(lambda: None, lambda: None, labels=("x", "x"))


def test_alternate_takes_turns_and_labels_each_timing():
    order = []
    timings = alternate({name: (lambda name=name: order.append(name)) for name in "abc"}, warmup=1, repeats=3,
                        device="cpu")
    assert order == ["a", "b", "c"] * 4
    assert list(timings) == ["a", "b", "c"]
    assert all(t.label == name and len(t.times_s) == 3 for name, t in timings.items())
    with pytest.raises(ValueError, match="at least one"):
        alternate({}, device="cpu")


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
    slow, fast = Timing("slow", "cpu", (1.5, 2.0, 9.0)), Timing("fast", "cpu", (0.25, 0.5, 0.6))
    assert Comparison(slow, fast).speedup == pytest.approx(4.0)  # of the means 9.3x, of the minima 6x
    assert "4.00x" in str(Comparison(slow, fast))


@pytest.mark.parametrize("bad", [dict(warmup=-1), dict(repeats=0)])
def test_bad_counts_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        measure(lambda: None, device="cpu", **bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU")
def test_timing_on_a_gpu_that_is_not_there_says_so():
    with pytest.raises(ValueError, match="cannot time on cuda.*no CUDA GPU"):
        measure(lambda: None, device="cuda")


def test_format_number_keeps_three_digits_or_the_whole_number_and_groups_thousands():
    assert [format_number(v) for v in (0.01234, 4.561, 78.94, 99.96, 5410.4, 1234567, -250.2)] == [
        "0.0123", "4.56", "78.9", "100", "5,410", "1,234,567", "-250"]


def test_format_bytes_takes_the_largest_unit_a_size_fills():
    assert [format_bytes(n) for n in (512, 1536, 5 * 2 ** 20 - 1, 3 * 2 ** 30, 1234 * 2 ** 30)] == [
        "512 B", "1.5 KiB", "5 MiB", "3 GiB", "1,234 GiB"]
    assert [format_bytes(n, binary=False) for n in (999, 1000, 2.5e9, 4.2e7)] == ["999 B", "1 kB", "2.5 GB", "42 MB"]


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


def test_nonnegative_polyfit_is_polyfit_when_that_is_nonnegative():
    x = np.array([16.0, 64, 128, 256, 512])
    y = 0.5 + 0.01 * x + 3e-5 * x ** 2 + np.array([0.01, -0.02, 0.015, 0.0, -0.01])
    np.testing.assert_allclose(nonnegative_polyfit(x, y, 2), np.polyfit(x, y, 2), rtol=1e-9)


@pytest.mark.parametrize("y", [[0.256, 0.378, 1.016, 1.278, 0.062],  # one noisy run of notebook 01's step latencies
                               [5.0, 4.0, 3.0, 2.0, 1.0]])
def test_nonnegative_polyfit_meets_the_optimality_conditions(y):
    """Karush-Kuhn-Tucker: the gradient of the squared error is 0 along every positive coefficient
    and >= 0 along every zero one; np.polyfit's answer here has a negative coefficient."""
    x = np.array([16.0, 128, 256, 512, 1000])
    assert np.polyfit(x, y, 2).min() < 0
    c = nonnegative_polyfit(x, y, 2)
    powers = np.vander(x, 3)
    gradient = powers.T @ (powers @ c - y) / np.abs(powers).max(axis=0)
    assert c.min() >= 0
    assert np.all(np.abs(gradient[c > 0]) < 1e-8) and np.all(gradient[c == 0] > -1e-8)
    assert np.polyval(c, np.arange(15, 1100)).min() >= 0


def test_nonnegative_polyfit_is_exact_on_a_pure_power():
    x = np.array([16.0, 128, 256, 512, 1000])  # np.polyfit leaves tiny negative terms here, which must not win
    np.testing.assert_allclose(nonnegative_polyfit(x, x ** 2, 2), [1, 0, 0], atol=1e-9)
    np.testing.assert_allclose(nonnegative_polyfit(x, 0.01 * x, 2), [0, 0.01, 0], atol=1e-12)


@pytest.mark.parametrize("x, y, degree, says", [
    ([1.0, 2.0], [1.0, 2.0], 2, "more points than the degree"),
    ([1.0, 2.0, 3.0], [1.0, 2.0], 1, "as many x as y"),
    ([1.0, 2.0, 3.0], [1.0, float("nan"), 3.0], 1, "must be finite"),
])
def test_nonnegative_polyfit_refuses_what_it_cannot_fit(x, y, degree, says):
    with pytest.raises(ValueError, match=says):
        nonnegative_polyfit(x, y, degree)


def test_a_timing_reports_its_minimum_and_warns_when_its_spread_is_large():
    steady = Timing("steady", "cpu", (1.0, 1.02, 0.98, 1.01, 0.99))
    assert not steady.noisy and steady.warning == "" and "min 980.0 ms" in str(steady) and "warning" not in str(steady)
    busy = Timing("busy", "cpu", (1.0, 1.0, 1.6, 2.4, 1.1, 3.0))  # one-sided: a busy machine only adds time
    assert busy.noisy and "median is not a reliable time" in busy.warning and "minimum" in busy.warning
    assert f"warning: {busy.warning}" in str(busy)
    assert "other programs" in busy.warning and "launches" not in busy.warning
    on_gpu = Timing("busy", "cuda:0 (NVIDIA H100 80GB HBM3)", busy.times_s)
    assert "launches the GPU's work" in on_gpu.warning and "close what you can" not in on_gpu.warning
    assert "2.00x by the minima" in str(Comparison(Timing("a", "cpu", (2.0, 4.0, 3.0)), busy))


def test_quartile_errors_match_numpy_percentiles():
    timings = [Timing("a", "cpu", (0.5, 0.1, 0.3, 0.2, 0.9, 0.4)), Timing("b", "cpu", (2.0,)), Timing("c", "cpu", (1.0, 3.0))]
    errors = bench.quartile_errors(timings, scale=1e3)
    for i, t in enumerate(timings):
        low, high = np.percentile(t.times_s, [25, 75])
        median = np.median(t.times_s)
        assert errors[:, i] == pytest.approx([(median - low) * 1e3, (high - median) * 1e3])


def test_trust_says_rerun_and_names_what_failed(capsys):
    assert bench.trust({"a cached step is no slower than a naive one": True})
    assert capsys.readouterr().out == ""
    noisy = Timing("cached", "cpu", (1.0, 1.0, 2.0, 3.0))
    assert not bench.trust({"holds": True, "a speedup no larger than the tokens per call": False}, [noisy])
    out = capsys.readouterr().out
    assert "not trustworthy: rerun" in out and "a speedup no larger than the tokens per call" in out
    assert "holds" not in out.replace("should hold", "") and "cached spread widely" in out


def test_choose_threads_keeps_the_count_whose_75th_percentile_is_lowest(monkeypatch, capsys):
    import time

    before = torch.get_num_threads()
    monkeypatch.setattr(bench, "_DEFAULT_THREADS", 4)
    try:
        best_at_two = lambda: time.sleep(0.001 + 0.003 * abs(torch.get_num_threads() - 2))
        assert bench.choose_threads(best_at_two, repeats=3, device="cpu") == 2 == torch.get_num_threads()
        assert "1 thread median" in capsys.readouterr().out
        calls = []
        steady_at_one = lambda: (calls.append(1), time.sleep(0.002 if torch.get_num_threads() == 1
                                                              else [0.0005, 0.01][len(calls) % 2]))
        assert bench.choose_threads(steady_at_one, repeats=8, device="cpu", verbose=False) == 1  # fast but erratic loses
        timings = {1: Timing("1", "cpu", (1.02, 1.02, 1.02, 1.02)), 2: Timing("2", "cpu", (1.0, 1.0, 1.0, 1.0))}
        assert bench.tied(timings) == [1, 2] and bench.steadiest(timings) == 1  # within 3%: the fewer threads win
        timings[1] = Timing("1", "cpu", (1.04, 1.04, 1.04, 1.04))
        assert bench.tied(timings) == [2] and bench.steadiest(timings) == 2
        monkeypatch.setattr(bench, "time_thread_counts", lambda *a, **k: {1: Timing("1", "cpu", (2.981e-3,) * 4),
                                                                           2: Timing("2", "cpu", (2.975e-3,) * 4)})
        assert bench.choose_threads(lambda: None, device="cpu") == 1
        said = capsys.readouterr().out
        assert "75th percentile 2.98 ms" in said and "1 and 2 threads are within 3%" in said and "a tie" in said
        monkeypatch.setattr(bench, "_DEFAULT_THREADS", 1)
        assert bench.choose_threads(lambda: None, device="cpu") == 1 and "nothing to choose" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("default, counts", [(1, [1]), (2, [1, 2]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]),
                                             (12, [1, 2, 4, 8, 12])])
def test_the_thread_counts_tried_end_at_torch_s_default(monkeypatch, default, counts):
    monkeypatch.setattr(bench, "_DEFAULT_THREADS", default)
    assert bench.thread_counts() == counts


def test_timing_thread_counts_leaves_the_count_as_it_was_even_when_the_step_fails():
    before = torch.get_num_threads()
    calls = []

    def fails_at_the_second_call():
        calls.append(torch.get_num_threads())
        if len(calls) == 2:
            raise KeyboardInterrupt  # the student pressed stop
    with pytest.raises(KeyboardInterrupt):
        bench.time_thread_counts(fails_at_the_second_call, [1, 2], device="cpu")
    assert calls == [1, 2] and torch.get_num_threads() == before


def test_not_faster_allows_noise_but_not_a_clear_win():
    base = Timing("fp32", "cpu", (1.0, 1.1, 1.2, 1.3))
    assert bench.not_faster(Timing("int4", "cpu", (1.05, 1.1, 1.15, 1.2)), base)  # overlapping: noise
    assert not bench.not_faster(Timing("int4", "cpu", (0.5, 0.55, 0.6, 0.62)), base)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc")
def test_busy_cpus_runs_its_processes_only_inside_the_block():
    def spinning() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/cmdline", "rb") as cmd:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == os.getpid() and b"getppid" in cmd.read():
                        found.append(int(pid))
            except (OSError, IndexError, ValueError):
                pass
        return found
    with bench.busy_cpus(2, max_seconds=30):
        assert len(spinning()) == 2
    assert spinning() == []
    with pytest.raises(KeyboardInterrupt), bench.busy_cpus(2, max_seconds=30):
        raise KeyboardInterrupt  # an interrupted cell leaves no spinner behind either
    assert spinning() == []
    with pytest.raises(ValueError, match="between 1 and 64"):
        with bench.busy_cpus(0):
            pass


def test_busy_cpus_starts_its_block_only_once_every_process_spins(monkeypatch):
    monkeypatch.setattr(bench, "_SPIN", "import time\ntime.sleep(0.6)" + bench._SPIN)  # slow to start
    start = time.perf_counter()
    with bench.busy_cpus(2, max_seconds=30):
        assert time.perf_counter() - start >= 0.6  # waited for them, not a fixed pause
    monkeypatch.setattr(bench, "_SPIN", "raise SystemExit(3)")  # ends without ever spinning
    with pytest.raises(RuntimeError, match="exit code 3"):
        with bench.busy_cpus(1, max_seconds=30):
            pass
    if os.name != "nt":
        monkeypatch.setattr(bench, "_SPIN", "import time\ntime.sleep(5)")  # neither spins nor ends
        monkeypatch.setattr(bench, "SPIN_START_S", 0.3)
        with pytest.raises(RuntimeError, match="did not start spinning within 0.3 s"):
            with bench.busy_cpus(2, max_seconds=30):
                pass


def test_measure_goes_on_until_its_wall_time_is_spent():
    timing = measure(lambda: time.sleep(0.01), warmup=0, repeats=2, device="cpu", min_seconds=0.2)
    assert len(timing.times_s) >= 15 and sum(timing.times_s) >= 0.15
    assert len(measure(lambda: None, warmup=0, repeats=3, device="cpu").times_s) == 3
    with pytest.raises(ValueError, match="min_seconds=-1"):
        measure(lambda: None, device="cpu", min_seconds=-1)
