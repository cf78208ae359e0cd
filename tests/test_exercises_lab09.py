"""Exercises of notebook 09: plausible mistakes fail at the case that tests them, with a hint that helps; the
references hold what the statements promise; a router that hangs, or never awaits, fails instead of hanging."""
from __future__ import annotations

import asyncio
import gc
import time
import warnings

import numpy as np
import pytest

from labkit.check import FAILED, NOT_ATTEMPTED, PASSED, run_cases
from labkit.exercises import get, lab09
from labkit.exercises.lab09 import FakeEngine
from labkit.exercises.spec import Case

from exercise_cells import cells, define, fails, mistake


@pytest.fixture
def quick(monkeypatch):
    """Scenarios of ex09.4 that hang give up after 0.2 s instead of 1 s."""
    monkeypatch.setattr(lab09, "SCENARIO_LIMIT_S", 0.2)


def test_lab09_parse_stream_mistakes_fail(root):
    choices = ('            for choice in json.loads(payload)["choices"]:  # the usage event has none\n'
               '                text += choice["text"]\n')
    mistakes = [  # (what the solution says, the slip, the case it fails first, what the message must say)
        ('*lines, buffer = buffer.split(b"\\n")', 'lines, buffer = buffer.split(b"\\n"), b""',
         "bytes, cut every 7 bytes", "keep what follows the last newline"),
        ("                tokens += 1\n", "", "one event per chunk", "expected 4, got 0"),
        (choices, choices.replace("text +=", 'if choice["finish_reason"]:\n'
                                             '                    return text, choice["finish_reason"], tokens\n'
                                             '                text +='),
         "one event per chunk", "carries the last token's text too"),
        ('            if payload == "[DONE]":\n', '            if False:\n', "one event per chunk",
         "(not JSON: it ends the stream)"),
        (('                return text, finish_reason, tokens\n',  # [DONE] skipped, and no stream is cut off
          '    raise ValueError("the stream ended without data: [DONE]: it was cut off")'),
         ("                continue\n", "    return text, finish_reason, tokens"), "cut off",
         "Raise ValueError rather than return part of a completion"),
        (('                return text, finish_reason, tokens\n',  # cut off only where no finish_reason came
          '    raise ValueError("the stream ended without data: [DONE]: it was cut off")'),
         ("                continue\n", '    if finish_reason is None:\n        raise ValueError("cut off")\n'
                                      '    return text, finish_reason, tokens'), "cut off",
         "ends after the last token and the usage, without data: [DONE]"),
        ('.removesuffix("\\r")', "", "lines that end with \\r\\n", "strip the \\r"),
        ('if not line.startswith("data: "):', "if not line:", "a keep-alive comment", "skip it"),
        ("tokens += 1", 'tokens += bool(choice["text"])', "a token whose text is empty", "Count token events"),
        (choices + '                tokens += 1\n', '            tokens += 1\n' + choices,
         "with usage", "It is no token"),
        ('for choice in json.loads(payload)["choices"]:', 'for choice in [json.loads(payload)["choices"][0]]:',
         "with usage", "raised IndexError"),
    ]
    for right, wrong, case, hint in mistakes:
        fails("ex09.1", mistake(root, "ex09.1", right, wrong), case, hint)


def test_a_parser_that_decodes_each_chunk_fails_on_a_character_cut_between_chunks(root):
    solution = define(cells("solutions", root)["ex09.1"], "parse_stream")
    per_chunk = lambda chunks: solution([c.decode() if isinstance(c, bytes) else c for c in chunks])  # noqa: E731
    fails("ex09.1", per_chunk, "bytes, a chunk cut inside a UTF-8 character", "decode whole lines")


def test_lab09_stream_text_mistakes_fail(root):
    def each_alone(token_bytes):
        return [t.decode("utf-8", errors="replace") for t in token_bytes] + [""]

    def until_an_error(replaces_the_invalid):
        """Holds back from the first error: an unfinished character, or (unless ``replaces_the_invalid``, which
        then replaces every byte, the start of a character after the invalid one too) an invalid byte."""
        def decode(token_bytes):
            pieces, pending = [], b""
            for token in token_bytes:
                pending += token
                try:
                    pieces.append(pending.decode())
                    pending = b""
                except UnicodeDecodeError as error:
                    ends = error.reason == "unexpected end of data" or not replaces_the_invalid
                    pieces.append(pending[:error.start].decode(errors="replace") if ends
                                  else pending.decode(errors="replace"))
                    pending = pending[error.start:] if ends else b""
            return pieces + [pending.decode(errors="replace")]
        return decode

    fails("ex09.2", each_alone, "an accent cut between two tokens", "never emit U+FFFD")
    fails("ex09.2", until_an_error(False), "invalid bytes never become a character", "become U+FFFD at once")
    fails("ex09.2", until_an_error(True), "an invalid byte, then the start of a character", "Every invalid byte")
    mistakes = [
        ("ready = len(pending) - incomplete(pending)", "ready = 0", "ASCII", "nothing is held back"),
        ('pieces.append(pending.decode("utf-8", errors="replace"))  #', 'pieces.append("")  #',
         "the stream ends inside a character", "they are not dropped"),
        ("range(1, min(3, len(data)) + 1)", "range(1, min(1, len(data)) + 1)", "a Chinese character",
         "look back up to three bytes"),
        ("else 4 if 0xF0 <= first <= 0xF4 else 1", "else 1", "an emoji over four tokens", "all four bytes"),
        ('.decode("utf-8", errors="replace"))\n        pending = pending[ready:]',
         '.decode("utf-8", errors="ignore"))\n        pending = pending[ready:]',
         "invalid bytes never become a character", "become U+FFFD at once"),
    ]
    for right, wrong, case, hint in mistakes:
        fails("ex09.2", mistake(root, "ex09.2", right, wrong), case, hint)


def test_the_pieces_expected_are_the_whole_decode_and_emitted_early():
    for case in get("ex09.2").cases():
        if not isinstance(case, Case):
            continue
        tokens, = case.args
        assert "".join(case.expected) == b"".join(tokens).decode("utf-8", errors="replace"), case.label
        assert len(case.expected) == len(tokens) + 1, case.label
    emoji = next(c for c in get("ex09.2").cases() if c.label.startswith("an emoji"))
    assert emoji.expected == ["", "", "", "\U0001F600", " ok", ""]


BORROWED = {  # cells that answer ex09.2 with Python's own decoder, and the name the check must find
    "getincrementaldecoder": "import codecs\n\ndef stream_text(token_bytes):\n"
                             "    d = codecs.getincrementaldecoder('utf-8')(errors='replace')\n"
                             "    return [d.decode(t) for t in token_bytes] + [d.decode(b'', final=True)]\n",
    "renamed": "from codecs import getincrementaldecoder as renamed\n\ndef stream_text(token_bytes):\n"
               "    d = renamed('utf-8')(errors='replace')\n"
               "    return [d.decode(t) for t in token_bytes] + [d.decode(b'', final=True)]\n",
    "incrementaldecoder": "import codecs\n\ndef pieces(d, token_bytes):\n"
                          "    return [d.decode(t) for t in token_bytes] + [d.decode(b'', final=True)]\n\n"
                          "def stream_text(token_bytes):\n"
                          "    return pieces(codecs.lookup('utf-8').incrementaldecoder(errors='replace'), token_bytes)\n",
    "IncrementalDecoder": "import encodings.utf_8\n\ndef stream_text(token_bytes):\n"
                          "    make = lambda: encodings.utf_8.IncrementalDecoder(errors='replace')\n"
                          "    d = make()\n"
                          "    return [d.decode(t) for t in token_bytes] + [d.decode(b'', final=True)]\n",
}


@pytest.mark.parametrize("name", BORROWED)
def test_python_s_own_incremental_decoders_fail_however_imported(name):
    fails("ex09.2", define(BORROWED[name], "stream_text"), "written without Python's incremental decoder",
          f"stream_text uses {name} from Python's codecs")


def test_lab09_serving_metrics_mistakes_fail(root):
    mistakes = [
        ("/ (len(token_times) - 1) if", "/ len(token_times) if", "one request of five tokens", "not over all n"),
        ("float(np.percentile(values, p))", "float(sorted(values)[min(len(values) - 1, int(p / 100 * len(values)))])",
         "five requests sent at once", "not the nearest rank's 500"),
        ("ttft = token_times[0] - send", "ttft = token_times[0] - records[0][0]", "requests sent at different times",
         "from its own send"),
        (" - min(send for send, _, _ in records)", "", "requests sent at different times", "the clock's zero"),
        ("and (tpot is None or", "or (tpot is None or", "goodput", "both: one over either is not good"),
        (" and (tpot is None or tpot * 1000 <= slo_tpot_ms)", "", "goodput", "both: one over either is not good"),
        ("ttft * 1000 <= slo_ttft_ms", "ttft * 1000 < slo_ttft_ms", "goodput", "at or under it (<=)"),
        ("if len(token_times) > 1 else None", "if len(token_times) > 1 else 0.0", "a request of one token",
         "not a 0 in them"),
        ("(tpot is None or tpot * 1000", "(tpot is not None and tpot * 1000", "a request of one token",
         "count it as meeting the TPOT limit"),
    ]
    for right, wrong, case, hint in mistakes:
        fails("ex09.3", mistake(root, "ex09.3", right, wrong), case, hint)


def test_the_figures_worked_out_by_hand_are_numpys():
    """The expected values are literals: numpy, given the definitions, finds the same."""
    names = ("median", "p90", "p99")
    for case in get("ex09.3").cases():
        records, slo_ttft, slo_tpot = case.args
        ttft = np.array([t[0] - s for s, t, _ in records]) * 1e3
        tpot = np.array([(f - t[0]) / (len(t) - 1) for _, t, f in records if len(t) > 1]) * 1e3
        good = sum(1 for (s, t, f), x in zip(records, ttft) if x <= slo_ttft and
                   (len(t) == 1 or (f - t[0]) / (len(t) - 1) * 1e3 <= slo_tpot))
        duration = max(f for *_, f in records) - min(s for s, *_ in records)
        figures = {**{f"{n}_ttft_ms": np.percentile(ttft, q) for n, q in zip(names, (50, 90, 99))},
                   **{f"{n}_tpot_ms": np.percentile(tpot, q) for n, q in zip(names, (50, 90, 99))},
                   "request_throughput": len(records) / duration,
                   "output_throughput": sum(len(t) for _, t, _ in records) / duration,
                   "request_goodput": good / duration}
        assert figures.keys() == case.expected.keys()
        for key, value in figures.items():
            assert value == pytest.approx(case.expected[key], rel=1e-9), (case.label, key)


def test_the_fake_engine_admits_steps_and_aborts_like_the_engine():
    async def play():
        engine = FakeEngine(max_running=1)
        engine.add("a", 2)
        engine.add("b", 1)
        with pytest.raises(ValueError, match="in the engine already"):
            engine.add("a", 3)
        first = await engine.step()
        step = asyncio.ensure_future(engine.step())
        await asyncio.sleep(0)  # the step has its batch and awaits the model: abort now
        assert engine.abort("a") and not engine.holds("a") and not engine.abort("a")
        in_flight = await step
        rest = []
        while engine.has_unfinished():
            rest += await engine.step()
        with pytest.raises(RuntimeError, match="nothing to run"):
            await engine.step()
        return first, in_flight, rest, engine.whose(201)
    first, in_flight, rest, owner = asyncio.run(play())
    assert first == [("a", 100, False)]
    assert in_flight == [("a", 101, True)]  # the batch was fixed when the step began
    assert rest == [("b", 200, True)] and owner == "b"


def _router(root):
    return cells("solutions", root)["ex09.4"]


def test_lab09_router_mistakes_fail(root, quick):
    mistakes = [
        ("                    queue.put_nowait(None)\n", "", "one request of three tokens", "its stream never ended"),
        ("queue = self.queues.pop(request_id, None)", "queue = self.queues.get(request_id)", "a client disconnects",
         "then its queue received [102]"),
        ("                queue = self.queues.get(request_id)\n"
         "                if queue is None:  # aborted while the step ran: its token goes nowhere\n"
         "                    continue\n",
         "                queue = self.queues[request_id]\n", "a client disconnects", "raised KeyError: 'a'"),
        ("        self.engine.abort(request_id)\n", "", "a client disconnects", "the engine still holds the request"),
        ("        self.engine.abort(request_id)\n        queue.put_nowait(None)\n",
         "        self.engine.abort(request_id)\n", "a client disconnects",  # ended later (a step), or never
         "abort('a') returned, but the request's stream has not ended: put None in its queue now"),
        ("        queue = self.queues.pop(request_id, None)\n"
         "        if queue is None:  # finished, aborted already, or never added: nothing to do\n"
         "            return\n",
         "        queue = self.queues.pop(request_id)\n", "abort twice", "raised KeyError"),
        ("while self.engine.has_unfinished():", "while True:", "one request of three tokens", "nothing to run"),
        ("while self.engine.has_unfinished():\n",
         "while True:\n            if not self.engine.has_unfinished():\n"
         "                await asyncio.sleep(0)\n                continue\n",
         "one request of three tokens", "run() had not returned"),
    ]
    for right, wrong, case, hint in mistakes:
        result = fails("ex09.4", mistake(root, "ex09.4", right, wrong), case, hint)
        assert "hint:" in result.message, result.message


def test_a_router_with_one_queue_for_all_requests_fails():
    class OneQueue:
        def __init__(self, engine):
            self.engine, self.queue = engine, asyncio.Queue()

        def add(self, request_id, n_tokens):
            self.engine.add(request_id, n_tokens)
            return self.queue

        async def run(self):
            while self.engine.has_unfinished():
                for _, token, finished in await self.engine.step():
                    self.queue.put_nowait(token)
                    if finished:
                        self.queue.put_nowait(None)

        def abort(self, request_id):
            self.engine.abort(request_id)
            self.queue.put_nowait(None)
    fails("ex09.4", OneQueue, "three requests", "each request needs a queue of its own")


def test_an_async_abort_is_named_as_one(root):
    async_abort = mistake(root, "ex09.4", "    def abort(self, request_id: str) -> None:\n",
                          "    async def abort(self, request_id: str) -> None:\n")
    with warnings.catch_warnings(record=True) as caught:  # the coroutine is closed, not left unawaited
        warnings.simplefilter("always")
        result = run_cases(get("ex09.4"), async_abort)
        gc.collect()  # an unawaited coroutine warns when it is collected
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]
    assert result.status == FAILED and "abort('a') returned a coroutine: abort is a plain method (def, not async " \
        "def)" in result.message and "hint:" not in result.message, result.message


def test_a_router_that_never_awaits_is_stopped_and_fails(root, quick):
    spins = mistake(root, "ex09.4", "while self.engine.has_unfinished():\n",
                     "while True:\n            if not self.engine.has_unfinished():\n                continue\n")
    start = time.perf_counter()
    result = fails("ex09.4", spins, "one request of three tokens", "without giving the event loop a turn")
    assert time.perf_counter() - start < 6 * (3 * lab09.SCENARIO_LIMIT_S + 1), result.message
    assert run_cases(get("ex09.4"), define(_router(root), "StreamRouter")).status == PASSED  # no thread left behind


def test_a_router_whose_run_is_still_the_stub_is_not_attempted(root):
    """run() fails inside the scenario's own thread and event loop: the stub is still named."""
    source = _router(root)
    start, end = source.index("    async def run(self) -> None:\n"), source.index("    def abort")
    stub = ('    async def run(self) -> None:\n'
            '        raise NotImplementedError("ex09.4: replace this line with your code")\n\n')
    result = run_cases(get("ex09.4"), define(source[:start] + stub + source[end:], "StreamRouter"))
    assert result.status == NOT_ATTEMPTED and result.message.startswith("StreamRouter.run still raises"), result.message


def test_edges_found_by_mutating_the_solutions_fail(root):
    fails("ex09.2", mistake(root, "ex09.2", "0xC2 <= first", "0xC3 <= first"), "first bytes at both edges",
          "C2..DF two bytes")
    fails("ex09.2", mistake(root, "ex09.2", "0xF0 <= first <= 0xF4", "0xF0 <= first < 0xF4"),
          "first bytes at both edges", "F0..F4 four")
    # the bit patterns alone (110xxxxx, 11110xxx) take C0, C1 and F5 to F7 for first bytes, which start nothing
    fails("ex09.2", mistake(root, "ex09.2", "0xC2 <= first", "0xC0 <= first"),
          "bytes that fit a first byte's bits but start no character", "two-byte characters start at C2")
    fails("ex09.2", mistake(root, "ex09.2", "0xF0 <= first <= 0xF4", "0xF0 <= first <= 0xF7"),
          "bytes that fit a first byte's bits but start no character", "four-byte ones end at F4")
    fails("ex09.3", mistake(root, "ex09.3", "tpot * 1000 <= slo_tpot_ms", "tpot * 1000 < slo_tpot_ms"),
          "the limits, met exactly", "exactly at its limit meets it (<=)")
    fails("ex09.3", mistake(root, "ex09.3", "ttft * 1000 <=", "ttft * 999 <="), "the limits, met exactly",
          "one a hair over (0.1 ms, 0.05 ms) does not")


@pytest.mark.parametrize("ex_id, right, wrong, case", [
    # str chunks never carried over: only a text case cut inside a line catches it
    ("ex09.1", "buffer += chunk.encode() if isinstance(chunk, str) else chunk",
     "buffer = (chunk.encode() if isinstance(chunk, str) else buffer + chunk)", "text, cut every 11 characters"),
])
def test_lab09_slips_the_earlier_cases_let_through_fail(root, ex_id, right, wrong, case):
    fails(ex_id, mistake(root, ex_id, right, wrong), case, "")



def test_looking_at_a_stream_leaves_the_students_queue_as_it_was():
    """The check looks for the end of a stream through the queue's public calls: its items, their order and its
    count of unfinished tasks (what join() waits on) are the student's again afterwards."""
    async def look() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(7)
        assert not lab09._ends(queue)
        queue.put_nowait(None)
        assert lab09._ends(queue) and [queue.get_nowait(), queue.get_nowait()] == [7, None]
        queue.task_done()
        queue.task_done()
        await asyncio.wait_for(queue.join(), 1.0)  # hangs, and times out, if looking counted the items twice
    asyncio.run(look())
