"""Check an exercise inline: ``labkit.check("ex00.1", matmul_intensity)``.

The check runs the exercise's cases (from ``labkit.exercises``) and prints a verdict with
the first failure and that case's hint; when the same case fails again in a later check, the
exercise's recipe too. ``run_cases`` returns the same verdict as a ``Result``. Points
are all or nothing: every case must pass. An exercise is "not attempted" while every case
stops at a stub (a ``raise NotImplementedError`` line), which the verdict names. With
``LABKIT_STRICT=1`` (how CI runs the solutions) anything but a pass raises ``ExerciseFailed``, here
and in the notebook's grade cell (``labkit.grade.grade_this``); otherwise the notebook carries on, so
a student copy with unsolved stubs still runs top to bottom.
"""
from __future__ import annotations

import io
import os
import re
import signal
import threading
import time
import traceback
from collections import Counter
from contextlib import contextmanager, nullcontext, redirect_stderr, redirect_stdout
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, ContextManager, Iterator, Mapping

from labkit.answers import (LABKIT_DIR, LIBRARIES, BorrowedAnswer, callee, checking, functions_of, is_students,
                            normalised)
from labkit.exercises import Exercise, get
from labkit.exercises.spec import Case, Scenario, SaysWhatToDo

PASSED, FAILED, NOT_ATTEMPTED = "passed", "failed", "not attempted"
_MARK = {PASSED: "PASS", FAILED: "FAIL", NOT_ATTEMPTED: "TODO"}


@dataclass(frozen=True)
class Started:
    """A case as it starts (its number from 1, its label), how many cases before it passed, how many there are."""

    number: int
    label: str
    passed: int
    total: int

    def where(self) -> str:
        """`` in case 3 of 5 (its label); 2 of the 2 cases before it passed``."""
        before = f"; {self.passed} of the {self.number - 1} cases before it passed" if self.number > 1 else ""
        return f" in case {self.number} of {self.total} ({self.label}){before}"


class ExerciseFailed(AssertionError):
    """Raised under ``LABKIT_STRICT=1`` by ``check`` when an exercise does not pass, and by the grade
    cell when the grader finds anything short of full points (``fail_if_strict``)."""


@dataclass
class Result:
    """The outcome of one exercise for one submission."""

    exercise: str
    status: str  # passed, failed, not attempted; the grader adds error, timeout, crashed, missing
    points: float
    max_points: int
    passed: int = 0  # cases
    total: int = 0
    message: str = ""
    notebook: str = ""  # the file the grader graded
    failed_case: str = ""  # the label of the first case that failed

    def verdict(self) -> str:
        mark = _MARK.get(self.status, "FAIL")
        cases = f"{self.passed}/{self.total} cases pass, " if self.total else ""
        head = f"[{mark}] {self.exercise}: {self.status} ({cases}{self.points:g}/{self.max_points} points)"
        return head + (f"\n    {self.message}" if self.message else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _describe_error(error: BaseException) -> str:
    if isinstance(error, AssertionError) and str(error):
        return str(error)
    return f"raised {type(error).__name__}: {error}{_where(error)}"


def _name_item(message: str, exercise: Exercise) -> str:
    """``at index 1: ...`` of a returned tuple whose items the exercise names, as ``residual: ...``."""
    match = re.match(r"at index (\d+): ", message)
    if match is None or int(match[1]) >= len(exercise.returns):
        return message
    return f"{exercise.returns[int(match[1])]}: {message[match.end():]}"


def _where(error: BaseException) -> str:
    """Where ``error`` was raised and, when that is in labkit or a library, the student's line that
    led there: the last of their frames in the error or in the errors it came from (Triton's
    interpreter wraps a kernel's error in its own, raised in its own code)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    last, chain = frames[-1], [error]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and cause not in chain:
        chain.append(cause)
    theirs = [f for e in chain for f in traceback.extract_tb(e.__traceback__) if is_students(f.filename)]
    if not theirs or theirs[-1][:3] == last[:3]:  # file, line, function
        return f" (line {last.lineno} of {last.name})"
    return f" (line {theirs[-1].lineno} of your {theirs[-1].name}; raised in {last.name}, line {last.lineno})"


def run_cases(exercise: Exercise, fn: Callable[..., Any], failed_before: Mapping[str, int] | None = None,
              starting: Callable[[Started], None] | None = None) -> Result:
    """Run every case of ``exercise`` on ``fn``; all must pass for the points. ``failed_before``
    counts, by case label, the earlier checks that failed first on that case: the recipe is shown
    when the case that fails now has failed before. ``starting`` is told each case as it starts, with how
    many of the cases before it passed and how many there are (``Started``), so that whoever stops a case
    that never ends can say which it was and what had passed."""
    if not callable(fn):
        return Result(exercise.id, FAILED, 0, exercise.points,
                      message=f"expected the function {exercise.function}, got {type(fn).__name__}")
    borrowed = _labkit_code(exercise, fn)
    if borrowed:
        return Result(exercise.id, FAILED, 0, exercise.points, message=borrowed)
    cases = exercise.cases()
    first_failure, first_case, first_needs_hint, passed, stubs = "", None, False, 0, []
    for number, case in enumerate(cases, 1):
        if starting is not None:
            starting(Started(number, case.label, passed, len(cases)))
        try:
            with checking(exercise.id), _case_limit(case):  # labkit's answer to it refuses the student's calls
                case.run(fn)
            passed += 1
        except (Exception, SystemExit) as error:  # a student's bug of any kind is a failed case, not a crash
            stub = _stub_name(fn, exercise.function, error)
            stubs += [stub] if stub else []
            what = (f"{stub} still raises NotImplementedError: write it next" if stub
                    else _name_item(_describe_error(error), exercise))
            if first_case is None:
                first_case, first_failure = case, f"case {number} ({case.label}): {what}".replace("\n", "\n    ")
                first_needs_hint = not stub and not _not_about_values(error)
    if passed == len(cases):
        return Result(exercise.id, PASSED, exercise.points, exercise.points, passed, len(cases))
    if len(stubs) == len(cases):  # every case stopped at a stub
        names = " and ".join(dict.fromkeys(stubs))
        return Result(exercise.id, NOT_ATTEMPTED, 0, exercise.points, 0, len(cases),
                      f"{names} still raise{'s' * (' and ' not in names)} NotImplementedError: replace the stub "
                      "with your code")
    hints = f"\n    {_hints(exercise, first_case, failed_before)}" if first_needs_hint else ""
    return Result(exercise.id, FAILED, 0, exercise.points, passed, len(cases), f"first failure, {first_failure}{hints}",
                  failed_case=first_case.label)


def _as_the_grader_sees_it(result: Result, exercise: Exercise, fn: Any) -> Result:
    """``result``, unless it is a pass that the grader, which runs only the setup cells and the exercise cells,
    would not give: where a cell the grader skips made ``fn`` what the kernel has (``grade.skipped_cell_of``), a
    failure that names the cell; where ``fn`` needs names only such cells bind (a NameError, graded), a failure
    that names the names and where the notebook binds them. Where the notebook cannot be read, or anything goes
    wrong in finding out, the pass stands."""
    from labkit.grade import names_the_grader_lacks, skipped_cell_of  # grade imports this module

    if result.status != PASSED:
        return result
    try:
        skipped = skipped_cell_of(exercise, fn)
        lacking = [] if skipped else _needed(names_the_grader_lacks(exercise, fn), exercise, fn)
    except Exception:  # noqa: BLE001 -- a student's notebook or namespace of any shape: the verdict stands
        return result
    if skipped:
        code, where = skipped
        named = f"{code.called} here is {code.name}, which" if code.renamed else f"this {code.called}"
        return replace(result, status=FAILED, points=0, message=(
            f"every case passes here, but the grader would not grade this code: {named} was {where}, "
            "which the grader does not run (it runs only the setup cells and the exercise cells): define "
            f"{code.called} in this exercise's cell (and save: the grader reads the file)"))
    if not lacking:
        return result
    names = "; ".join(f"{name} ({where})" for name, where in lacking)
    return replace(result, status=FAILED, points=0, message=(
        f"every case passes here, but graded it would raise NameError: the grader runs only the setup cells and the "
        f"exercise cells, where {names} {'is' if len(lacking) == 1 else 'are'} not defined: import or define "
        f"{'it' if len(lacking) == 1 else 'them'} in this exercise's cell (and save: the grader reads the file)"))


def _needed(lacking: list[tuple[str, str]], exercise: Exercise, fn: Any) -> list[tuple[str, str]]:
    """Those of ``lacking`` that the cases fail for with a NameError, run again, quietly, with them taken out of
    ``fn``'s namespace (and put back after) and ``fn``'s caches cleared; none where they pass all the same (a name
    read only on a path the cases never take) or fail otherwise."""
    if not lacking:
        return []
    namespace, taken = functions_of(fn)[0].__globals__, {}
    for cached in (fn, *(vars(fn).values() if isinstance(fn, type) else ())):
        getattr(cached, "cache_clear", lambda: None)()  # a memoised answer would not read the name again
    try:
        taken.update((name, namespace.pop(name)) for name, _ in lacking if name in namespace)
        with time_limit(exercise.timeout_s), redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            again = run_cases(exercise, fn)
    except Overtime:
        return []
    finally:
        namespace.update(taken)
    return [(name, where) for name, where in lacking if f"name '{name}' is not defined" in again.message]


def _not_about_values(error: BaseException) -> bool:
    """Whether a case's failure is one its hint, which is about the values, cannot help with: a message
    that says what to change, a name the function's cell does not define, memory that ran out."""
    if isinstance(error, UnboundLocalError):  # a logic slip inside the function, which the hint may help with
        return False
    return (isinstance(error, (SaysWhatToDo, BorrowedAnswer, NameError, MemoryError))
            or "can't allocate memory" in str(error))


def _hints(exercise: Exercise, case: Case | Scenario, failed_before: Mapping[str, int] | None) -> str:
    """The failing case's own hint. In an inline check (``failed_before`` given), the exercise's
    recipe as well once that case has failed before; the grader, which runs once, gives the hint."""
    if not case.hint:
        return f"hint: {exercise.recipe}"
    if failed_before is None:
        return f"hint: {case.hint}"
    if failed_before.get(case.label, 0):
        return f"hint: {case.hint}\n    recipe (this case failed before): {exercise.recipe}"
    return f"hint: {case.hint}\n    (should this case fail again, the check will show the whole recipe)"


def _labkit_code(exercise: Exercise, fn: Any) -> str | None:
    """What the submission hands in of labkit's own code instead of the student's: the function
    itself, imported, or a method the exercise asks for, inherited from a labkit class (a subclass
    of ``BlockPool`` that leaves out ``fork`` has labkit's). None when all of it is the student's."""
    named = ([(f"{exercise.function}.{m}", getattr(fn, m, None)) for m in exercise.methods]
             if isinstance(fn, type) else [(exercise.function, fn)])
    for name, code in named:
        code = callee(code)
        module = getattr(code, "__module__", None) or ""
        if module == "labkit" or module.startswith("labkit."):
            where = f"{module}.{getattr(code, '__qualname__', name.split('.')[-1])}"
            return f"{name} is labkit's own ({where}), not yours: write it in your cell"
    return None


def _stub_name(fn: Any, name: str, error: BaseException) -> str | None:
    """The stub that raised ``error``, if it is a ``raise NotImplementedError`` line of the
    student's (their method, ``SimplePool.free``, or function) or of labkit's (lab 07's kernel
    launcher, for a kernel the GPU compiler refused: ``name``); None for anything else, such as a
    NotImplementedError from inside torch, which is an ordinary failure."""
    frames = traceback.extract_tb(error.__traceback__)
    if not isinstance(error, NotImplementedError) or not frames:
        return None
    last = frames[-1]
    path = normalised(last.filename)
    if "raise NotImplementedError" not in (last.line or "raise NotImplementedError") or (
            path.startswith(LIBRARIES) and not path.startswith(LABKIT_DIR)) or last.filename.startswith("<frozen "):
        return None
    if path.startswith(LABKIT_DIR) or last.name == name or last.name.startswith("<"):  # <module>, <listcomp>
        return name
    return f"{name}.{last.name}" if isinstance(fn, type) and hasattr(fn, last.name) else last.name


def strict() -> bool:
    """Whether checks raise on failure (``LABKIT_STRICT=1``)."""
    return os.environ.get("LABKIT_STRICT", "0").strip().lower() in ("1", "true", "yes")


def fail_if_strict(failure: str | None) -> None:
    """Under ``LABKIT_STRICT=1``, raise ``ExerciseFailed(failure)`` if there is a failure; else nothing."""
    if failure is not None and strict():
        raise ExerciseFailed(failure)


class Overtime(BaseException):
    """Raised by ``time_limit`` into the code it stops: not an Exception, so that neither a
    student's ``except Exception`` nor ``run_cases`` takes it for one more failed case."""


class TooSlow(AssertionError):
    """Raised into a case that runs past its own ``within_s``: one failed case, with its hint."""


@contextmanager
def time_limit(seconds: float, error: type[BaseException] = Overtime) -> Iterator[None]:
    """Raise ``error`` into the code under it after ``seconds`` of wall time, where a timer signal
    can (on Unix, in the main thread: a notebook's code runs there); elsewhere, no limit. Inside
    another limit that ends sooner, that one stands; inside one that ends later, that one is set
    again once this one ends or fires, so that code which swallows this error is still stopped."""
    outer_s = signal.getitimer(signal.ITIMER_REAL)[0] if hasattr(signal, "getitimer") else 0.0
    if (not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread()
            or 0 < outer_s <= seconds):
        yield
        return
    start, outer_handler, restored = time.monotonic(), signal.getsignal(signal.SIGALRM), False

    def restore() -> None:  # once: after this limit fired, leaving its block must not re-arm the outer one
        nonlocal restored
        if restored:
            return
        restored = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_s:
            signal.setitimer(signal.ITIMER_REAL, max(outer_s - (time.monotonic() - start), 1e-3))

    def stop(signum: int, frame: Any) -> None:
        restore()
        raise error(f"stopped after {seconds:g} s")
    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        restore()


def _case_limit(case: Case | Scenario) -> ContextManager[None]:
    """The case's own time, where it has one (``Case.within_s``): running past it fails the case."""
    within_s = getattr(case, "within_s", None)
    return time_limit(within_s, TooSlow) if within_s else nullcontext()


# exercise id -> how many checks in this kernel failed first on each case (by label)
_FAILED_CASES: dict[str, Counter[str]] = {}


def check(exercise_id: str, fn: Callable[..., Any]) -> None:
    """Run an exercise's cases on ``fn`` and print the verdict. The cases get the time the
    grader gives them, so an endless loop stops here too."""
    exercise = get(exercise_id)
    failed = _FAILED_CASES.setdefault(exercise.id, Counter())
    running: list[Started] = []
    try:
        with time_limit(exercise.timeout_s):
            result = run_cases(exercise, fn, failed, starting=running.append)
    except Overtime as stopped:
        where = running[-1] if running else None
        result = Result(exercise.id, FAILED, 0, exercise.points, where.passed if where else 0,
                        where.total if where else 0, failed_case=where.label if where else "",
                        message=f"{stopped}{where.where() if where else ''}: an endless loop, or far too slow (the "
                                "grader stops it too)")
    if result.failed_case:
        failed[result.failed_case] += 1
    result = _as_the_grader_sees_it(result, exercise, fn)
    print(f"{exercise.title} -- {result.verdict()}")
    fail_if_strict(result.verdict() if result.status != PASSED else None)
