"""Serving from an event loop: the engine steps in a thread of its own, requests come and go as coroutines.

An HTTP server lives in an asyncio event loop, which must accept connections and stream tokens
while the model computes. Here the engine's loop (schedule, execute, postprocess: ``EngineCore.step``)
runs in ONE background thread, which alone touches the engine. Coroutines never call the
scheduler; they post commands (add a request, abort one) to a thread-safe inbox, which the thread
applies between two steps, and each request gets its tokens through an ``asyncio.Queue`` of its
own, which the thread fills with one ``loop.call_soon_threadsafe`` per step:

    coroutine --add/abort--> inbox --> engine thread: apply commands, step, route new tokens
    coroutine <--TokenEvent-- its queue <-----------------------------'

Why a dedicated thread rather than ``run_in_executor`` around each step: the engine's state then has
a single owner (no lock, no step interleaved with an abort), the loop between two steps costs no
trip through the event loop, and the event loop stays free during a step because PyTorch releases
the GIL inside its kernels. An abort takes effect at the next step boundary, when no step holds the
request's blocks; the request is then removed wherever it is and its blocks are freed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from dataclasses import dataclass
from typing import Hashable

from labkit.engine import EngineCore, Request, stopped_at_eos


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of a request, when the engine sampled it (engine clock, seconds), and why
    the request ended if this is its last event: "stop" (EOS), "length" or "abort"."""

    token: int | None
    time: float
    finish_reason: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """The engine as the thread last saw it: gauges, and totals since the start."""

    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    prompt_tokens: int = 0  # prompt tokens of the requests that reached their first token
    cached_tokens: int = 0  # of those, the ones the prefix cache held
    preemptions: int = 0
    generated_tokens: int = 0
    steps: int = 0


class QueueFull(RuntimeError):
    """More requests wait than the engine admits; try again later."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new request."""


class RequestStream:
    """One request's tokens as they come: an async iterator of ``TokenEvent``, the last with the finish
    reason (an engine failure raises). Closing it before the end (``aclose``, or dropping it: a client
    gone) aborts the request, wherever it is."""

    def __init__(self, engine: AsyncEngine, request_id: Hashable, sink: asyncio.Queue) -> None:
        self._engine, self.request_id, self._sink = engine, request_id, sink
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        item = await self._sink.get()
        if isinstance(item, BaseException) or item.finish_reason is not None:
            self._end(abort=False)
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self._end(abort=True)

    def __del__(self) -> None:
        self._end(abort=True)

    def _end(self, abort: bool) -> None:
        if not self._done:
            self._done = True
            self._engine._release(self.request_id, abort)


@dataclass
class _Live:
    """A request the thread serves: where its tokens go, and how many it has sent."""

    request: Request
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue
    sent: int = 0


class AsyncEngine:
    """An ``EngineCore`` behind an event loop (see the module docstring). ``max_waiting``: how many
    requests may wait for admission before ``stream`` raises ``QueueFull``."""

    def __init__(self, engine: EngineCore, max_waiting: int = 256) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting} must be at least 1")
        self.engine, self.max_waiting = engine, max_waiting
        self.stats = EngineStats(blocks_free=engine.allocator.num_free)  # replaced whole by the thread
        self.accepting = True
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids: set[Hashable] = set()  # requests between stream()'s start and end (event loop side)
        self._live: dict[Hashable, _Live] = {}  # the thread's own
        self._thread = threading.Thread(target=self._run, name="labkit-engine", daemon=True)
        self._thread.start()

    # the event loop's side ------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (it stops after ``shutdown``)."""
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests being served beyond the batch's cap (``max_num_seqs``): those must wait. Counted
        on the event loop's side, so that a burst is counted before the engine thread sees it."""
        return max(0, len(self._ids) - self.engine.scheduler.config.max_num_seqs)

    def stream(self, request: Request) -> RequestStream:
        """Serve ``request``: it joins the engine at once, and the returned ``RequestStream`` yields a
        ``TokenEvent`` per sampled token, the last with its finish reason. Raises ``ValueError`` for
        a request the engine could never serve, ``QueueFull`` or ``EngineStopped``."""
        self._admit(request)
        sink: asyncio.Queue = asyncio.Queue()
        self._ids.add(request.request_id)
        self._inbox.put(("add", _Live(request, asyncio.get_running_loop(), sink)))
        return RequestStream(self, request.request_id, sink)

    def _release(self, request_id: Hashable, abort: bool) -> None:
        """A stream has ended (``abort``: before its request finished, which must go)."""
        self._ids.discard(request_id)
        if abort:
            self.abort(request_id)

    def _admit(self, request: Request) -> None:
        if not self.accepting or not self.alive:
            raise EngineStopped("the server is shutting down and takes no new request")
        if request.request_id in self._ids:
            raise ValueError(f"a request with id {request.request_id!r} is already being served: ids must be unique")
        self.engine.check_servable(request)
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting, the most this server queues "
                            f"(max_waiting={self.max_waiting}): retry later")

    def abort(self, request_id: Hashable) -> None:
        """Remove a request at the next step boundary, wherever it is, and free its blocks; its
        stream ends with finish reason "abort". Unknown or finished ids are ignored."""
        self._inbox.put(("abort", request_id))

    async def shutdown(self, drain_s: float = 5.0) -> None:
        """Stop admitting, let what runs finish for up to ``drain_s`` seconds, abort the rest, and
        stop the thread."""
        self.accepting = False
        deadline = time.monotonic() + drain_s
        while self._ids and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._inbox.put(("stop", None))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    # the engine thread's side ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            stopping = False
            while not stopping:
                stopping = self._apply(block=not self.engine.scheduler.has_work)
                if self.engine.scheduler.has_work and not stopping:
                    self._step()
        finally:  # stopped, or an error outside a step: no stream may be left waiting
            self.accepting = False
            for request_id in list(self._live):
                self._abort(request_id)
            while not self._inbox.empty():
                kind, payload = self._inbox.get_nowait()
                if kind == "add":
                    self._send(payload, EngineStopped("the engine stopped before this request could start"))

    def _apply(self, block: bool) -> bool:
        """Apply the commands posted since the last step, in order (waiting for one when idle);
        True if one of them was stop. A request added after the stop is refused."""
        try:
            commands = [self._inbox.get(timeout=0.5)] if block else []
        except queue.Empty:
            commands = []
        while not self._inbox.empty():
            commands.append(self._inbox.get_nowait())
        stopping = False
        for kind, payload in commands:
            if kind == "stop":
                stopping = True
            elif kind == "add" and stopping:
                self._send(payload, EngineStopped("the engine stopped before this request could start"))
            elif kind == "add":
                self._add(payload)
            else:
                self._abort(payload)
        if commands:
            self._publish()
        return stopping

    def _add(self, live: _Live) -> None:
        try:
            self.engine.add(live.request)
        except ValueError as error:
            self._send(live, error)
            return
        self._live[live.request.request_id] = live

    def _abort(self, request_id: Hashable) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self.engine.scheduler.abort(request_id)
        self._publish()
        self._send(live, TokenEvent(None, self.engine.now(), "abort"))

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as error:  # noqa: BLE001 - a failed step fails its requests, not the server
            for request_id, live in list(self._live.items()):
                self.engine.scheduler.abort(request_id)
                del self._live[request_id]
                self._send(live, RuntimeError(f"the engine failed: {error!r}"))
            self._publish()
            return
        record = self.engine.log.pop()  # the thread consumes the log: a server's would grow forever
        first, new, outbox = self._route([request_id for request_id, _, _ in record.batch])
        # the stats first: a client that has its tokens must find them counted in /metrics
        self._publish(steps=1, preemptions=len(record.preempted), generated_tokens=new,
                      prompt_tokens=sum(len(r.prompt) for r in first),
                      cached_tokens=sum(r.cached_tokens for r in first))
        for loop, items in outbox.items():
            _post(loop, items)

    def _route(self, request_ids: list[Hashable]) -> tuple[list[Request], int, dict]:
        """Each scheduled request's new tokens, as events to post to its loop; returns the requests
        that got their first token, how many tokens there are, and the events by loop."""
        outbox: dict[asyncio.AbstractEventLoop, list] = {}
        first, new = [], 0
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is None or len(live.request.output) == live.sent:
                continue
            request = live.request
            first += [request] if live.sent == 0 else []
            new += len(request.output) - live.sent
            for i in range(live.sent, len(request.output)):
                last = i == len(request.output) - 1 and request.finish_time is not None
                reason = ("stop" if stopped_at_eos(request, self.engine.eos_id) else "length") if last else None
                event = TokenEvent(request.output[i], request.token_times[i], reason)
                outbox.setdefault(live.loop, []).append((live.sink, event))
            live.sent = len(request.output)
            if request.finish_time is not None:
                del self._live[request_id]
        return first, new, outbox

    def _send(self, live: _Live, item: TokenEvent | BaseException) -> None:
        _post(live.loop, [(live.sink, item)])

    def _publish(self, **totals: int) -> None:
        """Replace ``stats`` with the engine's state now, adding ``totals`` to the running totals (one
        assignment: a reader never sees half an update)."""
        scheduler, allocator, old = self.engine.scheduler, self.engine.allocator, self.stats
        free = allocator.num_free
        added = {name: getattr(old, name) + value for name, value in totals.items()}
        self.stats = dataclasses.replace(old, running=len(scheduler.running), waiting=len(scheduler.waiting),
                                         blocks_used=allocator.num_blocks - free, blocks_free=free, **added)


def _post(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Put items on their queues from the engine thread (one wake-up of the loop for all of them);
    a loop that has closed has no one left to read them."""
    def put_all() -> None:
        for sink, item in items:
            sink.put_nowait(item)
    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:
        pass
