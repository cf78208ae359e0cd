"""What an exercise is: an id, its points, the function a student writes, and test cases.

A case calls the student's function on fixed arguments and compares the result with the
value the reference implementation in labkit returned; a scenario drives a student's class
through a sequence of operations and checks it after each. The inline check (``labkit.check``)
and the grader (``labkit.grade``) run the very same cases.

Hints come in steps. Each case carries a hint of its own: what that case tests and what its
failure suggests. The exercise's ``recipe`` (how to write the whole thing) is shown only when
the same case fails again, so a student who is one idea away gets the idea, not the answer.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Case:
    """One call of the student's function and the result it must give."""

    label: str
    args: tuple
    expected: Any
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    rtol: float = 1e-6
    atol: float = 1e-9
    after: Callable[..., None] | None = None  # inspects the arguments after the call (how it was done)
    unchanged: bool = False  # the call must leave its arguments as they were (where the spec says so)
    hint: str = ""  # what this case tests, and what failing it suggests (not the recipe)
    numbers_as_tensors: bool = False  # a 0-d tensor may stand for a number (where the spec allows it)
    within_s: float | None = None  # the call must answer this fast (where the spec asks for a way, not an answer)
    refuses: tuple[Callable[..., Any], ...] = ()  # torch functions the call may not use: the check's own reference

    def run(self, fn: Callable[..., Any]) -> None:
        """Call ``fn`` on copies of the arguments; raise AssertionError if the result is wrong, if
        ``after``, given those arguments after the call, finds it was done the wrong way, or, with
        ``unchanged``, if the call changed an argument in place."""
        args, kwargs = copy.deepcopy(self.args), copy.deepcopy(dict(self.kwargs))
        calls = _Calls(self.refuses)
        with calls if self.refuses else contextlib.nullcontext():
            got = fn(*args, **kwargs)
        if self.numbers_as_tensors:
            got = _numbers_of_scalars(got, self.expected)
        assert_matches(got, self.expected, self.rtol, self.atol)
        if calls.made is not None:
            raise SaysWhatToDo(f"the result is right, but it comes from torch's {calls.made.__name__}, the reference "
                               "the check compares with: write the arithmetic yourself")
        if self.after is not None:
            self.after(*args, **kwargs)
        if not self.unchanged:
            return
        names = _parameter_names(fn, len(args))
        for where, given, now in [*((names[i], a, b) for i, (a, b) in enumerate(zip(self.args, args))),
                                  *((k, self.kwargs[k], kwargs[k]) for k in self.kwargs)]:
            if _changed(given, now):
                raise ChangedInPlace(f"the result is right, but the call changed its argument {where} in place (an "
                                     "in-place operation such as x.sub_(...), x <<= 4 or x[...] = ...): leave the "
                                     "inputs as they were, and compute into new tensors")


class _Calls(TorchFunctionMode):
    """Notes the first call of any of ``refused`` (torch functions) while it is on."""

    def __init__(self, refused: tuple[Callable[..., Any], ...]) -> None:
        super().__init__()
        self.refused, self.made = refused, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.made is None and any(func is refused for refused in self.refused):
            self.made = func
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class Scenario:
    """A case that drives the student's class through a sequence of operations: ``play`` raises
    AssertionError, naming the operation, at the first thing that goes wrong."""

    label: str
    play: Callable[[Any], None]
    hint: str = ""  # what this scenario tests, and what failing it suggests (not the recipe)

    def run(self, fn: Callable[..., Any]) -> None:
        self.play(fn)


@dataclass(frozen=True)
class Exercise:
    """A graded exercise: ``ex00.1`` is exercise 1 of notebook 00."""

    id: str
    title: str
    points: int
    function: str  # the name the student's cell defines
    cases: Callable[[], Sequence[Case | Scenario]]  # built on demand: cases may hold tensors
    recipe: str  # how to write it, step by step: shown after the same case fails twice
    timeout_s: float = 60.0
    methods: tuple[str, ...] = ()  # when ``function`` is a class: the methods the student writes in it
    returns: tuple[str, ...] = ()  # when it returns a tuple: the names of its items, for messages

    @property
    def lab(self) -> str:
        """The notebook this exercise belongs to: ``ex03.2`` -> ``03``, ``ex06b.1`` -> ``06b``."""
        return self.id[2:].split(".")[0]


def _numbers_of_scalars(got: Any, expected: Any) -> Any:
    """``got`` with each 0-d tensor that stands where ``expected`` has a number made a number."""
    if isinstance(got, torch.Tensor) and got.dim() == 0 and isinstance(expected, numbers.Real):
        return got.item()
    if isinstance(got, (tuple, list)) and isinstance(expected, (tuple, list)) and len(got) == len(expected):
        return type(got)(_numbers_of_scalars(g, e) for g, e in zip(got, expected))
    return got


def _parameter_names(fn: Callable[..., Any], count: int) -> list[str]:
    """The names of ``fn``'s first ``count`` positional parameters (``residual``, ``k_cache``), for
    messages; ``#1``, ``#2`` ... where the signature does not say."""
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"#{i + 1}" for i in range(count)]


def _changed(before: Any, after: Any) -> bool:
    """Whether a call changed this argument in place: tensors, numbers, strings and the lists, tuples
    and dicts that hold them are compared; other objects are not looked into."""
    if type(before) is not type(after):  # an item of a list or dict replaced by something else
        return True
    if isinstance(before, torch.Tensor):
        if (before.shape, before.dtype, before.device) != (after.shape, after.dtype, after.device):
            return True
        same = (before == after) | (before != before) & (after != after)  # NaN where NaN was counts as unchanged
        return not bool(same.all())
    if isinstance(before, (list, tuple)):
        return len(before) != len(after) or any(_changed(b, a) for b, a in zip(before, after))
    if isinstance(before, dict):
        return before.keys() != after.keys() or any(_changed(before[k], after[k]) for k in before)
    if isinstance(before, (numbers.Number, str)):
        return not (before == after or (before != before and after != after))  # NaN is not equal to itself
    return False


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def items_of(got: Any, names: tuple[str, ...]) -> tuple:
    """``got`` as a tuple of ``len(names)`` items, or an AssertionError saying what was expected."""
    if not isinstance(got, (tuple, list)) or len(got) != len(names):
        raise AssertionError(f"expected a tuple ({', '.join(names)}), got {_short(got)}")
    return tuple(got)


def int_list(value: Any) -> list[int] | None:
    """A list or tuple of ints (or a 1-d integer tensor) as a list; None for anything else."""
    if isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point():
        return value.tolist()
    if isinstance(value, (list, tuple)) and all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                                for v in value):
        return [int(v) for v in value]
    return None


def number_of(value: Any, what: str) -> float:
    """A real number (or a 0-d tensor) as a float, or an AssertionError naming ``what`` was expected."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise AssertionError(f"{what}: expected a number, got {_short(value)}")
    return float(value)


def assert_matches(got: Any, expected: Any, rtol: float, atol: float) -> None:
    """Compare numbers within tolerance, tensors with torch.testing, containers item by item."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"expected a tensor, got {_short(got)}")
        if expected.is_floating_point() or expected.is_complex():
            if _right_in_another_dtype(got, expected, rtol, atol):
                raise _wrong_dtype(got, expected)
            _assert_close(got, expected, rtol, atol)
        else:
            assert_equal_tensors(got, expected)
    elif isinstance(expected, bool) or not isinstance(expected, (int, float, tuple, list, dict)):
        if got != expected:
            raise AssertionError(f"expected {_short(expected)}, got {_short(got)}")
    elif isinstance(expected, (int, float)):
        _assert_number(got, expected, rtol, atol)
    elif isinstance(expected, dict):
        if not isinstance(got, dict):
            raise AssertionError(f"expected a dict with keys {sorted(expected)}, got {_short(got)}")
        if set(got) != set(expected):
            missing, extra = [k for k in expected if k not in got], [k for k in got if k not in expected]
            named = [f"{label} {keys}" for label, keys in (("missing", missing), ("extra", extra)) if keys]
            raise SaysWhatToDo(f"expected a dict with exactly the keys {sorted(expected)}: {'; '.join(named)}")
        for key in expected:
            _at(repr(key), got[key], expected[key], rtol, atol)
    else:
        if not isinstance(got, (tuple, list)):
            if _listed_matches(got, expected, rtol, atol):
                made = "x.tolist()" if isinstance(expected, list) else "tuple(x.tolist())"
                name = type(got).__name__
                kind = {"ndarray": "a NumPy array", "Tensor": "a tensor"}.get(name, f"a {name}")
                raise WrongType(f"the values are right, but in {kind}: expected a {type(expected).__name__} ({made})")
            raise AssertionError(f"expected a {type(expected).__name__} of {len(expected)} items, got "
                                 f"{_short(got)} (of type {type(got).__name__})")
        if len(got) != len(expected):
            raise AssertionError(f"expected {len(expected)} items, got {len(got)}: {_short(got)}")
        try:
            for i, (got_item, expected_item) in enumerate(zip(got, expected)):
                _at(f"at index {i}", got_item, expected_item, rtol, atol)
        except AssertionError:
            order = _another_order(got, expected, rtol, atol) if isinstance(expected, tuple) else None
            if order is None:  # a list's items in another order are a wrong list, not a slip of the return
                raise
            moved = ", ".join(f"index {i} holds what belongs at index {j}" for i, j in enumerate(order) if i != j)
            raise SaysWhatToDo(f"the items are right, but in another order ({moved}): return them in the order the "
                               "spec gives") from None


SHOWN_VALUES = 32  # a wrong tensor of at most this many values is shown whole, beside the expected one


def _assert_close(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    """torch.testing.assert_close, whose message for a small real tensor of the right shape, dtype, device and
    layout is ``_differ``'s, both tensors' values (torch's names only the greatest difference); any other message is
    torch's."""
    try:
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    except AssertionError:
        alike = (got.shape == expected.shape and got.dtype == expected.dtype and got.device == expected.device
                 and got.layout == expected.layout == torch.strided and not expected.is_complex())
        if not alike or expected.numel() > SHOWN_VALUES:
            raise
        wrong = ~torch.isclose(got.detach(), expected.detach(), rtol=rtol, atol=atol)
        if not wrong.any():  # torch saw another difference: its message says which
            raise
        largest = (got.detach() - expected.detach()).abs()[wrong].max().item()
        raise AssertionError(_differ(got, expected, wrong, f"largest difference {largest:.3g}")) from None


def _differ(got: torch.Tensor, expected: torch.Tensor, wrong: torch.Tensor, note: str = "") -> str:
    """Where two tensors of one shape differ first, how many values differ (and ``note``), and both tensors whole
    when they are small, floats in as many significant digits as tell each differing pair apart."""
    got, expected, wrong = (t.detach().cpu() for t in (got, expected, wrong))
    at = tuple(wrong.nonzero()[0].tolist())
    shown, written = _written(got, expected, wrong)
    both = (f"\n    expected {shown(expected.tolist())}\n    got      {shown(got.tolist())}"
            if wrong.numel() <= SHOWN_VALUES else "")
    counted = f"{int(wrong.sum())} of {wrong.numel()} values differ" + (f"; {note}" if note else "")
    return (f"at index {list(at)} expected {written(expected[at].item())}, got {written(got[at].item())} "
            f"({counted}){both}")


def _written(got: torch.Tensor, expected: torch.Tensor, wrong: torch.Tensor) -> tuple[Callable, Callable]:
    """How to write the values of two tensors: integers as they are; floats to the fewest significant digits (4 at
    least) at which every differing pair reads differently. A formatter of nested lists, and one of a number."""
    digits = 4
    if expected.is_floating_point():
        pairs = list(zip(got[wrong].double().tolist(), expected[wrong].double().tolist()))
        digits = next((d for d in (4, 6, 9) if all(f"{a:.{d}g}" != f"{b:.{d}g}" for a, b in pairs)), 17)

    def written(value: Any) -> str:
        return f"{value:.{digits}g}" if isinstance(value, float) else str(value)

    def shown(values: Any) -> str:
        return f"[{', '.join(map(shown, values))}]" if isinstance(values, list) else written(values)
    return shown, written


def _listed_matches(got: Any, expected: Sequence[Any], rtol: float, atol: float) -> bool:
    """Whether ``got``, a tensor or an array (anything with ``tolist``), holds ``expected``'s items."""
    listed = got.tolist() if callable(getattr(got, "tolist", None)) else None
    if not isinstance(listed, list):
        return False
    try:
        assert_matches(type(expected)(listed), expected, rtol, atol)
    except AssertionError:
        return False
    return True


def _another_order(got: Sequence[Any], expected: Sequence[Any], rtol: float, atol: float) -> tuple[int, ...] | None:
    """The order of ``expected``'s items in which ``got`` holds them (``order[i]``: where got's item i belongs),
    for a few items; None where no other order holds them either."""
    if not 2 <= len(got) <= 4:
        return None
    for order in list(itertools.permutations(range(len(got))))[1:]:  # the first is the order given, which failed
        try:
            for i, j in enumerate(order):
                assert_matches(got[i], expected[j], rtol, atol)
        except AssertionError:
            continue
        return order
    return None


class SaysWhatToDo(AssertionError):
    """A failure whose message says what to change: the case's hint, which is about the result,
    would mislead, and the check leaves it out."""


class ChangedInPlace(SaysWhatToDo):
    """The right result, got by changing an argument in place."""


class WrongType(SaysWhatToDo):
    """The right value in the wrong type (a float where the spec says int, a 0-d tensor where it
    says a number)."""


def _assert_number(got: Any, expected: int | float, rtol: float, atol: float) -> None:
    """The value first (an int exactly, a float within tolerance), then its type."""
    value = got.item() if isinstance(got, torch.Tensor) and got.numel() == 1 else got
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        if _the_number_inside(got, expected, rtol, atol):
            raise WrongType(f"expected a Python number ({_short(expected)}), got {_short(got)}: the value is right, "
                            f"but inside a {type(got).__name__}: return the number itself")
        raise AssertionError(f"expected a number ({_short(expected)}), got {_short(got)}")
    if isinstance(expected, int) and isinstance(value, numbers.Integral):
        if value != expected:
            raise AssertionError(f"expected {expected}, got {value}")
    elif not math.isclose(float(value), expected, rel_tol=rtol, abs_tol=atol):
        raise AssertionError(f"expected {expected:.6g}, got {value:.6g}")
    if value is not got:
        shape = "a 0-d tensor" if got.dim() == 0 else f"a tensor of shape {list(got.shape)}"
        raise WrongType(f"expected a Python number ({_short(expected)}), got {shape} ({value:.6g}): the value is "
                        "right; turn it into a number with .item()")
    if isinstance(expected, int) and not isinstance(value, numbers.Integral):
        raise WrongType(f"expected a whole number, an int ({expected}), got {type(value).__name__} {value!r}: the value "
                        "is right, but the spec asks for an int: where every input is an int, keep the arithmetic "
                        "in ints (//, not /: a float on the way is exact only below 2^53); where an input is a float, "
                        "// gives a float too: round down with math.floor(...) or int(...)")


def _the_number_inside(got: Any, expected: int | float, rtol: float, atol: float) -> bool:
    """Whether ``got`` is ``expected`` in a wrapper: its text ('0.5'), or the one item of a list, a tuple or an
    array."""
    if isinstance(got, (list, tuple)) and len(got) == 1:
        got = got[0]
    elif hasattr(got, "shape") and hasattr(got, "item") and getattr(got, "size", 0) == 1:  # a numpy array
        got = got.item()
    try:
        value = float(got) if isinstance(got, (str, numbers.Real)) and not isinstance(got, bool) else None
    except ValueError:
        return False
    return value is not None and math.isclose(value, expected, rel_tol=rtol, abs_tol=atol)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def assert_equal_tensors(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Exact comparison (integers, codes, slots, masks): AssertionError naming what differs first, the
    shape, the dtype, or the first wrong value, and how many are wrong (and both, if small). Right
    values in another dtype are a ``WrongType``: the case's hint, about the values, would mislead."""
    if _right_in_another_dtype(got, expected):
        raise _wrong_dtype(got, expected)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(f"expected shape {list(expected.shape)} of {_name(expected.dtype)}, got shape "
                             f"{list(got.shape)} of {_name(got.dtype)}")
    wrong = got.cpu() != expected.cpu()
    if wrong.any():
        raise AssertionError(_differ(got, expected, wrong))


def _wrong_dtype(got: torch.Tensor, expected: torch.Tensor) -> WrongType:
    """Right values in another dtype: the failure to raise, which says how to make the right one."""
    want = _name(expected.dtype)
    return WrongType(f"the values are right, but of {_name(got.dtype)}: expected {want} (make it with "
                     f"dtype=torch.{want}, or convert with .to(torch.{want}))")


def _right_in_another_dtype(got: torch.Tensor, expected: torch.Tensor, rtol: float = 0.0, atol: float = 0.0) -> bool:
    """Whether ``got`` holds ``expected``'s numbers (within the tolerances) in another dtype, of the same shape
    (complex ones aside)."""
    if got.shape != expected.shape or got.dtype == expected.dtype or got.is_complex() or expected.is_complex():
        return False
    return torch.allclose(got.detach().cpu().double(), expected.cpu().double(), rtol=rtol, atol=atol)


def _at(where: str, got: Any, expected: Any, rtol: float, atol: float) -> None:
    """``assert_matches`` on one part of a container; a mismatch names the part (``'tpot': ...``)."""
    try:
        assert_matches(got, expected, rtol, atol)
    except AssertionError as error:
        raise type(error)(f"{where}: {error}") from None


@dataclass(frozen=True)
class JudgedCase(Case):
    """A case whose result ``judge`` inspects (raising AssertionError) instead of comparing it with one
    expected value: where several answers are right, or where what is wrong can be said more precisely."""

    expected: Any = None
    judge: Callable[[Any], None] = lambda got: None

    def run(self, fn: Callable[..., Any]) -> None:
        @functools.wraps(fn)  # the argument names stay fn's, for the in-place check's message
        def judged(*args: Any, **kwargs: Any) -> None:
            self.judge(fn(*args, **kwargs))
        super().run(judged)
