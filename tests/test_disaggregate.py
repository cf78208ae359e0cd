"""Disaggregated prefill and decode: two gloo ranks serve a random workload with the outputs of the
colocated engine in one process, no request lost, each shipping its prompt's KV bytes as the memory
formula counts them; the engine's adopt path in one process continues a request prefilled elsewhere
exactly (prefix hits and preemption included); bad input is refused before any process starts."""
from __future__ import annotations

import copy

import pytest
import torch

from labkit.engine import FINISHED, Engine, Request, SchedulerConfig
from labkit.generate import SamplingParams
from labkit.load import load, save_checkpoint
from labkit.memory import kv_cache_bytes, shape_of
from labkit.parallel import disaggregate
from labkit.parallel.disaggregate import mixed_workload, prefill, run_colocated, run_disaggregated
from labkit.workload import make_workload, uniform

from tiny_models import far_apart_model, one_torch_thread

VOCAB, BLOCK = 4096, 8  # the lab tokenizer's vocabulary, so that labkit.load takes the folder
CONFIG = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, chunked_prefill=False, headroom=0)

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """The tiny model, saved in float32, for the ranks to load."""
    path = tmp_path_factory.mktemp("tiny")
    save_checkpoint(far_apart_model(VOCAB), path, dtype=torch.float32)
    return str(path)


def workload() -> list[Request]:
    """Twelve requests arriving over ~0.1 s, prompts of 1..40 tokens, outputs of 1..10."""
    return make_workload(12, uniform(1, 40), uniform(1, 10), rate=100.0, vocab_size=VOCAB, seed=3)


def colocated(folder: str, requests: list[Request], num_blocks: int, config: SchedulerConfig = CONFIG) -> list[Request]:
    """The reference: the colocated engine, in this process."""
    model = load(folder, "cpu", torch.float32)[0]
    return Engine(model, num_blocks, BLOCK, config).run(copy.deepcopy(requests))


def test_disaggregated_outputs_equal_colocated_and_kv_bytes_equal_the_formula(folder):
    requests, num_blocks = workload(), 12  # 96 slots: requests wait for room, and may be preempted
    assert {r.params.max_new_tokens == 1 for r in requests} == {True, False}  # some finish at their first token
    reference = colocated(folder, requests, num_blocks)
    run = run_disaggregated(folder, requests, num_blocks, BLOCK, CONFIG)
    assert all(r.status == "waiting" and not r.output for r in requests)  # the caller's are not served
    assert [r.request_id for r in run.requests] == [r.request_id for r in requests]  # none lost, none added
    assert [r.output for r in run.requests] == [r.output for r in reference]
    model = load(folder, "cpu", torch.float32)[0]
    shape = shape_of("tiny", model.config, model.num_parameters())
    for r in run.requests:
        assert r.status == FINISHED and len(r.output) == r.params.max_new_tokens == len(r.token_times)
        assert r.arrival_time <= r.token_times[0] and r.token_times == sorted(r.token_times)
        assert r.finish_time == r.token_times[-1]
        if r.params.max_new_tokens > 1:
            assert run.kv_bytes[r.request_id] == kv_cache_bytes(shape, len(r.prompt), dtype="fp32")
        else:
            assert r.request_id not in run.kv_bytes
    by_arrival = sorted(requests, key=lambda r: r.arrival_time)
    assert [s.batch[0][0] for s in run.logs["prefill"]] == [r.request_id for r in by_arrival]
    preempted = {r.request_id for r in run.requests if r.preemptions}  # often some: the pool is tight
    for step in run.logs["decode"]:  # the decode rank runs no prompt, only a preempted request's recomputation
        assert {rid for rid, _, kind in step.batch if kind == "prefill"} <= preempted
    assert run.summary()["requests"] == len(requests) and set(run.busy_s()) == {"prefill", "decode"}


def test_run_colocated_serves_as_the_engine_does_in_this_process(folder):
    requests = workload()
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16)
    run = run_colocated(folder, requests, 32, chunked_prefill=True, block_size=BLOCK, config=config)
    assert [r.output for r in run.requests] == [r.output for r in colocated(folder, requests, 32, config)]
    assert all(r.status == FINISHED for r in run.requests)
    by_arrival = [r.request_id for r in sorted(requests, key=lambda r: r.arrival_time)]
    for i, name in enumerate(["colocated 0", "colocated 1"]):  # every other request to arrive, on each engine
        steps = run.logs[name]
        assert sorted({rid for s in steps for rid, _, _ in s.batch}) == sorted(by_arrival[i::2])
    assert any(n < len(r.prompt) for name in run.logs for s in run.logs[name] for rid, n, kind in s.batch
               for r in run.requests if r.request_id == rid and kind == "prefill")  # chunked indeed


def test_adopt_continues_a_request_prefilled_elsewhere_exactly(folder):
    model = load(folder, "cpu", torch.float32)[0]
    prefix = list(range(3, 3 + 2 * BLOCK))  # two whole blocks that later prompts find in the prefix cache
    requests = [Request(f"r{i}", prefix + [(7 * i + k) % 64 for k in range(5 + 3 * i)],
                        SamplingParams(max_new_tokens=12 + i, stop_at_eos=False)) for i in range(5)]
    reference = Engine(model, 14, BLOCK, CONFIG).run(copy.deepcopy(requests))
    engine = Engine(model, 14, BLOCK, CONFIG)  # 112 slots for up to 5 x 46 tokens: preemptions
    for r in requests:
        token, kv = prefill(model, r)
        r.output, r.token_times = [token], [engine.now()]
        while not engine.adopt(r, kv):
            engine.step()
        computed = engine.allocator.slot_mapping(r.request_id, range(len(r.prompt)))
        # the tokens the prefix cache held keep an earlier prompt's keys and values: the same tokens, but a prompt
        # of another length, which a CPU's matmul may round differently; the others are what was shipped, exactly
        held = r.cached_tokens
        for cache, shipped in zip((engine.cache.k, engine.cache.v), kv):
            stored = cache.flatten(1, 2)[:, computed]
            assert torch.equal(stored[:, held:], shipped[:, held:])
            torch.testing.assert_close(stored[:, :held], shipped[:, :held], rtol=1e-5, atol=1e-6)
    while engine.scheduler.has_work:
        engine.step()
    assert [r.output for r in requests] == [r.output for r in reference]
    assert any(r.cached_tokens for r in requests) and any(r.preemptions for r in requests)
    engine.allocator.check()


def test_adopt_refuses_what_was_not_prefilled_elsewhere(folder):
    model = load(folder, "cpu", torch.float32)[0]
    engine = Engine(model, 8, BLOCK, CONFIG)
    request = Request("a", [1, 2, 3], SamplingParams(max_new_tokens=4, stop_at_eos=False))
    _, kv = prefill(model, request)
    with pytest.raises(ValueError, match="not one prefilled elsewhere"):
        engine.adopt(request, kv)  # no first token
    request.output = [5]
    with pytest.raises(ValueError, match=r"expected \(2, 2, 3, 2, 8\)"):
        engine.adopt(request, kv[:, :, :2])
    assert engine.adopt(request, kv) and request.status == "running" and request.num_computed == 3
    with pytest.raises(ValueError, match="not one prefilled elsewhere"):
        engine.adopt(request, kv)  # running already
    done = Request("b", [1], SamplingParams(max_new_tokens=1, stop_at_eos=False), output=[2])
    with pytest.raises(ValueError, match="nothing left to decode"):
        engine.adopt(done, prefill(model, done)[1])
    engine.allocator.check()


def test_bad_input_is_refused_by_name_before_any_process_starts(folder, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started for bad input")
    monkeypatch.setattr(disaggregate, "launch", no_launch)
    ok = workload()[:2]
    too_long = Request("long", [1] * 120, SamplingParams(max_new_tokens=20, stop_at_eos=False))
    cases = [([], 12, "requests is empty"), (ok + [copy.deepcopy(ok[0])], 12, "two requests have the id 'req0'"),
             ([too_long], 32, "'long': 120 prompt tokens"), (ok, 2, "'req0' needs 4 blocks")]
    for requests, num_blocks, message in cases:
        with pytest.raises(ValueError, match=message):
            run_disaggregated(folder, requests, num_blocks, BLOCK, CONFIG)
    with pytest.raises(ValueError, match="instances=0 must be at least 1"):
        run_colocated(folder, ok, 12, chunked_prefill=True, block_size=BLOCK, instances=0)
    with pytest.raises(ValueError, match="'req0'.*max_num_batched_tokens=4"):
        run_colocated(folder, ok, 12, chunked_prefill=False, block_size=BLOCK,
                      config=SchedulerConfig(max_num_batched_tokens=4))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run_disaggregated(str(folder) + "-missing", ok, 12, BLOCK, CONFIG)


def test_mixed_workload_lands_long_prompts_while_short_requests_decode():
    requests = mixed_workload(n_short=8, n_long=2, rate=10.0, vocab_size=VOCAB, seed=1)
    assert [r.request_id for r in requests] == [r.request_id for r in mixed_workload(8, 2, 10.0, vocab_size=VOCAB,
                                                                                      seed=1)]
    shorts = [r for r in requests if r.request_id.startswith("short")]
    longs = [r for r in requests if r.request_id.startswith("long")]
    assert len(shorts) == 8 and len(longs) == 2
    assert [r.arrival_time for r in requests] == sorted(r.arrival_time for r in requests)
    first, last = shorts[0].arrival_time, shorts[-1].arrival_time
    assert all(first < r.arrival_time < last and 256 <= len(r.prompt) <= 512 for r in longs)
    assert all(16 <= len(r.prompt) <= 64 and 32 <= r.params.max_new_tokens <= 64 for r in shorts)
