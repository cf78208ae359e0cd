"""labkit's own answers to the exercises, refused to a student's code while its check runs.

labkit implements what the exercises ask for: ``labkit.paged_attention.slot_mapping`` is the answer to
ex03.1. A check must not pass a cell that only calls it. ``labkit.check`` refuses a function that *is*
labkit's; a function marked here with ``answer_to`` also refuses to be called from the student's own
code while that exercise's cases run (a wrapper, ``lambda P, N: cost.tokens_processed(P, N)``, or
``super().fork(...)`` in a subclass), however far up: through labkit's other functions too (the
student's cell calling ``quant.quantize``, which calls ``group_params``, the answer to ex06.1). Calls
from labkit itself, the checks' own references among them, go through, and outside a check every
call does. A call from another thread is not refused (its stack does not lead back to the check, and
labkit's own threads must go through): this stops a slip, not a student set on getting around it.
"""
from __future__ import annotations

import dis
import functools
import inspect
import os
import site
import sys
import sysconfig
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any, Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@functools.lru_cache(maxsize=None)  # a check's every call of a marked answer walks the stack through a few files
def normalised(filename: str) -> str:
    """A file's path as paths are compared here: absolute, and in the case the system compares names in."""
    return os.path.normcase(os.path.abspath(filename))


LABKIT_DIR = normalised(os.path.dirname(__file__)) + os.sep  # labkit's own code lives here
CHECK_FILE = LABKIT_DIR + "check.py"  # where the cases run: the student's calls are below it on the stack (normcased)
# where code that is not a student's lives besides labkit: the standard library, installed packages
LIBRARIES = tuple({normalised(path) + os.sep for path in (
    *(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    *site.getsitepackages(), site.getusersitepackages())})
_checking: str | None = None  # the exercise whose cases run now: one owner, ``checking``


class BorrowedAnswer(AssertionError):
    """The student's code called labkit's answer to the exercise being checked."""


def answer_to(*exercise_ids: str) -> Callable[[F], F]:
    """Mark a function or method as labkit's answer to each of ``exercise_ids`` (a later exercise may
    ask again for what an earlier one built, inside something larger)."""
    def mark(fn: F) -> F:
        @functools.wraps(fn)
        def refusing(*args: Any, **kwargs: Any) -> Any:
            if _checking in exercise_ids and _called_by_the_student(sys._getframe(1)):
                raise BorrowedAnswer(f"your code calls labkit's {fn.__module__}.{fn.__qualname__}, which is labkit's "
                                     f"answer to {_checking}: write the exercise yourself, without it")
            return fn(*args, **kwargs)
        del refusing.__wrapped__  # functools.wraps leaves the unguarded answer there, one attribute away
        refusing.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]  # what help() shows
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


def is_students(filename: str) -> bool:
    """Whether code of this file is the student's: not labkit's, nor a library's, nor generated (a
    dataclass's ``__init__`` comes from ``<string>``, Python's own from ``<frozen ...>``); a cell is."""
    if filename == "<string>" or filename.startswith("<frozen "):
        return False
    path = normalised(filename)
    return not (path.startswith(LIBRARIES) or path.startswith(LABKIT_DIR))


def _called_by_the_student(frame: FrameType | None) -> bool:
    """Whether the student's code is among the callers, from ``frame`` up to the check that runs the case."""
    while frame is not None and normalised(frame.f_code.co_filename) != CHECK_FILE:
        if _runs_students_code(frame):
            return True
        frame = frame.f_back
    return False


def _runs_students_code(frame: FrameType) -> bool:
    """``is_students`` of the frame's file; code made from a string (a dataclass's ``__init__``, an
    ``eval``'d lambda) is the module's whose globals it runs in: a student's unless that has a file
    that is not theirs."""
    if frame.f_code.co_filename == "<string>":
        module_file = frame.f_globals.get("__file__")
        return module_file is None or is_students(module_file)
    return is_students(frame.f_code.co_filename)


def students_code(fn: Any) -> list[CodeType]:
    """The code a student's function or class runs: its own (a class's functions'), the functions, classes,
    lambdas and comprehensions nested in it, and the code of the functions defined beside it (in the same
    namespace) that it names, each once."""
    found: list[CodeType] = []
    for function in functions_of(fn):
        _collect(function.__code__, function.__globals__, found)
    return found


def functions_of(fn: Any) -> list[Any]:
    """A function (unwrapped from a method or a partial); a class's own functions, properties' included."""
    if not isinstance(fn, type):
        fn = callee(fn)
        return [fn] if hasattr(fn, "__code__") else []
    return list(methods_of(fn).values())


def methods_of(cls: type) -> dict[str, Any]:
    """A class's own functions by their attribute's name, properties' getters included."""
    members = {name: m.fget if isinstance(m, property) else callee(m) for name, m in vars(cls).items()}
    return {name: m for name, m in members.items() if hasattr(m, "__code__") and hasattr(m, "__globals__")}


def callee(fn: Any) -> Any:
    """What ``fn`` hands its calls to: a partial's (or a partialmethod's) function, a bound, static or class method's,
    a decorator's wrapped function (``__wrapped__``), a Triton kernel's Python function (its ``fn``), a callable
    object's ``__call__``; anything else as it is."""
    while True:
        if isinstance(fn, (functools.partial, functools.partialmethod)):
            fn = fn.func
        elif isinstance(fn, (staticmethod, classmethod)) or inspect.ismethod(fn):
            fn = fn.__func__
        elif callable(getattr(fn, "fn", None)) and type(fn).__module__.startswith("triton."):
            fn = fn.fn
        elif callable(getattr(fn, "__wrapped__", None)):
            try:
                fn = inspect.unwrap(fn)  # stops at a cycle, and after as many steps as the recursion limit
            except ValueError:
                return fn
            if callable(getattr(fn, "__wrapped__", None)):  # an object that makes a wrapper of anything
                return fn
        elif callable(fn) and not isinstance(fn, type) and not inspect.isroutine(fn):
            fn = type(fn).__call__
        else:
            return fn


def global_reads(code: CodeType) -> list[str]:
    """The names ``code`` itself (not the code nested in it) looks up among the globals, in order, each once."""
    return list(dict.fromkeys(i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")))


def _collect(code: CodeType, namespace: dict, found: list[CodeType]) -> None:
    if any(code is seen for seen in found):
        return
    found.append(code)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            _collect(const, namespace, found)
    for name in global_reads(code):
        helper = namespace.get(name)
        if getattr(helper, "__globals__", None) is namespace and hasattr(helper, "__code__"):
            _collect(helper.__code__, namespace, found)
