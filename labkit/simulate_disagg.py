"""Disaggregated prefill and decode, simulated: prompts on some GPUs, decoding on others (Splitwise, DistServe).

A colocated engine runs prefills and decodes in the same steps, so a long prompt admitted into
the batch makes every decoding request wait for its next token (chunked prefill bounds the wait,
never removes it). Disaggregation gives each phase its own instances: a prefill instance runs
only prompts and produces each request's first token, then ships the request's KV cache to a
decode instance, which adds the blocks to its own pool and decodes the request in its continuous
batch, where no prompt ever holds a step up. Each request pays for the transfer:

    KV bytes = KV bytes per token x prompt tokens                 (labkit.memory.kv_cache_bytes)
    transfer = link latency + KV bytes / (W x link bandwidth)     (each of an instance's W GPUs sends
                                                                   its share of the KV heads at once)

``compare_disaggregated`` serves one workload both ways on the same GPUs: P prefill + D decode
GPUs against P + D colocated ones, in instances of W = ``cost.n_gpus`` GPUs (tensor parallel over
``cost.link``), each a ``SimulatedEngine`` on ``cost``: the engine's own scheduler throughout. It
reports TTFT and TPOT percentiles and the goodput: requests meeting both limits of the SLO, per
second. The i-th request to arrive goes to instance i mod N, decode instances included (in the
order their KV arrives); a prefill instance sends one request's KV at a time, and frees the
request's blocks when its first token is out rather than when the transfer ends (a little
optimistic on its memory). A decode instance admits an arriving request as it admits a waiting
one (``Scheduler.adopt``: the sequence cap, the free blocks and their headroom), with its
prompt's keys and values in place, so its first step there decodes, as the real disaggregated
engine of ``labkit.parallel.disaggregate`` does.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from functools import partial
from typing import NamedTuple, Sequence

from labkit.engine import FINISHED, Request, SchedulerConfig, check_unique_ids
from labkit.generate import SamplingParams
from labkit.interconnect import Link
from labkit.memory import kv_cache_bytes
from labkit.metrics import latency_figures, request_metrics
from labkit.simulate import CostModel, SimulatedEngine

PERCENTILES = (50, 90, 99)


class SLO(NamedTuple):
    """A service-level objective: the longest time to first token and time per output token, in seconds."""

    ttft_s: float
    tpot_s: float


def _fresh(request: Request, params: SamplingParams | None = None) -> Request:
    """A new, unserved copy of ``request`` (with other ``params`` if given): each way of serving gets its own."""
    return Request(request.request_id, list(request.prompt), params or request.params, request.arrival_time)


def _round_robin(requests: Sequence[Request], n: int) -> list[list[Request]]:
    ordered = sorted(requests, key=lambda r: r.arrival_time)
    return [ordered[i::n] for i in range(n)]


def _prefill(engine: SimulatedEngine, requests: list[Request], cost: CostModel,
             link: Link) -> list[tuple[float, Request, float]]:
    """Run the requests' prompts on a prefill instance; each gets its first token there. Returns
    (when its KV has arrived, the request, KV bytes) for each request that has more tokens to go."""
    firsts = engine.run([_fresh(r, replace(r.params, max_new_tokens=1)) for r in requests])
    handoffs, link_free = [], 0.0
    for request, first in sorted(zip(requests, firsts), key=lambda pair: pair[1].finish_time):
        request.output, request.token_times = list(first.output), list(first.token_times)
        if len(request.output) >= request.params.max_new_tokens:
            request.finish_time, request.status = first.finish_time, FINISHED
            continue
        nbytes = kv_cache_bytes(cost.model, len(request.prompt), dtype=cost.kv_dtype)
        link_free = max(first.finish_time, link_free) + link.send_seconds(nbytes / cost.n_gpus)
        handoffs.append((link_free, request, nbytes))
    return handoffs


def _decode(engine: SimulatedEngine, handoffs: list[tuple[float, Request, float]]) -> None:
    """Decode the handed-off requests on a decode instance, each adopted into the batch
    (``Scheduler.adopt``) when its KV has arrived and there is room (a preempted one is recomputed
    there, as on any engine). The colocated run has checked that an engine like this one can serve
    each request, so one always fits an idle engine."""
    pending = deque(sorted(handoffs, key=lambda h: h[0]))
    while pending or engine.scheduler.has_work:
        while pending and pending[0][0] <= engine.now() and engine.scheduler.adopt(pending[0][1]) is not None:
            pending.popleft()
        if engine.scheduler.has_work:
            engine.step()
        elif pending[0][0] <= engine.now():  # arrived, yet refused by an idle instance: it never will fit
            raise RuntimeError(f"request {pending[0][1].request_id!r} does not fit a decode instance's idle pool")
        else:
            engine.clock.wait_until(pending[0][0])


def _report(requests: Sequence[Request], slo: SLO, gpus: int, kv_bytes: dict | None = None) -> dict:
    """A run's TTFT, TPOT, ITL and E2E figures (``labkit.metrics.latency_figures``, ms), its goodput
    (requests meeting the SLO per second of the run), its preemptions, and one row per request."""
    per_request = [request_metrics(r.arrival_time, r.token_times, r.finish_time) for r in requests]
    rows, met = [], 0
    for r, m in zip(requests, per_request):
        ok = m["ttft"] <= slo.ttft_s and (m["tpot"] is None or m["tpot"] <= slo.tpot_s)
        met += ok
        rows.append({"request_id": r.request_id, "prompt_tokens": len(r.prompt), "output_tokens": len(r.output),
                     "ttft_ms": m["ttft"] * 1e3, "tpot_ms": None if m["tpot"] is None else m["tpot"] * 1e3,
                     "meets_slo": ok, **({} if kv_bytes is None else {"kv_bytes": kv_bytes.get(r.request_id, 0.0)})})
    duration = max(r.finish_time for r in requests)
    return {"gpus": gpus, "requests": len(requests), "duration_s": duration,
            "request_throughput": len(requests) / duration, "goodput": met / duration,
            "slo_attainment": met / len(requests), "preemptions": sum(r.preemptions for r in requests),
            **latency_figures(per_request, PERCENTILES), "per_request": rows}


def compare_disaggregated(cost: CostModel, link: Link, requests: Sequence[Request], prefill_gpus: int,
                          decode_gpus: int, slo: SLO, config: SchedulerConfig = SchedulerConfig(),
                          block_size: int = 16, num_blocks: int | None = None, prefix_caching: bool = True) -> dict:
    """Serve ``requests`` on ``prefill_gpus`` + ``decode_gpus`` GPUs disaggregated (the KV shipped over
    ``link``) and on as many colocated, in instances of ``cost.n_gpus`` GPUs, each a ``SimulatedEngine``
    with ``num_blocks`` KV blocks (None: what their memory leaves), ``config`` and ``prefix_caching``
    (off is faster for prompts that share nothing). Returns {"colocated": report, "disaggregated":
    report}, each report as ``_report`` makes it; the disaggregated one adds ``kv_bytes``, the KV
    bytes shipped in all. The requests given are not changed: each way serves copies."""
    w = cost.n_gpus
    for name, gpus in (("prefill_gpus", prefill_gpus), ("decode_gpus", decode_gpus)):
        if gpus < w or gpus % w:
            raise ValueError(f"{name}={gpus} must be a positive multiple of cost.n_gpus={w}, the GPUs of one instance")
    if not requests:
        raise ValueError("requests is empty: give the workload to serve")
    if not (slo.ttft_s > 0 and slo.tpot_s > 0):
        raise ValueError(f"slo={slo}: both limits must be positive seconds")
    check_unique_ids(requests)
    engine = partial(SimulatedEngine, cost, num_blocks, block_size, config, prefix_caching)  # one instance's

    colocated = [_fresh(r) for r in requests]
    for share in _round_robin(colocated, (prefill_gpus + decode_gpus) // w):
        engine().run(share)

    split = [_fresh(r) for r in requests]
    handoffs = [h for share in _round_robin(split, prefill_gpus // w)
                for h in _prefill(engine(), share, cost, link)]
    handoffs.sort(key=lambda h: h[0])
    for i in range(decode_gpus // w):
        _decode(engine(), handoffs[i::decode_gpus // w])
    kv_bytes = {request.request_id: nbytes for _, request, nbytes in handoffs}
    return {"colocated": _report(colocated, slo, prefill_gpus + decode_gpus),
            "disaggregated": _report(split, slo, prefill_gpus + decode_gpus, kv_bytes) | {
                "kv_bytes": sum(kv_bytes.values())}}
