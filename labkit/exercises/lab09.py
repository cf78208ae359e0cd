"""Notebook 09 (serving over HTTP): a client reading a streamed completion, text streamed without a
broken character, a load test's figures, and the bridge between the engine loop and each request's stream.

The references are independent of labkit's serving modules: ex09.1's answers are the events its cases are
built from, ex09.2's come from the standard library's incremental UTF-8 decoder, ex09.3's are worked out by
hand with vLLM's ``benchmark_serving`` definitions, and ex09.4 drives the student's router against
``FakeEngine``, a small stand-in for the engine, in scenarios that each end within ``SCENARIO_LIMIT_S``.
"""
from __future__ import annotations

import asyncio
import codecs
import ctypes
import inspect
import json
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine

from labkit.answers import students_code
from labkit.exercises.spec import Case, Exercise, SaysWhatToDo, Scenario

# ex09.1 ------------------------------------------------------------------------------------------


def _event(text: str, finish_reason: str | None = None) -> str:
    """One token's server-sent event, as labkit's server writes it."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    body = {"id": "cmpl-9", "object": "text_completion", "created": 1700000000, "model": "target",
            "choices": [choice]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


_USAGE = "data: " + json.dumps({"id": "cmpl-9", "object": "text_completion", "created": 1700000000,
                                "model": "target", "choices": [],
                                "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}) + "\n\n"
_DONE = "data: [DONE]\n\n"
_HELLO = ["Hello", ",", " world", "!"]  # four tokens; the last one ends the completion


def _stream(pieces: list[str], finish_reason: str | None = "length") -> str:
    """The events of a completion whose tokens' texts are ``pieces``, the last carrying ``finish_reason``."""
    return "".join(_event(p, finish_reason if i == len(pieces) - 1 else None) for i, p in enumerate(pieces))


def _cut(data: bytes, every: int) -> list[bytes]:
    """``data`` in chunks of ``every`` bytes, as a network hands them over: anywhere."""
    return [data[i:i + every] for i in range(0, len(data), every)]


def _cut_off(parse_stream: Callable[..., Any]) -> None:
    for where, chunks in [("after two tokens", [_event("Hello"), _event(",")]),
                          ("after the last token and the usage", [_stream(_HELLO), _USAGE])]:
        try:
            got = parse_stream(chunks)
        except ValueError:
            continue
        raise AssertionError(f"a stream that ends {where}, without data: [DONE], was cut off: expected a ValueError, "
                             f"got {got!r}")


def _parse_cases() -> list[Case | Scenario]:
    hello, whole = ("Hello, world!", "length", 4), _stream(_HELLO) + _DONE
    crlf = whole.replace("\n", "\r\n")
    between = crlf.index("\r\n") + 1  # a chunk that ends between the \r and the \n
    accents = _stream(["Caf", "é", " crème"], "stop") + _DONE
    encoded = accents.encode()
    inside = encoded.index("é".encode()) + 1  # a chunk that ends inside the two bytes of é
    return [
        Case("one event per chunk", ([event + "\n\n" for event in whole.split("\n\n") if event],), hello,
             hint="each line 'data: {...}' is an event: its JSON's choices[0]['text'] is one token's text. The event "
                  "that carries finish_reason carries the last token's text too: add the text, then stop at the line "
                  "'data: [DONE]' (not JSON: it ends the stream)"),
        Case("bytes, cut every 7 bytes: lines and JSON split across chunks", (_cut(whole.encode(), 7),), hello,
             hint="a network chunk ends anywhere, in the middle of a line or of the JSON: keep what follows the last "
                  "newline of a chunk and put it before the next chunk; parse complete lines only"),
        Case("text, cut every 11 characters: lines and JSON split across str chunks", ([whole[i:i + 11] for i in
                                                                                        range(0, len(whole), 11)],),
             hello,
             hint="aiter_text() hands over str chunks, and they end anywhere too, in the middle of a line or of the "
                  "JSON: keep what follows the last newline and put it before the next chunk, as for bytes"),
        Case("the whole stream in one chunk", ([whole],), hello,
             hint="one chunk may hold several events: split it into lines and handle every line, not only the "
                  "chunk's first"),
        Case("lines that end with \\r\\n, a chunk cut between the \\r and the \\n", ([crlf[:between], crlf[between:]],),
             hello,
             hint="server-sent events may end their lines with \\r\\n: split on \\n and strip the \\r from each "
                  "line, or 'data: [DONE]\\r' is not [DONE]; an event then ends at '\\r\\n\\r\\n', not '\\n\\n' (and "
                  "the \\r and the \\n may come in different chunks)"),
        Case("a keep-alive comment between events", ([_event("Hello"), ": keep-alive\n\n", _event(","),
                                                      _stream([" world", "!"]), _DONE],), hello,
             hint="a line that starts with ':' is a comment (servers send them so that proxies keep the connection "
                  "open): skip it, as you skip the blank lines between events"),
        Case("a token whose text is empty still counts", ([_stream(["Hello", "", ",", " world", "!"]) + _DONE],),
             ("Hello, world!", "length", 5),
             hint="a token that ends in the middle of a UTF-8 character has the text '': it is one token all the "
                  "same. Count token events, not non-empty texts"),
        Case("with usage: an event whose choices are empty", ([_stream(_HELLO), _USAGE, _DONE],), hello,
             hint="with stream_options.include_usage the server sends one more event before [DONE]: 'choices' is [] "
                  "and 'usage' holds the counts. It is no token: count the choices, not the events"),
        Case("bytes, a chunk cut inside a UTF-8 character", ([encoded[:inside], encoded[inside:]],),
             ("Café crème", "stop", 3),
             hint="the JSON arrives as UTF-8 bytes, and a chunk can end between the two bytes of 'é': decode whole "
                  "lines, not each chunk"),
        Scenario("cut off: the connection closed before data: [DONE]", _cut_off,
                 hint="only [DONE] says the completion is whole: a stream that ends without it was cut off (a crash, a "
                      "dropped connection). Raise ValueError rather than return part of a completion as if it were "
                      "all"),
    ]


# ex09.2 ------------------------------------------------------------------------------------------


def _reference_pieces(token_bytes: list[bytes]) -> list[str]:
    """What each token lets out, then what the end of the stream does, by Python's incremental decoder."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return [decoder.decode(token) for token in token_bytes] + [decoder.decode(b"", final=True)]


def _text_cases() -> list[Case | Scenario]:
    runs = [  # the bytes of each token, what the case tests
        ("ASCII: every byte is a character", [b"Hel", b"lo", b",", b" world"],
         "ASCII is one byte per character: each token's text is complete, so it goes out with that token and "
         "nothing is held back (the last item, the end of the stream, is then '')"),
        ("an accent cut between two tokens", [b"ca", b"f\xc3", b"\xa9!"],
         "a token may end in the middle of a character: é is C3 A9. Hold the C3 back until the token that completes "
         "it: never emit U+FFFD for bytes that the next token may complete"),
        ("a Chinese character cut after two of its three bytes", [b"\xe6\x97", b"\xa5\xe6\x9c\xac"],
         "a three-byte character may be cut after one or two of its bytes: look back up to three bytes for the byte "
         "the character starts with (not 10xxxxxx), and see how many bytes it says the character has"),
        ("one token holds the end of a character and the start of the next", [b"\xc3", b"\xa9\xc3", b"\xbc"],
         "the second token completes é and starts ü: emit é and hold back ü's first byte"),
        ("an emoji over four tokens", [b"\xf0", b"\x9f", b"\x98", b"\x80", b" ok"],
         "a four-byte character (a first byte F0..F4) is held back until all four bytes are in, however many tokens "
         "that takes"),
        ("first bytes at both edges of each range, one byte a token",
         [bytes([b]) for b in "\u0080\u07ff\u0800\uffff\U00010000\U0010ffff".encode()],
         "the first byte says the length: C2..DF two bytes, E0..EF three, F0..F4 four. Each edge of each range "
         "starts a character here (U+0080, U+07FF, U+0800, U+FFFF, U+10000, U+10FFFF), each cut after every byte: "
         "check the bounds of your ranges"),
        ("invalid bytes never become a character", [b"a\xff", b"b", b"\x80c"],
         "FF starts no character, and 80 (10xxxxxx) continues nothing here: they can never be completed, so they "
         "become U+FFFD at once, as bytes.decode(errors='replace') makes them. Hold back only the start of a "
         "character at the very end"),
        ("bytes that fit a first byte's bits but start no character", [b"a\xc0", b"\x80", b"\xc1", b"b\xf5", b"\x80"],
         "C0 and C1 fit 110xxxxx, and F5 fits 11110xxx, but none of them starts a character (the table's last row "
         "lists them: C0 and C1 could only spell ASCII the long way round, and F5 would go past U+10FFFF). Like FF they can never "
         "be completed, so they become U+FFFD at once: two-byte characters start at C2, four-byte ones end at F4"),
        ("an invalid byte, then the start of a character, in one token", [b"a\x80\xe6\x97", b"\xa5"],
         "80 continues nothing: U+FFFD at once; but the E6 97 after it start a character that the next token "
         "completes: hold them back. Every invalid byte is replaced, not only the first, and not the bytes after it"),
        ("a character cut short by the next token", [b"\xc3", b"(x"],
         "C3 announces a two-byte character, but '(' is no continuation byte: the C3 is a broken character, U+FFFD, "
         "and the '(x' after it is text"),
        ("the stream ends inside a character", [b"ok", b"\xe2\x82"],
         "the last item is the flush: what the end of the stream leaves. Bytes held back are then never completed: "
         "they become U+FFFD (decode them with errors='replace'), they are not dropped"),
    ]
    cases: list[Case | Scenario] = [Case(label, (tokens,), _reference_pieces(tokens), hint=hint)
                                    for label, tokens, hint in runs]
    return cases + [Scenario("written without Python's incremental decoder", _without_codecs,
                             hint="the exercise is to write the decoder that codecs.getincrementaldecoder('utf-8') "
                                  "gives: find where the last character starts and how long it says it is")]


# Python's own ways to decode UTF-8 a piece at a time, by name and as objects (an import may rename them)
_DECODER_NAMES = {"getincrementaldecoder", "incrementaldecoder", "IncrementalDecoder", "BufferedIncrementalDecoder",
                  "iterdecode", "utf_8_decode", "getreader", "StreamReader"}
_DECODERS = (codecs.getincrementaldecoder, codecs.iterdecode, codecs.utf_8_decode, codecs.getreader,
             codecs.IncrementalDecoder, codecs.BufferedIncrementalDecoder)


def _without_codecs(stream_text: Callable[[list[bytes]], list[str]]) -> None:
    """The student's code, and the functions of theirs it calls, name none of Python's incremental decoders
    (once it runs: a stub is not attempted yet)."""
    stream_text([b"ok"])
    for name in _names_used(stream_text):
        raise AssertionError(f"stream_text uses {name} from Python's codecs: it gives the right pieces, but writing "
                             "that decoder is the exercise")


def _names_used(fn: Any) -> list[str]:
    """The decoders among the names that ``fn``'s code (its nested functions, classes and lambdas too) and the
    functions of the same module that it calls refer to."""
    module = getattr(fn, "__globals__", {})
    return [name for code in students_code(fn) for name in code.co_names
            if name in _DECODER_NAMES or any(module.get(name) is decoder for decoder in _DECODERS)]


# ex09.3 ------------------------------------------------------------------------------------------


def _metrics(ttft: tuple[float, float, float], tpot: tuple[float, float, float], requests: float, tokens: float,
             good: float, duration: float) -> dict[str, float]:
    """The figures of a run, named as vLLM names them: percentiles in ms, rates per second of ``duration``."""
    names = ("median", "p90", "p99")  # floats all: 200.0, not 200, which would ask for an int
    return ({f"{n}_ttft_ms": float(v) for n, v in zip(names, ttft)}
            | {f"{n}_tpot_ms": float(v) for n, v in zip(names, tpot)}
            | {"request_throughput": requests / duration, "output_throughput": tokens / duration,
               "request_goodput": good / duration})


def _metric_cases() -> list[Case]:
    # (send time, token times, finish time) per request, in seconds; expected values worked out by hand
    at_once = [(0.0, [0.3, 0.32, 0.34], 0.34), (0.0, [0.1, 0.16, 0.22], 0.22), (0.0, [0.5, 0.54, 0.58], 0.58),
               (0.0, [0.2, 0.28, 0.36], 0.36), (0.0, [0.4, 0.45, 0.5], 0.5)]  # TTFT .1 .. .5 s, TPOT 20 .. 80 ms
    staggered = [(10.0, [10.1, 10.2, 10.3, 10.4], 10.45), (11.0, [11.3, 11.35, 11.4], 11.4),
                 (12.0, [12.2, 12.3], 12.35)]
    slo_mix = [(0.0, [0.125, 0.15625, 0.1875], 0.1875),  # meets both
               (0.0, [0.5, 0.53125, 0.5625], 0.5625),  # TTFT over the limit
               (0.0, [0.125, 0.25, 0.375], 0.375),  # TPOT over the limit
               (0.0, [0.25, 0.28125, 0.3125], 0.3125)]  # TTFT exactly at the limit: meets it
    one_token = [(0.0, [0.2], 0.2), (0.0, [0.1, 0.2, 0.3], 0.3), (0.0, [0.3, 0.35, 0.4, 0.45], 0.45)]
    at_the_limits = [(0.0, [0.25, 0.3125, 0.375], 0.375),  # TTFT 250 ms, TPOT 62.5 ms: both exactly at the limits
                     (0.0, [0.2501, 0.26, 0.27], 0.27),  # TTFT 250.1 ms: over
                     (0.0, [0.125, 0.18755, 0.2501], 0.2501)]  # TPOT 62.55 ms: over
    return [
        Case("one request of five tokens", ([(0.0, [0.2, 0.25, 0.3, 0.35, 0.4], 0.4)], 500, 100),
             _metrics((200, 200, 200), (50, 50, 50), 1, 5, 1, 0.4),
             hint="TTFT = first token - send; TPOT = (finish - send - TTFT) / (n - 1): the time after the first token "
                  "spread over the n - 1 tokens that follow it, not over all n; both in ms. One request: every "
                  "percentile is its value, and the median is the 50th percentile (not the mean). The three rates "
                  "are per second of the run (0.4 s here, the first send to the last finish): 1 request, 5 output "
                  "tokens (the first one too), 1 good request, not a fraction of the requests"),
        Case("five requests sent at once: percentiles interpolate", (at_once, 1000, 100),
             _metrics((300, 460, 496), (50, 72, 79.2), 5, 15, 5, 0.58),
             hint="the p-th percentile of sorted values v_0..v_(n-1) sits at rank p/100 * (n - 1), interpolated "
                  "linearly between the two ranks around it (numpy.percentile's default): of 5 TTFTs .1 .. .5 s, p90 "
                  "is at rank 3.6: 400 + 0.6 * 100 = 460 ms, not the nearest rank's 500. The run lasts from the first "
                  "send to the last finish, 0.58 s here, not the sum of the requests' times (they overlap)"),
        Case("requests sent at different times", (staggered, 1000, 200),
             _metrics((200, 280, 298), (350 / 3, 430 / 3, 448 / 3), 3, 9, 3, 2.35),
             hint="each request's TTFT runs from its own send, not the first request's; the finish may come after the "
                  "last token (TPOT runs to the finish); and the run lasts from the first send to the last finish "
                  "(the clock's zero is not the start: perf_counter's is arbitrary)"),
        Case("goodput: only requests that meet both limits count", (slo_mix, 250, 50),
             _metrics((187.5, 425, 492.5), (31.25, 96.875, 122.1875), 4, 12, 2, 0.5625),
             hint="a good request meets the TTFT limit and the TPOT limit, both: one over either is not good. Meeting "
                  "a limit means at or under it (<=): a TTFT of exactly 250 ms meets a 250 ms limit"),
        Case("the limits, met exactly and missed by a hair", (at_the_limits, 250, 62.5),
             _metrics((250, 250.08, 250.098), (62.5, 62.54, 62.549), 3, 9, 1, 0.375),
             hint="a TTFT or TPOT exactly at its limit meets it (<=); one a hair over (0.1 ms, 0.05 ms) does not. "
                  "The times are in seconds and the limits in ms: compare TTFT x 1000 with the limit as it is"),
        Case("a request of one token has no TPOT", (one_token, 250, 60),
             _metrics((200, 280, 298), (75, 95, 99.5), 3, 8, 1, 0.45),
             hint="with one token there is no time per output token: leave it out of the TPOT percentiles (not a 0 in "
                  "them, no division by zero), and count it as meeting the TPOT limit, as vLLM does"),
    ]


# ex09.4 ------------------------------------------------------------------------------------------

SCENARIO_LIMIT_S = 2.0  # an ex09.4 scenario takes milliseconds: after this, a stream that has not ended hangs


@dataclass
class _FakeRequest:
    request_id: str
    first_token: int
    n_tokens: int
    produced: int = 0


class FakeEngine:
    """A stand-in for the engine of notebook 04, cut down to what ex09.4 needs. Requests wait, up to
    ``max_running`` of them run, and each step gives every running request its next token. The k-th
    request added gets the tokens 100k, 100k + 1, ..., so that a token says whose it is."""

    def __init__(self, max_running: int = 2) -> None:
        self.max_running = max_running
        self.waiting: deque[_FakeRequest] = deque()
        self.running: list[_FakeRequest] = []
        self.owners: dict[int, str] = {}  # first token -> request id, of every request ever added

    def add(self, request_id: str, n_tokens: int) -> None:
        """Queue a request for ``n_tokens`` tokens; a ValueError if one with this id is in the engine."""
        if self.holds(request_id):
            raise ValueError(f"request {request_id!r} is in the engine already: request ids are unique")
        if n_tokens < 1:
            raise ValueError(f"n_tokens must be at least 1, got {n_tokens}")
        first = 100 * (len(self.owners) + 1)
        self.owners[first] = request_id
        self.waiting.append(_FakeRequest(request_id, first, n_tokens))

    def abort(self, request_id: str) -> bool:
        """Remove a request, waiting or running; whether there was one (as with the engine's
        ``Scheduler.abort``, an unknown id is no error)."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    return True
        return False

    def holds(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r in (*self.waiting, *self.running))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def whose(self, token: int) -> str | None:
        """The id of the request a token belongs to."""
        return self.owners.get(token // 100 * 100)

    async def step(self) -> list[tuple[str, int, bool]]:
        """One step: admit waiting requests while fewer than ``max_running`` run, then give each request of the
        batch its next token: ``(request_id, token, finished)``. The step awaits while the model runs, and other
        coroutines run meanwhile: the batch is fixed when the step starts, so a request aborted while the step
        runs still gets its token in this step's outputs, as from a model step already under way."""
        if not self.has_unfinished():
            raise RuntimeError("nothing to run: no request is waiting or running (step only while has_unfinished())")
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.popleft())
        batch = list(self.running)
        await asyncio.sleep(0)  # the model runs (labkit's AsyncEngine runs it in a process of its own)
        outputs = []
        for request in batch:
            request.produced += 1
            finished = request.produced == request.n_tokens
            outputs.append((request.request_id, request.first_token + request.produced - 1, finished))
            if finished and request in self.running:
                self.running.remove(request)
        return outputs


@dataclass
class _Reader:
    """A client reading one request's stream; ``then`` maps a count of tokens read to what it does next."""

    request_id: str
    queue: asyncio.Queue
    then: dict[int, Callable[[], None]]
    got: list[int] = field(default_factory=list)

    async def read(self) -> None:
        while (token := await self.queue.get()) is not None:
            self.got.append(token)
            if len(self.got) in self.then:
                self.then[len(self.got)]()


class _Harness:
    """One scenario's engine, the student's router on it, the readers of its streams, and its run()."""

    def __init__(self, router_class: Callable[..., Any], max_running: int) -> None:
        self.engine = FakeEngine(max_running)
        self.router = router_class(self.engine)
        self.readers: dict[str, tuple[_Reader, asyncio.Task]] = {}
        self.running: asyncio.Task | None = None

    def open(self, request_id: str, n_tokens: int, then: dict[int, Callable[[], None]] | None = None) -> None:
        """Add a request through the router and start a client reading its stream."""
        queue = self.router.add(request_id, n_tokens)
        if not isinstance(queue, asyncio.Queue):
            raise AssertionError(f"add({request_id!r}, {n_tokens}) returned {queue!r}: expected the request's "
                                 "stream, an asyncio.Queue")
        reader = _Reader(request_id, queue, then or {})
        self.readers[request_id] = (reader, asyncio.ensure_future(reader.read()))

    def abort(self, request_id: str) -> None:
        returned = self.router.abort(request_id)
        if inspect.iscoroutine(returned):
            returned.close()  # never run: no "never awaited" warning besides this message
            raise SaysWhatToDo(f"abort({request_id!r}) returned a coroutine: abort is a plain method (def, not async "
                               "def), called from a handler that does not await it; it only puts None on a queue and "
                               "tells the engine, neither of which waits")
        if self.engine.holds(request_id):
            raise AssertionError(f"abort({request_id!r}) returned, but the engine still holds the request: it would "
                                 "go on generating and keep its memory")
        reader, task = self.readers.get(request_id, (None, None))
        if reader is not None and not task.done() and not _ends(reader.queue):
            raise AssertionError(f"abort({request_id!r}) returned, but the request's stream has not ended: put None "
                                 "in its queue now, in abort (its client is gone; run() would end it a step later, "
                                 "or never)")

    def tasks(self) -> list[asyncio.Task]:
        """run() (once started) and the readers."""
        return [task for task in (self.running, *(task for _, task in self.readers.values())) if task is not None]

    async def settle(self) -> None:
        """Start run() (if not yet), and wait until every stream has ended and run() has returned: re-raise what
        either raised, fail naming what still waits after ``SCENARIO_LIMIT_S``."""
        self.running = self.running or asyncio.ensure_future(self.router.run())
        deadline = asyncio.get_running_loop().time() + SCENARIO_LIMIT_S
        while True:
            for task in self.tasks():
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            pending = [task for task in self.tasks() if not task.done()]
            if not pending:
                return
            left = max(deadline - asyncio.get_running_loop().time(), 0)
            done, _ = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise AssertionError(self._hanging())

    def forget(self) -> None:
        """Mark what finished tasks raised as seen (one is re-raised already): asyncio would log the others."""
        for task in self.tasks():
            if task.done() and not task.cancelled():
                task.exception()

    def _hanging(self) -> str:
        waiting = [reader for reader, task in self.readers.values() if not task.done()]
        if not waiting:
            return (f"every stream ended, but run() had not returned after {SCENARIO_LIMIT_S:g} s: it must return "
                    "once the engine has nothing unfinished")
        reader = waiting[0]
        returned = " (run() had returned)" if self.running.done() else ""
        return (f"request {reader.request_id!r} received {reader.got} and then nothing more for {SCENARIO_LIMIT_S:g} "
                f"s{returned}: its stream never ended (no None in its queue)")

    def verify(self, expected: dict[str, list[int]]) -> None:
        """Each stream got exactly its request's tokens, in order, and nothing came after its end."""
        for request_id, want in expected.items():
            reader, _ = self.readers[request_id]
            if reader.got != want:
                strangers = [t for t in reader.got if self.engine.whose(t) != request_id]
                whose = (f": {strangers[0]} is request {self.engine.whose(strangers[0])!r}'s token" if strangers
                         else "")
                raise AssertionError(f"request {request_id!r} received {reader.got}, expected {want}{whose}")
            after = [reader.queue.get_nowait() for _ in range(reader.queue.qsize())]
            if after:
                raise AssertionError(f"request {request_id!r}'s stream ended (None), and then its queue received "
                                     f"{after}: nothing may come after the end")


def _ends(queue: asyncio.Queue) -> bool:
    """Whether the last item put in ``queue`` and not yet taken is None, the stream's end."""
    waiting = [queue.get_nowait() for _ in range(queue.qsize())]  # no public way to look: take them all, put
    for item in waiting:                                             # them back in their order,
        queue.put_nowait(item)
    for _ in waiting:  # and take back the tasks put_nowait counted: join() and task_done() see the queue as it was
        queue.task_done()
    return bool(waiting) and waiting[-1] is None


def _stop_thread(thread: threading.Thread) -> None:
    """Raise SystemExit in ``thread`` at its next line of Python: the one way to stop a loop that never awaits."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit))
    thread.join(1.0)


def _in_own_loop(play: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``play()`` on an event loop of its own in a thread of its own (a notebook's thread runs a loop of its
    own already), and re-raise what it raised. A coroutine that never gives the loop a turn cannot be timed out
    by asyncio: after twice the scenario's time it is stopped, and fails."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(play())
        except BaseException as error:  # noqa: B036 -- handed to the caller, whatever it is
            raised.append(error)
    thread = threading.Thread(target=target, name="ex09.4 scenario", daemon=True)
    thread.start()
    thread.join(2 * SCENARIO_LIMIT_S)
    if thread.is_alive():
        _stop_thread(thread)
        raise AssertionError(f"still running after {2 * SCENARIO_LIMIT_S:g} s without giving the event loop a turn: "
                             "a loop with no await in it (while True: ... that awaits nothing?)")
    if raised:
        raise raised[0]


def _scenario(label: str, max_running: int, body: Callable[[_Harness], Coroutine[Any, Any, None]],
              hint: str) -> Scenario:
    def play(router_class: Callable[..., Any]) -> None:
        async def scenario() -> None:
            harness = _Harness(router_class, max_running)
            try:
                await body(harness)
            finally:
                harness.forget()
        _in_own_loop(scenario)
    return Scenario(label, play, hint=hint)


async def _one(h: _Harness) -> None:
    h.open("a", 3)
    await h.settle()
    h.verify({"a": [100, 101, 102]})


async def _three(h: _Harness) -> None:
    h.open("a", 3)
    h.open("b", 1)
    h.open("c", 4)
    await h.settle()
    h.verify({"a": [100, 101, 102], "b": [200], "c": [300, 301, 302, 303]})


async def _late(h: _Harness) -> None:
    h.open("a", 3, then={1: lambda: h.open("b", 2)})
    await h.settle()
    h.verify({"a": [100, 101, 102], "b": [200, 201]})


async def _disconnect(h: _Harness) -> None:
    h.open("a", 5, then={2: lambda: h.abort("a")})
    h.open("b", 3)
    await h.settle()
    h.verify({"a": [100, 101], "b": [200, 201, 202]})


async def _abort_waiting(h: _Harness) -> None:
    h.open("a", 3, then={1: lambda: h.abort("b")})
    h.open("b", 2)
    await h.settle()
    h.verify({"a": [100, 101, 102], "b": []})


async def _late_aborts(h: _Harness) -> None:
    h.open("a", 2)
    h.open("b", 3, then={1: lambda: (h.abort("b"), h.abort("b"))})
    await h.settle()
    h.abort("a")  # finished already: a disconnect noticed after the end
    h.abort("nobody")
    h.verify({"a": [100, 101], "b": [200]})


def _router_cases() -> list[Scenario]:
    return [
        _scenario("one request of three tokens", 2, _one,
                  hint="run() awaits engine.step() while engine.has_unfinished(), and puts each token in its request's "
                       "queue; the token that comes with finished=True is the last: put None after it, or the "
                       "client waits forever"),
        _scenario("three requests, two running at a time", 2, _three,
                  hint="each request needs a queue of its own, found by its id (a dict): with one queue for all, a "
                       "token goes to whichever client asks first, and the first None ends every stream"),
        _scenario("a request added while run() runs", 2, _late,
                  hint="b is added while a's tokens stream: run() keeps stepping as long as the engine has anything "
                       "unfinished, new requests included"),
        _scenario("a client disconnects: abort a running request after two tokens", 2, _disconnect,
                  hint="abort removes the request from the engine (engine.abort), ends its stream (None) and forgets "
                       "it. The step under way when it was aborted still has a token for it: run() must drop it, "
                       "without an error, and not put it in the queue after the end"),
        _scenario("abort a request still waiting", 1, _abort_waiting,
                  hint="b waits behind a (one request runs at a time) when it is aborted: its stream ends with no "
                       "token, and the engine never runs it"),
        _scenario("abort twice, abort after the end, abort an id never added", 2, _late_aborts,
                  hint="a disconnect can come after the request finished, or twice: abort of an id that no longer "
                       "runs does nothing: no error, and no second None in a stream that has ended"),
    ]


EXERCISES = [
    Exercise(
        id="ex09.1", title="Parse a streamed completion (server-sent events)", points=2, function="parse_stream",
        returns=("text", "finish_reason", "tokens"), cases=_parse_cases,
        recipe="Keep a buffer of bytes (str chunks .encode()d). For each chunk: buffer += chunk; *lines, buffer = "
               "buffer.split(b'\\n'). For each complete line: line = line.decode().removesuffix('\\r'); skip it "
               "unless it starts with 'data: '; payload = what follows; if payload == '[DONE]', return (text, "
               "finish_reason, tokens); else for each choice in json.loads(payload)['choices'] (none in the usage "
               "event): text += choice['text'], tokens += 1, finish_reason = choice['finish_reason']. After the "
               "last chunk, with no [DONE] seen, raise ValueError.",
    ),
    Exercise(
        id="ex09.2", title="Stream text without breaking a character", points=2, function="stream_text",
        cases=_text_cases,
        recipe="Keep the bytes not yet emitted (pending). After each token: pending += token; find the last byte "
               "among pending's last 3 that is not a continuation byte (b & 0xC0 != 0x80): it starts the last "
               "character; if the length it announces (C2..DF: 2, E0..EF: 3, F0..F4: 4, anything else: 1) is more "
               "than the bytes from it to the end, hold those bytes back; emit the rest with "
               ".decode('utf-8', errors='replace'). At the end, append pending.decode('utf-8', errors='replace').",
    ),
    Exercise(
        id="ex09.3", title="Percentiles and goodput from per-request timestamps", points=1, function="serving_metrics",
        cases=_metric_cases,
        recipe="For each (send, token_times, finish): ttft = token_times[0] - send; n = len(token_times); tpot = "
               "(finish - send - ttft) / (n - 1) if n > 1 (only those go into the TPOT percentiles); good if ttft * "
               "1000 <= slo_ttft_ms and (n == 1 or tpot * 1000 <= slo_tpot_ms). duration = max(finish) - min(send). "
               "Percentiles: numpy.percentile(values_in_ms, [50, 90, 99]) (linear). request_throughput = requests / "
               "duration, output_throughput = sum of n / duration, request_goodput = good / duration.",
    ),
    Exercise(
        id="ex09.4", title="From the engine loop to each request's stream, with abort", points=2,
        function="StreamRouter", methods=("add", "run", "abort"), cases=_router_cases,
        recipe="add: queue = asyncio.Queue(); self.queues[request_id] = queue; self.engine.add(request_id, n_tokens); "
               "return queue. run: while self.engine.has_unfinished(): for request_id, token, finished in await "
               "self.engine.step(): queue = self.queues.get(request_id); skip if None (aborted meanwhile); "
               "queue.put_nowait(token); if finished: queue.put_nowait(None) and del self.queues[request_id]. abort: "
               "queue = self.queues.pop(request_id, None); if None, return; self.engine.abort(request_id); "
               "queue.put_nowait(None).",
    ),
]

__all__ = ["EXERCISES", "FakeEngine", "SCENARIO_LIMIT_S"]
