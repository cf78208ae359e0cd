"""What a serving run felt like, as vLLM's serving benchmark measures it. For a request that
arrives at ``a``, gets its n output tokens at t_1 .. t_n and completes at ``f``:

    TTFT = t_1 - a      TPOT = (f - a - TTFT) / (n - 1)      ITL = t_(i+1) - t_i      E2E = f - a

and the throughputs: completed requests, and output tokens, per second of the whole run.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from labkit.answers import answer_to
from labkit.engine import Request


@answer_to("ex04.3")
def request_metrics(arrival: float, token_times: Sequence[float], finish: float | None = None) -> dict:
    """TTFT, TPOT, the inter-token latencies and the end-to-end latency of one request, in
    seconds, from when it arrived, when each output token came, and when it completed (the
    last token, unless given). TPOT is None for a single-token output."""
    if not token_times:
        raise ValueError("a request with no output tokens has no latencies")
    finish = token_times[-1] if finish is None else finish
    ttft, e2e = token_times[0] - arrival, finish - arrival
    tpot = (e2e - ttft) / (len(token_times) - 1) if len(token_times) > 1 else None
    return {"ttft": ttft, "tpot": tpot, "itl": [b - a for a, b in zip(token_times, token_times[1:])], "e2e": e2e}


def summarize(requests: Sequence[Request]) -> dict[str, float]:
    """A run's figures as vLLM's benchmark reports them: duration (the clock starts at 0),
    request and token throughputs, and the mean, median and p99 of TTFT, TPOT, ITL and E2E in ms."""
    if any(r.finish_time is None for r in requests) or not requests:
        raise ValueError("summarize a run whose requests have all finished")
    duration = max(r.finish_time for r in requests)
    out_tokens = sum(len(r.output) for r in requests)
    figures = {"requests": len(requests), "duration_s": duration,
               "request_throughput": len(requests) / duration, "output_throughput": out_tokens / duration,
               "total_token_throughput": (out_tokens + sum(len(r.prompt) for r in requests)) / duration}
    per_request = [request_metrics(r.arrival_time, r.token_times, r.finish_time) for r in requests]
    return figures | latency_figures(per_request)


def latency_figures(per_request: Sequence[dict], percentiles: Sequence[float] = (50, 99)) -> dict[str, float]:
    """The mean and the given percentiles, in ms, of TTFT, TPOT, ITL (every gap of every request)
    and E2E over requests' ``request_metrics``, named as vLLM's benchmark names them:
    ``mean_ttft_ms``, ``median_ttft_ms`` (the 50th), ``p99_ttft_ms``, ... Percentiles interpolate
    linearly between the closest ranks, as numpy's default does; NaN where there is no value."""
    quantiles = torch.tensor([q / 100 for q in percentiles], dtype=torch.float64)
    figures = {}
    for name in ("ttft", "tpot", "itl", "e2e"):
        values = [v for m in per_request for v in (m[name] if name == "itl" else [m[name]]) if v is not None]
        data = torch.tensor(values or [math.nan], dtype=torch.float64) * 1e3
        figures[f"mean_{name}_ms"] = float(data.mean())
        for q, value in zip(percentiles, data.quantile(quantiles).tolist()):
            figures[f"{'median' if q == 50 else f'p{q:g}'}_{name}_ms"] = value
    return figures
