"""Notebook 08 (compilation): the static cache's plan, a decode loop's bookkeeping that compiles
whole, and padding a batch to its CUDA-graph bucket.

ex08.1 and ex08.2 are checked twice: for their values, eagerly, and for being capturable, by compiling them
with ``fullgraph=True`` and a backend that generates no code (``compiled_whole``): a graph break, a value
read into a Python number (``int(t)``, ``.item()``), or an operation whose output shape depends on the data,
fails with the reason in plain words.
"""
from __future__ import annotations

import os
import re
import types
from typing import Any, Callable

import torch
from torch import Tensor

from labkit.cuda_graphs import bucket_for, buckets, pad_to_bucket
from labkit.exercises.spec import Case, Exercise, Scenario, assert_matches, items_of
from labkit.model import ContiguousKVCache, ModelConfig, Transformer, forward_tokens
from labkit.static_cache import StaticKVCache, StaticPlan

# ex08.1 ------------------------------------------------------------------------------------------


def _reference_plan(positions: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """What ``StaticKVCache.plan`` computes for ``positions`` on a cache of ``max_len`` slots."""
    config = ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8,
                         max_seq_len=max(64, max_len))
    plan = StaticKVCache(config, positions.shape[0], max_len).plan(positions)
    return plan.slots, plan.mask


def _plan_case(label: str, positions: list[list[int]], max_len: int, hint: str) -> Case:
    positions_t = torch.tensor(positions)
    return Case(label, (positions_t, max_len), _reference_plan(positions_t, max_len), unchanged=True, hint=hint)


_TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
# a batch of two rows through a static cache of 8 slots: (tokens, positions) per step; -1 is padding
_STEPS = [
    ([[11, 12, 13, 14, 15], [21, 22, 23, 0, 0]], [[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]]),  # prefill, row 1 padded
    ([[16], [24]], [[5], [3]]),  # a decode step
    ([[17, 18, 0], [25, 0, 0]], [[6, 7, -1], [4, -1, -1]]),  # row 0 reaches the last slot, padding beside it
]


def _tiny_model() -> Transformer:
    with torch.random.fork_rng():
        torch.manual_seed(8)
        return Transformer(_TINY).eval()


def _attend_through_plan(static_plan: Callable[..., Any]) -> None:
    """Run a small random model through a ``StaticKVCache`` whose plans are the student's slots and
    mask, and compare every real token's logits with the contiguous cache's, row by row."""
    model, max_len = _tiny_model(), 8
    cache = StaticKVCache(_TINY, 2, max_len)
    references = [ContiguousKVCache(_TINY, 1, max_len) for _ in range(2)]
    for number, (tokens, positions) in enumerate(_STEPS, 1):
        positions_t = torch.tensor(positions)
        slots, mask = static_plan(positions_t.clone(), max_len)
        with torch.inference_mode():
            logits = model(torch.tensor(tokens), plan=StaticPlan(cache, positions_t, slots, mask))
        if not torch.isfinite(logits).all():
            raise AssertionError(f"step {number} (positions {positions}): the logits hold NaN or inf. A padding "
                                 "query must see at least one slot (labkit's plan lets it see them all: its output "
                                 "is ignored), or its softmax is over nothing: 0 / 0")
        for row in range(2):
            real = [i for i, p in enumerate(positions[row]) if p >= 0]
            with torch.inference_mode():
                expected = forward_tokens(model, [tokens[row][i] for i in real], positions[row][real[0]],
                                          references[row])
            got = logits[row, real]
            if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
                worst = int((got - expected).abs().amax(-1).argmax())
                raise AssertionError(
                    f"step {number} (positions {positions}): row {row}'s token at position "
                    f"{positions[row][real[worst]]} gets other logits through the static cache than through the "
                    f"contiguous one (largest difference {(got - expected).abs().max():.3g}): it attended to other "
                    "keys, or its own key was overwritten")


def _plan_compiles(static_plan: Callable[..., Any]) -> None:
    positions = torch.tensor([[3, 4, 5], [0, 1, -1]])
    _compiled_gives(static_plan, (positions, 8), _reference_plan(positions, 8), ("slots", "mask"))


def _plan_cases() -> list[Case | Scenario]:
    return [
        _plan_case("a decode step: one token per row at positions 5, 2 and 0, max_len 8", [[5], [2], [0]], 8,
                   hint="slots are the positions themselves; the mask [B, 1, T, max_len] lets a query at position p "
                        "see slots 0..p, its own included (<=, not <: its key was written in this very step, and a "
                        "token at position 0 would otherwise see nothing)"),
        _plan_case("a prefill of 4 tokens: causal within the step", [[0, 1, 2, 3]], 8,
                   hint="each query of the step has its own row of the mask: compare the slots [max_len] with the "
                        "positions shaped [B, 1, T, 1], so the comparison broadcasts to [B, 1, T, max_len]"),
        _plan_case("a batch with padding (-1), max_len 8", [[3, 4, 5], [0, 1, -1], [-1, -1, -1]], 8,
                   hint="if the slots differ: padding goes to the spare slot max_len (the cache keeps max_len + 1 "
                        "slots and reads the first max_len), not max_len - 1, a real slot, and not -1 left as it is, "
                        "which lands on the spare slot only because Python counts from the end. If the mask differs: "
                        "a padding query sees every slot (| (position < 0)); with none, its softmax is over nothing, "
                        "0 / 0 (PyTorch's SDPA returns zeros there, a hand-written kernel such as lab 07's gives "
                        "NaN)"),
        _plan_case("another max_len: 5", [[4, -1], [1, 2]], 5,
                   hint="take the spare slot and the mask's width from max_len, the argument, not from a number of "
                        "your own"),
        Scenario("a random model through a static cache planned by your function, against the contiguous cache",
                 _attend_through_plan,
                 hint="a prefill with padding beside real tokens, a decode step, then a row that reaches the last "
                      "slot (7) with a padding token in the same step: if only this fails, padding is written to a "
                      "real slot (max_len - 1) and overwrites that row's own key"),
        Scenario("compiles whole: torch.compile(static_plan, fullgraph=True) captures it in one graph", _plan_compiles,
                 hint="the values are right when run eagerly; inside a compiled step the plan may not read a position "
                      "on the host (.tolist(), .item(), int(...), a Python if or loop over the values): compare the "
                      "positions with torch.arange(max_len) and pick the slots with torch.where, for every row at "
                      "once"),
    ]


# ex08.2 ------------------------------------------------------------------------------------------


def _unbacked(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes of a captured graph, in order, whose output depends on the data in a way the host must
    learn: a number read from a tensor (``int(t)``, ``.item()``, traced as a symbol of unknown value),
    or a tensor whose shape is such a number."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    symbolic = (Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    return [node for node in gm.graph.nodes
            if isinstance(value := node.meta.get("example_value"), symbolic) and free_unbacked_symbols(value)]


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)(?:\n[ \t]*(?!File ")(\S.*))?')
_CAUSED_BY = re.compile(r"Caused by: (.+?)\s+# \S*?:(\d+) in (\S+)")
_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")  # with its separator: torchvision is not torch


def _where(text: str) -> str:
    """' (line 7 of advance: `if done.all():`)' from a message or stack trace of TorchDynamo's, or '':
    the innermost frame outside torch (a builtin such as any() is traced through torch's own copy of it)."""
    frames = _FRAME.findall(text)
    if frames:
        _, line, name, code = ([f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames)[-1]
    elif found := _CAUSED_BY.findall(text):
        code, line, name = found[-1]
    else:
        return ""
    return f" (line {line} of {name}" + (f": `{code.strip()}`)" if code else ")")


def _explain_break(error: Exception) -> str:
    """What a TorchDynamo error means, in plain words, with the line it names."""
    text = str(error)
    where = _where(text)
    if "Data-dependent branching" in text or "generic_jump" in text:
        return (f"it does not compile whole: a Python if, while, and, or, or not decides on a tensor's value{where}. "
                "The compiler traces with shapes, not values, so it cannot know which way to go. Compute both "
                "outcomes and pick one per row with torch.where; combine conditions with |, & and ~")
    if any(s in text for s in ("data-dependent", "item()", "Tensor.item", "tolist", "__bool__", "Could not guard")):
        return (f"it does not compile whole: a tensor's value is read into Python (.item(), .tolist(), int(...) or "
                f"bool(...)) and then used by Python{where}. That needs the number on the host in the middle of "
                "the step. Keep it a tensor: compare tensors with tensors, pick with torch.where")
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return f"it does not compile whole{where}: TorchDynamo says: {first}"


def compiled_whole(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` compiled whole (``fullgraph=True``) by a backend that runs the captured graph as
    it is (no code generated: fast); an AssertionError in plain words on a graph break, or where the
    graph reads a tensor's value into a number (``int(t)``, ``.item()``) or holds an operation whose
    output shape depends on the data (a boolean mask as an index, ``nonzero``): it compiles, but a
    CUDA graph cannot record it. A fresh copy of ``fn`` is compiled each time, so a function fixed
    since, or checked before, is traced again."""
    code = getattr(fn, "__code__", None)
    if isinstance(fn, types.FunctionType) and code is not None:
        fn = types.FunctionType(code.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    shaped: list[torch.fx.Node] = []

    def inspect(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        shaped.extend(_unbacked(gm))
        return gm.forward
    try:
        result = torch.compile(fn, fullgraph=True, backend=inspect, dynamic=False)(*args)
    except torch._dynamo.exc.TorchDynamoException as error:
        raise AssertionError(_explain_break(error)) from None
    if shaped:
        raise AssertionError(_explain_unbacked(shaped[0]))
    return result


def _explain_unbacked(node: torch.fx.Node) -> str:
    """What the first data-dependent node of a graph that compiled means, in plain words, with its line."""
    where = _where(node.meta.get("stack_trace") or "")
    if not isinstance(node.meta.get("example_value"), Tensor):
        return (f"it compiles, but a tensor's value is read into a Python number (int(...), float(...) or "
                f".item()){where}: the step then waits for the host to learn it, and a CUDA graph cannot record it. "
                "Keep it a tensor: compare tensors with tensors, pick with torch.where")
    return (f"it compiles, but an operation{where} makes a tensor whose shape depends on the values (how many "
            "entries of a mask are True): boolean-mask indexing and nonzero do that. The step then waits for the host "
            "to learn the size, and a CUDA graph cannot record it. Keep every row and choose per row with "
            "torch.where(condition, a, b)")


def _rows(tokens: list[int], positions: list[int], finished: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    return torch.tensor(tokens), torch.tensor(positions), torch.tensor(finished)


def _advance_case(label: str, before: tuple[list[int], list[int], list[bool]], eos_id: int,
                  after: tuple[list[int], list[bool]], hint: str) -> Case:
    """Every case checks that the inputs are left as they were: the spec asks for new tensors."""
    return Case(label, (*_rows(*before), eos_id), (torch.tensor(after[0]), torch.tensor(after[1])),
                unchanged=True, hint=hint)


def _compiled_gives(fn: Callable[..., Any], args: tuple, expected: tuple[Tensor, ...], names: tuple[str, ...]) -> None:
    """``fn(*args)`` compiled whole returns ``expected``, item by item; AssertionError naming the item otherwise."""
    fn(*(a.clone() if isinstance(a, Tensor) else a for a in args))  # eagerly first: a stub stops here, as itself
    compiled = compiled_whole(fn, *args)
    for name, got, want in zip(names, items_of(compiled, names), expected):
        try:
            assert_matches(got, want, 0, 0)
        except AssertionError as error:
            raise type(error)(f"compiled, {name}: {error}") from None  # a WrongType stays one


def _compiles(advance: Callable[..., Any]) -> None:
    _compiled_gives(advance, (*_rows([2, 9, 2, 5, 0, 2], [7, 3, 12, 4, 9, 0], [False, False, True, True, False, False]),
                              2),
                    (torch.tensor([7, 4, 12, 4, 10, 0]), torch.tensor([True, False, True, True, False, True])),
                    ("positions", "finished"))


def _advance_cases() -> list[Case | Scenario]:
    return [
        _advance_case("no row finishes: every row moves on by one", ([5, 7, 9], [3, 4, 10], [False] * 3), 2,
                      ([4, 5, 11], [False] * 3),
                      hint="a running row's next token goes one position further; with no eos and nothing finished, "
                           "positions + 1 and finished unchanged, as new tensors (positions += ... changes the "
                           "caller's). Python's and, or and not ask a tensor of several values for one truth value "
                           "('Boolean value of Tensor ... is ambiguous'): combine tensors with |, & and ~"),
        _advance_case("rows that produce eos (2) finish and keep their position", ([2, 7, 2, 4], [3, 4, 10, 0],
                                                                                    [False] * 4), 2,
                      ([3, 5, 10, 1], [True, False, True, False]),
                      hint="a row whose new token is eos_id is finished from now on: finished | (tokens == eos_id); "
                           "use the updated finished to choose the positions, so a row that just finished does not "
                           "move on"),
        _advance_case("finished rows stay finished and keep their position, whatever they produce",
                      ([9, 2, 2, 6], [8, 4, 6, 2], [True, False, True, True]), 2,
                      ([8, 4, 6, 2], [True, True, True, True]),
                      hint="a finished row's token is padding, not text: it must neither move its position nor "
                           "unfinish the row (combine with the old finished, do not replace it). Mind Python's "
                           "precedence: | binds tighter than ==, so finished | tokens == eos_id means "
                           "(finished | tokens) == eos_id; write finished | (tokens == eos_id)"),
        _advance_case("eos_id is an argument: 0 here", ([0, 2, 5], [1, 2, 3], [False, False, False]), 0,
                      ([1, 3, 4], [True, False, False]),
                      hint="compare with eos_id, the argument, not a number of your own"),
        Scenario("compiles whole: torch.compile(advance, fullgraph=True) captures it in one graph", _compiles,
                 hint="the values are right when run eagerly; compiled whole, the step may not read a value on the "
                      "host (.item(), .tolist(), a Python if on a tensor) nor make a shape that depends on the "
                      "data (x[mask]): torch.where and the operators | & ~ do all of it"),
    ]


# ex08.3 ------------------------------------------------------------------------------------------


def _padded(rows: int, length: int, sizes: list[int]) -> tuple[Tensor, Tensor, list[int]]:
    generator = torch.Generator().manual_seed(rows * 31 + length)
    tokens = torch.randint(1, 100, (rows, length), generator=generator)
    positions = torch.randint(0, 50, (rows, 1), generator=generator) + torch.arange(length)
    return tokens, positions, list(sizes)


def _pad_case(label: str, rows: int, length: int, sizes: list[int], hint: str, unchanged: bool = False) -> Case:
    tokens, positions, sizes = _padded(rows, length, sizes)
    expected = pad_to_bucket(tokens, positions, bucket_for(rows, sizes))
    return Case(label, (tokens, positions, sizes), expected, unchanged=unchanged, hint=hint)


def _too_large(pad_batch: Callable[..., Any]) -> None:
    tokens, positions, sizes = _padded(20, 1, [1, 2, 4, 8, 16])
    try:
        got = pad_batch(tokens, positions, sizes)
    except ValueError as error:
        if "20" not in str(error):
            raise AssertionError(f"20 rows with buckets {sizes}: a ValueError, but its message, {str(error)!r}, "
                                 "does not say what went wrong: name the batch's size (20), and the buckets "
                                 "too") from None
        return
    shape = tuple(got[0].shape) if isinstance(got, tuple) and got and isinstance(got[0], Tensor) else got
    raise AssertionError(f"20 rows with buckets {sizes}: expected a ValueError (no bucket holds them), got {shape!r}")


def _pad_cases() -> list[Case | Scenario]:
    return [
        _pad_case("4 rows, buckets 1, 2, 4, 8: the batch fills the bucket of 4, nothing to pad", 4, 1, [1, 2, 4, 8],
                  hint="the bucket is the smallest size that holds the batch's B rows (B = tokens.shape[0]: tokens "
                       "are [B, T]): 4 here, not the largest (8) and not the next one up; a batch that fills its "
                       "bucket comes back as it is, values and dtypes (int64) alike"),
        _pad_case("3 rows, buckets 1, 2, 4, 8: one padding row", 3, 1, [1, 2, 4, 8], unchanged=True,
                  hint="the new row goes after the batch's own rows (torch.cat([tokens, padding]) along dim 0), and "
                       "is token 0 at position -1: padding, which the static cache writes to its spare slot (position "
                       "0 is a real token: it would overwrite slot 0 of that row). Keep the dtypes, int64: torch.zeros "
                       "and torch.ones make float32 unless given dtype=..."),
        _pad_case("5 rows of 2 tokens (a verification step), buckets 1, 2, 4, 8, 16", 5, 2, [1, 2, 4, 8, 16],
                  hint="pad whole rows: [5, 2] becomes [8, 2], every token of a new row at position -1"),
        _pad_case("9 rows, the sizes in no order: 32, 1, 16, 2, 4, 8", 9, 1, [32, 1, 16, 2, 4, 8],
                  hint="the smallest size that holds the batch, whatever the order of the list: not the first one "
                       "in the list that does (min over the sizes >= B)"),
        _pad_case(f"33 rows, the engine's buckets(64): {', '.join(map(str, buckets(64)))}", 33, 1, buckets(64),
                  hint="the bucket is one of the sizes given, the smallest that holds the batch: 48 here, not the "
                       "next power of two (64); past 8, the engine's buckets are multiples of 16"),
        Scenario("20 rows, buckets up to 16: no bucket holds them, a ValueError", _too_large,
                 hint="when no size holds the batch, raise ValueError saying so, with the batch's size and the "
                      "buckets (a batch cut down to a bucket would drop sequences)"),
    ]


EXERCISES = [
    Exercise(
        id="ex08.1", title="The static cache's plan", points=2, function="static_plan", returns=("slots", "mask"),
        cases=_plan_cases,
        recipe="slots = torch.where(positions >= 0, positions, max_len); query = positions[:, None, :, None]; "
               "mask = (torch.arange(max_len, device=positions.device) <= query) | (query < 0); return slots, mask.",
    ),
    Exercise(
        id="ex08.2", title="A decode loop's bookkeeping that compiles whole", points=2, function="advance",
        returns=("positions", "finished"), cases=_advance_cases,
        recipe="finished = finished | (tokens == eos_id) (a new tensor: | does not change its inputs); "
               "positions = torch.where(finished, positions, positions + 1); return positions, finished. "
               "No .item(), no Python if on a tensor, no x[mask].",
    ),
    Exercise(
        id="ex08.3", title="Padding a batch to its CUDA-graph bucket", points=1, function="pad_batch",
        returns=("tokens", "positions"), cases=_pad_cases,
        recipe="bucket = min(b for b in sizes if b >= B), or ValueError when none is; missing = bucket - B; "
               "append missing rows: torch.zeros((missing, T), dtype=tokens.dtype) to the tokens and "
               "torch.full((missing, T), -1, dtype=positions.dtype) to the positions (torch.cat along dim 0, "
               "or torch.nn.functional.pad(x, (0, 0, 0, missing), value=...)).",
    ),
]

__all__ = ["EXERCISES", "compiled_whole"]
