"""The load generator against a small fake OpenAI-style server (FastAPI + uvicorn in a thread on
127.0.0.1, streaming tokens with a known delay): the SSE parser at every split point, what a
record holds, errors recorded and not retried, Poisson and closed-loop arrivals, the summary
against hand-computed figures, and the command line end to end."""
from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from collections import Counter

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from labkit.background import free_port
from labkit.corpus import functions
from labkit.loadgen import (PROMPT_LINES, RequestRecord, SSEParser, completion_bodies, corpus_prompts, format_report,
                            main, output_lengths, poisson_arrivals, reset_prefix_cache, run_load, send_request, summarize,
                            system_prompt)

TOKEN_DELAY_S = 0.004
LINGER_S = 0.1  # how long prompt "linger" waits after its last token event, before [DONE] and after it


def token_text(i: int) -> str:
    return "" if i == 1 else f"t{i} "  # token 1 ends mid-character: an event with no text


def expected_text(n: int) -> str:
    return "".join(map(token_text, range(n)))


def sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


class FakeServer:
    """What the fake server saw: requests per prompt, and how many streams were in flight at once."""

    def __init__(self) -> None:
        self.prompts: Counter[str] = Counter()
        self.in_flight = self.max_in_flight = self.resets = 0

    def app(self) -> FastAPI:
        """/v1/completions: prompt "bad" gets a 400, "busy" a 503, "drop" a connection broken after
        three tokens, "nodone" a stream without [DONE], "abort" a stream whose last token has the
        finish reason "abort", "linger" a stream that waits LINGER_S after its last token event and
        again after [DONE]; any other prompt max_tokens tokens, one every TOKEN_DELAY_S, some
        events split across two writes, the last two events in one."""
        app = FastAPI()

        @app.post("/reset_prefix_cache")
        async def reset():  # busy twice (a 409, as labkit's server answers while requests run), then done
            self.resets += 1
            if self.resets <= 2:
                return error(409, "1 requests run and 0 wait: the prefix cache can be reset once the engine is idle")
            if self.resets == 10:  # as some of vLLM's versions answer a reset they could not make
                return {"success": False}
            return {"blocks_forgotten": 3}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            prompt, n = body["prompt"], body["max_tokens"]
            self.prompts[prompt] += 1
            words = len(prompt.split())
            usage = {"prompt_tokens": words, "completion_tokens": n, "total_tokens": words + n}
            if prompt == "bad":
                return error(400, "max_tokens=0 must be >= 1")
            if prompt == "busy":
                return error(503, "the waiting queue is full (2 requests): retry later", {"Retry-After": "1"})
            if body.get("stream"):
                with_usage = body.get("stream_options", {}).get("include_usage", False)
                return StreamingResponse(self.events(prompt, n, usage if with_usage else None),
                                         media_type="text/event-stream")
            await asyncio.sleep(n * TOKEN_DELAY_S)
            return {"object": "text_completion", "usage": usage,
                    "choices": [{"index": 0, "text": expected_text(n), "logprobs": None, "finish_reason": "length"}]}

        return app

    async def events(self, prompt: str, n: int, usage: dict | None):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield b": a comment line\n\n"
            for i in range(n):
                await asyncio.sleep(TOKEN_DELAY_S)
                if prompt == "drop" and i == 3:
                    raise RuntimeError("the fake server breaks the connection")
                reason = "abort" if prompt == "abort" else "length"
                event = sse({"choices": [{"index": 0, "text": token_text(i),
                                          "finish_reason": reason if i == n - 1 else None}]})
                if i % 3 == 1:  # split mid-line, the halves written apart
                    yield event[:9]
                    await asyncio.sleep(0.001)
                    yield event[9:]
                else:
                    yield event
        finally:
            self.in_flight -= 1  # before [DONE]: a client that saw it finds the count down
        if prompt == "linger":
            await asyncio.sleep(LINGER_S)
        if prompt != "nodone":
            yield (sse({"choices": [], "usage": usage}) if usage else b"") + sse("[DONE]")
        if prompt == "linger":
            await asyncio.sleep(LINGER_S)


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": status}}, status_code=status, headers=headers)


@pytest.fixture(scope="module")
def server():
    """(base URL, FakeServer) of a fake server on a free port of 127.0.0.1, stopped after the module."""
    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(fake.app(), log_level="critical", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", fake
    uv.should_exit = True
    thread.join(10)
    sock.close()
    assert not thread.is_alive(), "the fake server did not stop"


def load(url: str, bodies: list[dict], **kwargs):
    return asyncio.run(run_load(url, bodies, **kwargs))


def unserved_url() -> str:
    """The URL of a port of 127.0.0.1 that nothing listens on (it was free a moment ago)."""
    return f"http://127.0.0.1:{free_port()}"


# ---------------------------------------------------------------- server-sent events

STREAM = (b": keep-alive\n\n"
          b'data: {"a": 1}\n\n'
          b"event: ignored\nid: 7\ndata: two\r\ndata:  lines\r\n\r\n"
          + "data: caf\u00e9 \u4e2d \U0001f600\n\n".encode()
          + b"data:\n\n"
          b"data: [DONE]\n\n")
EVENTS = ['{"a": 1}', "two\n lines", "caf\u00e9 \u4e2d \U0001f600", "", "[DONE]"]


def test_sse_parser_at_every_split_point():
    assert SSEParser().feed(STREAM) == EVENTS
    for cut in range(len(STREAM) + 1):
        parser = SSEParser()
        assert parser.feed(STREAM[:cut]) + parser.feed(STREAM[cut:]) == EVENTS, f"split at byte {cut}"
    parser = SSEParser()
    assert [e for i in range(len(STREAM)) for e in parser.feed(STREAM[i:i + 1])] == EVENTS  # byte by byte
    parser = SSEParser()
    assert parser.feed(b"data: unfinished\n") == [] and parser.feed(b"\n") == ["unfinished"]


# ---------------------------------------------------------------- records

def test_streamed_and_plain_records(server):
    url, _ = server
    lengths = [1, 5, 9]
    streamed = completion_bodies(["a b", "c", "d e f"], lengths)
    without_usage = [{k: v for k, v in body.items() if k != "stream_options"} for body in streamed]
    plain = completion_bodies(["a b", "c", "d e f"], lengths, stream=False)
    result = load(url, streamed + without_usage + plain, concurrency=9)
    assert [r.index for r in result.records] == list(range(9))
    assert result.duration_s >= max(r.finish_time for r in result.records)
    for r, n, prompt_tokens, events in zip(result.records, lengths * 3, [2, 1, 3] * 3, lengths * 2 + [0] * 3):
        assert r.error is None and r.finish_reason == "length" and r.text == expected_text(n)
        assert r.output_tokens == n and len(r.token_times) == events
        assert r.prompt_tokens == (None if r.index in (3, 4, 5) else prompt_tokens)  # usage only when asked for
        times = [r.send_time, *r.token_times, r.finish_time]
        assert times == sorted(times) and r.finish_time - r.send_time >= 0.8 * n * TOKEN_DELAY_S
        if events > 1:  # tokens come TOKEN_DELAY_S apart
            assert r.token_times[-1] - r.token_times[0] >= 0.8 * (n - 1) * TOKEN_DELAY_S


def test_a_reply_is_whole_at_its_last_token_event(server):
    url, _ = server
    bodies = completion_bodies(["linger"], [3]) + completion_bodies(["linger"], [3], stream=False)
    streamed, plain = load(url, bodies, concurrency=2).records
    assert streamed.error is None and len(streamed.token_times) == 3
    assert streamed.finish_time == streamed.token_times[-1]  # not [DONE], LINGER_S later, nor the close
    assert streamed.finish_time - streamed.send_time < LINGER_S
    metrics = summarize([streamed], 1.0)
    assert metrics["mean_e2e_ms"] == pytest.approx((streamed.token_times[-1] - streamed.send_time) * 1e3)
    assert plain.error is None and plain.finish_time > plain.send_time and not plain.token_times


def test_failures_are_recorded_not_raised_nor_retried(server):
    url, fake = server
    bodies = completion_bodies(["bad", "busy", "drop", "nodone", "abort", "empty", "fine"], [4, 4, 8, 4, 3, 0, 4])
    records = load(url, bodies, concurrency=2).records
    assert records[0].error == "HTTP 400: max_tokens=0 must be >= 1"
    assert records[1].error == "HTTP 503: the waiting queue is full (2 requests): retry later"
    assert records[2].error.startswith("connection failed: RemoteProtocolError") and len(records[2].token_times) == 3
    assert records[3].error == "the stream ended before data: [DONE] after 4 tokens"
    assert records[4].error == "aborted by the server after 3 tokens" and records[4].finish_reason == "abort"
    assert records[5].error == "the stream ended at data: [DONE] without a token event"
    assert records[6].error is None
    assert all(fake.prompts[p] == 1 for p in ("bad", "busy", "drop", "nodone", "abort", "empty"))  # each sent once
    assert all(r.finish_time >= r.send_time for r in records)
    summary = summarize(records, 1.0)
    assert summary["completed"] == 1 and summary["failed"] == 6
    assert summary["errors"]["aborted by the server after 3 tokens"] == 1
    records = load(unserved_url(), bodies[-1:], concurrency=1).records
    assert records[0].error.startswith("connection failed: ConnectError")


def test_timeouts_bound_a_request_and_the_run(server):
    url, _ = server

    async def one_slow() -> RequestRecord:
        async with httpx.AsyncClient(trust_env=False) as client:
            return await send_request(client, f"{url}/v1/completions", completion_bodies(["x"], [100])[0], 0,
                                      timeout_s=0.05)

    record = asyncio.run(one_slow())  # 100 tokens take 0.4 s
    assert record.error == "timed out after 0.05 s" and 0.05 <= record.finish_time - record.send_time < 0.3
    result = load(url, completion_bodies(["y"] * 4, [100] * 4), concurrency=1, timeout_s=0.2)
    assert result.records[0].error == "timed out: the run's 0.2 s passed" and result.records[0].finish_time < 0.25
    assert [r.error for r in result.records[1:]] == ["not sent: the run's 0.2 s had passed"] * 3
    assert result.duration_s < 0.3


# ---------------------------------------------------------------- arrivals

def test_poisson_arrivals_are_seeded_and_exponential():
    offsets = poisson_arrivals(4000, rate=20.0, seed=5)
    assert offsets == poisson_arrivals(4000, rate=20.0, seed=5) != poisson_arrivals(4000, rate=20.0, seed=6)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0 and min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.06)  # mean gap 1 / rate
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1, abs=0.08)  # exponential: std = mean
    with pytest.raises(ValueError, match="rate=0"):
        poisson_arrivals(3, rate=0)


def test_exact_arrivals_make_the_rate_and_keep_the_draw():
    drawn, exact = poisson_arrivals(48, rate=4.0, seed=0), poisson_arrivals(48, rate=4.0, seed=0, exact=True)
    assert abs(47 / drawn[-1] - 4.0) > 0.4  # this seed's draw strays by more than 10% (1 / sqrt(48) = 14%)
    assert exact[0] == 0 and exact[-1] == pytest.approx(47 / 4.0, rel=1e-12)
    ratios = [e / d for d, e in zip(drawn[1:], exact[1:])]  # the same draw, stretched: every time by one factor
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-12)
    assert poisson_arrivals(1, rate=4.0, exact=True) == [0.0]


def test_rate_mode_sends_on_the_seeded_schedule(server):
    url, _ = server
    result = load(url, completion_bodies(["r"] * 10, [2] * 10), rate=50.0, seed=3)
    for record, offset in zip(result.records, poisson_arrivals(10, 50.0, seed=3)):
        assert record.error is None and offset - 0.002 <= record.send_time <= offset + 0.05
    exact = load(url, completion_bodies(["r"] * 10, [2] * 10), rate=50.0, seed=3, exact_rate=True).records
    assert 9 / 50.0 - 0.002 <= exact[-1].send_time <= 9 / 50.0 + 0.03  # at (n - 1) / rate; the draw's at 0.143 s


def test_concurrency_mode_keeps_c_in_flight_and_never_more(server):
    url, fake = server
    fake.max_in_flight = 0
    records = load(url, completion_bodies(["c"] * 12, [6] * 12), concurrency=3).records
    assert all(r.error is None for r in records)
    assert fake.max_in_flight == 3
    overlap = max(sum(o.send_time <= r.send_time < o.finish_time for o in records) for r in records)
    assert overlap == 3  # seen from the client too


def test_run_load_rejects_an_ambiguous_load(server):
    url, _ = server
    bodies = completion_bodies(["z"], [1])
    for kwargs in ({}, {"rate": 1.0, "concurrency": 2}):
        with pytest.raises(ValueError, match="exactly one"):
            load(url, bodies, **kwargs)
    with pytest.raises(ValueError, match="concurrency=0"):
        load(url, bodies, concurrency=0)


# ---------------------------------------------------------------- prompts and bodies

def test_corpus_prompts_and_system_prompt_are_deterministic():
    prompts = corpus_prompts(20, seed=4)
    assert prompts == corpus_prompts(20, seed=4) != corpus_prompts(20, seed=5)
    held_out = functions("validation")
    assert all(p.count("\n") <= PROMPT_LINES and any(f.startswith(p.rstrip("\n")) for f in held_out) for p in prompts)
    prefix = system_prompt(3000)
    assert len(prefix) == 3000 and prefix == system_prompt(3000) and prefix.startswith(held_out[0])
    assert [p.removeprefix(prefix) for p in corpus_prompts(20, seed=4, shared_prefix=prefix)] == prompts
    with pytest.raises(ValueError, match="the held-out split has only"):
        system_prompt(10**9)
    lengths = output_lengths(500, seed=1)
    assert lengths == output_lengths(500, seed=1) and min(lengths) == 16 and max(lengths) == 256
    body, plain = completion_bodies(["p"], [7])[0], completion_bodies(["p"], [7], stream=False, model="m")[0]
    assert body == {"prompt": "p", "max_tokens": 7, "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
    assert plain == {"prompt": "p", "max_tokens": 7, "temperature": 0.0, "ignore_eos": True, "stream": False,
                     "model": "m"}
    with pytest.raises(ValueError, match="2 prompts but 1 output lengths"):
        completion_bodies(["a", "b"], [3])


# ---------------------------------------------------------------- summary

def synthetic_run() -> list[RequestRecord]:
    return [RequestRecord(0, 0.0, [0.1, 0.2, 0.4], 0.4, 10, 3),  # TTFT 100, TPOT 150, ITL 100 200, E2E 400
            RequestRecord(1, 0.5, [0.8, 0.9], 1.0, 20, 2),  # TTFT 300, TPOT 200, ITL 100, E2E 500
            RequestRecord(2, 1.0, [1.05], 1.1, 5, 1),  # TTFT 50, no TPOT, E2E 100
            RequestRecord(3, 1.2, [], 1.21, error="HTTP 503: busy"),
            RequestRecord(4, 1.5, [], 2.0, 8, 4)]  # not streamed: TTFT = E2E = 500


def test_summarize_by_hand():
    summary = summarize(synthetic_run(), duration_s=2.0)
    expected = {"completed": 4, "failed": 1, "duration_s": 2.0, "prompt_tokens": 43, "output_tokens": 10,
                "request_throughput": 2.0, "output_throughput": 5.0, "total_token_throughput": 26.5, "goodput": 2.0,
                # TTFT 50 100 300 500: p90 at rank 2.7 = 300 + 0.7 x 200; TPOT 150 200; ITL 100 100 200
                "mean_ttft_ms": 237.5, "median_ttft_ms": 200, "p90_ttft_ms": 440, "p99_ttft_ms": 494,
                "mean_tpot_ms": 175, "median_tpot_ms": 175, "p90_tpot_ms": 195, "p99_tpot_ms": 199.5,
                "mean_itl_ms": 400 / 3, "median_itl_ms": 100, "p90_itl_ms": 180, "p99_itl_ms": 198,
                "mean_e2e_ms": 375, "median_e2e_ms": 450, "p90_e2e_ms": 500, "p99_e2e_ms": 500}
    assert summary.pop("errors") == {"HTTP 503: busy": 1}
    assert summary == pytest.approx(expected | {"slo_ttft_ms": None, "slo_tpot_ms": None})
    # goodput: TTFT <= 350 keeps 0, 1, 2; TPOT <= 160 keeps 0, 2 (no TPOT) and 4 (not streamed)
    assert summarize(synthetic_run(), 2.0, slo_ttft_ms=350)["goodput"] == pytest.approx(3 / 2)
    assert summarize(synthetic_run(), 2.0, slo_tpot_ms=160)["goodput"] == pytest.approx(3 / 2)
    both = summarize(synthetic_run(), 2.0, slo_ttft_ms=350, slo_tpot_ms=160)
    assert both["goodput"] == pytest.approx(2 / 2)
    report = format_report(both)
    for text in ("4 completed, 1 failed in 2.00 s", "26.5 total tok/s", "1.00 req/s (TTFT <= 350 ms, TPOT <= 160 ms)",
                 "237.5", "440.0", "1 x HTTP 503: busy"):
        assert text in report


def test_tpot_counts_the_servers_tokens_not_its_events():
    merged = RequestRecord(0, 0.0, [0.1, 0.3], 0.3, 2, 5)  # 5 tokens in 2 events: TPOT (300 - 100) / 4
    no_usage = RequestRecord(1, 0.0, [0.1, 0.2, 0.4], 0.4, None, 3)  # one token per event: TPOT 300 / 2
    plain = RequestRecord(2, 0.0, [], 0.5, 2, 6)  # not streamed: no TPOT
    summary = summarize([merged, no_usage, plain], 1.0)
    assert summary["mean_tpot_ms"] == pytest.approx((50 + 150) / 2)
    assert summary["mean_itl_ms"] == pytest.approx((200 + 100 + 200) / 3)  # the gaps between events
    assert summary["mean_e2e_ms"] == pytest.approx(400)
    assert summarize([merged], 1.0, slo_tpot_ms=60)["goodput"] == 1  # 50 ms per token, though 200 ms per event


def test_summarize_a_run_that_failed_or_lacks_usage():
    summary = summarize(synthetic_run()[3:4], duration_s=1.0)
    assert summary["completed"] == 0 and summary["goodput"] == 0 and summary["mean_ttft_ms"] != summary["mean_ttft_ms"]
    no_usage = synthetic_run()
    no_usage[0].prompt_tokens = None
    assert summarize(no_usage, 2.0)["total_token_throughput"] is None
    assert "total tok/s unknown" in format_report(summarize(no_usage, 2.0))
    with pytest.raises(ValueError, match="duration_s=0"):
        summarize(synthetic_run(), 0)


# ---------------------------------------------------------------- command line

def test_command_line_end_to_end(server, tmp_path, capsys):
    url, fake = server
    out = tmp_path / "run.json"
    argv = [url, "--requests", "6", "--concurrency", "2", "--min-tokens", "2", "--max-tokens", "5",
            "--shared-prefix-chars", "200", "--seed", "7", "--slo-ttft-ms", "1000", "--json", str(out)]
    assert main(argv) == 0  # in this process: python -m would add seconds of imports
    printed = capsys.readouterr().out
    assert "6 completed, 0 failed" in printed and "TTFT <= 1000 ms" in printed
    saved = json.loads(out.read_text())
    assert saved["summary"]["completed"] == 6
    assert [r["output_tokens"] for r in saved["records"]] == output_lengths(6, 2, 5, seed=8)
    prompts = corpus_prompts(6, seed=7, shared_prefix=system_prompt(200))
    assert all(fake.prompts[p] == prompts.count(p) for p in prompts)
    failed = tmp_path / "failed.json"
    assert main([unserved_url(), "--requests", "1", "--rate", "1", "--json", str(failed)]) == 1
    assert "0 completed, 1 failed" in capsys.readouterr().out

    def no_nan(constant: str):
        raise ValueError(f"{constant} is not JSON")

    saved = json.loads(failed.read_text(), parse_constant=no_nan)  # strict JSON: no NaN nor Infinity
    assert saved["summary"]["mean_ttft_ms"] is None and saved["summary"]["failed"] == 1


def test_a_prefix_cache_reset_waits_out_a_busy_server_and_says_what_refused_it(server, capsys):
    """``reset_prefix_cache`` asks again while the server answers 409 (busy), then returns what it forgot; a server
    without the endpoint (a 404) or one busy past the wait raises, with the server's words; on the command line,
    such a failure sends nothing and exits 1."""
    url, fake = server
    fake.resets = 0
    assert reset_prefix_cache(url) == 3 and fake.resets == 3
    fake.resets = 0
    with pytest.raises(RuntimeError, match="reset_prefix_cache answered 409: .*once the engine is idle"):
        reset_prefix_cache(url, wait_s=0.05)
    fake.resets = 9
    with pytest.raises(RuntimeError, match='answered 200: {"success":false}'):
        reset_prefix_cache(url)
    sent = sum(fake.prompts.values())
    assert main([url + "/v1", "--requests", "2", "--concurrency", "1", "--reset-prefix-cache"]) == 1
    assert "the prefix cache was not reset, so nothing was sent: " in capsys.readouterr().err
    assert sum(fake.prompts.values()) == sent
    fake.resets = 2  # the next answer is a reset
    assert main([url, "--requests", "2", "--concurrency", "1", "--min-tokens", "2", "--max-tokens", "4",
                 "--reset-prefix-cache"]) == 0
    assert "prefix cache reset: 3 blocks forgotten" in capsys.readouterr().out


@pytest.mark.parametrize("argv, complaint", [
    (["--requests", "0", "--rate", "1"], "--requests: '0' is not an int of at least 1"),
    (["--requests", "4", "--rate", "0"], "--rate: '0' is not a finite number more than 0.0"),
    (["--requests", "4", "--rate", "nan"], "--rate: 'nan' is not a finite number more than 0.0"),
    (["--requests", "4", "--rate", "inf"], "--rate: 'inf' is not a finite number more than 0.0"),  # arrivals all NaN
    (["--requests", "4", "--rate", "2", "--json", "/tmp"], "--json /tmp: a folder"),
    (["--requests", "4", "--concurrency", "0"], "--concurrency: '0' is not an int of at least 1"),
    (["--requests", "4", "--rate", "2", "--max-tokens", "4"], "--min-tokens 16 is more than --max-tokens 4"),
    (["--requests", "4", "--rate", "2", "--shared-prefix-chars", "-5"], "'-5' is not an int of at least 0"),
    (["--requests", "4", "--rate", "2", "--json", "/nonexistent/run.json"], "its folder /nonexistent does not exist"),
])
def test_command_line_refuses_bad_options_by_name_before_sending_anything(argv, complaint, capsys):
    with pytest.raises(SystemExit) as stop:  # a URL where nothing listens: a run would report failures instead
        main([unserved_url(), *argv])
    assert stop.value.code == 2 and complaint in capsys.readouterr().err
