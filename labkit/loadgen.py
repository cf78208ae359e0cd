"""A load generator for an OpenAI-compatible completions server, measuring from the client.

A request is sent at ``s``; its streamed reply brings server-sent token events (events with a
choice; labkit's server sends one per generated token, others may merge several tokens into one),
the i-th arriving at t_i (i = 1 .. m), and n output tokens in all (the server's usage, else m).
Per request, with vLLM's ``benchmark_serving`` definitions (``labkit.metrics.request_metrics``
computes TTFT, ITL and E2E):

    TTFT = t_1 - s                   time to first token: queueing + prefill + the first hop back
    TPOT = (E2E - TTFT) / (n - 1)    time per output token after the first (none when n = 1)
    ITL  = t_(i+1) - t_i             every gap between two token events, pooled over all requests
    E2E  = t_m - s                   end-to-end latency: what the user waits for the whole answer

The answer is whole at the arrival of its last token event, t_m, as vLLM's client takes it: the
usage event, ``data: [DONE]`` and the closing of the connection that follow it are not waited
for. TPOT divides by the tokens the server counted, not by the events: a server that sends two
tokens per event shows ITLs twice the time per token, and the same TPOT as one that sends one.

and for the run, over its duration D (the first send to the last reply): request throughput =
completed / D, output token throughput = output tokens / D, total token throughput = (prompt +
output tokens) / D, and goodput = the completed requests that meet every SLO given (TTFT <= its
limit, TPOT <= its limit) / D. Latencies are reported as mean, median, p90 and p99 in ms.
A reply that is not streamed shows its first text with its last, when its body has arrived: its
TTFT is its E2E, and it has no TPOT nor ITL. A reply that the server ends with the finish reason
"abort" (labkit's server does when it shuts down) is a failed request, not a completed one.

Why from the client: the engine's own clock starts when a request reaches its queue and stops
when a token is sampled. The user also waits for the HTTP parsing, the tokenizing, the queue in
front of the engine, detokenizing and the network on the way back; only a clock at the client
sees all of it, and only an open-loop client (Poisson arrivals that do not wait for replies)
shows the queue growing when the offered rate passes what the server can serve. A fixed
concurrency instead keeps C requests in flight: the closed loop that measures saturation.

    python -m labkit.loadgen http://127.0.0.1:8000 --requests 100 --rate 4 --slo-ttft-ms 500

It exits with 0 when any request completed, the failures (a server that turns requests away under
overload, say) counted in the report as measurements; with 1 when none did. ``--reset-prefix-cache``
empties the server's prefix cache first, as a benchmark that must not find an earlier run's prompts
cached does (``reset_prefix_cache``); a server that will not reset it sends nothing (exit 1).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import httpx
import torch

from labkit.corpus import functions
from labkit.metrics import latency_figures, request_metrics
from labkit.validate import option_in
from labkit.workload import poisson_arrivals, uniform

PERCENTILES = (50, 90, 99)
PROMPT_LINES = 8  # a prompt is the first lines of a function from the held-out split
REQUEST_TIMEOUT_S, RUN_TIMEOUT_S = 300.0, 3600.0
Clock = Callable[[], float]


@dataclass
class RequestRecord:
    """What the client saw of one request; times in seconds on the run's clock. A failed request
    (an error status, a broken or malformed stream, an abort, a timeout, never sent) has ``error`` set."""
    index: int
    send_time: float
    token_times: list[float] = field(default_factory=list)  # the arrival of each token event
    finish_time: float | None = None  # the last token event's arrival (not streamed: the body's); failed: the end
    prompt_tokens: int | None = None  # from the server's usage; None when it sent none
    output_tokens: int = 0  # from the server's usage, else the number of token events
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class LoadResult:
    records: list[RequestRecord]  # one per body, in the bodies' order
    duration_s: float


class SSEParser:
    """Server-sent events from raw bytes as they come off the network: a line, or an event, may
    be split across chunks, and one chunk may hold several events. ``feed`` returns the ``data``
    of each event completed so far (its ``data:`` lines joined by newlines; ``[DONE]`` included);
    comment lines (``:...``) and other fields are skipped. Lines end with LF or CRLF."""

    def __init__(self) -> None:
        self._pending = b""  # the start of a line whose end has not arrived
        self._data: list[str] = []  # the data lines of the event being read

    def feed(self, chunk: bytes) -> list[str]:
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        events = []
        for raw in lines:  # split at LF, a UTF-8 character is never cut
            line = raw.removesuffix(b"\r").decode()
            if not line and self._data:  # a blank line ends the event
                events.append("\n".join(self._data))
                self._data = []
            elif line.startswith("data:"):
                self._data.append(line[len("data:"):].removeprefix(" "))
        return events


async def send_request(client: httpx.AsyncClient, url: str, body: dict, index: int, *,
                       timeout_s: float = REQUEST_TIMEOUT_S, deadline: float = math.inf,
                       clock: Clock = time.perf_counter) -> RequestRecord:
    """POST one completion ``body`` to ``url`` and record what the client saw, streamed or not
    (``body["stream"]``). The request may take ``timeout_s``, and must end by ``deadline`` (the
    run's, on ``clock``); past it, it is not sent. A failure, an aborted reply included, is
    recorded in ``error``, never raised and never retried; ``finish_time`` is then when it was
    seen, else when the answer was whole (the module docstring)."""
    record = RequestRecord(index, send_time=clock())
    limit = min(timeout_s, deadline - record.send_time)
    if limit <= 0:
        record.finish_time, record.error = record.send_time, f"not sent: the run's {deadline:g} s had passed"
        return record
    try:
        async with asyncio.timeout(limit), client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {_error_message(await response.aread())}"
            elif body.get("stream"):
                await _read_stream(response, record, clock)
            else:
                content = await response.aread()
                record.finish_time = clock()
                _read_completion(json.loads(content), record)
    except TimeoutError:
        record.error = (f"timed out after {timeout_s:g} s" if limit == timeout_s
                        else f"timed out: the run's {deadline:g} s passed")
    except httpx.HTTPError as e:
        record.error = f"connection failed: {type(e).__name__}: {e}"
    except (ValueError, LookupError, TypeError) as e:  # JSON that is not a completion
        record.error = f"malformed reply: {type(e).__name__}: {e}"
    if record.error is None and record.finish_reason == "abort":
        record.error = f"aborted by the server after {record.output_tokens} tokens"
    if record.error is not None:
        record.finish_time = clock()
    return record


def _error_message(content: bytes) -> str:
    """The message of an OpenAI-style error body, else the body's start."""
    try:
        return json.loads(content)["error"]["message"]
    except (ValueError, LookupError, TypeError):
        return content[:200].decode(errors="replace")


async def _read_stream(response: httpx.Response, record: RequestRecord, clock: Clock) -> None:
    """Every token event's arrival and text, the finish reason and the usage, up to [DONE]; the
    reply's finish time is its last token event's arrival."""
    parser, usage, done = SSEParser(), None, False
    async for chunk in response.aiter_bytes():
        now = clock()
        for data in parser.feed(chunk):
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            for choice in event["choices"]:  # a token event; the usage event has none
                record.token_times.append(now)
                record.finish_time = now
                record.text += choice["text"]
                record.finish_reason = choice.get("finish_reason")  # the last token's event has it
            usage = event.get("usage") or usage
    _count_tokens(record, usage)
    if not done:
        record.error = f"the stream ended before data: [DONE] after {len(record.token_times)} tokens"
    elif not record.token_times:
        record.error = "the stream ended at data: [DONE] without a token event"


def _read_completion(reply: dict, record: RequestRecord) -> None:
    choice = reply["choices"][0]
    record.text, record.finish_reason = choice["text"], choice["finish_reason"]
    _count_tokens(record, reply["usage"])


def _count_tokens(record: RequestRecord, usage: dict | None) -> None:
    """Token counts from the server's usage; without it, one output token per token event."""
    record.prompt_tokens = usage["prompt_tokens"] if usage else None
    record.output_tokens = usage["completion_tokens"] if usage else len(record.token_times)


def reset_prefix_cache(url: str, api_key: str | None = None, wait_s: float = 10.0) -> int | None:
    """Empty the prefix cache of the server at ``url`` (``POST /reset_prefix_cache``), so that what is measured
    next starts cold; returns the blocks it forgot, or None where the server does not say. labkit's server
    answers a busy engine with a 409: it is asked again every 0.1 s for about ``wait_s`` seconds. vLLM's server
    has the endpoint only with ``VLLM_SERVER_DEV_MODE=1`` (else a 404), answers 200 with no count, and in some
    versions ``{"success": false}`` where it could not reset. A refusal raises RuntimeError with the server's
    words; a server that cannot be reached, httpx's error."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + wait_s
    with httpx.Client(headers=headers, timeout=wait_s + 10.0, trust_env=False) as client:
        while ((response := client.post(f"{url.rstrip('/')}/reset_prefix_cache")).status_code == 409
               and time.monotonic() < deadline):
            time.sleep(0.1)
    try:
        answer = response.json() if response.content else {}
    except ValueError:
        answer = {}
    if response.status_code != 200 or (isinstance(answer, dict) and answer.get("success") is False):
        raise RuntimeError(f"{url.rstrip('/')}/reset_prefix_cache answered {response.status_code}: "
                           f"{response.text[:300]}")
    return answer.get("blocks_forgotten") if isinstance(answer, dict) else None


async def run_load(url: str, bodies: Sequence[dict], rate: float | None = None, concurrency: int | None = None,
                   seed: int = 0, api_key: str | None = None, timeout_s: float = RUN_TIMEOUT_S,
                   request_timeout_s: float = REQUEST_TIMEOUT_S, *, exact_rate: bool = False) -> LoadResult:
    """Send ``bodies`` to the server at ``url`` (e.g. http://127.0.0.1:8000) either as Poisson
    arrivals at ``rate`` requests/s (seeded, open loop; with ``exact_rate``, their gaps scaled to
    make exactly that rate, see ``poisson_arrivals``) or keeping ``concurrency`` requests in
    flight (closed loop). Each request may take ``request_timeout_s``, the run ``timeout_s``:
    what is still running then fails as timed out, what was not yet sent fails as not sent."""
    if (rate is None) == (concurrency is None):
        raise ValueError(f"rate={rate}, concurrency={concurrency}: give exactly one of them")
    if not bodies or (concurrency is not None and concurrency < 1) or not min(timeout_s, request_timeout_s) > 0:
        raise ValueError(f"{len(bodies)} bodies and concurrency={concurrency} must be >= 1, "
                         f"timeout_s={timeout_s} and request_timeout_s={request_timeout_s} > 0")
    offsets = poisson_arrivals(len(bodies), rate, seed, exact_rate) if rate is not None else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # no queue in the client
    async with httpx.AsyncClient(headers=headers, timeout=None, limits=limits, trust_env=False) as client:
        start = time.perf_counter()  # once the client is set up (its TLS context alone takes tens of ms)

        def clock() -> float:
            return time.perf_counter() - start

        def send(index: int) -> Awaitable[RequestRecord]:
            return send_request(client, f"{url.rstrip('/')}/v1/completions", bodies[index], index,
                                timeout_s=request_timeout_s, deadline=timeout_s, clock=clock)

        if offsets is not None:
            records = await _at_offsets(send, [min(t, timeout_s) for t in offsets], clock)
        else:
            records = await _at_concurrency(send, len(bodies), concurrency)
        duration = clock()
    return LoadResult(sorted(records, key=lambda r: r.index), duration)


async def _at_offsets(send: Callable[[int], Awaitable[RequestRecord]], offsets: list[float],
                      clock: Clock) -> list[RequestRecord]:
    """Open loop: start request i at offsets[i], whether or not earlier ones have finished."""
    tasks = []
    for index, offset in enumerate(offsets):
        await asyncio.sleep(max(0.0, offset - clock()))
        tasks.append(asyncio.create_task(send(index)))
    return list(await asyncio.gather(*tasks))


async def _at_concurrency(send: Callable[[int], Awaitable[RequestRecord]], n: int,
                          concurrency: int) -> list[RequestRecord]:
    """Closed loop: ``concurrency`` workers, each sending the next request when its last is done."""
    indices = iter(range(n))  # shared: each index is taken by exactly one worker

    async def worker() -> list[RequestRecord]:
        return [await send(index) for index in indices]

    per_worker = await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return [record for records in per_worker for record in records]


def system_prompt(chars: int) -> str:
    """A long system prompt of ``chars`` characters for every prompt to share (``corpus_prompts``'
    ``shared_prefix``): the held-out split's functions in file order, each followed by a blank
    line, cut at ``chars``; the same on every call."""
    if chars < 1:
        raise ValueError(f"chars={chars} must be >= 1")
    prompt = ""
    for text in functions("validation"):
        if len(prompt) >= chars:
            return prompt[:chars]
        prompt += text + "\n\n"
    raise ValueError(f"chars={chars}: the held-out split has only {len(prompt)} characters of functions")


def corpus_prompts(n: int, seed: int = 0, shared_prefix: str | None = None) -> list[str]:
    """``n`` prompts: functions drawn (seeded, with replacement) from the held-out split, each cut
    to its first ``PROMPT_LINES`` lines, each after ``shared_prefix`` when given."""
    pool = functions("validation")
    picks = torch.randint(len(pool), (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [(shared_prefix or "") + "\n".join(pool[i].splitlines()[:PROMPT_LINES]) + "\n" for i in picks]


def output_lengths(n: int, low: int = 16, high: int = 256, seed: int = 0) -> list[int]:
    """``n`` output token counts, uniform in [low, high] (vLLM's random dataset), seeded."""
    return uniform(low, high)(n, torch.Generator().manual_seed(seed))


def completion_bodies(prompts: Sequence[str], lengths: Sequence[int], *, stream: bool = True,
                      model: str | None = None, temperature: float = 0.0) -> list[dict]:
    """One /v1/completions request per prompt, generating exactly its length (``ignore_eos``, as
    serving benchmarks do); streamed ones ask for the usage event."""
    if len(prompts) != len(lengths):
        raise ValueError(f"{len(prompts)} prompts but {len(lengths)} output lengths: give one length per prompt")
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    if model:
        extra["model"] = model
    return [{"prompt": p, "max_tokens": k, "temperature": temperature, "ignore_eos": True, "stream": stream} | extra
            for p, k in zip(prompts, lengths)]


def summarize(records: Sequence[RequestRecord], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """A run's figures, as vLLM's ``benchmark_serving`` defines them (see the module docstring):
    counts, throughputs and goodput per second of ``duration_s``, latency statistics in ms over
    the completed requests, and how often each error occurred. Without an SLO, every completed
    request is good; a one-token or not-streamed reply has no TPOT, and so meets any TPOT limit."""
    if not duration_s > 0:
        raise ValueError(f"duration_s={duration_s} must be > 0")
    done = [r for r in records if r.error is None]
    per_request = [_latencies(r) for r in done]
    good = sum(_meets(m, slo_ttft_ms, slo_tpot_ms) for m in per_request)
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done) if all(r.prompt_tokens is not None for r in done) else None
    return {"completed": len(done), "failed": len(records) - len(done), "duration_s": duration_s,
            "prompt_tokens": prompt, "output_tokens": output,
            "request_throughput": len(done) / duration_s, "output_throughput": output / duration_s,
            "total_token_throughput": None if prompt is None else (prompt + output) / duration_s,
            "goodput": good / duration_s, "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
            "errors": dict(Counter(r.error for r in records if r.error is not None))
            } | latency_figures(per_request, PERCENTILES)


def _latencies(record: RequestRecord) -> dict:
    """``request_metrics`` of a completed request, with its TPOT over the output tokens the server
    counted rather than over its token events (vLLM's); no TPOT for a reply that was not streamed."""
    metrics = request_metrics(record.send_time, record.token_times or [record.finish_time], record.finish_time)
    n = record.output_tokens if record.token_times else 0
    return metrics | {"tpot": (metrics["e2e"] - metrics["ttft"]) / (n - 1) if n > 1 else None}


def _meets(metrics: dict, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    return ((slo_ttft_ms is None or metrics["ttft"] * 1e3 <= slo_ttft_ms)
            and (slo_tpot_ms is None or metrics["tpot"] is None or metrics["tpot"] * 1e3 <= slo_tpot_ms))


def format_report(summary: dict) -> str:
    """The summary as a small table, for the command line and the notebook."""
    total, stats = summary["total_token_throughput"], ("mean", "median", "p90", "p99")
    slos = ", ".join(f"{name.upper()} <= {summary[f'slo_{name}_ms']:g} ms" for name in ("ttft", "tpot")
                     if summary[f"slo_{name}_ms"] is not None)
    lines = [f"requests    {summary['completed']} completed, {summary['failed']} failed "
             f"in {summary['duration_s']:.2f} s",
             f"throughput  {summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s, "
             + ("total tok/s unknown (no usage)" if total is None else f"{total:.1f} total tok/s"),
             f"goodput     {summary['goodput']:.2f} req/s ({slos or 'no SLO: every completed request'})",
             "ms    " + "".join(f"{stat:>10}" for stat in stats)]
    lines += [f"{name.upper():<6}" + "".join(f"{summary[f'{stat}_{name}_ms']:>10.1f}" for stat in stats)
              for name in ("ttft", "tpot", "itl", "e2e")]
    lines += [f"error       {count} x {message}" for message, count in summary["errors"].items()]
    return "\n".join(lines)


def _finite(value: object) -> object:
    """``value`` with every NaN or infinite float (a figure of a run with nothing to measure) made
    None, which JSON writes as null: NaN is no JSON."""
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit.loadgen URL``: load a completions server with corpus prompts, print the report."""
    parser = argparse.ArgumentParser(prog="python -m labkit.loadgen", description=main.__doc__)
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    count, positive = option_in(int, 1), option_in(float, 0.0, above=True)
    parser.add_argument("--requests", type=count, required=True)
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=positive, help="Poisson arrivals, requests per second (open loop)")
    load.add_argument("--concurrency", type=count, help="requests kept in flight (closed loop)")
    parser.add_argument("--exact-rate", action="store_true",
                        help="scale the random gaps so that the arrivals make exactly --rate (a short run's would stray)")
    parser.add_argument("--min-tokens", type=count, default=16, help="output tokens, uniform from min to max")
    parser.add_argument("--max-tokens", type=count, default=256)
    parser.add_argument("--shared-prefix-chars", type=option_in(int, 0), default=0,
                        help="start every prompt with one shared system prompt of this many characters")
    parser.add_argument("--no-stream", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--slo-ttft-ms", type=positive)
    parser.add_argument("--slo-tpot-ms", type=positive)
    parser.add_argument("--api-key")
    parser.add_argument("--seed", type=int, default=0, help="prompts; seed + 1: output lengths; seed + 2: arrivals")
    parser.add_argument("--timeout-s", type=positive, default=RUN_TIMEOUT_S, help="for the whole run")
    parser.add_argument("--request-timeout-s", type=positive, default=REQUEST_TIMEOUT_S)
    parser.add_argument("--json", type=Path, help="also write the summary and every record here")
    parser.add_argument("--reset-prefix-cache", action="store_true",
                        help="empty the server's prefix cache first (POST /reset_prefix_cache), so the run starts cold")
    args = parser.parse_args(argv)
    if args.min_tokens > args.max_tokens:
        parser.error(f"--min-tokens {args.min_tokens} is more than --max-tokens {args.max_tokens}: lower it too")
    if args.json and (args.json.is_dir() or not args.json.parent.is_dir()):  # now, not after the run and its records
        parser.error(f"--json {args.json}: " + ("a folder: name a file in it" if args.json.is_dir() else
                                                 f"its folder {args.json.parent} does not exist"))
    prefix = system_prompt(args.shared_prefix_chars) if args.shared_prefix_chars else None
    bodies = completion_bodies(corpus_prompts(args.requests, args.seed, prefix),
                               output_lengths(args.requests, args.min_tokens, args.max_tokens, args.seed + 1),
                               stream=not args.no_stream, model=args.model)
    if args.reset_prefix_cache:
        try:
            forgotten = reset_prefix_cache(args.url, args.api_key)
        except (RuntimeError, httpx.HTTPError) as error:
            print(f"error: the prefix cache was not reset, so nothing was sent: {error}", file=sys.stderr)
            return 1
        print("prefix cache reset" + (f": {forgotten} blocks forgotten" if forgotten is not None else
                                      " (the server did not say how many blocks it forgot)"))
    result = asyncio.run(run_load(args.url, bodies, args.rate, args.concurrency, args.seed + 2, args.api_key,
                                  args.timeout_s, args.request_timeout_s, exact_rate=args.exact_rate))
    summary = summarize(result.records, result.duration_s, args.slo_ttft_ms, args.slo_tpot_ms)
    print(format_report(summary))
    if args.json:
        records = [asdict(r) for r in result.records]
        args.json.write_text(json.dumps(_finite({"summary": summary, "records": records}), indent=1, allow_nan=False))
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
