"""Grade submissions: ``python -m labkit.grade PATH...``

A PATH is one notebook, a folder of notebooks (one student's submission), or a folder of
student folders (a class); with ``--per-file``, every notebook is a student of its own, named
by its file (a flat folder, as course platforms export a class). Every exercise of every
notebook runs in a fresh Python process with a time limit: the notebook's cells tagged
``setup`` first, then the cells of the notebook's earlier exercises (so that an exercise may
use what an earlier one defined, as it does in the notebook; their errors are not counted here,
and each may run for a few seconds at most), then the exercise cell, then the exercise's cases
(the same ones ``labkit.check`` runs) on the function the cell defines. No other cell runs. A
crash, an endless loop, a syntax error, ``sys.exit`` or (on Linux) an allocation past the exercise's
share of memory (``memory_limit``) in a submission costs that exercise's points and nothing more.
The grader prints a points table (a notebook none of whose exercises was attempted, or submitted, takes
one line of reasons) and writes ``grades.json`` (every result with its reason and the notebook it came
from) and ``grades.csv`` (a row per student: a column per exercise, blank where it is missing; a total
and a maximum per notebook when there are several, the total blank where all of that notebook is missing;
the total, and the exercises that did not pass, each with its status). A notebook whose lab cannot be told
(no ``NN_`` prefix, no exercise cell, tagged or defining an exercise's function) is not graded: it is an
entry of its own in the table and the CSV, named by its file, 0 points of 0, that says what would place
it; in grades.json it is under the student's ``unplaced`` (file name: that message), beside
``exercises``. Of a student's two copies of one notebook the better counts, and a note says so. The exit
status is 0 when some exercise was graded, 1 when no notebook could be placed (the reports are written all
the same), and 2 for a path that does not exist, holds no notebook or is a file of another kind.
"""
from __future__ import annotations

import argparse
import builtins
import csv
import json
import linecache
import math
import multiprocessing
import multiprocessing.context
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

from labkit import notebook
from labkit.answers import functions_of, global_reads, methods_of, students_code
from labkit.check import FAILED, NOT_ATTEMPTED, PASSED, Result, Started, fail_if_strict, run_cases, time_limit
from labkit.exercises import EXERCISES, Exercise, for_lab, get
from labkit.spawning import cores, fork_server, process, threads_each

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

ERROR, TIMEOUT, CRASHED, MISSING = "error", "timeout", "crashed", "missing"
CASE_FILE = "case"  # beside a worker's result: the case it has started, for the message should it never end
_EARLIER_CELL_S = 10.0  # at most, for an earlier exercise's cell, and a quarter of the exercise's time limit
_CPU_SLACK_S = 30.0  # a worker's CPU time beyond its time limit x the cores, after which it ends on its own
_STOP_POLL_S = 0.1  # how often a batch's worker threads look for a Ctrl+C while an exercise runs
_OUTPUT_LIMIT = 1 << 20  # bytes a submission may write to a file while graded
_MESSAGE_LIMIT = 20_000  # characters of a result's message: the result is a file, which _OUTPUT_LIMIT caps too
_MEMORY_SHARE = 0.5  # of this machine's memory: what the exercises graded at once may allocate in all
_MEMORY_FLOOR = 1 << 30  # what one may always allocate (labkit's own solutions need a fraction of it)
_THREAD_ALLOWANCE = 32 << 20  # what a thread may reserve (its stack, its allocator's arena; about 16 MiB seen)


@dataclass(frozen=True)
class Submission:
    """One student's copy of one notebook."""

    student: str
    path: Path
    lab: str


def _lab_of(path: Path) -> str | None:
    """The notebook number: the file name's (``03_paged-Copy1.ipynb``) if it holds any of that
    notebook's exercises, or else that of most of its exercises (said on stderr where the name
    gives another), or else the name's."""
    named = _known_lab_of_name(path.name)
    try:
        labs = Counter(ex.lab for ex in _exercises_in(notebook.read(path)))
    except ValueError:
        return named  # unreadable: graded by its name, which reports it so
    if named in labs:  # an exercise of another lab pasted in does not move it
        return named
    held = labs.most_common(1)[0][0] if labs else None
    if held is not None and named is not None:
        print(f"{path}: named {named}_ but it holds notebook {held}'s exercises: graded as {held}", file=sys.stderr)
    return held or named


def _exercises_in(nb: notebook.Notebook) -> list[Exercise]:
    """The exercises of the cells tagged with one; where no cell is (tags lost in a copy), those whose
    function a code cell defines, as the grader finds them (``_exercise_cell``), of labs with two or
    more of them defined (one function of a common name, ``advance``, does not make a lab's notebook)."""
    tagged = [get(i) for c in nb["cells"] if (i := notebook.exercise_id(c)) in EXERCISES]
    if tagged:
        return tagged
    defined = [ex for ex in EXERCISES.values() if _exercise_cell(nb, ex)[0] is not None]
    labs = Counter(ex.lab for ex in defined)
    return [ex for ex in defined if labs[ex.lab] >= 2]


_LAB_IDS = sorted({ex.lab for ex in EXERCISES.values()})  # the labs that have exercises: "00", "01", ...


def _known_lab_of_name(name: str) -> str | None:
    """The lab a file name gives (``notebook.lab_of_name``), None where it gives none or one with no exercises."""
    named = notebook.lab_of_name(name)
    return named if named in _LAB_IDS else None


def _unplaced(path: Path) -> str:
    """Why a notebook whose lab cannot be told was not graded, and what would place it."""
    try:
        notebook.read(path)
    except ValueError as error:
        return f"its lab cannot be told, so it was not graded: {error}"
    named = notebook.lab_of_name(path.name)
    name = (f"its name's {named}_ is no lab's (the labs: {', '.join(_LAB_IDS)})" if named else "no NN_ prefix in its name")
    bare = path.name[len(named) + 1:] if named else path.name
    return (f"its lab cannot be told ({name}, and no cell tagged as an exercise or defining an exercise's "
            f"function), so it was not graded: rename it with its lab's NN_ prefix (as 03_{bare} for lab 03) or "
            "restore the 'exercise' tags of its exercise cells")


def _notebooks_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.ipynb") if p.is_file() and _a_submissions_name(p.name))


def _a_submissions_name(name: str) -> bool:
    """Not hidden, nor what a zip made on a Mac adds: ``__MACOSX`` and its ``._x.ipynb`` shadows."""
    return not name.startswith((".", "__"))


def find_submissions(paths: list[Path], per_file: bool = False) -> list[Submission]:
    """Every (student, notebook) under the given paths; a student is the folder a notebook is in,
    or with ``per_file`` the notebook's file name without its extension. A student folder of a
    class folder that holds no notebook is a submission too, of no lab (``lab`` empty), and so is a
    notebook of no lab that can be told (no ``NN_`` prefix, no exercise cell): nobody is left out."""
    found: list[Path] = []
    empty: list[Path] = []  # student folders without a notebook
    for path in paths:
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            own = _notebooks_in(path)
            held = {sub: _notebooks_in(sub) for sub in sorted(path.iterdir())
                    if sub.is_dir() and _a_submissions_name(sub.name)}
            a_class = any(held.values()) or not own  # else one student's folder, its subfolders theirs
            if a_class and own and not per_file:
                print(f"{path}: {', '.join(p.name for p in own)} at the top of a class folder: graded as a student "
                      f"named {path.name}; move each into its student's folder", file=sys.stderr)
            found += own
            for sub, notebooks in held.items():
                found += notebooks
                if not notebooks and a_class and not per_file and _an_empty_student(sub):
                    empty.append(sub.resolve())
        else:
            raise FileNotFoundError(f"{path} does not exist")
    # where each notebook sits (a link is the student's own, wherever it points), each once
    found = list(dict.fromkeys(p.parent.resolve() / p.name for p in found))
    owners = {p: p.with_suffix("") if per_file else p.parent for p in found}
    clash = Counter(owner.name for owner in set(owners.values()) | set(empty))
    submissions = [Submission(f.name if clash[f.name] == 1 else str(f), f, "") for f in empty]
    for nb_path in found:  # a student is their folder's (or file's) name, or its full path where two share one
        owner = owners[nb_path]
        lab = _lab_of(nb_path)
        if lab is None:  # still the student's: an entry of the student's row that names the file
            print(f"{nb_path}: {_unplaced(nb_path)}", file=sys.stderr)
        submissions.append(Submission(owner.name if clash[owner.name] == 1 else str(owner), nb_path, lab or ""))
    return submissions


@lru_cache(maxsize=1)
def _context() -> multiprocessing.context.BaseContext:
    """Fresh processes that start in milliseconds (``spawning.fork_server``), with what most labs' setup
    cells import already imported: each exercise runs its lab's setup cells anew."""
    return fork_server("IPython.core.interactiveshell", "numpy", "matplotlib.pyplot", "ipywidgets", "labkit",
                       *_grade_module())


def _grade_module() -> list[str]:
    """This module, to preload, unless it runs as ``python -m labkit.grade``: the fork server then
    runs it as its main module, and importing it first as well makes Python warn."""
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    return [] if main_spec is not None and main_spec.name == "labkit.grade" else ["labkit.grade"]


def _run_worker(spec: dict, cwd: Path, timeout_s: float, stop: threading.Event | None = None) -> dict:
    """Run one exercise in a fresh process; return its result, whatever the process did. Where ``stop`` is
    set while it runs (a Ctrl+C or an Interrupt, heard by the main thread), kill it and raise KeyboardInterrupt."""
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        result_path = Path(tmp) / "result.json"
        proc = process(_context(), _worker, (spec, str(cwd), str(result_path)), daemon=True)
        proc.start()
        try:
            _join(proc, timeout_s, stop)
            timed_out = proc.is_alive()
        finally:  # an Interrupt of the grade cell too: the worker leads its own group, which no SIGINT reaches
            _kill_group(proc.pid)
            proc.join()
        if result_path.exists():  # written whole (os.replace): the process may have lingered after it
            outcome = json.loads(result_path.read_text(encoding="utf-8"))
            if timed_out:
                outcome["message"] = _with_note(outcome["message"], "the process did not end once it had its result "
                                                "(a thread of the exercise's left running?)")
            return outcome
        started = _case_reached(Path(tmp, CASE_FILE))
        where = started.where() if started else (" before its first case (in a setup cell, an earlier exercise's "
                                                 "cell or the exercise cell)")
        reached = ({"failed_case": started.label, "passed": started.passed, "total": started.total} if started
                   else {"failed_case": ""})
        if timed_out:
            return {"status": TIMEOUT, **reached,
                    "message": f"stopped after {timeout_s:g} s{where}: an endless loop, or far too slow"}
        how = (f"killed by signal {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0
               else f"exited with code {proc.exitcode}")
        return {"status": CRASHED, **reached,
                "message": f"the process {how}{where}, with no result reported (os._exit, a crash, too much output "
                           "or memory?)"}


def _join(proc: multiprocessing.process.BaseProcess, timeout_s: float, stop: threading.Event | None) -> None:
    """Wait for ``proc`` to end, at most ``timeout_s``; raise KeyboardInterrupt once ``stop`` is set."""
    if stop is None:  # in the main thread, where a SIGINT interrupts the wait itself
        proc.join(timeout_s)
        return
    deadline = time.monotonic() + timeout_s
    while proc.is_alive() and (left := deadline - time.monotonic()) > 0:
        if stop.is_set():
            raise KeyboardInterrupt
        proc.join(min(left, _STOP_POLL_S))


def _case_reached(case_file: Path) -> Started | None:
    """The case a worker's ``run_cases`` had started when it stopped; None where none had started."""
    return Started(**json.loads(case_file.read_text(encoding="utf-8"))) if case_file.exists() else None


def _kill_group(pgid: int) -> None:
    """Kill the worker and anything it started (it leads its own process group)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exercise_cell(nb: notebook.Notebook, exercise: Exercise) -> tuple[str | None, str]:
    """The source of the exercise's cell (the last one if a student duplicated it), and a note: where
    no cell is tagged with the exercise (its tags lost in a copy), the last code cell that defines
    the exercise's function, said in the note."""
    sources = [notebook.source(c) for c in nb["cells"] if notebook.exercise_id(c) == exercise.id]
    if sources:
        return sources[-1], ""
    defines = re.compile(rf"^(?:def|class)\s+{re.escape(exercise.function)}\b", re.MULTILINE)
    sources = [notebook.source(c) for c in nb["cells"] if c.get("cell_type") == "code"
               and defines.search(notebook.source(c))]
    if sources:
        return sources[-1], (f"no cell is tagged 'exercise' for {exercise.id} (its tags lost?): graded the last "
                             f"cell that defines {exercise.function}")
    return None, ""


def _unrun_cells(nb: notebook.Notebook, run: list[str]) -> list[str]:
    """The sources of the notebook's code cells that the grader does not run for an exercise, in order: those
    other than ``run`` (its setup cells, the earlier exercises' cells and its own)."""
    return [src for c in nb["cells"] if c.get("cell_type") == "code" and (src := notebook.source(c)) not in run]


def _setup_cells(nb: notebook.Notebook) -> list[str]:
    """The sources of the cells tagged ``setup``; where none is (tags lost), the first code cell, where
    every notebook has its setup (tests/test_release.py checks it)."""
    cells = notebook.code_cells(nb, "setup") or [c for c in nb["cells"] if c.get("cell_type") == "code"][:1]
    return [notebook.source(c) for c in cells]


def _check_options(timeout_s: float | None, jobs: int | None, names: tuple[str, str] = ("timeout_s=", "jobs=")
                   ) -> None:
    """Raise ValueError, naming the option (``names``: as the CLI spells them), for a time limit that is
    not a number of seconds > 0 or for fewer than 1 job; None is the default, 0 is not."""
    if timeout_s is not None and not 0 < timeout_s < math.inf:
        raise ValueError(f"{names[0]}{timeout_s:g} must be a finite number of seconds > 0")
    if jobs is not None and jobs < 1:
        raise ValueError(f"{names[1]}{jobs} must be 1 or more")


def memory_limit(jobs: int) -> int:
    """Bytes one of ``jobs`` exercises graded at once may allocate beyond what its process holds when it
    starts: a share of this machine's memory, so that a submission that allocates without end fails its
    exercise, where it would make the machine swap, or its kernel kill a process of its choosing."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(_MEMORY_FLOOR, int(total * _MEMORY_SHARE / jobs))


def grade_submission(sub: Submission, timeout_s: float | None = None, jobs: int = 1,
                     stop: threading.Event | None = None) -> dict[str, Result]:
    """Grade every exercise of one submitted notebook; ``timeout_s`` replaces each exercise's own limit.
    ``jobs`` exercises are graded at once, this one's among them: each has its share of the memory
    (``memory_limit``) and of the cores (``spawning.threads_each``). Setting ``stop`` (from another
    thread) ends it within a tenth of a second, with KeyboardInterrupt."""
    _check_options(timeout_s, None)
    exercises = for_lab(sub.lab)
    try:
        nb = notebook.read(sub.path)
    except ValueError as error:
        return {ex.id: Result(ex.id, ERROR, 0, ex.points, message=str(error), notebook=str(sub.path))
                for ex in exercises}
    setup = _setup_cells(nb)
    cells, notes = zip(*(_exercise_cell(nb, ex) for ex in exercises))
    results = {}
    for i, (ex, cell, note) in enumerate(zip(exercises, cells, notes)):
        if cell is None:
            results[ex.id] = Result(ex.id, MISSING, 0, ex.points, notebook=str(sub.path),
                                    message=f"no cell tagged 'exercise' for {ex.id}, nor one that defines "
                                            f"{ex.function} (was it deleted?)")
            continue
        limit = ex.timeout_s if timeout_s is None else timeout_s
        spec = {"exercise": ex.id, "setup": setup, "earlier": [c for c in cells[:i] if c is not None],
                "earlier_s": min(_EARLIER_CELL_S, limit / 4), "cell": cell,
                "memory_bytes": memory_limit(jobs), "threads": threads_each(jobs), "limit_s": limit}
        outcome = _run_worker(spec, sub.path.resolve().parent, limit, stop)
        if outcome["status"] == CRASHED and spec["earlier"]:  # an earlier exercise's cell may have taken it down
            alone = _run_worker({**spec, "earlier": []}, sub.path.resolve().parent, limit, stop)
            if alone["status"] != CRASHED:  # it was one of them
                outcome = alone
                if alone["status"] != PASSED:
                    outcome["message"] = _with_note(outcome["message"], "graded without the cells of the exercises "
                                                    "before it, since with them the process crashed")
        unrun = _unrun_cells(nb, [*setup, *spec["earlier"], cell])
        for extra in (*_notes(outcome["message"], spec["memory_bytes"], unrun), note):
            outcome["message"] = _with_note(outcome["message"], extra)
        results[ex.id] = Result(**{"exercise": ex.id, "points": 0, "max_points": ex.points, **outcome,
                                   "notebook": str(sub.path)})
    return results


def grade(paths: list[Path], timeout_s: float | None = None, jobs: int | None = None, per_file: bool = False
          ) -> dict[str, dict[str, Result]]:
    """Grade every submission under ``paths``: {student: {exercise id: Result}}, where a notebook whose
    lab cannot be told is an entry of its own, keyed by its file name (see ``_add_missing``)."""
    _check_options(timeout_s, jobs)
    submissions = find_submissions(paths, per_file)
    if not any(sub.path.is_file() for sub in submissions):  # only student folders that hold none
        raise FileNotFoundError(f"no notebooks to grade in {', '.join(map(str, paths))}")
    placed = [sub for sub in submissions if sub.lab]
    workers = jobs or cores()
    at_once = max(1, min(workers, len(placed)))
    with _no_main_file():
        graded = _grade_in_threads(placed, timeout_s, workers, at_once)
    book: dict[str, dict[str, Result]] = {sub.student: {} for sub in submissions}
    for (student, lab), copies in _by_student_and_lab(graded).items():
        book[student].update(_best_copy(student, lab, copies, per_file))
    _add_missing(book, submissions, per_file)
    return {student: dict(sorted(results.items())) for student, results in sorted(book.items())}


def _grade_in_threads(placed: list[Submission], timeout_s: float | None, workers: int, at_once: int
                      ) -> list[tuple[Submission, dict[str, Result]]]:
    """Grade ``workers`` submissions at a time. A Ctrl+C or a notebook's Interrupt (or a notebook whose grading
    fails) stops the exercises being graded (their workers killed) and those not begun, and is raised again."""
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = [pool.submit(grade_submission, sub, timeout_s, at_once, stop) for sub in placed]
        return [(sub, future.result()) for sub, future in zip(placed, futures)]
    finally:  # done, interrupted, or a notebook's grading failed: nothing graded goes on
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)


def _add_missing(book: dict[str, dict[str, Result]], submissions: list[Submission], per_file: bool) -> None:
    """Count as missing what a student lacks of the grading's labs: every lab's exercises (a student
    submits each), or with ``per_file`` none (a file is one lab, its own), but for a file whose lab
    cannot be told, the grading's lab where it has one only (where it has several, no lab's: its
    maximum would count them all). Each notebook whose lab cannot be told adds an entry that names
    it, 0 points of 0, and says what would place it."""
    columns = sorted({ex.id for sub in submissions for ex in for_lab(sub.lab)})
    one_lab = len({get(c).lab for c in columns}) == 1
    for results in book.values():
        if per_file and (results or not one_lab):  # a file of its own lab, or one of no lab among several
            continue
        for ex in map(get, columns):
            results.setdefault(ex.id, Result(ex.id, MISSING, 0, ex.points, message=f"no notebook {ex.lab}_* submitted"))
    for sub in submissions:
        if not sub.lab and sub.path.is_file():
            book[sub.student][sub.path.name] = Result(sub.path.name, MISSING, 0, 0, message=_unplaced(sub.path),
                                                      notebook=str(sub.path))


def _an_empty_student(folder: Path) -> bool:
    """Whether a folder of a class folder that holds no notebook is a student's (said on stderr): not
    the grader's own output (a folder holding grades.json)."""
    if (folder / "grades.json").exists():
        return False
    deeper = next(folder.rglob("*.ipynb"), None)
    where = f" ({deeper.relative_to(folder)} is deeper down: move it up)" if deeper else ""
    print(f"{folder}: no notebook in it{where}; every exercise counts as missing", file=sys.stderr)
    return True


def this_notebook(name: str) -> Path:
    """The notebook this kernel runs, so that a renamed copy (``00_welcome-Copy1.ipynb``) grades
    itself: the one Jupyter started the kernel for (``JPY_SESSION_NAME``), or VS Code's
    (``__vsc_ipynb_file__``). Where neither says (nbconvert, papermill), the notebooks of ``name``'s
    lab in the working directory (by their exercises, whatever their names): the only one, or the
    one saved last, said on stderr; ``name`` where there is none."""
    told = _told_notebook()
    if told is not None:
        return told
    lab = notebook.lab_of_name(name)
    candidates = _notebooks_of(lab)
    if len(candidates) > 1:
        print(f"Jupyter did not say which notebook is running (nbconvert does not), and {len(candidates)} notebooks "
              f"of lab {lab} are here: {', '.join(p.name for p in candidates)}. Graded the one saved last, "
              f"{candidates[-1].name}; to grade another, run python -m labkit.grade THAT_FILE.ipynb", file=sys.stderr)
    return candidates[-1] if candidates else Path(name)


def _told_notebook() -> Path | None:
    """The notebook Jupyter (``JPY_SESSION_NAME``) or VS Code (``__vsc_ipynb_file__``) says this kernel runs."""
    for told in (os.environ.get("JPY_SESSION_NAME", ""), _vscode_notebook()):
        if told.endswith(".ipynb") and Path(told).is_file():
            return Path(told)
    return None


def _notebooks_of(lab: str | None) -> list[Path]:
    """The notebooks of ``lab`` in the working directory (by their exercises), the one saved last last."""
    return sorted((p for p in _notebooks_in(Path.cwd()) if _lab_of(p) == lab and not _an_output_of_nbconvert(p)),
                  key=lambda p: p.stat().st_mtime)


def names_the_grader_lacks(exercise: Exercise, fn: Any) -> list[tuple[str, str]]:
    """The names ``fn``'s code reads from the notebook's namespace that no cell the grader runs for ``exercise``
    binds (its setup cells, the cells of the exercises up to it, and the cells that defined ``fn``'s code, as the
    kernel ran them), each with where the notebook binds it. Empty where ``fn`` was not defined in a notebook's cell
    or the notebook cannot be found."""
    view = _as_graded(exercise, fn)
    if view is None:
        return []
    nb, graded, defined = view
    run = [*graded, *(d.cell for d in defined)]
    given = set(dir(builtins)) | set(getattr(_shell(), "user_ns_hidden", ()))  # IPython's own names: In, exit, ...
    bound = given.union(*map(notebook.bound_names, run))
    read = dict.fromkeys(name for code in students_code(fn) for name in global_reads(code))
    unrun = _unrun_cells(nb, run)
    namespace = functions_of(fn)[0].__globals__
    return [(name, _where_bound(name, unrun)[0]) for name in read if name not in bound and name in namespace]


class Defined(NamedTuple):
    """A notebook cell that defined code of a submission: what the exercise calls the code (``Int4Packer.unpack``),
    the code's own name (``my_unpack``), and the cell's source as the kernel ran it."""
    called: str
    name: str
    cell: str

    @property
    def renamed(self) -> bool:
        """Whether the exercise calls the code by another name than its own (``accept_branch = my_accept``)."""
        return self.called.rsplit(".", 1)[-1] != self.name


def skipped_cell_of(exercise: Exercise, fn: Any) -> tuple[Defined, str] | None:
    """Where a cell the grader does not run for ``exercise`` made ``fn`` what the kernel has: defined it, or one of
    a class's methods (a demo cell, or one of the student's own), or bound the exercise's name to it under another
    name (``matmul_intensity = my_version``, ``Int4Packer.unpack = staticmethod(my_unpack)``), as the last cell of
    the notebook to bind that name. That code, and what the cell did in words ("defined by the cell below the
    exercise cell that begins ..."); None where the grader runs every such cell, or where the cells or the
    notebook cannot be told."""
    view = _as_graded(exercise, fn)
    if view is None:
        return None
    nb, graded, defined = view
    sources = [notebook.source(c) for c in nb["cells"] if c.get("cell_type") == "code"]
    runs = [notebook.as_run(source) for source in sources]
    run_by_grader = set(map(notebook.as_run, graded))
    own = _exercise_cell(nb, exercise)[0]
    where = next((i for i, source in enumerate(sources) if source == own), None)

    def in_words(i: int) -> str:
        side = "" if where is None else "above" if i < where else "below"
        return f"the cell {side + ' the exercise cell ' if side else ''}that begins `{_first_line(sources[i])}`"
    for code in defined:
        ran = notebook.as_run(code.cell)
        first = next((i for i, source in enumerate(runs) if source == ran), None)
        if first is not None and ran not in run_by_grader:  # else edited since it was saved, or run by the grader
            return code, f"defined by {in_words(first)}"
    for code in (code for code in defined if code.renamed):
        binders = [i for i, source in enumerate(sources) if code.called in notebook.bound_names(source)]
        if binders and runs[binders[-1]] not in run_by_grader:
            return code, f"bound to it by {in_words(binders[-1])}"
    return None


def _as_graded(exercise: Exercise, fn: Any) -> tuple[notebook.Notebook, list[str], list[Defined]] | None:
    """The notebook this kernel runs, the sources of the cells the grader runs for ``exercise`` (its setup cells
    and the cells of the exercises up to it, as saved), and the cells that defined ``fn``'s code as the kernel ran
    them, each with what the exercise calls that code and its own name (see ``_defined``); None where none of it was
    defined in a notebook's cell or the notebook cannot be found or read."""
    defined = _defined(exercise, fn)
    path = _told_notebook() or next(reversed(_notebooks_of(exercise.lab)), None)
    if not defined or path is None:
        return None
    try:
        nb = notebook.read(path)
    except ValueError:
        return None
    return nb, [*_setup_cells(nb), *(_exercise_cell(nb, ex)[0] or "" for ex in _up_to(exercise))], defined


def _defined(exercise: Exercise, fn: Any) -> list[Defined]:
    """The notebook cells that defined ``fn``'s code, as the kernel ran them, each with what the exercise calls the
    code and its own name: ``fn`` itself (``accept_branch``, ``my_accept``), a class by the cells of its own
    methods (``Int4Packer``, ``MyPacker``), and each method patched into the class from elsewhere
    (``Int4Packer.unpack``, ``my_unpack``). Code of a file is left out."""
    if isinstance(fn, type):
        named = [(exercise.function, fn.__name__, f) if f.__qualname__.startswith(f"{fn.__qualname__}.")
                 else (f"{exercise.function}.{attr}", _own_name(f), f) for attr, f in methods_of(fn).items()]
    else:
        named = [(exercise.function, _own_name(f), f) for f in functions_of(fn)]
    cells = [Defined(called, name, _cell_of(f)) for called, name, f in named]
    return list(dict.fromkeys(defined for defined in cells if defined.cell is not None))


def _own_name(function: Any) -> str:
    """A function's name as a student would say it: ``my_accept``, ``Other.unpack`` for another class's method,
    ``a lambda``."""
    return "a lambda" if function.__name__ == "<lambda>" else function.__qualname__.replace(".<locals>", "")


def _up_to(exercise: Exercise) -> list[Exercise]:
    """The exercises of ``exercise``'s notebook up to it, itself included."""
    ours = for_lab(exercise.lab)
    return ours[:ours.index(exercise) + 1]


def _cell_of(function: Any) -> str | None:
    """The source of the notebook cell that defined ``function``, as the kernel ran it (IPython keeps each cell's
    source in linecache, under a name no file has); None for code of a file."""
    filename = function.__code__.co_filename
    if os.path.exists(filename):
        return None
    return "".join(linecache.getlines(filename)) or None


def _where_bound(name: str, unrun: list[str]) -> tuple[str, str | None]:
    """Where the notebook binds ``name`` outside the cells the grader runs, in words, and that cell's source: the
    first such cell, by its first line (None where no cell of the notebook binds it)."""
    binder = next((src for src in unrun if name in notebook.bound_names(src)), None)
    return ((f"defined by the cell that begins `{_first_line(binder)}`" if binder is not None
             else "defined by a cell of yours, or one run and deleted since"), binder)


def _an_output_of_nbconvert(path: Path) -> bool:
    """``X.nbconvert.ipynb``: what ``jupyter nbconvert --execute X.ipynb`` wrote, not a student's copy."""
    return path.name.endswith(".nbconvert.ipynb")


def _vscode_notebook() -> str:
    """The notebook VS Code runs this kernel for, which it puts in the kernel's namespace."""
    shell = _shell()
    return str(shell.user_ns.get("__vsc_ipynb_file__", "")) if shell is not None else ""


def _shell() -> Any:
    """The IPython shell this code runs in, if any."""
    return sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None


def grade_this(name: str) -> None:
    """The grade cell of notebook ``name``: find the file this kernel runs, say which file that is
    and when it was saved (the grader reads the file, not the cells on screen), grade it and print
    the table. Under ``LABKIT_STRICT=1`` (CI's run of the solutions) anything short of full points
    raises, as a check does."""
    path = this_notebook(name)
    if not path.is_file():
        nothing = (f"Nothing to grade: Jupyter did not say which notebook is running, and {Path.cwd()} holds no "
                   f"notebook with lab {notebook.lab_of_name(name)}'s exercises. Save this notebook (Ctrl+S) in the "
                   "folder it runs in, or grade it from a terminal: python -m labkit.grade PATH/TO/IT.ipynb")
        fail_if_strict(nothing)
        print(nothing)
        return
    saved = time.strftime("%H:%M:%S", time.localtime(path.stat().st_mtime))
    print(f"grading {path.resolve()}, saved at {saved} (the file on disk: save first, Ctrl+S; after Save As, restart "
          "the kernel, or Jupyter still names the old file)")
    book = grade([path], per_file=True)  # named after the file, not the folder it is in
    print(table(book))
    short = sorted(ex_id for results in book.values() for ex_id, r in results.items() if r.status != PASSED)
    fail_if_strict(f"LABKIT_STRICT=1: the grader did not pass {', '.join(short)} of {path.name} (the table above "
                   "says why)" if short else None)


@contextmanager
def _no_main_file() -> Iterator[None]:
    """Start the workers with no ``__file__`` on ``__main__``: a new process runs that file first,
    and the workers need nothing of it (they run labkit.grade's own code). In a notebook ``__main__``
    has none, unless Triton's interpreter has run a kernel defined there: it copies its own module's
    globals, ``__file__`` included, into the kernel's, and every worker then crashed running them."""
    main = sys.modules["__main__"]
    saved = vars(main).pop("__file__", None)
    try:
        yield
    finally:
        if saved is not None:
            main.__file__ = saved


def _by_student_and_lab(graded: list[tuple[Submission, dict[str, Result]]]
                        ) -> dict[tuple[str, str], list[tuple[Submission, dict[str, Result]]]]:
    groups: dict[tuple[str, str], list[tuple[Submission, dict[str, Result]]]] = {}
    for sub, results in graded:
        groups.setdefault((sub.student, sub.lab), []).append((sub, results))
    return groups


def _best_copy(student: str, lab: str, copies: list[tuple[Submission, dict[str, Result]]], per_file: bool
               ) -> dict[str, Result]:
    """The results of the copy of one lab's notebook with the most points; where a student submitted several, the
    choice is said on stderr and in a note of each counted result that names the other copies."""
    best_sub, best = max(copies, key=lambda c: _total(c[1])[0])
    if len(copies) == 1:
        return best
    names = ", ".join(sub.path.name for sub, _ in copies)
    hint = "" if per_file else " (if they are different students' copies, grade with --per-file)"
    print(f"{student} has {len(copies)} notebooks for {lab}_ ({names}): counting the best, "
          f"{best_sub.path.name}{hint}", file=sys.stderr)
    others = ", ".join(f"{sub.path.name} ({_total(results)[0]:g}/{_total(results)[1]} points)"
                       for sub, results in copies if sub is not best_sub)
    note = f"counted the best of the {len(copies)} notebooks submitted for {lab}_, this one; not {others}"
    return {key: replace(r, message=_with_note(r.message, note)) for key, r in best.items()}


def _total(results: dict[str, Result]) -> tuple[float, int]:
    return sum(r.points for r in results.values()), sum(r.max_points for r in results.values())


def _columns(book: dict[str, dict[str, Result]]) -> list[str]:
    """Every exercise any student was graded on (with ``--per-file``, a file has its own lab's only);
    not the entries of notebooks whose lab cannot be told."""
    return sorted({key for results in book.values() for key in results if key in EXERCISES})


def _lab_of_entry(key: str) -> str:
    """The lab of an exercise's entry; the file name, for a notebook whose lab cannot be told."""
    return EXERCISES[key].lab if key in EXERCISES else key


def table(book: dict[str, dict[str, Result]]) -> str:
    """A points table, then the reason for every exercise that did not pass, or for a notebook none of whose
    exercises was attempted, or submitted, in one line (``_groups``); for one student, a list."""
    if len(book) == 1:
        return _one_student(*next(iter(book.items())))
    columns = _columns(book)
    width = max(len("student"), *(len(s) for s in book))
    lines = ["  ".join(["student".ljust(width), *(c.rjust(7) for c in columns), "  total"])]
    for student, results in book.items():
        got, most = _total(results)
        cells = [(f"{results[c].points:g}/{results[c].max_points}" if c in results else "-").rjust(7) for c in columns]
        lines.append("  ".join([student.ljust(width), *cells, f"{got:g}/{most}".rjust(7)]))
    notes = [f"{student} {_label(group)}: {_verdict(group)}" for student, results in book.items()
             for group in _groups(results) if next(iter(group.values())).status != PASSED]
    return "\n".join(lines + ([""] + notes if notes else []))


def _one_student(student: str, results: dict[str, Result]) -> str:
    """A line per exercise, with the reason where it did not pass, or per notebook (``_groups``)."""
    got, most = _total(results)
    lines = [f"{student}: {got:g}/{most} points"]
    for group in _groups(results):
        got, most = _total(group)
        lines.append(f"  {_label(group):<8}{f'{got:g}/{most}':>6}  {_verdict(group)}")
    return "\n".join(lines)


def _groups(results: dict[str, Result]) -> list[dict[str, Result]]:
    """The results in their order, an exercise's alone, but a notebook's together where it has several exercises
    and none was attempted, or none submitted: all of them ``not attempted``, or all ``missing``."""
    by_lab: dict[str, dict[str, Result]] = {}
    for key, result in results.items():
        by_lab.setdefault(_lab_of_entry(key), {})[key] = result
    groups = []
    for ours in by_lab.values():
        statuses = {r.status for r in ours.values()}
        untouched = len(ours) > 1 and len(statuses) == 1 and statuses <= {NOT_ATTEMPTED, MISSING}
        groups += [ours] if untouched else [{key: r} for key, r in ours.items()]
    return groups


def _label(group: dict[str, Result]) -> str:
    """An exercise's id (or a file's name, for a notebook whose lab cannot be told); ``03_*`` for a notebook's."""
    return next(iter(group)) if len(group) == 1 else f"{_lab_of_entry(next(iter(group)))}_*"


def _verdict(group: dict[str, Result]) -> str:
    """An exercise's status, with how many of its cases passed where one failed or never ended (``failed (2/5
    cases)``), and the reason it did not pass; a notebook's status, its exercises, and their reason where
    they share one."""
    if len(group) > 1:
        reasons = {r.message for r in group.values()}
        why = f" ({reasons.pop()})" if len(reasons) == 1 and "" not in reasons else ""
        return f"{next(iter(group.values())).status}: {', '.join(group)}{why}"
    (r,) = group.values()
    cases = f" ({r.passed}/{r.total} cases)" if r.total and r.status in (FAILED, TIMEOUT, CRASHED) else ""
    why = f": {r.message}" if r.message and r.status != PASSED else ""
    return f"{r.status}{cases}{why}"


def write_reports(book: dict[str, dict[str, Result]], out: Path) -> tuple[Path, Path]:
    """grades.json (``_report``) and grades.csv (a row per student: the points of each exercise, blank where
    it is missing; where there are several notebooks (a gradebook's assignments), the points of each and out of
    how many (``_lab_total``); the points in all, out of how many, and which exercises did not pass and why, in a
    word; a notebook whose lab cannot be told, by its file name)."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out / "grades.json", out / "grades.csv"
    json_path.write_text(json.dumps({s: _report(r) for s, r in book.items()}, indent=2) + "\n", encoding="utf-8")
    columns = _columns(book)
    labs = sorted({get(c).lab for c in columns})
    labs = labs if len(labs) > 1 else []  # one notebook: its total is the total
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["student", *columns, *(f"{lab} {of}" for lab in labs for of in ("total", "max")), "total",
                         "max", "not passed"])
        for student, results in book.items():
            missed = "; ".join(f"{r.exercise} {r.status}" for r in results.values() if r.status != PASSED)
            points = ("" if c not in results or results[c].status == MISSING else f"{results[c].points:g}"
                      for c in columns)
            per_lab = (cell for lab in labs for cell in _lab_total(results, lab))
            writer.writerow([student, *points, *per_lab, *map(str, _total(results)), missed])
    return json_path, csv_path


def _report(results: dict[str, Result]) -> dict:
    """A student's grades.json: the points in all and out of how many, every exercise's result, and under
    ``unplaced`` each notebook whose lab cannot be told, by its file name, with what would place it."""
    got, most = _total(results)
    return {"total": got, "max": most, "exercises": {e: r.to_dict() for e, r in results.items() if e in EXERCISES},
            "unplaced": {name: r.message for name, r in results.items() if name not in EXERCISES}}


def _lab_total(results: dict[str, Result], lab: str) -> tuple[str, str]:
    """The points of one notebook's exercises and out of how many: both blank for a student graded on none of
    them, the points blank where all of them are missing."""
    ours = {e: r for e, r in results.items() if _lab_of_entry(e) == lab}
    if not ours:
        return "", ""
    got, most = _total(ours)
    return ("" if all(r.status == MISSING for r in ours.values()) else f"{got:g}"), str(most)


def _isolate(cwd: str, scratch: str, memory_bytes: int, threads: int) -> None:
    """In the worker: own process group, the notebook's folder as working directory and first on
    the import path (as in Jupyter), no terminal output, its share of the cores, caps on files
    written and on memory allocated, and an IPython profile of its own (so the user's history is
    not written to)."""
    import resource

    import torch

    os.setsid()
    os.chdir(cwd)
    sys.path.insert(0, cwd)  # as in Jupyter, a module beside the notebook imports
    os.environ.update(LABKIT_STRICT="0", MPLBACKEND="Agg", IPYTHONDIR=scratch)
    import matplotlib  # the fork server imported it before MPLBACKEND above could choose its backend

    matplotlib.use("Agg")  # no window, and no notebook's inline backend: plt.show() draws nowhere, at once
    resource.setrlimit(resource.RLIMIT_FSIZE, (_OUTPUT_LIMIT, _OUTPUT_LIMIT))
    torch.set_num_threads(min(torch.get_num_threads(), threads))  # the exercises graded at once share the cores
    _cap_memory(memory_bytes, threads)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)


def _end_with_grader() -> None:
    """Kill this worker's process group (itself and whatever it started) as soon as its grader ends: a grader
    killed outright (``kill -9``, a machine's OOM killer) can no longer stop its worker at the time limit, and an
    endless loop, or a wait that never ends, would outlive it for good. A thread waits for the end of the pipe
    the grader alone holds open (multiprocessing's parent sentinel): no process id that another process could
    take by then is involved."""
    from multiprocessing import connection, parent_process

    parent = parent_process()
    if parent is None:  # not started by multiprocessing: no grader to watch
        return

    def watch() -> None:
        try:
            while connection.wait([parent.sentinel]) and os.read(parent.sentinel, 1):
                pass  # data, not the end of the pipe: the grader is there
        except OSError:  # the pipe cannot be read: the CPU cap is the backstop left
            return
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="labkit-grader-watch", daemon=True).start()


def _cap_cpu(seconds: float) -> None:
    """End this process once it has used ``seconds`` of CPU time: a second backstop for a worker whose grader was
    killed, where code that holds the GIL (a C extension's loop, a pathological regular expression) keeps
    ``_end_with_grader``'s thread from running. No core file is written (the working directory is the student's
    folder)."""
    import resource

    limit = math.ceil(seconds)
    for kind, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, limit)):
        try:
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError):  # a hard limit below it, set by the system: that one stands
            pass


def _cap_memory(share: int, threads: int) -> None:
    """Let this process allocate ``share`` bytes beyond what it holds now, and an allowance for each of its
    torch ``threads``, for a pool of one thread per core (numpy's BLAS starts one) and for the thread that
    watches the grader: RLIMIT_DATA counts the address space reserved, a thread's stack included, so that an
    allocation past the cap fails. On Linux only: elsewhere the limit is not enforced on what torch
    allocates."""
    import resource

    held = _data_bytes()
    if held is None:
        return
    limit = held + (threads + cores() + 1) * _THREAD_ALLOWANCE + share  # + 1: the thread that watches the grader
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    except (ValueError, OSError):  # a hard limit below it, set by the system: that one stands
        pass


def _data_bytes() -> int | None:
    """The data this process holds (VmData, from /proc); None where /proc does not say (not Linux)."""
    try:
        found = re.search(r"^VmData:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) << 10 if found else None


def _worker(spec: dict, cwd: str, result_path: str) -> None:
    """Inside the fresh process: run the setup cells, the earlier exercises' cells and the
    exercise's cell as IPython would, then the cases."""
    from IPython.core.interactiveshell import InteractiveShell

    _isolate(cwd, str(Path(result_path).parent), spec["memory_bytes"], spec["threads"])
    _end_with_grader()  # should the grader be killed, which can no longer stop this process at its limit
    _cap_cpu(spec["limit_s"] * cores() + _CPU_SLACK_S)  # every core busy for the whole limit stays within it
    exercise = get(spec["exercise"])
    shell = InteractiveShell.instance(colors="nocolor")
    shell.user_ns.update(exit=sys.exit, quit=sys.exit)  # IPython's, which ask a terminal or kernel to end, fail here
    failed = _run_cells(shell, "a setup cell", spec["setup"])
    if failed is None:
        for src in spec["earlier"]:  # what an earlier exercise's cell defines is this one's to use, its errors are not
            with time_limit(spec["earlier_s"]):  # IPython catches its Overtime, as any error of the cell
                shell.run_cell(src, store_history=False)
        failed = _run_cells(shell, "the exercise cell", [spec["cell"]])
    fn = shell.user_ns.get(exercise.function)
    if failed is not None or fn is None:
        outcome = {"status": ERROR, "message": failed or f"the exercise cell does not define {exercise.function}"}
    else:
        case_file = Path(result_path).with_name(CASE_FILE)
        result = run_cases(exercise, fn, starting=lambda started: _write_whole(case_file, asdict(started)))
        outcome = {k: v for k, v in result.to_dict().items() if k not in ("exercise", "max_points")}
    outcome["message"] = _shortened(outcome["message"])
    _write_whole(Path(result_path), outcome)


def _write_whole(path: Path, record: dict) -> None:
    """Write ``record`` as JSON whole or not at all: the file cap, or a kill, may stop a write."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record), encoding="utf-8")
    os.replace(partial, path)


def _shortened(message: str) -> str:
    """A message without its lines of only spaces (torch's after "Tensor-likes are not close!"), cut to
    ``_MESSAGE_LIMIT`` characters (a student's exception may hold megabytes)."""
    message = "\n".join(line for line in message.split("\n") if line.strip())
    if len(message) <= _MESSAGE_LIMIT:
        return message
    return f"{message[:_MESSAGE_LIMIT]}... ({len(message) - _MESSAGE_LIMIT:,} more characters)"


def _with_note(message: str, note: str) -> str:
    """``message`` with ``note: ...`` on a line of its own (the note alone where there is no message, the
    message alone where there is no note)."""
    if not note:
        return message
    return f"{message}\n    note: {note}" if message else f"note: {note}"


def _notes(message: str, memory_bytes: int, unrun: list[str]) -> list[str]:
    """What the grader does differently from the notebook, where a failure's message suggests that it mattered;
    ``unrun``: the sources of the notebook's code cells that the grader did not run."""
    notes = []
    if "raised NameError" in message and "a setup cell" not in message:  # it passes inline, maybe
        notes.append(_name_note(message, unrun))
    if re.search(r"\bMemoryError\b|can't allocate memory", message):  # not CUDA's OutOfMemoryError: uncapped
        notes.append(f"while graded, an exercise may allocate {memory_bytes / 2**30:.1f} GiB beyond what the "
                     "grader's own process holds")
    return notes


def _name_note(message: str, unrun: list[str]) -> str:
    """For a NameError, the first cell the grader did not run that binds the name (a demo's import, say), by its
    first line; where none does, that the grader runs only the setup cells and the exercise cells."""
    name = re.search(r"NameError: name '(\w+)' is not defined", message)
    where, binder = _where_bound(name[1], unrun) if name else ("", None)
    if binder is None:
        return ("the grader runs only the setup cells and the exercise cells; if the name is defined in a cell of "
                "your own, move it into the exercise cell")
    return f"{name[1]} is {where}, which the grader does not run: import or define it in the exercise cell"


def _first_line(source: str, limit: int = 60) -> str:
    """The first line of a cell that is not blank, cut to ``limit`` characters."""
    line = next((line.strip() for line in source.split("\n") if line.strip()), "")
    return line if len(line) <= limit else f"{line[:limit - 3]}..."


def _run_cells(shell: InteractiveShell, kind: str, sources: list[str]) -> str | None:
    """Run the cells in turn, as IPython would; at the first that raises, stop and say what it raised."""
    for src in sources:
        ran = shell.run_cell(src, store_history=False)
        error = ran.error_before_exec or ran.error_in_exec
        # a syntax error in the cell itself: its text names IPython's file for the cell, so say the line
        if isinstance(ran.error_before_exec, SyntaxError) and error.lineno:
            return f"{kind} raised {type(error).__name__}: {error.msg} (line {error.lineno} of the cell)"
        if isinstance(error, SystemExit):  # its text is only its code, often none
            code = "" if error.code is None else f" with code {error.code!r}"
            return f"{kind} called sys.exit, exit() or quit(){code}{_cell_line(error)}: remove the call"
        if error is not None:
            return f"{kind} raised {type(error).__name__}: {error}"
    return None


def _cell_line(error: BaseException) -> str:
    """`` (line 3 of the cell)``: the last line of the cell's own code that ``error`` passed through (the cell
    is the first ``<module>`` of its traceback); empty where it passed through none."""
    frames = traceback.extract_tb(error.__traceback__)
    cell = next((f.filename for f in frames if f.name == "<module>"), None)
    lines = [f.lineno for f in frames if f.filename == cell]
    return f" (line {lines[-1]} of the cell)" if lines else ""


def _limits() -> str:
    """Each exercise's own time limit, the most common first: "60 s for 28 exercises, 30 s for ex06b.1, ..."."""
    by_limit: dict[float, list[str]] = {}
    for ex in EXERCISES.values():
        by_limit.setdefault(ex.timeout_s, []).append(ex.id)
    common, *others = sorted(by_limit.items(), key=lambda item: -len(item[1]))
    return ", ".join([f"{common[0]:g} s for {len(common[1])} exercises"]
                     + [f"{limit:g} s for {', '.join(ids)}" for limit, ids in others])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.grade",
                                     description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks, a student's folder, or a class folder")
    parser.add_argument("--out", type=Path, default=Path("grades"),
                        help="where grades.json and grades.csv go (default: grades)")
    parser.add_argument("--timeout", type=float, help="seconds per exercise, replacing every exercise's own limit, "
                                                      f"up or down (default: each its own: {_limits()})")
    parser.add_argument("--jobs", type=int, help="notebooks graded at once (default: CPU count)")
    parser.add_argument("--per-file", action="store_true",
                        help="each notebook is a student of its own, named by its file (a flat folder of a class)")
    args = parser.parse_args(argv)
    if not args.paths:
        parser.error("give at least one notebook or folder to grade")
    try:  # before grading, which may take minutes
        _check_options(args.timeout, args.jobs, ("--timeout ", "--jobs "))
    except ValueError as error:
        parser.error(str(error))
    if other := next((p for p in args.paths if p.is_file() and p.suffix != ".ipynb"), None):
        parser.error(f"{other} is not a notebook (.ipynb): name notebooks, or folders of them")
    if blocked := next((p for p in (args.out, *args.out.parents) if p.exists() and not p.is_dir()), None):
        where = "" if blocked == args.out else f": {blocked}"
        parser.error(f"--out {args.out}{where} is a file: give a folder for grades.json and grades.csv")
    try:
        book = grade(args.paths, args.timeout, args.jobs, args.per_file)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: nothing graded is kept, and no report was written to {args.out}", file=sys.stderr)
        return 130
    print(table(book))
    json_path, csv_path = write_reports(book, args.out)
    print(f"\nwrote {json_path} and {csv_path}")
    if not _columns(book):  # the reports say why of each file; the exit status, that nothing was graded
        print("error: nothing was graded: no notebook's lab could be told (the reasons are above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
