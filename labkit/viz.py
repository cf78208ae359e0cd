"""Plots shared by the notebooks. Each plot_ function returns its matplotlib Figure; plain_log numbers axes."""
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
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from labkit.engine import StepRecord
from labkit.hardware import Hardware
from labkit.parallel.pipeline import Piece, bubble_fraction, measured_bubble
from labkit.tree import check_tree, children, tree_mask


HATCH_LABEL_BOX = dict(fc="white", ec="none", pad=0.5)  # behind a label on a hatched patch: no hatch through it


def plain_log(*axes, subs: Sequence[float] = (1, 2, 5)) -> None:
    """Number log-scale axes (``ax.xaxis``, ``ax.yaxis``) at ``subs`` times each power of ten (1, 2, 5,
    10, 20, ...) as plain numbers, not powers of ten."""
    for axis in axes:
        axis.set_major_locator(LogLocator(subs=subs))
        axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.set_minor_formatter(NullFormatter())


def plot_roofline(machines: Sequence[Hardware], points: Iterable[tuple[str, float]] = (),
                  intensity_range: tuple[float, float] = (0.1, 1e4), title: str = "Roofline",
                  achieved: Iterable[tuple[str, float, float]] = ()) -> Figure:
    """Each machine's roofline, log-log, with its ridge point; ``points`` are (label, intensity)
    kernels drawn as vertical lines, labelled in a band above every roof so that no label covers
    a ridge point; ``achieved`` are (label, intensity, FLOP/s) measured kernels, drawn as stars.
    A measured machine is drawn thick and says so. A flat roof at the height of one drawn before
    it (the H100 and the H200 share one) is dashed, so that the roof beneath shows through."""
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)",
           ylabel="attainable TFLOP/s", title=title)
    x = np.logspace(np.log10(intensity_range[0]), np.log10(intensity_range[1]), 400)
    styles, peaks = ["-", (0, (5, 4)), (0, (1, 3)), (0, (6, 3, 1, 3))], []
    for hw in machines:
        y = np.minimum(hw.peak_flops, x * hw.bandwidth) / 1e12
        label = f"{hw.name} ({'measured' if hw.measured else 'datasheet'}, {hw.dtype})"
        below = sum(np.isclose(hw.peak_flops, peak, rtol=0.01) for peak in peaks)  # roofs already at this height
        peaks.append(hw.peak_flops)
        line, = ax.plot(x, y, lw=3 if hw.measured else 1.5, ls=styles[below % len(styles)], label=label)
        ax.plot(hw.ridge_intensity, hw.peak_flops / 1e12, "o", color=line.get_color())
    for label, intensity, flops in achieved:
        ax.plot(intensity, flops / 1e12, "*", ms=14, color="black")
        ax.annotate(label, (intensity, flops / 1e12), xytext=(8, -8), textcoords="offset points", fontsize=8,
                    va="top", bbox=dict(fc="white", ec="none", alpha=0.8))  # below: a star is under its roof
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
        ax.text(col + 0.46, -row + 0.46, label, ha="center", va="center", fontsize=7,
                bbox=HATCH_LABEL_BOX if state == "shared" else None)
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
    request; hatched while prefilling, grey while idle (a static batch's finished rows, still
    computed while they wait for its longest), a black x where a request was preempted."""
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
    handles += [Patch(facecolor=colour, hatch=hatch, label=label)  # a static batch's idle rows are still computed
                for kind, colour, hatch, label in [("decode", "tab:blue", None, "decode"),
                                                   ("prefill", "tab:blue", "////", "prefill"),
                                                   ("idle", "0.85", None, "finished, still computed (padding)")]
                if bars[kind]]
    ax.set(xlabel="time (s)", ylabel="batch slot", title=title)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if own:
        fig.tight_layout()  # makes room for the legend
    return fig


def plot_pipeline_timeline(timeline: Sequence[Piece], title: str = "", ax: Axes | None = None) -> Figure:
    """A pipeline-parallel run over time: one row per rank, a bar per piece of compute, coloured and
    labelled by micro-batch (hatched: the prompts' forward pass, when decode steps follow), grey
    where the rank sat idle. The title gives the bubble of the prompts' forward pass (step 0),
    measured and by the formula (p - 1) / (m + p - 1); say in ``title`` which device ran it."""
    if not timeline:
        raise ValueError("the timeline is empty: give the pieces a pipeline run recorded")
    own = ax is None
    ranks = max(p.rank for p in timeline) + 1
    fig, ax = plt.subplots(figsize=(10, 0.6 * ranks + 1.6)) if own else (ax.figure, ax)
    begin, end = min(p.start for p in timeline), max(p.end for p in timeline)
    ax.barh(range(ranks), end - begin, left=begin, height=0.85, color="0.85", lw=0)  # idle, under the work
    decoding = any(p.step for p in timeline)
    for p in timeline:
        ax.barh(p.rank, p.end - p.start, left=p.start, height=0.85, color=PALETTE[p.micro_batch % len(PALETTE)],
                lw=0, hatch="////" if decoding and p.step == 0 else None, edgecolor="white")
        if p.end - p.start > (end - begin) / 60:  # a label only where it fits
            ax.text((p.start + p.end) / 2, p.rank, str(p.micro_batch), ha="center", va="center", fontsize=7,
                    bbox=HATCH_LABEL_BOX if decoding and p.step == 0 else None)
    micro_batches = sorted({p.micro_batch for p in timeline})
    prefill = [p for p in timeline if p.step == 0]
    measured, formula = measured_bubble(prefill, ranks), bubble_fraction(ranks, len(micro_batches))
    handles = [Patch(facecolor=PALETTE[m % len(PALETTE)], label=f"micro-batch {m}") for m in micro_batches]
    handles += [Patch(facecolor="white", edgecolor="0.3", hatch="////", label="prompts (step 0)")] * decoding
    handles.append(Patch(facecolor="0.85", label="idle"))
    heading = (f"bubble of the prompts' pass: measured {measured:.0%}, "
               f"(p - 1) / (m + p - 1) = {formula:.0%} (p = {ranks}, m = {len(micro_batches)})")
    ax.set(xlabel="time (s)", ylabel="rank", title=f"{title}\n{heading}" if title else heading,
           yticks=range(ranks), ylim=(ranks - 0.5, -0.5))  # rank 0 on top
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if own:
        fig.tight_layout()
    return fig


SPECULATION_STYLES = {  # how each kind of token is shown in a speculative run's text
    "accepted": "background:#c8e6c9",  # drafted, and the target agreed
    "rejected": "background:#ffcdd2;text-decoration:line-through",  # drafted, the first the target disagreed with
    "unjudged": "background:#eeeeee;color:#757575;text-decoration:line-through",  # drafted after a rejected one,
    # thrown away unjudged (not counted in the acceptance rate)
    "target": "background:#ffe0b2",  # the target's own token: after a rejection, or with nothing drafted
    "bonus": "background:#bbdefb",  # the target's token after all drafts were accepted
}


def speculation_html(rounds: Sequence, decode) -> str:
    """A speculative run's text as HTML, each token coloured by how it came about (a legend of
    the kinds it has first); ``rounds`` are ``labkit.speculative.Round``s, ``decode`` maps a token id to its text."""
    def span(token: int, kind: str) -> str:
        # a token thrown away never enters the text, so its newline is shown but does not break the line
        newline = "↵" if kind in ("rejected", "unjudged") else "↵<br>"
        text = html.escape(decode(token)).replace("\n", newline).replace(" ", "&nbsp;")
        return f'<span style="{SPECULATION_STYLES[kind]}" title="{kind}">{text}</span>'
    tokens = []  # (token, kind), in the order they came
    for r in rounds:
        tokens += [(t, "accepted") for t in r.draft[:r.accepted]]
        tokens += [(t, "rejected") for t in r.draft[r.accepted:r.accepted + 1]]
        tokens += [(t, "unjudged") for t in r.draft[r.accepted + 1:]]
        tokens.append((r.token, "bonus" if r.bonus else "target"))
    kinds = {kind for _, kind in tokens}
    legend = " ".join(f'<span style="{style};padding:0 4px">{kind}</span>'  # the kinds this run has
                      for kind, style in SPECULATION_STYLES.items() if kind in kinds)
    text = "".join(span(token, kind) for token, kind in tokens)
    return f'<div>{legend}</div><div style="font-family:monospace;line-height:1.6">{text}</div>'


def tree_layout(parents: Sequence[int]) -> list[tuple[float, float]]:
    """Where to draw each node of a token tree (``labkit.tree``'s parent array): x its depth, y
    its row, the leaves one row apart in the order of a depth-first walk (children in order, the
    first on top) and every other node level with the middle of its children."""
    depth, kids = check_tree(parents), children(parents)
    row, leaves = [0.0] * len(parents), 0
    stack = [(0, False)]  # (node, its children done): children are placed before their parent
    while stack:
        node, done = stack.pop()
        if done or not kids[node]:
            if kids[node]:
                row[node] = (row[kids[node][0]] + row[kids[node][-1]]) / 2
            else:
                row[node], leaves = float(leaves), leaves + 1
            continue
        stack.append((node, True))
        stack += [(kid, False) for kid in reversed(kids[node])]
    return [(float(d), r) for d, r in zip(depth, row)]


def plot_token_tree(parents: Sequence[int], labels: Sequence[str], values: Sequence[float] | None = None, *,
                    value_label: str = "", title: str = "", ax: Axes | None = None) -> Figure:
    """A token tree drawn left to right, the root at the left and each node at its depth, joined to
    its parent; each node a box holding its label, coloured by its value in ``values`` (0 to 1,
    e.g. how often it was accepted; white where None) with a colour bar named ``value_label``."""
    if len(labels) != len(parents) or (values is not None and len(values) != len(parents)):
        raise ValueError(f"one label (and value) per node: {len(parents)} nodes, {len(labels)} labels"
                         + (f", {len(values)} values" if values is not None else ""))
    where = tree_layout(parents)
    rows = 1 + max(y for _, y in where)
    own = ax is None
    size = (1.7 * (1 + max(x for x, _ in where)) + 2, 0.38 * rows + 1.3)
    fig, ax = plt.subplots(figsize=size) if own else (ax.figure, ax)
    cmap = plt.get_cmap("YlGn")  # 0 near white, 1 dark green
    for node, parent in enumerate(parents[1:], start=1):
        (x0, y0), (x1, y1) = where[parent], where[node]
        ax.plot([x0, x1], [y0, y1], "-", color="0.6", lw=1, zorder=1)
    for node, ((x, y), label) in enumerate(zip(where, labels)):
        value = None if values is None else values[node]
        face = "white" if value is None else cmap(float(value))
        ink = "white" if value is not None and float(value) > 0.6 else "black"
        ax.text(x, y, label, ha="center", va="center", fontsize=7, color=ink, zorder=2,
                bbox=dict(boxstyle="round,pad=0.25", fc=face, ec="0.3", lw=0.6))
    ax.set(xlim=(-0.6, max(x for x, _ in where) + 0.6), ylim=(rows - 0.5, -0.5), title=title)
    ax.set_xticks(range(int(max(x for x, _ in where)) + 1))
    ax.set_xlabel("depth (0: the root, the text's last token; d: a guess of head d)")
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    if values is not None:
        bar = fig.colorbar(plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, 1)), ax=ax, fraction=0.03, pad=0.01)
        bar.set_label(value_label)
    if own:
        fig.tight_layout()
    return fig


def plot_tree_mask(parents: Sequence[int], labels: Sequence[str], start: int = 0, *, title: str = "",
                   ax: Axes | None = None) -> Figure:
    """The tree attention mask of ``labkit.tree.tree_plan`` as a picture: a row per node (what it
    sees), a column per node, and, when ``start`` tokens are cached, one column first for the
    cached text, which every node sees; dark where a node attends."""
    mask = tree_mask(parents).numpy()
    if start:
        mask = np.concatenate([np.ones((len(parents), 1), dtype=bool), mask], axis=1)
    columns = ([f"text ({start})"] if start else []) + list(labels)
    own = ax is None
    fig, ax = plt.subplots(figsize=(0.3 * len(columns) + 2.5, 0.3 * len(parents) + 1.5)) if own else (ax.figure, ax)
    ax.imshow(mask, cmap="Greys", vmin=0, vmax=1.4, aspect="equal")
    ax.set_xticks(range(len(columns)), columns, rotation=90, fontsize=7)
    ax.set_yticks(range(len(parents)), labels, fontsize=7)
    ax.set_xticks(np.arange(len(columns) + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(len(parents) + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", lw=0.5)
    ax.tick_params(which="minor", length=0)
    ax.set(xlabel="keys: what is seen", ylabel="queries: the node that looks", title=title)
    if own:
        fig.tight_layout()
    return fig
