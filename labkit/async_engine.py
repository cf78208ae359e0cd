"""Serving from an event loop: the engine steps in a thread or a process of its own, requests come and go as coroutines.

An HTTP server lives in an asyncio event loop, which must accept connections and stream tokens
while the model computes. Here the engine's loop (``EngineLoop``: apply commands, step, route the
new tokens) runs apart from the event loop and alone touches the engine. Coroutines never call the
scheduler; they post commands (add a request, abort one), which the loop applies between two steps,
and each request gets its tokens through an ``asyncio.Queue`` of its own, filled with one
``loop.call_soon_threadsafe`` per step:

    coroutine --add/abort--> inbox --> engine loop: apply commands, step, route new tokens
    coroutine <--TokenEvent-- its queue <--- Delivery (events, arrivals, stats) ---'

Where the engine loop runs:

- ``AsyncEngine(engine)``: in a thread of this process. The engine's state has one owner (no lock, no
  step interleaved with an abort), and the event loop stays free during a step because PyTorch
  releases the GIL inside its kernels. But a step of a small model is hundreds of short torch calls,
  each of which gives the GIL back and takes it again: while the event loop runs its Python (HTTP,
  JSON, detokenizing), each hand-over can make the engine wait. Tests use it: they can reach into
  the engine.
- ``AsyncEngine(EngineSpec(build, args))``: in a process of its own, as vLLM's V1 engine core, which
  builds its engine with ``build(*args)`` and talks to this one through two pipes (commands in,
  one ``Delivery`` out per step). The processes share no GIL; the price is a pickled message per
  step and a model loaded in the other process. ``labkit.serve`` runs its engine so.

An abort takes effect at the next step boundary, when no step holds the request's blocks; the
request is then removed wherever it is and its blocks are freed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from labkit.engine import EngineCore, EngineLimits, Request, stopped_at_eos
from labkit.spawning import check_importable, main_not_rerun


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


@dataclass(frozen=True)
class EngineSpec:
    """An engine to run in a process of its own: that process builds it with ``build(*args)``, so
    ``build`` must be importable by name (a module's function, not a notebook cell's) and ``args``
    picklable."""

    build: Callable[..., EngineCore]
    args: tuple = ()


@dataclass
class Delivery:
    """What the engine loop sends after it applied commands or stepped: each request's new events
    (a ``TokenEvent``, or the error that ends its stream), the arrival time the engine gave each
    request that got its first token (an engine in a process serves a copy of the request: this
    is how the caller's learns it), and the engine's stats."""

    events: list[tuple[Hashable, Any]] = field(default_factory=list)
    arrivals: dict[Hashable, float] = field(default_factory=dict)
    stats: EngineStats | None = None


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
class _Sink:
    """Where one request's events go: its event loop and queue (the caller's ``Request`` learns its arrival)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """An engine behind an event loop (see the module docstring): an ``EngineCore`` stepped in a thread, or
    an ``EngineSpec`` built and stepped in a process of its own. ``max_waiting``: how many requests may
    wait for admission before ``stream`` raises ``QueueFull``. Building the engine in a process waits for
    it (up to ``start_timeout_s``); a build that fails raises ``RuntimeError`` with its traceback."""

    def __init__(self, engine: EngineCore | EngineSpec, max_waiting: int = 256,
                 start_timeout_s: float = 300.0) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting} must be at least 1")
        self.max_waiting, self.accepting = max_waiting, True
        self._ids: set[Hashable] = set()  # requests between stream()'s start and end (event loop side)
        # a request's sink: added by stream(), removed by _deliver with its last event (or by _release)
        self._sinks: dict[Hashable, _Sink] = {}
        if isinstance(engine, EngineSpec):
            self._core: _ThreadCore | _ProcessCore = _ProcessCore(engine, self._deliver, self._lost, start_timeout_s)
        elif isinstance(engine, EngineCore):
            self._core = _ThreadCore(engine, self._deliver)
        else:
            raise TypeError(f"engine must be an EngineCore (stepped in a thread) or an EngineSpec (built and stepped "
                            f"in a process), got {type(engine).__name__}")
        self.limits: EngineLimits = self._core.limits
        self.stats = EngineStats(blocks_free=self.limits.num_blocks)  # replaced whole by each delivery

    # the event loop's side ------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the engine loop runs (it stops after ``shutdown``, or if its process dies)."""
        return self._core.alive

    @property
    def num_waiting(self) -> int:
        """Requests being served beyond the batch's cap (``max_num_seqs``): those must wait. Counted
        on the event loop's side, so that a burst is counted before the engine loop sees it."""
        return max(0, len(self._ids) - self.limits.config.max_num_seqs)

    def stream(self, request: Request) -> RequestStream:
        """Serve ``request``: it joins the engine at once, and the returned ``RequestStream`` yields a
        ``TokenEvent`` per sampled token, the last with its finish reason. Raises ``ValueError`` for
        a request the engine could never serve, ``QueueFull`` or ``EngineStopped``."""
        self._admit(request)
        sink = _Sink(request, asyncio.get_running_loop(), asyncio.Queue())
        self._ids.add(request.request_id)
        self._sinks[request.request_id] = sink
        self._core.send(("add", request))
        return RequestStream(self, request.request_id, sink.queue)

    def _release(self, request_id: Hashable, abort: bool) -> None:
        """A stream has ended (``abort``: before its request finished, which must go)."""
        self._ids.discard(request_id)
        if abort:
            self._sinks.pop(request_id, None)
            self.abort(request_id)

    def _admit(self, request: Request) -> None:
        if not self.accepting or not self.alive:
            raise EngineStopped("the server is shutting down and takes no new request")
        if request.request_id in self._ids:
            raise ValueError(f"a request with id {request.request_id!r} is already being served: ids must be unique")
        self.limits.check(request)
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting, the most this server queues "
                            f"(max_waiting={self.max_waiting}): retry later")

    def abort(self, request_id: Hashable) -> None:
        """Remove a request at the next step boundary, wherever it is, and free its blocks; its
        stream ends with finish reason "abort". Unknown or finished ids are ignored."""
        if self.alive:
            self._core.send(("abort", request_id))

    async def shutdown(self, drain_s: float = 5.0) -> None:
        """Stop admitting, let what runs finish for up to ``drain_s`` seconds, abort the rest, and
        stop the engine loop (and its process)."""
        self.accepting = False
        deadline = time.monotonic() + drain_s
        while self._ids and time.monotonic() < deadline and self.alive:
            await asyncio.sleep(0.02)
        if self.alive:
            self._core.send(("stop", None))
        await asyncio.get_running_loop().run_in_executor(None, self._core.join, 10.0)

    # the engine loop's side (its thread, or this process's reader of its pipe) -----------------------

    def _deliver(self, delivery: Delivery) -> None:
        """Pass a delivery on: the stats first (a client that has its tokens must find them counted
        in /metrics), then each event to its request's queue, one wake-up per event loop."""
        if delivery.stats is not None:
            self.stats = delivery.stats
        for request_id, arrival in delivery.arrivals.items():
            if (sink := self._sinks.get(request_id)) is not None:
                sink.request.arrival_time = arrival
        outbox: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in delivery.events:
            sink = self._sinks.get(request_id)
            if sink is None:  # its stream was closed
                continue
            if isinstance(item, BaseException) or item.finish_reason is not None:
                self._sinks.pop(request_id, None)  # (_release may be popping it too)
            outbox.setdefault(sink.loop, []).append((sink.queue, item))
        for loop, items in outbox.items():
            _post(loop, items)

    def _lost(self, why: str) -> None:
        """The engine's process has ended: every request still open fails with ``why``."""
        self._deliver(Delivery(events=[(request_id, RuntimeError(why)) for request_id in list(self._sinks)]))


def _post(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Put items on their queues from another thread (one wake-up of the loop for all of them); a loop
    that has closed has no one left to read them."""
    def put_all() -> None:
        for sink, item in items:
            sink.put_nowait(item)
    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:
        pass


@dataclass
class _Live:
    """A request the engine loop serves, and how many of its tokens it has sent."""

    request: Request
    sent: int = 0


class EngineLoop:
    """The engine's side: the one owner of an ``EngineCore``. It applies the commands from ``inbox``
    between steps (waiting for one when idle), steps while there is work, and hands a ``Delivery`` to
    ``deliver`` after each round. Commands: ("add", request), ("abort", request_id), ("stop", None)."""

    def __init__(self, engine: EngineCore, inbox: queue.SimpleQueue, deliver: Callable[[Delivery], None]) -> None:
        self.engine, self.inbox, self.deliver = engine, inbox, deliver
        self.stats = EngineStats(blocks_free=engine.allocator.num_free)
        self._live: dict[Hashable, _Live] = {}
        self._out = Delivery()

    def run(self) -> None:
        try:
            stopping = False
            while not stopping:
                stopping = self._apply(block=not self.engine.scheduler.has_work)
                if self.engine.scheduler.has_work and not stopping:
                    self._step()
                self._flush()
        finally:  # stopped, or an error outside a step: no stream may be left waiting
            for request_id in list(self._live):
                self._abort(request_id)
            while not self.inbox.empty():
                kind, payload = self.inbox.get_nowait()
                if kind == "add":
                    self._refuse(payload)
            self._flush()

    def _apply(self, block: bool) -> bool:
        """Apply the commands posted since the last step, in order (waiting for one when idle);
        True if one of them was stop. A request added after the stop is refused."""
        try:
            commands = [self.inbox.get(timeout=0.5)] if block else []
        except queue.Empty:
            commands = []
        while not self.inbox.empty():
            commands.append(self.inbox.get_nowait())
        stopping = False
        for kind, payload in commands:
            if kind == "stop":
                stopping = True
            elif kind == "add" and stopping:
                self._refuse(payload)
            elif kind == "add":
                self._add(payload)
            else:
                self._abort(payload)
        if commands:
            self._publish()
        return stopping

    def _add(self, request: Request) -> None:
        try:
            self.engine.add(request)
        except ValueError as error:
            self._send(request.request_id, error)
            return
        self._live[request.request_id] = _Live(request)

    def _refuse(self, request: Request) -> None:
        self._send(request.request_id, EngineStopped("the engine stopped before this request could start"))

    def _abort(self, request_id: Hashable) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self.engine.scheduler.abort(request_id)
        self._publish()
        self._send(request_id, TokenEvent(None, self.engine.now(), "abort"))

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as error:  # noqa: BLE001 - a failed step fails its requests, not the server
            for request_id in list(self._live):
                self.engine.scheduler.abort(request_id)
                del self._live[request_id]
                self._send(request_id, RuntimeError(f"the engine failed: {error!r}"))
            self._publish()
            return
        record = self.engine.log.pop()  # the loop consumes the log: a server's would grow forever
        first, new = self._route([request_id for request_id, _, _ in record.batch])
        self._publish(steps=1, preemptions=len(record.preempted), generated_tokens=new,
                      prompt_tokens=sum(len(r.prompt) for r in first),
                      cached_tokens=sum(r.cached_tokens for r in first))

    def _route(self, request_ids: list[Hashable]) -> tuple[list[Request], int]:
        """Each scheduled request's new tokens, as events to deliver; returns the requests that got
        their first token, and how many tokens there are."""
        first, new = [], 0
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is None or len(live.request.output) == live.sent:
                continue
            request = live.request
            if live.sent == 0:
                first.append(request)
                self._out.arrivals[request_id] = request.arrival_time
            new += len(request.output) - live.sent
            for i in range(live.sent, len(request.output)):
                last = i == len(request.output) - 1 and request.finish_time is not None
                reason = ("stop" if stopped_at_eos(request, self.engine.eos_id) else "length") if last else None
                self._send(request_id, TokenEvent(request.output[i], request.token_times[i], reason))
            live.sent = len(request.output)
            if request.finish_time is not None:
                del self._live[request_id]
        return first, new

    def _send(self, request_id: Hashable, item: TokenEvent | BaseException) -> None:
        self._out.events.append((request_id, item))

    def _publish(self, **totals: int) -> None:
        """The engine's state now, with ``totals`` added to the running totals, for the next delivery."""
        scheduler, allocator, old = self.engine.scheduler, self.engine.allocator, self.stats
        free = allocator.num_free
        added = {name: getattr(old, name) + value for name, value in totals.items()}
        self.stats = dataclasses.replace(old, running=len(scheduler.running), waiting=len(scheduler.waiting),
                                         blocks_used=allocator.num_blocks - free, blocks_free=free, **added)
        self._out.stats = self.stats

    def _flush(self) -> None:
        """Hand over what this round produced, if anything."""
        out, self._out = self._out, Delivery()
        if out.events or out.stats is not None:
            self.deliver(out)


class _ThreadCore:
    """An ``EngineLoop`` in a thread of this process."""

    def __init__(self, engine: EngineCore, deliver: Callable[[Delivery], None]) -> None:
        self.limits = engine.limits
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        loop = EngineLoop(engine, self._inbox, deliver)
        self._thread = threading.Thread(target=loop.run, name="labkit-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def send(self, command: tuple) -> None:
        self._inbox.put(command)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


class _ProcessCore:
    """An ``EngineLoop`` in a process of its own (``spawn``), fed through one pipe and heard through
    another; a thread here reads the second and delivers. The process ends itself when this one is
    gone (its command pipe closes); ``lost`` hears when it ends."""

    def __init__(self, spec: EngineSpec, deliver: Callable[[Delivery], None], lost: Callable[[str], None],
                 timeout_s: float) -> None:
        check_importable(spec.build)
        context = mp.get_context("spawn")
        commands_in, self._commands = context.Pipe(duplex=False)
        self._outputs, outputs_out = context.Pipe(duplex=False)
        self._process = context.Process(target=_engine_process, args=(spec, commands_in, outputs_out),
                                        name="labkit-engine", daemon=True)
        with main_not_rerun():
            self._process.start()
        commands_in.close(), outputs_out.close()  # the child's ends: a closed pipe then means a dead peer
        self._lock = threading.Lock()  # commands come from the event loop, and from any thread's garbage collector
        self.limits: EngineLimits = self._started(timeout_s)
        self._reader = threading.Thread(target=self._read, args=(deliver, lost), name="labkit-engine-reader",
                                        daemon=True)
        self._reader.start()

    def _started(self, timeout_s: float) -> EngineLimits:
        """The engine's limits, once the process has built it; its traceback if the build failed."""
        deadline = time.monotonic() + timeout_s
        while not self._outputs.poll(0.1):
            if not self._process.is_alive() or time.monotonic() > deadline:
                self._stop()
                self._outputs.close()
                why = (f"exited with code {self._process.exitcode}" if self._process.exitcode is not None
                       else f"did not build its engine within {timeout_s:.0f} s")
                raise RuntimeError(f"the engine process {why} before it was ready")
        ok, payload = self._outputs.recv()
        if not ok:
            self._stop()
            self._outputs.close()
            raise RuntimeError(f"the engine process failed to build its engine:\n{payload}")
        return payload

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and self._reader.is_alive()

    def send(self, command: tuple) -> None:
        with self._lock:
            try:
                self._commands.send(command)
            except OSError:  # the process is gone; the reader has failed its requests
                pass

    def _read(self, deliver: Callable[[Delivery], None], lost: Callable[[str], None]) -> None:
        while True:
            try:
                delivery = self._outputs.recv()
            except (EOFError, OSError):
                break
            deliver(delivery)
        self._process.join(5.0)
        lost(f"the engine process ended (exit code {self._process.exitcode}) before this request finished")

    def join(self, timeout_s: float) -> None:
        self._process.join(timeout_s)
        self._stop()
        self._reader.join(timeout_s)

    def _stop(self) -> None:
        """Terminate the process if it still runs, then kill it if it must."""
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        with self._lock:
            self._commands.close()


def _engine_process(spec: EngineSpec, commands: Any, outputs: Any) -> None:
    """The engine process: build the engine, say it is ready (or why not), then run its loop, with a
    thread that moves commands from the pipe to the loop's inbox (so that a sender never waits for
    a step to end). The pipe's end (this process's starter gone) stops the loop. Ctrl-C in a terminal
    reaches every process of its group: this one leaves it to its starter, which drains it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = spec.build(*spec.args)
        limits = engine.limits
    except BaseException:  # noqa: BLE001 - the starter shows it
        outputs.send((False, traceback.format_exc()))
        return
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def forward() -> None:
        while True:
            try:
                inbox.put(commands.recv())
            except (EOFError, OSError):
                inbox.put(("stop", None))
                return
    threading.Thread(target=forward, name="labkit-engine-inbox", daemon=True).start()
    try:
        outputs.send((True, limits))
        EngineLoop(engine, inbox, outputs.send).run()
    except OSError:  # the starter is gone: no one to tell
        pass
