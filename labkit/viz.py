"""Plots shared by the notebooks. Each returns its matplotlib Figure."""
from __future__ import annotations

import html
import zlib
from collections import Counter
from typing import Hashable, Iterable, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from labkit.engine import StepRecord
from labkit.hardware import Hardware


def plot_roofline(machines: Sequence[Hardware], points: Iterable[tuple[str, float]] = (),
                  intensity_range: tuple[float, float] = (0.1, 1e4), title: str = "Roofline",
                  achieved: Iterable[tuple[str, float, float]] = ()) -> Figure:
    """Each machine's roofline, log-log, with its ridge point; ``points`` are (label, intensity)
    kernels drawn as vertical lines, labelled in a band above every roof so that no label covers
    a ridge point; ``achieved`` are (label, intensity, FLOP/s) measured kernels, drawn as stars.
    A measured machine is drawn thick and says so."""
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)",
           ylabel="attainable TFLOP/s", title=title)
    x = np.logspace(np.log10(intensity_range[0]), np.log10(intensity_range[1]), 400)
    for hw in machines:
        y = np.minimum(hw.peak_flops, x * hw.bandwidth) / 1e12
        label = f"{hw.name} ({'measured' if hw.measured else 'datasheet'}, {hw.dtype})"
        line, = ax.plot(x, y, lw=3 if hw.measured else 1.5, label=label)
        ax.plot(hw.ridge_intensity, hw.peak_flops / 1e12, "o", color=line.get_color())
    for label, intensity, flops in achieved:
        ax.plot(intensity, flops / 1e12, "*", ms=14, color="black")
        ax.annotate(label, (intensity, flops / 1e12), xytext=(10, -4), textcoords="offset points", fontsize=8,
                    bbox=dict(fc="white", ec="none", alpha=0.8))
    _label_above_the_roofs(ax, sorted(points, key=lambda point: point[1]))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the axes: points go on them
    fig.tight_layout()
    return fig


def _label_above_the_roofs(ax: Axes, points: Sequence[tuple[str, float]], row: float = 0.065) -> None:
    """Vertical lines at the points' intensities, their labels one per row in a band that the
    y axis grows by, above the highest roof: clear of every ridge point and of each other."""
    if not points:
        return
    band = row * len(points)  # the top fraction of the axes' height
    low, high = np.log10(ax.get_ylim())
    ax.set_ylim(10 ** low, 10 ** (low + (high - low) / (1 - band)))
    left, right = np.log10(ax.get_xlim())
    for i, (label, intensity) in enumerate(points):
        ax.axvline(intensity, color="grey", ls=":", lw=1)
        on_the_right = (np.log10(intensity) - left) / (right - left) > 0.5  # the text runs towards the middle
        ax.text(intensity, 1 - band + (i + 0.5) * row, f" {label} ", transform=ax.get_xaxis_transform(),
                va="center", ha="right" if on_the_right else "left", fontsize=8,
                bbox=dict(fc="white", ec="none", alpha=0.8, pad=1))


PALETTE = [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i not in (14, 15)]  # greys mean cached or idle


def colour_of(seq: Hashable) -> tuple[float, ...]:
    """A sequence's colour, the same in every picture of a run."""
    return PALETTE[zlib.crc32(str(seq).encode()) % len(PALETTE)]


def plot_block_pool(tables: Mapping[Hashable, Sequence[int]], states: Sequence[str], columns: int = 16,
                    title: str = "", ax: Axes | None = None) -> Figure:
    """A paged cache's pool as a grid, one square per block: coloured by the sequence that holds
    it (hatched, with its count, when several share it), grey when free but still caching a
    prefix (revivable), white when free."""
    rows = -(-len(states) // columns)
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(10, 0.7 * rows + 1))
    owner: dict[int, Hashable] = {}
    for seq, table in tables.items():
        for block in table:
            owner.setdefault(block, seq)  # a shared block takes its first owner's colour
    shared = Counter(block for table in tables.values() for block in table)
    for block, state in enumerate(states):
        row, col = divmod(block, columns)
        color = {"free": "white", "cached": "0.8"}.get(state) or colour_of(owner.get(block))
        ax.add_patch(Rectangle((col, -row), 0.92, 0.92, facecolor=color, edgecolor="0.3",
                               hatch="///" if state == "shared" else None))
        label = f"{block}\n×{shared[block]}" if state == "shared" else str(block)
        ax.text(col + 0.46, -row + 0.46, label, ha="center", va="center", fontsize=7)
    handles = [Patch(facecolor=colour_of(seq), edgecolor="0.3", label=str(seq)) for seq in tables]
    for state, style, label in [("shared", dict(facecolor="white", hatch="///"), "shared (×holders)"),
                                ("cached", dict(facecolor="0.8"), "cached (free)")]:
        if state in states:  # only what this picture shows
            handles.append(Patch(edgecolor="0.3", label=label, **style))
    ax.set(xlim=(-0.1, columns), ylim=(-rows + 0.9, 1), aspect="equal", title=title)
    ax.axis("off")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return fig


def batch_slots(log: Sequence[StepRecord]) -> list[list[tuple[int, Hashable, int, str]]]:
    """Per step, (slot, request id, tokens, kind) for each request in the batch: a request keeps
    the lowest slot free when it first runs until it last runs or is preempted."""
    last = {rid: i for i, step in enumerate(log) for rid, _, _ in step.batch}
    slots: dict[Hashable, int] = {}
    steps = []
    for i, step in enumerate(log):
        for rid in step.preempted:
            slots.pop(rid, None)
        for rid, _, _ in step.batch:
            if rid not in slots:
                slots[rid] = min(set(range(len(slots) + 1)) - set(slots.values()))
        steps.append([(slots[rid], rid, n, kind) for rid, n, kind in step.batch])
        for rid, _, _ in step.batch:
            if last[rid] == i:
                del slots[rid]
    return steps


def plot_batch_timeline(log: Sequence[StepRecord], title: str = "", ax: Axes | None = None) -> Figure:
    """A serving run over time: one row per batch slot, a bar per request per step, coloured by
    request; hatched while prefilling, grey while idle (a static batch's finished rows waiting
    for its longest), a black x where a request was preempted."""
    own = ax is None
    fig, ax = plt.subplots(figsize=(10, 3.5)) if own else (ax.figure, ax)
    bars: dict[str, list[tuple[int, float, float, tuple]]] = {"decode": [], "prefill": [], "idle": []}
    where: dict[Hashable, int] = {}
    colours: dict[Hashable, tuple] = {}  # in order of arrival, so that neighbours differ
    for step, slots in zip(log, batch_slots(log)):
        for rid in step.preempted:
            ax.plot(step.start, where[rid], "kx", ms=7)
        for slot, rid, _, kind in slots:
            where[rid] = slot
            colour = colours.setdefault(rid, PALETTE[len(colours) % len(PALETTE)])
            bars[kind].append((slot, step.start, step.end - step.start, colour))
    for kind, style in [("decode", {}), ("prefill", {"hatch": "////", "edgecolor": "white"}), ("idle", {})]:
        if bars[kind]:
            slot, left, width, colour = zip(*bars[kind])
            ax.barh(slot, width, left=left, height=0.85, color="0.85" if kind == "idle" else colour, lw=0, **style)
    # legend entries for what the run shows, drawn nowhere (a bar of height 0 at x=0 would stretch
    # the time axis to -0.4 s); outside the axes, where they hide no bar
    handles = [Line2D([], [], color="k", marker="x", ls="", label="preempted")] * any(s.preempted for s in log)
    handles += [Patch(facecolor=colour, hatch=hatch, label=kind)
                for kind, colour, hatch in [("decode", "tab:blue", None), ("prefill", "tab:blue", "////"),
                                            ("idle", "0.85", None)] if bars[kind]]
    ax.set(xlabel="time (s)", ylabel="batch slot", title=title)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if own:
        fig.tight_layout()  # makes room for the legend
    return fig


SPECULATION_STYLES = {  # how each kind of token is shown in a speculative run's text
    "accepted": "background:#c8e6c9",  # drafted, and the target agreed
    "rejected": "background:#ffcdd2;text-decoration:line-through",  # drafted, not kept (the first one
    # rejected, and any after it, never checked)
    "target": "background:#ffe0b2",  # the target's own token: after a rejection, or with nothing drafted
    "bonus": "background:#bbdefb",  # the target's token after all drafts were accepted
}


def speculation_html(rounds: Sequence, decode) -> str:
    """A speculative run's text as HTML, each token coloured by how it came about (a legend
    first); ``rounds`` are ``labkit.speculative.Round``s, ``decode`` maps a token id to its text."""
    def span(token: int, kind: str) -> str:
        # a rejected token never enters the text, so its newline is shown but does not break the line
        newline = "↵" if kind == "rejected" else "↵<br>"
        text = html.escape(decode(token)).replace("\n", newline).replace(" ", "&nbsp;")
        return f'<span style="{SPECULATION_STYLES[kind]}" title="{kind}">{text}</span>'
    legend = " ".join(f'<span style="{style};padding:0 4px">{kind}</span>'
                      for kind, style in SPECULATION_STYLES.items())
    body = []
    for r in rounds:
        body += [span(t, "accepted") for t in r.draft[:r.accepted]]
        body += [span(t, "rejected") for t in r.draft[r.accepted:]]
        body.append(span(r.token, "bonus" if r.bonus else "target"))
    return f'<div>{legend}</div><div style="font-family:monospace;line-height:1.6">{"".join(body)}</div>'
