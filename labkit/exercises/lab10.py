"""Notebook 10 (beyond one device): a linear layer split across ranks, attention's heads shared out, what a
pipeline and an all-reduce cost, and the KV cache a disaggregated request ships. The specs, as a student
reads them:

A rank's share of n things split over ``world`` ranks is contiguous and in rank order: rank r holds the
r-th of ``world`` equal parts, indices r * n / world .. (r + 1) * n / world - 1.

ex10.1  ``TensorParallel``, a class of two static methods: Megatron's two splits of a linear layer
    y = x @ weight.T, weight ``[out_features, in_features]``.
    ``column_parallel(x, weight, rank, world)``: this rank's share of the output features, x @ weight[rows of
    the rank].T, ``[..., out_features / world]``; the ranks' results, concatenated in rank order, are y.
    ``row_parallel(x_part, weight, rank, world)``: ``x_part`` holds this rank's share of the input features;
    returns the rank's partial sum x_part @ weight[:, columns of the rank].T, ``[..., out_features]``; the
    ranks' partial sums, added by an all-reduce, are y.
    Both raise ValueError when ``world`` does not divide the features they split. Checked on each rank against
    slices of the full product, then as Llama's MLP (gate and up column-parallel, SiLU(gate) * up on each
    rank's share, down row-parallel, an all-reduce) against the unsplit MLP at W = 1, 2, 4.

ex10.2  ``shard_heads(n_heads, n_kv_heads, rank, world) -> (query_heads, kv_heads)``
    The attention heads a rank computes and the KV heads it caches, lists of head indices in ascending order.
    Query heads: the rank's contiguous share. KV heads: the rank's contiguous share when world <= n_kv_heads;
    with more ranks than KV heads, each KV head is replicated and a rank holds the one KV head its query heads
    read (vLLM does so). Either way a rank holds exactly the KV heads its query heads read, query head h
    reading KV head h // (n_heads / n_kv_heads). Checked for MHA, GQA and MQA at W = 1, 2, 4, 8 (the layouts
    given divide: world divides n_heads, and n_kv_heads or world divides the other).

ex10.3  ``ParallelCosts``, a class of two static methods, the two formulas of the notebook:
    ``bubble_fraction(stages, micro_batches)``: the share of a pipeline's time its stages sit idle, p stages
    and m micro-batches, (p - 1) / (m + p - 1).
    ``ring_allreduce_seconds(nbytes, world, latency_s, bandwidth)``: a ring all-reduce of ``nbytes`` on each
    of W ranks over links of ``latency_s`` and ``bandwidth`` bytes/s, 2 (W - 1) (latency + nbytes / (W x
    bandwidth)). Checked against a pipeline schedule whose idle slots are counted, and a ring whose steps are
    run and timed.

ex10.4  ``kv_bytes_shipped(n_layers, n_heads, n_kv_heads, head_dim, prompt_tokens, bytes_per_element)``
    The bytes of KV cache a prefill worker sends a decode worker for one prompt: a key and a value per layer,
    KV head and token, head_dim elements each, 2 x layers x kv_heads x head_dim x tokens x bytes. Checked
    against ``labkit.memory.kv_cache_bytes`` for published models and against the bytes a labkit
    ``ContiguousKVCache`` holds for the prompt.

Each check names a known mistake when an answer is one; in ex10.3 a slip in a formula is named only where it
gives the answer's value at a second point too (one value can fit two slips). The tests check the references
against the formulas.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from labkit import memory
from labkit.exercises.spec import (Case, ChangedInPlace, Exercise, JudgedCase, SaysWhatToDo, Scenario, WrongType,
                                   _short, int_list, items_of, number_of)
from labkit.model import ContiguousKVCache, ModelConfig
from labkit.parallel.pipeline import even_split
from labkit.parallel.tensor import shard_heads
from labkit.presets import MODEL_PRESETS


def share(n: int, rank: int, world: int) -> range:
    """Rank ``rank``'s contiguous share of ``n`` things split over ``world`` ranks (``world`` divides ``n``)."""
    return even_split(n, world)[rank]


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; ChangedInPlace if it changed a tensor it was given."""
    given = copy.deepcopy(args)
    got = fn(*given)
    if any(isinstance(a, Tensor) and not torch.equal(a, b) for a, b in zip(args, given)):
        raise ChangedInPlace(f"{getattr(fn, '__name__', 'the call')} changed a tensor it was given in place: leave "
                             "x and weight as they were, and compute into new tensors")
    return got


# ex10.1 ------------------------------------------------------------------------------------------


def _close(got: Tensor, want: Tensor) -> bool:
    return (got.shape, got.dtype) == (want.shape, want.dtype) and torch.allclose(got, want, rtol=1e-9, atol=1e-12)


def _judge_shard(what: str, got: Any, want: Tensor, mistakes: list[tuple[Tensor, str]]) -> None:
    """``got`` must be ``want``; a known wrong answer in ``mistakes`` names its mistake."""
    if not isinstance(got, Tensor):
        raise AssertionError(f"{what}: expected a tensor of shape {list(want.shape)}, got {_short(got)}")
    if _close(got, want):
        return
    why = next((text for wrong, text in mistakes if _close(got, wrong)), None)
    if why is None and got.shape != want.shape:
        why = f"expected shape {list(want.shape)}, got {list(got.shape)}"
    elif why is None and got.dtype != want.dtype:
        kind = WrongType if got.shape == want.shape and torch.allclose(got.to(want.dtype), want, 1e-4, 1e-6) else \
            AssertionError  # a type slip alone says what to do; wrong values in another type want the hint too
        raise kind(f"{what}: expected {want.dtype}, the dtype of x and weight, got {got.dtype}: compute with the "
                   "tensors as they are given, without .float() or a new tensor of torch's default dtype")
    elif why is None:
        why = f"the values differ (by up to {(got - want).abs().max().item():.3g})"
    raise AssertionError(f"{what}: {why}")


def _span(part: range) -> str:
    return f"{part.start} .. {part.stop - 1}"


def _starts_at_rank(what: str, rank: int, part: range) -> str:
    """What a share of ``what`` (rows, columns) that starts at ``rank`` instead of rank x its size is."""
    return (f"this uses {what} {rank} .. {rank + len(part) - 1}, a share that starts at {what[:-1]} {rank}; rank "
            f"{rank}'s share starts at rank x {len(part)} = {part.start}: {what} {_span(part)}")


def _column_mistakes(x: Tensor, weight: Tensor, rank: int, world: int) -> list[tuple[Tensor, str]]:
    out = weight.shape[0]
    rows = share(out, rank, world)
    others = [share(out, other, world) for other in range(world)]
    return [
        (x @ weight[rank::world].T, f"this is x @ weight[{rank}::{world}].T, an interleaved (strided) split; rank "
                                    f"{rank}'s share is contiguous, rows {_span(rows)}: concatenated in rank order, "
                                    "the shares must give y's features in order"),
        *((x @ weight[theirs.start:theirs.stop].T, f"this is rank {other}'s share (rows {_span(theirs)}); rank {rank} "
                                                   f"holds rows {_span(rows)}: the rank-th of {world} equal parts")
          for other, theirs in enumerate(others) if other != rank),
        (x @ weight.T, f"this is the whole output, all {out} features; a rank computes only its share, "
                       f"{out // world} of them, with its rows of the weight"),
        (x @ weight[rank:rank + len(rows)].T, _starts_at_rank("rows", rank, rows)),
    ]


def _row_mistakes(x_part: Tensor, weight: Tensor, rank: int, world: int) -> list[tuple[Tensor, str]]:
    out, inp = weight.shape
    cols = share(inp, rank, world)
    others = [share(inp, other, world) for other in range(world)]
    mistakes = [
        (x_part @ weight[:, rank::world].T, f"this uses weight[:, {rank}::{world}], an interleaved (strided) split; "
                                            f"x_part holds the contiguous input features {_span(cols)}, so the "
                                            "columns must be those"),
        *((x_part @ weight[:, theirs.start:theirs.stop].T, f"this uses rank {other}'s columns; x_part holds rank "
                                                           f"{rank}'s input features, {_span(cols)}, and they multiply "
                                                           "the same columns of the weight")
          for other, theirs in enumerate(others) if other != rank),
        ((x_part @ weight[:, cols.start:cols.stop].T) / world,
         f"this is the partial sum divided by {world}: the all-reduce adds the ranks' partial sums (each holds part "
         "of every output feature's dot product), it does not average them"),
        (x_part @ weight[:, rank:rank + len(cols)].T, _starts_at_rank("columns", rank, cols)),
    ]
    if out == inp:  # a square weight: a slice of rows fits x_part without a transpose
        rows = share(out, rank, world)
        mistakes.append((x_part @ weight[rows.start:rows.stop],
                         f"this is x_part @ weight[{rows.start}:{rows.stop}], a split by rows; the row-parallel layer "
                         "splits the weight by its columns (its input features, those x_part holds): "
                         "x_part @ weight[:, cols].T"))
    return mistakes


def _judged_share(what: str, call: Callable[[], Any], expected: Tensor, mistakes: Any, shape_hint: str) -> Tensor:
    """A rank's share from ``call()``, judged against ``expected`` and the known ``mistakes``; a shape
    error is explained by ``shape_hint``."""
    try:
        got = call()
    except NotImplementedError:  # a stub, not a shape error
        raise
    except RuntimeError as error:
        raise AssertionError(f"{what} raised RuntimeError: {error}. If the shapes do not fit: {shape_hint}") from None
    _judge_shard(what, got, expected, mistakes)
    return got


def _column_shares(cls: Any, x: Tensor, weight: Tensor, world: int) -> list[Tensor]:
    """Each rank's column-parallel output, checked, and their concatenation against the full product; then
    that no rank computed the whole product to keep its share of it."""
    shares, whole = [], _WholeOutput((*x.shape[:-1], weight.shape[0]))
    for rank in range(world):
        rows = share(weight.shape[0], rank, world)
        hint = (f"x holds all {weight.shape[1]} input features, so the column-parallel layer splits the weight by rows "
                f"(output features): weight[{rows.start}:{rows.stop}], shape [{len(rows)}, {weight.shape[1]}]")
        shares.append(_judged_share(f"column_parallel(x, weight, rank={rank}, world={world})",
                                    lambda: _call(whole.watching(cls.column_parallel), x, weight, rank, world),
                                    x @ weight[rows.start:rows.stop].T, _column_mistakes(x, weight, rank, world), hint))
    _judge_shard(f"the {world} ranks' outputs concatenated in rank order", torch.cat(shares, -1), x @ weight.T, [])
    if world > 1 and whole.seen:
        raise SaysWhatToDo(f"column_parallel(..., world={world}) gives each rank its share, but computes the whole "
                           f"output, all {weight.shape[0]} features, on the way: a rank multiplies x by its own rows "
                           f"of the weight only, {weight.shape[0] // world} of them, and that is the work it saves")
    return shares


class _WholeOutput(TorchFunctionMode):
    """Notes whether any operation makes a tensor of ``shape``: x's leading dimensions and every output feature."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.seen = shape, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.seen = self.seen or (isinstance(result, Tensor) and tuple(result.shape) == self.shape)
        return result

    def watching(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, run under this mode."""
        @functools.wraps(fn)
        def watched(*args: Any) -> Any:
            with self:
                return fn(*args)
        return watched


def _row_partials(cls: Any, parts: Sequence[Tensor], weight: Tensor, world: int) -> list[Tensor]:
    """Each rank's row-parallel partial sum, checked."""
    partials = []
    for rank, x_part in enumerate(parts):
        cols = share(weight.shape[1], rank, world)
        hint = (f"x_part is already rank {rank}'s share of the input, {x_part.shape[-1]} of the {weight.shape[1]} "
                f"features (use it whole, with no slice of its own); the row-parallel layer splits the weight by "
                f"columns: weight[:, {cols.start}:{cols.stop}], shape [{weight.shape[0]}, {len(cols)}]; a slice of "
                "rows does not fit x_part")
        got = _judged_share(f"row_parallel(x_part, weight, rank={rank}, world={world})",
                            lambda: _call(cls.row_parallel, x_part, weight, rank, world),
                            x_part @ weight[:, cols.start:cols.stop].T, _row_mistakes(x_part, weight, rank, world),
                            hint)
        partials.append(got)
    return partials


def all_reduce(partials: Sequence[Tensor]) -> Tensor:
    """The all-reduce the check uses: every rank gets the sum of the ranks' tensors (here, the sum itself)."""
    return torch.stack(list(partials)).sum(0)


def _weights(generator: torch.Generator, *shapes: tuple[int, int]) -> list[Tensor]:
    return [torch.randn(shape, generator=generator, dtype=torch.float64) / shape[1] ** 0.5 for shape in shapes]


def _column_play(x_shape: tuple[int, ...], out: int, world: int, seed: int) -> Callable[[Any], None]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=generator, dtype=torch.float64)
    (weight,) = _weights(generator, (out, x_shape[-1]))

    def play(cls: Any) -> None:
        _column_shares(cls, x, weight, world)
    return play


def _row_play(x_shape: tuple[int, ...], out: int, world: int, seed: int) -> Callable[[Any], None]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=generator, dtype=torch.float64)
    (weight,) = _weights(generator, (out, x_shape[-1]))

    def play(cls: Any) -> None:
        parts = [x[..., part.start:part.stop] for part in (share(x.shape[-1], rank, world) for rank in range(world))]
        summed = all_reduce(_row_partials(cls, parts, weight, world))
        _judge_shard(f"the {world} ranks' partial sums added (the all-reduce)", summed, x @ weight.T, [])
    return play


def _mlp_play(x_shape: tuple[int, ...], d_ff: int, world: int, seed: int) -> Callable[[Any], None]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=generator, dtype=torch.float64)
    d_model = x_shape[-1]
    gate, up, down = _weights(generator, (d_ff, d_model), (d_ff, d_model), (d_model, d_ff))

    def play(cls: Any) -> None:
        hidden = [F.silu(g) * u for g, u in zip(_column_shares(cls, x, gate, world), _column_shares(cls, x, up, world))]
        got = all_reduce(_row_partials(cls, hidden, down, world))
        want = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
        _judge_shard(f"the MLP on {world} rank{'s' * (world > 1)}, all-reduced", got, want, [])
    return play


def _ones(*shape: int) -> Tensor:
    return torch.ones(*shape, dtype=torch.float64)


def _refuses_play(cls: Any) -> None:
    # the dimension split has 8 features, which 3 ranks cannot share; the other has 6, which they could
    for name, (x, weight), split in (("column_parallel", (_ones(2, 6), _ones(8, 6)), "output"),
                                     ("row_parallel", (_ones(2, 2), _ones(6, 8)), "input")):
        try:
            got = getattr(cls, name)(x, weight, 0, 3)
        except ValueError:
            continue
        raise AssertionError(f"{name}(..., weight of shape {list(weight.shape)}, rank=0, world=3) returned "
                             f"{_short(got)}; expected a ValueError: 3 ranks cannot share its 8 {split} features "
                             "equally")


def _tensor_parallel_cases() -> list[Scenario]:
    return [
        Scenario("column-parallel, 2 ranks: x [3, 6], weight [8, 6]", _column_play((3, 6), 8, 2, 0),
                 hint="rank r computes the output features of its own rows of the weight: the 8 rows split in 2 "
                      "equal contiguous parts, rank 0 the first, rank 1 the rest"),
        Scenario("column-parallel, 4 ranks: x [2, 3, 6], weight [12, 6]", _column_play((2, 3, 6), 12, 4, 1),
                 hint="4 ranks of 3 output features each; x has two leading dimensions, which the output keeps. "
                      "Read the share's size from the weight and world, never a fixed number. The dimension split "
                      "is the output features, weight.shape[0] (12): the 6 input features need not split in 4"),
        Scenario("row-parallel, 2 ranks: x_part [3, 4], weight [8, 8]", _row_play((3, 8), 8, 2, 2),
                 hint="x_part holds input features r*4 .. r*4+3 of x; they meet only the weight's columns of the "
                      "same numbers, so the partial sum uses those 4 columns and has all 8 output features (each "
                      "one's dot product cut in parts, one per rank)"),
        Scenario("row-parallel, 4 ranks: x_part [2, 3, 2], weight [6, 8]", _row_play((2, 3, 8), 6, 4, 3),
                 hint="8 input features over 4 ranks, 2 each, and 6 output features on every rank"),
        Scenario("Llama's MLP on 1 rank: d_model 6, d_ff 8", _mlp_play((3, 6), 8, 1, 4),
                 hint="one rank holds everything: column_parallel is x @ weight.T, row_parallel x_part @ weight.T"),
        Scenario("Llama's MLP on 2 ranks: d_model 6, d_ff 8", _mlp_play((3, 6), 8, 2, 5),
                 hint="gate and up column-parallel, SiLU(gate) * up on each rank's own features (no communication: "
                      "each feature is whole on one rank), down row-parallel, one all-reduce: Megatron's MLP"),
        Scenario("Llama's MLP on 4 ranks: x [2, 5, 8], d_ff 16", _mlp_play((2, 5, 8), 16, 4, 6),
                 hint="four ranks of 4 hidden features each, a batch of 2 sequences of 5 tokens"),
        Scenario("3 ranks cannot share 8 features: ValueError", _refuses_play,
                 hint="8 features do not split into 3 equal parts (8 // 3 would drop 2 of them, and torch.chunk "
                      "would make parts of 3, 3 and 2): raise ValueError when world does not divide the dimension "
                      "split, out_features for column_parallel and in_features for row_parallel"),
    ]


# ex10.2 ------------------------------------------------------------------------------------------


def reference_heads(n_heads: int, n_kv_heads: int, rank: int, world: int) -> tuple[list[int], list[int]]:
    """labkit's answer (``parallel.tensor.shard_heads``), as lists."""
    query, kv = shard_heads(n_heads, n_kv_heads, rank, world)
    return list(query), list(kv)


def _heads(value: Any) -> list[int] | None:
    return int_list(list(value) if isinstance(value, range) else value)


def _layout_play(n_heads: int, n_kv_heads: int, world: int) -> Callable[[Any], None]:
    group = n_heads // n_kv_heads

    def play(fn: Any) -> None:
        for rank in range(world):
            query, kv = reference_heads(n_heads, n_kv_heads, rank, world)
            what = f"shard_heads({n_heads}, {n_kv_heads}, rank={rank}, world={world})"
            given = items_of(fn(n_heads, n_kv_heads, rank, world), ("query_heads", "kv_heads"))
            got_query, got_kv = (_heads(v) for v in given)
            if got_query is None:
                raise AssertionError(f"{what}: query_heads: expected a list of ints, got {_short(given[0])}")
            if (got_query, got_kv) == (kv, query) != (query, kv):
                raise AssertionError(f"{what}: expected ({query}, {kv}), got ({got_query}, {got_kv}): the two lists "
                                     "are swapped; return (query_heads, kv_heads), the query heads first")
            if got_query != query:
                raise AssertionError(f"{what}: query_heads: expected {query}, got {got_query}"
                                     + _query_why(got_query, n_heads, rank, world))
            if got_kv is None:
                raise AssertionError(f"{what}: kv_heads: expected a list of ints, got {_short(given[1])}")
            if got_kv != kv:
                raise AssertionError(f"{what}: kv_heads: expected {kv}, got {got_kv}: "
                                     + _kv_why(got_kv, kv, query, n_kv_heads, group, world))
    return play


def _query_why(got: list[int], n_heads: int, rank: int, world: int) -> str:
    if got == list(range(rank, n_heads, world)):
        mine = share(n_heads, rank, world)
        return (f": this is a round robin, one head in {world} from head {rank}; a rank's share is contiguous, "
                f"heads {mine.start} .. {mine.stop - 1}, so that a group of query heads, which share a KV head, "
                "stays on one rank")
    if got == list(range(n_heads)):
        return f": these are all the heads; each rank computes its share, {n_heads // world} of them"
    return ""


def _kv_why(got: list[int], kv: list[int], query: list[int], n_kv_heads: int, group: int, world: int) -> str:
    reads = f"its query heads {query} read KV heads {kv} (query head h reads h // {group})"
    missing, extra = sorted(set(kv) - set(got)), sorted(set(got) - set(kv))
    if got == list(range(got[0] if got else 0, n_kv_heads, world)) and len(got) > 1:
        return (f"this is a round robin, one KV head in {world}; {reads}, a contiguous run, for the query heads "
                "of a group, which share a KV head, are neighbours")
    if missing and world > n_kv_heads:
        return (f"{reads}, which it does not hold. With more ranks ({world}) than KV heads ({n_kv_heads}) the KV "
                "heads cannot be split: each is replicated on the ranks whose query heads read it, one per rank")
    if missing:
        return f"{reads}; a rank must hold each KV head its query heads read"
    if got == list(range(n_kv_heads)) and world > 1:
        return (f"every rank holds all {n_kv_heads} KV heads. Holding them all, a rank has the ones its query heads "
                f"read, so attention comes out right, but it caches keys and values those heads never read: "
                f"{n_kv_heads // len(kv)} times the KV-cache memory it needs, the memory a server batches requests "
                f"with. Keep only the KV heads its query heads {query} read: {kv} (query head h reads h // {group})")
    if extra:
        return (f"KV heads {extra} are read by no query head of this rank; {reads}. Their keys and values would "
                "take cache memory for nothing")
    return "the KV heads in ascending order, each once"


def _sharding_cases() -> list[Scenario]:
    layouts = [  # label, n_heads, n_kv_heads, world, what the case tests
        ("MHA on 1 rank: 4 heads", 4, 4, 1, "one rank holds every query head and every KV head"),
        ("MHA on 2 ranks: 8 heads", 8, 8, 2,
         "8 query heads over 2 ranks, 4 each, contiguous: rank 0 heads 0-3; in MHA query head h reads KV head h, "
         "so each rank holds the 4 KV heads of its own query heads, and no others"),
        ("GQA on 2 ranks: 8 query heads, 4 KV heads", 8, 4, 2,
         "groups of 2 query heads share a KV head: rank 0's query heads 0-3 read KV heads 0 and 1"),
        ("GQA on 2 ranks: 8 query heads, 2 KV heads", 8, 2, 2, "as many ranks as KV heads: one KV head each"),
        ("GQA on 4 ranks: 8 query heads, 2 KV heads, replicated", 8, 2, 4,
         "more ranks than KV heads: 2 KV heads cannot be split 4 ways. Ranks 0 and 1 (query heads 0-3) both read "
         "KV head 0, ranks 2 and 3 KV head 1: each KV head is replicated on the ranks that read it"),
        ("MQA on 4 ranks: 8 query heads, 1 KV head", 8, 1, 4, "MQA: every query head reads KV head 0, so every rank "
                                                              "holds it, a copy each"),
        ("MHA on 8 ranks: 8 heads", 8, 8, 8, "one query head and its KV head per rank"),
        ("Llama-3.1-8B on 8 ranks: 32 query heads, 8 KV heads", 32, 8, 8,
         "4 query heads per rank, a group of 4 sharing one KV head: one KV head each"),
        ("Qwen2.5-7B on 4 ranks: 28 query heads, 4 KV heads", 28, 4, 4,
         "7 query heads per rank, a group of 7 per KV head: the numbers need not be powers of 2"),
        ("GQA on 8 ranks: 16 query heads, 2 KV heads, replicated", 16, 2, 8,
         "each KV head on 4 ranks: rank r's query heads 2r, 2r + 1 read KV head 2r // 8"),
        ("MQA on 8 ranks: 8 query heads, 1 KV head", 8, 1, 8, "eight copies of the one KV head, one per rank"),
    ]
    return [Scenario(label, _layout_play(n_heads, n_kv_heads, world), hint=hint)
            for label, n_heads, n_kv_heads, world, hint in layouts]


# ex10.3 ------------------------------------------------------------------------------------------


def bubble_by_schedule(stages: int, micro_batches: int) -> float:
    """The idle share of a pipeline schedule laid out slot by slot: stage s runs micro-batch j in time slot
    s + j (it needs stage s - 1's output for j, and finishes j - 1 first); the idle slots are counted."""
    busy = {(stage, stage + batch) for stage in range(stages) for batch in range(micro_batches)}
    slots = 1 + max(slot for _, slot in busy)
    idle = sum((stage, slot) not in busy for stage in range(stages) for slot in range(slots))
    return idle / (stages * slots)


def ring_by_steps(nbytes: float, world: int, latency_s: float, bandwidth: float) -> float:
    """A ring all-reduce run step by step on W ranks, each holding one number per piece (the piece's
    stand-in): every step each rank sends a piece of nbytes / W bytes to the next, all at once, and the
    step takes latency_s + the piece's bytes / bandwidth. Reduce-scatter adds what arrives, all-gather
    keeps it; the run checks every rank ends with every sum."""
    values = [[float(rank * world + piece) for piece in range(world)] for rank in range(world)]
    sums = [sum(values[rank][piece] for rank in range(world)) for piece in range(world)]
    seconds = 0.0
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(world - 1):
            sent = [(rank, (rank - step + (phase == "all-gather")) % world) for rank in range(world)]
            arriving = [values[rank][piece] for rank, piece in sent]
            for (rank, piece), value in zip(sent, arriving):
                after = (rank + 1) % world
                values[after][piece] = values[after][piece] + value if phase == "reduce-scatter" else value
            seconds += latency_s + nbytes / world / bandwidth
    assert all(row == sums for row in values), "the ring did not leave every rank every sum"
    return seconds


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 + 1e-9 * abs(b)


def _judge_number(what: str, got: Any, want: float, name: Callable[[float], str | None], unit: str = "") -> None:
    """``got`` must be the number ``want``; ``name(value)`` says what a wrong value is, if it knows."""
    value = number_of(got, what)
    if not _near(value, want):
        why = name(value)
        raise AssertionError(f"{what}: expected {want:.6g}{unit}, got {value:.6g}{unit}" + (f": {why}" if why else ""))


def _every_fit(mistakes: list[tuple[float, str]]) -> Callable[[float], str | None]:
    """What each of ``mistakes`` (a wrong value, what it is) that a value equals says, in order: one value
    can fit two slips at one case's sizes (32 query heads over 8 KV heads: a group of 4, half the KV heads)."""
    def name(value: float) -> str | None:
        texts = list(dict.fromkeys(text for wrong, text in mistakes if _near(value, wrong)))
        return "; or ".join(texts) if texts else None
    return name


def _value_at(method: Callable[..., Any], args: tuple) -> float | None:
    """``method(*args)`` as a float; None where it raises or gives no number."""
    try:
        return float(method(*args))
    except Exception:  # a student's code: whatever it raises at the probe, no mistake is named
        return None


def _formula_fit(method: Callable[..., Any], args: tuple, mistakes: list[tuple[Callable[..., float], str]],
                 probe: tuple) -> Callable[[float], str | None]:
    """What the first of ``mistakes`` (a formula of the method's arguments, what it is) says whose formula gives a
    value at ``args`` and what ``method`` gives at ``probe`` too. One value can fit two slips (with one stage,
    (m - 1) / m is both p and m swapped and p - 1 / (m + p - 1), its brackets left out); two points seldom do."""
    def name(value: float) -> str | None:
        fitting = [(formula, text) for formula, text in mistakes if _near(value, formula(*args))]
        at_probe = _value_at(method, probe) if fitting else None
        return next((text for formula, text in fitting if at_probe is not None and _near(at_probe, formula(*probe))),
                    None)
    return name


BUBBLE_PROBE = (3, 5)  # stages, micro_batches: where the formulas below all differ
BUBBLE_MISTAKES = [
    (lambda p, m: (p - 1) / m, "that is the idle time over the busy time of a stage, (p - 1) / m; the fraction is "
                               "over the whole schedule, which lasts m + p - 1 slots"),
    (lambda p, m: (m - 1) / (m + p - 1), "stages and micro_batches are swapped: the idle slots of a stage are p - 1, "
                                         "one for each stage before it (waiting to start) or after it (done early)"),
    (lambda p, m: (p - 1) / (m + p), "the schedule lasts m + p - 1 slots, not m + p: the last micro-batch enters the "
                                     "last stage p - 1 slots after the first stage took it"),
    (lambda p, m: p - 1 / (m + p - 1), "that is stages - 1 / (m + p - 1): / binds before -, so the numerator needs "
                                       "its brackets, (stages - 1) / (...)"),
    (lambda p, m: 100 * (p - 1) / (m + p - 1), "that is a percentage; a share of the time is a fraction, between 0 "
                                               "and 1"),
]


def _ring(nbytes: float, world: int, latency_s: float, bandwidth: float) -> float:
    return 2 * (world - 1) * (latency_s + nbytes / (world * bandwidth))


RING_PROBE = (1e6, 4, 1e-5, 1e9)  # nbytes, world, latency_s, bandwidth: where the formulas below all differ
RING_MISTAKES = [
    (lambda n, w, lat, bw: (w - 1) * (lat + n / (w * bw)),
     "that is half of it, one phase: a ring all-reduce is a reduce-scatter (W - 1 steps that add the pieces) then an "
     "all-gather (W - 1 steps that share the sums): 2 (W - 1) steps"),
    (lambda n, w, lat, bw: 2 * (w - 1) * (lat + n / bw),
     "each step sends the whole message; a rank sends one piece of nbytes / W bytes per step"),
    (lambda n, w, lat, bw: 2 * w * (lat + n / (w * bw)),
     "2 W steps; each phase takes W - 1: a piece starts on one rank and needs W - 1 hops to reach the other W - 1"),
    (lambda n, w, lat, bw: lat + 2 * (w - 1) * n / (w * bw),
     "the latency counted once; each of the 2 (W - 1) steps is a message of its own, and pays it"),
    (lambda n, w, lat, bw: 2 * (w - 1) * n / (w * bw),
     "the latency is left out: every step pays it, 2 (W - 1) of them"),
    (lambda n, w, lat, bw: 2 * (w - 1) / w * (lat + n / bw),
     "that is 2 (W - 1) / W x (latency + nbytes / bandwidth): the / W cuts the latency too, but only the bytes are cut "
     "in W pieces; each of the 2 (W - 1) steps pays the whole latency"),
    (lambda n, w, lat, bw: 2 * (w - 1) * (lat + 8 * n / (w * bw)),
     "that counts bits: nbytes is in bytes and bandwidth in bytes per second, so nbytes / (W x bandwidth) is seconds"),
    (lambda n, w, lat, bw: 2 * (w - 1) * lat + 2 * n / bw,
     "the bytes term is 2 x nbytes / bandwidth: the (W - 1) / W is missing. Each of the 2 (W - 1) steps sends a piece "
     "of nbytes / W, 2 (W - 1) / W x nbytes in all"),
    (lambda n, w, lat, bw: 2 * (w - 1) * lat + (w - 1) * n / (w * bw),
     "the latency is paid 2 (W - 1) times but the bytes only W - 1 times; both phases send a piece of nbytes / W at "
     "each of their steps, so the bytes term has the factor 2 as well"),
    (lambda *args: 1e3 * _ring(*args), "that is in milliseconds; return seconds"),
    (lambda *args: 1e6 * _ring(*args), "that is in microseconds; return seconds"),
]


def _bubble_play(stages: int, micro_batches: int) -> Callable[[Any], None]:
    p, m = stages, micro_batches
    want = bubble_by_schedule(p, m)
    what = f"bubble_fraction(stages={p}, micro_batches={m})"

    def judge(cls: Any) -> None:
        got = cls.bubble_fraction(p, m)
        if isinstance(got, int) and not isinstance(got, bool) and want != int(want):
            raise AssertionError(f"{what}: expected {want:.6g}, got the int {got}: // divides and drops the fraction; "
                                 "a share of the time is a fraction, so divide with /")
        _judge_number(what, got, want, _formula_fit(cls.bubble_fraction, (p, m), BUBBLE_MISTAKES, BUBBLE_PROBE))
    return judge


def _ring_play(nbytes: float, world: int, latency_s: float, bandwidth: float) -> Callable[[Any], None]:
    args = (nbytes, world, latency_s, bandwidth)
    want = ring_by_steps(*args)
    return lambda cls: _judge_number(
        f"ring_allreduce_seconds(nbytes={nbytes:g}, world={world}, latency_s={latency_s:g}, bandwidth={bandwidth:g})",
        cls.ring_allreduce_seconds(*args), want,
        _formula_fit(cls.ring_allreduce_seconds, args, RING_MISTAKES, RING_PROBE), " s")


def _cost_cases() -> list[Scenario]:
    bubbles = [
        ("one stage, 8 micro-batches: no bubble", 1, 8, "a single stage is never idle: 0"),
        ("4 stages, 1 micro-batch", 4, 1, "one micro-batch walks through the stages one after another: each stage "
                                          "works 1 slot of 4, and sits idle 3 (p - 1)"),
        ("4 stages, 4 micro-batches", 4, 4, "the schedule lasts m + p - 1 = 7 slots, each stage busy 4 of them: "
                                            "3/7 idle"),
        ("8 stages, 32 micro-batches", 8, 32, "more micro-batches shrink the bubble: 7 idle slots of 39"),
        ("2 stages, 3 micro-batches", 2, 3, "the first stage idles at the end, the second at the start: 1 slot of 4 "
                                            "each"),
    ]
    rings = [  # label, bytes, W, latency, bandwidth, hint
        ("2 ranks, 16 KB over NVLink (a decode step's all-reduce)", 16384, 2, 1.9e-6, 450e9,
         "2 ranks: one step of reduce-scatter, one of all-gather, each sending a piece of 8 KB and each paying the "
         "latency"),
        ("4 ranks, 64 MB over PCIe", 64e6, 4, 2.5e-6, 31.5e9,
         "6 steps of 16 MB pieces: a large message is bandwidth-bound, about 2 (W - 1) / W x nbytes / bandwidth"),
        ("8 ranks, 1 MB over InfiniBand", 1e6, 8, 4e-6, 50e9,
         "14 steps of 125 KB pieces, each paying the latency too"),
        ("1 rank: nothing to reduce", 1e6, 1, 2e-6, 100e9, "one rank already holds the sum: no step, 0 seconds"),
    ]
    return [*(Scenario(f"bubble: {label}", _bubble_play(p, m), hint=hint) for label, p, m, hint in bubbles),
            *(Scenario(f"ring all-reduce: {label}", _ring_play(nbytes, w, lat, bw), hint=hint)
              for label, nbytes, w, lat, bw, hint in rings)]


# ex10.4 ------------------------------------------------------------------------------------------


def cache_bytes(config: ModelConfig, tokens: int, dtype: torch.dtype) -> int:
    """The bytes a labkit ``ContiguousKVCache`` of one sequence holds for its first ``tokens`` tokens: its
    key and value tensors' slices, counted."""
    cache = ContiguousKVCache(config, 1, tokens, dtype)
    return cache.k[:, :, :, :tokens].nbytes + cache.v[:, :, :, :tokens].nbytes


def _shipped_judge(layers: int, heads: int, kv_heads: int, head_dim: int, tokens: int, size: float, want: float
                   ) -> Callable[[Any], None]:
    elements = layers * kv_heads * head_dim * tokens
    # a fraction made whole: said alone where it fits, for 2 x elements x 1 fits a count of elements too, which the
    # cases of whole bytes, passed before, rule out
    whole = [] if size == int(size) else [
        (2 * elements * rounded, f"bytes_per_element is {size:g} here, a fraction: multiply by it as it is, with no "
                                 "int(), //, rounding or max(1, ...) on the way") for rounded in (0, 1)]
    mistakes = [
        (elements * size, "that is the keys alone (or the values alone); each token has a key AND a value per layer "
                          "and KV head: the factor 2"),
        (2 * layers * heads * head_dim * tokens * size, f"that counts the {heads} query heads; only the "
                                                        f"{kv_heads} KV heads have keys and values in the cache"),
        (2 * layers * (heads // kv_heads) * head_dim * tokens * size,
         f"that counts heads // kv_heads = {heads // kv_heads} KV heads, the query heads that share one; the cache "
         f"holds all {kv_heads} KV heads' keys and values"),
        (2 * kv_heads * head_dim * tokens * size, f"that is one layer's; every one of the {layers} layers keeps its "
                                                  "own keys and values"),
        (2 * layers * kv_heads * head_dim * size, f"that is one token's; each of the prompt's {tokens} tokens has its "
                                                  "own keys and values"),
        (2 * elements, "that is a count of elements; times bytes_per_element for bytes"),
        (2 * elements * size * 8, "that is bits; bytes_per_element counts bytes"),
        (2 * layers * kv_heads * head_dim * (tokens + 1) * size,
         f"that counts {tokens} + 1 tokens; the prefill worker ships the prompt's {tokens} tokens' keys and values. "
         "The first sampled token's keys and values are computed on the decode worker, when it feeds that token"),
        (2 * layers * kv_heads * head_dim * (tokens - 1) * size,
         f"that counts {tokens} - 1 tokens; a prefill feeds every token of the prompt, the last one too, and caches "
         "its key and value (the token a generation never feeds is the last one it samples)"),
        *[(2 * elements * size / scale, f"that is in {unit}; return bytes") for unit, scale in (
            ("megabytes (10^6 bytes)", 1e6), ("MiB (2^20 bytes)", 2**20), ("gigabytes (10^9 bytes)", 1e9),
            ("GiB (2^30 bytes)", 2**30))],
    ]
    fraction, others = _every_fit(whole), _every_fit(mistakes)
    return lambda got: _judge_number("the bytes shipped", got, want, lambda value: fraction(value) or others(value),
                                     " B")


def _shipped_cases() -> list[Case]:
    published = [  # label, preset, cache dtype, prompt tokens, hint
        ("Qwen2.5-7B, a 2,048-token prompt, fp32", "Qwen2.5-7B", "fp32", 2048,
         "GQA: 28 query heads but 4 KV heads; a key and a value per layer (28 here), KV head and token, head_dim (128) "
         "elements each, 4 bytes an element"),
        ("Llama-3.2-1B, a 512-token prompt, fp32", "Llama-3.2-1B", "fp32", 512,
         "16 layers of 8 KV heads (32 query heads), head_dim 64, 4 bytes an element"),
        ("Llama-3.1-8B, a 4,096-token prompt, bf16", "Llama-3.1-8B", "bf16", 4096,
         "bf16: 2 bytes an element; 32 layers of 8 KV heads"),
        ("Llama-2-7B (MHA), a 1,000-token prompt, fp16", "Llama-2-7B", "fp16", 1000,
         "MHA: as many KV heads as query heads, 32"),
        ("Llama-3.1-70B, a 32K-token prompt, fp8", "Llama-3.1-70B", "fp8", 32768,
         "80 layers, 8 KV heads, 1 byte an element: a long prompt ships gigabytes"),
        ("Llama-3.1-8B, a 1,000-token prompt, an INT4 cache", "Llama-3.1-8B", "int4", 1000,
         "4 bits: half a byte an element, so bytes_per_element is 0.5"),
    ]
    cases = []
    for label, name, dtype, tokens, hint in published:
        shape, size = MODEL_PRESETS[name], memory.bytes_per_element(dtype)
        args = (shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.head_dim, tokens, size)
        cases.append(JudgedCase(label, args, hint=hint, judge=_shipped_judge(
            *args, memory.kv_cache_bytes(shape, tokens, 1, dtype))))
    labkit_models = [  # label, config, dtype, tokens, hint
        ("a labkit model's cache (2 layers, 4 heads, 2 KV heads), 13 tokens, float32",
         ModelConfig(64, 32, 2, 4, 2, 64, 64), torch.float32, 13,
         "counted from a ContiguousKVCache's own tensors: its k and v, [layers, batch, kv_heads, tokens, head_dim] "
         "each, 4 bytes an element"),
        ("a labkit model's cache (3 layers, MQA: 1 KV head of 8 heads), 7 tokens, bfloat16",
         ModelConfig(64, 64, 3, 8, 1, 64, 64), torch.bfloat16, 7, "MQA: one KV head, 2 bytes an element"),
    ]
    for label, config, dtype, tokens, hint in labkit_models:
        size = torch.empty(0, dtype=dtype).element_size()
        args = (config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim, tokens, size)
        want = cache_bytes(config, tokens, dtype)
        cases.append(JudgedCase(label, args, hint=hint, judge=_shipped_judge(*args, want)))
    return cases


EXERCISES = [
    Exercise(
        id="ex10.1", title="Column- and row-parallel linear layers", points=2, function="TensorParallel",
        methods=("column_parallel", "row_parallel"), cases=_tensor_parallel_cases, timeout_s=30,
        recipe="In both: s = the features split // world, after raising ValueError when world does not divide "
               "them. column_parallel: return x @ weight[rank * s:(rank + 1) * s].T (weight.shape[0] split). "
               "row_parallel: return x_part @ weight[:, rank * s:(rank + 1) * s].T (weight.shape[1] split).",
    ),
    Exercise(
        id="ex10.2", title="Sharding attention's heads", points=2, function="shard_heads",
        cases=_sharding_cases, timeout_s=30,
        recipe="q = n_heads // world; query = list(range(rank * q, (rank + 1) * q)); group = n_heads // n_kv_heads; "
               "kv = sorted({h // group for h in query}) (the KV heads the rank's query heads read: its contiguous "
               "share when world <= n_kv_heads, one replicated head otherwise). Return query, kv.",
    ),
    Exercise(
        id="ex10.3", title="The pipeline bubble and a ring all-reduce's time", points=1, function="ParallelCosts",
        methods=("bubble_fraction", "ring_allreduce_seconds"), cases=_cost_cases, timeout_s=30,
        recipe="bubble_fraction: return (stages - 1) / (micro_batches + stages - 1). ring_allreduce_seconds: return "
               "2 * (world - 1) * (latency_s + nbytes / (world * bandwidth)).",
    ),
    Exercise(
        id="ex10.4", title="The KV cache a disaggregated request ships", points=1, function="kv_bytes_shipped",
        cases=_shipped_cases, timeout_s=30,
        recipe="return 2 * n_layers * n_kv_heads * head_dim * prompt_tokens * bytes_per_element: a key and a value "
               "per layer, KV head and token; n_heads does not enter.",
    ),
]
