"""Release: solution regions become stubs, outputs go, and --check catches a stale notebooks/."""
from __future__ import annotations

import shutil
import subprocess
import sys

import nbformat
import pytest

from labkit import notebook
from labkit.release import main, release_notebook, stale, strip_solutions

SOLVED = '''def f(x):
    """Doc."""
    ### BEGIN SOLUTION
    y = x + 1
    return y
    ### END SOLUTION

def g():
    if True:
        ### BEGIN SOLUTION
        return 2
        ### END SOLUTION
'''


def test_markers_with_trailing_comments_still_hide_the_solution():
    out = strip_solutions("def f():\n    ### BEGIN SOLUTION  # noqa\n    return 42\n    ### END SOLUTION # x\n",
                          "ex00.1", "test")
    assert "42" not in out and "NotImplementedError" in out


def test_each_region_becomes_one_raise_at_its_indentation():
    out = strip_solutions(SOLVED, "ex00.1", "test")
    assert out.splitlines() == [
        "def f(x):", '    """Doc."""',
        '    raise NotImplementedError("ex00.1: replace this line with your code")', "",
        "def g():", "    if True:",
        '        raise NotImplementedError("ex00.1: replace this line with your code")']


@pytest.mark.parametrize("broken, complaint", [
    ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("### END SOLUTION\n", "never opened"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "inside another"),
    ("x = 1  ### BEGIN SOLUTION\n", "not alone on its line"),
])
def test_broken_markers_are_refused(broken, complaint):
    with pytest.raises(ValueError, match=complaint):
        strip_solutions(broken, "ex00.1", "nb cell 3")


def _nb(*cells):
    return {"cells": list(cells), "metadata": {"widgets": {"state": {}}}, "nbformat": 4, "nbformat_minor": 5}


def _code(text, tags=(), exercise=None, outputs=()):
    meta = {"tags": list(tags)} | ({"labkit": {"exercise": exercise}} if exercise else {})
    return {"cell_type": "code", "metadata": meta, "source": text, "outputs": list(outputs), "execution_count": 4}


def test_release_clears_outputs_and_widget_state():
    nb = _nb(_code("print(1)", outputs=[{"output_type": "stream", "name": "stdout", "text": "1"}]),
             _code(SOLVED, ["exercise"], "ex00.1"))
    student = release_notebook(nb, "00_x.ipynb")
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in student["cells"])
    assert "widgets" not in student["metadata"]
    assert "return y" not in notebook.source(student["cells"][1])
    assert nb["cells"][0]["outputs"], "the instructor notebook itself is left alone"


def test_release_keeps_only_the_metadata_students_need():
    """An instructor who ran and saved the solutions leaves editor state in them: a hidden source
    would hide a stub from the students."""
    cell = _code(SOLVED, ["exercise"], "ex00.1")
    cell["metadata"].update(jupyter={"source_hidden": True}, ExecuteTime={"end_time": "x"}, scrolled=True,
                            vscode={"languageId": "python"})
    nb = _nb(cell)
    nb["metadata"].update(toc={"number_sections": True}, language_info={"name": "python", "version": "3.11.9"},
                          kernelspec={"name": "labkit", "display_name": "Python (labkit)", "language": "python"})
    student = release_notebook(nb, "00_x.ipynb")
    assert student["cells"][0]["metadata"] == {"tags": ["exercise"], "labkit": {"exercise": "ex00.1"}}
    assert student["metadata"] == {"kernelspec": nb["metadata"]["kernelspec"], "language_info": {"name": "python"}}


@pytest.mark.parametrize("cell, complaint", [
    (_code(SOLVED), "not tagged 'exercise'"),
    (_code("def f(): pass", ["exercise"], "ex00.1"), "no '### BEGIN SOLUTION'"),
    (_code(SOLVED, ["exercise"], "ex42.1"), "not defined in labkit.exercises"),
])
def test_instructor_mistakes_are_named(cell, complaint):
    with pytest.raises(ValueError, match=complaint):
        release_notebook(_nb(cell), "00_x.ipynb")


def test_the_repository_is_released_and_holds_no_outputs(root):
    run = subprocess.run([sys.executable, "-m", "labkit.release", "--check"], cwd=root,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    for path in [*root.glob("solutions/*.ipynb"), *root.glob("notebooks/*.ipynb")]:
        for cell in notebook.read(path)["cells"]:
            assert not cell.get("outputs") and not cell.get("execution_count"), f"{path} holds outputs"
    student = (root / "notebooks/00_welcome.ipynb").read_text()
    assert "BEGIN SOLUTION" not in student and "flops = 2 * m * n * k" not in student


def test_every_instructor_notebook_has_its_current_student_copy(root):
    """Each solutions/*.ipynb, whatever its number (06b too), has the student copy a release of it writes."""
    for path in sorted(root.glob("solutions/*.ipynb")):
        student = root / "notebooks" / path.name
        assert student.exists(), f"{path.name} has no student copy in notebooks/"
        released = notebook.dumps(release_notebook(notebook.read(path), path.name))
        assert student.read_text(encoding="utf-8") == released, f"notebooks/{path.name} is out of date"


def test_every_notebook_is_valid_with_a_unique_id_per_cell(root):
    """nbformat 4.5 requires cell ids (their absence is a warning now, an error in later nbformat): a cell
    pasted into an instructor notebook by hand must get one, and the release copies it."""
    for path in [*root.glob("solutions/*.ipynb"), *root.glob("notebooks/*.ipynb")]:
        cells = notebook.read(path)["cells"]
        ids = [cell.get("id") for cell in cells]
        assert None not in ids, f"{path.name}: cell {ids.index(None)} has no id"
        assert len(set(ids)) == len(ids), f"{path.name}: repeated cell ids"
        nbformat.validate(nbformat.read(path, as_version=4))


def test_every_notebooks_setup_is_its_first_code_cell(root):
    """Where a student's copy lost its tags, the grader takes the first code cell for the setup."""
    for path in root.glob("solutions/*.ipynb"):
        code = [cell for cell in notebook.read(path)["cells"] if cell["cell_type"] == "code"]
        assert notebook.code_cells(notebook.read(path), "setup") == code[:1], path.name


def test_check_reports_stale_and_orphan_notebooks(root, tmp_path, capsys):
    shutil.copytree(root / "solutions", tmp_path / "solutions")
    shutil.copytree(root / "notebooks", tmp_path / "notebooks")
    paths = ["--solutions", str(tmp_path / "solutions"), "--notebooks", str(tmp_path / "notebooks")]
    assert main(["--check", *paths]) == 0
    welcome = tmp_path / "notebooks/00_welcome.ipynb"
    welcome.write_text(welcome.read_text().replace("Welcome", "Hello"))
    shutil.copy(welcome, tmp_path / "notebooks/99_orphan.ipynb")
    assert main(["--check", *paths]) == 1
    problems = stale(tmp_path / "solutions", tmp_path / "notebooks")
    assert any("00_welcome.ipynb is out of date" in p for p in problems)
    assert any("99_orphan.ipynb has no instructor notebook" in p for p in problems)
    assert main(paths) == 0 and main(["--check", *paths]) == 1  # the orphan is reported, not deleted
    assert "out of date" not in capsys.readouterr().out.splitlines()[-1]


def test_a_release_into_its_own_solutions_or_from_no_solutions_is_refused_and_writes_nothing(root, tmp_path, capsys):
    shutil.copytree(root / "solutions", tmp_path / "solutions")
    before = {p.name: p.read_bytes() for p in (tmp_path / "solutions").glob("*.ipynb")}
    for args, complaint in [(["--notebooks", str(tmp_path / "solutions" / ".")], "is the --solutions folder"),
                            (["--notebooks", str(tmp_path / "missing" / "deep")], None),
                            (["--notebooks", str(tmp_path / "solutions" / "00_welcome.ipynb")], "is a file")]:
        args = ["--solutions", str(tmp_path / "solutions"), *args]
        if complaint is None:  # a folder that does not exist yet is made
            assert main(args) == 0 and (tmp_path / "missing" / "deep" / "00_welcome.ipynb").exists()
            continue
        with pytest.raises(SystemExit) as stop:
            main(args)
        assert stop.value.code == 2 and complaint in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "solutions").glob("*.ipynb")} == before
    with pytest.raises(SystemExit):
        main(["--solutions", str(tmp_path / "nowhere"), "--notebooks", str(tmp_path / "out")])
    assert "is not a folder of instructor notebooks" in capsys.readouterr().err and not (tmp_path / "out").exists()
