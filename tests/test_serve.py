"""labkit's HTTP server end to end, against real ``python -m labkit.serve`` processes on free ports of
127.0.0.1 (three, started at once by one fixture, since each costs seconds of imports, and always
stopped): the official ``openai`` client completes and streams the offline engine's greedy tokens;
64 concurrent streams each get their own tokens, one event per token, and leave every block free;
clients that hang up abort their requests, and the others still complete; 1,000 requests do not
grow the server's memory; bad input gets a 4xx naming the field, a full queue a 503 with
Retry-After, a missing key a 401; chat completions on a model with a chat template have OpenAI's
chat shape; SIGTERM during a load run, or a parent that dies, ends the process within seconds, its
engine's process with it, and an engine process whose server was killed ends on its own."""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import httpx
import openai
import pytest
import torch

import labkit
import labkit.background
from labkit.background import BackgroundServer, children, serve_command, stop_all
from labkit.corpus import token_ids
from labkit.detokenize import IncrementalDetokenizer
from labkit.engine import Engine, Request, SchedulerConfig
from labkit.generate import SamplingParams, eos_id_of, stream
from labkit.load import save_checkpoint
from labkit.model import ModelConfig, Transformer, forward_tokens
from labkit.serve import APIError, ServedModel, _alive, chat_prompt, parse_completion

from tiny_models import one_torch_thread

KEY = "labkit-test-key"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
TIMEOUT = httpx.Timeout(30.0)
NEAR_TIE = 1e-3  # float32 logits this close may swap places between two kernels: references avoid them
IDLE = ("labkit:kv_blocks_used", "labkit:num_requests_running", "labkit:num_requests_waiting")
ABORTED = 'labkit:request_success_total{finished_reason="abort"}'


one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


# the servers -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random model over the lab's 4,096-token vocabulary, saved with a chat template."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(ModelConfig(vocab_size=4096, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                                        max_seq_len=512))
        model.reset_parameters(std=0.3)  # logits far apart: greedy never hangs on a near tie
    folder = tmp_path_factory.mktemp("tiny")
    save_checkpoint(model, folder)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


class Fleet:
    """The module's three servers, started in parallel (imports dominate a start, ~5 s of CPU each),
    each stopped at the end: "target" (the shipped model, defaults); "tiny" (the tiny model with its
    chat template, watching a parent process of its own, which the last test ends); "busy" (one
    running, one waiting at most, a key, a short drain; the SIGTERM test ends it). ``get`` waits for
    one, and starts it again should a test before have ended it."""

    def __init__(self, tiny: Path) -> None:
        self.tiny, self.pool = str(tiny), ThreadPoolExecutor(3)
        self.servers: list[BackgroundServer] = []
        self.parents: list[subprocess.Popen] = []
        self.started = {name: self.launch(name) for name in ("target", "tiny", "busy")}

    def command(self, name: str) -> list[str]:
        if name == "target":
            return serve_command("target", device="cpu")
        if name == "busy":
            return serve_command(self.tiny, device="cpu", max_num_seqs=1, max_waiting=1, api_key=KEY, drain=0.5)
        # a parent that lives until it is killed, or until this process ends (its stdin closes)
        self.parents.append(subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                             stdin=subprocess.PIPE))
        command = serve_command(self.tiny, device="cpu", served_name="tiny")
        command[command.index("--parent-pid") + 1] = str(self.parents[-1].pid)
        return command

    def launch(self, name: str) -> Future:
        self.servers.append(BackgroundServer(self.command(name)))
        return self.pool.submit(self.servers[-1].start, 180.0)

    def get(self, name: str) -> BackgroundServer:
        if not self.started[name].result().running:  # .result() re-raises a failed start, with the log
            self.started[name] = self.launch(name)
        return self.started[name].result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)  # a start under way ends (healthy, failed or timed out) before the stops
        for server in self.servers:
            server.stop()
        for parent in self.parents:
            parent.kill()
            parent.wait()
            parent.stdin.close()


@pytest.fixture(scope="module")
def fleet(tiny_folder) -> Fleet:
    servers = Fleet(tiny_folder)
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture(scope="module")
def http() -> httpx.Client:
    """One client for the plain requests: a new one costs ~50 ms of CPU (its SSL context)."""
    with httpx.Client(timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def target(fleet) -> BackgroundServer:
    return fleet.get("target")


@pytest.fixture(scope="module")
def target_model() -> tuple[Transformer, object]:
    return labkit.load("target", device="cpu")


# references --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """A prompt as sent (text or token ids), its ids as the server tokenizes it, and its greedy tokens."""

    prompt: str | list[int]
    ids: list[int]
    expected: list[int]

    def body(self, **changes: object) -> dict:
        return {"prompt": self.prompt, "max_tokens": len(self.expected), "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}} | changes


def offline_greedy(model: Transformer, prompts: list[tuple[list[int], int]]) -> list[list[int]]:
    """Each (prompt, length)'s greedy tokens from the offline engine, in one run, EOS ignored."""
    engine = Engine(model, num_blocks=512, config=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024))
    requests = [Request(i, ids, SamplingParams(max_new_tokens=n, stop_at_eos=False))
                for i, (ids, n) in enumerate(prompts)]
    return [r.output for r in engine.run(requests)]


def clear_solo_greedy(model: Transformer, prompt: list[int], output: list[int]) -> bool:
    """Whether ``output`` is the prompt's greedy continuation on its own (each token the argmax
    given the prompt and the tokens before it: one teacher-forced forward pass checks them all)
    with no near tie on the way, which another kernel's rounding could flip. A clear mismatch fails."""
    logits = forward_tokens(model, prompt + output[:-1], 0, None)[len(prompt) - 1:]
    top = logits.topk(2)
    near = bool((top.values[:, 0] - top.values[:, 1] < NEAR_TIE).any())
    assert near or top.indices[:, 0].tolist() == output, "the offline engine's tokens are not greedy decoding's"
    return not near


@pytest.fixture(scope="module")
def jobs(target_model) -> list[Job]:
    """64 distinct prompts from the held-out corpus (8 to 31 tokens; every other one sent as text),
    each with 8 to 16 greedy tokens, verified to be its solo greedy output."""
    model, tokenizer = target_model
    corpus = token_ids(tokenizer, "validation")
    candidates = []
    for i in range(72):  # a few spare, should a prompt pass a near tie
        window = corpus[997 * i:997 * i + 8 + i % 24].tolist()
        prompt = tokenizer.decode(window) if i % 2 else window
        candidates.append((prompt, tokenizer.encode(prompt).ids if i % 2 else window, 8 + i % 9))
    outputs = offline_greedy(model, [(ids, n) for _, ids, n in candidates])
    found = [Job(prompt, ids, out) for (prompt, ids, _), out in zip(candidates, outputs)
             if clear_solo_greedy(model, ids, out)]
    assert len(found) >= 64 and len({tuple(job.ids) for job in found}) == len(found)
    return found[:64]


# reading the server ------------------------------------------------------------------------------


@dataclass
class Stream:
    """What one streamed response carried: the request ids of its events, each token event's text
    and finish reason, the usage event, and whether it ended with [DONE]."""

    ids: set[str] = field(default_factory=set)
    texts: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    usage: dict | None = None
    done: bool = False

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def read_stream(client: httpx.AsyncClient, url: str, body: dict, hang_up_after: int | None = None) -> Stream:
    """POST a streamed completion and parse its events; with ``hang_up_after``, close the
    connection after that many token events."""
    got = Stream()
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, (await response.aread()).decode()
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not got.done, f"unexpected line {line!r} (after [DONE]: {got.done})"
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                got.done = True
                continue
            event = json.loads(payload)
            got.ids.add(event["id"])
            if not event["choices"]:
                got.usage = event["usage"]
                continue
            got.texts.append(event["choices"][0]["text"])
            got.reasons.append(event["choices"][0]["finish_reason"])
            if len(got.texts) == hang_up_after:
                break
    return got


def check_stream(got: Stream, job: Job, tokenizer) -> None:
    """One request's events, one per token, the last with the finish reason, then the usage and
    [DONE]; the text is the decoded reference."""
    n = len(job.expected)
    assert len(got.ids) == 1, f"events of several requests in one stream: {got.ids}"
    assert got.reasons == [None] * (n - 1) + ["length"], got.reasons
    assert got.text == tokenizer.decode(job.expected)
    assert got.usage == {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n}
    assert got.done


def metric(text: str, sample: str) -> float:
    """A sample's value in Prometheus text (0 when absent, as a labelled counter is before its first count)."""
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def settled_metrics(http: httpx.Client, url: str, until: Callable[[str], bool] = lambda text: True,
                    timeout_s: float = 5.0) -> str:
    """/metrics once nothing runs, waits or holds a block, and ``until`` holds (the engine thread
    publishes its gauges after each step: a moment after the last response, at most); after
    ``timeout_s``, the last reading, for the test to show."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = http.get(url + "/metrics").text
        if (all(metric(text, name) == 0 for name in IDLE) and until(text)) or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def assert_idle(text: str) -> None:
    missing = [name for name in IDLE if not re.search(rf"^{re.escape(name)} ", text, re.M)]
    assert not missing, f"/metrics has no {missing}: a gauge renamed or dropped would read as idle"
    assert {name: metric(text, name) for name in IDLE} == dict.fromkeys(IDLE, 0.0)


def run(coroutine, timeout_s: float = 60.0):
    """Run a coroutine to its end, or fail after ``timeout_s``."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout_s))


def openai_client(server: BackgroundServer, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, timeout=30.0, max_retries=0)


def post(http: httpx.Client, server: BackgroundServer, body: dict | bytes | Iterator[bytes],
         path: str = "/v1/completions", **kwargs) -> httpx.Response:
    content = {"json": body} if isinstance(body, dict) else {"content": body}  # bytes, or chunks sent chunked
    return http.post(server.url + path, **content, **kwargs)


# completions -------------------------------------------------------------------------------------


def test_the_openai_client_completes_and_streams_the_offline_greedy_tokens(target, target_model):
    model, tokenizer = target_model
    prompt, n = "def fibonacci(n):\n", 24
    ids = tokenizer.encode(prompt).ids
    expected = list(stream(model, ids, SamplingParams(max_new_tokens=n), eos_id=eos_id_of(tokenizer)))
    assert clear_solo_greedy(model, ids, expected), "the reference passes a near tie: choose another prompt"
    reason = "stop" if expected[-1] == eos_id_of(tokenizer) else "length"
    with openai_client(target) as client:
        assert [card.id for card in client.models.list()] == ["target"]

        whole = client.completions.create(model="target", prompt=prompt, max_tokens=n, temperature=0)
        assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
        assert whole.choices[0].text == tokenizer.decode(expected)
        assert whole.choices[0].finish_reason == reason
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(expected))

        chunks = list(client.completions.create(model="target", prompt=prompt, max_tokens=n, temperature=0,
                                                stream=True))
        detokenizer = IncrementalDetokenizer(tokenizer)  # token by token: each event carries its token's text
        pieces = [detokenizer.add(token) for token in expected]
        pieces[-1] += detokenizer.flush()
        assert [chunk.choices[0].text for chunk in chunks] == pieces
        assert [chunk.choices[0].finish_reason for chunk in chunks] == [None] * (len(expected) - 1) + [reason]
        assert len({chunk.id for chunk in chunks}) == 1

        by_ids = client.completions.create(model="target", prompt=ids, max_tokens=n, temperature=0)
        assert by_ids.choices[0].text == whole.choices[0].text


def test_64_concurrent_streams_each_get_their_own_greedy_tokens_and_free_every_block(http, target, jobs, target_model):
    async def load() -> list[Stream]:
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=len(jobs))) as client:
            return await asyncio.gather(*(read_stream(client, target.url, job.body()) for job in jobs))

    streams = run(load())
    for got, job in zip(streams, jobs):
        check_stream(got, job, target_model[1])
    assert len({request_id for got in streams for request_id in got.ids}) == len(jobs), "a request id was reused"
    assert_idle(settled_metrics(http, target.url))


def test_clients_that_hang_up_abort_their_requests_and_the_others_complete(http, target, jobs, target_model):
    rng = random.Random(0)
    chosen = jobs[:32]
    hang_up = {i: rng.randint(1, 5) for i in rng.sample(range(len(chosen)), 10)}  # request -> events it reads
    aborted_before = metric(settled_metrics(http, target.url), ABORTED)

    async def one(client: httpx.AsyncClient, i: int) -> Stream:
        if i in hang_up:  # 800 tokens: seconds from done when its client goes, were it not aborted
            return await read_stream(client, target.url, chosen[i].body(max_tokens=800), hang_up_after=hang_up[i])
        return await read_stream(client, target.url, chosen[i].body())

    async def load() -> list[Stream]:
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=len(chosen))) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(chosen))))

    streams = run(load())
    for i, (got, job) in enumerate(zip(streams, chosen)):
        if i in hang_up:
            assert len(got.texts) == hang_up[i] and not got.done
        else:
            check_stream(got, job, target_model[1])
    text = settled_metrics(http, target.url, lambda text: metric(text, ABORTED) >= aborted_before + len(hang_up))
    assert_idle(text)
    assert metric(text, ABORTED) - aborted_before == len(hang_up)


def test_a_stop_string_cuts_the_text_ends_the_request_and_frees_its_blocks(http, target, target_model):
    """The text ends right before the stop string, streamed or not; the request is counted once,
    as "stop", and its blocks come back at once."""
    model, tokenizer = target_model
    ids = tokenizer.encode("def add(a, b):").ids
    full = tokenizer.decode(list(stream(model, ids, SamplingParams(max_new_tokens=40, temperature=0.0),
                                        eos_id=eos_id_of(tokenizer))))
    stop = full.strip()[:3]  # a string the greedy text holds after its first characters
    cut = full[:full.index(stop)]
    stopped_before = metric(settled_metrics(http, target.url), 'labkit:request_success_total{finished_reason="stop"}')
    body = {"prompt": ids, "max_tokens": 40, "temperature": 0, "stop": [stop, "never seen"]}
    whole = post(http, target, body).json()
    assert (whole["choices"][0]["text"], whole["choices"][0]["finish_reason"]) == (cut, "stop")

    async def read_one() -> Stream:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            return await read_stream(client, target.url, body | {"stream": True})

    streamed = run(read_one())
    assert "".join(streamed.texts) == cut and streamed.done
    text = settled_metrics(http, target.url)
    assert_idle(text)
    assert metric(text, 'labkit:request_success_total{finished_reason="stop"}') - stopped_before == 2


def test_an_engine_failure_is_an_openai_error_and_the_next_request_is_served(tiny_folder):
    """In process (no HTTP server): a step that raises fails the requests it held with a 500 in
    OpenAI's shape (streamed: an error event, then [DONE]); the engine goes on serving."""
    from labkit.async_engine import AsyncEngine
    from labkit.serve import ServedModel, create_app

    model, tokenizer = labkit.load(str(tiny_folder), device="cpu")
    engine = Engine(model, 64, 16, SchedulerConfig(max_num_seqs=4))
    served = ServedModel("tiny", tokenizer, model.config.vocab_size, model.config.max_seq_len)
    execute, steps = engine.runner.execute, []

    def failing(batch):  # the first request's first step fails, and the streamed one's second (its first decode)
        steps.append(batch)
        if len(steps) in (1, 3):
            raise RuntimeError("a kernel crashed")
        return execute(batch)

    async def scenario() -> list[httpx.Response]:
        async_engine = AsyncEngine(engine)
        engine.runner.execute = failing
        transport = httpx.ASGITransport(app=create_app(async_engine, served))
        body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://labkit", timeout=TIMEOUT) as client:
                return [await client.post("/v1/completions", json=b) for b in (body, body | {"stream": True}, body)]
        finally:
            await async_engine.shutdown(0.0)

    failed, streamed, served_after = run(scenario())
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "internal_error"
    assert "a kernel crashed" in failed.json()["error"]["message"]
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    events = [json.loads(line[len("data: "):]) for line in streamed.text.split("\n\n")
              if line.startswith("data: {")]
    assert len(events) >= 2 and all("choices" in e for e in events[:-1]), events  # its first token, then the error
    assert events[-1]["error"]["type"] == "internal_error" and "a kernel crashed" in events[-1]["error"]["message"]
    assert served_after.status_code == 200 and served_after.json()["usage"]["completion_tokens"] == 4
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("argv, complaint", [
    (["--max-num-seqs", "0"], "--max-num-seqs: '0' is not an int of at least 1"),
    (["--num-blocks", "1.5"], "--num-blocks: '1.5' is not an int of at least 1"),
    (["--port", "70000"], "--port: '70000' is not an int of at least 0 and at most 65535"),
    (["--port", "9" * 400], "is not an int of at least 0 and at most 65535"),  # past a float: compared as an int
    (["--drain", "-1"], "--drain: '-1' is not a finite number of at least 0.0"),
    (["--api-key", ""], "an empty key would let every request in"),  # "$KEY" with KEY unset: no check at all
])
def test_the_command_line_refuses_bad_settings_by_name_before_anything_starts(argv, complaint, capsys):
    from labkit.serve import parse_args

    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    assert stop.value.code == 2 and complaint in capsys.readouterr().err


def test_an_empty_key_in_the_environment_is_refused_before_the_engine_starts(monkeypatch, capsys):
    from labkit import serve

    monkeypatch.setenv("LABKIT_API_KEY", " ")
    monkeypatch.setattr(serve, "build_engine", lambda args: pytest.fail("the engine was built first"))
    with pytest.raises(SystemExit, match="LABKIT_API_KEY is set but empty"):
        serve.main([])


def test_a_model_folder_of_pickled_weights_is_refused_before_the_engine_process_starts(tiny_folder, tmp_path):
    from labkit.serve import build_engine, parse_args

    shutil.copy(tiny_folder / "config.json", tmp_path / "config.json")  # labkit's config, the lab's tokenizer
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(SystemExit, match="no model.safetensors weights in .*pytorch_model.bin.*never loads pickled"):
        build_engine(parse_args(["--model", str(tmp_path), "--device", "cpu"]))


def test_port_0_serves_on_a_free_port_and_says_which(tiny_folder):
    server = subprocess.Popen([sys.executable, "-m", "labkit.serve", "--model", str(tiny_folder), "--port", "0",
                               "--device", "cpu", "--engine", "thread"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()  # uvicorn logs at warning level: this is the server's first line
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)$", line.strip()).group(1))
        assert port > 0 and httpx.get(f"http://127.0.0.1:{port}/health", timeout=TIMEOUT).status_code == 200
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_command_lines_engine_in_a_thread_serves_the_offline_greedy_tokens(tiny_folder):
    """``--engine thread`` (``build_engine``'s other way; the servers above step theirs in a process),
    in process through ASGI: a completion has the offline engine's greedy tokens."""
    from labkit.serve import build_engine, create_app, parse_args

    model, tokenizer = labkit.load(str(tiny_folder), device="cpu")
    prompt = [5, 6, 7, 8]
    expected = offline_greedy(model, [(prompt, 6)])[0]

    async def scenario() -> tuple[httpx.Response, int | None]:
        engine, served = build_engine(parse_args(["--model", str(tiny_folder), "--device", "cpu", "--engine", "thread"]))
        transport = httpx.ASGITransport(app=create_app(engine, served))
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://labkit", timeout=TIMEOUT) as client:
                return await client.post("/v1/completions", json=body), engine.engine_pid
        finally:
            await engine.shutdown(0.0)

    response, pid = run(scenario())
    assert pid is None and response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == tokenizer.decode(expected)


def test_a_client_gone_before_its_answer_aborts_the_request_streamed_or_not(http, target, jobs):
    """A non-streamed request has no stream to cancel: the server checks that its client is still
    there; a streamed one whose client leaves before its first token is cancelled by Starlette."""
    aborted_before = metric(settled_metrics(http, target.url), ABORTED)
    body = jobs[0].body(max_tokens=800)  # seconds of work, were it not aborted
    with pytest.raises(httpx.ReadTimeout):  # the client waits 0.3 s for the whole answer
        http.post(target.url + "/v1/completions", json=body | {"stream": False, "stream_options": None},
                  timeout=httpx.Timeout(30.0, read=0.3))
    with http.stream("POST", target.url + "/v1/completions", json=body) as response:
        assert response.status_code == 200  # the headers come at once; the client leaves before any event
    text = settled_metrics(http, target.url, lambda text: metric(text, ABORTED) >= aborted_before + 2)
    assert_idle(text)
    assert metric(text, ABORTED) - aborted_before == 2
    assert metric(text, "labkit:e2e_request_latency_seconds_count") > 0


def vm_rss_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))


def all_end(pids: list[int], limit_s: float) -> bool:
    """Whether every process of ``pids`` has ended (or is a zombie) within ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(pid) for pid in pids)


SOAK_REQUESTS, SOAK_WARMUP, SOAK_CONCURRENCY = 1000, 300, 16
SOAK_PROMPT = 256  # distinct token ids per request: a request kept by mistake keeps ~10 KB of them
SOAK_GROWTH_KB = 2048


def test_a_soak_of_1000_requests_does_not_grow_the_servers_memory(http, fleet):
    """VmRSS of the server and of each process it started (its engine's) after a warm-up of 300
    requests against after all 1,000 (idle both times). Without a leak each grew 0.2 to 0.7 MB over
    the last 700 (the allocators settling); an engine that keeps each request's record (made to,
    for a check) grew 7.4 MB, its 256 prompt ids alone being ~10 KB a request. 2 MB lies between."""
    server = fleet.get("tiny")
    prompts = [[(7 * i + j) % 4096 for j in range(SOAK_PROMPT)] for i in range(SOAK_REQUESTS)]

    async def one(client: httpx.AsyncClient, limit: asyncio.Semaphore, i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": 2, "ignore_eos": True, "stream": i % 2 == 1}
        async with limit:
            response = await client.post(server.url + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if body["stream"]:
            assert response.text.endswith("data: [DONE]\n\n")
        else:
            assert response.json()["usage"]["completion_tokens"] == 2

    async def soak(indices: range) -> None:
        limit = asyncio.Semaphore(SOAK_CONCURRENCY)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=SOAK_CONCURRENCY)) as client:
            await asyncio.gather(*(one(client, limit, i) for i in indices))

    run(soak(range(SOAK_WARMUP)), 120)
    assert_idle(settled_metrics(http, server.url))
    pids = [server.process.pid, server.engine_pid]
    assert pids[1] is not None, "the server has no engine process"
    warm = [vm_rss_kb(pid) for pid in pids]
    run(soak(range(SOAK_WARMUP, SOAK_REQUESTS)), 240)
    assert_idle(settled_metrics(http, server.url))
    growth = [vm_rss_kb(pid) - kb for pid, kb in zip(pids, warm)]
    assert max(growth) < SOAK_GROWTH_KB, (
        f"the server and its engine's process grew by {growth} kB over {SOAK_REQUESTS - SOAK_WARMUP} requests")


# bad input and refusals --------------------------------------------------------------------------

BAD = {  # case: (path, body, param at fault, words the message must hold)
    "malformed JSON": ("/v1/completions", b'{"prompt": "def f(", "max_tokens": ', None, ["not valid JSON"]),
    "missing prompt": ("/v1/completions", {"max_tokens": 4}, "prompt", ["no prompt"]),
    "max_tokens 0": ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", ["max_tokens=0", "at least 1"]),
    "max_tokens -3": ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens",
                      ["max_tokens=-3", "at least 1"]),
    "prompt over the context": ("/v1/completions", {"prompt": [1] * 1025, "max_tokens": 1}, "prompt",
                                ["1025 tokens", "context of 1024"]),
    "prompt + max_tokens over the context": ("/v1/completions", {"prompt": [1] * 1000, "max_tokens": 100}, "max_tokens",
                                             ["max_tokens=100", "at most 25", "1024"]),
    "negative temperature": ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature",
                             ["temperature=-0.5", "is out of range", "from 0.0 to 2.0"]),
    "temperature a word": ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature",
                           ['temperature="hot"', "is not a number"]),  # as JSON spells it, not Python
    "temperature NaN": ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature",
                        ["temperature=NaN", "is not a number"]),
    "temperature of 400 digits": ("/v1/completions", {"prompt": "x", "temperature": 10 ** 400}, "temperature",
                                  ["is out of range"]),  # too large for a float: compared as an int
    "n 2": ("/v1/completions", {"prompt": "x", "n": 2}, "n", ["n=2", "n must be 1"]),
    "n true": ("/v1/completions", {"prompt": "x", "n": True}, "n", ["n=true", "n must be 1"]),  # True == 1 in Python
    "an integer of 5,000 digits": ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None,
                                   ["not valid JSON", "digits"]),
    "lists nested 100,000 deep": ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None,
                                  ["not valid JSON"]),
    "a lone surrogate": ("/v1/completions", b'{"prompt": "def \\ud800", "max_tokens": 1}', "prompt",
                         ["lone UTF-16 surrogate at character 4"]),
    "model a number": ("/v1/completions", {"prompt": "x", "model": 5}, "model", ["model=5 must be a string"]),
    "user a number": ("/v1/completions", {"prompt": "x", "user": 5}, "user", ["user=5 must be a string"]),
    "stream_options unstreamed": ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
                                  "stream_options", ["only for a streamed request"]),
    "an unknown stream option": ("/v1/completions", {"prompt": "x", "stream": True,
                                                     "stream_options": {"include_usage": True, "every_token": True}},
                                 "stream_options", ["'every_token'", "takes include_usage"]),
    "max_tokens by default past the context": ("/v1/completions", {"prompt": [1] * 1020}, "max_tokens",
                                               ["max_tokens=16 (the default", "at most 5"]),
    "vLLM's top_k": ("/v1/completions", {"prompt": "x", "top_k": 5}, "top_k",
                     ["unrecognized request field 'top_k'", "would otherwise ignore it", "uses ignore_eos, max_tokens"]),
    "a chat field on completions": ("/v1/completions", {"prompt": "x", "messages": []}, "messages",
                                    ["unrecognized request field 'messages'"]),
    "unknown model": ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, "model", ["'gpt-4'", "serves 'target'"]),
    "token id past the vocabulary": ("/v1/completions", {"prompt": [5, 4096]}, "prompt", ["4096", "[0, 4096)"]),
    "negative token id": ("/v1/completions", {"prompt": [-1, 5]}, "prompt", ["-1", "[0, 4096)"]),
    "chat on a model without a template": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                           "messages", ["'target' has no chat template"]),
}
NOT_FOUND = {"unknown model"}  # 404, as OpenAI's API and vLLM answer; the rest 400


@pytest.mark.parametrize("case", BAD)
def test_bad_input_gets_a_400_naming_the_problem_and_the_server_keeps_serving(http, target, case):
    path, body, param, words = BAD[case]
    response = post(http, target, body, path)
    status = 404 if case in NOT_FOUND else 400
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, status)
    assert all(word in error["message"] for word in words), error["message"]
    good = post(http, target, {"prompt": "def f(", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_a_text_too_long_for_any_context_is_refused_before_it_is_tokenized_and_a_body_past_that_is_413(
        http, target, target_model):
    """The target's tokenizer spells at most L characters a token: a text of more than 1,024 L
    characters cannot fit, and is refused before the tokenizer sees it (3 s for 4 MB of text, on the
    server's event loop); a body past what such a prompt needs is refused before it is read whole."""
    _, tokenizer = target_model
    longest = max(map(len, tokenizer.get_vocab()))
    served = ServedModel("target", tokenizer, 4096, 1024)
    assert served.max_prompt_chars == 1024 * longest
    response = post(http, target, {"prompt": "ab" * (512 * longest) + "c", "max_tokens": 1})
    assert response.status_code == 400, response.text  # by characters: tokenized, it would say "tokens"
    assert f"has {1024 * longest + 1:,} characters: the context of 1024 tokens holds at most" in response.json()[
        "error"]["message"]
    assert post(http, target, {"prompt": "def f(", "max_tokens": 1}).status_code == 200
    too_big = b'{"prompt": "' + b"x" * served.max_body_bytes + b'"}'
    response = post(http, target, too_big)
    assert response.status_code == 413 and "more than a request to this model needs" in response.json()["error"][
        "message"], response.text
    chunked = post(http, target, (too_big[i:i + (1 << 16)] for i in range(0, len(too_big), 1 << 16)))  # no length
    assert chunked.status_code == 413 and "the body passes" in chunked.json()["error"]["message"], chunked.text
    assert post(http, target, {"prompt": "def f(", "max_tokens": 1}).status_code == 200


def test_a_full_queue_answers_503_with_retry_after(http, fleet):
    """One request runs (--max-num-seqs 1), one waits (--max-waiting 1): the others are refused at once."""
    server, headers = fleet.get("busy"), {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True, "temperature": 0}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=TIMEOUT, headers=headers) as client:
            return await asyncio.gather(*(client.post(server.url + "/v1/completions", json=body) for _ in range(6)))

    responses = run(burst())
    refused = [r for r in responses if r.status_code == 503]
    assert refused and all(r.status_code in (200, 503) for r in responses), [r.status_code for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 500 for r in responses if r.status_code == 200)
    error = refused[0].json()["error"]
    assert error["code"] == 503 and "max_waiting=1" in error["message"] and "retry" in error["message"]
    assert int(refused[0].headers["Retry-After"]) >= 1
    again = post(http, server, body | {"max_tokens": 2}, headers=headers)
    assert again.status_code == 200, again.text


def test_with_an_api_key_v1_wants_the_bearer_key_and_health_does_not(http, fleet):
    server = fleet.get("busy")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = post(http, server, {"prompt": "x", "max_tokens": 2}, headers=headers)
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and "Authorization: Bearer" in error["message"]
    assert http.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        with openai_client(server, api_key="wrong") as client:
            client.models.list()
    keyed = post(http, server, {"prompt": "x", "max_tokens": 2}, headers={"Authorization": f"Bearer {KEY}"})
    assert keyed.status_code == 200, keyed.text
    health = http.get(server.url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_reset_prefix_cache_makes_the_next_prompt_cold_and_is_refused_while_requests_run(http, fleet):
    """A prompt sent twice hits the prefix cache the second time; POST /reset_prefix_cache forgets its blocks and
    the third time it hits nothing. While a request runs the reset is refused with a 409 that says why, and
    without the key it is a 401, as every /v1/ route is."""
    server, headers = fleet.get("busy"), {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": list(range(1, 41)), "max_tokens": 2, "temperature": 0}  # 40 tokens: 2 full blocks of 16
    hits = "labkit:prefix_cache_hits_total"
    settled_metrics(http, server.url)
    assert http.post(server.url + "/reset_prefix_cache").status_code == 401
    assert http.post(server.url + "/reset_prefix_cache", headers=headers).status_code == 200  # others' blocks go

    def hits_of_one() -> float:
        before = metric(settled_metrics(http, server.url), hits)
        assert post(http, server, body, headers=headers).status_code == 200
        return metric(settled_metrics(http, server.url, lambda text: metric(text, hits) >= before), hits) - before
    assert [hits_of_one(), hits_of_one()] == [0, 32]
    reset = http.post(server.url + "/reset_prefix_cache", headers=headers)
    assert reset.status_code == 200 and reset.json()["blocks_forgotten"] >= 2, reset.text
    assert hits_of_one() == 0

    async def while_one_runs() -> httpx.Response:
        async with httpx.AsyncClient(timeout=TIMEOUT, headers=headers) as client:
            long = asyncio.create_task(client.post(server.url + "/v1/completions",
                                                   json={"prompt": [1, 2, 3], "max_tokens": 300, "ignore_eos": True}))
            for _ in range(200):  # until it runs
                if metric((await client.get(server.url + "/metrics")).text, "labkit:num_requests_running"):
                    break
                await asyncio.sleep(0.02)
            refused = await client.post(server.url + "/reset_prefix_cache")
            assert (await long).status_code == 200
            return refused
    refused = run(while_one_runs())
    error = refused.json()["error"]
    assert refused.status_code == 409 and error["type"] == "conflict", refused.text
    assert "1 requests run and 0 wait: the prefix cache can be reset once the engine is idle" in error["message"]


# chat ------------------------------------------------------------------------------------------


def test_each_endpoint_takes_its_own_prompt_field_and_refuses_the_others(tiny_folder):
    _, tokenizer = labkit.load(str(tiny_folder), device="cpu")
    served = ServedModel("tiny", tokenizer, tokenizer.get_vocab_size(), 64, chat_template="{{ messages }}")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "user": "me"}
    assert parse_completion(chat, served, prompt=[1, 2], max_tokens_field="max_completion_tokens").params \
        .max_new_tokens == 3
    assert parse_completion({"prompt": "x", "max_tokens": 2}, served).params.max_new_tokens == 2
    with pytest.raises(APIError, match="unrecognized request field 'prompt'"):
        parse_completion(chat | {"prompt": "x"}, served, prompt=[1, 2])
    with pytest.raises(APIError, match="unrecognized request field 'max_completion_tokens'"):
        parse_completion({"prompt": "x", "max_completion_tokens": 2}, served)
    # OpenAI's chat fields that this server lacks are named as such, and taken at their defaults
    assert parse_completion(chat | {"response_format": {"type": "text"}, "tools": [], "store": False}, served,
                            prompt=[1, 2], max_tokens_field="max_completion_tokens").params.max_new_tokens == 3
    with pytest.raises(APIError, match="tools is not supported by this server"):
        parse_completion(chat | {"tools": [{"type": "function"}]}, served, prompt=[1, 2])
    with pytest.raises(APIError, match="give max_completion_tokens or max_tokens, not both"):
        parse_completion(chat | {"max_tokens": 9}, served, prompt=[1, 2])


def test_chat_messages_take_openais_text_parts_and_null_content_and_a_templates_own_refusal(tiny_folder):
    _, tokenizer = labkit.load(str(tiny_folder), device="cpu")
    template = ("{% if messages[0].role != 'user' %}{{ raise_exception('the first turn must be the user') }}"
                "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    served = ServedModel("tiny", tokenizer, tokenizer.get_vocab_size(), 512, chat_template=template)
    parts = [{"type": "text", "text": "A sort,"}, {"type": "text", "text": "please."}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": None},
                {"role": "user", "content": "Go on."}]
    expected = "user: A sort,\nplease.\nassistant: \nuser: Go on.\n"  # parts joined by newlines, as vLLM joins them
    assert chat_prompt({"messages": messages}, served) == tokenizer.encode(expected).ids
    with pytest.raises(APIError, match="template failed on these messages: the first turn must be the user"):
        chat_prompt({"messages": [{"role": "assistant", "content": "hi"}]}, served)
    for content in ([{"type": "image_url", "image_url": {"url": "x"}}], 5):
        with pytest.raises(APIError, match=r"messages\[0\] must be .*text only"):
            chat_prompt({"messages": [{"role": "user", "content": content}]}, served)
    with pytest.raises(APIError, match=r"messages\[1\] must be"):
        chat_prompt({"messages": [{"role": "user", "content": "hi"}, {"role": "user"}]}, served)
    with pytest.raises(APIError, match=r"messages\[1\]'s content holds a lone UTF-16 surrogate at character 3"):
        chat_prompt({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "why\ud800"}]},
                    served)


def test_chat_completions_through_the_models_template_have_openais_chat_shape(http, fleet, tiny_folder):
    server = fleet.get("tiny")
    model, tokenizer = labkit.load(str(tiny_folder), device="cpu")
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A sort, please."}]
    ids = tokenizer.encode("system: You write Python.\nuser: A sort, please.\nassistant:").ids
    expected = list(stream(model, ids, SamplingParams(max_new_tokens=8), eos_id=eos_id_of(tokenizer)))
    assert clear_solo_greedy(model, ids, expected), "the reference passes a near tie: choose other messages"
    reason = "stop" if expected[-1] == eos_id_of(tokenizer) else "length"

    response = post(http, server, {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0},
                    "/v1/chat/completions")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": tokenizer.decode(expected)},
                                "logprobs": None, "finish_reason": reason}]
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(expected),
                             "total_tokens": len(ids) + len(expected)}
    capped = post(http, server, {"messages": messages, "max_tokens": None, "max_completion_tokens": 3,
                                 "ignore_eos": True}, "/v1/chat/completions")  # a null max_tokens is no max_tokens
    assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] == 3, capped.text

    with openai_client(server) as client:
        whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        message = whole.choices[0].message
        assert (message.role, message.content) == ("assistant", tokenizer.decode(expected))
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                     stream=True))
        assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
        assert "".join(chunk.choices[0].delta.content for chunk in chunks) == tokenizer.decode(expected)
        assert [chunk.choices[0].finish_reason for chunk in chunks] == [None] * (len(expected) - 1) + [reason]


# stopping ----------------------------------------------------------------------------------------

EXIT_LIMIT_S = 8.0  # --drain 0.5 s for what runs, then uvicorn closes and the engine process ends: ~1.5 s here


def test_sigterm_during_a_load_run_ends_every_stream_and_the_process_within_the_limit(fleet):
    """Two requests of 500 tokens, one running and one waiting (on "busy"): the drain of 0.5 s lets
    the running one go on, far from its end; then both end with finish reason "abort"."""
    server, headers = fleet.get("busy"), {"Authorization": f"Bearer {KEY}"}
    bodies = [{"prompt": [i + 1, 2, 3], "max_tokens": 500, "ignore_eos": True, "stream": True} for i in range(2)]

    async def engine_holds(client: httpx.AsyncClient, running: int, waiting: int, streams: list[asyncio.Task]) -> None:
        while not any(stream.done() for stream in streams):  # one that ended early shows why below
            text = (await client.get(server.url + "/metrics")).text
            if (metric(text, IDLE[1]), metric(text, IDLE[2])) == (running, waiting):
                return
            await asyncio.sleep(0.02)

    async def load_then_sigterm() -> tuple[list[Stream], float]:
        async with httpx.AsyncClient(timeout=TIMEOUT, headers=headers) as client:
            streams = [asyncio.create_task(read_stream(client, server.url, bodies[0]))]
            await engine_holds(client, 1, 0, streams)  # sent together, the second would find the first
            streams.append(asyncio.create_task(read_stream(client, server.url, bodies[1])))  # not yet running
            await engine_holds(client, 1, 1, streams)
            sent = time.monotonic()
            server.process.terminate()
            await asyncio.to_thread(server.process.wait, EXIT_LIMIT_S)
            return await asyncio.gather(*streams), time.monotonic() - sent

    engine, started = server.engine_pid, children(server.process.pid)
    streams, exit_s = run(load_then_sigterm(), 60)
    assert exit_s < EXIT_LIMIT_S and engine in started and all_end(started, 1.0)
    for got in streams:
        assert got.done and len(got.ids) == 1 and got.reasons[:-1] == [None] * (len(got.reasons) - 1)
        assert got.reasons[-1] == "abort" or (got.reasons[-1] == "length" and len(got.texts) == 500)
    assert sum(got.reasons[-1] == "abort" for got in streams) >= 1


def test_a_server_whose_parent_dies_exits_on_its_own(fleet):
    server = fleet.get("tiny")
    engine, started = server.engine_pid, children(server.process.pid)
    fleet.parents[-1].kill()
    fleet.parents[-1].wait()  # reaped: its pid is gone, which the server checks twice a second
    server.process.wait(EXIT_LIMIT_S)  # TimeoutExpired if it stays
    assert engine in started and all_end(started, 1.0)


def test_an_engine_process_whose_server_is_killed_ends_on_its_own(fleet):
    """SIGKILL to the server (no drain, no goodbye): its engine's process finds its command pipe
    closed and exits."""
    server = fleet.get("busy")
    engine = server.engine_pid
    server.process.kill()
    server.process.wait(EXIT_LIMIT_S)
    assert engine is not None and all_end([engine], EXIT_LIMIT_S)


def _file_server(tmp_path: Path) -> BackgroundServer:
    """Python's own file server on a free port: a process that answers 200 within a second, and nothing more."""
    return BackgroundServer([sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1", "--directory",
                             str(tmp_path)], health="/")


def test_a_background_server_is_out_of_reach_of_its_starters_interrupts(tmp_path):
    """A notebook's interrupt is a SIGINT to the kernel's whole process group: a server there would stop too. Its
    session stays the starter's: Linux's autogroup shares the CPU between sessions, and a server in one of its own
    took twice its share against its client (this file's tests ran twice as long, and timed out)."""
    with _file_server(tmp_path) as server:
        assert os.getpgid(server.process.pid) != os.getpgid(0) and os.getsid(server.process.pid) == os.getsid(0)


def test_an_interrupt_while_a_server_starts_stops_it(tmp_path, monkeypatch):
    server = _file_server(tmp_path)

    def interrupted(client):
        raise KeyboardInterrupt
    monkeypatch.setattr(server, "_healthy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.start()
    assert server.process.poll() is not None and not server.running


def test_stop_all_stops_every_server_this_process_started(tmp_path, monkeypatch):
    monkeypatch.setattr(labkit.background, "_RUNNING", set())  # this test's servers only, not the module's fleet
    first, second = _file_server(tmp_path).start(), _file_server(tmp_path).start()
    stop_all()
    assert not first.running and not second.running
