"""labkit.mutants: the changes it makes to a solution, and the mutants a check lets through."""
from __future__ import annotations

import pytest

from labkit import mutants
from labkit.exercises import get
from labkit.exercises.spec import Case, Exercise

SOURCE = '''def below(a, b):
    limit = b + 1  # outside the solution: never changed
    ### BEGIN SOLUTION
    if not a:
        return False
    return a < limit and b > 0
    ### END SOLUTION
'''


def test_each_change_is_one_and_inside_the_solution_region():
    made = list(mutants.mutants(SOURCE))
    assert all("limit = b + 1" in m.source for m in made)  # the line before the region stays as it is
    changed = {(m.kind, m.before, m.after) for m in made}
    assert ("comparison", "return a < limit and b > 0", "return a <= limit and b > 0") in changed
    assert ("comparison", "return a < limit and b > 0", "return a < limit and b >= 0") in changed
    assert ("and/or", "return a < limit and b > 0", "return a < limit or b > 0") in changed
    assert ("number + 1", "return a < limit and b > 0", "return a < limit and b > 1") in changed
    assert ("unary dropped", "if not a:", "if a:") in changed
    assert ("statement removed", "return False", "pass") in changed
    assert len(made) == len(changed) == 9  # two comparisons, and/or, a number twice, not, if, two returns
    assert [m.kind for m in made] == [m.kind for m in mutants.mutants(SOURCE)]  # in a fixed order


def test_a_keyword_is_left_out_a_function_called_for_its_partner_and_arguments_swapped():
    calls = ("def top(x):\n    ### BEGIN SOLUTION\n    return x.amax(dim=-1, keepdim=True) + max(1, 2) + pow(x, 2)\n"
             "    ### END SOLUTION\n")
    changed = {(m.kind, m.after) for m in mutants.mutants(calls)}
    assert changed >= {("keyword dropped", "return x.amax(keepdim=True) + max(1, 2) + pow(x, 2)"),
                       ("keyword dropped", "return x.amax(dim=-1) + max(1, 2) + pow(x, 2)"),
                       ("partner called", "return x.amin(dim=-1, keepdim=True) + max(1, 2) + pow(x, 2)"),
                       ("partner called", "return x.amax(dim=-1, keepdim=True) + min(1, 2) + pow(x, 2)"),
                       ("arguments swapped", "return x.amax(dim=-1, keepdim=True) + max(1, 2) + pow(2, x)")}
    assert not any(kind == "arguments swapped" and "max(2, 1)" in after for kind, after in changed)  # moot for max
    in_triton = "def f(x):\n    ### BEGIN SOLUTION\n    return tl.sum(x) + tl.max(x)\n    ### END SOLUTION\n"
    partners = {m.after for m in mutants.mutants(in_triton) if m.kind == "partner called"}
    assert partners == {"return tl.sum(x) + tl.min(x)"}  # Triton has no tl.mean: no mutant that cannot compile


def test_a_check_without_the_edge_case_lets_the_comparison_through():
    weak = Exercise(id="ex00.1", title="below", points=1, function="below", recipe="",
                    cases=lambda: [Case("far below", (1, 5), True), Case("far above", (9, 5), False),
                                   Case("nothing", (0, 5), False)])
    total, passed = mutants.survivors(weak, SOURCE)
    assert total == 9
    assert {(m.kind, m.after) for m in passed} >= {("comparison", "return a <= limit and b > 0")}
    edged = Exercise(id="ex00.1", title="below", points=1, function="below", recipe="",
                     cases=lambda: [*weak.cases(), Case("at the limit", (6, 5), False)])
    assert ("comparison", "return a <= limit and b > 0") not in {(m.kind, m.after)
                                                                 for m in mutants.survivors(edged, SOURCE)[1]}


def test_a_mutant_that_loops_for_ever_is_stopped_and_counts_as_caught():
    looping = ("def f(n):\n    ### BEGIN SOLUTION\n    while n > 0:\n        n -= 1\n    return n\n"
               "    ### END SOLUTION\n")
    exercise = Exercise(id="ex00.1", title="f", points=1, function="f", recipe="",
                        cases=lambda: [Case("three", (3,), 0)])
    by_kind = {m.kind + " " + m.after: m for m in mutants.mutants(looping)}
    assert not mutants.passes(exercise, by_kind["operator n += 1"].source, limit_s=0.5)  # n grows: stopped
    assert not mutants.passes(exercise, by_kind["comparison while n >= 0:"].source, limit_s=0.5)  # returns -1


def test_every_mutant_of_a_solution_the_lab_ships_is_caught(root, capsys):
    cells = mutants.solution_cells(root / "solutions")
    total, passed = mutants.survivors(get("ex00.1"), cells["ex00.1"])
    assert total >= 10 and passed == []
    assert mutants.main(["ex00.2", "--solutions", str(root / "solutions")]) == 0
    assert capsys.readouterr().out.startswith("ex00.2: the check caught 3 of 3 mutants")


def test_a_solution_its_check_fails_is_refused_and_the_command_says_so(root, tmp_path, capsys):
    weak = Exercise(id="ex00.1", title="below", points=1, function="below", recipe="",
                    cases=lambda: [Case("at the limit", (6, 5), True)])  # a case the solution gets wrong
    with pytest.raises(ValueError, match="the check of ex00.1 does not pass its solution"):
        mutants.survivors(weak, SOURCE)
    (tmp_path / "00_welcome.ipynb").write_bytes((root / "solutions/00_welcome.ipynb").read_bytes().replace(
        b"2 * m * n * k", b"3 * m * n * k"))  # a solution broken: its check fails it
    assert mutants.main(["ex00.1", "ex00.2", "--solutions", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("ex00.2: the check caught") and "not checked: ex00.1: the check of ex00.1" in err
    with pytest.raises(SystemExit):
        mutants.main(["ex00.1", "--limit", "-1"])
    assert "--limit -1: give a number of seconds above 0" in capsys.readouterr().err
