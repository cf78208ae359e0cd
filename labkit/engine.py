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

A step is three calls, each with one job:

    batch = scheduler.schedule()                        # who runs, how many tokens; slots reserved
    tokens = runner.execute(batch)                      # the forward pass and sampling, nothing else
    scheduler.postprocess(batch, tokens, now, eos_id)   # what was computed, new tokens, who finished

so a step interrupted before its last call has recorded nothing as computed and handed out no
token: it simply runs again (a seeded draw, from ``token_generator``, comes out the same).
``labkit.metrics`` measures a run, ``labkit.static_batching`` is the baseline it is compared
with, and ``labkit.simulate`` runs the same scheduler on a cost model's clock. ``Engine.adopt``
takes over a request whose prompt ran elsewhere, its keys and values shipped in
(``labkit.parallel.disaggregate``).
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Protocol, Sequence

from torch import Tensor

from labkit.answers import answer_to
from labkit.generate import SamplingParams, next_token, token_generator
from labkit.memory import blocks_for
from labkit.model import Transformer
from labkit.paged import BlockAllocator, OutOfBlocks, PagedKVCache, step_logits
from labkit.paged_attention import DecodeKernel
from labkit.paged_graphs import PagedGraphs
from labkit.validate import as_token_ids, check_eos, check_ints

WAITING, RUNNING, FINISHED, ABORTED = "waiting", "running", "finished", "aborted"


@dataclass(eq=False)
class Request:
    """A prompt to complete, with how to sample it and when it arrives (seconds after the start);
    the engine fills in its output, progress and timestamps. The request is the one record of
    its tokens and of how many of them are in the cache."""

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
        if not (math.isfinite(self.arrival_time) and self.arrival_time >= 0):
            raise ValueError(f"request {self.request_id!r}: arrival_time={self.arrival_time} must be finite and >= 0")

    @property
    def tokens(self) -> list[int]:
        """The prompt and every token generated so far."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """len(tokens), without building them."""
        return len(self.prompt) + len(self.output)

    @property
    def to_compute(self) -> int:
        """Tokens not yet in the cache: the prompt's rest while prefilling, 1 while decoding."""
        return self.num_tokens - self.num_computed

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
class ScheduledBatch:
    """What one step runs: (request, how many of its tokens) in batch order, who was preempted,
    the block copies (copy on write) to make before the forward pass, and which entries run their
    last token, so that a new token is sampled for them (``sampled``, indices into ``scheduled``)."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)


@answer_to("ex04.2")
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


@answer_to("ex04.1")
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

    def schedule(self) -> ScheduledBatch:
        """The next step's batch: running requests first, then waiting ones; each gets slots for
        the tokens it runs."""
        batch, budget = ScheduledBatch(), self.config.max_num_batched_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RUNNING or not self._reserve(request, batch):
                continue  # preempted, by an older request's decode or its own
            n = min(request.to_compute, budget)
            batch.scheduled.append((request, n))
            budget -= n
        if not batch.preempted:
            batch.scheduled += admit(self.waiting, self.running, self.allocator, budget, self.config.max_num_seqs,
                                     self.config.chunked_prefill, self.config.headroom)
        batch.sampled = [i for i, (r, n) in enumerate(batch.scheduled) if n == r.to_compute]
        return batch

    def _reserve(self, request: Request, batch: ScheduledBatch) -> bool:
        """Slots for the request's newest token(s), preempting the newest running requests until
        they fit; False if the request itself had to go."""
        new = request.num_tokens - self.allocator.length(request.request_id)
        while True:
            try:
                batch.copies += self.allocator.append(request.request_id, new)
                return True
            except OutOfBlocks:
                victim = preempt_newest(self.waiting, self.running, self.allocator)
                batch.preempted.append(victim)
                if victim is request:
                    return False

    def adopt(self, request: Request) -> int | None:
        """Take over a request whose tokens but the newest were computed elsewhere (disaggregated
        serving: another rank ran its prompt and sampled its first token; ``check_prefilled``): it
        joins the running batch as a waiting request is admitted (``admit``: the sequence cap, the
        free blocks and their headroom), with its tokens but the newest counted as computed, so its
        next step decodes. Returns how many of those tokens the prefix cache held (the caller writes
        the others' keys and values into its blocks), or None, with nothing changed, while there is
        no room or preempted requests wait to be readmitted (they come first): try after a step."""
        self.check_id(request)
        if self.waiting or not admit(deque([request]), self.running, self.allocator, request.num_tokens,
                                     self.config.max_num_seqs, headroom=self.config.headroom):
            return None
        request.num_computed = request.num_tokens - 1
        self.allocator.mark_computed(request.request_id, request.tokens[:request.num_computed])
        return request.cached_tokens

    def postprocess(self, batch: ScheduledBatch, tokens: Sequence[int], now: float,
                    eos_id: int | None = None) -> list[Request]:
        """Record a step once it has run: each scheduled request has its tokens computed (their full
        blocks named for the prefix cache); those sampled get their new token at ``now``, and finish
        at EOS or at their length. Returns the requests that finished."""
        assert len(tokens) == len(batch.sampled), f"{len(tokens)} tokens for {len(batch.sampled)} sampled requests"
        size = self.allocator.block_size
        for request, n in batch.scheduled:
            request.num_computed += n
            # only a step that fills a block has one to name: the blocks before it were named as they filled
            # (add_sequence names a cached prefix, adopt() and fork() their tokens, and a preempted request
            # starts again at 0), so that each request has num_computed // block_size names after every step
            if request.num_computed // size > (request.num_computed - n) // size:
                self.allocator.mark_computed(request.request_id, request.tokens[:request.num_computed])
        finished = []
        for i, token in zip(batch.sampled, tokens):
            request = batch.scheduled[i][0]
            request.output.append(token)
            request.token_times.append(now)
            if is_finished(request, eos_id):
                self.finish(request)
                request.finish_time = now
                finished.append(request)
        return finished

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request.request_id)
        request.status = FINISHED

    def abort(self, request_id: Hashable) -> Request | None:
        """Remove a request wherever it is (waiting, prefilling or decoding) and free its blocks;
        returns it (status ``aborted``), or None if no such request is queued or running. Call it
        between steps: a step scheduled but not yet postprocessed still counts on its blocks."""
        for queue in (self.waiting, self.running):
            request = next((r for r in queue if r.request_id == request_id), None)
            if request is not None:
                queue.remove(request)
                if request_id in self.allocator.tables:  # a waiting request holds none
                    self.allocator.free(request.request_id)
                request.status = ABORTED
                return request
        return None


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
    greedy rows in one argmax, the others each with its own parameters (and, seeded, the
    generator of that token: ``token_generator``)."""
    tokens = logits.argmax(-1).tolist()
    for i, request in enumerate(requests):
        if request.params.temperature > 0:
            generator = token_generator(request.params, len(request.output), logits.device)
            tokens[i] = int(next_token(logits[i:i + 1], request.params, generator))
    return tokens


def _kind(request: Request, n: int) -> str:
    """"decode" when the step runs only the request's newest generated token, else "prefill"
    (a prompt, a chunk of one, or a preempted request's recomputation)."""
    return "decode" if request.output and n == 1 and request.to_compute == 1 else "prefill"


def _prompt_ids(request: Request, vocab_size: int | None = None) -> list[int]:
    """The request's prompt as token ids (``as_token_ids``), at least one, or a ValueError that names
    the request (checked when it is made, and again when it is served: its prompt may have changed)."""
    try:
        ids = as_token_ids(request.prompt, vocab_size)
    except ValueError as error:
        raise ValueError(f"request {request.request_id!r}: {error}") from None
    if not ids:
        raise ValueError(f"request {request.request_id!r} has an empty prompt: give at least one token")
    return ids


def check_fits(request: Request, vocab_size: int, max_seq_len: int, new: bool = True) -> None:
    """ValueError unless the request is new (served again, it would add to its output; ``new=False``
    for one prefilled elsewhere, ``check_prefilled``), its tokens are in the vocabulary and it fits
    the context."""
    if new and (request.status != WAITING or request.output or request.num_computed):
        raise ValueError(f"request {request.request_id!r} has run before ({request.status}, "
                         f"{len(request.output)} tokens out): serve a new Request")
    _prompt_ids(request, vocab_size)
    if request.max_tokens > max_seq_len:
        raise ValueError(f"request {request.request_id!r}: {len(request.prompt)} prompt tokens + "
                         f"{request.params.max_new_tokens} new ones exceed max_seq_len={max_seq_len}")


def check_prefilled(request: Request, eos_id: int | None = None) -> None:
    """ValueError unless the request was prefilled elsewhere and has tokens left to decode: it has
    its first token (or more) in ``output`` and nothing computed here, and is not finished."""
    if request.status != WAITING or request.num_computed or not request.output:
        raise ValueError(f"request {request.request_id!r} ({request.status}, {len(request.output)} tokens out, "
                         f"{request.num_computed} computed) is not one prefilled elsewhere: that has its first "
                         "token in output and nothing computed yet")
    if is_finished(request, eos_id):
        raise ValueError(f"request {request.request_id!r} is finished ({len(request.output)} of "
                         f"{request.params.max_new_tokens} tokens, or EOS): there is nothing left to decode")


def check_unique_ids(requests: Sequence[Request]) -> None:
    """ValueError naming an id that two of ``requests`` share (or one request given twice)."""
    seen: set[Hashable] = set()
    for request in requests:
        if request.request_id in seen:
            raise ValueError(f"two requests have the id {request.request_id!r}: ids must be unique")
        seen.add(request.request_id)


def stopped_at_eos(request: Request, eos_id: int | None) -> bool:
    """Whether the request's newest token is EOS and the request stops there."""
    return request.params.stop_at_eos and eos_id is not None and request.output[-1] == eos_id


def is_finished(request: Request, eos_id: int | None) -> bool:
    """Whether the request's newest token ends it: EOS (if it stops there), or its length."""
    return stopped_at_eos(request, eos_id) or len(request.output) >= request.params.max_new_tokens


class Runner(Protocol):
    """What executes a scheduled batch: the model (``ModelRunner``), or a cost model
    (``labkit.simulate``); and the limits of the requests it can serve."""

    max_seq_len: int
    vocab_size: int

    def execute(self, batch: ScheduledBatch) -> list[int]:
        """The new token of each entry of ``batch.sampled``; no bookkeeping."""


@dataclass(frozen=True)
class EngineLimits:
    """What an engine can serve, to check a request against where the engine is not (a server's front
    end, whose engine runs in another process)."""

    vocab_size: int
    max_seq_len: int
    num_blocks: int
    block_size: int
    config: SchedulerConfig

    def check(self, request: Request) -> None:
        """A clear error for a request the engine could never serve (too long, out of the vocabulary,
        more blocks than the pool has, or a prompt no step could take)."""
        check_fits(request, self.vocab_size, self.max_seq_len)
        need = blocks_for(request.max_tokens, self.block_size)
        if need > self.num_blocks:
            raise ValueError(f"request {request.request_id!r} needs {need} blocks of {self.block_size} tokens but the "
                             f"pool has only {self.num_blocks}: it could never finish")
        config = self.config
        if not config.chunked_prefill and request.max_tokens > config.max_num_batched_tokens:
            raise ValueError(f"request {request.request_id!r}: {request.max_tokens} tokens may need recomputing in "
                             f"one step, more than max_num_batched_tokens={config.max_num_batched_tokens}; "
                             f"raise it or turn chunked_prefill on")


class Clock(Protocol):
    def reset(self) -> None: ...
    def now(self) -> float: ...
    def wait_until(self, t: float) -> None: ...


class WallClock:
    """Seconds since ``reset``, on the wall clock; waiting sleeps."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._start

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))


class ModelRunner:
    """Executes a scheduled batch on the model: the block copies, one forward pass over every
    scheduled token as a single ragged row through the paged cache, then sampling. With
    ``graphs``, a step in which every sequence decodes one token is replayed from a CUDA graph."""

    def __init__(self, model: Transformer, cache: PagedKVCache, graphs: PagedGraphs | None = None) -> None:
        self.model, self.cache, self.graphs = model, cache, graphs
        self.max_seq_len, self.vocab_size = model.config.max_seq_len, model.config.vocab_size

    def execute(self, batch: ScheduledBatch) -> list[int]:
        self.cache.copy_blocks(batch.copies)
        runs = [(r.request_id, r.num_computed, n) for r, n in batch.scheduled]
        tokens = [t for r, n in batch.scheduled for t in r.tokens[r.num_computed:r.num_computed + n]]
        if self.graphs is not None and len(tokens) == len(runs) <= self.graphs.max_batch:  # decodes only
            logits = self.graphs(runs, tokens)[batch.sampled]
        else:
            logits = step_logits(self.model, self.cache, runs, tokens, batch.sampled)
        return sample(logits, [batch.scheduled[i][0] for i in batch.sampled])


class EngineCore:
    """The serving loop: a ``Scheduler`` over a ``BlockAllocator``, a ``Runner`` that executes each
    scheduled batch, and a clock. ``run`` serves a list of requests (arriving over time), ``step``
    runs one step. ``Engine`` runs it on a model, ``labkit.simulate.SimulatedEngine`` on a cost model."""

    def __init__(self, runner: Runner, allocator: BlockAllocator, config: SchedulerConfig, clock: Clock,
                 eos_id: int | None = None) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, e.g. SchedulerConfig(max_num_seqs=2), not {config!r:.60}")
        self.runner, self.allocator, self.clock, self.eos_id = runner, allocator, clock, eos_id
        self.scheduler = Scheduler(allocator, config)
        self.log: list[StepRecord] = []

    def now(self) -> float:
        """Seconds since the run started."""
        return self.clock.now()

    def add(self, request: Request) -> None:
        """Queue a request now, which is then its arrival time (``run`` adds each as it arrives);
        ``validate`` says which are refused, and one due to arrive later is too."""
        self.validate(request)
        if request.arrival_time > self.now():
            raise ValueError(f"request {request.request_id!r} arrives at {request.arrival_time} s, {self.now():.3f} s "
                             "into the run: add it then, or give run() every request with its arrival time")
        request.arrival_time = self.now()
        self.scheduler.add(request)

    def reset_prefix_cache(self) -> int:
        """Forget every block the prefix cache holds, so that the next requests find none of the earlier ones'
        (what a benchmark does before it measures); returns how many blocks it forgot: none where the engine runs
        without prefix caching, which is always cold. Refused (ValueError) while requests are served, whose blocks
        are in use."""
        if self.allocator.prefix is None:
            return 0
        if self.scheduler.has_work:
            raise ValueError(f"{len(self.scheduler.running)} requests run and {len(self.scheduler.waiting)} wait: "
                             "the prefix cache can be reset once the engine is idle")
        return self.allocator.prefix.clear()

    def validate(self, request: Request) -> None:
        """A clear error for a request this engine could never serve, one that has run before, or
        one whose id it is serving."""
        self.scheduler.check_id(request)
        self.limits.check(request)

    @property
    def limits(self) -> EngineLimits:
        """What this engine can serve (``EngineLimits.check`` refuses the rest)."""
        return EngineLimits(self.runner.vocab_size, self.runner.max_seq_len, self.allocator.num_blocks,
                            self.allocator.block_size, self.scheduler.config)

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
        self.clock.reset()
        self.log = []
        while pending or self.scheduler.has_work:
            while pending and pending[0].arrival_time <= self.now():
                self.scheduler.add(pending.popleft())
            if self.scheduler.has_work:
                self.step()
            else:
                self.clock.wait_until(pending[0].arrival_time)
        return requests

    def step(self) -> list[Request]:
        """Schedule, execute (one forward pass over every scheduled token, and sampling), then
        record what the step computed; returns the requests that finished in this step."""
        if not self.scheduler.has_work:
            raise RuntimeError("nothing to run: no request is waiting or running (add one first)")
        start = self.now()
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            raise RuntimeError("the scheduler found nothing to run although requests are waiting")
        entries = [(r.request_id, n, _kind(r, n)) for r, n in batch.scheduled]
        tokens = self.runner.execute(batch)
        end = self.now()
        finished = self.scheduler.postprocess(batch, tokens, end, self.eos_id)
        self.log.append(StepRecord(start, end, entries, [r.request_id for r in batch.preempted]))
        return finished


class Engine(EngineCore):
    """Continuous batching of a model over a paged KV cache (see ``EngineCore``). ``decode_kernel``:
    see ``PagedKVCache`` (by default the decoding sequences are gathered, then attended).
    ``use_cuda_graphs``: record the decode step for each batch bucket up to ``max_num_seqs`` and
    replay it for steps that only decode (``labkit.paged_graphs``); CUDA only. Give it the Triton
    decode kernel (``labkit.kernels.paged_decode``) too: without a kernel, a graphed step gathers
    every block a sequence could ever have, ``max_seq_len`` keys per row and layer."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int = 16,
                 config: SchedulerConfig = SchedulerConfig(), prefix_caching: bool = True,
                 eos_id: int | None = None, decode_kernel: DecodeKernel | None = None,
                 use_cuda_graphs: bool = False) -> None:
        check_eos(eos_id, model.config.vocab_size)
        allocator = BlockAllocator(num_blocks, block_size, prefix_caching)
        self.model = model
        self.cache = PagedKVCache(model.config, allocator, model.dtype, model.device, decode_kernel,
                                  spare_block=use_cuda_graphs)
        graphs = PagedGraphs(model, self.cache, config.max_num_seqs) if use_cuda_graphs else None
        super().__init__(ModelRunner(model, self.cache, graphs), allocator, config, WallClock(), eos_id)

    def adopt(self, request: Request, kv: Tensor) -> bool:
        """Take over a request prefilled elsewhere (``check_prefilled``, ``Scheduler.adopt``) with ``kv``,
        the keys and values of its tokens but the newest, ``[2, n_layers, tokens, n_kv_heads, head_dim]``:
        they are written into its blocks (those the prefix cache held already are skipped), and its
        next step decodes. False, with nothing changed, while there is no room: try after a step."""
        check_prefilled(request, self.eos_id)
        check_fits(request, self.runner.vocab_size, self.runner.max_seq_len, new=False)
        config = self.model.config
        expected = (2, config.n_layers, request.num_tokens - 1, config.n_kv_heads, config.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"request {request.request_id!r}: kv has shape {tuple(kv.shape)}, expected {expected} "
                             "(K and V, layers, its tokens but the newest, KV heads, head_dim)")
        cached = self.scheduler.adopt(request)
        if cached is None:
            return False
        slots = self.allocator.slot_mapping(request.request_id, range(cached, request.num_computed))
        for pool, new in zip((self.cache.k, self.cache.v), kv):
            pool.flatten(1, 2)[:, slots] = new[:, cached:].to(pool)
        return True
