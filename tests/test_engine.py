"""The serving engine: continuous batching gives every request the tokens it would get alone
(greedy and seeded sampling, under preemption, chunked prefill and prefix caching), the step log
follows first come, first served scheduling (checked against a reference replay of the
scheduler), static batching, validation, metrics, workloads, the ragged paged cache and the
cost-model simulator."""
from __future__ import annotations

import copy
import functools
import math
import random
import statistics
from collections import Counter, deque

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from labkit import presets
from labkit.engine import (FINISHED, RUNNING, WAITING, Engine, Request, Scheduler, SchedulerConfig, StepRecord, admit,
                           preempt_newest)
from labkit.generate import SamplingParams, stream
from labkit.hardware import Hardware
from labkit.kernels.paged_decode_cpu import paged_decode_cpu
from labkit.memory import ModelShape, blocks_for
from labkit.metrics import request_metrics, summarize
from labkit.paged import BlockAllocator, PagedKVCache, step_logits
from labkit.simulate import CostModel, SimulatedEngine
from labkit.static_batching import run_static
from labkit.workload import lognormal, make_workload, uniform
from labkit.viz import plot_batch_timeline

from tiny_models import far_apart_model, one_torch_thread

VOCAB = 64


MODEL = far_apart_model(VOCAB)


one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


def params(max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                          stop_at_eos=False)


@functools.lru_cache(maxsize=None)
def _alone(prompt: tuple[int, ...], p: SamplingParams) -> list[int]:
    """The reference: the request generated on its own through the contiguous cache."""
    return list(stream(MODEL, list(prompt), p))


def alone(request: Request) -> list[int]:
    return _alone(tuple(request.prompt), request.params)


def run_engine(engine: Engine, requests: list[Request], max_steps: int = 5000) -> list[Request]:
    """``engine.run`` with a guard against a scheduler that never finishes."""
    step, count = engine.step, [0]

    def counted():
        count[0] += 1
        assert count[0] <= max_steps, f"no end after {max_steps} steps: the scheduler livelocks"
        return step()
    engine.step = counted
    try:
        return engine.run(requests)
    finally:
        del engine.step


def check_finished(engine: Engine, requests: list[Request], done: list[Request]) -> None:
    """Every request finished exactly once with all its tokens, and the pool is clean again."""
    assert done == requests  # the same objects, in the order given
    for r in requests:
        assert r.status == FINISHED
        assert len(r.output) == r.params.max_new_tokens == len(r.token_times)
        assert r.finish_time is not None and r.finish_time == r.token_times[-1]
        assert r.token_times == sorted(r.token_times) and r.token_times[0] >= r.arrival_time
    assert not engine.scheduler.running and not engine.scheduler.waiting
    allocator = engine.allocator
    assert allocator.tables == {} and allocator.lengths == {} and allocator.names == {}
    allocator.check()
    assert allocator.num_free == allocator.num_blocks  # every block free, or held by the prefix cache alone
    assert set(allocator.block_states()) <= {"free", "cached"}


def replay(engine: Engine, requests: list[Request], config: SchedulerConfig, exact: bool) -> Counter:
    """Check the step log against a reference model of the scheduler.

    Always: no request twice in a step, the token budget and the sequence cap, preempted
    requests are the newest running ones and go back to the front of the queue, running requests
    come before admissions (a prefix of the running list, cut only by the budget), admissions
    follow the queue (first come, first served), none in a step that preempted, and a token
    comes to a request (its token_times, its finish time) exactly at the end of a step that ran it.

    ``exact`` (no prefix caching, so no tokens skipped at admission): also how many tokens each
    request runs, that its token comes exactly when its last uncached token runs, each entry's
    kind, that a preemption was needed and that admission stopped only for a reason. Returns
    counts of the cases met, for tests that must meet them."""
    seen: Counter = Counter()
    by_id = {r.request_id: r for r in requests}
    queue = [r.request_id for r in sorted(requests, key=lambda r: r.arrival_time)]  # waiting, then not yet arrived
    running: list = []
    produced = dict.fromkeys(by_id, 0)
    computed: dict = {}  # exact: tokens in the cache
    reserved: dict = {}  # exact: tokens with slots
    size, pool = engine.allocator.block_size, engine.allocator.num_blocks
    prev_end = 0.0

    def length(i) -> int:
        return len(by_id[i].prompt) + produced[i]

    for rec in engine.log:
        ids = [i for i, _, _ in rec.batch]
        assert ids and len(set(ids)) == len(ids), rec
        assert prev_end <= rec.start <= rec.end
        assert all(n >= 1 for _, n, _ in rec.batch)
        assert sum(n for _, n, _ in rec.batch) <= config.max_num_batched_tokens
        assert len(ids) <= config.max_num_seqs
        victims = list(rec.preempted)
        assert not set(victims) & set(ids)
        assert victims == running[::-1][:len(victims)], "preemption must take the newest running request"
        del running[len(running) - len(victims):]
        for v in victims:  # each to the front: the oldest victim, preempted last, is first
            queue.insert(0, v)
            computed.pop(v, None)
            reserved.pop(v, None)
        k = 0
        while k < len(ids) and ids[k] in running:
            k += 1
        assert ids[:k] == running[:k], "running requests keep their order and come first"
        budget = config.max_num_batched_tokens
        for i, n, _ in rec.batch[:k]:
            if exact:
                assert n == min(length(i) - computed[i], budget)
                reserved[i] = length(i)
            budget -= n
        if k < len(running):
            assert budget == 0, "a running request was skipped although tokens were left in the budget"
        held = sum(blocks_for(reserved[i], size) for i in running) if exact else 0
        if exact and victims:
            assert held + blocks_for(length(victims[-1]), size) > pool, "a preemption that was not needed"
        admitted = rec.batch[k:]
        assert not (victims and admitted), "admissions in a step that preempted"
        for i, n, _ in admitted:
            assert i not in running and queue and queue[0] == i, f"{i} admitted out of turn: queue {queue}"
            queue.pop(0)
            assert by_id[i].arrival_time <= rec.start
            if exact:
                assert n == min(length(i), budget)
                assert config.chunked_prefill or n == length(i)
                held += blocks_for(length(i), size)
                assert not running or pool - held >= config.headroom * (len(running) + 1), "headroom not kept"
                computed[i], reserved[i] = 0, length(i)
            running.append(i)
            budget -= n
        assert len(running) <= config.max_num_seqs
        if exact:
            assert held <= pool
            if not victims and queue and budget > 0 and len(running) < config.max_num_seqs:
                nxt = queue[0]
                if by_id[nxt].arrival_time <= prev_end:  # it was in the waiting queue for this step
                    blocked = blocks_for(length(nxt), size) > pool - held - config.headroom * (len(running) + 1)
                    too_long = not config.chunked_prefill and length(nxt) > budget
                    assert blocked or too_long, f"{nxt} was not admitted though it fitted"
        for i, n, kind in rec.batch:
            r = by_id[i]
            got_token = produced[i] < len(r.token_times) and r.token_times[produced[i]] == rec.end
            if exact:
                assert got_token == (computed[i] + n == length(i))
                decode = produced[i] > 0 and n == 1 and computed[i] == length(i) - 1
                assert kind == ("decode" if decode else "prefill")
                if produced[i] and not decode:
                    seen["recomputation chunk of 1" if n == 1 else "recomputation chunk"] += 1
                computed[i] += n
            else:
                assert kind in ("prefill", "decode") and (kind == "prefill" or n == 1)
            seen["chunks that end without a token"] += not got_token
            if got_token:
                produced[i] += 1
                if produced[i] == r.params.max_new_tokens:
                    assert r.finish_time == rec.end
                    running.remove(i)
                    computed.pop(i, None)
                    reserved.pop(i, None)
        prev_end = rec.end
    assert not running and not queue
    assert all(produced[r.request_id] == len(r.output) == r.params.max_new_tokens for r in requests)
    seen["preemptions"] = sum(len(rec.preempted) for rec in engine.log)
    return seen


# ---------------------------------------------------------------- continuous batching, property-based

@st.composite
def workloads(draw):
    """Requests (some sharing a prompt prefix, some sampled, some arriving later), a scheduler
    configuration, a block size and a pool that is often just big enough for the largest request."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    shared = draw(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=12)) if draw(st.booleans()) else []
    specs = []
    for _ in range(draw(st.integers(2, 6))):
        prompt = shared * draw(st.booleans()) + draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14))
        temperature = draw(st.sampled_from([0.0, 0.0, 0.7, 1.5]))
        p = params(draw(st.integers(1, 10)), temperature, draw(st.sampled_from([0, 5])) if temperature else 0,
                   draw(st.integers(0, 1000)) if temperature else None)
        arrival = draw(st.sampled_from([0.0, 0.0, 0.0, 0.002, 0.01]))
        specs.append((prompt, p, arrival))
    longest = max(len(prompt) + p.max_new_tokens - 1 for prompt, p, _ in specs)
    chunked = draw(st.booleans())
    budget = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 64]))
    config = SchedulerConfig(max_num_seqs=draw(st.integers(1, 6)),
                             max_num_batched_tokens=budget if chunked else max(budget, longest),
                             chunked_prefill=chunked, headroom=draw(st.sampled_from([0, 0, 1, 2])))
    need = [blocks_for(len(prompt) + p.max_new_tokens - 1, block_size) for prompt, p, _ in specs]
    tight = draw(st.sampled_from([True, True, True, False]))
    num_blocks = (max(need) if tight else sum(need)) + draw(st.integers(0, 2))
    return specs, config, block_size, num_blocks, draw(st.booleans())


def build(specs) -> list[Request]:
    return [Request(f"r{i}", prompt, p, arrival_time=arrival) for i, (prompt, p, arrival) in enumerate(specs)]


@settings(max_examples=40, deadline=None)
@given(workloads())
def test_every_request_gets_the_tokens_it_would_get_alone(workload):
    specs, config, block_size, num_blocks, prefix_caching = workload
    requests = build(specs)
    engine = Engine(MODEL, num_blocks, block_size, config, prefix_caching)
    done = run_engine(engine, requests)
    assert [r.output for r in done] == [alone(r) for r in requests]
    check_finished(engine, requests, done)
    seen = replay(engine, requests, config, exact=not prefix_caching)
    for case, met in [("preempted", seen["preemptions"]), ("a cached prefix", any(r.cached_tokens for r in requests)),
                      ("a prompt in chunks", seen["chunks that end without a token"]),
                      ("sampled", any(r.params.temperature for r in requests))]:
        if met:
            event(case)


MODEL32 = copy.deepcopy(MODEL).float()  # the C++ decode operator is fp32 only


@settings(max_examples=20, deadline=None)
@given(workloads())
def test_the_cpu_decode_kernel_changes_no_token_and_loses_no_request(workload):
    """The engine with labkit's C++ paged decode operator against the same engine gathering the
    blocks (whose outputs the test above checks against each request generated alone)."""
    specs, config, block_size, num_blocks, prefix_caching = workload
    calls = []

    def kernel(*args):
        calls.append(len(args[0]))
        return paged_decode_cpu(*args)
    outputs = []
    for decode_kernel in (None, kernel):
        requests = build(specs)
        engine = Engine(MODEL32, num_blocks, block_size, config, prefix_caching, decode_kernel=decode_kernel)
        done = run_engine(engine, requests)
        check_finished(engine, requests, done)
        outputs.append([r.output for r in done])
    assert outputs[0] == outputs[1]
    one_token_steps = sum(any(n == 1 for _, n, _ in record.batch) for record in engine.log)
    # one call when the cache is made (to try the kernel), then one per layer of each step, for all its decodes
    assert len(calls) == 1 + one_token_steps * MODEL.config.n_layers


def test_a_decode_kernel_that_cannot_serve_the_cache_is_refused_when_the_engine_is_made():
    with pytest.raises(ValueError, match="paged_decode_cpu cannot attend.*float64"):
        Engine(MODEL, 8, 4, decode_kernel=paged_decode_cpu)  # the operator is fp32 only


def _crowd(n: int, temperature: float = 0.0) -> list[Request]:
    """``n`` requests of 6..11-token prompts and 12 new tokens each, all at once."""
    return [Request(i, [(7 * i + 3 * j) % VOCAB for j in range(6 + i % 6)],
                    params(12, temperature, top_k=8 if temperature else 0, seed=100 + i if temperature else None))
            for i in range(n)]


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_pool_just_big_enough_for_one_request_preempts_and_changes_no_token(temperature, prefix_caching):
    requests = _crowd(8, temperature)
    block_size = 4
    num_blocks = max(blocks_for(r.max_tokens, block_size) for r in requests)  # 6 blocks of 4 for 22 tokens
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    engine = Engine(MODEL, num_blocks, block_size, config, prefix_caching)
    done = run_engine(engine, requests)
    assert sum(r.preemptions for r in requests) > 0
    assert any(rec.preempted for rec in engine.log)
    assert [r.output for r in done] == [alone(r) for r in requests]
    check_finished(engine, requests, done)
    replay(engine, requests, config, exact=not prefix_caching)


def test_without_chunked_prefill_a_preempted_request_is_recomputed_in_one_step():
    requests = _crowd(6)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=22, chunked_prefill=False)
    engine = Engine(MODEL, 7, 4, config, prefix_caching=False)
    done = run_engine(engine, requests)
    assert sum(r.preemptions for r in requests) > 0
    assert [r.output for r in done] == [alone(r) for r in requests]
    replay(engine, requests, config, exact=True)


def test_a_small_budget_recomputes_a_preempted_request_in_chunks():
    """A workload (found by search) where a preempted request comes back while older ones take
    most of a 4-token budget: its recomputation runs in chunks, one of them a single token, which
    is still a prefill, not a decode."""
    specs = [([60, 36], 5), ([50, 4, 34, 42], 8), ([7, 37], 4), ([39, 26, 48, 8, 54], 1), ([11, 47], 1)]
    requests = [Request(i, prompt, params(n)) for i, (prompt, n) in enumerate(specs)]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, headroom=0)
    engine = Engine(MODEL, 6, 2, config, prefix_caching=False)
    done = run_engine(engine, requests)
    assert [r.output for r in done] == [alone(r) for r in requests]
    seen = replay(engine, requests, config, exact=True)
    assert seen["preemptions"] and seen["recomputation chunk"] and seen["recomputation chunk of 1"]


def test_eos_ends_a_request_as_it_ends_the_stream():
    prompt = [5, 9, 14, 2]
    reference = _alone(tuple(prompt), params(10))
    eos = reference[3]  # the 4th token (it may come earlier too)
    request = Request("a", prompt, SamplingParams(max_new_tokens=10, stop_at_eos=True))
    engine = Engine(MODEL, 8, 4, eos_id=eos)
    engine.run([request])
    expected = list(stream(MODEL, prompt, SamplingParams(max_new_tokens=10, stop_at_eos=True), eos_id=eos))
    assert request.output == expected and request.output[-1] == eos and len(expected) <= 4
    assert request.status == FINISHED and request.finish_time == request.token_times[-1]


def test_run_returns_the_requests_in_the_order_given_and_the_engine_can_run_again():
    late = Request("late", [3, 4, 5], params(3), arrival_time=0.01)
    early = Request("early", [6, 7], params(4))
    engine = Engine(MODEL, 16, 4)
    assert engine.run([late, early]) == [late, early]
    assert early.token_times[0] < late.token_times[0] and late.token_times[0] >= 0.01
    again = Request("again", [6, 7], params(4))
    engine.run([again])
    assert again.output == early.output == alone(early)
    assert engine.log[0].start >= 0 and len(engine.log) == 4  # the log and the clock start over


# ---------------------------------------------------------------- static batching

@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), st.integers(1, 8),
                          st.sampled_from([0.0, 0.0, 1.0])),
                min_size=1, max_size=5),
       st.integers(1, 4))
def test_static_batching_gives_the_tokens_of_each_request_alone(specs, batch_size):
    requests = [Request(i, prompt, params(n, temperature, seed=i)) for i, (prompt, n, temperature) in enumerate(specs)]
    done, log = run_static(MODEL, requests, batch_size)
    assert done == requests
    assert [r.output for r in requests] == [alone(r) for r in requests]
    steps = iter(log)
    for start in range(0, len(requests), batch_size):  # all arrive at 0: batches of consecutive requests
        batch = requests[start:start + batch_size]
        longest = max(r.params.max_new_tokens for r in batch)
        records = [next(steps) for _ in range(longest)]
        assert len({r.finish_time for r in batch}) == 1
        for s, rec in enumerate(records):
            kinds = ["prefill" if s == 0 else "decode" if s < r.params.max_new_tokens else "idle" for r in batch]
            assert [kind for _, _, kind in rec.batch] == kinds
            assert [i for i, _, _ in rec.batch] == [r.request_id for r in batch]
        following = next(iter(log[log.index(records[-1]) + 1:]), None)
        for r in batch:
            assert r.status == FINISHED and len(r.output) == r.params.max_new_tokens
            assert r.token_times == [rec.end for rec in records[:r.params.max_new_tokens]]
            assert records[-1].end <= r.finish_time <= (following.start if following else math.inf)
    assert next(steps, None) is None


def test_static_batching_waits_for_the_whole_batch_and_for_arrivals():
    short, long_ = Request("short", [1, 2, 3], params(2)), Request("long", [4, 5], params(7))
    later = Request("later", [9, 8, 7], params(3), arrival_time=0.05)
    done, log = run_static(MODEL, [short, long_, later], batch_size=4)
    assert short.finish_time == pytest.approx(long_.finish_time, abs=1e-3)  # the short one waits for the long one
    assert max(short.finish_time, long_.finish_time) < later.token_times[0]
    assert later.token_times[0] >= 0.05
    assert any(kind == "idle" for rec in log for _, _, kind in rec.batch)
    assert [r.output for r in done] == [alone(r) for r in done]


def test_static_batching_completes_a_batch_at_one_instant():
    batch = [Request(i, [1 + i, 2], params(1 + i)) for i in range(3)]
    run_static(MODEL, batch, batch_size=3)
    assert len({r.finish_time for r in batch}) == 1


def test_static_batching_serves_any_requests_that_fit_the_context():
    long_prompt = Request("long prompt", [7] * 100, params(2))  # 101 tokens
    long_output = Request("long output", [5], params(100))  # 100 tokens
    run_static(MODEL, [long_prompt, long_output], batch_size=2)
    assert long_prompt.output == alone(long_prompt)


# ---------------------------------------------------------------- the scheduler

def advance(plan) -> None:
    """What a step does after its forward pass (without a model): tokens computed, a token
    (0) for each request whose last token ran."""
    for r, n in plan.scheduled:
        done = r.num_computed + n == len(r.tokens)
        r.num_computed += n
        if done:
            r.output.append(0)


def scheduled(plan) -> list[tuple]:
    return [(r.request_id, n) for r, n in plan.scheduled]


def test_admission_is_first_come_first_served_up_to_max_num_seqs():
    scheduler = Scheduler(BlockAllocator(64, 4, prefix_caching=False), SchedulerConfig(max_num_seqs=2))
    a, b, c = (Request(x, [1, 2, 3], params(5)) for x in "abc")
    for r in (a, b, c):
        scheduler.add(r)
    plan = scheduler.schedule()
    assert scheduled(plan) == [("a", 3), ("b", 3)] and list(scheduler.waiting) == [c]
    assert scheduler.running == [a, b] and a.status == b.status == RUNNING and c.status == WAITING
    advance(plan)
    assert scheduled(scheduler.schedule()) == [("a", 1), ("b", 1)]  # c waits for a free seat


def test_chunked_prefill_splits_a_long_prompt_and_puts_decodes_first():
    scheduler = Scheduler(BlockAllocator(64, 4, prefix_caching=False),
                          SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8))
    long_ = Request("long", list(range(20)), params(5))
    short = Request("short", [1, 2, 3, 4, 5], params(5))
    scheduler.add(long_)
    scheduler.add(short)
    plans = []
    for _ in range(4):
        plans.append(scheduler.schedule())
        advance(plans[-1])
    assert [scheduled(p) for p in plans] == [
        [("long", 8)], [("long", 8)], [("long", 4), ("short", 4)],  # the prompt in chunks of the budget
        [("long", 1), ("short", 1)]]  # long decodes first, then short's last prompt token
    assert long_.output == [0, 0] and short.output == [0]
    newcomer = Request("new", list(range(30, 40)), params(2))
    scheduler.add(newcomer)
    plan = scheduler.schedule()
    assert scheduled(plan) == [("long", 1), ("short", 1), ("new", 6)]  # decodes, then the budget's rest


def test_without_chunked_prefill_a_prompt_larger_than_the_budget_left_waits():
    allocator = BlockAllocator(64, 4, prefix_caching=False)
    scheduler = Scheduler(allocator, SchedulerConfig(max_num_batched_tokens=8, chunked_prefill=False))
    first, second = Request("first", [1, 2, 3], params(3)), Request("second", list(range(8)), params(3))
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert scheduled(plan) == [("first", 3)]  # 5 tokens left, second needs 8: it waits, whole
    assert list(scheduler.waiting) == [second] and "second" not in allocator.tables and second.status == WAITING
    advance(plan)
    assert scheduled(scheduler.schedule()) == [("first", 1)]  # 7 left: still waiting
    allocator.check()


def test_a_prompt_refused_for_the_budget_leaves_the_prefix_cache_alone():
    allocator = BlockAllocator(4, 2)
    allocator.add_sequence("old", [1, 2, 3, 4, 5])
    allocator.mark_computed("old", [1, 2, 3, 4, 5])
    allocator.free("old")  # [1 2] and [3 4] stay cached
    scheduler = Scheduler(allocator, SchedulerConfig(max_num_batched_tokens=4, chunked_prefill=False))
    decoding = Request("decoding", [9], params(5))
    scheduler.add(decoding)
    advance(scheduler.schedule())
    allocator.mark_computed("decoding", [9])
    scheduler.add(Request("too long", [7, 7, 7, 7], params(1)))  # 4 tokens, 3 left in the budget: it waits
    before = (allocator.block_states(), dict(allocator.prefix.blocks))
    assert scheduled(scheduler.schedule()) == [("decoding", 1)]
    assert (allocator.block_states(), dict(allocator.prefix.blocks)) == before


def test_admit_respects_the_budget_the_cap_and_the_blocks():
    allocator = BlockAllocator(5, 2, prefix_caching=False)
    waiting = deque(Request(x, [1, 2, 3], params(2)) for x in "abcd")  # 2 blocks each
    running: list[Request] = []
    queues = {"waiting": waiting, "running": running, "allocator": allocator}
    assert [(r.request_id, n) for r, n in admit(**queues, budget=4, max_num_seqs=8)] == [("a", 3), ("b", 1)]
    assert [r.request_id for r in running] == ["a", "b"] and len(waiting) == 2
    assert admit(**queues, budget=10, max_num_seqs=8) == []  # c needs 2 blocks, 1 is free
    assert admit(**queues, budget=10, max_num_seqs=2) == [] and len(allocator.tables) == 2
    allocator.check()


def test_admission_keeps_headroom_for_the_running_requests_but_never_leaves_the_pool_idle():
    def queues(num_blocks: int) -> dict:  # requests of 2 blocks each
        waiting = deque(Request(x, [1] * 8, params(8)) for x in "abc")
        return {"waiting": waiting, "running": [], "allocator": BlockAllocator(num_blocks, 4, prefix_caching=False)}
    five, six = queues(5), queues(6)
    # five blocks: a alone is admitted; b would leave 5 - 4 = 1 free block for two running requests
    assert [r.request_id for r, _ in admit(**five, budget=64, max_num_seqs=8, headroom=1)] == ["a"]
    # six: b leaves 2 for two, 1 each; c would leave none for three
    assert [r.request_id for r, _ in admit(**six, budget=64, max_num_seqs=8, headroom=1)] == ["a", "b"]
    assert six["allocator"].num_free == 2 and [r.request_id for r in six["waiting"]] == ["c"]
    assert admit(**six, budget=64, max_num_seqs=8, headroom=0)[0][0].request_id == "c"  # fits without it
    lone = BlockAllocator(2, 4, prefix_caching=False)
    alone_in_the_pool = {"waiting": deque([Request("d", [1] * 8, params(1))]), "running": [], "allocator": lone}
    assert len(admit(**alone_in_the_pool, budget=64, max_num_seqs=8, headroom=5)) == 1  # takes every block


def test_headroom_counts_the_cached_blocks_a_prompt_revives_but_not_those_a_running_request_holds():
    system = list(range(100, 108))  # two full blocks of 4

    def pool(num_blocks: int, holder_runs: bool) -> tuple[BlockAllocator, list[Request]]:
        allocator = BlockAllocator(num_blocks, 4)
        holder = Request("holder", system + [1], params(4))
        allocator.add_sequence("holder", holder.prompt)
        allocator.mark_computed("holder", holder.prompt)  # system's two blocks are cached
        if holder_runs:
            return allocator, [holder]
        allocator.free("holder")  # cached, but free: a prompt that reuses them takes them back
        allocator.add_sequence("other", [9])
        return allocator, [Request("other", [9], params(4))]

    allocator, running = pool(5, holder_runs=False)  # 4 free; the new prompt takes 2 revived + 1: 1 left, 2 needed
    assert admit(deque([Request("x", system + [2], params(4))]), running, allocator, 64, 8, headroom=1) == []
    allocator, running = pool(6, holder_runs=True)  # 3 free; the new prompt takes 1 (the 2 are held): 2 left
    admitted = admit(deque([Request("y", system + [2], params(4))]), running, allocator, 64, 8, headroom=1)
    assert [(r.request_id, n) for r, n in admitted] == [("y", 1)]  # the 8 cached tokens are not run


def test_the_engine_preempts_less_with_headroom_and_each_output_is_unchanged():
    requests = [Request(i, [(5 * i + j) % VOCAB for j in range(6)], params(14)) for i in range(6)]
    preemptions = {}
    for headroom in (0, 1):
        copies = [Request(r.request_id, r.prompt, r.params) for r in requests]
        engine = Engine(MODEL, 12, 4, SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, headroom=headroom),
                        prefix_caching=False)
        run_engine(engine, copies)
        assert [r.output for r in copies] == [alone(r) for r in requests]
        replay(engine, copies, engine.scheduler.config, exact=True)
        preemptions[headroom] = sum(r.preemptions for r in copies)
    assert preemptions[1] < preemptions[0]


def test_preemption_takes_the_newest_running_request_and_requeues_it_first():
    allocator = BlockAllocator(4, 2, prefix_caching=False)
    scheduler = Scheduler(allocator, SchedulerConfig(headroom=0))  # admit while prompts fit
    a, b, c = Request("a", [1, 2], params(5)), Request("b", [3], params(5)), Request("c", [4], params(5))
    waiting_d = Request("d", [5], params(1))
    for r in (a, b, c, waiting_d):
        scheduler.add(r)
    plan = scheduler.schedule()  # a: 1 block, b: 1, c: 1, d: 1 (all four fit)
    assert scheduled(plan) == [("a", 2), ("b", 1), ("c", 1), ("d", 1)]
    advance(plan)
    scheduler.finish(waiting_d)
    late = Request("late", [6], params(1))
    scheduler.add(late)
    plan = scheduler.schedule()  # a takes d's freed block for its 3rd token; b's and c's 2nd fit; late waits
    advance(plan)
    assert plan.preempted == [] and scheduled(plan) == [("a", 1), ("b", 1), ("c", 1)]
    plan = scheduler.schedule()  # b's 3rd token needs a block, none is free: c, the newest, makes room
    assert plan.preempted == [c] and scheduled(plan) == [("a", 1), ("b", 1)]
    assert c.status == WAITING and c.num_computed == 0 and c.preemptions == 1 and c.output == [0, 0]
    assert list(scheduler.waiting) == [c, late] and scheduler.running == [a, b]
    assert "c" not in allocator.tables
    allocator.check()


def test_preempt_newest_frees_the_blocks_of_the_last_admitted():
    allocator = BlockAllocator(8, 2, prefix_caching=False)
    old, new = Request("old", [1, 2, 3], params(2)), Request("new", [4, 5, 6], params(2))
    waiting, running = deque([Request("queued", [7], params(1))]), [old, new]
    for r in running:
        allocator.add_sequence(r.request_id, r.prompt)
        r.num_computed, r.status = 3, RUNNING
    assert preempt_newest(waiting=waiting, running=running, allocator=allocator) is new
    assert running == [old] and waiting[0] is new and new.num_computed == 0 and new.status == WAITING
    assert allocator.num_free == 6 and list(allocator.tables) == ["old"]


def test_no_admission_in_a_step_that_preempted_even_when_the_victim_would_fit():
    """Two copies of one prompt start in the same step (so nothing is shared yet); the first one's
    decode needs a block and preempts the second, whose prompt is now cached in the first one's
    blocks: it would fit at once, but is readmitted only in the next step, from the cache."""
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    first, second = Request("first", prompt, params(4)), Request("second", prompt, params(4))
    engine = Engine(MODEL, 8, 2, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, headroom=0),
                    prefix_caching=True)
    run_engine(engine, [first, second])
    assert engine.log[0].batch == [("first", 8, "prefill"), ("second", 8, "prefill")]
    assert engine.log[1].preempted == ["second"] and engine.log[1].batch == [("first", 1, "decode")]
    assert ("second", 1, "decode") in engine.log[2].batch  # prompt from the cache, its own token recomputed
    assert second.cached_tokens == 8 and second.preemptions == 1
    assert first.output == second.output == alone(first)
    check_finished(engine, [first, second], [first, second])


def test_a_prompt_whose_prefix_was_computed_reuses_it():
    system = list(range(1, 21))  # 20 tokens: 5 blocks of 4
    first = Request("first", system + [30, 31], params(3))
    second = Request("second", system + [40, 41, 42], params(5))
    engine = Engine(MODEL, 32, 4, SchedulerConfig(max_num_seqs=1))  # second starts after first finished
    run_engine(engine, [first, second])
    assert (first.cached_tokens, second.cached_tokens) == (0, 20)
    assert second.output == alone(second) and first.output == alone(first)
    second_steps = [n for rec in engine.log for i, n, _ in rec.batch if i == "second"]
    assert second_steps[0] == 3 and sum(second_steps) == 3 + 4  # only the uncached prompt, then 4 decodes
    again = Request("again", system + [40, 41, 42], params(5))  # a later run still finds it
    run_engine(engine, [again])
    assert again.cached_tokens == 20 and again.output == second.output


def test_a_reset_prefix_cache_is_cold_again_and_is_refused_while_requests_are_served():
    """After a reset the same prompt finds nothing cached and is computed whole, to the same tokens; the blocks
    come back free. A reset while a request waits or runs is refused and changes nothing; an engine without prefix
    caching is always cold: its reset forgets nothing."""
    system = list(range(1, 21))  # 5 blocks of 4
    engine = Engine(MODEL, 32, 4, SchedulerConfig(max_num_seqs=1))
    first = Request("first", system + [30], params(3))
    run_engine(engine, [first])
    engine.add(busy := Request("busy", system + [31], params(2)))
    with pytest.raises(ValueError, match="0 requests run and 1 wait: the prefix cache can be reset once the engine"):
        engine.reset_prefix_cache()
    for _ in range(20):  # busy finishes, its prompt served from the cache
        if engine.scheduler.has_work:
            engine.step()
    assert busy.cached_tokens == 20
    assert engine.reset_prefix_cache() == 5  # the system prompt's blocks: no request wrote a sixth full one
    engine.allocator.check()
    assert engine.allocator.num_free == 32 and engine.reset_prefix_cache() == 0
    again = Request("again", system + [30], params(3))
    run_engine(engine, [again])
    assert again.cached_tokens == 0 and again.output == first.output
    plain = Engine(MODEL, 32, 4, SchedulerConfig(max_num_seqs=1), prefix_caching=False)
    assert plain.reset_prefix_cache() == 0


def test_without_prefix_caching_nothing_is_reused():
    system = list(range(1, 21))
    requests = [Request(i, system + [30 + i], params(2)) for i in range(2)]
    engine = Engine(MODEL, 32, 4, SchedulerConfig(max_num_seqs=1), prefix_caching=False)
    run_engine(engine, requests)
    assert [r.cached_tokens for r in requests] == [0, 0]
    assert [r.output for r in requests] == [alone(r) for r in requests]


def test_the_simulator_reuses_a_cached_prefix():  # its scheduler and allocator are the engine's own
    cost = CostModel(presets.model("Llama-3.1-8B"), presets.gpu("H100-SXM"))
    system = list(range(1, 201))
    requests = [Request(i, system + [i], params(3)) for i in range(2)]
    SimulatedEngine(cost, 100, 16, SchedulerConfig(max_num_seqs=1)).run(requests)
    assert requests[1].cached_tokens == 192


@pytest.mark.parametrize("chunked_prefill", [False, True])
def test_after_every_step_each_running_request_has_its_full_blocks_named(chunked_prefill):
    """What lets the engine name blocks only in a step that fills one: shared prefixes (cached at
    admission), chunked prefill and preemption in a pool too small for every request at once."""
    cost = CostModel(presets.model("Llama-3.1-8B"), presets.gpu("H100-SXM"))
    rng = random.Random(0)
    shared = [rng.randrange(1, 1000) for _ in range(40)]
    requests = [Request(i, shared[:rng.randrange(0, 40)] + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 30))],
                        params(rng.randrange(1, 40))) for i in range(24)]
    # unchunked, a budget that takes any request whole (prompt and output, recomputed after a preemption)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32 if chunked_prefill else 128,
                             chunked_prefill=chunked_prefill)
    engine = SimulatedEngine(cost, num_blocks=24, block_size=4, config=config)
    for request in requests:
        engine.add(request)
    steps = 0
    while engine.scheduler.has_work:
        engine.step()
        steps += 1
        for request in engine.scheduler.running:
            assert len(engine.allocator.names[request.request_id]) == request.num_computed // 4, request.request_id
    assert sum(r.preemptions for r in requests) and sum(r.cached_tokens for r in requests), "cases not met"
    assert steps == len(engine.log) and all(r.finish_time is not None for r in requests)


# ---------------------------------------------------------------- validation

def test_bad_requests_are_refused_by_name():
    with pytest.raises(ValueError, match="request 'a' has an empty prompt"):
        Request("a", [])
    with pytest.raises(ValueError, match="request 'a'.*got -1"):
        Request("a", [1, -1])
    with pytest.raises(ValueError, match="request 'a'.*got 2.0"):
        Request("a", [1, 2.0])
    with pytest.raises(ValueError, match="request 'a'.*not a tensor"):
        Request("a", torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="arrival_time=-1"):
        Request("a", [1], arrival_time=-1)
    with pytest.raises(ValueError, match="arrival_time=nan"):
        Request("a", [1], arrival_time=math.nan)


@pytest.mark.parametrize("request_, engine_args, message", [
    (Request("long", [1] * 120, params(10)), {}, "'long'.*max_seq_len=128"),
    (Request("oov", [1, VOCAB], params(1)), {}, "token 64 is outside the vocabulary of 64"),
    (Request("big", [1] * 9, params(1)), {"num_blocks": 2, "block_size": 4},
     "'big' needs 3 blocks.*only 2"),
    (Request("chunk", [1] * 10, params(3)),
     {"config": SchedulerConfig(max_num_batched_tokens=11, chunked_prefill=False)},
     "12 tokens.*max_num_batched_tokens=11"),
])
def test_the_engine_refuses_a_request_it_could_never_serve(request_, engine_args, message):
    fine = Request("fine", [1, 2], params(2))
    engine = Engine(MODEL, **{"num_blocks": 64, "block_size": 4, **engine_args})
    with pytest.raises(ValueError, match=message):
        engine.run([fine, request_])
    assert fine.output == [] and fine.status == WAITING  # nothing ran


def test_the_engine_refuses_an_end_token_outside_the_vocabulary_and_a_config_that_is_not_one():
    with pytest.raises(ValueError, match="eos_id='</s>' must be a token id in 0..63 or None"):
        Engine(MODEL, 16, 4, eos_id="</s>")
    with pytest.raises(TypeError, match="config must be a SchedulerConfig"):  # it would fail at the first step
        Engine(MODEL, 16, 4, {"max_num_seqs": 2})


def test_a_prompt_emptied_after_the_request_was_made_is_refused_before_it_jams_the_engine():
    emptied = Request("a", [1, 2], params(3))
    emptied.prompt = []
    engine = Engine(MODEL, 16, 4)
    with pytest.raises(ValueError, match="request 'a' has an empty prompt"):
        engine.run([emptied])
    assert engine.run([Request("b", [1, 2], params(2))])[0].output == alone(Request("b", [1, 2], params(2)))


def test_a_request_is_served_once_and_its_id_only_once_at_a_time():
    engine = Engine(MODEL, 16, 4)
    served = engine.run([Request("x", [1, 2], params(2))])
    for again in (lambda: engine.run(served), lambda: run_static(MODEL, served, 2)):
        with pytest.raises(ValueError, match="request 'x' has run before"):
            again()
    assert served[0].output == alone(served[0])  # and its output is as it was
    added = Request("y", [3], params(3))
    engine.add(added)
    assert 0 < added.arrival_time <= engine.now()  # it arrived when it was added: its TTFT counts from then
    with pytest.raises(ValueError, match="request 'later' arrives at 50.0 s"):
        engine.add(Request("later", [1], params(1), arrival_time=50.0))
    with pytest.raises(ValueError, match="id 'y' is already queued"):
        engine.add(Request("y", [4], params(1)))
    with pytest.raises(ValueError, match="token 64 is outside the vocabulary"):
        engine.add(Request("oov", [VOCAB], params(1)))
    while engine.scheduler.has_work:
        engine.step()
    with pytest.raises(RuntimeError, match="nothing to run: no request"):
        engine.step()
    engine.add(Request("y", [4], params(1)))  # its id is free again
    with pytest.raises(RuntimeError, match="still serves 1 requests"):
        engine.run([Request("z", [5], params(1))])  # its clock would restart under y


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, RuntimeError])
def test_a_step_interrupted_after_the_forward_pass_runs_again(monkeypatch, interruption):
    """Ctrl-C (or an error) while sampling, after the forward pass wrote the step's keys and values
    and a seeded request drew its token: nothing was recorded, so the step runs again, and every
    request gets its own output (the seeded draw is the same the second time)."""
    import labkit.engine
    real, calls = labkit.engine.sample, [0]

    def interrupted_once(logits, requests):
        calls[0] += 1
        tokens = real(logits, requests)  # the seeded request's draw is made
        if calls[0] == 2:  # the step in which the first request's first block fills: it was named
            raise interruption("now")
        return tokens
    monkeypatch.setattr(labkit.engine, "sample", interrupted_once)
    engine = Engine(MODEL, 64, 4)
    requests = [Request(i, [i + 1] * (3 + i), params(4)) for i in range(3)]
    requests.append(Request("seeded", [5, 6, 7], params(4, temperature=1.0, seed=3)))
    with pytest.raises(interruption):
        engine.run(requests)
    engine.allocator.check()  # consistent at once, not only once the requests are done
    while engine.scheduler.has_work:
        engine.step()
    assert [r.output for r in requests] == [alone(r) for r in requests]
    engine.allocator.check()


def test_a_request_that_exactly_fits_runs():
    request = Request("edge", [1] * 120, params(9))  # 128 tokens: max_seq_len
    engine = Engine(MODEL, num_blocks=32, block_size=4)  # exactly 32 blocks of 4 for 128 tokens
    engine.run([request])
    assert request.output == alone(request)


def test_other_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="two requests have the id .x."):
        Engine(MODEL, 16, 4).run([Request("x", [1], params(1)), Request("x", [2], params(1))])
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens=0"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="headroom=-1 must be at least 0"):
        SchedulerConfig(headroom=-1)
    with pytest.raises(ValueError, match=r"uniform\(5, 2\): need 1 <= low <= high"):
        uniform(5, 2)
    with pytest.raises(ValueError, match=r"uniform\(0, 2\)"):
        uniform(0, 2)
    with pytest.raises(ValueError, match=r"lognormal\(0, 1, 1, 5\)"):
        lognormal(0, 1, 1, 5)
    with pytest.raises(ValueError, match=r"lognormal\(10, -1, 1, 5\)"):
        lognormal(10, -1, 1, 5)
    for n, vocab, rate in [(0, 10, None), (3, 10, 0.0), (3, 10, -2.0), (3, 0, None)]:
        with pytest.raises(ValueError, match=f"n={n} and vocab_size={vocab} .*rate={rate}"):
            make_workload(n, uniform(1, 2), uniform(1, 2), rate=rate, vocab_size=vocab)
    for bad, call in [("low=1.5", lambda: uniform(1.5, 3)), ("n=2.0", lambda: make_workload(2.0, uniform(1, 2),
                                                                                          uniform(1, 2))),
                      ("low=1.5", lambda: lognormal(10, 1, 1.5, 5))]:
        with pytest.raises(ValueError, match=f"{bad} must be an int"):
            call()
    for field, value in [("max_num_seqs", True), ("max_num_batched_tokens", 4.5), ("headroom", 0.5)]:
        with pytest.raises(ValueError, match=f"{field}={value} must be an int"):
            SchedulerConfig(**{field: value})
    with pytest.raises(ValueError, match="chunked_prefill=1 must be True or False"):
        SchedulerConfig(chunked_prefill=1)
    with pytest.raises(ValueError, match="request 'a': params .*got 5"):
        Request("a", [1], 5)
    twice = Request("t", [1], params(1))
    for system in (lambda r: run_static(MODEL, r, 2), lambda r: Engine(MODEL, 8, 4).run(r)):
        with pytest.raises(ValueError, match="two requests have the id 't'"):
            system([twice, twice])
        assert twice.status == WAITING and not twice.output
    with pytest.raises(ValueError, match="batch_size=0 must be at least 1"):
        run_static(MODEL, [Request("x", [1], params(1))], 0)
    with pytest.raises(ValueError, match="'y'.*max_seq_len=128"):
        run_static(MODEL, [Request("y", [1] * 100, params(30))], 1)
    unfinished = Request("u", [1], params(1))
    with pytest.raises(ValueError, match="requests have all finished"):
        summarize([unfinished])
    with pytest.raises(ValueError, match="requests have all finished"):
        summarize([])
    with pytest.raises(ValueError, match="no output tokens"):
        request_metrics(0.0, [])


# ---------------------------------------------------------------- metrics

def test_request_metrics_by_hand():
    m = request_metrics(1.0, [1.5, 1.75, 2.25], finish=2.5)
    assert m["ttft"] == pytest.approx(0.5) and m["e2e"] == pytest.approx(1.5)
    assert m["tpot"] == pytest.approx((1.5 - 0.5) / 2) and m["itl"] == pytest.approx([0.25, 0.5])
    m = request_metrics(1.0, [1.5, 1.75, 2.25])  # completes with its last token
    assert m["e2e"] == pytest.approx(1.25) and m["tpot"] == pytest.approx(0.375)
    m = request_metrics(2.0, [2.5])
    assert m == {"ttft": 0.5, "tpot": None, "itl": [], "e2e": 0.5}


def finished(request_id, arrival: float, times: list[float], finish: float, prompt_len: int = 3) -> Request:
    r = Request(request_id, [1] * prompt_len, params(len(times)), arrival_time=arrival)
    r.output, r.token_times, r.finish_time, r.status = [0] * len(times), list(times), finish, FINISHED
    return r


def p99(values: list[float]) -> float:
    """Linear interpolation between the closest ranks, as numpy.percentile does by default."""
    xs = sorted(values)
    h = (len(xs) - 1) * 0.99
    lo = math.floor(h)
    return xs[lo] + (h - lo) * (xs[min(lo + 1, len(xs) - 1)] - xs[lo])


def test_summarize_by_hand():
    requests = [finished("a", 0.0, [1.0, 2.0], 2.0, prompt_len=3),
                finished("b", 1.0, [1.5, 2.0, 3.0], 3.5, prompt_len=5),
                finished("c", 2.0, [4.0, 4.25, 5.0], 5.0, prompt_len=7)]
    expected = {"ttft": [1.0, 0.5, 2.0], "tpot": [1.0, 1.0, 0.5], "itl": [1.0, 0.5, 1.0, 0.25, 0.75],
                "e2e": [2.0, 2.5, 3.0]}  # odd counts: every median is a middle value
    figures = summarize(requests)
    assert figures["requests"] == 3 and figures["duration_s"] == 5.0
    assert figures["request_throughput"] == pytest.approx(3 / 5)
    assert figures["output_throughput"] == pytest.approx(8 / 5)
    assert figures["total_token_throughput"] == pytest.approx((8 + 15) / 5)
    for name, seconds in expected.items():
        ms = [1000 * v for v in seconds]
        assert figures[f"mean_{name}_ms"] == pytest.approx(statistics.fmean(ms))
        assert figures[f"median_{name}_ms"] == pytest.approx(statistics.median(ms))
        assert figures[f"p99_{name}_ms"] == pytest.approx(p99(ms))
    assert figures["p99_e2e_ms"] == pytest.approx(2990)  # rank 1.98 of [2, 2.5, 3] s: 2.5 + 0.98 x 0.5


def test_summarize_a_run_of_one_token_outputs_has_no_tpot():
    figures = summarize([finished("a", 0.0, [1.0], 1.0), finished("b", 0.5, [2.0], 2.0)])
    assert math.isnan(figures["mean_tpot_ms"]) and math.isnan(figures["p99_itl_ms"])
    assert figures["mean_ttft_ms"] == pytest.approx(1250) and figures["p99_ttft_ms"] == pytest.approx(p99([1000, 1500]))


def test_summarize_median_of_an_even_count_averages_the_middle_two():
    figures = summarize([finished("a", 0.0, [1.0], 1.0), finished("b", 0.0, [2.0], 2.0)])
    assert figures["median_ttft_ms"] == pytest.approx(statistics.median([1000.0, 2000.0]))  # 1500, not 1000


# ---------------------------------------------------------------- workloads

def test_make_workload_is_seeded_and_offline_arrives_at_once():
    def make(seed):
        return make_workload(20, uniform(3, 9), lognormal(6, 0.8, 2, 12), vocab_size=50, temperature=0.5, seed=seed)

    one, two, other = make(3), make(3), make(4)
    key = lambda w: [(r.request_id, r.prompt, r.params, r.arrival_time) for r in w]  # noqa: E731
    assert key(one) == key(two) and key(one) != key(other)
    assert all(r.arrival_time == 0 for r in one)
    for i, r in enumerate(one):
        assert r.request_id == f"req{i}" and 3 <= len(r.prompt) <= 9 and 2 <= r.params.max_new_tokens <= 12
        assert all(0 <= t < 50 for t in r.prompt)
        assert (r.params.temperature, r.params.seed, r.params.stop_at_eos) == (0.5, 3 + i, False)


def test_make_workload_gives_the_same_prompts_offline_and_online():
    offline, online = (make_workload(10, uniform(3, 9), uniform(1, 5), rate=rate, seed=2) for rate in (None, 4.0))
    assert [(r.prompt, r.params) for r in offline] == [(r.prompt, r.params) for r in online]
    assert len({r.arrival_time for r in online}) == 10



def test_make_workload_meets_the_same_traffic_whatever_the_lengths_and_exactly_its_rate_if_asked():
    short, long = (make_workload(30, uniform(low, low + 8), uniform(1, 5), rate=4.0, seed=5) for low in (3, 700))
    assert [r.arrival_time for r in short] == [r.arrival_time for r in long]  # the lengths do not move the arrivals
    exact = make_workload(30, uniform(3, 9), uniform(1, 5), rate=4.0, seed=5, exact=True)
    assert exact[-1].arrival_time == pytest.approx(29 / 4.0)  # the last at (n - 1) / rate
    assert short[-1].arrival_time != pytest.approx(29 / 4.0)


def _ranks(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).argsort().argsort().double()


def test_a_workloads_arrivals_are_unrelated_to_its_lengths():
    """Drawn from the lengths' own numbers (the same seed, or one 2^32 away: torch reads a seed's low 32 bits), long
    prompts came after long gaps: a rank correlation of -0.38 between a prompt's length and the gap before it."""
    for seed in (0, 1, 2):
        requests = make_workload(2000, lognormal(512, 0.8, 16, 4096), uniform(1, 4), rate=4.0, seed=seed)
        gaps = [b.arrival_time - a.arrival_time for a, b in zip(requests, requests[1:])]
        lengths, waits = _ranks([len(r.prompt) for r in requests[1:]]), _ranks(gaps)
        assert abs(torch.corrcoef(torch.stack([lengths, waits]))[0, 1]) < 0.1, f"seed {seed}"

def test_make_workload_online_arrivals_are_poisson():
    rate, n = 50.0, 2000
    requests = make_workload(n, uniform(4, 8), uniform(1, 3), rate=rate, prefix=[60, 61, 62], vocab_size=40,
                             seed=7, id_prefix="q")
    arrivals = [r.arrival_time for r in requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and len(set(arrivals)) == n
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.15)  # exponential: sd = mean
    assert {len(r.prompt) - 3 for r in requests} == {4, 5, 6, 7, 8}
    assert {r.params.max_new_tokens for r in requests} == {1, 2, 3}
    assert all(r.prompt[:3] == [60, 61, 62] and max(r.prompt[3:]) < 40 for r in requests)
    assert requests[5].request_id == "q5"


def test_lognormal_lengths_are_clipped_around_the_median():
    draw = lognormal(20, 1.0, 5, 60)
    lengths = draw(4000, torch.Generator().manual_seed(0))
    assert min(lengths) == 5 and max(lengths) == 60
    assert statistics.median(lengths) == pytest.approx(20, abs=2)
    assert lognormal(20, 0.0, 1, 100)(5, torch.Generator()) == [20] * 5


def test_a_workload_context_too_short_for_a_request_is_named():
    from labkit.workload import workload_lengths

    with pytest.raises(ValueError, match="context=1 must be at least 2"):  # the message named lognormal's bounds
        workload_lengths(5, context=1)


# ---------------------------------------------------------------- the ragged paged cache

@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10), st.integers(1, 6)), min_size=1, max_size=5),
       st.sampled_from([1, 2, 4, 16]), st.integers(0, 2**16))
def test_a_ragged_row_gives_each_sequence_the_logits_it_gets_alone(shape, block_size, seed):
    """Sequences with h tokens already cached and q new ones each (decodes when q = 1, chunks or
    whole prompts otherwise) run in one row: each one's logits equal a full forward of it alone."""
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(VOCAB, (h + q,), generator=generator).tolist() for h, q in shape]
    cache = PagedKVCache(MODEL.config, BlockAllocator(96, block_size, prefix_caching=False), torch.float64)
    for i, ((h, _), tokens) in enumerate(zip(shape, sequences)):
        if h:
            cache.allocator.add_sequence(i, tokens[:h])
            step_logits(MODEL, cache, [(i, 0, h)], tokens[:h])
    for i, ((h, _), tokens) in enumerate(zip(shape, sequences)):
        if h:
            cache.append(i, len(tokens) - h)
        else:
            cache.allocator.add_sequence(i, tokens)
    row = [t for (h, _), tokens in zip(shape, sequences) for t in tokens[h:]]
    plan = cache.plan([(i, h, q) for i, (h, q) in enumerate(shape)])
    with torch.no_grad():
        logits = MODEL(torch.tensor([row]), plan=plan)[0]
        expected = torch.cat([MODEL(torch.tensor([tokens]))[0, h:] for (h, _), tokens in zip(shape, sequences)])
    torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)
    assert plan.last.tolist() == [sum(q for _, q in shape[:i + 1]) - 1 for i in range(len(shape))]
    cache.allocator.check()


def test_bad_runs_are_refused_before_the_forward_pass():
    cache = PagedKVCache(MODEL.config, BlockAllocator(16, 4), torch.float64)
    cache.allocator.add_sequence("a", [1, 2, 3])
    cache.allocator.add_sequence("b", [4, 5])
    for runs, key in [([("a", 0, 3), ("b", 0, 3)], "'b': positions 0..2"),  # past b's slots
                      ([("a", 0, 3), ("b", 0, 0)], "'b': positions 0..-1")]:  # a run without tokens
        with pytest.raises(ValueError, match=key):
            cache.plan(runs)
    with pytest.raises(TypeError, match="not positions"):  # as a contiguous cache's plan takes
        cache.plan(torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="at least one sequence"):
        cache.plan([])
    with pytest.raises(KeyError, match="no sequence 'c'"):
        cache.plan([("c", 0, 1)])
    plan = cache.plan([("a", 0, 3), ("b", 0, 2)])
    with pytest.raises(ValueError, match="positions .1, 5. must match tokens .1, 4."):  # the plan is for 5 tokens
        MODEL(torch.tensor([[1, 2, 3, 4]]), plan=plan)
    with pytest.raises(ValueError, match="a plan carries its positions"):
        MODEL(torch.tensor([[1, 2, 3, 4, 5]]), plan.positions, plan)
    with pytest.raises(TypeError, match="not a PagedKVCache"):
        MODEL(torch.tensor([[1, 2, 3, 4, 5]]), None, cache)
    from dataclasses import replace
    shallow = PagedKVCache(replace(MODEL.config, n_layers=1), BlockAllocator(16, 4), torch.float64)
    shallow.allocator.add_sequence("a", [1, 2])
    with pytest.raises(ValueError, match=r"made for a model of \(layers, KV heads, head dim\) = \(1, "):
        step_logits(MODEL, shallow, [("a", 0, 2)], [1, 2])  # the model checks every cache's layout


def test_a_step_may_run_more_tokens_than_the_context_but_no_position_past_it():
    """The context limit is per sequence: a step's row of many requests' tokens may be longer."""
    requests = [Request(i, [(5 * i + j) % VOCAB for j in range(100)], params(4)) for i in range(3)]
    engine = Engine(MODEL, 128, 4, SchedulerConfig(max_num_batched_tokens=512))
    run_engine(engine, requests)
    assert max(sum(n for _, n, _ in record.batch) for record in engine.log) == 300 > MODEL.config.max_seq_len
    assert [r.output for r in requests] == [alone(r) for r in requests]
    cache = PagedKVCache(MODEL.config, BlockAllocator(40, 4), torch.float64)
    cache.allocator.add_sequence("long", [1] * 129)  # slots past the context: the plan refuses them
    with pytest.raises(ValueError, match="'long': position 128 is past the context limit max_seq_len=128"):
        cache.plan([("long", 0, 129)])


# ---------------------------------------------------------------- the simulator

TOY = ModelShape("toy", 1e9, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_context=4096)
TOY_GPU = Hardware("toy GPU", memory_bytes=10e9, bandwidth=1e12, peak_flops=1e14, dtype="bf16")


def test_step_time_by_hand():
    cost = CostModel(TOY, TOY_GPU)  # KV: 2 layers x 2 (K, V) x 2 heads x 8 dims x 2 bytes = 128 bytes a token
    decode = [(1, 100), (1, 50)]  # two decodes after 100 and 50 cached tokens
    flops = 2 * 1e9 * 2 + 4 * 2 * 4 * 8 * (101 + 51)
    nbytes = 2e9 + 128 * (101 + 51)
    assert cost.flops(decode) == pytest.approx(flops) and cost.bytes(decode) == pytest.approx(nbytes)
    assert cost.flops(decode) - 4e9 == 256 * 152 and cost.bytes(decode) - 2e9 == 128 * 152  # the small terms exactly
    assert cost.step_time(decode) == pytest.approx(nbytes / 1e12)  # bandwidth-bound: 2 ms
    prefill = [(1000, 0)]  # keys attended: 1 + 2 + ... + 1000
    flops = 2 * 1e9 * 1000 + 4 * 2 * 4 * 8 * 500500
    assert cost.step_time(prefill) == pytest.approx(flops / 1e14)  # compute-bound: 20 ms
    chunk = [(3, 10)]  # keys attended: 11 + 12 + 13
    assert cost.flops(chunk) - 6e9 == 4 * 2 * 4 * 8 * 36
    assert cost.bytes(chunk) - 2e9 == 128 * 13  # the 10 cached tokens read, the 3 new ones written
    two = CostModel(TOY, TOY_GPU, n_gpus=2, step_overhead_s=0.001)
    assert two.step_time(decode) == pytest.approx(nbytes / 2e12 + 0.001)


def test_kv_blocks_fill_the_memory_the_weights_leave():
    cost = CostModel(TOY, TOY_GPU)  # 0.9 x 10 GB - 2 GB of weights = 7 GB of 128-byte tokens
    assert cost.kv_blocks(16) == math.floor(7e9 / (128 * 16))
    with pytest.raises(ValueError, match="Llama-3.1-70B's weights do not fit .*L4"):
        CostModel(presets.model("Llama-3.1-70B"), presets.gpu("L4")).kv_blocks()
    assert CostModel(presets.model("Llama-3.1-70B"), presets.gpu("H100-SXM"), n_gpus=2).kv_blocks() > 0
    with pytest.raises(ValueError, match="n_gpus=0"):
        CostModel(TOY, TOY_GPU, n_gpus=0)
    with pytest.raises(ValueError, match=r"utilization=90 must be in \(0, 1\]"):
        cost.kv_blocks(16, utilization=90)


def test_simulated_steps_take_the_cost_models_time():
    cost = CostModel(presets.model("Llama-3.1-8B"), presets.gpu("H100-SXM"), step_overhead_s=1e-4)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, headroom=0)
    requests = make_workload(30, uniform(20, 300), uniform(1, 40), rate=20.0, seed=3)
    engine = SimulatedEngine(cost, num_blocks=34, block_size=16, config=config, prefix_caching=False)
    done = run_engine(engine, requests)
    assert sum(r.preemptions for r in requests) > 0  # 34 blocks: some preemption too (3 on these arrivals)
    check_finished(engine, requests, done)
    replay(engine, requests, config, exact=True)
    computed: dict = {}  # the cached tokens before each step, from the log
    busy = idle = 0.0
    previous = 0.0
    for rec in engine.log:
        for v in rec.preempted:
            computed[v] = 0
        batch = [(n, computed.get(i, 0)) for i, n, _ in rec.batch]
        assert rec.end - rec.start == pytest.approx(cost.step_time(batch), rel=1e-12)
        for i, n, _ in rec.batch:
            computed[i] = computed.get(i, 0) + n
        if rec.start > previous:  # it waited, idle, for the next arrival
            assert rec.start in {r.arrival_time for r in requests}
        busy, idle, previous = busy + rec.end - rec.start, idle + rec.start - previous, rec.end
    assert engine.now() == pytest.approx(busy + idle) and engine.now() == max(r.finish_time for r in requests)
    assert idle > 0 and summarize(done)["duration_s"] == engine.now()


def test_a_higher_arrival_rate_does_not_lower_throughput():
    cost = CostModel(presets.model("Llama-3.1-8B"), presets.gpu("H100-SXM"), step_overhead_s=1e-4)

    def throughput(rate):
        requests = make_workload(40, uniform(50, 200), uniform(10, 60), rate=rate, seed=3)
        engine = SimulatedEngine(cost, num_blocks=400, block_size=16, config=SchedulerConfig(max_num_seqs=16))
        return summarize(engine.run(requests))["output_throughput"]

    rates = [throughput(rate) for rate in (1.0, 10.0, 100.0, None)]
    assert rates == sorted(rates) and rates[-1] > 2 * rates[0]


def test_the_timeline_legend_lists_only_what_the_run_shows():
    log = [StepRecord(0.0, 0.1, [("a", 4, "prefill"), ("b", 3, "prefill")]),
           StepRecord(0.1, 0.2, [("a", 1, "decode"), ("b", 1, "decode")])]

    def legend(steps):
        fig = plot_batch_timeline(steps)
        return [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert legend(log) == ["decode", "prefill"]
    assert legend(log + [StepRecord(0.2, 0.3, [("a", 1, "decode")], preempted=["b"])]) == ["preempted", "decode",
                                                                                            "prefill"]
