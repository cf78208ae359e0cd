"""Roofline arithmetic against hand-worked values, the probe, and the GPU presets."""
from __future__ import annotations

import pytest
import torch

from labkit import hardware
from labkit.bench import Timing
from labkit.hardware import Hardware, attainable_flops, matmul_intensity, probe
from labkit.presets import GPU_PRESETS, gpu


def test_matmul_intensity_worked_cases():
    # square n=4096 fp16: 2n^3 / (2 * 3n^2) = n/3
    assert matmul_intensity(4096, 4096, 4096, 2) == pytest.approx(4096 / 3)
    # one token through 4096x4096 fp16: 2*4096^2 / (2*(4096 + 4096^2 + 4096))
    assert matmul_intensity(1, 4096, 4096, 2) == pytest.approx(4096 ** 2 / (4096 ** 2 + 2 * 4096))


def test_weights_in_their_own_format_activations_and_output_in_theirs():
    # int4 weights, 16-bit activations and output, 300 tokens: 2*300*d^2 / (0.5 d^2 + 2*(300 d + 300 d))
    d = 4096
    assert matmul_intensity(300, d, d, 2, weight_bytes=0.5) == pytest.approx(2 * 300 * d * d / (0.5 * d * d + 1200 * d))
    assert matmul_intensity(300, d, d, 2, weight_bytes=2) == matmul_intensity(300, d, d, 2)


def test_roofline_below_at_and_above_the_ridge():
    peak, bandwidth = 100e12, 2e12  # ridge at 50 FLOP/byte
    assert attainable_flops(10, peak, bandwidth) == pytest.approx(20e12)
    assert attainable_flops(50, peak, bandwidth) == pytest.approx(peak)
    assert attainable_flops(500, peak, bandwidth) == pytest.approx(peak)
    with pytest.raises(ValueError, match="bandwidth=0"):
        attainable_flops(1, peak, 0)


def test_bytes_per_element_comes_from_the_dtype_of_the_roof():
    def with_dtype(dtype: str) -> Hardware:
        return Hardware("x", 1, 1, 1, dtype)

    assert [with_dtype(d).bytes_per_element for d in ("float32", "bfloat16", "float16", "bf16", "fp16", "fp8")] \
        == [4, 2, 2, 2, 2, 1]
    assert gpu("T4").bytes_per_element == 2
    for unknown in ("float", "int4"):
        with pytest.raises(ValueError, match="bytes per element"):
            with_dtype(unknown).bytes_per_element


def test_presets_have_the_datasheet_ridges():
    assert set(GPU_PRESETS) == {"A100-40GB", "A100-80GB", "H100-SXM", "H200", "L4", "T4", "RTX-4090"}
    assert gpu("H100-SXM").ridge_intensity == pytest.approx(989 / 3.35)
    assert gpu("H200").memory_bytes == pytest.approx(141e9)
    assert all(not hw.measured and hw.peak_flops > hw.bandwidth for hw in GPU_PRESETS.values())
    with pytest.raises(KeyError, match="choose one of"):
        gpu("V100")


def test_probe_measures_positive_rates_on_this_device():
    hw = probe(torch.device("cpu"))
    assert isinstance(hw, Hardware) and hw.measured
    assert hw.bandwidth > 1e8 and hw.peak_flops > 1e8  # anything alive beats 0.1 GB/s and 0.1 GFLOP/s
    assert hw.dtype == "float32" and hw.memory_bytes > 0
    assert hw.attainable(hw.ridge_intensity * 10) == pytest.approx(hw.peak_flops)


def test_the_probe_reports_the_fastest_run_not_the_median(monkeypatch):
    # noise only slows a run: of runs taking 1, 0.5 and 4 s the machine showed what it can do in 0.5 s
    runs = (1.0, 0.5, 4.0)
    monkeypatch.setattr(hardware, "measure", lambda fn, **kw: Timing(kw.get("label", "fn"), "cpu", runs))
    hw = probe(torch.device("cpu"))
    assert hw.bandwidth == pytest.approx(2 * (256 << 20) / 0.5)
    assert hw.peak_flops == pytest.approx(2 * 1024 ** 3 / 0.5)


def test_roofline_plot_draws_each_machine_and_labels_the_measured_one():
    import matplotlib
    matplotlib.use("Agg")
    from labkit.viz import plot_roofline

    me = Hardware("this cpu", 1e9, 20e9, 100e9, "float32", measured=True)
    fig = plot_roofline([me, gpu("H100-SXM")], points=[("decode", 1.0)])
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["this cpu (measured, float32)", "H100 SXM 80GB (datasheet, bf16)"]
    roof = ax.get_lines()[0].get_ydata()
    assert roof.max() == pytest.approx(0.1)  # 100 GFLOP/s, in TFLOP/s
    assert any("decode" in t.get_text() for t in ax.texts)


def test_roofline_dashes_a_flat_roof_that_another_already_drew():
    import matplotlib
    matplotlib.use("Agg")
    from labkit.viz import plot_roofline

    fig = plot_roofline([gpu("A100-40GB"), gpu("H100-SXM"), gpu("A100-80GB"), gpu("H200")])
    solid = [line.get_linestyle() == "-" for line in fig.axes[0].get_lines()[::2]]  # each roof, then its ridge point
    assert solid == [True, True, False, False]  # the 80GB A100 and the H200 share the roofs drawn before them


def test_roofline_labels_cover_no_ridge_point_and_no_other_label():
    import matplotlib
    matplotlib.use("Agg")
    from labkit.viz import plot_roofline

    me = Hardware("this cpu", 1e9, 20e9, 100e9, "float32", measured=True)
    gpus = [gpu("H100-SXM"), gpu("H200"), gpu("A100-80GB")]
    points = [("decode, fp32", 0.5), ("decode, bf16", 1.0), ("prefill at the H100's ridge", gpus[0].ridge_intensity),
              ("prefill, bf16", 256.0)]
    fig = plot_roofline([me, *gpus], points=points, achieved=[("measured", 5.0, 50e9)])
    fig.canvas.draw()
    ax = fig.axes[0]
    boxes = [t.get_window_extent() for t in ax.texts if t.get_text().strip() in {p[0] for p in points}]
    assert len(boxes) == len(points)
    ridges = ax.transData.transform([(hw.ridge_intensity, hw.peak_flops / 1e12) for hw in [me, *gpus]])
    for i, box in enumerate(boxes):
        assert not any(box.expanded(1.0, 1.0).contains(*ridge) for ridge in ridges), box
        assert not any(box.overlaps(other) for other in boxes[i + 1:])


def test_the_last_level_cache_is_the_largest_level_linux_reports(tmp_path, monkeypatch):
    for index, (level, size) in enumerate([("1", "48K"), ("2", "1024K"), ("3", "32M"), ("x", "9M")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(level + "\n")
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    monkeypatch.setattr(hardware, "CPU_CACHES", tmp_path)
    assert hardware.last_level_cache("cpu") == (32 << 20, "this CPU's L3 cache")  # the unreadable entry is skipped
    monkeypatch.setattr(hardware, "CPU_CACHES", tmp_path / "absent")
    size, why = hardware.last_level_cache("cpu")
    assert size is None and "does not report" in why
