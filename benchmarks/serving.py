"""labkit's server against the offline engine, and against the server a newcomer writes (issue 33).

    .venv/bin/python benchmarks/serving.py [--quick] [--requests 128] [--repeats 1] [--threads 1] [--rates R R R]
                                           [--naive-requests 24] [--rate-requests 64] [--naive-rate-requests 16]

One workload: prompts from the corpus (``loadgen.corpus_prompts``: the first 8 lines of held-out
functions), output lengths uniform in [16, 256] (``loadgen.output_lengths``), EOS ignored so that
each request makes exactly its length, greedy; the shipped ``target`` model in fp32. Every labkit
engine has the server's default settings (``python -m labkit.serve``: 512 blocks of 16,
max_num_seqs 32, max_num_batched_tokens 512), labkit's C++ paged decode operator (built before any
timing) and no prefix caching (the runs follow one another on one server, and a run would find
an earlier run's prompts in the cache).

1. The offline engine, in this process: ``Engine.run`` with every request at t = 0; output
   tokens/s = the requests' tokens / the wall time of ``run``. It runs before part 2 and after
   each of its ``--repeats`` runs, and part 2's goal takes the median of its runs (this machine's
   speed drifts from minute to minute) against the server's median run.
2. labkit's server (``labkit.background.start_server``, a process of its own, whose engine steps
   in a process of its own: ``--engine process``, the default) driven by ``labkit.loadgen`` at
   saturation: every request sent at once, streamed; output tokens/s over the run (first send to
   last reply), with vLLM's TTFT/TPOT/ITL/E2E. Goal: at least 90% of the offline engine's output
   tokens/s. Each of its runs is followed by one of the offline engine and one of the same
   server with its engine in a thread of the server's process (``--engine thread``), which shares
   the GIL with the event loop: no goal, the comparison says what the second process buys.
   Printed with them, where the time went: the engine's steps and wall time per step
   (``/metrics``' ``labkit:engine_steps``) against the offline engine's; the CPU time per output
   token of the engine (its process, or the server's threads but the main one: torch starts no
   other with one thread, the rest sleep), of the server's main thread (the event loop: HTTP,
   JSON, detokenizing, events), of the server's other threads beside an engine process (the
   pipe's reader and writer) and of the load generator (this process), from /proc, against the
   offline engine's; and the share of the run the engine computed, its CPU seconds over the wall time:
   the rest of the time it waited, for the GIL (a thread's, while the event loop runs Python) or
   for a core. If the goal is missed, the same requests also run not streamed, which separates
   the cost of one event per token from the rest of the server.
3. The baseline a newcomer would write (``benchmarks/naive_server.py``): FastAPI around
   transformers' ``generate()`` on the same weights (``labkit.load.save_hf``), one request at a
   time behind a lock, one event per token through a streamer. At saturation with the first
   ``--naive-requests`` requests only: it serves them one by one at batch 1, so its tokens/s do
   not depend on how many wait. Goal: labkit's server at least 5x its output tokens/s.
4. What streaming costs per token, at the client: ``--pairs`` requests of ``--pair-tokens`` tokens
   at concurrency 1, each sent streamed and not streamed, in alternating order; per pair
   (E2E streamed - E2E not streamed) / tokens, and their mean. Both go through the
   same engine and the same incremental detokenizing; only the per-token server-sent event (its
   JSON, the ASGI send, the socket) and its parsing at the client differ. (The client's ITL
   against the engine's own, from /metrics, would not do: a delay that every token pays shifts
   each arrival alike, and a gap between two arrivals does not show it.) Long requests, so that
   what a reply costs once (its headers, the usage event, [DONE]) weighs little per token. A
   request's time at batch 1 wanders by tens of percent from one to the next here, so one pair
   says little: the goal is met only if the whole 95% interval of the mean over the pairs (mean
   + 1.96 standard errors) is under 1 ms per token.
5. Poisson arrivals at three rates (by default 0.5, 0.9 and 1.5 times the request rate that
   labkit's server reached at saturation: below, near and above it), the first
   ``--rate-requests`` requests for labkit's server, the first ``--naive-rate-requests`` for the
   naive one (bounded: a run never takes longer than ``--run-timeout``). Throughput, TTFT, TPOT,
   ITL and E2E percentiles, and goodput: requests per second with TTFT <= 500 ms (the course texts'
   rule of thumb for chat) and TPOT <= 50 ms (20 tokens/s: text comes faster than anyone reads,
   and on this CPU a full batch of 32 decodes within it). Goal: labkit's p99 TTFT lower than
   the naive server's at every rate. Above its capacity the naive server's queue grows with every
   request, so with fewer requests its p99 TTFT is lower than it would be with as many as
   labkit's: the comparison favours it.

Threads: this machine has 2 cores, shared by each server and this load generator. The engine
computes with ``--threads`` torch threads (1 by default) everywhere: OMP_NUM_THREADS in both
servers' processes, ``torch.set_num_threads`` here for the offline engine. With one, the server's
engine thread computes on one core while its event loop and the load generator use the other;
with two, torch's threads would share their cores with them and wait for each other at every
operation (issue 31: for this model's decode step one thread was as fast as two on a quiet
machine, and far steadier beside other work). The offline engine gets the same thread count, so the comparison
measures what serving adds, not a different thread count. Servers listen on 127.0.0.1 on free
ports and are always stopped.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

import labkit
from labkit import loadgen
from labkit.background import BackgroundServer, start_server
from labkit.device import device_name
from labkit.engine import Engine, Request, SchedulerConfig
from labkit.generate import SamplingParams, eos_id_of
from labkit.kernels.paged_decode_cpu import build, paged_decode_cpu
from labkit.load import save_hf
from labkit.metrics import latency_figures, request_metrics
from labkit.model import Transformer
from labkit.serve import parse_args as serve_defaults

GOALS = {"server / offline engine": 0.9, "server / naive server": 5.0, "streaming cost, ms per token": 1.0}
RATE_FACTORS = (0.5, 0.9, 1.5)  # of labkit's saturation request rate: below, near, above
NAIVE_SERVER = Path(__file__).with_name("naive_server.py")
QUICK = dict(requests=8, naive_requests=2, rate_requests=6, naive_rate_requests=2, pairs=4, pair_tokens=32)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CORES = len(os.sched_getaffinity(0))  # the cores this process may use
SERVER_COUNTERS = ("engine_steps_total", "generation_tokens_total", "inter_token_latency_seconds_sum",
                   "inter_token_latency_seconds_count")


@dataclass
class Workload:
    """The requests: prompt strings, their token ids (the server's tokenizer) and output lengths."""

    prompts: list[str]
    ids: list[list[int]]
    lengths: list[int]

    def bodies(self, n: int | None = None, stream: bool = True) -> list[dict]:
        return loadgen.completion_bodies(self.prompts[:n], self.lengths[:n], stream=stream)

    def requests(self) -> list[Request]:
        params = [SamplingParams(max_new_tokens=k, temperature=0.0, stop_at_eos=False) for k in self.lengths]
        return [Request(i, ids, p) for i, (ids, p) in enumerate(zip(self.ids, params))]


@dataclass
class Row:
    """One line of the table: a run's name and its figures (``loadgen.summarize``'s keys, and more)."""

    name: str
    figures: dict


# the offline engine -------------------------------------------------------------------------------


def engine_settings(args: argparse.Namespace) -> dict:
    """The engine's settings, as ``start_server`` options (the offline engine gets the same)."""
    return dict(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, decode_kernel="cpp", no_prefix_caching=True,
                device="cpu", max_waiting=max(args.requests, 256))


def run_offline(model: Transformer, eos_id: int | None, workload: Workload, args: argparse.Namespace) -> Row:
    """``Engine.run`` on the whole workload at t = 0: latencies on the engine's clock, no goodput;
    its steps, the CPU seconds this process spent, and the tokens."""
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = Engine(model, args.num_blocks, args.block_size, config, prefix_caching=False, eos_id=eos_id,
                    decode_kernel=paged_decode_cpu)
    requests = workload.requests()
    start, cpu = time.perf_counter(), time.process_time()
    done = engine.run(requests)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    per_request = [request_metrics(r.arrival_time, r.token_times, r.finish_time) for r in done]
    tokens = sum(len(r.output) for r in done)
    figures = {"completed": len(done), "failed": 0, "duration_s": wall, "output_tokens": tokens,
               "request_throughput": len(done) / wall, "output_throughput": tokens / wall, "goodput": None,
               "steps": len(engine.log), "cpu_s": cpu, "outputs": [r.output for r in done]}
    return Row("offline engine, in-process", figures | latency_figures(per_request, loadgen.PERCENTILES))


# driving a server ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of a process's main thread, and of all its other threads (those
    that have exited included), from /proc."""
    def seconds(path: str) -> float:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: the file's 14th, 15th fields
    total, main = seconds(f"/proc/{pid}/stat"), seconds(f"/proc/{pid}/task/{pid}/stat")
    return main, total - main


def scrape(url: str) -> dict[str, float]:
    """labkit's server's counters (``SERVER_COUNTERS``) from its /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return {name: samples[f"labkit:{name}"] for name in SERVER_COUNTERS}


def drive(server: BackgroundServer, name: str, bodies: list[dict], args: argparse.Namespace,
          rate: float | None = None, concurrency: int | None = None, counters: bool = False) -> Row:
    """One load run against ``server``: its summary (the SLO applied), the CPU seconds of the server's
    main thread, of its other threads, of its engine's process (None without one) and of this
    client, the texts, and with ``counters`` how much the server's ``SERVER_COUNTERS`` grew
    (labkit's server only)."""
    before = scrape(server.url) if counters else {}
    engine = server.engine_pid
    engine_cpu = sum(cpu_seconds(engine)) if engine else None
    server_cpu, client_cpu = cpu_seconds(server.process.pid), time.process_time()
    result = asyncio.run(loadgen.run_load(server.url, bodies, rate=rate, concurrency=concurrency, seed=args.seed + 2,
                                          timeout_s=args.run_timeout))
    client_cpu = time.process_time() - client_cpu
    main, other = (b - a for a, b in zip(server_cpu, cpu_seconds(server.process.pid)))
    figures = loadgen.summarize(result.records, result.duration_s, args.slo_ttft_ms, args.slo_tpot_ms)
    figures |= {"cpu_main_s": main, "cpu_other_s": other, "cpu_client_s": client_cpu,
                "cpu_engine_s": sum(cpu_seconds(engine)) - engine_cpu if engine else None,
                "texts": [r.text for r in result.records]}
    if counters:
        figures |= {key: value - before[key] for key, value in scrape(server.url).items()}
    return Row(name, figures)


def warm_up(server: BackgroundServer, workload: Workload) -> None:
    """Two short requests, so that no timed run pays for the first ones."""
    bodies = loadgen.completion_bodies(workload.prompts[-2:], [8, 8])
    asyncio.run(loadgen.run_load(server.url, bodies, concurrency=2, timeout_s=120))


def streaming_cost(url: str, workload: Workload, args: argparse.Namespace) -> list[float]:
    """Per pair, (E2E streamed - E2E not streamed) / tokens, in ms (the module docstring's part 4)."""
    prompts = [workload.prompts[i % len(workload.prompts)] for i in range(args.pairs)]
    lengths = [args.pair_tokens] * args.pairs
    streamed, whole = (loadgen.completion_bodies(prompts, lengths, stream=stream) for stream in (True, False))

    async def pairs() -> list[float]:
        costs, target = [], url + "/v1/completions"
        async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
            for i in range(args.pairs):
                e2e = {}
                for body in (streamed[i], whole[i]) if i % 2 == 0 else (whole[i], streamed[i]):
                    record = await loadgen.send_request(client, target, body, i)
                    if record.error is not None or record.output_tokens != args.pair_tokens:
                        raise RuntimeError(f"request {i} of the streaming pairs failed: {record.error}, "
                                           f"{record.output_tokens} of {args.pair_tokens} tokens")
                    e2e[body["stream"]] = record.finish_time - record.send_time
                costs.append((e2e[True] - e2e[False]) / args.pair_tokens * 1e3)
        return costs
    return asyncio.run(pairs())


def start_naive_server(model: Transformer, tokenizer: Tokenizer, folder: Path, env: dict[str, str]) -> BackgroundServer:
    """``naive_server.py`` on the model's weights, saved in ``folder`` as a Hugging Face checkpoint."""
    save_hf(model, folder, tokenizer)
    command = [sys.executable, str(NAIVE_SERVER), str(folder), "--port", "{port}"]
    return BackgroundServer(command, env=env).start(timeout_s=120)


# printing -----------------------------------------------------------------------------------------

COLUMNS = [("done", "completed", 5, 0), ("wall s", "duration_s", 7, 1), ("out tok/s", "output_throughput", 10, 1),
           ("req/s", "request_throughput", 7, 2), ("goodput", "goodput", 8, 2)] + [
    (f"{name.upper()} p{q}" if q == 50 else f"p{q}", f"{'median' if q == 50 else f'p{q}'}_{name}_ms",
     len(name) + 7 if q == 50 else 7, 1 if name in ("tpot", "itl") else 0)
    for name in ("ttft", "tpot", "itl", "e2e") for q in loadgen.PERCENTILES]


def print_table(rows: list[Row]) -> None:
    """Each run's throughputs, goodput and latency percentiles (ms)."""
    print(f"{'':<30}" + "".join(f"{label:>{width}}" for label, _, width, _ in COLUMNS))
    for row in rows:
        values = [(row.figures.get(key), width, digits) for _, key, width, digits in COLUMNS]
        cells = [f"{'-':>{width}}" if value is None or math.isnan(value) else f"{value:>{width}.{digits}f}"
                 for value, width, digits in values]
        failed = row.figures["failed"]
        print(f"{row.name:<30}" + "".join(cells) + (f"  {failed} failed" if failed else ""))


def print_split(offline: list[Row], served: Row, threaded: Row) -> None:
    """Where the servers' time went at saturation, against the offline engine's runs: steps, wall
    time per step, CPU time per output token of each part that works, and the share of the run
    the engine computed."""
    for row in offline:
        f = row.figures
        print(f"  offline engine: {f['steps']} steps, {f['duration_s'] / f['steps'] * 1e3:.1f} ms each; "
              f"{f['cpu_s'] / f['output_tokens'] * 1e6:.0f} us of CPU a token")
    for row in (served, threaded):
        s = row.figures
        tokens, steps, in_process = s["output_tokens"], s["engine_steps_total"], s["cpu_engine_s"] is not None
        engine_s = s["cpu_engine_s"] if in_process else s["cpu_other_s"]
        parts = {"engine process" if in_process else "engine thread (and the idle others)": engine_s,
                 "event-loop thread": s["cpu_main_s"]}
        parts |= {"the server's other threads": s["cpu_other_s"]} if in_process else {}
        parts |= {"load generator": s["cpu_client_s"]}
        print(f"  {row.name}: {steps:.0f} engine steps, {s['duration_s'] / steps * 1e3:.1f} ms of the run each; "
              "CPU a token: " + ", ".join(f"{name} {cpu / tokens * 1e6:.0f} us" for name, cpu in parts.items()))
        engine_itl = s["inter_token_latency_seconds_sum"] / s["inter_token_latency_seconds_count"] * 1e3
        print(f"    the engine {'process' if in_process else 'thread'} computed for {engine_s / s['duration_s']:.0%} of "
              f"the run (the rest it waited: {'for a core' if in_process else 'for the GIL, or for a core'}); "
              f"all used {sum(parts.values()):.1f} CPU s of the {CORES} cores' {CORES * s['duration_s']:.1f} s; mean "
              f"inter-token time {engine_itl:.1f} ms on the engine's clock (/metrics), {s['mean_itl_ms']:.1f} ms at "
              "the client")


def agreement(offline: Row, served: Row, tokenizer: Tokenizer) -> str:
    """How many of a server's texts equal the offline engine's greedy outputs, decoded."""
    texts = [tokenizer.decode(ids) for ids in offline.figures["outputs"]]
    return f"{sum(a == b for a, b in zip(texts, served.figures['texts']))}/{len(served.figures['texts'])}"


def median_run(rows: list[Row]) -> Row:
    """The run with the median output throughput (the lower middle one of an even count)."""
    return sorted(rows, key=lambda row: row.figures["output_throughput"])[(len(rows) - 1) // 2]


# the benchmark ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = serve_defaults([])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="target")
    parser.add_argument("--quick", action="store_true", help="a smoke run of about a minute: "
                        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    parser.add_argument("--requests", type=int, default=128, help="the workload; the saturation runs")
    parser.add_argument("--repeats", type=int, default=1,
                        help="saturation runs of labkit's server, each followed by one of the offline engine")
    parser.add_argument("--naive-requests", type=int, default=24, help="the naive server's saturation run")
    parser.add_argument("--rate-requests", type=int, default=64, help="labkit's server at each Poisson rate")
    parser.add_argument("--naive-rate-requests", type=int, default=16, help="the naive server at each rate")
    parser.add_argument("--rates", type=float, nargs=3, default=None,
                        help=f"requests/s (default: {', '.join(map(str, RATE_FACTORS))} x labkit's saturation rate)")
    parser.add_argument("--pairs", type=int, default=32, help="streamed / not streamed pairs (part 4)")
    parser.add_argument("--pair-tokens", type=int, default=128, help="output tokens of each pair's requests")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every engine (see the docstring)")
    parser.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--run-timeout", type=float, default=150.0, help="seconds any one load run may take")
    parser.add_argument("--seed", type=int, default=0, help="prompts; +1: output lengths; +2: arrivals")
    args = parser.parse_args(argv)
    if args.pairs < 2:
        parser.error(f"--pairs {args.pairs}: give at least 2, the interval of the mean needs their spread")
    if args.quick:
        for name, value in QUICK.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    return args


@dataclass
class Runs:
    """Every run of the benchmark: the offline engine's and labkit's saturation runs (in turn: the
    engine in a process, offline, the engine in a thread), the not-streamed one (only if the first
    goal is missed), the streaming pairs' costs (ms a token), the Poisson rates and each server's
    runs at them, and the naive server's saturation run."""

    offline: list[Row]
    served: list[Row]
    threaded: list[Row]
    unstreamed: Row | None
    costs: list[float]
    rates: list[float]
    poisson: list[Row]
    naive_saturated: Row | None = None
    naive_poisson: list[Row] | None = None

    @property
    def saturated(self) -> Row:
        return median_run(self.served)

    @property
    def threaded_ratio(self) -> float:
        return median_run(self.threaded).figures["output_throughput"] / self.offline_tps

    @property
    def offline_tps(self) -> float:
        return statistics.median(row.figures["output_throughput"] for row in self.offline)

    @property
    def ratio(self) -> float:
        return self.saturated.figures["output_throughput"] / self.offline_tps


def print_header(args: argparse.Namespace, model: Transformer, workload: Workload) -> None:
    print(f"{datetime.date.today()}  {device_name('cpu')}  torch {torch.__version__}  transformers "
          f"{transformers.__version__}  model {args.model} ({model.num_parameters():,} parameters, fp32)")
    print("command: " + " ".join([os.path.relpath(sys.executable), *sys.argv]))
    print(f"{CORES} cores, shared by each server process and this load generator; every engine (offline, "
          f"labkit's server, transformers in the naive server) computes with {args.threads} torch "
          f"thread{'s' * (args.threads != 1)}")
    lengths = [len(ids) for ids in workload.ids]
    print(f"workload: {args.requests} corpus prompts of {min(lengths)}..{max(lengths)} tokens (mean "
          f"{statistics.mean(lengths):.0f}), outputs uniform in [16, 256] ({sum(workload.lengths)} tokens), "
          "EOS ignored, greedy")
    shown = {k: v for k, v in engine_settings(args).items() if k not in ("device", "max_waiting")}
    print("engine: " + ", ".join(f"{k} {v}" for k, v in shown.items())
          + f"; goodput's SLO: TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms\n")


def measure_labkit(args: argparse.Namespace, model: Transformer, eos_id: int | None, workload: Workload,
                   env: dict[str, str]) -> Runs:
    """Parts 1, 2, 4 and 5 on labkit's server (see the module docstring)."""
    run_offline(model, eos_id, Workload(workload.prompts[:4], workload.ids[:4], [16] * 4), args)  # warm-up
    offline, served, threaded = [run_offline(model, eos_id, workload, args)], [], []
    with (start_server(args.model, env=env, **engine_settings(args)) as server,
          start_server(args.model, env=env, engine="thread", **engine_settings(args)) as in_thread):
        warm_up(server, workload)
        warm_up(in_thread, workload)
        for _ in range(args.repeats):
            served.append(drive(server, "labkit server, saturation", workload.bodies(), args,
                                concurrency=args.requests, counters=True))
            offline.append(run_offline(model, eos_id, workload, args))
            threaded.append(drive(in_thread, "engine in a thread, saturation", workload.bodies(), args,
                                  concurrency=args.requests, counters=True))
        runs = Runs(offline, served, threaded, None, [], [], [])
        if runs.ratio < GOALS["server / offline engine"]:  # then also: what does the same load cost without events?
            runs.unstreamed = drive(server, "labkit server, not streamed", workload.bodies(stream=False), args,
                                    concurrency=args.requests)
            runs.unstreamed.figures["goodput"] = None  # its TTFT is its E2E: the SLO means nothing here
        runs.costs = streaming_cost(server.url, workload, args)
        runs.rates = args.rates or [round(f * runs.saturated.figures["request_throughput"], 2) for f in RATE_FACTORS]
        runs.poisson = [drive(server, f"labkit server, {rate:g} req/s", workload.bodies(args.rate_requests), args,
                              rate=rate) for rate in runs.rates]
    return runs


def measure_naive(args: argparse.Namespace, model: Transformer, tokenizer: Tokenizer, workload: Workload,
                  env: dict[str, str], runs: Runs) -> None:
    """Parts 3 and 5 on the naive server, at labkit's rates; into ``runs``."""
    with tempfile.TemporaryDirectory() as folder, start_naive_server(model, tokenizer, Path(folder), env) as naive:
        warm_up(naive, workload)
        runs.naive_saturated = drive(naive, "naive server, saturation", workload.bodies(args.naive_requests), args,
                                     concurrency=args.naive_requests)
        runs.naive_poisson = [drive(naive, f"naive server, {rate:g} req/s", workload.bodies(args.naive_rate_requests),
                                    args, rate=rate) for rate in runs.rates]


def report(runs: Runs, tokenizer: Tokenizer, args: argparse.Namespace) -> None:
    """The table, the outputs' agreement, where the server's time went, and the streaming costs."""
    in_turn = [runs.offline[0]] + [row for trio in zip(runs.served, runs.offline[1:], runs.threaded) for row in trio]
    print_table(in_turn + ([runs.unstreamed] if runs.unstreamed else []) + [runs.naive_saturated]
                + [row for pair in zip(runs.poisson, runs.naive_poisson) for row in pair])
    print("\n(offline engine: latencies on its own clock, from t = 0; servers: at the client. wall s: first send to "
          "last reply. goodput: req/s within the SLO)")
    print(f"server texts equal to the offline engine's greedy output: "
          f"{agreement(runs.offline[0], runs.saturated, tokenizer)} (labkit), "
          f"{agreement(runs.offline[0], runs.naive_saturated, tokenizer)} (naive; float differences can flip "
          f"late tokens)")
    print("\nwhere the server's time went at saturation:")
    print_split(runs.offline, runs.saturated, median_run(runs.threaded))
    if runs.unstreamed is not None:
        u = runs.unstreamed.figures
        print(f"  not streamed, the same requests: {u['output_throughput']:.1f} tok/s "
              f"({u['output_throughput'] / runs.offline_tps:.1%} of the offline engine's), event-loop thread "
              f"{u['cpu_main_s'] / u['output_tokens'] * 1e6:.0f} us of CPU a token")
    naive_tps = runs.naive_saturated.figures["output_throughput"]
    print(f"  the naive server: {naive_tps:.1f} tok/s, one request at a time at batch 1 ({1e3 / naive_tps:.1f} ms a "
          f"token); labkit's engine offline, batches of up to {args.max_num_seqs}: {runs.offline_tps:.1f} tok/s")
    cost, upper = streaming_interval(runs.costs)
    print(f"\nstreaming cost per token, {args.pairs} pairs of {args.pair_tokens}-token requests at concurrency 1: "
          f"mean {cost:.3f} ms (95% interval up to {upper:.3f} ms), median {statistics.median(runs.costs):.3f} ms, "
          f"pairs from {min(runs.costs):.3f} to {max(runs.costs):.3f} ms")


def streaming_interval(costs: list[float]) -> tuple[float, float]:
    """The mean cost, and the top of its 95% interval (mean + 1.96 standard errors)."""
    mean = statistics.mean(costs)
    return mean, mean + 1.96 * statistics.stdev(costs) / math.sqrt(len(costs))


def print_goals(runs: Runs, args: argparse.Namespace, seconds: float) -> bool:
    """Each goal, its figure and met or MISSED; True if all are met."""
    served_tps, naive_tps = (row.figures["output_throughput"] for row in (runs.saturated, runs.naive_saturated))
    speedup, (cost, upper) = served_tps / naive_tps, streaming_interval(runs.costs)
    ttft = [(rate, p.figures["p99_ttft_ms"], n.figures["p99_ttft_ms"])
            for rate, p, n in zip(runs.rates, runs.poisson, runs.naive_poisson)]
    met = {"offline": runs.ratio >= GOALS["server / offline engine"],
           "naive": speedup >= GOALS["server / naive server"], "ttft": all(ours < theirs for _, ours, theirs in ttft),
           "streaming": upper < GOALS["streaming cost, ms per token"]}
    verdict = {name: "met" if ok else "MISSED" for name, ok in met.items()}
    print(f"\ngoals ({seconds:.0f} s in all):")
    print(f"  server >= {GOALS['server / offline engine']:.0%} of the offline engine's output tok/s: {runs.ratio:.1%} "
          f"({served_tps:.1f} against {runs.offline_tps:.1f}, the median of "
          + ", ".join(f"{row.figures['output_throughput']:.1f}" for row in runs.offline) + f"), {verdict['offline']}"
          f" (its engine in a thread of the server instead: {runs.threaded_ratio:.1%}, no goal)")
    print(f"  server >= {GOALS['server / naive server']:g}x the naive server's output tok/s: {speedup:.2f}x "
          f"({served_tps:.1f} against {naive_tps:.1f}), {verdict['naive']}")
    print("  p99 TTFT below the naive server's at the same rate: "
          + "; ".join(f"{rate:g} req/s {ours:.0f} against {theirs:.0f} ms" for rate, ours, theirs in ttft)
          + f", {verdict['ttft']}")
    print(f"  streaming adds < {GOALS['streaming cost, ms per token']:g} ms a token at the client: {cost:.3f} ms, "
          f"the 95% interval up to {upper:.3f} ms ({args.pairs} pairs), {verdict['streaming']}")
    return all(met.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    env = {"OMP_NUM_THREADS": str(args.threads)}
    transformers.logging.disable_progress_bar()
    model, tokenizer = labkit.load(args.model, device="cpu")
    build()  # the C++ decode operator, compiled here once; the server loads the build
    prompts = loadgen.corpus_prompts(args.requests, args.seed)
    workload = Workload(prompts, [tokenizer.encode(p).ids for p in prompts],
                        loadgen.output_lengths(args.requests, seed=args.seed + 1))
    print_header(args, model, workload)
    runs = measure_labkit(args, model, eos_id_of(tokenizer), workload, env)
    measure_naive(args, model, tokenizer, workload, env, runs)
    report(runs, tokenizer, args)
    return 0 if print_goals(runs, args, time.perf_counter() - start) else 1


if __name__ == "__main__":
    raise SystemExit(main())
