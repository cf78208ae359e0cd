"""Exercises: solutions pass, released stubs and wrong answers do not, checks print and raise."""
from __future__ import annotations

import linecache

import pytest
import torch

from labkit import notebook
from labkit.check import FAILED, NOT_ATTEMPTED, PASSED, ExerciseFailed, check, run_cases
from labkit.exercises import EXERCISES, get
from labkit.exercises.spec import assert_matches
from labkit.generate import SamplingParams


def _cells(folder, root) -> dict[str, str]:
    cells = {}
    for path in sorted((root / folder).glob("*.ipynb")):
        for cell in notebook.read(path)["cells"]:
            if (ex_id := notebook.exercise_id(cell)) is not None:
                assert ex_id not in cells, f"{ex_id} appears twice in {folder}/"
                assert path.name.startswith(get(ex_id).lab + "_"), f"{ex_id} sits in {path.name}"
                cells[ex_id] = notebook.source(cell)
    return cells


def _define(source: str, name: str):
    """Run an exercise cell and return what it defines as ``name``. The cell's source goes into
    linecache, as IPython puts it, so that Triton can read a kernel's source."""
    filename = f"<exercise cell {name} {hash(source)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def test_every_exercise_has_one_cell_in_solutions_and_notebooks(root):
    assert set(_cells("solutions", root)) == set(EXERCISES)
    assert set(_cells("notebooks", root)) == set(EXERCISES)


@pytest.mark.parametrize("ex_id", sorted(EXERCISES))
def test_solution_passes(root, ex_id):
    fn = _define(_cells("solutions", root)[ex_id], get(ex_id).function)
    result = run_cases(get(ex_id), fn)
    assert result.status == PASSED, result.verdict()
    assert result.points == get(ex_id).points


@pytest.mark.parametrize("ex_id", sorted(ex_id for ex_id, ex in EXERCISES.items() if ex.returns))
def test_the_named_items_are_what_the_solution_returns(root, ex_id):
    """An exercise that names the items of the tuple it returns names as many as the solution returns,
    and a wrong item is named in the message."""
    exercise = get(ex_id)
    fn = _define(_cells("solutions", root)[ex_id], exercise.function)
    case = exercise.cases()[0]
    got = fn(*case.args, **case.kwargs)
    assert isinstance(got, tuple) and len(got) == len(exercise.returns), got
    last = len(got) - 1

    def last_item_wrong(*args, **kwargs):
        items = list(fn(*args, **kwargs))
        items[last] = object()
        return tuple(items)
    message = run_cases(exercise, last_item_wrong).message
    assert f"{exercise.returns[last]} (item {last}): expected" in message, message


@pytest.mark.parametrize("ex_id", sorted(EXERCISES))
def test_released_stub_scores_nothing(root, ex_id):
    fn = _define(_cells("notebooks", root)[ex_id], get(ex_id).function)
    result = run_cases(get(ex_id), fn)
    assert result.status == NOT_ATTEMPTED and result.points == 0
    assert result.message.split(" still raise")[0].split(".")[0] == get(ex_id).function, result.message


def _with_stub(cls: type, method: str) -> type:
    """``cls`` with one method put back to the released stub."""
    namespace: dict = {}
    exec(f"def {method}(self, *args):\n    raise NotImplementedError('replace this line with your code')", namespace)
    return type(cls.__name__, (cls,), {method: namespace[method]})


def test_a_stub_left_in_a_class_is_named(root):
    pool = _define(_cells("solutions", root)["ex03.2"], "SimplePool")
    result = run_cases(get("ex03.2"), _with_stub(pool, "free"))  # allocate done, free not: every case frees
    assert result.status == NOT_ATTEMPTED and result.message.startswith("SimplePool.free still raises")


def test_a_stub_reached_by_some_cases_only_fails_them(root):
    solution = _define(_cells("solutions", root)["ex03.1"], "slot_mapping")

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
    assert "[FAIL] ex00.2: failed" in out and "stopped after 0.5 s: an endless loop" in out
    check("ex00.2", lambda i, p, b: min(p, i * b))  # the timer is gone: nothing fires later
    time.sleep(0.6)
    assert "[PASS] ex00.2" in capsys.readouterr().out


def test_a_function_that_is_not_callable_fails():
    assert run_cases(get("ex00.1"), 42).status == FAILED


def test_assert_matches_compares_by_kind():
    import numpy as np

    assert_matches((1.0, torch.ones(2)), (1.0 + 1e-9, torch.ones(2)), 1e-6, 1e-9)
    assert_matches((np.float32(0.5), torch.tensor(2.0), 3), (0.5, 2.0, 3), 1e-6, 1e-9)
    assert_matches({"a": [1, 2]}, {"a": (1, 2)}, 0, 0)
    for got, expected in [(torch.ones(2), torch.zeros(2)), ([1], torch.ones(1)), (True, 1),
                          ("1", 1), ((1, 2), (1, 2, 3)), ({"a": 1}, {"b": 1}), (False, True)]:
        with pytest.raises(AssertionError):
            assert_matches(got, expected, 1e-6, 1e-9)
    with pytest.raises(AssertionError, match=r"list of 3 items, got 3 \(of type int\)"):
        assert_matches(3, [1, 2, 3], 0, 0)
    with pytest.raises(AssertionError, match=r"expected 3 items, got 2: \(1, 2\)"):
        assert_matches((1, 2), [1, 2, 3], 0, 0)
    slots = torch.tensor([[0, 1, 2, 3]])
    with pytest.raises(AssertionError, match=r"of int64, got .* of float32"):
        assert_matches(slots.float(), slots, 0, 0)
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
    from labkit.speculative import acceptance_rule

    def in_place(p, q, token):  # the residual computed in p's own memory
        accept, residual = acceptance_rule(p, q, token)
        p.sub_(q).clamp_(min=0)
        return accept, residual
    result = run_cases(get("ex05.1"), in_place)
    assert result.status == FAILED and "changed its argument 1 in place" in result.message, result.message


def test_lab01_plausible_mistakes_fail():
    import math

    from labkit.generate import SamplingParams, stream

    textbook = lambda p, n: (n * p + n * (n + 1) // 2, p + n)  # feeds the last token back in
    assert run_cases(get("ex01.1"), textbook).status == FAILED

    def tiled_heads(q, k_new, v_new, k_cache, v_cache):  # KV head j % kv serves query head j: wrong
        keys, values = torch.cat([k_cache, k_new], 2), torch.cat([v_cache, v_new], 2)
        group = q.shape[1] // keys.shape[1]
        scores = q @ keys.repeat(1, group, 1, 1).transpose(-2, -1) / math.sqrt(q.shape[-1])
        return scores.softmax(-1) @ values.repeat(1, group, 1, 1), keys, values
    result = run_cases(get("ex01.2"), tiled_heads)
    assert result.status == FAILED and 0 < result.passed < result.total  # MHA and MQA cases still pass

    def naive(model, prompt, new_tokens):  # right tokens, no cache
        return list(stream(model, prompt, SamplingParams(new_tokens, stop_at_eos=False), use_cache=False))
    result = run_cases(get("ex01.3"), naive)
    assert result.status == FAILED and "cached generation runs" in result.message

    from labkit.model import ContiguousKVCache

    def through(call):  # the solution's loop, with the forward call written another way
        def cached_generate(model, prompt, new_tokens):
            cache, generated = ContiguousKVCache(model.config, 1, len(prompt) + new_tokens), []
            tokens, positions = torch.tensor([prompt]), torch.arange(len(prompt))[None]
            with torch.no_grad():
                for step in range(new_tokens):
                    generated.append(int(call(model, tokens, positions, cache)[0, -1].argmax()))
                    tokens, positions = torch.tensor([[generated[-1]]]), torch.tensor([[len(prompt) + step]])
            return generated
        return cached_generate
    assert run_cases(get("ex01.3"), through(lambda m, t, p, c: m(t, plan=c.plan(p)))).status == PASSED
    for call, says in [(lambda m, t, p, c: m(t, p, c), "cache.plan(positions), not a ContiguousKVCache"),
                       (lambda m, t, p, c: m(t, p, c.plan(p)), "a plan carries its positions")]:
        result = run_cases(get("ex01.3"), through(call))
        assert result.status == FAILED and says in result.message, result.message


def test_lab02_plausible_mistakes_fail():
    import math

    size = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
    keys_only = lambda layers, heads, kv, dim, tokens, batch, dtype: layers * kv * dim * tokens * batch * size[dtype]
    assert run_cases(get("ex02.1"), keys_only).status == FAILED
    query_heads = lambda layers, heads, kv, dim, tokens, batch, dtype: 2 * layers * heads * dim * tokens * batch * size[dtype]
    result = run_cases(get("ex02.1"), query_heads)  # right only where the model is MHA
    assert result.status == FAILED and 0 < result.passed < result.total

    def no_mask(q, k, v):  # attends to the future too
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1) @ v
    result = run_cases(get("ex02.2"), no_mask)
    assert result.status == FAILED and result.passed == 1  # only the one-token case passes

    def tiled_heads(q, k, v):  # query head i uses KV head i % n_kv_heads: wrong grouping
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        future = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1)
        return scores.masked_fill(future, float("-inf")).softmax(-1) @ v
    result = run_cases(get("ex02.2"), tiled_heads)
    assert result.status == FAILED and 0 < result.passed < result.total

    for dtypes in ({"fp32": 4, "fp16": 2, "int8": 1, "int4": 0.5}, {**size, "fp8": 2}):  # bf16 and fp8 missing, or fp8 as 2
        wrong = lambda layers, heads, kv, dim, tokens, batch, dtype, dtypes=dtypes: (
            2 * layers * kv * dim * tokens * batch * dtypes[dtype])
        result = run_cases(get("ex02.1"), wrong)
        assert result.status == FAILED and "Llama-3.1-8B" in result.message, dtypes

    all_memory = lambda memory, utilization, weights, per_sequence: max(0, int((memory - weights) // per_sequence))
    assert run_cases(get("ex02.3"), all_memory).status == FAILED


def test_lab03_plausible_mistakes_fail(root):
    from labkit.paged import BlockPool, OutOfBlocks
    solution = _define(_cells("solutions", root)["ex03.2"], "SimplePool")  # each mistake is in one method only

    def no_padding(block_tables, positions, block_size):  # -1 becomes a real slot
        return block_tables.gather(1, positions.clamp(min=0) // block_size) * block_size + positions % block_size
    assert run_cases(get("ex03.1"), no_padding).status == FAILED

    class Leaky(solution):  # frees the table but never returns blocks to the free list
        def free(self, seq_id):
            for block in self.tables.pop(seq_id):
                self.ref_count[block] -= 1
    result = run_cases(get("ex03.2"), Leaky)
    assert result.status == FAILED and "leaked" in result.message, result.message

    class Greedy(solution):  # takes what it can, then raises: the pool is changed
        def allocate(self, seq_id, n_blocks):
            blocks = [self.free_blocks.pop() for _ in range(min(n_blocks, len(self.free_blocks)))]
            for block in blocks:
                self.ref_count[block] = 1
            self.tables.setdefault(seq_id, []).extend(blocks)
            if len(blocks) < n_blocks:
                raise OutOfBlocks("too few")
            return blocks
    result = run_cases(get("ex03.2"), Greedy)
    assert result.status == FAILED and "changed the pool first" in result.message, result.message

    class IgnoresCounts(solution):  # every block back to the free list, whoever else holds it
        def free(self, seq_id):
            for block in self.tables.pop(seq_id):
                self.ref_count[block] = 0
                self.free_blocks.append(block)
    result = run_cases(get("ex03.2"), IgnoresCounts)
    assert result.status == FAILED and "two tables hold" in result.message, result.message

    class SlicesFromTheEnd(solution):  # free_blocks[-0:] is all of them
        def allocate(self, seq_id, n_blocks):
            if n_blocks > len(self.free_blocks):
                raise OutOfBlocks("too few")
            blocks = self.free_blocks[-n_blocks:]
            del self.free_blocks[-n_blocks:]
            for block in blocks:
                self.ref_count[block] = 1
            self.tables.setdefault(seq_id, []).extend(blocks)
            return blocks
    result = run_cases(get("ex03.2"), SlicesFromTheEnd)
    assert result.status == FAILED and "allocate 0 blocks" in result.message, result.message

    class AlwaysCopies(BlockPool):  # copies even an exclusive block
        def fork(self, parent, child):
            BlockPool.fork(self, parent, child)

        def copy_on_write(self, seq_id, index):
            new, = self.take(1)
            old, self.tables[seq_id][index], self.ref_count[new] = self.tables[seq_id][index], new, 1
            self.release(old)
            return old, new
    result = run_cases(get("ex03.3"), AlwaysCopies)
    assert result.status == FAILED and "labkit's own" not in result.message, result.message

    def unmasked(q, k_pool, v_pool, block_tables, lengths):  # attends to the noise past each length
        from labkit.paged_attention import gather_kv
        longest = int(lengths.max())
        keys, values = gather_kv(k_pool, block_tables, longest), gather_kv(v_pool, block_tables, longest)
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True)[:, :, 0]
    result = run_cases(get("ex03.4"), unmasked)
    assert result.status == FAILED and 0 < result.passed < result.total


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


def test_every_class_exercise_names_the_methods_a_student_writes(root):
    for ex_id, source in _cells("solutions", root).items():
        fn = _define(source, get(ex_id).function)
        if isinstance(fn, type):
            assert get(ex_id).methods and all(m in vars(fn) for m in get(ex_id).methods), ex_id
        else:
            assert not get(ex_id).methods, ex_id


def test_lab04_plausible_mistakes_fail():
    from labkit.engine import admit, preempt_newest
    from labkit.memory import blocks_for
    from labkit.metrics import request_metrics
    from labkit.paged import OutOfBlocks

    def unlimited(waiting, running, allocator, budget, max_num_seqs):  # ignores the token budget
        return admit(waiting, running, allocator, 10**9, max_num_seqs)
    assert run_cases(get("ex04.1"), unlimited).status == FAILED

    def skips_ahead(waiting, running, allocator, budget, max_num_seqs):  # a later request jumps the queue
        scheduled = []
        for request in list(waiting):
            if budget <= 0 or len(running) >= max_num_seqs:
                break
            try:
                cached = allocator.add_sequence(request.request_id, request.tokens)
            except OutOfBlocks:
                continue
            waiting.remove(request)
            request.num_computed, request.status = cached, "running"
            running.append(request)
            scheduled.append((request, min(len(request.tokens) - cached, budget)))
            budget -= scheduled[-1][1]
        return scheduled
    result = run_cases(get("ex04.1"), skips_ahead)
    assert result.status == FAILED and 0 < result.passed < result.total

    def admit_with(reserve, run, fits=lambda allocator, request: True, counts_scheduled=False):
        """admit, but reserving ``reserve(request)``, scheduling ``run(request) - cached`` tokens, trying a
        request only if ``fits``, and (``counts_scheduled``) counting this call's admissions twice in the cap."""
        def wrong(waiting, running, allocator, budget, max_num_seqs):
            scheduled = []
            while waiting and budget > 0 and len(running) + counts_scheduled * len(scheduled) < max_num_seqs:
                request = waiting[0]
                if not fits(allocator, request):
                    break
                try:
                    cached = allocator.add_sequence(request.request_id, reserve(request))
                except OutOfBlocks:
                    break
                n = min(len(run(request)) - cached, budget)
                waiting.popleft()
                request.num_computed, request.status = cached, "running"
                running.append(request)
                scheduled.append((request, n))
                budget -= n
            return scheduled
        return wrong
    tokens, prompt = (lambda r: r.tokens), (lambda r: r.prompt)
    assert run_cases(get("ex04.1"), admit_with(tokens, tokens)).status == PASSED  # the helper itself is right
    for label, wrong, case in [
            ("prompt only", admit_with(prompt, prompt), "a preempted request"),
            ("all reserved, prompt scheduled", admit_with(tokens, prompt), "a preempted request"),
            ("counts blocks before the cache", admit_with(tokens, tokens, fits=lambda a, r: a.num_free >= blocks_for(
                len(r.tokens), a.block_size)), "a cached prefix needs no new blocks"),
            ("cap counts admissions twice", admit_with(tokens, tokens, counts_scheduled=True), "max_num_seqs")]:
        result = run_cases(get("ex04.1"), wrong)
        assert result.status == FAILED and result.passed == result.total - 1 and case in result.message, label

    def oldest(waiting, running, allocator):
        return preempt_newest(waiting, running[::-1], allocator) and running.pop(0)
    assert run_cases(get("ex04.2"), oldest).status == FAILED

    def keeps_blocks(waiting, running, allocator):  # forgets to free: the blocks leak
        victim = running.pop()
        victim.num_computed, victim.status, victim.preemptions = 0, "waiting", victim.preemptions + 1
        waiting.appendleft(victim)
        return victim
    assert run_cases(get("ex04.2"), keeps_blocks).status == FAILED

    def forgets_output(waiting, running, allocator):  # the victim loses the tokens it generated
        victim = preempt_newest(waiting, running, allocator)
        victim.output = []
        return victim
    result = run_cases(get("ex04.2"), forgets_output)
    assert result.status == FAILED and "preemptions, output) should be" in result.message, result.message

    def tpot_over_all(arrival, token_times, finish=None):  # divides by n, not n - 1
        metrics = request_metrics(arrival, token_times, finish)
        if metrics["tpot"] is not None:
            metrics["tpot"] = (metrics["e2e"] - metrics["ttft"]) / len(token_times)
        return metrics
    result = run_cases(get("ex04.3"), tpot_over_all)
    assert result.status == FAILED and "'tpot': expected" in result.message, result.message  # names the key


def test_lab05_plausible_mistakes_fail():
    from labkit.speculative import acceptance_rule, speculation_gain, verify_greedy

    def unnormalised(p, q, token):  # forgets to renormalise the residual
        accept, _ = acceptance_rule(p, q, token)
        return accept, (p - q).clamp(min=0)
    assert run_cases(get("ex05.1"), unnormalised).status == FAILED

    def ratio_uncapped(p, q, token):  # p / q without the min(1, .)
        return float(p[token] / q[token]), acceptance_rule(p, q, token)[1]
    assert run_cases(get("ex05.1"), ratio_uncapped).status == FAILED

    def no_bonus(draft, target_logits):  # all accepted: takes the last draft's row instead of the bonus row
        accepted, token = verify_greedy(draft, target_logits)
        return accepted, int(target_logits[len(accepted) - 1].argmax()) if accepted == list(draft) and draft else token
    assert run_cases(get("ex05.2"), no_bonus).status == FAILED

    def keeps_going(draft, target_logits):  # accepts every matching token, even after a mismatch
        best = target_logits.argmax(-1).tolist()
        kept = [t for t, b in zip(draft, best) if t == b]
        return kept, best[len(kept)]
    assert run_cases(get("ex05.2"), keeps_going).status == FAILED

    def k_terms(a, k, c):  # sums a^0..a^(k-1): forgets the bonus token
        tokens = k if a == 1 else (1 - a ** k) / (1 - a)
        return tokens, tokens / (k * c + 1)
    assert run_cases(get("ex05.3"), k_terms).status == FAILED


def test_lab06_plausible_mistakes_fail():
    from labkit.exercises.lab06 import reference_group
    from labkit.quant import dequantize, pack_int4, unpack_int4

    def fp32_scale(w, bits, symmetric):  # keeps the scale in fp32: not what an fp16 scale dequantizes to
        codes, scale, zero, _ = reference_group(w, bits, symmetric)
        exact = (w.abs().max() / (2 ** (bits - 1) - 1) if symmetric else
                 (w.max().clamp(min=0) - w.min().clamp(max=0)) / (2 ** bits - 1)).item() or 1.0
        return codes, exact, zero, (codes.float() - zero) * exact
    assert run_cases(get("ex06.1"), fp32_scale).status == FAILED

    def symmetric_over_8(w, bits, symmetric):  # divides the largest weight by 2^(bits-1), not 2^(bits-1) - 1
        if not symmetric:
            return reference_group(w, bits, symmetric)
        scale = float((w.abs().max() / 2 ** (bits - 1)).half()) or 1.0
        codes = (torch.round(w / scale) + 2 ** (bits - 1)).clamp(0, 2 ** bits - 1).to(torch.uint8)
        return codes, scale, float(2 ** (bits - 1)), (codes.float() - 2 ** (bits - 1)) * scale
    assert run_cases(get("ex06.1"), symmetric_over_8).status == FAILED

    def grid(w, bits, symmetric, hi=lambda w: w.max().clamp(min=0), top=lambda w: w.abs().max(), exact_zero=False,
             clamp=True):
        """ex06.1 as the spec says, but for the part a keyword replaces (each call below makes one slip)."""
        if symmetric:
            exact = top(w) / (2 ** (bits - 1) - 1)
        else:
            lo = w.min().clamp(max=0)
            exact = (hi(w) - lo) / (2 ** bits - 1)
        scale = exact.half().float() if exact > 0 else torch.tensor(1.0)
        zero = torch.tensor(2.0 ** (bits - 1)) if symmetric else torch.round(-lo / (exact if exact_zero and exact > 0
                                                                                   else scale))
        codes = torch.round(w / scale) + zero
        codes = (codes.clamp(0, 2 ** bits - 1) if clamp else codes).to(torch.uint8)
        return codes, scale.item(), zero.item(), (codes.float() - zero) * scale
    assert run_cases(get("ex06.1"), grid).status == PASSED  # the helper itself is right
    for slip, case in [(dict(hi=lambda w: w.max()), "all negative"),
                       (dict(top=lambda w: w.max()), "the largest weight is negative"),
                       (dict(clamp=False), "the top code is clamped"),
                       (dict(exact_zero=True), "the zero point comes from the fp16 scale")]:
        result = run_cases(get("ex06.1"), lambda w, bits, symmetric, slip=slip: grid(w, bits, symmetric, **slip))
        assert result.status == FAILED and result.passed == result.total - 1 and case in result.message, case

    class Swapped:  # the odd code in the low nibble
        pack = staticmethod(lambda codes: pack_int4(codes.flip(-1)).flip(-1) if codes.shape[-1] % 2 == 0
                            else pack_int4(codes))
        unpack = staticmethod(lambda packed: unpack_int4(packed.flip(-1)).flip(-1))
    assert run_cases(get("ex06.2"), Swapped).status == FAILED

    class Unchecked:  # packs whatever it is given
        pack = staticmethod(lambda codes: codes[..., 0::2] | (codes[..., 1::2] << 4))
        unpack = staticmethod(unpack_int4)
    assert run_cases(get("ex06.2"), Unchecked).status == FAILED

    def checked(codes):
        if codes.numel() % 2 or int(codes.max()) > 15:  # an odd count over the whole tensor, not each row
            raise ValueError("does not fit")
        return codes[..., 0::2] | (codes[..., 1::2] << 4)  # rows of 3 broadcast to rows of 2
    result = run_cases(get("ex06.2"), type("Int4Packer", (), {"pack": staticmethod(checked),
                                                               "unpack": staticmethod(lambda p: unpack_int4(p))}))
    assert result.status == FAILED and "rows of 3 codes" in result.message, result.message

    def shifts_in_place(codes):  # the odd codes shifted in the caller's tensor
        pack_int4(codes)  # its checks
        high = codes[..., 1::2]
        high <<= 4
        return codes[..., 0::2] | high
    result = run_cases(get("ex06.2"), type("Int4Packer", (), {"pack": staticmethod(shifts_in_place),
                                                               "unpack": staticmethod(lambda p: unpack_int4(p))}))
    assert result.status == FAILED and "must leave its input as it was" in result.message, result.message
    result = run_cases(get("ex06.2"), type("Int4Packer", (), {"pack": staticmethod(lambda c: pack_int4(c)),
                                                               "unpack": staticmethod(lambda p: unpack_int4(p).flatten())}))
    assert result.status == FAILED and "expected shape [5, 64] of uint8, got shape [320]" in result.message, result.message

    def forgets_zeros(layer, x):  # treats every grid as symmetric around 0
        codes = unpack_int4(layer.packed) if layer.scheme.bits == 4 else layer.packed
        return torch.nn.functional.linear(x, dequantize(codes, layer.scales, torch.zeros_like(layer.scales)))
    assert run_cases(get("ex06.3"), forgets_zeros).status == FAILED

    def always_fp32(layer, x):  # the output in fp32 whatever x is
        codes = unpack_int4(layer.packed) if layer.scheme.bits == 4 else layer.packed
        zeros = layer.zeros if layer.zeros is not None else torch.full_like(layer.scales, 2 ** (layer.scheme.bits - 1))
        return torch.nn.functional.linear(x.float(), dequantize(codes, layer.scales, zeros))
    result = run_cases(get("ex06.3"), always_fp32)
    assert result.status == FAILED and result.passed == result.total - 1 and "bfloat16" in result.message

    def calls_the_layer(layer, x):  # the layer's own forward is sealed in the exercise
        return layer(x)
    assert run_cases(get("ex06.3"), calls_the_layer).status == FAILED


# the NaN warnings come from the mistake that loads K past the head dims
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
def test_lab07_plausible_mistakes_fail(root):
    def no_rescale(m, l, acc, scores, values):  # forgets that the old sum and output were under the old maximum
        m_new = torch.maximum(m, scores.amax(-1))
        p = torch.exp(scores - m_new[:, None])
        return m_new, l + p.sum(-1), acc + p @ values
    assert run_cases(get("ex07.1"), no_rescale).status == FAILED

    kernel = _cells("solutions", root)["ex07.2"]
    mistakes = {
        "acc is not rescaled": ("acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot"),
        "no causal mask": ("visible = visible & (keys[None, :] <= position[:, None])", "visible = visible"),
        "keys past S are not masked": ("visible = keys[None, :] < S", "visible = keys[None, :] >= 0"),
        "diagonal tiles left unmasked": ("partly_masked = partly_masked | (start + BLOCK_N - 1 > first_position)",
                                         "partly_masked = partly_masked"),
        "exp of scores in log2 units": ("p = tl.exp2(scores", "p = tl.exp(scores"),
        "V's tokens at K's stride": ("V + keys[:, None] * stride_vt", "V + keys[:, None] * stride_kt"),
        "K's tile not masked to the head's dims": ("mask=(keys[None, :] < S) & (dims[:, None] < HEAD_DIM)",
                                                   "mask=(keys[None, :] < S)"),
    }
    for what, (right, wrong) in mistakes.items():
        assert right in kernel, what
        result = run_cases(get("ex07.2"), _define(kernel.replace(right, wrong), "flash_attention_kernel"))
        assert result.status == FAILED, what
    # an error inside the kernel surfaces in Triton's interpreter code; the message names the kernel's line
    right = "k_t = tl.load(K + keys[None, :] * stride_kt + dims[:, None]"
    untransposed = kernel.replace(right, "k_t = tl.load(K + keys[:, None] * stride_kt + dims[None, :]")
    assert right in kernel
    result = run_cases(get("ex07.2"), _define(untransposed.replace("mask=(keys[None, :] < S) & (dims[:, None]",
                                                                   "mask=(keys[:, None] < S) & (dims[None, :]"),
                                              "flash_attention_kernel"))
    assert result.status == FAILED and "of your flash_attention_kernel; raised in" in result.message, result.message
