"""The grader: full points on solutions/, zero on notebooks/, and it survives broken submissions."""
from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit import notebook
from labkit.background import children
from labkit.check import ExerciseFailed
from labkit.exercises import EXERCISES, for_lab, get
from labkit.grade import (CRASHED, ERROR, MISSING, TIMEOUT, find_submissions, grade, grade_this, main, table,
                          this_notebook, write_reports)


CORRECT_ROOFLINE = "def attainable_flops(i, p, b):\n    return min(p, i * b)\n"
BROKEN_EX1 = {
    "loops": "def matmul_intensity(m, n, k, b=2):\n    while True:\n        pass\n",
    "raises": "raise RuntimeError('boom')\n",
    "syntax": "def matmul_intensity(m, n, k, b=2)\n    return 1\n",
    "exits": "import sys\nsys.exit(3)\n",
    "quits": "x = 1\nquit()\n",  # IPython's quit, which a bare shell cannot honour
    "hard_exits": "import os\ndef matmul_intensity(m, n, k, b=2):\n    os._exit(7)\n",
    "crashes_at_top": "import os\nos._exit(9)\n",  # and ex00.2's worker, which runs this cell first, crashes too
    "loops_at_top": "while True:\n    pass\n",
    # right in case 1, wrong in case 2, endless in case 3: a timeout says what had passed before it
    "loops_late": "def matmul_intensity(m, n, k, b=2):\n    while m == n == k:\n        pass\n    if m == 512:\n"
                  "        return 0.0\n    return 2 * m * n * k / (b * (m * k + k * n + m * n))\n",
    "exits_when_called": "import sys\ndef matmul_intensity(m, n, k, b=2):\n    sys.exit(4)\n",
    "wrong": "def matmul_intensity(m, n, k, b=2):\n    return 2 * m * n * k / (b * n * k)\n",
    "renamed": "def intensity(m, n, k, b=2):\n    return 1.0\n",
    # a helper defined in a cell of the student's own: the inline check saw it, the grader does not
    "helper_elsewhere": "def matmul_intensity(m, n, k, b=2):\n    return _intensity(m, n, k, b)\n",
    # a name the notebook's own Explore cell imports, which the grader does not run
    "uses_a_demo": ("def matmul_intensity(m, n, k, b=2):\n    assert widgets\n"
                    "    return 2*m*n*k / (b*(m*k + k*n + m*n))\n"),
    # a message with a blank line in it, as torch's "Tensor-likes are not close!\n\nMismatched elements..."
    "blank_line": "def matmul_intensity(m, n, k, b=2):\n    raise ValueError('not close!\\n\\nMismatched')\n",
    "magic": "%time x = 1\ndef matmul_intensity(m, n, k, b=2):\n    return 2*m*n*k / (b*(m*k + k*n + m*n))\n",
    # an exception's message of 2 MB, past the cap on a file the worker writes (its result among them)
    "shouts": "def matmul_intensity(m, n, k, b=2):\n    raise ValueError('x' * (2 << 20))\n",
    # right, but a thread of its own keeps the process alive past the time limit
    "lingers": "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,)).start()\n"
               "def matmul_intensity(m, n, k, b=2):\n    return 2*m*n*k / (b*(m*k + k*n + m*n))\n",
    # three quarters of the machine's memory, asked for and never touched: allowed but for the grader's cap
    "hoards": "import os, torch\ndef matmul_intensity(m, n, k, b=2):\n"
              "    torch.empty(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') * 3 // 4, dtype=torch.uint8)\n"
              "    return 2*m*n*k / (b*(m*k + k*n + m*n))\n",
}


# a notebook of no lab that can be told: code pasted into a new notebook, no NN_ name, no tagged cell, and no
# exercise's function defined (attainable_flops, say, would place it in lab 00)
NO_LAB = {"cells": [{"cell_type": "code", "metadata": {}, "source": "def roof(i, p, b):\n    return min(p, i * b)\n",
                     "outputs": [],
                     "execution_count": None}], "metadata": {}, "nbformat": 4, "nbformat_minor": 4}


def _submit(folder, student, template, ex1_source=None, drop_ex1=False, name="00_welcome.ipynb",
            ex2_source=CORRECT_ROOFLINE):
    nb = notebook.read(template)
    kept = []
    for cell in nb["cells"]:
        ex_id = notebook.exercise_id(cell)
        if ex_id == "ex00.1" and drop_ex1:
            continue
        if ex_id == "ex00.1" and ex1_source is not None:
            notebook.set_source(cell, ex1_source)
        if ex_id == "ex00.2":
            notebook.set_source(cell, ex2_source)
        kept.append(cell)
    nb["cells"] = kept
    (folder / student).mkdir(parents=True)
    notebook.write(nb, folder / student / name)


def test_a_solution_scores_full_points_and_its_stubs_zero(root):
    # Every lab's solutions go through the grader in CI: each solution's grade cell runs under
    # LABKIT_STRICT=1 in tests/test_notebooks.py, where anything short of full points raises (the
    # test below). Here lab 00's solution and stubs, graded together: a stub's setup cells are its
    # solution's (labkit.release changes only the solution regions), and tests/test_exercises.py
    # checks that every released stub, of every lab, scores nothing.
    book = grade([root / "solutions" / "00_welcome.ipynb", root / "notebooks" / "00_welcome.ipynb"])
    ours = {ex.id for ex in for_lab("00")}
    assert set(book["solutions"]) == set(book["notebooks"]) == ours and len(ours) >= 2
    assert {r.status for r in book["solutions"].values()} == {"passed"}
    assert {r.status for r in book["notebooks"].values()} == {"not attempted"}
    assert sum(r.points for r in book["solutions"].values()) == sum(get(ex_id).points for ex_id in ours)
    assert sum(r.points for r in book["notebooks"].values()) == 0


def test_every_lab_has_a_solution_whose_grade_cell_ci_runs(root):
    """What makes the strict grade cells of tests/test_notebooks.py cover every exercise."""
    labs = {ex.lab for ex in EXERCISES.values()}
    for lab in labs:
        (solution,) = (root / "solutions").glob(f"{lab}_*.ipynb")
        cells = [notebook.source(c) for c in notebook.read(solution)["cells"] if c.get("cell_type") == "code"]
        assert any(f'grade.grade_this("{solution.name}")' in source for source in cells), solution


def test_the_grade_cell_under_strict_raises_short_of_full_points(root, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setenv("LABKIT_STRICT", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExerciseFailed, match="Nothing to grade"):
        grade_this("00_welcome.ipynb")
    stubs = tmp_path / "00_welcome.ipynb"
    stubs.write_text((root / "notebooks" / "00_welcome.ipynb").read_text())
    ids = ", ".join(sorted(ex.id for ex in for_lab("00")))
    with pytest.raises(ExerciseFailed, match=f"did not pass {re.escape(ids)} of 00_welcome\\.ipynb"):
        grade_this("00_welcome.ipynb")
    assert "not attempted" in capsys.readouterr().out  # the table is printed first
    monkeypatch.setenv("LABKIT_STRICT", "0")
    grade_this("00_welcome.ipynb")  # a student's run: the table, no error


def test_grading_from_a_notebook_where_triton_left_a_main_file(root, tmp_path):
    """Triton's interpreter puts its own ``__file__`` into the globals of a kernel defined in a
    notebook, that is ``__main__``'s: the workers must not run it (they all crashed)."""
    trap = tmp_path / "trap.py"
    trap.write_text("raise ImportError('a worker ran __main__.__file__')\n")
    code = ("import sys, labkit.grade as g\n"
            f"sys.modules['__main__'].__file__ = {str(trap)!r}\n"
            f"book = g.grade([__import__('pathlib').Path({str(root / 'solutions/00_welcome.ipynb')!r})])\n"
            "print(sorted({r.status for r in book['solutions'].values()}), sys.modules['__main__'].__file__)\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["['passed']", str(trap)], ran.stdout + ran.stderr  # and __file__ is back


def test_the_workers_draw_with_agg_whatever_backend_the_grader_was_given(root, tmp_path, monkeypatch):
    """A notebook's grade cell runs with ipykernel's inline backend in MPLBACKEND; the fork server has
    imported matplotlib by then, so the workers must switch to Agg themselves."""
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    asks = ("import matplotlib\n"
            "def matmul_intensity(m, n, k, b=2):\n"
            "    backend = matplotlib.rcParams._get('backend')  # as set, before any plot resolves it\n"
            "    assert str(backend).lower() == 'agg', f'the backend is {backend}'\n"
            "    return 2*m*n*k / (b*(m*k + k*n + m*n))\n")
    _submit(tmp_path, "plots", root / "notebooks/00_welcome.ipynb", asks)
    result = grade([tmp_path / "plots"], timeout_s=30)["plots"]["ex00.1"]
    assert result.status == "passed", result.message


@pytest.fixture(scope="module")
def class_folder(tmp_path_factory):
    from tests.conftest import ROOT
    folder = tmp_path_factory.mktemp("class")
    template = ROOT / "notebooks/00_welcome.ipynb"
    for student, source in BROKEN_EX1.items():
        _submit(folder, student, template, source)
    _submit(folder, "deleted", template, drop_ex1=True)
    # as in the notebook, an exercise may use what an earlier exercise's cell defined
    _submit(folder, "reuses", template, BROKEN_EX1["magic"] + "def roof(i, p, b):\n    return min(p, i * b)\n",
            ex2_source="def attainable_flops(i, p, b):\n    return roof(i, p, b)\n")
    _submit(folder, "copy_renamed", template, BROKEN_EX1["magic"], name="my_work.ipynb")
    _submit(folder, "two_copies", template, BROKEN_EX1["wrong"])  # the original is wrong, its copy right
    notebook.write(notebook.read(folder / "magic/00_welcome.ipynb"), folder / "two_copies/00_welcome-Copy1.ipynb")
    _submit(folder / "zipped", "inner", template, BROKEN_EX1["magic"])
    _submit(folder, "ex2_crashes", template, BROKEN_EX1["magic"], ex2_source="import os\nos._exit(5)\n")
    _submit(folder, "imports_broken", template, "import broken_helper\n")  # the syntax error is in another file
    (folder / "imports_broken/broken_helper.py").write_text("x = 1\ndef f(:\n")
    (folder / "garbage").mkdir()
    (folder / "garbage/00_welcome.ipynb").write_text("{ this is not json")
    return folder


@pytest.fixture(scope="module")
def class_book(class_folder):
    return grade([class_folder], timeout_s=8)


@pytest.mark.parametrize("student, status, says", [
    ("loops", TIMEOUT, "stopped after 8 s in case 1 of 5 ("),  # the message names the case that never ended
    ("raises", ERROR, "RuntimeError: boom"),
    ("syntax", ERROR, "the exercise cell raised SyntaxError: expected ':' (line 1 of the cell)"),
    ("imports_broken", ERROR, "broken_helper.py, line 2)"),
    ("exits", ERROR, "the exercise cell called sys.exit, exit() or quit() with code 3 (line 2 of the cell): remove"),
    ("quits", ERROR, "the exercise cell called sys.exit, exit() or quit() (line 2 of the cell): remove the call"),
    ("hard_exits", CRASHED, "exited with code 7"),
    ("crashes_at_top", CRASHED, "exited with code 9"),
    ("zipped", MISSING, "no notebook 00_* submitted"),  # a folder with its notebook one level deeper
    ("exits_when_called", "failed", "raised SystemExit: 4"),
    # before any case; and ex00.2, which runs this cell first, is not held up
    ("loops_at_top", TIMEOUT, "stopped after 8 s before its first case"),
    ("wrong", "failed", "hint:"),
    ("renamed", ERROR, "does not define matmul_intensity"),
    ("helper_elsewhere", "failed", "if the name is defined in a cell of your own, move it into the exercise cell"),
    ("uses_a_demo", "failed", "note: widgets is defined by the cell that begins `import ipywidgets as widgets`, "
                              "which the grader does not run: import or define it in the exercise cell"),
    ("blank_line", "failed", "raised ValueError: not close!\n    Mismatched"),  # the line of spaces between, dropped
    ("deleted", MISSING, "no cell tagged 'exercise' for ex00.1"),
    ("magic", "passed", ""),
    ("reuses", "passed", ""),
    ("copy_renamed", "passed", ""),
    ("two_copies", "passed", "note: counted the best of the 2 notebooks submitted for 00_, this one; not "
                             "00_welcome.ipynb (1/3 points)"),
    ("garbage", ERROR, "not a readable notebook"),
    ("hoards", "failed", "can't allocate memory: you tried to allocate"),  # and the note of the cap after it
    ("shouts", "failed", "xxx... (2,"),  # cut short, where the whole message stopped the grader
    ("lingers", "passed", "note: the process did not end once it had its result"),
])
def test_each_broken_submission_costs_only_its_exercise(class_book, student, status, says):
    if student == "hoards" and not sys.platform.startswith("linux"):
        pytest.skip("the memory cap reads and sets what Linux counts (VmData, RLIMIT_DATA)")
    result = class_book[student]["ex00.1"]
    assert result.status == status and says in result.message
    if student not in ("garbage", "zipped"):
        assert class_book[student]["ex00.2"].status == "passed", "the other exercise keeps its points"


def test_a_timeout_or_a_crash_names_its_case_for_scripts_too(class_book):
    for student in ("loops", "hard_exits"):  # in a case: its label, as a failed case's
        result = class_book[student]["ex00.1"]
        assert result.failed_case and f"in case 1 of 5 ({result.failed_case})" in result.message, result
    assert class_book["crashes_at_top"]["ex00.1"].failed_case == ""  # before any case
    late = class_book["loops_late"]["ex00.1"]  # the cases before the endless one counted, passed or not
    assert (late.status, late.passed, late.total) == (TIMEOUT, 1, 5), late
    assert "in case 3 of 5 (square 4096 fp16 matmul); 1 of the 2 cases before it passed" in late.message, late


def test_the_table_and_reports(class_folder, tmp_path):
    run = subprocess.run([sys.executable, "-m", "labkit.grade", str(class_folder / "magic"),
                          str(class_folder / "wrong"), "--out", str(tmp_path), "--timeout", "30"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # so the fork server preloads labkit
    assert run.returncode == 0, run.stderr
    assert "found in sys.modules" not in run.stderr, run.stderr  # runpy's warning: the CLI imported twice
    assert "magic" in run.stdout and "3/3" in run.stdout and "wrong ex00.1: failed" in run.stdout
    rows = list(csv.DictReader((tmp_path / "grades.csv").open()))
    assert rows == [{"student": "magic", "ex00.1": "2", "ex00.2": "1", "total": "3", "max": "3", "not passed": ""},
                    {"student": "wrong", "ex00.1": "0", "ex00.2": "1", "total": "1", "max": "3",
                     "not passed": "ex00.1 failed"}]
    report = json.loads((tmp_path / "grades.json").read_text())
    assert report["wrong"]["exercises"]["ex00.1"]["status"] == "failed"
    graded = str((class_folder / "wrong/00_welcome.ipynb").resolve())
    assert report["wrong"]["exercises"]["ex00.1"]["notebook"] == graded


def test_a_crash_of_the_exercise_itself_is_not_blamed_on_the_cells_before_it(class_book):
    crashed = class_book["ex2_crashes"]["ex00.2"]
    assert crashed.status == CRASHED and "exited with code 5" in crashed.message
    assert "graded without" not in crashed.message and class_book["ex2_crashes"]["ex00.1"].status == "passed"


def test_empty_student_folders_are_missing_rows_named_as_the_others(root, tmp_path, capsys):
    _submit(tmp_path / "sec1", "alice", root / "notebooks/00_welcome.ipynb", BROKEN_EX1["magic"])
    (tmp_path / "sec2" / "alice").mkdir(parents=True)  # empty, and named like sec1's alice
    (tmp_path / "sec2" / "__MACOSX" / "alice").mkdir(parents=True)  # a zip's leftovers: nobody
    (tmp_path / "sec2" / "grades").mkdir()
    (tmp_path / "sec2" / "grades" / "grades.json").write_text("{}")  # the grader's own output: nobody
    book = grade([tmp_path / "sec1", tmp_path / "sec2"], timeout_s=30)
    full, empty = (str((tmp_path / s / "alice").resolve()) for s in ("sec1", "sec2"))
    assert sorted(book) == sorted([full, empty])
    assert {r.status for r in book[full].values()} == {"passed"}
    assert {r.status for r in book[empty].values()} == {MISSING}
    assert "no notebook in it; every exercise counts as missing" in capsys.readouterr().err


def test_a_notebook_at_the_top_of_a_class_folder_does_not_hide_the_empty_student_folders(root, tmp_path, capsys):
    _submit(tmp_path, "alice", root / "notebooks/00_welcome.ipynb", BROKEN_EX1["magic"])
    (tmp_path / "gina").mkdir()  # submitted nothing
    (tmp_path / "00_welcome.ipynb").write_bytes((root / "notebooks/00_welcome.ipynb").read_bytes())  # a stray copy
    found = sorted((s.student, s.lab) for s in find_submissions([tmp_path]))
    assert found == [("alice", "00"), ("gina", ""), (tmp_path.name, "00")]
    err = capsys.readouterr().err
    assert f"00_welcome.ipynb at the top of a class folder: graded as a student named {tmp_path.name}" in err
    assert "gina: no notebook in it" in err


def test_a_notebook_of_no_lab_that_can_be_told_is_a_row_of_missing_exercises_that_names_it(root, tmp_path, capsys):
    _submit(tmp_path / "class", "alice", root / "notebooks/00_welcome.ipynb", BROKEN_EX1["magic"])
    (tmp_path / "class" / "dave").mkdir()
    notebook.write(NO_LAB, tmp_path / "class" / "dave" / "my_lab.ipynb")  # no NN_ name, no tagged cell
    book = grade([tmp_path / "class"], timeout_s=30)
    assert sorted(book) == ["alice", "dave"] and {r.status for r in book["dave"].values()} == {MISSING}
    assert sorted(book["dave"]) == ["ex00.1", "ex00.2", "my_lab.ipynb"]
    assert book["dave"]["my_lab.ipynb"].message.startswith("its lab cannot be told (no NN_ prefix in its name")
    assert "rename it with its lab's NN_ prefix (as 03_my_lab.ipynb" in book["dave"]["my_lab.ipynb"].message
    assert "my_lab.ipynb: its lab cannot be told" in capsys.readouterr().err
    assert "\n  my_lab.ipynb   0/0  missing: its lab cannot be told" in table({"dave": book["dave"]})
    (tmp_path / "flat").mkdir()
    notebook.write(NO_LAB, tmp_path / "flat" / "carol.ipynb")
    (tmp_path / "flat" / "alice.ipynb").write_bytes((tmp_path / "class/alice/00_welcome.ipynb").read_bytes())
    book = grade([tmp_path / "flat"], timeout_s=30, per_file=True)
    assert sorted(book) == ["alice", "carol"] and {r.status for r in book["carol"].values()} == {MISSING}
    assert set(book["alice"]) == {"ex00.1", "ex00.2"}  # and carol's file is most likely a copy of the one lab's
    assert set(book["carol"]) == {"ex00.1", "ex00.2", "carol.ipynb"}


def test_per_file_a_notebook_of_no_lab_claims_no_lab_where_the_files_are_of_several(tmp_path):
    """Of a flat folder of labs 00 and 02, a file whose lab cannot be told is 0 points out of 0 (not every lab's
    exercises missing), and its row says what would place it."""
    for name in ("00_alice.ipynb", "02_bob.ipynb"):  # placed by their names; nothing in them, so nothing runs
        notebook.write({**NO_LAB, "cells": []}, tmp_path / name)
    notebook.write(NO_LAB, tmp_path / "carol.ipynb")
    book = grade([tmp_path], timeout_s=30, per_file=True)
    assert {e[:4] for e in book["00_alice"]} == {"ex00"} and {e[:4] for e in book["02_bob"]} == {"ex02"}
    assert list(book["carol"]) == ["carol.ipynb"], book["carol"]
    untold = book["carol"]["carol.ipynb"]
    assert (untold.status, untold.points, untold.max_points) == (MISSING, 0, 0)
    assert "its lab cannot be told" in untold.message and "rename it with its lab's NN_ prefix" in untold.message
    rows = table(book).splitlines()
    assert next(r for r in rows if r.startswith("carol ")).split()[-1] == "0/0", rows
    assert any(r.startswith("carol carol.ipynb: missing: its lab cannot be told") for r in rows), rows
    write_reports(book, tmp_path / "grades")
    carol = next(r for r in csv.DictReader((tmp_path / "grades/grades.csv").open()) if r["student"] == "carol")
    assert (carol["00 total"], carol["02 total"], carol["total"], carol["max"]) == ("", "", "0", "0"), carol
    assert carol["not passed"] == "carol.ipynb missing"


def test_a_notebook_named_for_no_lab_or_unreadable_says_so(tmp_path):
    """A prefix of no lab (12_) places nothing and the entry names it; an unreadable file of no prefix is
    said to be unreadable, not to lack tags."""
    notebook.write(NO_LAB, tmp_path / "12_extra.ipynb")
    (tmp_path / "scratch.ipynb").write_text("{not json")
    book = grade([tmp_path], timeout_s=30, per_file=True)
    extra = book["12_extra"]["12_extra.ipynb"].message
    assert extra.startswith("its lab cannot be told (its name's 12_ is no lab's (the labs: 00, 01,"), extra
    assert "(as 03_extra.ipynb for lab 03)" in extra
    scratch = book["scratch"]["scratch.ipynb"].message
    assert scratch.startswith("its lab cannot be told, so it was not graded: ") and "not a readable notebook" in scratch


def test_a_class_of_notebooks_of_no_lab_only_is_graded_as_one_with_others(tmp_path):
    for student in ("dave", "erin"):
        (tmp_path / "class" / student).mkdir(parents=True)
        notebook.write(NO_LAB, tmp_path / "class" / student / "my_lab.ipynb")
    book = grade([tmp_path / "class"], timeout_s=30)
    assert sorted(book) == ["dave", "erin"]
    for results in book.values():
        assert list(results) == ["my_lab.ipynb"] and results["my_lab.ipynb"].status == MISSING
        assert "its lab cannot be told" in results["my_lab.ipynb"].message
    assert "dave my_lab.ipynb: missing: its lab cannot be told" in table(book)
    (tmp_path / "nobody" / "gina").mkdir(parents=True)  # a class folder without a notebook: nothing to grade
    with pytest.raises(FileNotFoundError, match="no notebooks to grade in"):
        grade([tmp_path / "nobody"])


def test_a_notebook_of_no_nn_name_whose_exercise_cells_lost_their_tags_is_placed_by_their_functions(
        root, tmp_path, capsys):
    _submit(tmp_path, "fay", root / "notebooks/00_welcome.ipynb", BROKEN_EX1["magic"], name="my_work.ipynb")
    nb = notebook.read(tmp_path / "fay/my_work.ipynb")
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("tags", None)
    notebook.write(nb, tmp_path / "fay/my_work.ipynb")
    assert [(s.student, s.lab) for s in find_submissions([tmp_path / "fay"])] == [("fay", "00")]
    assert "cannot be told" not in capsys.readouterr().err
    results = grade([tmp_path / "fay"], timeout_s=30)["fay"]
    assert sorted(results) == ["ex00.1", "ex00.2"] and {r.status for r in results.values()} == {"passed"}, results
    scratch = {**NO_LAB, "cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                                    "source": "def advance(tokens, positions, finished, eos_id):\n    pass\n"}]}
    (tmp_path / "gus").mkdir()
    notebook.write(scratch, tmp_path / "gus" / "scratch.ipynb")  # one function of a common name: no lab's notebook
    assert [(s.student, s.lab) for s in find_submissions([tmp_path / "gus"])] == [("gus", "")]


def test_an_exercise_cell_that_lost_its_tags_is_found_by_the_function_it_defines(root, tmp_path):
    # ex00.1's answer uses torch, which only the setup cell imports: the setup is found without its tag too
    uses_setup = "def matmul_intensity(m, n, k, b=2):\n    return float(torch.tensor(2*m*n*k / (b*(m*k + k*n + m*n))))\n"
    _submit(tmp_path, "ed", root / "notebooks/00_welcome.ipynb", uses_setup)
    nb = notebook.read(tmp_path / "ed/00_welcome.ipynb")
    assert "import torch" in next(notebook.source(c) for c in nb["cells"] if c["cell_type"] == "code")
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("tags", None)
    notebook.write(nb, tmp_path / "ed/00_welcome.ipynb")
    results = grade([tmp_path / "ed"], timeout_s=30)["ed"]
    assert {r.status for r in results.values()} == {"passed"}, results
    assert "no cell is tagged 'exercise' for ex00.1 (its tags lost?): graded the last cell that defines " \
           "matmul_intensity" in results["ex00.1"].message


def test_what_a_zip_made_on_a_mac_adds_is_nobody(root, tmp_path):
    _submit(tmp_path / "class", "alice", root / "notebooks/00_welcome.ipynb", BROKEN_EX1["magic"])
    (tmp_path / "class" / "__MACOSX" / "alice").mkdir(parents=True)
    (tmp_path / "class" / "__MACOSX" / "alice" / "._00_welcome.ipynb").write_bytes(b"\x00\x05\x16\x07")
    (tmp_path / "class" / "alice" / "._00_welcome.ipynb").write_bytes(b"\x00\x05\x16\x07")
    assert [(s.student, s.lab) for s in find_submissions([tmp_path / "class"])] == [("alice", "00")]
    assert [(s.student, s.lab) for s in find_submissions([tmp_path / "class" / "alice"], per_file=True)] == [
        ("00_welcome", "00")]


def test_a_notebook_is_graded_as_the_lab_its_exercises_belong_to(root, tmp_path, capsys):
    _submit(tmp_path, "alice", root / "notebooks/00_welcome.ipynb", name="10_welcome.ipynb")
    _submit(tmp_path, "bob", root / "notebooks/00_welcome.ipynb", name="my_work.ipynb")
    nb = notebook.read(root / "notebooks/03_paged_attention.ipynb")  # and one exercise of lab 00 pasted in
    nb["cells"].append(next(c for c in notebook.read(root / "notebooks/00_welcome.ipynb")["cells"]
                            if notebook.exercise_id(c) == "ex00.1"))
    (tmp_path / "carol").mkdir()
    notebook.write(nb, tmp_path / "carol/03_paged_attention.ipynb")
    found = [(s.student, s.lab) for s in find_submissions([tmp_path])]
    assert found == [("alice", "00"), ("bob", "00"), ("carol", "03")]
    err = capsys.readouterr().err
    assert "10_welcome.ipynb: named 10_ but it holds notebook 00's exercises: graded as 00" in err
    assert "carol" not in err


def test_students_with_the_same_folder_name_are_kept_apart(root, tmp_path):
    for group in ("monday", "tuesday"):
        _submit(tmp_path / group, "alice", root / "notebooks/00_welcome.ipynb", BROKEN_EX1["magic"])
    book = grade([tmp_path / "monday", tmp_path / "tuesday"])
    assert sorted(book) == [str((tmp_path / g / "alice").resolve()) for g in ("monday", "tuesday")]


def test_a_flat_folder_of_a_class_per_file(root, tmp_path):
    """A course platform's export: every student's copy side by side, named after the student."""
    for student in ("magic", "wrong"):
        _submit(tmp_path / "staging", student, root / "notebooks/00_welcome.ipynb", BROKEN_EX1[student])
        (tmp_path / "staging" / student / "00_welcome.ipynb").rename(tmp_path / f"{student}_00_welcome.ipynb")
    merged = grade([tmp_path], timeout_s=30)
    assert list(merged) == [tmp_path.name], "without --per-file the folder is one student"
    (tmp_path / "carol_02_kv_memory.ipynb").write_bytes((root / "solutions/02_kv_memory.ipynb").read_bytes())
    book = grade([tmp_path], timeout_s=30, per_file=True)
    assert sorted(book) == ["carol_02_kv_memory", "magic_00_welcome", "wrong_00_welcome"]
    assert book["magic_00_welcome"]["ex00.1"].status == "passed"
    assert book["wrong_00_welcome"]["ex00.1"].status == "failed"
    # a file is one lab: graded on its own exercises, out of its own points, not the other labs'
    assert {e[:4] for e in book["carol_02_kv_memory"]} == {"ex02"}
    assert {e[:4] for e in book["magic_00_welcome"]} == {"ex00"}
    rows = table(book).splitlines()
    assert rows[1].split()[-1] == "4/4" and rows[2].split()[1:] == ["2/2", "1/1", "-", "-", "-", "3/3"], rows
    write_reports(book, tmp_path / "grades")
    csv_rows = list(csv.DictReader((tmp_path / "grades/grades.csv").open()))
    assert [(r["00 total"], r["02 total"], r["total"], r["max"]) for r in csv_rows] == [
        ("", "4", "4", "4"), ("3", "", "3", "3"), ("1", "", "1", "3")], csv_rows


def test_per_file_names_links_and_clashes(root, tmp_path):
    template = root / "notebooks/00_welcome.ipynb"
    for folder in ("monday", "tuesday"):
        (tmp_path / folder).mkdir()
        notebook.write(notebook.read(template), tmp_path / folder / "alice.ipynb")
    (tmp_path / "store").mkdir()
    notebook.write(notebook.read(template), tmp_path / "store/3f9a.ipynb")
    (tmp_path / "export").mkdir()
    for student in ("bob", "carol"):  # a platform's export: links to one stored file
        (tmp_path / "export" / f"{student}.ipynb").symlink_to(tmp_path / "store/3f9a.ipynb")
    found = find_submissions([tmp_path / "monday", tmp_path / "tuesday", tmp_path / "export",
                              tmp_path / "export/bob.ipynb"], per_file=True)  # bob given twice
    assert sorted(s.student for s in found) == sorted(["bob", "carol", str((tmp_path / "monday/alice").resolve()),
                                                       str((tmp_path / "tuesday/alice").resolve())])


def test_one_students_grades_are_a_list_and_a_notebook_left_untouched_is_one_line():
    from labkit.check import NOT_ATTEMPTED, Result

    book = {"me": {"ex00.1": Result("ex00.1", "passed", 2, 2), "ex00.2": Result("ex00.2", "failed", 0, 1,
                                                                                 message="case 1: wrong"),
                   **{ex.id: Result(ex.id, NOT_ATTEMPTED, 0, ex.points, message="still a stub") for ex in for_lab("01")}}}
    lines = table(book).splitlines()
    assert lines[0] == f"me: 2/{3 + sum(e.points for e in for_lab('01'))} points"
    assert lines[1].split() == ["ex00.1", "2/2", "passed"] and lines[2].split()[:3] == ["ex00.2", "0/1", "failed:"]
    assert lines[3].split()[:4] == ["01_*", f"0/{sum(e.points for e in for_lab('01'))}", "not", "attempted:"]
    assert len(lines) == 4


def _results(lab, status, **fields):
    """Every exercise of ``lab`` with ``status``, 0 points (full points where passed)."""
    from labkit.check import Result

    return {ex.id: Result(ex.id, status, ex.points if status == "passed" else 0, ex.points, **fields)
            for ex in for_lab(lab)}


def test_the_table_gives_an_untouched_notebook_one_line_and_a_failure_its_cases():
    from labkit.check import FAILED, NOT_ATTEMPTED, Result

    book = {"bob": {**_results("00", NOT_ATTEMPTED, message="a stub"), **_results("01", "passed")},
            "carol": {"ex00.1": Result("ex00.1", FAILED, 0, 2, 2, 5, "first failure, case 3"),
                      "ex00.2": Result("ex00.2", TIMEOUT, 0, 1, 1, 4, "stopped after 8 s in case 2 of 4"),
                      "ex01.1": Result("ex01.1", ERROR, 0, 1, message="the exercise cell raised NameError"),
                      **{k: r for k, r in _results("01", "passed").items() if k != "ex01.1"}},
            "ivan": {**_results("00", MISSING, message="no notebook 00_* submitted"),
                     **_results("01", MISSING, message="no notebook 01_* submitted")}}
    notes = table(book).split("\n\n")[1].splitlines()
    assert notes == ["bob 00_*: not attempted: ex00.1, ex00.2 (a stub)",
                     "carol ex00.1: failed (2/5 cases): first failure, case 3",
                     "carol ex00.2: timeout (1/4 cases): stopped after 8 s in case 2 of 4",
                     "carol ex01.1: error: the exercise cell raised NameError",
                     "ivan 00_*: missing: ex00.1, ex00.2 (no notebook 00_* submitted)",
                     "ivan 01_*: missing: ex01.1, ex01.2, ex01.3 (no notebook 01_* submitted)"], notes


def test_the_reports_leave_what_is_missing_blank_and_give_each_notebook_its_maximum(tmp_path):
    from labkit.check import FAILED, Result

    untitled = Result("Untitled.ipynb", MISSING, 0, 0, message="its lab cannot be told")
    book = {"ann": {**_results("00", "passed"), "ex00.1": Result("ex00.1", FAILED, 0, 2),  # submitted, wrong: 0
                    **_results("01", MISSING)},
            "heidi": {**_results("00", "passed"), **_results("01", MISSING), "Untitled.ipynb": untitled},
            "ivan": {**_results("00", MISSING), **_results("01", MISSING)}}
    write_reports(book, tmp_path)
    with (tmp_path / "grades.csv").open() as f:
        header, *rows = list(csv.reader(f))
    assert header[6:] == ["00 total", "00 max", "01 total", "01 max", "total", "max", "not passed"], header
    assert [row[1:10] for row in rows] == [["0", "1", "", "", "", "1", "3", "", "5"],
                                           ["2", "1", "", "", "", "3", "3", "", "5"],
                                           ["", "", "", "", "", "", "3", "", "5"]], rows
    assert [row[10:12] for row in rows] == [["1", "8"], ["3", "8"], ["0", "8"]]  # the total, a number still
    report = json.loads((tmp_path / "grades.json").read_text())
    assert sorted(report["heidi"]["exercises"]) == ["ex00.1", "ex00.2", "ex01.1", "ex01.2", "ex01.3"]
    assert report["heidi"]["unplaced"] == {"Untitled.ipynb": "its lab cannot be told"}
    assert report["ann"]["unplaced"] == {}


def test_a_missing_notebook_and_bad_paths(class_book, tmp_path):
    assert "loops" in table(class_book)
    run = subprocess.run([sys.executable, "-m", "labkit.grade", str(tmp_path / "nowhere")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "does not exist" in run.stderr


@pytest.mark.parametrize("option, says", [
    (["--timeout", "-1"], "--timeout -1 must be a finite number of seconds > 0"),
    (["--timeout", "0"], "--timeout 0 must be a finite number of seconds > 0"),
    (["--timeout", "nan"], "--timeout nan must be a finite number of seconds > 0"),
    (["--timeout", "inf"], "--timeout inf must be a finite number of seconds > 0"),  # an endless loop would hang it
    (["--jobs", "0"], "--jobs 0 must be 1 or more"),
    (["--jobs", "-1"], "--jobs -1 must be 1 or more"),
    (["--out", "{file}"], "--out {file} is a file: give a folder for grades.json and grades.csv"),
    (["--out", "{file}/sub"], "--out {file}/sub: {file} is a file: give a folder"),
])
def test_bad_options_are_refused_before_grading(root, tmp_path, option, says):
    """Said at once, naming the option, with argparse's exit code: not a traceback after minutes of
    grading, nor every exercise 0 for a time limit of -1 s."""
    (tmp_path / "grades.csv").write_text("an old report\n")
    fill = {"file": str(tmp_path / "grades.csv")}
    run = subprocess.run([sys.executable, "-m", "labkit.grade", str(root / "notebooks/00_welcome.ipynb"),
                          *(o.format(**fill) for o in option)], capture_output=True, text=True, timeout=15)
    assert run.returncode == 2 and says.format(**fill) in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not run.stdout  # nothing graded
    assert (tmp_path / "grades.csv").read_text() == "an old report\n"


def test_the_python_api_refuses_a_time_limit_or_jobs_below_one(root):
    from labkit.grade import Submission, grade_submission

    welcome = root / "notebooks/00_welcome.ipynb"
    with pytest.raises(ValueError, match=r"timeout_s=0 must be a finite number of seconds > 0"):
        grade([welcome], timeout_s=0)
    with pytest.raises(ValueError, match=r"jobs=0 must be 1 or more"):
        grade([welcome], jobs=0)
    with pytest.raises(ValueError, match=r"timeout_s=-1 must be a finite number of seconds > 0"):
        grade_submission(Submission("me", welcome, "00"), timeout_s=-1)


def test_a_notebook_grades_itself_under_any_name(tmp_path, monkeypatch):
    """Jupyter names the notebook a kernel was started for; a renamed copy grades itself."""
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "00_welcome-Copy1.ipynb"
    copy.write_text("{}")
    monkeypatch.setenv("JPY_SESSION_NAME", str(copy))
    assert this_notebook("00_welcome.ipynb") == copy
    copy.unlink()
    for session in (str(tmp_path / "gone.ipynb"), str(tmp_path), "console-1"):  # no such notebook: the name given
        monkeypatch.setenv("JPY_SESSION_NAME", session)
        assert this_notebook("00_welcome.ipynb").name == "00_welcome.ipynb"
    monkeypatch.delenv("JPY_SESSION_NAME")
    assert this_notebook("00_welcome.ipynb").name == "00_welcome.ipynb"


def test_where_jupyter_does_not_say_the_lab_s_notebook_saved_last_is_graded_and_named(root, tmp_path, monkeypatch,
                                                                                    capsys):
    """nbconvert names no notebook: a renamed copy beside the pristine one is graded (it was saved
    last), the choice is said, and the grade cell prints the path it graded above the table."""
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.chdir(tmp_path)
    pristine, mine = tmp_path / "00_welcome.ipynb", tmp_path / "mine.ipynb"  # found by its exercises
    pristine.write_text((root / "notebooks" / "00_welcome.ipynb").read_text())
    mine.write_text((root / "solutions" / "00_welcome.ipynb").read_text())
    os.utime(pristine, (1, 1))
    assert this_notebook("00_welcome.ipynb") == mine
    assert "Graded the one saved last, mine.ipynb" in capsys.readouterr().err
    (tmp_path / "01_kv_cache.ipynb").write_text("{}")  # another lab's notebook does not count, nor nbconvert's output
    (tmp_path / "mine.nbconvert.ipynb").write_text(mine.read_text())
    pristine.unlink()
    assert this_notebook("00_welcome.ipynb") == mine and not capsys.readouterr().err
    grade_this("00_welcome.ipynb")
    out = capsys.readouterr().out
    assert out.startswith(f"grading {mine.resolve()}, saved at ") and "\nmine: 3/3 points\n" in out, out
    mine.unlink()
    grade_this("00_welcome.ipynb")  # run from elsewhere, or never saved: said, not a traceback
    assert capsys.readouterr().out.startswith("Nothing to grade: Jupyter did not say")


def test_the_grade_cell_of_a_notebook_of_no_lab_says_so(tmp_path, monkeypatch, capsys):
    notebook.write(NO_LAB, tmp_path / "scratch.ipynb")
    monkeypatch.setenv("JPY_SESSION_NAME", str(tmp_path / "scratch.ipynb"))
    grade_this("00_welcome.ipynb")
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1] == "scratch: 0/0 points" and lines[2].split()[:6] == [
        "scratch.ipynb", "0/0", "missing:", "its", "lab", "cannot"], out


def test_in_vs_code_the_notebook_it_names_is_graded(tmp_path, monkeypatch):
    import IPython

    mine = tmp_path / "anything.ipynb"
    mine.write_text("{}")
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setattr(IPython, "get_ipython", lambda: type("Shell", (), {"user_ns": {"__vsc_ipynb_file__": str(mine)}}))
    assert this_notebook("00_welcome.ipynb") == mine


def test_a_notebook_number_may_carry_a_letter():
    """A second notebook of one lab (06b, after 06) is a lab of its own to the grader."""
    from labkit.notebook import lab_of_name
    assert lab_of_name("03_paged-Copy1.ipynb") == "03"
    assert lab_of_name("06b_fast_quantized_decode.ipynb") == "06b"
    assert lab_of_name("notes.ipynb") is None and lab_of_name("6_x.ipynb") is None


def test_the_command_exits_1_when_nothing_could_be_graded(tmp_path, capsys):
    """Reports are written for a notebook that cannot be placed, and the exit status says nothing was graded; a
    placed notebook beside it makes the status 0. A file that is no notebook at all is refused before grading."""
    (tmp_path / "scratch.ipynb").write_text("{not json")
    assert main([str(tmp_path / "scratch.ipynb"), "--out", str(tmp_path / "grades")]) == 1
    assert (tmp_path / "grades/grades.csv").is_file()
    err = capsys.readouterr().err
    assert "scratch.ipynb is not a readable notebook" in err and "error: nothing was graded" in err
    notebook.write({**NO_LAB, "cells": []}, tmp_path / "00_alice.ipynb")  # placed by its name; nothing runs
    assert main([str(tmp_path / "scratch.ipynb"), str(tmp_path / "00_alice.ipynb"), "--out", str(tmp_path / "g2")]) == 0
    assert "nothing was graded" not in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("not a notebook")
    with pytest.raises(SystemExit) as refused:
        main([str(tmp_path / "notes.txt"), "--out", str(tmp_path / "g3")])
    assert refused.value.code == 2 and not (tmp_path / "g3").exists()
    assert "notes.txt is not a notebook (.ipynb): name notebooks, or folders of them" in capsys.readouterr().err


CHECKED_IN_A_KERNEL = """
import sys
import nbformat
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
for cell in nbformat.read(sys.argv[1], as_version=4).cells:
    shell.run_cell(cell.source)
"""


def _run_in_a_kernel(folder: Path, name: str) -> str:
    """What the cells of ``folder/name`` print, run one by one in an IPython shell (as a kernel runs them), with
    the notebook found in the folder (as nbconvert runs it: no Jupyter session names it)."""
    env = {k: v for k, v in os.environ.items() if k != "JPY_SESSION_NAME"}
    run = subprocess.run([sys.executable, "-c", CHECKED_IN_A_KERNEL, name], cwd=folder, capture_output=True,
                         text=True, timeout=120, env=env)
    return run.stdout + run.stderr


KIDS_LOOP = ("    kids = [[] for _ in parents]\n    for node in range(1, len(parents)):\n"
             "        kids[parents[node]].append(node)\n")
LACKS_TREE = ("every case passes here, but graded it would raise NameError: the grader runs only the setup cells and "
              "the exercise cells, where tree (defined by the cell that begins `import numpy as np`) is not defined")


@pytest.mark.parametrize("kids, earlier, says", [
    ("    kids = tree.children(parents)\n", "", LACKS_TREE),  # the demo cell's import, which the grader never runs
    ("    from labkit import tree\n    kids = tree.children(parents)\n", "", "[PASS] ex11.2"),  # its own import
    ("    kids = children_of(parents)\n", "", "[PASS] ex11.2"),  # a helper in its own cell (below)
    ("    kids = tree_kids(parents)\n", "\n\ndef tree_kids(parents):\n    from labkit import tree\n"
     "    return tree.children(parents)\n", "[PASS] ex11.2"),  # a helper of an earlier exercise's cell
    (KIDS_LOOP + "    if start < 0:\n        np.zeros(1)  # never run by the cases\n", "", "[PASS] ex11.2"),
    (KIDS_LOOP + "    assert len(np.zeros(1)) == 1\n", "", "graded it would raise NameError: the grader runs only the "
     "setup cells and the exercise cells, where np (defined by the cell that begins `import numpy as np`)"),
])
def test_the_inline_check_fails_a_name_only_a_demos_cell_defines(root, tmp_path, kids, earlier, says):
    """ex11.2 written with names of notebook 11's cells: every case passes in the kernel, where every cell ran, but
    the grader runs the setup and exercise cells only. The check fails a function that needs a name only another
    cell defines, and passes one whose names come from an exercise cell, or which reads one only on a path the
    cases never take."""
    solutions = notebook.read(root / "solutions/11_speculation_without_a_draft.ipynb")["cells"]
    first, second = (next(c for c in solutions if notebook.exercise_id(c) == ex) for ex in ("ex11.1", "ex11.2"))
    assert KIDS_LOOP in notebook.source(second)
    helper = ("\n\ndef children_of(parents):\n"
              "    return [[k for k in range(len(parents)) if parents[k] == n] for n in range(len(parents))]\n")

    def code(source):
        return {"cell_type": "code", "metadata": {}, "source": source, "outputs": [], "execution_count": None}
    cells = [{**code("import labkit"), "metadata": {"tags": ["setup"]}},
             code("import numpy as np\nfrom labkit import tree"),
             {**first, "source": notebook.source(first) + earlier},
             {**second, "source": notebook.source(second).replace(KIDS_LOOP, kids) + helper},
             code('labkit.check("ex11.2", accept_branch)')]
    notebook.write({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, tmp_path / "11_mine.ipynb")
    printed = _run_in_a_kernel(tmp_path, "11_mine.ipynb")
    assert says in printed, printed
    if says == LACKS_TREE:  # and the grader agrees, naming the same cell
        result = grade([tmp_path / "11_mine.ipynb"], per_file=True)["11_mine"]["ex11.2"]
        assert result.status == "failed" and "tree is defined by the cell that begins `import numpy as np`" in \
            result.message, result


@pytest.mark.parametrize("mine_first, exercise_cell, says, graded", [
    (True, "accept_branch = my_accept", "accept_branch here is my_accept, which was defined by the cell above the "
     "exercise cell that begins `def my_accept(parents: list[int], tokens: list[int], choi...`", "error"),  # skipped
    (False, None, "this accept_branch was defined by the cell below the exercise cell that begins "
     "`def accept_branch(parents: list[int], tokens: list[int], ...`", "not attempted"),  # the stub graded
    (False, "same", "[PASS] ex11.2", "passed"),  # a copy of the exercise cell, run below it: the grader runs its twin
])
def test_the_inline_check_fails_a_function_defined_by_a_cell_the_grader_skips(root, tmp_path, mine_first,
                                                                               exercise_cell, says, graded):
    """ex11.2 passes in the kernel with a function a cell the grader does not run defined: the exercise cell names
    it (``accept_branch = my_accept``), or a copy below the exercise cell, which keeps its stub, is the one run last.
    The check fails it, naming the cell; the grader fails it too. A copy identical to the exercise cell passes. The
    cells are saved as JupyterLab saves typed ones, with no final newline, which the kernel's copy of each has."""
    solved = next(c for c in notebook.read(root / "solutions/11_speculation_without_a_draft.ipynb")["cells"]
                  if notebook.exercise_id(c) == "ex11.2")
    stub = next(c for c in notebook.read(root / "notebooks/11_speculation_without_a_draft.ipynb")["cells"]
                if notebook.exercise_id(c) == "ex11.2")

    def code(source, cell=None):
        return {**(cell or {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None}),
                "source": source.rstrip("\n")}
    if exercise_cell == "same":  # the exercise cell saved bare, its copy with a final newline: the same code
        exercise, mine = code(notebook.source(solved), solved), {**code(""), "source": notebook.source(solved)}
    else:
        exercise = code(exercise_cell or notebook.source(stub), stub)
        mine = code(notebook.source(solved).replace("def accept_branch(", "def my_accept(" if mine_first else
                                                   "def accept_branch("))
    cells = [{**code("import labkit"), "metadata": {"tags": ["setup"]}},
             *([mine, exercise] if mine_first else [exercise, mine]), code('labkit.check("ex11.2", accept_branch)')]
    notebook.write({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, tmp_path / "11_mine.ipynb")
    printed = _run_in_a_kernel(tmp_path, "11_mine.ipynb")
    assert says in printed, printed
    assert grade([tmp_path / "11_mine.ipynb"], per_file=True)["11_mine"]["ex11.2"].status == graded


UNPACK = "        return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)\n"
MY_UNPACK = "\n\ndef my_unpack(packed):\n" + UNPACK[4:]
PATCH = "Int4Packer.unpack = staticmethod(my_unpack)\n"


@pytest.mark.parametrize("in_the_exercise_cell, below, says, graded", [
    ("", "import torch" + MY_UNPACK + "\n\n" + PATCH, "Int4Packer.unpack here is my_unpack, which was defined by the "
     "cell below the exercise cell that begins `import torch`", "failed"),  # the grader keeps the stub
    (MY_UNPACK, PATCH, "Int4Packer.unpack here is my_unpack, which was bound to it by the cell below the exercise "
     "cell that begins `Int4Packer.unpack = staticmethod(my_unpack)`", "failed"),  # defined where graded, bound not
    (MY_UNPACK + "\n\n" + PATCH, "", "[PASS] ex06.2", "passed"),  # patched in by the exercise cell, which is graded
])
def test_the_inline_check_fails_a_method_patched_in_by_a_cell_the_grader_skips(root, tmp_path, in_the_exercise_cell,
                                                                               below, says, graded):
    """ex06.2's class with its ``unpack`` a stub, and a working one patched in (``Int4Packer.unpack = ...``): every
    case passes in the kernel, but where a cell below the exercise cell defines the function or does the patching,
    the grader keeps the stub. The check fails it, naming the method, the function and the cell; patched in by the
    exercise cell itself, it passes (the grader runs that cell)."""
    solved = next(c for c in notebook.read(root / "solutions/06_int4_quantization.ipynb")["cells"]
                  if notebook.exercise_id(c) == "ex06.2")
    assert UNPACK in notebook.source(solved)
    stubbed = notebook.source(solved).replace(UNPACK, '        raise NotImplementedError("ex06.2")\n')

    def code(source):
        return {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": source}
    cells = [{**code("import labkit"), "metadata": {"tags": ["setup"]}},
             {**solved, "source": stubbed + in_the_exercise_cell}, *([code(below)] if below else []),
             code('labkit.check("ex06.2", Int4Packer)')]
    notebook.write({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, tmp_path / "06_mine.ipynb")
    printed = _run_in_a_kernel(tmp_path, "06_mine.ipynb")
    assert says in printed, printed
    assert grade([tmp_path / "06_mine.ipynb"], per_file=True)["06_mine"]["ex06.2"].status == graded


def test_bound_names_are_a_cells_top_level_names():
    code = ("%time x = 1\nimport numpy as np, os.path\nfrom labkit import tree as t, medusa\ndef f(a):\n    b = 1\n"
            "class C:\n    z = 2\nx, (y, *w) = 1, (2, 3)\nfor i in range(3):\n    k = i\nq = [j for j in range(3)]\n"
            "try:\n    pass\nexcept ValueError as e:\n    pass\nlam = lambda r: r\n")
    assert notebook.bound_names(code) == {"np", "os", "t", "medusa", "f", "C", "x", "y", "w", "i", "k", "q", "e", "lam"}
    assert notebook.bound_names("Int4Packer.unpack = f\nobj.a.b = 1\n") == {"Int4Packer.unpack"}  # a patch
    assert notebook.bound_names("def broken(:\n") == set()
    assert notebook.bound_names("%%capture out\nimport math\nz = 3") == {"out", "math", "z"}  # run here
    assert notebook.bound_names("%%timeit\nq = 1") == set()  # run in a namespace of its own
    assert notebook.bound_names("files = !ls\nif True:\n    %time y = 2\n") == {"files", "y"}


def test_an_interrupt_stops_the_grading_of_a_notebook_at_once_and_leaves_no_worker(root, tmp_path):
    """A notebook's grade cell, interrupted while an exercise loops: it stops within a second or two (it waited
    for every exercise's time limit, the workers leading groups of their own that no SIGINT reaches), and the
    worker it had started is killed."""
    _submit(tmp_path, "ada", root / "solutions" / "00_welcome.ipynb", BROKEN_EX1["loops"])
    script = ("from pathlib import Path\nfrom labkit.grade import grade\nprint('grading', flush=True)\n"
              f"try:\n    grade([Path({str(tmp_path / 'ada' / '00_welcome.ipynb')!r})], per_file=True)\n"
              "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n")
    grader = _interrupted_after(3.0, script)
    assert grader.stdout.readline() == "interrupted\n" and grader.wait(10) == 0


def test_an_interrupt_stops_a_batch_at_once_and_writes_no_report(root, tmp_path):
    """Ctrl+C in a terminal grading a class, notebooks in threads: it stops within a second or two, killing the
    workers of every exercise in flight and grading no other notebook (it waited for the whole class, the pool
    finishing what it held), and writes no report, which would hold a class half graded."""
    for student in ("ada", "bob", "cy"):
        _submit(tmp_path / "class", student, root / "solutions" / "00_welcome.ipynb", BROKEN_EX1["loops"])
    out = tmp_path / "grades"
    script = ("import sys\nfrom labkit.grade import main\nprint('grading', flush=True)\n"
              f"sys.exit(main([{str(tmp_path / 'class')!r}, '--jobs', '2', '--out', {str(out)!r}]))\n")
    grader = _interrupted_after(3.0, script, stderr=subprocess.PIPE)
    assert grader.wait(10) == 130
    assert "interrupted" in grader.stderr.read() and not out.exists()


def test_the_workers_of_a_grader_killed_outright_end_with_it(root, tmp_path):
    """A grader killed with SIGKILL can no longer stop a looping exercise at its time limit: its worker (and the
    fork server) ended only when the machine did, at 100% CPU (two were found 21 minutes on). Each worker now
    watches its grader and ends within a second or two of it."""
    _submit(tmp_path, "ada", root / "solutions" / "00_welcome.ipynb", BROKEN_EX1["loops"])
    script = ("from pathlib import Path\nfrom labkit.grade import grade\n"
              f"grade([Path({str(tmp_path / 'ada' / '00_welcome.ipynb')!r})], per_file=True)\n")
    grader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    workers = []
    try:
        deadline = time.monotonic() + 60.0  # the fork server imports torch and the rest first
        while not (workers := [pid for pid in _descendants(grader.pid) if _leads_a_session(pid)]):
            assert time.monotonic() < deadline and grader.poll() is None, "no worker started"
            time.sleep(0.1)
        time.sleep(1.0)  # in its endless loop
        grader.kill()
        grader.wait()
        deadline = time.monotonic() + 5.0
        while (left := [pid for pid in workers if _running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left]
    finally:
        grader.kill()
        grader.wait()
        for pid in workers:  # should the test fail: no worker left to spin
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def _leads_a_session(pid: int) -> bool:
    """A grader's worker: it leads a session of its own (the fork server does not)."""
    try:
        return os.getsid(pid) == pid
    except ProcessLookupError:
        return False


def _running(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, and not a zombie waiting for its parent to read its status."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_ends_after_its_cpu_allowance(tmp_path):
    """The second backstop, for code that holds the GIL (where the watching thread cannot run): the worker's CPU
    time is capped (here at 1 s), and it is killed there."""
    script = "from labkit.grade import _cap_cpu\n_cap_cpu(1.0)\nwhile True:\n    pass\n"
    started = time.monotonic()
    spinner = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, timeout=30)
    assert spinner.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and time.monotonic() - started < 15


def _interrupted_after(seconds, script, **popen):
    """Run ``script`` in a process group of its own (as a notebook's kernel, or a terminal's command), wait for
    it to print a line and then ``seconds``, send its group SIGINT (what Jupyter's Interrupt and a terminal's
    Ctrl+C send), and check that it ends within 3 s and that every process it had started ends too. Returns
    the process, ended, with its output to read."""
    # SIGINT raises KeyboardInterrupt, as in a kernel, also where this test runs as a shell's background job,
    # which starts with SIGINT ignored (so CI ran it once: the grader never heard the Interrupt)
    script = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n" + script
    grader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              start_new_session=True, **popen)
    try:
        assert grader.stdout.readline() == "grading\n"
        time.sleep(seconds)  # each worker is in its endless loop (its time limit is 8 s)
        started, workers = time.monotonic(), _descendants(grader.pid)  # the workers, and their forkserver
        os.killpg(grader.pid, signal.SIGINT)
        grader.wait(10)
        assert time.monotonic() - started < 3.0
        deadline = time.monotonic() + 5.0  # the forkserver and its resource tracker follow the grader out
        while (left := [pid for pid in workers if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers and not left, [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left]
        return grader
    finally:
        grader.kill()
        grader.wait()


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        found += (kids := children(todo.pop()))
        todo += kids
    return found
