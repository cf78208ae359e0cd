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
import contextlib
import dataclasses
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
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
    """The engine as its loop last saw it: gauges, and totals since the start."""

    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    prompt_tokens: int = 0  # prompt tokens of the requests that reached their first token
    cached_tokens: int = 0  # of those, the ones the prefix cache held
    preemptions: int = 0
    generated_tokens: int = 0
    steps: int = 0


@dataclass(frozen=True)
class Reply:
    """The engine loop's answer to a command that is not a request (a prefix-cache reset): its result."""

    value: Any


class QueueFull(RuntimeError):
    """More requests wait than the engine admits; try again later."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new request."""


@dataclass(frozen=True)
class EngineSpec:
    """An engine to run in a process of its own: that process builds it with ``build(*args)``, so
    ``build`` must be importable by name (a module's function, not a notebook cell's) and ``args``
    picklable. The process is a daemon, which may start no process of its own."""

    build: Callable[..., EngineCore]
    args: tuple = ()


@dataclass
class Delivery:
    """What the engine loop sends after it applied commands or stepped, by stream (each ``stream``
    call's key): new events (a ``TokenEvent``, or the error that ends the stream), the arrival time
    the engine gave each request that got its first token (an engine in a process serves a copy of
    the request: this is how the caller's copy learns it), and the engine's stats."""

    events: list[tuple[int, Any]] = field(default_factory=list)
    arrivals: dict[int, float] = field(default_factory=dict)
    stats: EngineStats | None = None


class RequestStream:
    """One request's tokens as they come: an async iterator of ``TokenEvent``, the last with the finish
    reason (an engine failure raises). Closing it before the end (``aclose``, or dropping it: a client
    gone) aborts the request, wherever it is."""

    def __init__(self, engine: AsyncEngine, request_id: Hashable, key: int, sink: asyncio.Queue) -> None:
        self._engine, self.request_id, self._key, self._sink = engine, request_id, key, sink
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
        """Dropped unfinished (from whichever thread collects it): end it on its event loop, or here
        if that loop has closed and nothing else runs there."""
        if not self._done:
            try:
                self._engine._loop.call_soon_threadsafe(self._end, True)
            except RuntimeError:
                self._end(True)

    def _end(self, abort: bool) -> None:
        if not self._done:
            self._done = True
            self._engine._release(self.request_id, self._key, abort)


@dataclass
class _Sink:
    """Where one stream's events go; its caller's ``Request`` (which learns its arrival time), or None for a
    caller awaiting a ``Reply``."""

    request: Request | None
    queue: asyncio.Queue


class AsyncEngine:
    """An engine behind an event loop (see the module docstring): an ``EngineCore`` stepped in a thread, or
    an ``EngineSpec`` built and stepped in a process of its own. ``max_waiting``: how many requests may
    wait for admission before ``stream`` raises ``QueueFull``. Building the engine in a process waits for
    it (up to ``start_timeout_s``); a build that fails raises ``RuntimeError`` saying why. An
    ``AsyncEngine`` serves the event loop of its first ``stream`` call, which alone touches its state."""

    def __init__(self, engine: EngineCore | EngineSpec, max_waiting: int = 256,
                 start_timeout_s: float = 300.0) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting} must be at least 1")
        self.max_waiting, self.accepting = max_waiting, True
        self.stats = EngineStats()  # replaced whole by each delivery (the engine loop's first one at its start)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._binding = threading.Lock()  # binding the loop, against a delivery deciding where to run
        self._serving: dict[Hashable, int] = {}  # request id -> its stream's key, from stream() to the stream's end
        self._sinks: dict[int, _Sink] = {}  # key -> a stream whose last event has not come
        self._keys = itertools.count()
        self._ended: str | None = None  # why the engine loop ended, once it has
        if isinstance(engine, EngineSpec):
            self._core: _ThreadCore | _ProcessCore = _ProcessCore(engine, self._receive, self._receive_end,
                                                                  start_timeout_s)
        elif isinstance(engine, EngineCore):
            self._core = _ThreadCore(engine, self._receive, self._receive_end)
        else:
            raise TypeError(f"engine must be an EngineCore (stepped in a thread) or an EngineSpec (built and stepped "
                            f"in a process), got {type(engine).__name__}")
        self.limits: EngineLimits = self._core.limits

    # the event loop's side ------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the engine loop runs (it stops after ``shutdown``, or if its process dies)."""
        return self._ended is None and self._core.alive

    @property
    def engine_pid(self) -> int | None:
        """The engine's process (None: it steps in a thread of this one)."""
        return self._core.pid

    @property
    def num_waiting(self) -> int:
        """Requests being served beyond the batch's cap (``max_num_seqs``): those must wait. Counted
        on the event loop's side, so that a burst is counted before the engine loop sees it."""
        return max(0, len(self._serving) - self.limits.config.max_num_seqs)

    def stream(self, request: Request) -> RequestStream:
        """Serve ``request``: it joins the engine at once, and the returned ``RequestStream`` yields a
        ``TokenEvent`` per sampled token, the last with its finish reason. Raises ``ValueError`` for
        a request the engine could never serve, ``QueueFull`` or ``EngineStopped``. An engine in a
        process serves a copy of ``request``: of what the engine writes in it, only
        ``arrival_time`` comes back (the events carry the tokens and their times)."""
        self._bind(asyncio.get_running_loop())
        self._admit(request)
        key = next(self._keys)
        self._serving[request.request_id], self._sinks[key] = key, _Sink(request, asyncio.Queue())
        self._core.send(("add", key, request))
        return RequestStream(self, request.request_id, key, self._sinks[key].queue)

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._binding:
            if self._loop is None:
                self._loop = loop
        if loop is not self._loop:
            raise RuntimeError("this AsyncEngine serves another event loop (the one of its first stream() call)")

    def _release(self, request_id: Hashable, key: int, abort: bool) -> None:
        """A stream has ended (``abort``: before its request finished, which must go)."""
        self._serving.pop(request_id, None)
        if abort:
            self._sinks.pop(key, None)
            self._abort(request_id, key)

    def _admit(self, request: Request) -> None:
        if not self.accepting:
            raise EngineStopped("the server is shutting down and takes no new request")
        if not self.alive:
            raise EngineStopped(f"{self._ended or 'the engine loop has ended'}: no new request can be served")
        if request.request_id in self._serving:
            raise ValueError(f"a request with id {request.request_id!r} is already being served: ids must be unique")
        self.limits.check(request)
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting, the most this server queues "
                            f"(max_waiting={self.max_waiting}): retry later")

    def abort(self, request_id: Hashable) -> None:
        """Remove a request at the next step boundary, wherever it is, and free its blocks; its
        stream ends with finish reason "abort". Unknown or finished ids are ignored."""
        if (key := self._serving.get(request_id)) is not None:
            self._abort(request_id, key)

    def _abort(self, request_id: Hashable, key: int) -> None:
        if self.alive:
            self._core.send(("abort", key, request_id))

    async def reset_prefix_cache(self) -> int:
        """Have the engine forget every block its prefix cache holds (``EngineCore.reset_prefix_cache``), between
        its steps; returns how many it forgot. Raises ``ValueError`` while requests are served, and ``EngineStopped``
        once it has stopped."""
        self._bind(asyncio.get_running_loop())
        if not self.alive:
            raise EngineStopped(f"{self._ended or 'the engine loop has ended'}: its prefix cache is gone")
        key, sink = next(self._keys), asyncio.Queue()
        self._sinks[key] = _Sink(None, sink)
        self._core.send(("reset", key, None))
        reply = await sink.get()
        if isinstance(reply, BaseException):
            raise reply
        return reply.value

    async def shutdown(self, drain_s: float = 5.0) -> None:
        """Stop admitting, let what runs finish for up to ``drain_s`` seconds, abort the rest, and
        stop the engine loop (and its process)."""
        self.accepting = False
        deadline = time.monotonic() + drain_s
        while self._serving and time.monotonic() < deadline and self.alive:
            await asyncio.sleep(0.02)
        if self.alive:
            self._core.send(("stop", None, None))
        await asyncio.get_running_loop().run_in_executor(None, self._core.join, 10.0)

    def _deliver(self, delivery: Delivery) -> None:
        """A delivery, on the event loop: the stats first (a client that has its tokens must find them
        counted in /metrics), then each event to its stream."""
        if delivery.stats is not None:
            self.stats = delivery.stats
        for key, arrival in delivery.arrivals.items():
            if (sink := self._sinks.get(key)) is not None:
                sink.request.arrival_time = arrival
        for key, item in delivery.events:
            if (sink := self._sinks.get(key)) is None:  # its stream was closed
                continue
            if isinstance(item, (BaseException, Reply)) or item.finish_reason is not None:
                del self._sinks[key]
            sink.queue.put_nowait(item)

    def _engine_ended(self, why: str) -> None:
        """The engine loop has ended (on the event loop, if one is bound): a stream still open fails,
        saying ``why``, a new one is refused, and the gauges say that nothing runs."""
        self._ended, old = why, self.stats
        stats = dataclasses.replace(old, running=0, waiting=0, blocks_used=0,
                                    blocks_free=old.blocks_free + old.blocks_used)
        failed = f"{why} before this request finished"  # an exception each: each stream raises its own
        self._deliver(Delivery(events=[(key, RuntimeError(failed)) for key in self._sinks], stats=stats))

    # from the engine loop's thread, or this process's reader of its pipe --------------------------------

    def _receive(self, delivery: Delivery) -> None:
        self._on_loop(self._deliver, delivery)

    def _receive_end(self, why: str) -> None:
        self._on_loop(self._engine_ended, why)

    def _on_loop(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Run ``fn(arg)`` on the event loop, whose state it changes; before any stream has bound one,
        here and now (while no stream can bind it); a loop that has closed has no one left to tell."""
        with self._binding:
            if self._loop is None:
                fn(arg)
                return
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, arg)


@dataclass
class _Live:
    """A request the engine loop serves: its stream's key, and how many of its tokens it has sent."""

    key: int
    request: Request
    sent: int = 0


class EngineLoop:
    """The engine's side: the one owner of an ``EngineCore``. It applies the commands from ``inbox``
    between steps (waiting for one when idle), steps while there is work, and hands a ``Delivery`` to
    ``deliver`` after each round (and one with the stats at its start). Commands: ("add", key,
    request), ("abort", key, request_id), ("reset", key, None) (the prefix cache: a ``Reply`` with the blocks it
    forgot, or the error), ("stop", None, None); ``key`` names a stream, or the caller awaiting a reply."""

    def __init__(self, engine: EngineCore, inbox: queue.SimpleQueue, deliver: Callable[[Delivery], None]) -> None:
        self.engine, self.inbox, self.deliver = engine, inbox, deliver
        self.stats = EngineStats()
        self._live: dict[Hashable, _Live] = {}  # by request id: the engine serves one request of an id at a time
        self._out = Delivery()

    def run(self) -> None:
        self._publish()
        self._flush()
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
                kind, key, _ = self.inbox.get_nowait()
                if kind == "add":
                    self._refuse(key)
                elif kind == "reset":
                    self._send(key, EngineStopped("the engine stopped before it could reset its prefix cache"))
            self._flush()

    def _apply(self, block: bool) -> bool:
        """Apply the commands posted since the last step, in order (waiting for one when idle);
        True if one of them was stop. A request added after the stop is refused."""
        commands = [self.inbox.get()] if block else []  # every way the loop ends posts a stop
        while not self.inbox.empty():
            commands.append(self.inbox.get_nowait())
        stopping = False
        for kind, key, payload in commands:
            if kind == "stop":
                stopping = True
            elif kind == "add" and stopping:
                self._refuse(key)
            elif kind == "add":
                self._add(key, payload)
            elif kind == "reset":
                self._reset(key)
            else:
                self._abort(payload, key)
        if commands:
            self._publish()
        return stopping

    def _add(self, key: int, request: Request) -> None:
        try:
            self.engine.add(request)
        except ValueError as error:
            self._send(key, error)
            return
        self._live[request.request_id] = _Live(key, request)

    def _reset(self, key: int) -> None:
        try:
            self._send(key, Reply(self.engine.reset_prefix_cache()))
        except ValueError as error:
            self._send(key, error)

    def _refuse(self, key: int) -> None:
        self._send(key, EngineStopped("the engine stopped before this request could start"))

    def _abort(self, request_id: Hashable, key: int | None = None) -> None:
        """Abort a request (only if it is still ``key``'s, when given: an id may be served again)."""
        live = self._live.get(request_id)
        if live is None or key not in (None, live.key):
            return
        del self._live[request_id]
        self.engine.scheduler.abort(request_id)
        self._publish()
        self._send(live.key, TokenEvent(None, self.engine.now(), "abort"))

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as error:  # noqa: BLE001 - a failed step fails its requests, not the server
            for request_id, live in list(self._live.items()):
                self.engine.scheduler.abort(request_id)
                del self._live[request_id]
                self._send(live.key, RuntimeError(f"the engine failed: {error!r}"))
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
                self._out.arrivals[live.key] = request.arrival_time
            new += len(request.output) - live.sent
            for i in range(live.sent, len(request.output)):
                last = i == len(request.output) - 1 and request.finish_time is not None
                reason = ("stop" if stopped_at_eos(request, self.engine.eos_id) else "length") if last else None
                self._send(live.key, TokenEvent(request.output[i], request.token_times[i], reason))
            live.sent = len(request.output)
            if request.finish_time is not None:
                del self._live[request_id]
        return first, new

    def _send(self, key: int, item: TokenEvent | Reply | BaseException) -> None:
        self._out.events.append((key, item))

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

    pid = None

    def __init__(self, engine: EngineCore, deliver: Callable[[Delivery], None], ended: Callable[[str], None]) -> None:
        self.limits = engine.limits
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(EngineLoop(engine, self._inbox, deliver), ended),
                                        name="labkit-engine", daemon=True)
        self._thread.start()

    @staticmethod
    def _run(loop: EngineLoop, ended: Callable[[str], None]) -> None:
        try:
            loop.run()
        finally:
            ended("the engine loop ended")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def send(self, command: tuple) -> None:
        self._inbox.put(command)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


class _ProcessCore:
    """An ``EngineLoop`` in a process of its own (``spawn``), fed through one pipe and heard through
    another. Two threads here move the messages: a writer (so that a sender never waits for the pipe,
    and a send from a garbage collector's finalizer is safe) and a reader, which delivers, and which
    alone reaps the process when the pipe ends and then calls ``ended``. The process ends itself when
    this one is gone (its command pipe closes)."""

    def __init__(self, spec: EngineSpec, deliver: Callable[[Delivery], None], ended: Callable[[str], None],
                 timeout_s: float) -> None:
        check_importable(spec.build)
        context = mp.get_context("spawn")
        commands_in, self._commands = context.Pipe(duplex=False)
        self._outputs, outputs_out = context.Pipe(duplex=False)
        self._process = context.Process(target=_engine_process, args=(spec, commands_in, outputs_out),
                                        name="labkit-engine", daemon=True)
        try:
            with main_not_rerun():
                self._process.start()
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            self._close_pipes()
            raise ValueError(f"the EngineSpec cannot be sent to a new process: its args must be picklable "
                             f"({error})") from None
        finally:  # the child's ends: a closed pipe then means a dead peer
            commands_in.close()
            outputs_out.close()
        self.pid = self._process.pid
        try:
            self.limits: EngineLimits = self._started(timeout_s)
        except BaseException:
            self._end_process(wait_s=0.0)  # still building, or dead: nothing to wait for
            self._close_pipes()
            raise
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, args=(deliver,), name="labkit-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, args=(deliver, ended), name="labkit-engine-reader",
                                        daemon=True)
        self._writer.start()
        self._reader.start()

    def _started(self, timeout_s: float) -> EngineLimits:
        """The engine's limits, once the process has built it; a RuntimeError saying why not."""
        deadline = time.monotonic() + timeout_s
        while not self._outputs.poll(0.1):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine process did not build its engine within {timeout_s:g} s")
        try:
            ok, payload = self._outputs.recv()
        except EOFError:  # it died before it could say a word (killed, out of memory, a crash)
            self._process.join(5.0)
            raise RuntimeError(f"the engine process exited (exit code {self._process.exitcode}) before it was "
                               "ready") from None
        if not ok:
            raise RuntimeError(f"the engine process failed to build its engine:\n{payload}")
        return payload

    @property
    def alive(self) -> bool:
        return self._reader.is_alive()

    def send(self, command: tuple) -> None:
        self._outbox.put(command)

    def _write(self, deliver: Callable[[Delivery], None]) -> None:
        """Pickle and send each command until told to stop (None) or the pipe breaks. A command that
        cannot be pickled (only an add carries the caller's data) fails its stream, and only it."""
        try:
            while (command := self._outbox.get()) is not None:
                try:
                    data = ForkingPickler.dumps(command)
                except Exception as error:  # noqa: BLE001 - whatever pickling raises, the request's own fault
                    if command[0] == "add":
                        refused = ValueError(f"the request cannot be sent to the engine's process: {error!r}")
                        deliver(Delivery(events=[(command[1], refused)]))
                    continue
                self._commands.send_bytes(data)
        except OSError:  # the process is gone: the reader fails what was open
            pass
        finally:
            self._commands.close()

    def _read(self, deliver: Callable[[Delivery], None], ended: Callable[[str], None]) -> None:
        why = None
        try:
            while True:
                try:
                    delivery = self._outputs.recv()
                except (EOFError, OSError):
                    break
                except Exception as error:  # noqa: BLE001 - a message that cannot be read: the engine is lost
                    why = f"a message from the engine process could not be read ({error!r})"
                    break
                deliver(delivery)
        finally:  # whatever ended it: reap the process, stop the writer, and fail what is open
            self._end_process(wait_s=5.0 if why is None else 0.0)
            self._outbox.put(None)
            self._outputs.close()
            ended(why or f"the engine process ended (exit code {self._process.exitcode})")

    def join(self, timeout_s: float) -> None:
        """Wait for the process to end after a stop (the reader sees it), killing it if it does not."""
        self._reader.join(timeout_s)
        if self._reader.is_alive():
            self._process.kill()
            self._reader.join(timeout_s)

    def _end_process(self, wait_s: float) -> None:
        """Give the process ``wait_s`` to exit, then kill it."""
        self._process.join(wait_s)
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join(5.0)

    def _close_pipes(self) -> None:
        self._commands.close()
        self._outputs.close()


def _engine_process(spec: EngineSpec, commands: Any, outputs: Any) -> None:
    """The engine process: build the engine, say it is ready (or why not), then run its loop, with a
    thread that moves commands from the pipe to the loop's inbox. The pipe's end (this process's
    starter gone) stops the loop. It leaves its starter's process group: a signal to the whole group
    (Ctrl-C in a terminal, a service manager's SIGTERM) reaches the starter alone, which drains the
    engine and then stops it."""
    if hasattr(os, "setpgrp"):
        os.setpgrp()
    try:
        engine = spec.build(*spec.args)
        limits = engine.limits
    except BaseException:  # noqa: BLE001 - the starter shows it
        with contextlib.suppress(OSError):
            outputs.send((False, traceback.format_exc()))
        return
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_forward, args=(commands, inbox), name="labkit-engine-inbox", daemon=True).start()
    try:
        outputs.send((True, limits))
        EngineLoop(engine, inbox, outputs.send).run()
    except (BrokenPipeError, ConnectionResetError):  # the starter is gone: no one to tell
        pass


def _forward(commands: Any, inbox: queue.SimpleQueue) -> None:
    """Move commands from the pipe to the inbox; when the pipe ends, however it ends, stop the loop."""
    try:
        while True:
            inbox.put(commands.recv())
    except (EOFError, OSError):
        pass
    finally:
        inbox.put(("stop", None, None))
