"""What the server exposes at ``GET /metrics``, in Prometheus' text format, named after vLLM's metrics
with a ``labkit:`` prefix (``vllm:num_requests_running`` is ``labkit:num_requests_running``).

Gauges and totals are read from the engine's latest ``EngineStats`` when Prometheus scrapes (the
engine loop sends them with each step, the scrape only reads); latencies are histograms the server
observes as each token reaches its request's coroutine, on the engine's clock:

    TTFT = first token - arrival      ITL = token - previous token      E2E = last token - arrival

so they are the engine's view; a client adds the network, the HTTP layer and its own queueing.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from labkit.async_engine import EngineStats, TokenEvent
from labkit.engine import Request

# seconds; vLLM's buckets for the same histograms, roughly, reaching down to a CPU's milliseconds
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector:
    """The engine's gauges and totals, read from ``stats()`` at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        used = s.blocks_used / max(1, s.blocks_used + s.blocks_free)
        yield from (
            GaugeMetricFamily("labkit:num_requests_running", "Requests in the running batch", s.running),
            GaugeMetricFamily("labkit:num_requests_waiting", "Requests waiting for admission", s.waiting),
            GaugeMetricFamily("labkit:kv_blocks_used", "KV-cache blocks held by requests", s.blocks_used),
            GaugeMetricFamily("labkit:kv_blocks_free", "KV-cache blocks free or cached and idle", s.blocks_free),
            GaugeMetricFamily("labkit:kv_cache_usage_perc", "Fraction of KV-cache blocks used (0 to 1)", used),
            GaugeMetricFamily("labkit:prefix_cache_hit_rate", "Prompt tokens read from the prefix cache, of all "
                              "prompt tokens", s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0),
            CounterMetricFamily("labkit:prompt_tokens", "Prompt tokens of the requests that got a first token",
                                s.prompt_tokens),
            CounterMetricFamily("labkit:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                s.prompt_tokens),
            CounterMetricFamily("labkit:prefix_cache_hits", "Prompt tokens found in the prefix cache", s.cached_tokens),
            CounterMetricFamily("labkit:num_preemptions", "Requests preempted (recomputed later)", s.preemptions),
            CounterMetricFamily("labkit:generation_tokens", "Tokens generated", s.generated_tokens),
            CounterMetricFamily("labkit:engine_steps", "Engine steps run", s.steps),
        )


class ServerMetrics:
    """The server's registry: the engine's collector, request counters and latency histograms."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats))

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.ttft = histogram("labkit:time_to_first_token_seconds", "Time to first token, from arrival")
        self.itl = histogram("labkit:inter_token_latency_seconds", "Time between two tokens of a request")
        self.e2e = histogram("labkit:e2e_request_latency_seconds", "Arrival to last token")
        self.finished = Counter("labkit:request_success", "Requests ended, by reason: stop, length, abort (a "
                                "client gone, or the server shutting down), error", ["finished_reason"],
                                registry=self.registry)

    def token(self, request: Request, event: TokenEvent, previous: float | None) -> None:
        """Record a token of ``request``; ``previous``: when its previous token came (None before
        its first). The engine set ``request.arrival_time`` before it sent the first token."""
        if previous is None:
            self.ttft.observe(event.time - request.arrival_time)
        else:
            self.itl.observe(event.time - previous)

    def finish(self, request: Request, reason: str, last_token: float | None) -> None:
        """Record a request's end: why ("stop", "length", "abort", "error"), and its latency if it had a token."""
        self.finished.labels(reason).inc()
        if last_token is not None:
            self.e2e.observe(last_token - request.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
