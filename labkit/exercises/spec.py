"""What an exercise is: an id, its points, the function a student writes, and test cases.

A case calls the student's function on fixed arguments and compares the result with the
value the reference implementation in labkit returned; a scenario drives a student's class
through a sequence of operations and checks it after each. The inline check (``labkit.check``)
and the grader (``labkit.grade``) run the very same cases.
"""
from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch


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

    def run(self, fn: Callable[..., Any]) -> None:
        """Call ``fn`` on copies of the arguments; raise AssertionError if the result is wrong,
        or if ``after``, given those arguments after the call, finds it was done the wrong way."""
        args, kwargs = copy.deepcopy(self.args), copy.deepcopy(dict(self.kwargs))
        got = fn(*args, **kwargs)
        assert_matches(got, self.expected, self.rtol, self.atol)
        if self.after is not None:
            self.after(*args, **kwargs)


@dataclass(frozen=True)
class Scenario:
    """A case that drives the student's class through a sequence of operations: ``play`` raises
    AssertionError, naming the operation, at the first thing that goes wrong."""

    label: str
    play: Callable[[Any], None]

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
    hint: str
    timeout_s: float = 60.0
    methods: tuple[str, ...] = ()  # when ``function`` is a class: the methods the student writes in it
    returns: tuple[str, ...] = ()  # when it returns a tuple: the names of its items, for messages

    @property
    def lab(self) -> str:
        """The notebook number this exercise belongs to: ``ex03.2`` -> ``03``."""
        return self.id[2:4]


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def assert_matches(got: Any, expected: Any, rtol: float, atol: float) -> None:
    """Compare numbers within tolerance, tensors with torch.testing, containers item by item."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"expected a tensor, got {_short(got)}")
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    elif isinstance(expected, bool) or not isinstance(expected, (int, float, tuple, list, dict)):
        if got != expected:
            raise AssertionError(f"expected {_short(expected)}, got {_short(got)}")
    elif isinstance(expected, (int, float)):
        if isinstance(got, torch.Tensor) and got.dim() == 0:
            got = got.item()  # a 0-d tensor is a number too
        if not isinstance(got, numbers.Real) or isinstance(got, bool):
            raise AssertionError(f"expected a number ({_short(expected)}), got {_short(got)}")
        if not math.isclose(float(got), expected, rel_tol=rtol, abs_tol=atol):
            raise AssertionError(f"expected {expected:.6g}, got {got:.6g}")
    elif isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            raise AssertionError(f"expected a dict with keys {sorted(expected)}, got {_short(got)}")
        for key in expected:
            _at(repr(key), got[key], expected[key], rtol, atol)
    else:
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            raise AssertionError(f"expected {len(expected)} items, got {_short(got)}")
        for i, (got_item, expected_item) in enumerate(zip(got, expected)):
            _at(f"item {i}", got_item, expected_item, rtol, atol)


def _at(where: str, got: Any, expected: Any, rtol: float, atol: float) -> None:
    """``assert_matches`` on one part of a container; a mismatch names the part (``'tpot': ...``)."""
    try:
        assert_matches(got, expected, rtol, atol)
    except AssertionError as error:
        raise AssertionError(f"{where}: {error}") from None
