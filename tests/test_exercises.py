"""Exercises: solutions pass, released stubs and wrong answers do not, checks print and raise."""
from __future__ import annotations

import pytest
import torch

from labkit.check import FAILED, NOT_ATTEMPTED, PASSED, ExerciseFailed, check, run_cases
from labkit.exercises import EXERCISES, get
from labkit.exercises.spec import SaysWhatToDo, WrongType, assert_matches
from labkit.generate import SamplingParams

from exercise_cells import cells, define, solution


def test_every_exercise_has_one_cell_in_solutions_and_notebooks(root):
    assert set(cells("solutions", root)) == set(EXERCISES)
    assert set(cells("notebooks", root)) == set(EXERCISES)


@pytest.mark.parametrize("ex_id", sorted(EXERCISES))
def test_solution_passes(ex_id):
    fn = solution(ex_id)
    result = run_cases(get(ex_id), fn)
    assert result.status == PASSED, result.verdict()
    assert result.points == get(ex_id).points


@pytest.mark.parametrize("ex_id", sorted(ex_id for ex_id, ex in EXERCISES.items() if ex.returns))
def test_the_named_items_are_what_the_solution_returns(ex_id):
    """An exercise that names the items of the tuple it returns names as many as the solution returns,
    and a wrong item is named in the message."""
    exercise = get(ex_id)
    fn = solution(ex_id)
    case = exercise.cases()[0]
    got = fn(*case.args, **case.kwargs)
    assert isinstance(got, tuple) and len(got) == len(exercise.returns), got
    last = len(got) - 1

    def last_item_wrong(*args, **kwargs):
        items = list(fn(*args, **kwargs))
        items[last] = object()
        return tuple(items)
    message = run_cases(exercise, last_item_wrong).message
    assert f"{exercise.returns[last]}: expected" in message and "index" not in message, message


@pytest.mark.parametrize("ex_id", sorted(EXERCISES))
def test_released_stub_scores_nothing(root, ex_id):
    fn = define(cells("notebooks", root)[ex_id], get(ex_id).function)
    result = run_cases(get(ex_id), fn)
    assert result.status == NOT_ATTEMPTED and result.points == 0
    assert result.message.split(" still raise")[0].split(".")[0] == get(ex_id).function, result.message


def _with_stub(cls: type, method: str) -> type:
    """``cls`` with one method put back to the released stub."""
    namespace: dict = {}
    exec(f"def {method}(self, *args):\n    raise NotImplementedError('replace this line with your code')", namespace)
    return type(cls.__name__, (cls,), {method: namespace[method]})


def test_a_stub_left_in_a_class_is_named(root):
    pool = define(cells("solutions", root)["ex03.2"], "SimplePool")
    result = run_cases(get("ex03.2"), _with_stub(pool, "free"))  # allocate done, free not: every case frees
    assert result.status == NOT_ATTEMPTED and result.message.startswith("SimplePool.free still raises")


def test_a_stub_reached_by_some_cases_only_fails_them(root):
    solution = define(cells("solutions", root)["ex03.1"], "slot_mapping")

    def padding_slots(positions):
        raise NotImplementedError("later")

    def slot_mapping(block_tables, positions, block_size):
        return padding_slots(positions) if (positions < 0).any() else solution(block_tables, positions, block_size)
    result = run_cases(get("ex03.1"), slot_mapping)
    assert result.status == FAILED and 0 < result.passed < result.total
    assert "padding_slots still raises NotImplementedError" in result.message


@pytest.mark.parametrize("call", [
    lambda tables: torch.nn.Module()(tables),  # raised by a `raise NotImplementedError` line inside torch
    lambda tables: tables.to_sparse().view(-1),  # raised by a C++ operator: no Python frame of its own
    lambda tables: torch.stack([row.to_sparse().view(-1) for row in tables]),  # ... inside a comprehension
])
def test_a_not_implemented_error_from_a_library_is_an_ordinary_failure(call):
    def slot_mapping(block_tables, positions, block_size):
        return call(block_tables)
    result = run_cases(get("ex03.1"), slot_mapping)
    assert result.status == FAILED and "raised NotImplementedError" in result.message, result.message
    assert "still raises" not in result.message


def test_a_kernel_the_gpu_compiler_refuses_is_not_attempted(monkeypatch):
    """On a GPU, Triton refuses to compile the stub's raise; lab 07 turns that into a
    NotImplementedError of its own, raised inside labkit, which still names the kernel."""
    from labkit.exercises import lab07

    class CompilationError(Exception):
        pass

    def refuse(*args, **kwargs):
        raise CompilationError("at 12:8: unsupported AST node type: Raise")
    monkeypatch.setattr(lab07, "flash_attention", refuse)
    result = run_cases(get("ex07.2"), lambda *args: None)
    assert result.status == NOT_ATTEMPTED, result.verdict()
    assert result.message.startswith(f"{get('ex07.2').function} still raises"), result.message


@pytest.mark.parametrize("ex_id", sorted(EXERCISES))
@pytest.mark.parametrize("constant", [0, 1.0, None])
def test_a_constant_answer_fails(ex_id, constant):
    assert run_cases(get(ex_id), lambda *a, **k: constant).status == FAILED


def test_a_plausible_mistake_fails_with_the_case_and_a_hint():
    flops_over_weights = lambda m, n, k, b=2: 2 * m * n * k / (b * k * n)  # forgets A and C
    result = run_cases(get("ex00.1"), flops_over_weights)
    assert result.status == FAILED and result.passed < result.total
    assert "first failure, case" in result.message and "hint:" in result.message


def test_an_error_raised_in_labkit_names_the_students_line_that_led_there():
    from labkit.paged import BlockAllocator

    def intensity(m, n, k, b=2):
        return BlockAllocator(0, 16)  # raises inside labkit: an empty pool
    message = run_cases(get("ex00.1"), intensity).message
    line = intensity.__code__.co_firstlineno + 1
    assert f"(line {line} of your intensity; raised in " in message, message

    def bad_params(m, n, k, b=2):
        return SamplingParams(max_new_tokens=0)  # raised in a dataclass's generated __init__, then labkit's check
    message = run_cases(get("ex00.1"), bad_params).message
    assert f"(line {bad_params.__code__.co_firstlineno + 1} of your bad_params; raised in __post_init__" in message

    def own_error(m, n, k, b=2):
        raise ValueError("mine")
    message = run_cases(get("ex00.1"), own_error).message
    assert f"mine (line {own_error.__code__.co_firstlineno + 1} of own_error)" in message, message


def test_check_prints_and_only_raises_when_strict(monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_STRICT", "0")
    check("ex00.2", lambda i, p, b: 0.0)
    assert "[FAIL] ex00.2: failed" in capsys.readouterr().out
    monkeypatch.setenv("LABKIT_STRICT", "1")
    with pytest.raises(ExerciseFailed, match="ex00.2"):
        check("ex00.2", lambda i, p, b: 0.0)
    check("ex00.2", lambda i, p, b: min(p, i * b))
    assert "[PASS] ex00.2: passed" in capsys.readouterr().out
    with pytest.raises(KeyError, match="known: ex00.1"):
        check("ex99.9", print)


def test_an_endless_loop_stops_the_inline_check_as_the_grader_would(monkeypatch, capsys):
    import dataclasses
    import importlib
    import time

    check_module = importlib.import_module("labkit.check")  # labkit.check is also the function
    quick = dataclasses.replace(get("ex00.2"), timeout_s=0.5)
    monkeypatch.setattr(check_module, "get", lambda ex_id: quick)

    def attainable_flops(i, p, b):
        try:
            while True:
                time.sleep(0.01)
        except Exception:  # a student's catch-all does not swallow the stop
            return 0.0
    start = time.perf_counter()
    check("ex00.2", attainable_flops)
    assert time.perf_counter() - start < 5
    out = capsys.readouterr().out
    assert "[FAIL] ex00.2: failed" in out and "stopped after 0.5 s in case 1 of 9 (" in out and "an endless loop" in out
    check("ex00.2", lambda i, p, b: min(p, i * b))  # the timer is gone: nothing fires later
    time.sleep(0.6)
    assert "[PASS] ex00.2" in capsys.readouterr().out


def test_a_limit_inside_another_fires_alone_and_leaves_the_outer_one_standing():
    import time

    from labkit.check import Overtime, TooSlow, time_limit

    def spin(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    start = time.monotonic()
    with pytest.raises(Overtime):
        with time_limit(1.0):
            try:
                with time_limit(0.2, TooSlow):
                    spin(5)
            except TooSlow:  # code that swallows the inner stop is still stopped by the outer limit
                pass
            spin(5)
    assert 0.9 < time.monotonic() - start < 2.5
    start = time.monotonic()
    with pytest.raises(Overtime):
        with time_limit(0.6):
            with time_limit(0.3, TooSlow):
                spin(0.2)  # ends before its time: the outer limit keeps its own deadline, not a fresh 0.6 s
            spin(5)
    assert 0.5 < time.monotonic() - start < 0.75
    events = []
    with pytest.raises(Overtime):
        with time_limit(0.5):
            try:
                with time_limit(0.1, TooSlow):
                    try:
                        spin(5)
                    except TooSlow:
                        events.append("swallowed")
                    spin(5)  # the outer limit fires here, and its stop leaves through the inner block
            finally:
                spin(0.05)  # a second stop, re-armed on the way out, would cut this short
                events.append("cleaned up")
    assert events == ["swallowed", "cleaned up"]
    with time_limit(0.3):
        with time_limit(5, TooSlow):  # the outer limit ends sooner: it stands, and raises its own error
            with pytest.raises(Overtime):
                spin(5)


def test_a_function_that_is_not_callable_fails():
    assert run_cases(get("ex00.1"), 42).status == FAILED


def test_a_small_wrong_float_tensor_is_shown_whole_to_the_digits_that_tell_it_apart():
    """A wrong float tensor of up to 32 values: its first wrong index, how many differ and by how much at most,
    and both tensors whole, in as many significant digits as tell every differing pair apart (four where four
    do; more where a slip of 1e-5 would read as the same number). Anything else keeps torch's message: a larger
    tensor, another shape, a complex one."""
    expected = torch.tensor([0.25, 0.0, 0.75])
    with pytest.raises(AssertionError) as raised:
        assert_matches(torch.tensor([0.5, 0.0, 0.5]), expected, 1e-5, 1e-6)
    assert str(raised.value) == ("at index [0] expected 0.25, got 0.5 (2 of 3 values differ; largest difference "
                                 "0.25)\n    expected [0.25, 0, 0.75]\n    got      [0.5, 0, 0.5]")
    with pytest.raises(AssertionError, match=r"expected 0.714286, got 0.714293 .*\n    expected \[0.714286, 0\]"):
        assert_matches(torch.tensor([5 / 7 + 7e-6, 0.0]), torch.tensor([5 / 7, 0.0]), 1e-6, 1e-9)
    with pytest.raises(AssertionError, match=r"at index \[\] expected 0.7, got 0.5 \(1 of 1 values differ"):
        assert_matches(torch.tensor(0.5), torch.tensor(0.7), 1e-6, 1e-9)  # 0-d
    for got, wanted in [(torch.zeros(40), torch.ones(40)), (torch.zeros(2), torch.ones(3)),
                        (torch.zeros(2, dtype=torch.complex64), torch.ones(2, dtype=torch.complex64))]:
        with pytest.raises(AssertionError, match="Tensor-likes are not close|shape|do not match"):
            assert_matches(got, wanted, 1e-6, 1e-9)  # torch's own message


def test_assert_matches_compares_by_kind():
    import numpy as np

    assert_matches((1.0, torch.ones(2)), (1.0 + 1e-9, torch.ones(2)), 1e-6, 1e-9)
    assert_matches((np.float32(0.5), np.int64(2), 3), (0.5, 2, 3), 1e-6, 1e-9)
    with pytest.raises(AssertionError, match=r"a 0-d tensor \(2\): the value is right; turn it into a number with .item\(\)"):
        assert_matches(torch.tensor(2.0), 2.0, 1e-6, 1e-9)
    with pytest.raises(WrongType, match=r"expected a whole number, an int \(110\), got float 110.0: the value is right"):
        assert_matches(110.0, 110, 0, 0)
    for wrapped, kind in [("0.5", "str"), ([0.5], "list"), ((0.5,), "tuple"), (np.array([0.5]), "ndarray")]:
        with pytest.raises(WrongType, match=rf"the value is right, but inside a {kind}: return the number itself"):
            assert_matches(wrapped, 0.5, 1e-6, 1e-9)  # its hint, about the values, would mislead
    for wrong in ("0.6", [0.6], "half", None, [0.5, 0.5]):  # a wrong value or no number: the hint may help
        with pytest.raises(AssertionError, match="expected a number") as raised:
            assert_matches(wrong, 0.5, 1e-6, 1e-9)
        assert not isinstance(raised.value, WrongType), wrong
    with pytest.raises(AssertionError, match=r"expected 5368709120, got 5368704120"):  # ints exactly, not within 1e-6
        assert_matches(5368704120, 5368709120, 1e-6, 1e-9)
    with pytest.raises(AssertionError, match=r"expected 110, got 109.5"):  # a wrong value is said as such
        assert_matches(109.5, 110, 0, 0)
    assert_matches({"a": [1, 2]}, {"a": (1, 2)}, 0, 0)
    for got, expected in [(torch.ones(2), torch.zeros(2)), ([1], torch.ones(1)), (True, 1),
                          ("1", 1), ((1, 2), (1, 2, 3)), ({"a": 1}, {"b": 1}), (False, True)]:
        with pytest.raises(AssertionError):
            assert_matches(got, expected, 1e-6, 1e-9)
    with pytest.raises(SaysWhatToDo, match=r"exactly the keys \['tpot', 'ttft'\]: missing \['tpot'\]; extra "
                                           r"\['goodput_fraction', 'n'\]"):  # named, not cut short
        assert_matches({"ttft": 1, "goodput_fraction": 0.5, "n": 3}, {"ttft": 1, "tpot": 2}, 0, 0)
    with pytest.raises(AssertionError, match=r"list of 3 items, got 3 \(of type int\)"):
        assert_matches(3, [1, 2, 3], 0, 0)
    with pytest.raises(AssertionError, match=r"expected 3 items, got 2: \(1, 2\)"):
        assert_matches((1, 2), [1, 2, 3], 0, 0)
    slots = torch.tensor([[0, 1, 2, 3]])
    with pytest.raises(AssertionError, match=r"of int64, got .* of float32"):
        assert_matches(slots.float() + 0.5, slots, 0, 0)
    with pytest.raises(WrongType, match=r"the values are right, but of float32: expected int64 \(make it with "
                                        r"dtype=torch.int64, or convert with .to\(torch.int64\)\)"):
        assert_matches(slots.float(), slots, 0, 0)
    with pytest.raises(WrongType, match=r"of float32: expected bool"):  # a mask of 0. and 1.
        assert_matches(torch.tensor([1.0, 0.0]), torch.tensor([True, False]), 0, 0)
    scales = torch.tensor([0.5, 1.0, 2.0])
    with pytest.raises(WrongType, match=r"the values are right, but of float64: expected float32"):
        assert_matches(scales.double() * (1 + 1e-9), scales, 1e-6, 1e-9)
    with pytest.raises(AssertionError, match="dtype") as failure:  # wrong values too: not the right values
        assert_matches(scales.double() * 2, scales, 1e-6, 1e-9)
    assert not isinstance(failure.value, WrongType)
    with pytest.raises(AssertionError, match=r"index \[0, 2\] expected 2, got 8 \(2 of 4 .*\n"
                                             r".*\[\[0, 1, 2, 3\]\]\n.*\[\[0, 1, 8, 9\]\]"):
        assert_matches(torch.tensor([[0, 1, 8, 9]]), slots, 0, 0)


def test_what_counts_as_an_argument_changed_in_place():
    from labkit.exercises.spec import _changed

    t = torch.tensor([1.0, float("nan")])
    for before, after, changed in [(t, t.clone(), False), (t, torch.tensor([2.0, float("nan")]), True),
                                   (t, t.double(), True), ([t, 1], [t.clone(), 1], False), ([t], [3], True),
                                   ({"a": 1}, {"a": 1.5}, True), ([1, 2], [1, 2, 3], True), ("x", "x", False),
                                   (float("nan"), float("nan"), False), (float("nan"), 1.0, True),
                                   (torch.tensor([True]), torch.tensor([False]), True),
                                   (object(), object(), False)]:
        assert _changed(before, after) == changed, (before, after)


def test_an_argument_changed_in_place_fails_though_the_result_is_right():
    acceptance_rule = solution("ex05.1")

    def in_place(p, q, token):  # the residual computed in p's own memory
        accept, residual = acceptance_rule(p, q, token)
        p.sub_(q).clamp_(min=0)
        return accept, residual
    result = run_cases(get("ex05.1"), in_place)
    assert result.status == FAILED and "changed its argument p in place" in result.message, result.message
    assert "hint:" not in result.message, "the case's hint is about the result, which is right"


def test_labkit_own_code_handed_in_scores_nothing():
    from labkit.engine import admit
    from labkit.paged import BlockPool
    from labkit.quant import unpack_int4

    class ForkingPool(BlockPool):  # fork and copy_on_write are BlockPool's, which work
        pass

    class Int4Packer:
        pack = staticmethod(lambda codes: codes)
        unpack = staticmethod(unpack_int4)
    for ex_id, fn, says in [("ex03.3", ForkingPool, "ForkingPool.fork is labkit's own (labkit.paged.BlockPool.fork)"),
                            ("ex04.1", admit, "admit is labkit's own (labkit.engine.admit)"),
                            ("ex06.2", Int4Packer, "Int4Packer.unpack is labkit's own (labkit.quant.unpack_int4)")]:
        result = run_cases(get(ex_id), fn)
        assert result.status == FAILED and result.points == 0 and result.message.startswith(says), result.message


def test_an_answer_that_calls_labkit_s_own_scores_nothing_and_labkit_s_calls_go_through():
    import torch

    from labkit import awq, cost, cuda_graphs, generate, hardware, memory, paged_attention, quant, tree
    from labkit.kernels.int4_linear import int4_linear
    from labkit.model import ModelConfig
    from labkit.paged import BlockPool
    from labkit.static_cache import StaticKVCache

    def static_plan(positions, max_len):  # the cache's own plan, unpacked
        config = ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8, max_seq_len=64)
        plan = StaticKVCache(config, positions.shape[0], max_len).plan(positions)
        return plan.slots, plan.mask

    class ForkingPool(BlockPool):
        def fork(self, parent, child):
            super().fork(parent, child)

        def copy_on_write(self, seq_id, index):
            return super().copy_on_write(seq_id, index)
    for ex_id, fn, called in [
            ("ex01.1", lambda prompt_len, new_tokens: cost.tokens_processed(prompt_len, new_tokens),
             "labkit.cost.tokens_processed"),
            ("ex03.1", lambda *args: paged_attention.slot_mapping(*args), "labkit.paged_attention.slot_mapping"),
            ("ex03.3", ForkingPool, "labkit.paged.BlockPool.fork"),
            ("ex03.4", lambda *args: paged_attention.paged_attention(*args), "labkit.paged_attention.paged_attention"),
            ("ex11.3", lambda parents, accept: (tree.expected_accepted(parents, accept),) * 2,
             "labkit.tree.expected_accepted"),
            ("ex08.1", static_plan, "labkit.static_cache.StaticKVCache.plan"),
            ("ex08.3", lambda tokens, positions, sizes: cuda_graphs.pad_to_bucket(
                tokens, positions, cuda_graphs.bucket_for(tokens.shape[0], sizes)), "labkit.cuda_graphs.bucket_for"),
            ("ex06b.1", lambda packed, scales, zeros, x, group: float(quant.dequantize(
                quant.unpack_int4(packed)[None], scales[None], _zero_points(scales, zeros)[None])[0].double() @ x.double()),
             "labkit.quant.unpack_int4"),
            ("ex06b.1", lambda packed, scales, zeros, x, group: float(quant.dequantize(
                torch.stack([packed & 15, packed >> 4], -1).flatten()[None], scales[None],
                _zero_points(scales, zeros)[None])[0].double() @ x.double()), "labkit.quant.dequantize"),
            ("ex06b.1", lambda packed, scales, zeros, x, group: float(int4_linear(
                x.float()[None], packed[None], scales[None], None if zeros is None else zeros[None], group)[0, 0]),
             "labkit.kernels.int4_linear.int4_linear"),
            ("ex06b.2", lambda weight, x, scheme, grid=20: awq.search_scales(
                weight, x.reshape(-1, x.shape[-1]).abs().mean(0), quant.hessian(x), scheme, grid)[:2],
             "labkit.awq.search_scales"),
            ("ex06b.3", lambda weight, u, scale, zero, bits: quant.gptq(weight, u.T @ u, quant.Scheme(bits, None))[0],
             "labkit.quant.gptq"),
            ("ex06b.2", lambda weight, x, scheme, grid=20: _awq_from_parts(weight, x, scheme, grid),
             "labkit.awq.awq_scales"),
            ("ex11.1", lambda parents, start: (_tree_mask_by_hand(parents),
                                               start + torch.tensor(tree.check_tree(parents))),
             "labkit.tree.check_tree"),
            ("ex11.2", lambda parents, tokens, choices, start: _branch_by_walk(parents, tokens, choices, start),
             "labkit.tree.walk"),
            ("ex11.3", lambda parents, accept: (sum(tree.reach(parents, accept)[1:]),) * 2, "labkit.tree.reach"),
            ("ex00.1", lambda m, n, k, b=2: hardware.matmul_flops(m, n, k) / hardware.matmul_bytes(m, n, k, b),
             "labkit.hardware.matmul_flops"),
            ("ex02.1", lambda layers, heads, kv_heads, dim, tokens, batch, dtype: memory.kv_bytes_per_token(
                memory.ModelShape("x", 0, layers, heads, kv_heads, dim, 1 << 20), dtype) * tokens * batch,
             "labkit.memory.kv_bytes_per_token"),
            ("ex01.3", lambda model, prompt, n: list(generate.stream(
                model, prompt, generate.SamplingParams(max_new_tokens=n, stop_at_eos=False))),
             "labkit.generate.stream"),
            ("ex06.3", _forward_through_the_fused_kernel, "labkit.kernels.int4_linear.int4_linear")]:
        result = run_cases(get(ex_id), fn)
        assert result.status == FAILED and result.points == 0, (ex_id, result.message)
        assert result.message.endswith(f"your code calls labkit's {called}, which is labkit's answer to {ex_id}: write "
                                       "the exercise yourself, without it"), result.message  # and no hint after it
    assert cost.tokens_processed(3, 4) == (18, 6)  # outside a check, anyone may call it


def _forward_through_the_fused_kernel(layer, x):
    """ex06.3 through labkit's fused INT4 kernel (8 rows a call), and by hand for INT8."""
    import torch

    from labkit.kernels.int4_linear import int4_linear
    if layer.scheme.bits != 4:
        return torch.nn.functional.linear(x, (layer.packed.to(x.dtype) - 128) * layer.scales.to(x.dtype))
    rows = x.reshape(-1, x.shape[-1]).float()
    out = torch.cat([int4_linear(chunk, layer.packed, layer.scales, layer.zeros, layer.group_size)
                     for chunk in rows.split(8)])
    return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def _awq_from_parts(weight, x, scheme, grid):
    """ex06b.2 from labkit's parts: its scales, its rounding and its error, the argmin alone written."""
    from labkit import awq, quant
    m, h = x.reshape(-1, x.shape[-1]).abs().mean(0), quant.hessian(x)
    errors = [awq.output_error(weight, awq.rtn_scaled(weight, awq.awq_scales(m, k / grid), scheme), h)
              for k in range(grid + 1)]
    best = min(range(grid + 1), key=errors.__getitem__)
    return awq.awq_scales(m, best / grid), best / grid


def _tree_mask_by_hand(parents):
    import torch
    mask = torch.eye(len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents[1:], start=1):
        mask[node] |= mask[parent]
    return mask


def _branch_by_walk(parents, tokens, choices, start):
    """ex11.2 through labkit's walk, on logits whose argmax at node i is choices[i]."""
    import torch

    from labkit import tree
    from labkit.generate import SamplingParams
    logits = torch.nn.functional.one_hot(torch.tensor(choices), max([*tokens, *choices]) + 1).float()
    branch, token = tree.walk(parents, tokens, logits, SamplingParams())
    return branch, token, [start + node for node in [0, *branch]]


def _zero_points(scales, zeros):
    """ex06b.1's zero points: 8 for a symmetric grid (``zeros`` None)."""
    return scales.new_full(scales.shape, 8) if zeros is None else zeros


def test_labkit_s_own_answer_wrapped_by_partial_or_a_callable_object_scores_nothing():
    import functools

    from labkit.paged_attention import slot_mapping

    class Mapper:
        __call__ = staticmethod(slot_mapping)
    for fn in (functools.partial(slot_mapping), Mapper()):
        result = run_cases(get("ex03.1"), fn)
        assert result.status == FAILED and "is labkit's own (labkit.paged_attention.slot_mapping)" in result.message


def test_while_a_check_runs_its_answer_refuses_the_students_code_however_far_up_and_after_one_anyone_may():
    import torch

    from labkit import answers, paged_attention
    from labkit.paged import BlockAllocator

    allocator = BlockAllocator(num_blocks=4, block_size=2)
    allocator.add_sequence("A", [5, 6, 7])
    tables, positions = torch.tensor([allocator.tables["A"]]), torch.tensor([[0, 1, 2]])

    def run_by_the_check(expression: str):  # as the check's own code runs it: no student's code below it
        namespace = {"allocator": allocator}
        exec(compile(f"result = {expression}", answers.CHECK_FILE, "exec"), namespace)
        return namespace["result"]

    with answers.checking("ex03.1"):
        assert run_by_the_check('allocator.slot_mapping("A", range(3))') == [0, 1, 2]  # labkit's code calls it
        with pytest.raises(answers.BorrowedAnswer, match="labkit's answer to ex03.1"):
            paged_attention.slot_mapping(tables, positions, 2)  # this test's code may not
        with pytest.raises(answers.BorrowedAnswer, match="labkit's answer to ex03.1"):
            allocator.slot_mapping("A", range(3))  # nor through labkit's own method
    with pytest.raises(ZeroDivisionError), answers.checking("ex03.1"):
        1 / 0
    assert paged_attention.slot_mapping(tables, positions, 2).tolist() == [[0, 1, 2]]  # the check is over


def test_labkits_answer_is_not_one_attribute_or_one_eval_away():
    import inspect

    from labkit import cost

    assert not hasattr(cost.tokens_processed, "__wrapped__")  # functools.wraps left the unguarded answer there
    assert list(inspect.signature(cost.tokens_processed).parameters)[:2] == ["prompt_len", "new_tokens"]
    # a lambda made from a string runs in the globals it was given, not in labkit's: the student's
    via_eval = eval("lambda P, N: tokens_processed(P, N)", {"tokens_processed": cost.tokens_processed})
    result = run_cases(get("ex01.1"), via_eval)
    assert result.status == FAILED and "labkit's answer to ex01.1" in result.message, result.message


def test_every_class_exercise_names_the_methods_a_student_writes(root):
    for ex_id, source in cells("solutions", root).items():
        fn = define(source, get(ex_id).function)
        if isinstance(fn, type):
            assert get(ex_id).methods and all(m in vars(fn) for m in get(ex_id).methods), ex_id
        else:
            assert not get(ex_id).methods, ex_id


def test_the_case_hint_first_then_the_recipe_when_the_same_case_fails_again(monkeypatch, capsys):
    import importlib

    check_module = importlib.import_module("labkit.check")
    monkeypatch.setattr(check_module, "_FAILED_CASES", {})
    monkeypatch.setenv("LABKIT_STRICT", "0")
    recipe = get("ex00.1").recipe
    decode_only = lambda m, n, k, b=2: 2 * m * n * k / (b * (m * k + k * n + m * n)) if m == 1 else 2 * n * k / (b * k * n)
    check("ex00.1", decode_only)
    first = capsys.readouterr().out
    assert "case 2 (prefill" in first and "activations A and the output C" in first and recipe not in first, first
    check("ex00.1", lambda m, n, k, b=2: 2 * m * n * k / (b * k * n))  # case 1 fails now: no recipe yet
    out = capsys.readouterr().out
    assert "case 1 (decode" in out and recipe not in out, out
    check("ex00.1", decode_only)  # case 2 again
    assert recipe in capsys.readouterr().out


@pytest.mark.parametrize("ex_id", sorted(EXERCISES))
def test_every_case_has_a_hint_of_its_own_that_is_not_the_recipe(ex_id):
    exercise = get(ex_id)
    for case in exercise.cases():
        assert case.hint and exercise.recipe not in case.hint, f"{ex_id} case {case.label!r} has no hint of its own"


def test_an_argument_changed_in_place_is_named():
    acceptance_rule = solution("ex05.1")

    def rule(p, q, token):
        accept, residual = acceptance_rule(p, q, token)
        q.zero_()
        return accept, residual
    assert "changed its argument q in place" in run_cases(get("ex05.1"), rule).message


def test_a_stub_or_a_right_value_of_the_wrong_type_names_what_to_do_and_never_brings_the_recipe(monkeypatch, capsys):
    import importlib

    check_module = importlib.import_module("labkit.check")
    monkeypatch.setattr(check_module, "_FAILED_CASES", {})
    monkeypatch.setenv("LABKIT_STRICT", "0")
    packer = solution("ex06.2")

    class HalfDone(packer):  # pack written, unpack still the stub
        @staticmethod
        def unpack(packed):
            raise NotImplementedError("replace this line with your code")
    tokens_processed = solution("ex01.1")
    as_floats = lambda p, n: tuple(float(x) for x in tokens_processed(p, n))
    for _ in range(3):
        check("ex06.2", HalfDone)
        check("ex01.1", as_floats)
    out = capsys.readouterr().out
    assert "unpack still raises NotImplementedError: write it next" in out and "the value is right" in out, out
    assert get("ex06.2").recipe not in out and get("ex01.1").recipe not in out and "recipe" not in out


def test_the_grader_gives_the_case_hint_without_promising_a_recipe():
    matmul_intensity = solution("ex00.1")
    result = run_cases(get("ex00.1"), lambda m, n, k, b=2: matmul_intensity(m, n, k, b) if m == 1 else 1.0)
    assert "hint: with 512 rows" in result.message and "again" not in result.message, result.message


def test_right_numbers_in_an_allowed_type_pass():
    import numpy as np

    from labkit import memory
    from labkit.presets import MODEL_PRESETS

    shape = MODEL_PRESETS["Llama-3.1-8B"]
    as_float = lambda *args: float(memory.kv_cache_bytes(shape, args[4], args[5], args[6]))
    as_numpy = lambda *args: np.int64(memory.kv_cache_bytes(shape, args[4], args[5], args[6]))
    exercise = get("ex02.1")
    for answer in (as_float, as_numpy):
        case = next(c for c in exercise.cases() if c.args[:4] == (shape.n_layers, shape.n_heads, shape.n_kv_heads,
                                                                   shape.head_dim))
        case.run(answer)  # the text says bytes, not an int: a float of the right value is right


@pytest.mark.parametrize("error", [NameError("name 'tree' is not defined"), MemoryError(),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")])
def test_a_failure_no_value_hint_can_help_comes_without_one(error):
    """A name the cell does not define, or memory that ran out: the case's hint, about values, would mislead."""
    def raises(m, n, k, b=2):
        raise error
    result = run_cases(get("ex00.1"), raises)
    assert result.status == FAILED and type(error).__name__ in result.message, result.message
    assert "hint:" not in result.message and result.failed_case, result


def test_only_a_tuple_of_results_in_another_order_is_named_so():
    """A function's several results swapped is a slip of the return; a list whose items come in another order
    (text pieces a token late, accepted tokens) is a wrong list, whose case hint says why."""
    with pytest.raises(SaysWhatToDo, match="in another order"):
        assert_matches((torch.ones(2), 3), (3, torch.ones(2)), 1e-6, 1e-9)
    with pytest.raises(AssertionError) as wrong:
        assert_matches(["ca", "", "f", "é!"], ["ca", "f", "", "é!"], 1e-6, 1e-9)
    assert not isinstance(wrong.value, SaysWhatToDo), wrong.value


@pytest.mark.parametrize("source, needed", [
    ("def matmul_intensity(m, n, k, b=2):\n    print('working')\n    return scale * 2*m*n*k / (b*(m*k + k*n + m*n))\n",
     ["scale"]),
    ("import functools\n@functools.cache\ndef matmul_intensity(m, n, k, b=2):\n"  # memoised: the cache is cleared
     "    return scale * 2*m*n*k / (b*(m*k + k*n + m*n))\n", ["scale"]),
    ("def matmul_intensity(m, n, k, b=2):\n    if m < 0:\n        return scale\n"  # never read by the cases
     "    return 2*m*n*k / (b*(m*k + k*n + m*n))\n", []),
])
def test_a_name_counts_as_needed_only_where_the_cases_fail_without_it(source, needed, capsys):
    """The cases run again, quietly, with the name taken out of the function's namespace, and it is put back."""
    from labkit.check import _needed
    namespace = {"scale": 1.0}
    exec(compile(source, "<cell>", "exec"), namespace)
    fn = namespace["matmul_intensity"]
    assert run_cases(get("ex00.1"), fn).status == PASSED
    capsys.readouterr()
    assert [name for name, _ in _needed([("scale", "a demo's cell")], get("ex00.1"), fn)] == needed
    assert namespace["scale"] == 1.0 and capsys.readouterr().out == ""
