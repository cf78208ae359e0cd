"""Pipeline parallelism: the layers split across W ranks, micro-batches in flight between them.

    run = pipeline_generate("target", prompts, new_tokens=16, world_size=2, micro_batches=2)
    run.tokens, run.timeline, run.bubble()        # greedy tokens, who ran what when, the idle share

Rank r holds a contiguous run of the model's blocks (rank 0 also the embedding, the last rank the
final norm and LM head) and a KV cache for its own blocks only, so its memory is its share of the
model. With n_layers = q * W + e, the first e ranks hold q + 1 blocks and the others q: the last
rank's LM head is about a block's work in a decode step. A micro-batch's activations ``[rows, tokens, d_model]``
go from rank r to rank r + 1 as point-to-point messages; the last rank picks the greedy tokens
and sends them back to rank 0, which feeds them in at the next step. Every rank knows the
prompts, so it knows each message's shape before it arrives.

With one batch, rank r + 1 waits while rank r works, and the other way round. Split the batch
into m micro-batches and rank 0 runs micro-batch i + 1 while rank 1 runs micro-batch i. In one
forward pass of m equal micro-batches through p stages of equal time t, each stage works m * t
within a span of (m + p - 1) * t, so the share of the ranks' time spent idle, the bubble, is

    bubble = 1 - p * m * t / (p * (m + p - 1) * t) = (p - 1) / (m + p - 1)

which shrinks as m grows. During decoding each micro-batch's next token needs its previous one
to have left the last rank, so the pipeline stays full when m >= p.

Measured: every rank records when each piece of compute (a micro-batch at a step) started and
ended, with ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for every process), and
the bubble is 1 - busy time / (p * span).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from labkit.answers import answer_to
from labkit.device import synchronize
from labkit.load import load, load_config
from labkit.model import AttentionPlan, ContiguousKVCache, ModelConfig, Transformer, parameter_bytes
from labkit.parallel.launch import Rank, launch
from labkit.validate import check_counts, check_ints, generation_prompts


@answer_to("ex10.3")
def bubble_fraction(p: int, m: int) -> float:
    """The idle share of one forward pass of ``m`` equal micro-batches through ``p`` equal stages."""
    if p < 1 or m < 1:
        raise ValueError(f"p={p} stages and m={m} micro-batches must each be at least 1")
    return (p - 1) / (m + p - 1)


def even_split(n: int, parts: int) -> list[range]:
    """``n`` items in ``parts`` consecutive runs whose sizes differ by at most one, the longer runs
    first: layers over ranks, prompts over micro-batches."""
    if not 1 <= parts <= n:
        raise ValueError(f"{n} items cannot be split into {parts} non-empty parts (1..{n})")
    size, extra = divmod(n, parts)
    bounds = [r * size + min(r, extra) for r in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class Piece:
    """One piece of compute on a timeline: ``rank`` ran ``micro_batch`` at ``step`` (0: the
    prompts, s: the s-th decode step) from ``start`` to ``end`` seconds."""

    rank: int
    micro_batch: int
    step: int
    start: float
    end: float


def measured_bubble(pieces: Sequence[Piece], world_size: int) -> float:
    """1 - busy time / (world_size * span): the idle share of the ranks' time between the first
    piece's start and the last one's end."""
    if not pieces:
        raise ValueError("no pieces of compute to measure a bubble over")
    span = max(p.end for p in pieces) - min(p.start for p in pieces)
    return 1 - sum(p.end - p.start for p in pieces) / (world_size * span)


@dataclass
class Stage:
    """One rank's share of a model: blocks ``layers`` (numbered from 0 inside ``model``, as in the
    stage's cache), the embedding if ``first``, the final norm and LM head if ``last``."""

    model: Transformer
    layers: range
    first: bool
    last: bool

    @property
    def config(self) -> ModelConfig:
        """The model's sizes with this stage's layers: what its cache is made for. Its layout is not the
        whole model's, so a stage runs its layers through ``model.layers``, which does not check the
        cache's layout; ``model(...)`` would refuse the stage's cache."""
        return replace(self.model.config, n_layers=len(self.layers))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def forward(self, x: Tensor, positions: Tensor, plan: AttentionPlan | None, last: Tensor) -> Tensor:
        """This stage's part of a forward pass: token ids ``[rows, T]`` in on the first stage, the
        residual stream ``[rows, T, d_model]`` in on the others; out, the residual stream, or on
        the last stage each row's greedy next token after its token at column ``last[row]``."""
        with torch.inference_mode():
            if self.first:
                x = self.model.embed(x)
            x = self.model.layers(x, positions, plan)
            if self.last:
                x = self.model.head(x[torch.arange(x.shape[0], device=x.device), last]).argmax(-1)
        return x


def cut_stage(model: Transformer, rank: int, world_size: int) -> Stage:
    """Rank ``rank``'s stage of ``model``, whose other blocks (and the embedding, or the norm and
    LM head, where the rank holds none) are dropped: ``model`` is taken apart to make it."""
    layers = even_split(model.config.n_layers, world_size)[rank]
    kept = [model.blocks[i] for i in layers]
    for local, block in enumerate(kept):
        block.attn.layer = local  # its layer in the stage's own cache
    model.blocks = nn.ModuleList(kept)
    first, last = rank == 0, rank == world_size - 1
    if not first:
        model.embed = None
    if not last:
        model.norm = model.lm_head = None  # a tied LM head's weight stays with the embedding
    return Stage(model, layers, first, last)


def load_stage(source: str, rank: Rank, dtype: torch.dtype) -> Stage:
    """The stage of model ``source`` (a ``labkit.load`` name or folder) that ``rank`` holds, on its
    device: loaded on the CPU and cut there, so only the stage reaches the device."""
    model, _ = load(source, "cpu", dtype)
    stage = cut_stage(model, rank.rank, rank.world_size)
    stage.model.to(rank.device)
    return stage


def _now(device: torch.device) -> float:
    synchronize(device)
    return time.perf_counter()


def _tag(step: int, micro_batch: int, micro_batches: int) -> int:
    return step * micro_batches + micro_batch


def run_micro_batch(stage: Stage, rank: Rank, tokens: Tensor | None, positions: Tensor, plan: AttentionPlan | None,
                    last: Tensor, where: tuple[int, int, int], pending: list) -> tuple[Tensor, Piece]:
    """One micro-batch through this rank: receive its activations from the rank before (the first
    rank takes ``tokens``), run the stage (timed), send the result on to the next rank without
    waiting for it to arrive (its handle goes to ``pending``: wait on them before the end). The
    stage's output (on the last rank: the greedy tokens) and the piece of the timeline.
    ``where``: (micro-batch, step, number of micro-batches)."""
    micro_batch, step, micro_batches = where
    tag = _tag(step, micro_batch, micro_batches)
    x = tokens
    if not stage.first:
        x = torch.empty(*positions.shape, stage.config.d_model, dtype=stage.dtype, device=rank.device)
        dist.recv(x, rank.rank - 1, tag=tag)
    start = _now(rank.device)
    out = stage.forward(x, positions, plan, last)
    piece = Piece(rank.rank, micro_batch, step, start, _now(rank.device))
    if not stage.last:
        pending.append(dist.isend(out, rank.rank + 1, tag=tag))
    return out, piece


def forward_pass(stage: Stage, rank: Rank, tokens: Tensor, micro_batches: int) -> list[Piece]:
    """One forward pass of the batch ``tokens`` ``[rows, T]`` (every rank has them), split into
    ``micro_batches`` equal micro-batches, through the stages without a cache; this rank's pieces."""
    rows, length = tokens.shape
    if rows % micro_batches:
        raise ValueError(f"{rows} rows do not split into {micro_batches} equal micro-batches")
    size = rows // micro_batches
    positions = torch.arange(length, device=rank.device).expand(size, length)
    last = torch.full((size,), length - 1, device=rank.device)
    pieces, pending = [], []
    for j in range(micro_batches):
        _, piece = run_micro_batch(stage, rank, tokens[j * size:(j + 1) * size], positions, None, last,
                                   (j, 0, micro_batches), pending)
        pieces.append(piece)
    for work in pending:
        work.wait()
    return pieces


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch's prompts, right-padded: ids ``[rows, L]`` (padding: 0) at positions
    ``[rows, L]`` (padding: -1), and each prompt's length."""

    ids: Tensor
    positions: Tensor
    lengths: Tensor

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]], device: torch.device) -> MicroBatch:
        width = max(map(len, prompts))
        ids = torch.tensor([list(p) + [0] * (width - len(p)) for p in prompts], device=device)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        positions = torch.arange(width, device=device).expand_as(ids)
        return cls(ids, positions.where(positions < lengths[:, None], -1), lengths)

    def step(self, step: int) -> tuple[Tensor, Tensor]:
        """The positions at ``step`` (0: the prompts; s: the s-th new token fed back) and the
        column of each row's last token, whose logits pick the next one."""
        if step == 0:
            return self.positions, self.lengths - 1
        return (self.lengths + step - 1)[:, None], torch.zeros_like(self.lengths)


@dataclass(frozen=True)
class PipelineRun:
    """What ``pipeline_generate`` did: each prompt's new tokens, the timeline of
    every rank, and per rank its layers, weight bytes and KV-cache bytes."""

    tokens: list[list[int]]
    timeline: list[Piece]
    layers: list[range]
    parameter_bytes: list[int]
    kv_bytes: list[int]
    micro_batches: int

    @property
    def world_size(self) -> int:
        return len(self.layers)

    def bubble(self, step: int = 0) -> float:
        """The measured idle share of ``step`` (0: the prompts' forward pass, whose formula is
        ``bubble_fraction(world_size, micro_batches)`` when the micro-batches are equal)."""
        return measured_bubble([p for p in self.timeline if p.step == step], self.world_size)


def _sampled(stage: Stage, rank: Rank, own: Tensor, rows: int, tag: int, back: dist.ProcessGroup | None) -> Tensor:
    """On rank 0: a micro-batch's newest tokens, its own if it is also the last rank, else
    received from the last rank over the group ``back``."""
    if stage.last:
        return own
    tokens = torch.empty(rows, dtype=torch.long, device=rank.device)
    dist.recv(tokens, rank.world_size - 1, group=back, tag=tag)
    return tokens


def _generate_on_rank(rank: Rank, source: str, prompts: list[list[int]], new_tokens: int, micro_batches: int,
                      dtype: torch.dtype) -> PipelineRun | None:
    """Each rank's part of ``pipeline_generate``; rank 0 returns the run, with what every rank recorded."""
    stage = load_stage(source, rank, dtype)
    groups = [prompts[r.start:r.stop] for r in even_split(len(prompts), micro_batches)]
    batches = [MicroBatch.of(g, rank.device) for g in groups]
    caches = [ContiguousKVCache(stage.config, len(g), max(map(len, g)) + new_tokens - 1, stage.dtype, rank.device)
              for g in groups]
    sampled: list[Tensor] = [torch.empty(0)] * micro_batches  # on the last rank: each micro-batch's newest tokens
    outputs: list[list[Tensor]] = [[] for _ in groups]  # on rank 0: each micro-batch's tokens, step by step
    pieces, pending = [], []
    # the tokens go back to rank 0 in a group of their own: NCCL runs a group's messages between two
    # ranks in order, so on two ranks rank 0's next activations (waiting for rank 1 to take them)
    # and rank 1's tokens (waiting for rank 0) would each hold the other up
    back = dist.new_group([0, rank.world_size - 1]) if rank.world_size > 1 else None
    dist.barrier()  # every rank loaded: the timeline starts together
    for step in range(new_tokens + 1):
        for j, (batch, cache) in enumerate(zip(batches, caches)):
            if stage.first and step:  # the tokens the micro-batch sampled at the step before
                outputs[j].append(_sampled(stage, rank, sampled[j], len(batch.lengths),
                                           _tag(step - 1, j, micro_batches), back))
            if step == new_tokens:  # the last tokens are collected, not fed back
                continue
            positions, last = batch.step(step)
            tokens = outputs[j][-1][:, None] if stage.first and step else batch.ids
            out, piece = run_micro_batch(stage, rank, tokens, positions, cache.plan(positions), last,
                                         (j, step, micro_batches), pending)
            pieces.append(piece)
            if stage.last:
                sampled[j] = out
                if not stage.first:
                    pending.append(dist.isend(out, 0, group=back, tag=_tag(step, j, micro_batches)))
    for work in pending:
        work.wait()
    report = _gather((pieces, stage.layers, parameter_bytes(stage.model), sum(c.nbytes for c in caches)), rank)
    if rank.rank:
        return None
    timeline, layers, weights, kv = zip(*report)
    return PipelineRun(tokens=[row for out in outputs for row in torch.stack(out, dim=1).tolist()],
                       timeline=_from_zero([p for rank_pieces in timeline for p in rank_pieces]),
                       layers=list(layers), parameter_bytes=list(weights), kv_bytes=list(kv),
                       micro_batches=micro_batches)


def _gather(obj: object, rank: Rank) -> list:
    """Every rank's ``obj`` on rank 0, in rank order (an empty list elsewhere)."""
    gathered = [None] * rank.world_size if rank.rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered or []


def _from_zero(pieces: list[Piece]) -> list[Piece]:
    """The pieces in order of start, their times counted from the first start."""
    zero = min(p.start for p in pieces)
    return sorted((replace(p, start=p.start - zero, end=p.end - zero) for p in pieces),
                  key=lambda p: (p.start, p.rank))


def _check_layout(config: ModelConfig, world_size: int, micro_batches: int, rows: int) -> None:
    if not 1 <= world_size <= config.n_layers:
        raise ValueError(f"world_size={world_size} must be in 1..n_layers={config.n_layers}: each rank "
                         "holds at least one layer")
    if not 1 <= micro_batches <= rows:
        raise ValueError(f"micro_batches={micro_batches} must be in 1..{rows} (the batch's rows): each "
                         "micro-batch holds at least one prompt")


def pipeline_generate(model: str, prompts: Sequence[Sequence[int]], new_tokens: int,
                      world_size: int = 2, micro_batches: int = 2, dtype: torch.dtype = torch.float32,
                      timeout_s: float = 300.0) -> PipelineRun:
    """Greedy generation of ``new_tokens`` tokens after each prompt (token ids; no stop at
    end-of-text) by ``world_size`` ranks, each holding its share of the layers of ``model`` (a
    ``labkit.load`` name or folder), with the prompts split into ``micro_batches`` micro-batches
    in flight. The layout and prompts are checked before any process starts."""
    config = load_config(model)
    check_ints(world_size=world_size, micro_batches=micro_batches)
    ids = generation_prompts(prompts, new_tokens, config.vocab_size, config.max_seq_len)
    _check_layout(config, world_size, micro_batches, len(prompts))
    return launch(_generate_on_rank, world_size, (model, ids, new_tokens, micro_batches, dtype), timeout_s)


@dataclass(frozen=True)
class BubbleRun:
    """One forward pass of ``micro_batches`` equal micro-batches: its timeline, the bubble measured
    on it, and the formula's."""

    micro_batches: int
    timeline: list[Piece]
    measured: float
    formula: float


def _bubbles_on_rank(rank: Rank, source: str, rows: int, length: int, counts: list[int], passes: int,
                     dtype: torch.dtype) -> list[list[Piece]]:
    """Each rank's part of ``measure_bubble``: one untimed pass to warm up, then ``passes`` rounds of one
    pass per count, the counts taking turns."""
    stage = load_stage(source, rank, dtype)
    tokens = torch.arange(rows * length, device=rank.device).view(rows, length) % stage.config.vocab_size
    runs = []
    for i, count in enumerate([counts[0], *counts * passes]):
        dist.barrier()  # the pass starts on every rank together, the last one's tail finished
        pieces = forward_pass(stage, rank, tokens, count)
        if i:
            runs.append(pieces)
    return [_from_zero([p for pieces in run for p in pieces]) for run in zip(*_gather(runs, rank))]


def measure_bubble(model: str, world_size: int = 2, micro_batches: Sequence[int] = (1, 2, 4, 8), rows: int = 8,
                   length: int = 32, passes: int = 5, dtype: torch.dtype = torch.float32,
                   timeout_s: float = 300.0) -> list[BubbleRun]:
    """The bubble of a forward pass (no cache, no sampling) of ``rows`` prompts of ``length``
    tokens through ``world_size`` stages of ``model``, split into each of ``micro_batches`` equal
    micro-batches: measured against ``bubble_fraction``, ``passes`` times each (the counts taking
    turns), and each count's pass of median bubble kept. One launch for all of them."""
    config = load_config(model)
    counts = list(micro_batches)
    check_ints(world_size=world_size, rows=rows, length=length, passes=passes,
               **{f"micro_batches[{i}]": m for i, m in enumerate(counts)})
    if not counts:
        raise ValueError("micro_batches is empty: give the numbers of micro-batches to measure, e.g. (1, 2, 4, 8)")
    if not 1 <= length <= config.max_seq_len:
        raise ValueError(f"length={length} must be in 1..max_seq_len={config.max_seq_len}")
    check_counts(passes=passes)
    for count in counts:
        _check_layout(config, world_size, count, rows)
        if rows % count:
            raise ValueError(f"rows={rows} do not split into micro_batches={count} equal micro-batches: "
                             "choose rows a multiple of each count")
    runs = launch(_bubbles_on_rank, world_size, (model, rows, length, counts, passes, dtype), timeout_s)
    kept = []
    for i, m in enumerate(counts):
        timed = sorted((measured_bubble(run, world_size), j, run) for j, run in enumerate(runs[i::len(counts)]))
        bubble, _, run = timed[len(timed) // 2]
        kept.append(BubbleRun(m, run, bubble, bubble_fraction(world_size, m)))
    return kept
