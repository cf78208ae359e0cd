"""Disaggregated prefill and decode (Splitwise, DistServe): prompts on one rank, decoding on another.

A colocated engine runs prompts and decodes in the same steps. Without chunked prefill, a long
prompt admitted into the batch makes every decoding request wait the whole prefill for its next
token: its inter-token latency (ITL) spikes. Chunked prefill bounds the wait by a chunk, but never
removes it. Disaggregation gives each phase its own rank: rank 0 (prefill) runs each prompt as it
arrives, samples the first token, and ships the prompt's keys and values to rank 1 (decode), whose
continuous-batching ``Engine`` adopts the request into its own paged pool between two steps
(``Engine.adopt``) and decodes it, and no prompt ever holds a decode step up. Each request pays
one transfer of its prompt's KV cache,

    KV bytes shipped = 2 (K and V) x layers x kv_heads x head_dim x prompt tokens x bytes per element

(``labkit.memory.kv_cache_bytes``), and each phase has only its own rank's share of the cores.

Per request, in arrival order, rank 0 sends rank 1 a header (int64: the request's index, its
prompt length, its first token, that token's time in ns, whether KV follows) and then, unless that
token finished the request, its KV ``[2, layers, prompt tokens, kv_heads, head_dim]`` (token-major, as the pool's
slots). The prefill rank keeps a contiguous cache of exactly the prompt's length: it runs one
prompt at a time and forgets it once shipped, so paging would buy nothing there, and that buffer
is the message. The decode rank receives on a thread of its own (gloo's ``irecv`` reports
completion only once waited on), so its loop polls a queue between steps, never blocking while it
has work. Both ranks time from one start, which rank 0 broadcasts on ``time.perf_counter``
(CLOCK_MONOTONIC: one clock for every process of a Linux machine), so TTFT (rank 0) and the later
tokens (rank 1) are on one clock; ``labkit.metrics`` summarizes either run.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Hashable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from labkit.engine import (FINISHED, Engine, Request, SchedulerConfig, StepRecord, WallClock, check_unique_ids,
                           is_finished, sample)
from labkit.load import load
from labkit.metrics import summarize
from labkit.model import ContiguousKVCache, Transformer
from labkit.parallel.launch import Rank, launch
from labkit.validate import check_counts
from labkit.workload import make_workload, uniform

PREFILL, DECODE = 0, 1  # ranks
HEADER, KV = 0, 1  # message tags


@dataclass
class ServingRun:
    """A served workload: the requests with their outputs and token times (seconds after the run's
    start), each rank's steps (``StepRecord``: "prefill" and "decode" disaggregated, "colocated 0",
    "colocated 1", ... otherwise) and the KV bytes shipped per request (disaggregated only; none
    for a request that its first token finished)."""

    requests: list[Request]
    logs: dict[str, list[StepRecord]]
    kv_bytes: dict[Hashable, int] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        """TTFT, ITL, throughput, ... as ``labkit.metrics.summarize`` reports them."""
        return summarize(self.requests)

    def busy_s(self) -> dict[str, float]:
        """Seconds each rank spent in its steps."""
        return {role: sum(s.end - s.start for s in steps) for role, steps in self.logs.items()}


class StartedClock(WallClock):
    """Seconds since a start agreed between ranks (``time.perf_counter``); ``reset`` keeps it."""

    def __init__(self, start: float) -> None:
        self._start = start

    def reset(self) -> None:
        pass


def prefill(model: Transformer, request: Request) -> tuple[int, Tensor]:
    """Run the request's prompt through a contiguous cache of its length; its first token (sampled
    as the engine samples) and the prompt's keys and values ``[2, layers, prompt, kv_heads, head_dim]``."""
    n = len(request.prompt)
    cache = ContiguousKVCache(model.config, 1, n, model.dtype, model.device)
    tokens = torch.tensor([request.prompt], device=model.device)
    with torch.inference_mode():
        logits = model(tokens, plan=cache.plan(torch.arange(n, device=model.device)[None]),
                       logits_at=torch.tensor([n - 1], device=model.device))[0]
    kv = torch.stack([cache.k[:, 0], cache.v[:, 0]]).transpose(2, 3).contiguous()
    return sample(logits, [request])[0], kv


def run_disaggregated(model_name: str, requests: Sequence[Request], num_blocks: int, block_size: int = 16,
                      config: SchedulerConfig = SchedulerConfig(), dtype: torch.dtype = torch.float32,
                      eos_id: int | None = None, threads_per_rank: int | None = None,
                      timeout_s: float = 600.0) -> ServingRun:
    """Serve ``requests`` (arriving at their ``arrival_time``) on two ranks: rank 0 prefills, rank 1
    decodes with an ``Engine`` of ``num_blocks`` blocks and ``config``. Each rank loads
    ``model_name`` (``labkit.load``: a shipped name or a folder) in ``dtype``. The requests given
    are not changed: the run serves copies, returned in the same order. ``threads_per_rank``:
    torch threads per rank (default: the cores shared out, one each on 2 cores)."""
    requests = _checked(model_name, requests, num_blocks, block_size, config, dtype, eos_id)
    return launch(_disaggregated_rank, 2, args=(model_name, requests, num_blocks, block_size, config, dtype, eos_id),
                  timeout_s=timeout_s, threads=threads_per_rank)


def run_colocated(model_name: str, requests: Sequence[Request], num_blocks: int, chunked_prefill: bool,
                  block_size: int = 16, config: SchedulerConfig = SchedulerConfig(),
                  dtype: torch.dtype = torch.float32, eos_id: int | None = None, instances: int = 2,
                  threads: int | None = None, timeout_s: float = 600.0) -> ServingRun:
    """The baseline: ``instances`` engines (each a process, timed as ``run_disaggregated``'s ranks
    are), each serving prompts and decodes alike (``config`` with ``chunked_prefill``), the i-th
    request to arrive going to engine i mod ``instances``. Fair on the same cores: by default two
    engines of one thread each (``threads`` per engine: the cores shared out), the processes and
    threads the disaggregated pair has, as Splitwise compares P + D prefill and decode machines with
    P + D colocated ones. One engine with both threads would be weaker here, not stronger: a
    second thread barely speeds this model's small matmuls (a decode step's not at all) and waits
    on a core that other work holds. Compare at equal output throughput: a workload that both
    serve as fast as it arrives. Each engine has ``num_blocks`` blocks, as the decode rank has."""
    check_counts(instances=instances)
    config = replace(config, chunked_prefill=chunked_prefill)
    requests = _checked(model_name, requests, num_blocks, block_size, config, dtype, eos_id)
    args = (model_name, requests, num_blocks, block_size, config, dtype, eos_id)
    return launch(_colocated_rank, instances, args=args, timeout_s=timeout_s, threads=threads)


def _checked(model_name: str, requests: Sequence[Request], num_blocks: int, block_size: int,
             config: SchedulerConfig, dtype: torch.dtype, eos_id: int | None) -> list[Request]:
    """The requests, each refused by name, before any process starts, where an engine like the
    ranks' would refuse it: ids shared, run before, past the vocabulary or the context, too many
    blocks, or too long for one step without chunked prefill."""
    requests = list(requests)
    if not requests:
        raise ValueError("requests is empty: give the workload to serve")
    check_unique_ids(requests)
    engine = Engine(load(model_name, "cpu", dtype)[0], num_blocks, block_size, config, eos_id=eos_id)
    for request in requests:
        engine.validate(request)
    return requests


def _warmed_up(model_name: str, dtype: torch.dtype, device: torch.device) -> Transformer:
    """The model, loaded and run once, so that the timed run does not pay for a first call."""
    model = load(model_name, device, dtype)[0]
    warm_up = Request("warm-up", [0] * min(64, model.config.max_seq_len))
    prefill(model, warm_up)
    return model


def _agree_start(rank: Rank) -> float:
    """A start time on ``time.perf_counter`` that rank 0 chose and broadcast to all (also a barrier)."""
    start = torch.tensor([time.perf_counter() + 0.05], dtype=torch.float64, device=rank.device)
    dist.broadcast(start, src=PREFILL)
    return float(start)


def _colocated_rank(rank: Rank, model_name: str, requests: list[Request], num_blocks: int, block_size: int,
                    config: SchedulerConfig, dtype: torch.dtype, eos_id: int | None) -> ServingRun:
    """Serve every ``world_size``-th request to arrive, from the one start all engines agree on;
    rank 0 gathers everyone's requests (in the order given) and steps."""
    model = _warmed_up(model_name, dtype, rank.device)
    engine = Engine(model, num_blocks, block_size, config, eos_id=eos_id)
    engine.clock = StartedClock(_agree_start(rank))
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)[rank.rank::rank.world_size]
    engine.run([requests[i] for i in order])
    shares = [None] * rank.world_size
    dist.all_gather_object(shares, (order, [requests[i] for i in order], engine.log))
    served = dict(pair for indices, share, _ in shares for pair in zip(indices, share))
    return ServingRun([served[i] for i in range(len(requests))],
                      {f"colocated {r}": log for r, (_, _, log) in enumerate(shares)})


def _disaggregated_rank(rank: Rank, model_name: str, requests: list[Request], num_blocks: int, block_size: int,
                        config: SchedulerConfig, dtype: torch.dtype, eos_id: int | None) -> ServingRun | None:
    model = _warmed_up(model_name, dtype, rank.device)
    clock = StartedClock(_agree_start(rank))
    if rank.rank == PREFILL:
        return _prefill_rank(model, requests, clock, eos_id)
    engine = Engine(model, num_blocks, block_size, config, eos_id=eos_id)
    engine.clock = clock
    _decode_rank(engine, requests)
    return None


def _prefill_rank(model: Transformer, requests: list[Request], clock: StartedClock,
                  eos_id: int | None) -> ServingRun:
    """Prefill each request when it arrives, first come first served; send its header and KV to the
    decode rank. Returns the run, with the decode rank's requests and steps once it is done."""
    log, kv_bytes = [], {}
    for index in sorted(range(len(requests)), key=lambda i: requests[i].arrival_time):
        request = requests[index]
        clock.wait_until(request.arrival_time)
        start = clock.now()
        token, kv = prefill(model, request)
        now = clock.now()
        request.output.append(token)
        goes_on = not is_finished(request, eos_id)
        header = [index, len(request.prompt), token, round(now * 1e9), goes_on]
        dist.send(torch.tensor(header, device=model.device), DECODE, tag=HEADER)
        if goes_on:
            dist.send(kv, DECODE, tag=KV)
            kv_bytes[request.request_id] = kv.nbytes
        log.append(StepRecord(start, now, [(request.request_id, len(request.prompt), "prefill")]))
    served = [None]
    dist.recv_object_list(served, src=DECODE)
    requests, decode_log = served[0]
    return ServingRun(requests, {"prefill": log, "decode": decode_log}, kv_bytes)


class Arrival(NamedTuple):
    """A request handed over by the prefill rank: its index, first token and that token's time,
    and its prompt's keys and values (None when the first token finished it)."""

    index: int
    token: int
    time: float
    kv: Tensor | None


def _receive_arrivals(model: Transformer, prompt_lengths: list[int], inbox: queue.Queue) -> None:
    """On the decode rank's receiving thread: one header, then its KV if the request goes on, for
    each request; each into ``inbox`` as an ``Arrival`` (an exception, if one is raised)."""
    config = model.config
    try:
        for _ in prompt_lengths:
            header = torch.empty(5, dtype=torch.long, device=model.device)
            dist.recv(header, PREFILL, tag=HEADER)
            index, length, token, ns, goes_on = header.tolist()
            if prompt_lengths[index] != length:
                raise RuntimeError(f"request {index}: a header for {length} prompt tokens, but it has "
                                   f"{prompt_lengths[index]}")
            kv = None
            if goes_on:
                kv = torch.empty(2, config.n_layers, length, config.n_kv_heads, config.head_dim, dtype=model.dtype,
                                 device=model.device)
                dist.recv(kv, PREFILL, tag=KV)
            inbox.put(Arrival(index, token, ns / 1e9, kv))
    except BaseException as error:  # noqa: BLE001  the decoding loop raises it
        inbox.put(error)


def _decode_rank(engine: Engine, requests: list[Request]) -> None:
    """Decode every request the prefill rank hands over: between steps, take what has arrived (a
    blocking wait only when there is nothing to run) and adopt it, oldest first, when the pool has
    room. Sends the served requests and the steps to rank 0."""
    inbox: queue.Queue = queue.Queue()
    receiver = threading.Thread(target=_receive_arrivals, args=(engine.model, [len(r.prompt) for r in requests], inbox),
                                name="kv-receiver", daemon=True)
    receiver.start()
    received, ready = 0, deque()
    while received < len(requests) or ready or engine.scheduler.has_work:
        idle = not ready and not engine.scheduler.has_work
        while received < len(requests) and (idle or not inbox.empty()):
            arrival = inbox.get()
            if isinstance(arrival, BaseException):
                raise RuntimeError("the decode rank's receiving thread failed") from arrival
            received, idle = received + 1, False
            request = _handed_over(requests[arrival.index], arrival)
            if arrival.kv is not None:
                ready.append((request, arrival.kv))
        while ready and engine.adopt(*ready[0]):
            ready.popleft()
        if engine.scheduler.has_work:
            engine.step()
        elif ready:
            raise RuntimeError(f"request {ready[0][0].request_id!r} does not fit the decode rank's idle pool")
    receiver.join()
    dist.send_object_list([(requests, engine.log)], dst=PREFILL)


def _handed_over(request: Request, arrival: Arrival) -> Request:
    """The request with its first token, at the prefill rank's time; finished if that was its last."""
    request.output, request.token_times = [arrival.token], [arrival.time]
    if arrival.kv is None:
        request.status, request.finish_time = FINISHED, arrival.time
    return request


def mixed_workload(n_short: int = 24, n_long: int = 24, rate: float = 4.0, short_prompt: tuple[int, int] = (16, 64),
                   short_output: tuple[int, int] = (32, 64), long_prompt: tuple[int, int] = (256, 512),
                   long_output: tuple[int, int] = (4, 8), vocab_size: int = 4096, seed: int = 0) -> list[Request]:
    """Short prompts with long outputs arriving as a Poisson process at ``rate`` per second
    (``labkit.workload``), and ``n_long`` long prompts with short outputs spread evenly over the
    same span, each landing while short requests decode: a colocated engine without chunked
    prefill stalls them all for each long prefill. Ids ``short0..``, ``long0..``; sorted by
    arrival; lengths uniform in the (low, high) ranges given."""
    shorts = make_workload(n_short, uniform(*short_prompt), uniform(*short_output), rate=rate,
                           vocab_size=vocab_size, seed=seed, id_prefix="short")
    longs = make_workload(n_long, uniform(*long_prompt), uniform(*long_output), vocab_size=vocab_size,
                          seed=seed + 1, id_prefix="long")
    span = max(r.arrival_time for r in shorts)
    longs = [replace(r, arrival_time=span * (i + 0.5) / n_long) for i, r in enumerate(longs)]
    return sorted(shorts + longs, key=lambda r: r.arrival_time)
