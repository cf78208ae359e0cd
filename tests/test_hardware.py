"""Roofline arithmetic against hand-worked values, the probe, and the GPU presets."""
from __future__ import annotations

import pytest
import torch

from labkit.hardware import Hardware, attainable_flops, matmul_intensity, probe
from labkit.presets import GPU_PRESETS, gpu


def test_matmul_intensity_worked_cases():
    # square n=4096 fp16: 2n^3 / (2 * 3n^2) = n/3
    assert matmul_intensity(4096, 4096, 4096, 2) == pytest.approx(4096 / 3)
    # one token through 4096x4096 fp16: 2*4096^2 / (2*(4096 + 4096^2 + 4096))
    assert matmul_intensity(1, 4096, 4096, 2) == pytest.approx(4096 ** 2 / (4096 ** 2 + 2 * 4096))


def test_roofline_below_at_and_above_the_ridge():
    peak, bandwidth = 100e12, 2e12  # ridge at 50 FLOP/byte
    assert attainable_flops(10, peak, bandwidth) == pytest.approx(20e12)
    assert attainable_flops(50, peak, bandwidth) == pytest.approx(peak)
    assert attainable_flops(500, peak, bandwidth) == pytest.approx(peak)
    with pytest.raises(ValueError, match="bandwidth=0"):
        attainable_flops(1, peak, 0)


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
