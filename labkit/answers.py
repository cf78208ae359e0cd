"""labkit's own answers to the exercises, refused to a student's code while its check runs.

labkit implements what the exercises ask for: ``labkit.paged_attention.slot_mapping`` is the answer to
ex03.1. A check must not pass a cell that only calls it. ``labkit.check`` refuses a function that *is*
labkit's; a function marked here with ``answer_to`` also refuses to be called from the student's own
code while that exercise's cases run (a wrapper, ``lambda P, N: cost.tokens_processed(P, N)``, or
``super().fork(...)`` in a subclass). Calls from labkit itself, the checks' own references among
them, go through, and outside a check every call does.
"""
from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
LABKIT_DIR = os.path.normcase(os.path.dirname(os.path.abspath(__file__))) + os.sep  # labkit's own code lives here
_checking: str | None = None  # the exercise whose cases run now: one owner, ``checking``


class BorrowedAnswer(AssertionError):
    """The student's code called labkit's answer to the exercise being checked."""


def answer_to(exercise_id: str) -> Callable[[F], F]:
    """Mark a function or method as labkit's answer to ``exercise_id``."""
    def mark(fn: F) -> F:
        @functools.wraps(fn)
        def refusing(*args: Any, **kwargs: Any) -> Any:
            if _checking == exercise_id and not _is_labkit(sys._getframe(1).f_code.co_filename):
                raise BorrowedAnswer(f"your code calls labkit's {fn.__module__}.{fn.__qualname__}, which is labkit's "
                                     f"answer to {exercise_id}: write the exercise yourself, without it")
            return fn(*args, **kwargs)
        return refusing  # type: ignore[return-value]
    return mark


@contextmanager
def checking(exercise_id: str) -> Iterator[None]:
    """While the cases of ``exercise_id`` run: its answers refuse the student's calls."""
    global _checking
    before, _checking = _checking, exercise_id
    try:
        yield
    finally:
        _checking = before


def _is_labkit(filename: str) -> bool:
    return os.path.normcase(os.path.abspath(filename)).startswith(LABKIT_DIR)
