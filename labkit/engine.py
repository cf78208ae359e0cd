"""Serving many requests at once: continuous batching on the paged cache, and how to measure it.

Static batching takes a fixed batch of requests, pads their prompts to the longest, and runs
it until its longest member finishes: a short request sits idle in its slot, and a new one
waits for the whole batch. Continuous (iteration-level) batching, as in Orca and vLLM,
re-forms the batch at every step: a finished request leaves at once and a waiting one takes
its place. Each step the scheduler picks, first come first served:

1. the running requests: one token each for those decoding, the next chunk of the prompt for
   one still prefilling (chunked prefill). A decode that needs a new block when none is free
   preempts the newest running request: its blocks are freed and it goes back to the front of
   the queue, to be recomputed from its prompt and the tokens it has generated so far;
2. then, if nothing was preempted, waiting requests in arrival order, while the step's token
   budget (``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and the free
   blocks allow, keeping ``headroom`` blocks free per running request so that the requests
   already running can grow without being preempted at once. A prompt's cached prefix
   (``BlockAllocator``'s prefix sharing) is not rerun.

Every scheduled token then goes through the model in one forward pass: a single ragged row,
each request's new tokens after the previous request's, which the paged cache attends per
request (Orca's selective batching: the matmuls see every token, attention each sequence).

Metrics, as vLLM's serving benchmark defines them, for a request that arrives at ``a``, gets
its n output tokens at t_1 .. t_n and completes at ``f``:

    TTFT = t_1 - a      TPOT = (f - a - TTFT) / (n - 1)      ITL = t_(i+1) - t_i      E2E = f - a

and the throughputs: completed requests, and output tokens, per second of the whole run.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

import torch
from torch import Tensor

from labkit.generate import SamplingParams, next_token
from labkit.model import ContiguousKVCache, Transformer, check_ints, token_ids
from labkit.paged import BlockAllocator, DecodeKernel, OutOfBlocks, PagedKVCache, blocks_for, lognormal_lengths

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Request:
    """A prompt to complete, with how to sample it and when it arrives (seconds after the start);
    the engine fills in its output, progress and timestamps."""

    request_id: Hashable
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of prompt + output whose keys and values are in the cache
    status: str = WAITING
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    preemptions: int = 0
    cached_tokens: int = 0  # of its tokens (prompt, and output if preempted), those the prefix cache held
    # when it was last admitted: their keys and values were read, not computed again

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"request {self.request_id!r}: params must be a SamplingParams, got {self.params!r} "
                             f"(for a length: SamplingParams(max_new_tokens=...))")
        self.prompt = _prompt_ids(self)
        if not self.prompt:
            raise ValueError(f"request {self.request_id!r} has an empty prompt: give at least one token")
        if not (math.isfinite(self.arrival_time) and self.arrival_time >= 0):
            raise ValueError(f"request {self.request_id!r}: arrival_time={self.arrival_time} must be finite and >= 0")
        self._generator = None if self.params.seed is None else torch.Generator().manual_seed(self.params.seed)

    @property
    def tokens(self) -> list[int]:
        """The prompt and every token generated so far."""
        return self.prompt + self.output

    @property
    def to_compute(self) -> int:
        """Tokens not yet in the cache: the prompt's rest while prefilling, 1 while decoding."""
        return len(self.prompt) + len(self.output) - self.num_computed

    @property
    def max_tokens(self) -> int:
        """The longest this request can grow: prompt and every new token but the last (never fed back)."""
        return len(self.prompt) + self.params.max_new_tokens - 1


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits. ``headroom``: free blocks that admitting a request must leave for
    each running request (itself included), so that those already running can each grow by that
    many blocks before anyone is preempted; 0 admits whenever the prompt fits, as vLLM V1 does, and
    then preempts (and recomputes) more. A request is always admitted when none is running."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    chunked_prefill: bool = True
    headroom: int = 1

    def __post_init__(self) -> None:
        check_ints(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                   headroom=self.headroom)
        if not isinstance(self.chunked_prefill, bool):
            raise ValueError(f"chunked_prefill={self.chunked_prefill!r} must be True or False")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} and max_num_batched_tokens="
                             f"{self.max_num_batched_tokens} must both be at least 1")
        if self.headroom < 0:
            raise ValueError(f"headroom={self.headroom} must be at least 0 (free blocks per running request)")


@dataclass
class StepPlan:
    """What one step runs: (request, how many of its tokens) in batch order, who was preempted,
    and the block copies (copy on write) to make before the forward pass."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


def preempt_newest(waiting: deque[Request], running: list[Request], allocator: BlockAllocator) -> Request:
    """Preempt the most recently admitted running request: free its blocks, forget what it
    computed (it will be recomputed from prompt + output, which it keeps), and put it at the
    front of the queue, so it is the first to be readmitted."""
    victim = running.pop()
    allocator.free(victim.request_id)
    victim.num_computed, victim.status = 0, WAITING
    victim.preemptions += 1
    waiting.appendleft(victim)
    return victim


def admit(waiting: deque[Request], running: list[Request], allocator: BlockAllocator, budget: int,
          max_num_seqs: int, chunked_prefill: bool = True, headroom: int = 0) -> list[tuple[Request, int]]:
    """Move waiting requests, oldest first, to ``running`` while the token ``budget``, the
    ``max_num_seqs`` cap and the free blocks allow; each gets slots for its tokens (reusing a
    cached prefix) and is scheduled for as many of its uncached tokens as the budget leaves
    (all of them, or it waits, without ``chunked_prefill``). With ``headroom``, a request joins
    others only if that leaves ``headroom`` free blocks per running request, itself included,
    to grow into (see ``SchedulerConfig``). Returns [(request, tokens)]."""
    scheduled = []
    while waiting and budget > 0 and len(running) < max_num_seqs:
        request, tokens = waiting[0], waiting[0].tokens
        if not chunked_prefill and len(tokens) - allocator.cached_length(tokens) > budget:
            break
        if running and allocator.num_free - allocator.blocks_needed(tokens) < headroom * (len(running) + 1):
            break
        try:
            cached = allocator.add_sequence(request.request_id, tokens)
        except OutOfBlocks:
            break
        n = min(len(tokens) - cached, budget)
        waiting.popleft()
        request.num_computed = request.cached_tokens = cached
        request.status = RUNNING
        running.append(request)
        scheduled.append((request, n))
        budget -= n
    return scheduled


class Scheduler:
    """First come, first served, over a ``BlockAllocator``; see the module docstring."""

    def __init__(self, allocator: BlockAllocator, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.allocator, self.config = allocator, config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def ids(self) -> set[Hashable]:
        """The ids of the requests waiting or running."""
        return {r.request_id for r in (*self.waiting, *self.running)}

    def add(self, request: Request) -> None:
        """Queue a request (``check_id``)."""
        self.check_id(request)
        self.waiting.append(request)

    def check_id(self, request: Request) -> None:
        """ValueError if a request with this one's id is queued or running."""
        if request.request_id in self.ids:
            raise ValueError(f"a request with id {request.request_id!r} is already queued or running: "
                             "ids must be unique")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """The next step's batch: running requests first, then waiting ones."""
        plan, budget = StepPlan(), self.config.max_num_batched_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RUNNING or not self._reserve(request, plan):
                continue  # preempted, by an older request's decode or its own
            n = min(request.to_compute, budget)
            plan.scheduled.append((request, n))
            budget -= n
        if not plan.preempted:
            plan.scheduled += admit(self.waiting, self.running, self.allocator, budget, self.config.max_num_seqs,
                                    self.config.chunked_prefill, self.config.headroom)
        return plan

    def _reserve(self, request: Request, plan: StepPlan) -> bool:
        """Slots for the request's newest token(s), preempting the newest running requests until
        they fit; False if the request itself had to go."""
        new = request.tokens[self.allocator.length(request.request_id):]
        while True:
            try:
                plan.copies += self.allocator.append(request.request_id, new)
                return True
            except OutOfBlocks:
                victim = preempt_newest(self.waiting, self.running, self.allocator)
                plan.preempted.append(victim)
                if victim is request:
                    return False

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request.request_id)
        request.status = FINISHED


@dataclass(frozen=True)
class StepRecord:
    """One step, for plots: its start and end, and (request id, tokens run, "prefill" or
    "decode" or "idle") per batch slot; preempted request ids."""

    start: float
    end: float
    batch: list[tuple[Hashable, int, str]]
    preempted: list[Hashable] = field(default_factory=list)


def sample(logits: Tensor, requests: Sequence[Request]) -> list[int]:
    """The next token of each request from its row of ``logits`` ([len(requests), vocab]):
    greedy rows in one argmax, the others each with its own parameters and generator."""
    tokens = logits.argmax(-1).tolist()
    for i, request in enumerate(requests):
        if request.params.temperature > 0:
            tokens[i] = int(next_token(logits[i:i + 1], request.params, request._generator))
    return tokens


def _kind(request: Request, n: int) -> str:
    """"decode" when the step runs only the request's newest generated token, else "prefill"
    (a prompt, a chunk of one, or a preempted request's recomputation)."""
    return "decode" if request.output and n == 1 and request.to_compute == 1 else "prefill"


def _prompt_ids(request: Request, vocab_size: int | None = None) -> list[int]:
    """The request's prompt as token ids (``token_ids``), or a ValueError that names the request."""
    try:
        return token_ids(request.prompt, vocab_size)
    except ValueError as error:
        raise ValueError(f"request {request.request_id!r}: {error}") from None


def check_fits(request: Request, vocab_size: int, max_seq_len: int) -> None:
    """ValueError unless the request is new (served again, it would add to its output), its tokens
    are in the vocabulary and it fits the context."""
    if request.status != WAITING or request.output or request.num_computed:
        raise ValueError(f"request {request.request_id!r} has run before ({request.status}, "
                         f"{len(request.output)} tokens out): serve a new Request")
    _prompt_ids(request, vocab_size)
    if request.max_tokens > max_seq_len:
        raise ValueError(f"request {request.request_id!r}: {len(request.prompt)} prompt tokens + "
                         f"{request.params.max_new_tokens} new ones exceed max_seq_len={max_seq_len}")


def check_unique_ids(requests: Sequence[Request]) -> None:
    """ValueError naming an id that two of ``requests`` share (or one request given twice)."""
    seen: set[Hashable] = set()
    for request in requests:
        if request.request_id in seen:
            raise ValueError(f"two requests have the id {request.request_id!r}: ids must be unique")
        seen.add(request.request_id)


def _is_done(request: Request, eos_id: int | None) -> bool:
    stopped = request.params.stop_at_eos and eos_id is not None and request.output[-1] == eos_id
    return stopped or len(request.output) >= request.params.max_new_tokens


class Engine:
    """Continuous batching of a model over a paged KV cache: ``run`` serves a list of requests
    (arriving over time), ``step`` runs one scheduling step and one forward pass. ``decode_kernel``:
    see ``PagedKVCache`` (by default the decoding sequences are gathered, then attended)."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int = 16,
                 config: SchedulerConfig = SchedulerConfig(), prefix_caching: bool = True,
                 eos_id: int | None = None, decode_kernel: DecodeKernel | None = None) -> None:
        self.model, self.eos_id = model, eos_id
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.allocator, config)
        weight = next(model.parameters())
        self.cache = PagedKVCache(model.config, self.allocator, weight.dtype, weight.device, decode_kernel)
        self.log: list[StepRecord] = []
        self.reset_clock()

    @property
    def max_seq_len(self) -> int:
        return self.model.config.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def now(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self._start

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))

    def reset_clock(self) -> None:
        self._start = time.perf_counter()

    def add(self, request: Request) -> None:
        """Queue a request now, which is then its arrival time (``run`` adds each as it arrives);
        ``validate`` says which are refused, and one due to arrive later is too."""
        self.validate(request)
        if request.arrival_time > self.now():
            raise ValueError(f"request {request.request_id!r} arrives at {request.arrival_time} s, {self.now():.3f} s "
                             "into the run: add it then, or give run() every request with its arrival time")
        request.arrival_time = self.now()
        self.scheduler.add(request)

    def validate(self, request: Request) -> None:
        """A clear error for a request this engine could never serve, one that has run before, or
        one whose id it is serving."""
        self.scheduler.check_id(request)
        check_fits(request, self.vocab_size, self.max_seq_len)
        need, size = blocks_for(request.max_tokens, self.allocator.block_size), self.allocator.block_size
        if need > self.allocator.num_blocks:
            raise ValueError(f"request {request.request_id!r} needs {need} blocks of {size} tokens but the pool "
                             f"has only {self.allocator.num_blocks}: it could never finish")
        config = self.scheduler.config
        if not config.chunked_prefill and request.max_tokens > config.max_num_batched_tokens:
            raise ValueError(f"request {request.request_id!r}: {request.max_tokens} tokens may need recomputing in "
                             f"one step, more than max_num_batched_tokens={config.max_num_batched_tokens}; "
                             f"raise it or turn chunked_prefill on")

    def run(self, requests: Iterable[Request]) -> list[Request]:
        """Serve every request, each added when its arrival time comes; returns them, finished,
        in the order given. The clock starts now."""
        if self.scheduler.has_work:  # their times count from the clock that run() would restart
            raise RuntimeError(f"the engine still serves {len(self.scheduler.ids)} requests (added with add(), or "
                               "left by an interrupted run): step() until they are done, then run()")
        requests = list(requests)
        check_unique_ids(requests)
        for request in requests:
            self.validate(request)
        pending = deque(sorted(requests, key=lambda r: r.arrival_time))
        self.reset_clock()
        self.log = []
        while pending or self.scheduler.has_work:
            while pending and pending[0].arrival_time <= self.now():
                self.scheduler.add(pending.popleft())
            if self.scheduler.has_work:
                self.step()
            else:
                self.wait_until(pending[0].arrival_time)
        return requests

    def step(self) -> list[Request]:
        """Schedule, run one forward pass over every scheduled token, sample, finish; returns
        the requests that finished in this step."""
        if not self.scheduler.has_work:
            raise RuntimeError("nothing to run: no request is waiting or running (add one first)")
        start = self.now()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            raise RuntimeError("the scheduler found nothing to run although requests are waiting")
        rows = [i for i, (r, n) in enumerate(plan.scheduled) if n == r.to_compute]  # their last token runs
        done = [plan.scheduled[i][0] for i in rows]  # so they get a new one
        batch = [(r.request_id, n, _kind(r, n)) for r, n in plan.scheduled]
        seeded = [(r, r._generator.get_state()) for r in done if r._generator is not None]
        try:
            tokens = self.execute(plan, rows)
        except BaseException:  # failed or interrupted (Ctrl-C): what the step ran counts as not run, and runs again
            for request, _ in plan.scheduled:
                self.allocator.uncompute(request.request_id, request.num_computed)
            for request, state in seeded:  # and a seeded draw it made is drawn again
                request._generator.set_state(state)
            raise
        end, finished = self.now(), []
        for request, n in plan.scheduled:
            request.num_computed += n
        for request, token in zip(done, tokens):
            request.output.append(token)
            request.token_times.append(end)
            if _is_done(request, self.eos_id):
                self.scheduler.finish(request)
                request.finish_time = end
                finished.append(request)
        self.log.append(StepRecord(start, end, batch, [r.request_id for r in plan.preempted]))
        return finished

    def execute(self, plan: StepPlan, rows: Sequence[int]) -> list[int]:
        """One forward pass over the plan's tokens as a ragged batch; the next token of each
        request at ``rows`` of the plan (those whose last token runs in this step)."""
        self.cache.copy_blocks(plan.copies)
        device = self.cache.k.device
        tokens = [t for r, n in plan.scheduled for t in r.tokens[r.num_computed:r.num_computed + n]]
        positions = [p for r, n in plan.scheduled for p in range(r.num_computed, r.num_computed + n)]
        self.cache.seq_ids = [r.request_id for r, _ in plan.scheduled]
        self.cache.query_lens = [n for _, n in plan.scheduled]
        last = torch.tensor(self.cache.query_lens, device=device).cumsum(0) - 1
        with torch.inference_mode():
            logits = self.model(torch.tensor([tokens], device=device), torch.tensor([positions], device=device),
                                self.cache, logits_at=last[list(rows)])[0]
        return sample(logits, [plan.scheduled[i][0] for i in rows])


def run_static(model: Transformer, requests: Iterable[Request], batch_size: int,
               eos_id: int | None = None) -> tuple[list[Request], list[StepRecord]]:
    """Static batching, the baseline: up to ``batch_size`` requests that have arrived form a
    batch, their prompts left-padded to the longest; the batch decodes, every row every step,
    until its last member finishes, and only then do its requests complete and the next batch
    start. Returns the requests (in the order given) and the step log."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    requests = list(requests)
    check_unique_ids(requests)
    for request in requests:
        check_fits(request, model.config.vocab_size, model.config.max_seq_len)
    pending, log, start = deque(sorted(requests, key=lambda r: r.arrival_time)), [], time.perf_counter()
    now: Callable[[], float] = lambda: time.perf_counter() - start  # noqa: E731
    while pending:
        time.sleep(max(0.0, pending[0].arrival_time - now()))
        batch = []
        while pending and len(batch) < batch_size and pending[0].arrival_time <= now():
            batch.append(pending.popleft())
        _run_batch(model, batch, eos_id, now, log)
    return requests, log


def padded_prompts(batch: Sequence[Request], device: torch.device) -> tuple[Tensor, Tensor]:
    """Prompts left-padded to the longest: token ids (0 at padding) and positions (-1 there)."""
    width = max(len(r.prompt) for r in batch)
    tokens = [[0] * (width - len(r.prompt)) + r.prompt for r in batch]
    positions = [[-1] * (width - len(r.prompt)) + list(range(len(r.prompt))) for r in batch]
    return torch.tensor(tokens, device=device), torch.tensor(positions, device=device)


def _run_batch(model: Transformer, batch: list[Request], eos_id: int | None, now: Callable[[], float],
               log: list[StepRecord]) -> None:
    weight = next(model.parameters())
    steps = max(r.params.max_new_tokens for r in batch)
    fed, positions = padded_prompts(batch, weight.device)
    cache = ContiguousKVCache(model.config, len(batch), fed.shape[1] + steps, weight.dtype, weight.device)
    for r in batch:
        r.status = RUNNING
    active = list(batch)
    with torch.inference_mode():
        for step in range(steps):
            begin = now()
            logits = model(fed, positions, cache, logits_at=-1)[:, -1]  # only the last column is used
            rows = [i for i, r in enumerate(batch) if r in active]
            new = sample(logits[rows], active)
            end = now()
            log.append(StepRecord(begin, end, [(r.request_id, len(r.prompt) if step == 0 else 1,
                                                ("prefill" if step == 0 else "decode") if r in active else "idle")
                                               for r in batch]))
            for request, token in zip(list(active), new):
                request.output.append(token)
                request.token_times.append(end)
                if _is_done(request, eos_id):
                    active.remove(request)
            if not active:
                break
            # a finished row still runs (its slot is held), as padding: nothing of it is stored
            fed = torch.tensor([[r.output[-1]] for r in batch], device=weight.device)
            positions = torch.tensor([[len(r.prompt) + step if r in active else -1] for r in batch], device=weight.device)
    end = now()
    for request in batch:
        request.status, request.finish_time, request.num_computed = FINISHED, end, len(request.tokens) - 1


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
    for name in ("ttft", "tpot", "itl", "e2e"):
        values = [v for m in per_request for v in (m[name] if name == "itl" else [m[name]]) if v is not None]
        data = torch.tensor(values or [math.nan], dtype=torch.float64) * 1e3
        figures.update({f"mean_{name}_ms": float(data.mean()), f"median_{name}_ms": float(data.quantile(0.5)),
                        f"p99_{name}_ms": float(data.quantile(0.99))})
    return figures


LengthDistribution = Callable[[int, torch.Generator], list[int]]


def uniform(low: int, high: int) -> LengthDistribution:
    """Token counts uniform in [low, high]."""
    check_ints(low=low, high=high)
    if not 1 <= low <= high:
        raise ValueError(f"uniform({low}, {high}): need 1 <= low <= high")
    return lambda n, generator: torch.randint(low, high + 1, (n,), generator=generator).tolist()


def lognormal(median: float, sigma: float, low: int, high: int) -> LengthDistribution:
    """Token counts lognormal around ``median`` (spread ``sigma``), clipped to [low, high]: most
    short, a few long, as in real chat traffic."""
    lognormal_lengths(0, median, sigma, low, high, 0)  # refuses bad parameters now, not at the first draw
    return lambda n, generator: lognormal_lengths(n, median, sigma, low, high, generator)


def make_workload(n: int, prompt_lengths: LengthDistribution, output_lengths: LengthDistribution, *,
                  rate: float | None = None, vocab_size: int = 4096, prefix: Sequence[int] = (),
                  temperature: float = 0.0, seed: int = 0, id_prefix: str = "req") -> list[Request]:
    """``n`` requests with random prompt tokens (after a shared ``prefix``, if given) and
    lengths drawn from the distributions; each generates exactly its drawn output length (EOS
    ignored, as serving benchmarks do). Offline (``rate`` None): all arrive at 0; online: Poisson
    arrivals at ``rate`` requests per second. Seeded: the same arguments give the same requests."""
    check_ints(n=n, vocab_size=vocab_size)
    if n < 1 or vocab_size < 1 or (rate is not None and not rate > 0):
        raise ValueError(f"n={n} and vocab_size={vocab_size} must be >= 1, and rate={rate} None (offline) or > 0")
    generator = torch.Generator().manual_seed(seed)
    prompts, outputs = prompt_lengths(n, generator), output_lengths(n, generator)
    tokens = [torch.randint(vocab_size, (p,), generator=generator).tolist() for p in prompts]
    # drawn last, so that the same seed gives the same prompts offline and online
    gaps = torch.empty(n, dtype=torch.float64).exponential_(rate, generator=generator) if rate else torch.zeros(n)
    arrivals = (gaps.cumsum(0) - gaps[0]).tolist()  # the first arrives at 0
    return [Request(f"{id_prefix}{i}", list(prefix) + t,
                    SamplingParams(max_new_tokens=o, temperature=temperature, stop_at_eos=False, seed=seed + i),
                    arrival_time=a)
            for i, (t, o, a) in enumerate(zip(tokens, outputs, arrivals))]
