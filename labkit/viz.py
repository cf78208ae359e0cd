"""Plots shared by the notebooks. Each returns its matplotlib Figure."""
from __future__ import annotations

from typing import Iterable, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from labkit.hardware import Hardware


def plot_roofline(machines: Sequence[Hardware], points: Iterable[tuple[str, float]] = (),
                  intensity_range: tuple[float, float] = (0.1, 1e4), title: str = "Roofline") -> Figure:
    """Each machine's roofline, log-log, with its ridge point; ``points`` are (label, intensity)
    kernels drawn as vertical lines. A measured machine is drawn thick and says so."""
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)",
           ylabel="attainable TFLOP/s", title=title)
    x = np.logspace(np.log10(intensity_range[0]), np.log10(intensity_range[1]), 400)
    for hw in machines:
        y = np.minimum(hw.peak_flops, x * hw.bandwidth) / 1e12
        label = f"{hw.name} ({'measured' if hw.measured else 'datasheet'}, {hw.dtype})"
        line, = ax.plot(x, y, lw=3 if hw.measured else 1.5, label=label)
        ax.plot(hw.ridge_intensity, hw.peak_flops / 1e12, "o", color=line.get_color())
    for label, intensity in points:
        ax.axvline(intensity, color="grey", ls=":", lw=1)
        ax.text(intensity, 0.03, f" {label}", transform=ax.get_xaxis_transform(), rotation=90,
                va="bottom", ha="right", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
