"""The async engine in-process, no HTTP: a tiny float64 model behind an ``AsyncEngine``. Each
request's tokens arrive on its own stream, in order, as the offline engine makes them; an abort
while the request waits, prefills or decodes ends its stream with "abort" and frees its blocks;
the event loop stays responsive while the engine computes; a full queue raises ``QueueFull``, a
stopped engine ``EngineStopped``; a step that raises fails the live streams, and the engine serves
the next request. Where a test needs the engine at a given point, a ``Gate`` around the runner
lets the engine thread through one step at a time. The engine in a process of its own
(``EngineSpec``) streams the same tokens, aborts and frees blocks the same way, fails its streams
when its process dies, and a build that fails says why."""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import statistics
import threading
import time
from typing import AsyncIterator

import pytest
import torch

from labkit.async_engine import (AsyncEngine, EngineSpec, EngineStats, EngineStopped, QueueFull, RequestStream,
                                 TokenEvent)
from labkit.engine import ABORTED, WAITING, Engine, Request, SchedulerConfig
from labkit.generate import SamplingParams, stream
from labkit.model import ModelConfig, Transformer

from tiny_models import far_apart_model, one_torch_thread

VOCAB = 64
LIMIT_S = 10.0  # every wait of a test: a broken engine fails it instead of hanging it


MODEL = far_apart_model(VOCAB)


one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


def make_engine(model: Transformer = MODEL, num_blocks: int = 64, block_size: int = 4, eos_id: int | None = None,
                **config: int) -> Engine:
    return Engine(model, num_blocks, block_size, SchedulerConfig(**config), eos_id=eos_id)


def engine_in_process(eos_id: int | None, config: dict, step_delay_s: float = 0.0) -> Engine:
    """The tests' engine as an engine process builds it (``EngineSpec`` imports this module by name);
    ``step_delay_s``: each step takes that much longer, so that a test has time to act mid-request."""
    torch.set_num_threads(1)
    engine = make_engine(eos_id=eos_id, **config)
    execute = engine.runner.execute

    def slowed(batch):  # noqa: ANN001, ANN202
        time.sleep(step_delay_s)
        return execute(batch)
    engine.runner.execute = slowed
    return engine


def failing_build() -> Engine:
    raise FileNotFoundError("no checkpoint 'nowhere' (injected)")


def crashing_build() -> Engine:
    os._exit(3)


def endless_build() -> Engine:
    time.sleep(600)


def engine_processes() -> list:
    """This process's engine processes still running (``active_children`` also reaps the ended ones)."""
    return [p for p in multiprocessing.active_children() if p.name == "labkit-engine"]


def params(n: int, **changes: object) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": n, "stop_at_eos": False} | changes)


def prompt(i: int, length: int) -> list[int]:
    return [(7 * i + 3 * j + 1) % VOCAB for j in range(length)]


def alone(request: Request) -> list[int]:
    """The request's tokens generated on its own through the contiguous cache."""
    return list(stream(MODEL, request.prompt, request.params))


def all_free(engine: Engine) -> bool:
    return engine.allocator.num_free == engine.allocator.num_blocks


class Gate:
    """Stands in for a runner's ``execute``: each step waits until the test lets it through, so the
    test knows where the engine thread is (inside step k, nothing after it applied yet)."""

    def __init__(self, execute) -> None:  # noqa: ANN001 - the runner's bound method
        self.execute = execute
        self.permits, self.entered = threading.Semaphore(0), threading.Semaphore(0)

    def __call__(self, batch):  # noqa: ANN001, ANN204 - the runner's signature
        self.entered.release()
        if not self.permits.acquire(timeout=LIMIT_S):
            raise RuntimeError("the test never let this step through")
        return self.execute(batch)

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.permits.release()

    def open(self) -> None:
        """Let every later step through."""
        self.allow(10_000)

    async def step_began(self) -> None:
        assert await asyncio.to_thread(self.entered.acquire, timeout=LIMIT_S), "the engine thread ran no step"


def gated(engine: Engine) -> Gate:
    gate = Gate(engine.runner.execute)
    engine.runner.execute = gate
    return gate


@contextlib.asynccontextmanager
async def serving(engine: Engine | EngineSpec, max_waiting: int = 256,
                  gate: Gate | None = None) -> AsyncIterator[AsyncEngine]:
    """An ``AsyncEngine`` around ``engine``, shut down at the end (its gate opened first)."""
    served = AsyncEngine(engine, max_waiting)
    try:
        yield served
    finally:
        if gate is not None:
            gate.open()
        await served.shutdown(0.0)


async def read(stream: RequestStream) -> list[TokenEvent]:
    return [event async for event in stream]


async def collect(served: AsyncEngine, request: Request) -> list[TokenEvent]:
    return await read(served.stream(request))


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 3 * LIMIT_S))


@pytest.mark.parametrize("where", ["thread", "process"])
def test_each_stream_gets_its_requests_tokens_in_order_as_the_offline_engine_makes_them(where):
    """Nine requests, greedy and seeded, joining a running batch at different times (four at most,
    prompts chunked by 16), one stopping at its EOS: each stream is the offline engine's output,
    the engine in a thread or in a process; each caller's request learns its arrival on the
    engine's clock, before its first token."""
    eos = alone(Request(0, prompt(0, 5), params(3)))[-1]  # request 0 stops at its third token, or before

    def requests() -> list[Request]:  # fresh ones for each run
        return [Request(i, prompt(i, 3 + 5 * i % 23),
                        params(4 + 3 * i % 13, temperature=0.8 * (i % 2), seed=i, stop_at_eos=i == 0))
                for i in range(9)]

    config = dict(max_num_seqs=4, max_num_batched_tokens=16)
    offline, served_requests = make_engine(eos_id=eos, **config).run(requests()), requests()

    async def online() -> list[list[TokenEvent]]:
        engine = make_engine(eos_id=eos, **config) if where == "thread" else EngineSpec(engine_in_process, (eos, config))
        async with serving(engine) as served:
            async def later(request: Request, delay_s: float) -> list[TokenEvent]:
                await asyncio.sleep(delay_s)
                return await collect(served, request)
            return await asyncio.gather(*(later(r, 0.002 * r.request_id) for r in served_requests))

    for events, reference, request in zip(run(online()), offline, served_requests):
        assert 0 < request.arrival_time <= events[0].time
        assert [e.token for e in events] == reference.output
        reason = "stop" if reference.request_id == 0 else "length"
        assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + [reason]
        times = [e.time for e in events]
        assert times == sorted(times)
    assert offline[0].output[-1] == eos and len(offline[0].output) <= 3


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_prefix_cache_reset_between_requests_makes_the_next_one_cold(where):
    """The same prompt twice finds its blocks cached the second time; a reset (the engine in a thread or a
    process) forgets them, and the third computes its prompt whole, to the same tokens. A reset while a request
    runs is refused with the engine's reason, and one after shutdown raises EngineStopped."""
    config = dict(max_num_seqs=2)

    async def scenario() -> tuple[list[Request], list[list[int]], int]:
        engine = make_engine(**config) if where == "thread" else EngineSpec(engine_in_process, (None, config, 0.02))
        runs, outputs = [], []
        async with serving(engine) as served:
            for i in range(3):
                if i == 2:
                    forgotten = await served.reset_prefix_cache()
                runs.append(Request(f"r{i}", prompt(5, 14), params(3)))
                outputs.append([e.token for e in await collect(served, runs[-1])])
            busy = served.stream(Request("busy", prompt(6, 6), params(30)))
            with pytest.raises(ValueError, match=r"[01] requests run and [01] wait: the prefix cache can be reset once"):
                await served.reset_prefix_cache()
            await busy.aclose()
        with pytest.raises(EngineStopped):
            await served.reset_prefix_cache()
        return runs, outputs, forgotten

    runs, outputs, forgotten = run(scenario())
    assert forgotten == 4 and outputs[0] == outputs[1] == outputs[2] == alone(runs[0])  # 14 + 2 tokens written: 4 blocks
    if where == "thread":  # an engine process serves copies: the caller's requests learn only their arrival
        assert [r.cached_tokens for r in runs] == [0, 12, 0]


def test_aborting_a_waiting_request_ends_its_stream_and_the_running_one_goes_on():
    engine = make_engine(max_num_seqs=1)
    gate = gated(engine)
    a, b = Request("a", prompt(1, 6), params(6)), Request("b", prompt(2, 6), params(6))

    async def scenario() -> tuple[list[TokenEvent], list[TokenEvent]]:
        async with serving(engine, gate=gate) as served:
            streams = asyncio.create_task(collect(served, a)), asyncio.create_task(collect(served, b))
            await gate.step_began()
            gate.allow()
            await gate.step_began()  # step 2: both added long since, one running (max_num_seqs=1)
            assert b.status == WAITING and b in engine.scheduler.waiting
            served.abort("b")
            gate.open()
            return await asyncio.gather(*streams)

    events_a, events_b = run(scenario())
    assert [(e.token, e.finish_reason) for e in events_b] == [(None, "abort")]
    assert [e.token for e in events_a] == alone(a) and events_a[-1].finish_reason == "length"
    assert b.status == ABORTED and not b.output and all_free(engine)


def test_aborting_a_request_while_it_prefills_frees_its_blocks():
    engine = make_engine(max_num_batched_tokens=4)  # a 40-token prompt takes 10 steps
    gate = gated(engine)
    request = Request("p", prompt(3, 40), params(5))

    async def scenario() -> list[TokenEvent]:
        async with serving(engine, gate=gate) as served:
            events = asyncio.create_task(collect(served, request))
            await gate.step_began()
            gate.allow()
            await gate.step_began()  # step 2: 4 of the 40 prompt tokens in the cache
            assert 0 < request.num_computed < len(request.prompt) and not all_free(engine)
            served.abort("p")
            gate.open()
            return await events

    assert [(e.token, e.finish_reason) for e in run(scenario())] == [(None, "abort")]
    assert request.status == ABORTED and not request.output and all_free(engine)


def test_aborting_a_request_while_it_decodes_ends_its_stream_after_the_tokens_it_had():
    engine = make_engine()
    gate = gated(engine)
    request = Request("d", prompt(4, 5), params(50))

    async def scenario() -> list[TokenEvent]:
        events = []
        async with serving(engine, gate=gate) as served:
            gate.allow(3)  # the prefill (first token) and two decodes
            async for event in served.stream(request):
                events.append(event)
                if len(events) == 3:  # the thread waits inside step 4, whose token still comes
                    served.abort("d")
                    gate.open()
        return events

    events = run(scenario())
    tokens = [e.token for e in events[:-1]]
    assert len(tokens) in (3, 4) and tokens == alone(request)[:len(tokens)]
    assert (events[-1].token, events[-1].finish_reason) == (None, "abort")
    assert request.status == ABORTED and all_free(engine)


def test_an_id_served_again_right_after_an_abort_gets_only_its_own_tokens():
    """A stream closed mid-step (the step's token still comes for it), and at once a new request with
    the same id: the new stream gets exactly its own request's tokens, none of the old one's, and is
    not ended by the old one's abort."""
    engine = make_engine()
    gate = gated(engine)
    old, new = Request("x", prompt(9, 5), params(20)), Request("x", prompt(10, 6), params(5))

    async def scenario() -> list[TokenEvent]:
        async with serving(engine, gate=gate) as served:
            gate.allow(2)  # the prefill and a decode; the third step waits in the gate
            stream = served.stream(old)
            assert (await anext(stream)).token is not None and (await anext(stream)).token is not None
            await gate.step_began()
            await gate.step_began()
            await gate.step_began()  # step 3 under way: it still makes a token for the old request
            await stream.aclose()
            again = served.stream(new)
            gate.open()
            return await read(again)

    events = run(scenario())
    assert [e.token for e in events] == alone(new) and events[-1].finish_reason == "length"
    assert all_free(engine)


def test_the_event_loop_stays_responsive_while_the_engine_computes():
    """A timer of 5 ms, rearmed while four 512-token prompts run through a model big enough for
    steps of tens of ms: were a step run on the event loop, each timer would fire a step late
    (median lag ~ a step). With the engine in its thread the lag is the GIL's switch interval
    (5 ms) at worst; the bounds (a fifth of a step at the median, half at the 90th percentile)
    leave room for a loaded machine, whose steps slow down with it."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                                        d_ff=1024, max_seq_len=1024)).eval()
    engine = make_engine(model, num_blocks=256, block_size=16, max_num_batched_tokens=512)
    execute, steps = engine.runner.execute, []

    def timed(batch):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        tokens = execute(batch)
        steps.append((time.perf_counter() - start, sum(n for _, n in batch.scheduled)))
        return tokens

    engine.runner.execute = timed

    async def scenario() -> list[float]:
        lags = []
        async with serving(engine) as served:
            requests = [Request(i, [(31 * i + j) % 512 for j in range(512)], params(4)) for i in range(4)]
            streams = asyncio.gather(*(collect(served, r) for r in requests))
            while not streams.done():
                start = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - start - 0.005)
            await streams
        return lags

    lags = run(scenario())
    step = statistics.median(d for d, n in steps if n == 512)
    assert step > 0.02, f"prefill steps of {step * 1e3:.1f} ms are too short to tell"
    assert statistics.median(lags) < step / 5 and statistics.quantiles(lags, n=10)[-1] < step / 2, (
        f"timer lag median {statistics.median(lags) * 1e3:.1f} ms, p90 "
        f"{statistics.quantiles(lags, n=10)[-1] * 1e3:.1f} ms, against steps of {step * 1e3:.1f} ms")


def test_a_full_queue_raises_queue_full_until_it_drains():
    """A burst is counted as it arrives, before the engine thread has seen any of it: with one
    sequence a batch and two waiting allowed, the fourth request of a burst is refused."""
    engine = make_engine(max_num_seqs=1)

    async def scenario() -> list[list[TokenEvent]]:
        async with serving(engine, max_waiting=2) as served:
            burst = [served.stream(Request(name, prompt(5 + i, 4), params(3))) for i, name in enumerate("abc")]
            with pytest.raises(QueueFull, match="max_waiting=2"):
                served.stream(Request("d", prompt(8, 4), params(3)))
            done = await asyncio.gather(*(read(stream) for stream in burst))
            return done + [await collect(served, Request("d", prompt(8, 4), params(3)))]

    assert all(len(events) == 3 and events[-1].finish_reason == "length" for events in run(scenario()))
    assert all_free(engine)


def test_shutdown_aborts_what_runs_and_a_stopped_engine_refuses_new_requests():
    engine = make_engine()
    gate = gated(engine)
    request = Request("s", prompt(8, 5), params(100))

    async def scenario() -> tuple[list[TokenEvent], AsyncEngine]:
        served = AsyncEngine(engine)
        events = []
        gate.allow(2)
        async for event in served.stream(request):
            events.append(event)
            if len(events) == 2:
                gate.open()
                await served.shutdown(0.0)  # no drain: what runs is aborted
        with pytest.raises(EngineStopped, match="shutting down"):
            served.stream(Request("late", prompt(9, 4), params(2)))
        return events, served

    events, served = run(scenario())
    assert not served.alive and (events[-1].token, events[-1].finish_reason) == (None, "abort")
    tokens = [e.token for e in events[:-1]]
    assert 2 <= len(tokens) < 100 and tokens == alone(request)[:len(tokens)]
    assert request.status == ABORTED and all_free(engine)


def test_a_step_that_raises_fails_the_live_streams_and_the_engine_serves_on():
    engine = make_engine()
    execute, failures = engine.runner.execute, []

    def fails_once_with_two(batch):  # noqa: ANN001, ANN202
        if len(batch.scheduled) == 2 and not failures:  # the first step that runs both requests
            failures.append(batch)
            raise RuntimeError("boom (injected)")
        return execute(batch)

    engine.runner.execute = fails_once_with_two
    a, b, c = (Request(name, prompt(i, 5), params(8)) for i, name in enumerate("abc"))

    async def scenario() -> tuple[list, list[TokenEvent]]:
        async with serving(engine) as served:
            failed = await asyncio.gather(collect(served, a), collect(served, b), return_exceptions=True)
            assert all_free(engine) and served.alive
            return failed, await collect(served, c)

    failed, events = run(scenario())
    assert failures and all(isinstance(f, RuntimeError) and "boom (injected)" in str(f) for f in failed), failed
    assert a.status == b.status == ABORTED
    assert [e.token for e in events] == alone(c) and events[-1].finish_reason == "length"


def test_an_engine_process_aborts_frees_its_blocks_and_checks_requests_as_the_engine_would():
    """In a process (steps slowed to 50 ms): a request too long for the pool is refused at once,
    with the engine's message; one aborted while it decodes ends with "abort" after its first
    tokens, and the stats (the engine's, delivered) show every block free again; a request that
    runs on is unaffected. The process is in a process group of its own: a terminal's Ctrl-C,
    which reaches its starter's whole group, does not reach it."""
    config = dict(num_blocks=24, max_num_seqs=4)

    async def scenario() -> tuple[list[TokenEvent], list[TokenEvent], EngineStats]:
        async with serving(EngineSpec(engine_in_process, (None, config, 0.05))) as served:
            assert os.getpgid(served.engine_pid) != os.getpgid(0)
            with pytest.raises(ValueError, match="needs 28 blocks of 4 tokens but the pool has only 24"):
                served.stream(Request("huge", prompt(1, 50), params(60)))
            long_events, kept = [], asyncio.create_task(collect(served, Request("kept", prompt(2, 6), params(12))))
            async for event in served.stream(Request("long", prompt(3, 5), params(40))):
                long_events.append(event)
                if len(long_events) == 3:
                    served.abort("long")
            kept_events = await kept
            for _ in range(int(LIMIT_S / 0.01)):  # the stats come with the step after the abort
                if served.stats.blocks_free == 24 and served.stats.running == 0:
                    return long_events, kept_events, served.stats
                await asyncio.sleep(0.01)
            raise AssertionError(f"the blocks never came back: {served.stats}")

    long_events, kept_events, stats = run(scenario())
    assert 3 <= len(long_events) - 1 < 40 and (long_events[-1].token, long_events[-1].finish_reason) == (None, "abort")
    assert [e.token for e in long_events[:-1]] == alone(Request("long", prompt(3, 5), params(40)))[:len(long_events) - 1]
    assert [e.token for e in kept_events] == alone(Request("kept", prompt(2, 6), params(12)))
    assert (stats.blocks_free, stats.blocks_used, stats.running) == (24, 0, 0) and stats.generated_tokens >= 12 + 3


def test_an_engine_process_that_dies_fails_its_streams_and_refuses_new_requests():
    """SIGKILL to the engine's process mid-stream: the stream raises, saying the process ended and
    its exit code; the engine is no longer alive, and a new request gets ``EngineStopped``."""
    async def scenario() -> tuple[list[TokenEvent], BaseException, AsyncEngine]:
        async with serving(EngineSpec(engine_in_process, (None, {}, 0.02))) as served:
            events, stream = [], served.stream(Request("r", prompt(4, 5), params(100)))
            with pytest.raises(RuntimeError) as failure:
                async for event in stream:
                    events.append(event)
                    if len(events) == 2:
                        os.kill(served.engine_pid, signal.SIGKILL)
            with pytest.raises(EngineStopped, match=r"the engine process ended \(exit code -9\)"):
                served.stream(Request("late", prompt(5, 4), params(2)))
            return events, failure.value, served

    events, failure, served = run(scenario())
    assert 2 <= len(events) < 100 and all(e.finish_reason is None for e in events)
    assert "the engine process ended (exit code -9)" in str(failure) and not served.alive
    assert served.stats.running == 0 and served.stats.blocks_used == 0 and not engine_processes()


def test_an_engine_process_shuts_down_aborting_what_runs_and_refusing_what_comes():
    """``shutdown`` with no drain while a request decodes: its stream ends with "abort" after the
    tokens it had, a new request gets ``EngineStopped``, and the process is gone."""
    async def scenario() -> tuple[list[TokenEvent], AsyncEngine]:
        served, events = AsyncEngine(EngineSpec(engine_in_process, (None, {}, 0.02))), []
        try:
            async for event in served.stream(Request("r", prompt(6, 5), params(100))):
                events.append(event)
                if len(events) == 2:
                    await served.shutdown(0.0)
            with pytest.raises(EngineStopped, match="shutting down"):
                served.stream(Request("late", prompt(7, 4), params(2)))
        finally:
            await served.shutdown(0.0)
        return events, served

    events, served = run(scenario())
    assert 2 <= len(events) - 1 < 100 and (events[-1].token, events[-1].finish_reason) == (None, "abort")
    assert [e.token for e in events[:-1]] == alone(Request("r", prompt(6, 5), params(100)))[:len(events) - 1]
    assert not served.alive and not engine_processes()


def test_an_engine_that_cannot_be_built_says_why():
    """A build that raises in the engine's process: ``RuntimeError`` with its traceback; one that
    kills its process: the exit code; one that never ends: the time it was given. Each time the
    process is gone. A build the process could not import (a lambda, a notebook cell's function) is
    refused by name before any process starts."""
    with pytest.raises(RuntimeError, match=r"failed to build(.|\n)*no checkpoint 'nowhere' \(injected\)"):
        AsyncEngine(EngineSpec(failing_build))
    assert not engine_processes()
    with pytest.raises(RuntimeError, match=r"exited \(exit code 3\) before it was ready"):
        AsyncEngine(EngineSpec(crashing_build))
    assert not engine_processes()
    with pytest.raises(RuntimeError, match="did not build its engine within 3 s"):
        AsyncEngine(EngineSpec(endless_build), start_timeout_s=3)
    assert not engine_processes()
    with pytest.raises(ValueError, match="cannot be started in another process"):
        AsyncEngine(EngineSpec(lambda: make_engine()))
    with pytest.raises(TypeError, match="EngineCore .* or an EngineSpec"):
        AsyncEngine("target")
