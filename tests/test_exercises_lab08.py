"""Exercises of notebook 08: plausible mistakes fail, with a hint that helps; the compile check names what
stopped the capture and sees a function fixed since."""
from __future__ import annotations

import pytest
import torch

from labkit.check import NOT_ATTEMPTED, PASSED, run_cases
from labkit.exercises import get
from labkit.exercises.lab08 import compiled_whole

from exercise_cells import cells, define, fails, mistake


def test_lab08_static_plan_mistakes_fail(root):
    mistakes = [  # (what the solution says, the slip, the case it fails first, what the message must say)
        ("positions, max_len)", "positions, -1)", "a batch with padding", "not -1 left as it is"),
        ("positions, max_len)", "positions, max_len - 1)", "a batch with padding", "not max_len - 1, a real slot"),
        ("<= query", "< query", "a decode step", "<=, not <"),
        ("(torch.arange(max_len, device=positions.device) <= query) | (query < 0)",
         "(torch.arange(max_len, device=positions.device) <= query)", "a batch with padding",
         "a padding query sees every slot"),
        ("torch.arange(max_len,", "torch.arange(8,", "another max_len", "from max_len, the argument"),
    ]
    for right, wrong, case, hint in mistakes:
        fails("ex08.1", mistake(root, "ex08.1", right, wrong), case, hint)


def test_the_model_run_catches_padding_in_the_last_real_slot(root):
    """Through the model, padding written to slot max_len - 1 overwrites the key of a row's last token, written
    in the same step: the comparison with the contiguous cache sees it, whatever the value cases say."""
    wrong = mistake(root, "ex08.1", "positions, max_len)", "positions, max_len - 1)")
    scenario = next(case for case in get("ex08.1").cases() if case.label.startswith("a random model"))
    with pytest.raises(AssertionError, match="row 0's token at position 7 gets other logits"):
        scenario.run(wrong)
    scenario.run(define(cells("solutions", root)["ex08.1"], "static_plan"))


def test_lab08_advance_mistakes_fail():
    def item(tokens, positions, finished, eos_id):  # a Python loop over the rows, reading each value
        finished, positions = finished.clone(), positions.clone()
        for row in range(tokens.shape[0]):
            if tokens[row].item() == eos_id:
                finished[row] = True
            if not finished[row].item():
                positions[row] += 1
        return positions, finished

    def branch(tokens, positions, finished, eos_id):  # a shortcut that branches on a tensor
        finished = finished | (tokens == eos_id)
        if finished.all():
            return positions.clone(), finished
        return torch.where(finished, positions, positions + 1), finished

    def boolean_mask(tokens, positions, finished, eos_id):  # right values, a data-dependent shape
        finished = finished | (tokens == eos_id)
        positions = positions.clone()
        positions[~finished] += 1
        return positions, finished

    def builtin_any(tokens, positions, finished, eos_id):  # Python's any() over a tensor: torch traces its own copy
        finished = finished | (tokens == eos_id)
        if any(finished):
            return torch.where(finished, positions, positions + 1), finished
        return positions + 1, finished

    def tolist(tokens, positions, finished, eos_id):
        done = [bool(f) or t == eos_id for f, t in zip(finished.tolist(), tokens.tolist())]
        return torch.tensor([p if d else p + 1 for p, d in zip(positions.tolist(), done)]), torch.tensor(done)

    def int_read(tokens, positions, finished, eos_id):  # captured (int of a count), but read on the host
        finished = finished | (tokens == eos_id)
        every = int(finished.sum()) // len(finished)
        return torch.where(finished, positions, positions + 1 - every), finished

    compiles = "compiles whole"
    fails("ex08.2", item, compiles, "read into Python (.item(), .tolist()")
    fails("ex08.2", int_read, compiles, "read into a Python number (int(...), float(...) or .item()) (line")
    assert "of int_read: `every = int(finished.sum()) // len(finished)`)" in run_cases(get("ex08.2"), int_read).message
    assert "line" in run_cases(get("ex08.2"), item).message  # the line that stopped the capture
    fails("ex08.2", branch, compiles, "a Python if, while, and, or, or not decides on a tensor's value")
    fails("ex08.2", boolean_mask, compiles, "`positions[~finished] += 1`")
    fails("ex08.2", builtin_any, compiles, "of builtin_any: `if any(finished):`")  # the student's line, not torch's
    fails("ex08.2", tolist, compiles, "read into Python")

    def old_finished(tokens, positions, finished, eos_id):  # moves a row that has just finished
        return torch.where(finished, positions, positions + 1), finished | (tokens == eos_id)

    def replaced(tokens, positions, finished, eos_id):  # forgets the rows finished before
        done = tokens == eos_id
        return torch.where(done, positions, positions + 1), done

    def in_place(tokens, positions, finished, eos_id):
        finished |= tokens == eos_id
        return torch.where(finished, positions, positions + 1), finished

    def fixed_eos(tokens, positions, finished, eos_id):
        finished = finished | (tokens == 2)
        return torch.where(finished, positions, positions + 1), finished
    fails("ex08.2", old_finished, "rows that produce eos", "use the updated finished")
    fails("ex08.2", replaced, "finished rows stay finished", "do not replace it")
    fails("ex08.2", in_place, "rows that produce eos", "changed its argument finished in place")
    fails("ex08.2", fixed_eos, "eos_id is an argument", "compare with eos_id")


def test_the_compile_check_sees_a_function_fixed_since_and_repeats_its_verdict():
    args = (torch.tensor([2, 5]), torch.tensor([3, 4]), torch.tensor([False, False]), 2)
    namespace: dict = {}
    exec("import torch\ndef advance(tokens, positions, finished, eos_id):\n"
         "    finished = finished | (tokens == eos_id)\n"
         "    if finished.any():\n        pass\n"
         "    return torch.where(finished, positions, positions + 1), finished\n", namespace)
    broken = namespace["advance"]
    for _ in range(2):  # dynamo caches what it compiled per function: the check traces a fresh copy each time
        with pytest.raises(AssertionError, match="decides on a tensor's value"):
            compiled_whole(broken, *args)
    exec("import torch\ndef advance(tokens, positions, finished, eos_id):\n"
         "    finished = finished | (tokens == eos_id)\n"
         "    return torch.where(finished, positions, positions + 1), finished\n", namespace)
    positions, finished = compiled_whole(namespace["advance"], *args)
    assert positions.tolist() == [3, 5] and finished.tolist() == [True, False]
    assert run_cases(get("ex08.2"), namespace["advance"]).status == PASSED


def test_a_stub_inside_the_compile_check_is_not_attempted():
    def advance(tokens, positions, finished, eos_id):
        raise NotImplementedError("ex08.2: replace this line with your code")
    result = run_cases(get("ex08.2"), advance)
    assert result.status == NOT_ATTEMPTED and result.message.startswith("advance still raises"), result.message


def _min_of_nothing() -> str:
    """What this Python's min() says of an empty sequence (its words changed in 3.12)."""
    try:
        min([])
    except ValueError as error:
        return str(error)
    raise AssertionError("min([]) returned")


def test_lab08_pad_batch_mistakes_fail():
    def pad(tokens, positions, bucket, value=-1, dtype=None):
        missing = bucket - tokens.shape[0]
        pad_positions = torch.full((missing, positions.shape[1]), value, dtype=dtype or positions.dtype)
        return (torch.cat([tokens, torch.zeros((missing, tokens.shape[1]), dtype=tokens.dtype)]),
                torch.cat([positions, pad_positions]))

    smallest = lambda rows, sizes: min(s for s in sizes if s >= rows)  # noqa: E731
    mistakes = [
        (lambda t, p, s: pad(t, p, smallest(t.shape[0], s), value=0), "3 rows", "position 0 is a real token"),
        (lambda t, p, s: pad(t, p, max(s)), "4 rows", "not the largest (8)"),
        (lambda t, p, s: pad(t, p, smallest(t.shape[0] + 1, s)), "4 rows", "not the next one up"),
        (lambda t, p, s: pad(t, p, smallest(t.shape[0], s), dtype=torch.float32), "4 rows", "of float32"),
        (lambda t, p, s: pad(t, p, next(b for b in s if b >= t.shape[0])), "9 rows", "not the first one in the list"),
        (lambda t, p, s: pad(t, p, 1 << (t.shape[0] - 1).bit_length()), "33 rows", "not the next power of two"),
        (lambda t, p, s: pad(t, p, max(t.shape[0], min([b for b in s if b >= t.shape[0]] or [0]))), "20 rows",
         "raise ValueError"),
        (lambda t, p, s: pad(t, p, smallest(t.shape[0], s)), "20 rows",  # min() of nothing raises for it
         f"its message, {_min_of_nothing()!r}, does not say what went wrong"),
        (lambda t, p, s: pad(t, p, smallest(t.shape[0], s)) if [b for b in s if b >= t.shape[0]] else
         (_ for _ in ()).throw(ValueError("none fits")), "20 rows", "name the batch's size (20), and the buckets too"),
    ]
    for fn, case, hint in mistakes:
        fails("ex08.3", fn, case, hint)
    assert run_cases(get("ex08.3"), lambda t, p, s: pad(t, p, smallest(t.shape[0], s)) if [
        b for b in s if b >= t.shape[0]] else (_ for _ in ()).throw(ValueError(f"{t.shape[0]} rows: no bucket of {s}"))).status == PASSED


def test_a_frame_without_source_keeps_its_line_and_torchs_own_frames_are_passed_over():
    from labkit.exercises.lab08 import _TORCH_DIR, _where
    trace = (f'from user code:\n   File "<stdin>", line 3, in advance\n'
             f'  File "{_TORCH_DIR}_dynamo/polyfills/builtins.py", line 44, in any\n    if elem:\n')
    assert _where(trace) == " (line 3 of advance)"
    trace = 'File "/work/cell.py", line 7, in step\n    if done.all():\n' + trace
    assert _where(trace) == " (line 3 of advance)"  # the innermost frame outside torch


def test_an_advance_that_moves_the_callers_positions_in_place_fails():
    """The spec asks for new tensors. Updated in place, the positions are right, and only the cases that check
    the arguments after the call see it: every case does, not only the one where the old finished changes."""
    def plus_equals(tokens, positions, finished, eos_id):
        finished = finished | (tokens == eos_id)
        positions += ~finished
        return positions, finished

    def add_(tokens, positions, finished, eos_id):
        return positions.add_((~(finished | (tokens == eos_id))).long()), finished | (tokens == eos_id)
    for fn in (plus_equals, add_):
        fails("ex08.2", fn, "no row finishes", "changed its argument positions in place")


def test_python_precedence_and_pythons_or_get_a_hint_that_names_them():
    def precedence(tokens, positions, finished, eos_id):  # (finished | tokens) == eos_id: | binds tighter
        finished = finished | tokens == eos_id
        return torch.where(finished, positions, positions + 1), finished

    def python_or(tokens, positions, finished, eos_id):
        finished = finished or tokens == eos_id
        return torch.where(finished, positions, positions + 1), finished
    fails("ex08.2", precedence, "finished rows stay finished", "(finished | tokens) == eos_id")
    fails("ex08.2", python_or, "no row finishes", "Python's and, or and not")


def test_padding_put_first_or_a_batch_counted_along_the_tokens_gets_a_hint_that_names_it():
    def prepended(tokens, positions, sizes):
        missing = min(s for s in sizes if s >= tokens.shape[0]) - tokens.shape[0]
        return (torch.cat([torch.zeros((missing, tokens.shape[1]), dtype=tokens.dtype), tokens]),
                torch.cat([torch.full((missing, positions.shape[1]), -1), positions]))

    def along_tokens(tokens, positions, sizes):  # B taken from the wrong axis: [B, T]'s T
        missing = min(s for s in sizes if s >= tokens.shape[1]) - tokens.shape[0]
        return (torch.cat([tokens, torch.zeros((missing, tokens.shape[1]), dtype=tokens.dtype)]),
                torch.cat([positions, torch.full((missing, positions.shape[1]), -1)]))
    fails("ex08.3", prepended, "3 rows", "after the batch's own rows")
    fails("ex08.3", along_tokens, "4 rows", "tokens.shape[0]")


def test_a_plan_that_reads_the_positions_on_the_host_fails_the_compile_check(root):
    """The contiguous cache's way, positions.tolist() and Python: the right values, but no graph. The solution
    compiles whole, and a stub is still not attempted (the eager call comes first)."""
    def from_a_list(positions, max_len):
        slots = torch.tensor([[p if p >= 0 else max_len for p in row] for row in positions.tolist()])
        query = positions[:, None, :, None]
        return slots, (torch.arange(max_len) <= query) | (query < 0)
    result = fails("ex08.1", from_a_list, "compiles whole", "read into Python")
    assert "line" in result.message and "torch.where" in result.message
    assert run_cases(get("ex08.1"), define(cells("solutions", root)["ex08.1"], "static_plan")).status == PASSED

    def static_plan(positions, max_len):
        raise NotImplementedError("ex08.1: replace this line with your code")
    assert run_cases(get("ex08.1"), static_plan).status == NOT_ATTEMPTED


def test_right_items_returned_in_another_order_are_named_so(root):
    """A tuple of the right items in the wrong order: said, without the case's hint (which is about values)."""
    result = fails("ex08.3", mistake(root, "ex08.3", "return torch.cat([tokens, pad_tokens]), torch.cat([positions, "
                                     "pad_positions])", "return torch.cat([positions, pad_positions]), "
                                     "torch.cat([tokens, pad_tokens])"), "4 rows",
                   "the items are right, but in another order (index 0 holds what belongs at index 1")
    assert "hint:" not in result.message
