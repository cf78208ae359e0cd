"""An OpenAI-compatible HTTP server on labkit's engine (FastAPI and uvicorn, as vLLM and SGLang use).

    python -m labkit.serve --model target [--host 127.0.0.1] [--port 8000] [--api-key KEY]

A request's way through it: the JSON body is checked field by field (a 400 that names the field and
what it may be, or names a field the server does not take; a 404 for a model it does not serve; a
413 for a body larger than any request to the model needs, before it is read whole), its
prompt tokenized, and a ``Request`` handed to the ``AsyncEngine``, whose engine puts it in the
continuous batch: an engine in a process of its own (``--engine process``, the default, as vLLM's
V1), so that the HTTP side's Python never holds the GIL the engine's steps need.
Each sampled token comes back to the request's coroutine, which turns it into text incrementally
(``IncrementalDetokenizer``: a token can end in the middle of a UTF-8 character), cuts the text at
a stop string (``StopStrings``) and sends it, either as one server-sent event per token
(``stream: true``, ending with ``data: [DONE]``) or whole at the end.

Endpoints: ``POST /v1/completions``; ``POST /v1/chat/completions`` for a model whose folder has a
chat template; ``GET /v1/models``; ``GET /health``; ``GET /metrics`` (``labkit.serve_metrics``);
``POST /reset_prefix_cache``, which empties the prefix cache between the engine's steps (a benchmark's
cold start, as vLLM's endpoint of that name; a 409 while requests run).
A client that disconnects aborts its request, whose blocks return to the pool. ``finish_reason`` is
"stop" (EOS or a stop string) or "length", as OpenAI's, or "abort" (vLLM's: the server shut down
before the request finished); a request the engine fails gets a 500 (streamed: an error event). A full
waiting queue answers 503 with ``Retry-After``; with ``--api-key``, ``/v1/`` and the reset want the bearer key.
On SIGTERM the server stops admitting, lets what runs finish for ``--drain`` seconds, aborts the
rest and exits.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import secrets
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable

import uvicorn
from starlette.exceptions import HTTPException
from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from tokenizers import Tokenizer

from labkit.async_engine import AsyncEngine, EngineSpec, EngineStopped, QueueFull, RequestStream
from labkit.detokenize import IncrementalDetokenizer, StopStrings
from labkit.engine import Engine, Request, SchedulerConfig
from labkit.generate import SamplingParams, eos_id_of
from labkit.serve_metrics import CONTENT_TYPE, ServerMetrics
from labkit.validate import option_in

RETRY_AFTER_S = 1
DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


class APIError(Exception):
    """An error the client caused (or a full queue): its status, message and the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass(frozen=True)
class ServedModel:
    """What the server serves: the name clients use, the tokenizer, the limits of the model."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_seq_len: int
    chat_template: str | None = None

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Characters past which a text cannot fit the context, whatever its tokens: each token spells
        at most as many characters as the vocabulary's longest (a byte-level one: as many bytes), so a
        longer text is refused before the tokenizer spends seconds on it."""
        return self.max_seq_len * max(map(len, self.tokenizer.get_vocab()), default=1)

    @property
    def max_body_bytes(self) -> int:
        """The largest body worth reading: a prompt of ``max_prompt_chars`` characters, each escaped
        in JSON (at most 12 bytes: a surrogate pair's two \\uXXXX), and room for the other fields."""
        return 12 * self.max_prompt_chars + (1 << 20)


@dataclass
class Completion:
    """A checked request: the prompt's token ids, how to sample, where to stop, how to answer."""

    prompt: list[int]
    params: SamplingParams
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


# checking a request body ----------------------------------------------------------------------------


def _shown(value: Any) -> str:
    """A field's value as the client wrote it in JSON (true, "8", NaN), not Python's spelling, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):  # lists nested a little less deep than json.loads allows
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _number(body: dict, name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(name, default)
    value = default if value is None else value
    number = isinstance(value, Real) and not isinstance(value, bool) and value == value  # NaN is not itself
    if not number or not (low < value if open_low else low <= value) or not value <= high:  # exact for any int
        where = f"in ({low}, {high}]" if open_low else f"from {low} to {high}"
        problem = "is out of range" if number else "is not a number"
        raise APIError(f"{name}={_shown(value)} {problem}: it must be a number {where}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise APIError(f"{name}={_shown(value)} is invalid: it must be an integer of at least {low}", name)
    return value


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool) and value is not None:
        raise APIError(f"{name}={_shown(value)} must be true or false", name)
    return bool(value)


def _prompt_ids(prompt: Any, served: ServedModel) -> list[int]:
    if prompt is None:
        raise APIError("the request has no prompt: give one as a string or a list of token ids", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one, as the openai client may send it
    if isinstance(prompt, str):
        _check_text(prompt, served)
        ids = served.tokenizer.encode(prompt).ids
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < served.vocab_size]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary: ids must be in [0, {served.vocab_size})",
                           "prompt")
        ids = list(prompt)
    else:
        raise APIError("prompt must be one string or one list of token ids (this server takes one prompt "
                       "per request)", "prompt")
    if not ids:
        raise APIError("the prompt is empty: give at least one token", "prompt")
    return ids


def _check_text(text: str, served: ServedModel) -> None:
    """APIError for a text no tokenizer should see: past ``max_prompt_chars`` (a chat's text: its
    messages through the template, whose characters are theirs and the template's)."""
    if len(text) > served.max_prompt_chars:
        raise APIError(f"the prompt has {len(text):,} characters: the context of {served.max_seq_len} tokens holds at "
                       f"most {served.max_prompt_chars:,} of this model's tokenizer", "prompt")
    _check_encodable(text, "the prompt", "prompt")


def _check_encodable(text: str, what: str, field: str) -> None:
    """APIError where ``text`` holds a lone UTF-16 surrogate (JSON's "\\ud800" alone): no character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise APIError(f"{what} holds a lone UTF-16 surrogate at character {error.start} (JSON's \\ud800 to \\udfff "
                       "without its pair), which is no character: send the text as UTF-8", field) from None


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if not isinstance(stop, (str, list, type(None))):
        raise APIError(f"stop={_shown(stop)} must be a string or a list of strings", "stop")
    try:
        return StopStrings([] if stop is None else stop).stops
    except ValueError as error:
        raise APIError(f"stop={_shown(stop)} is invalid: {error}", "stop") from None


# The fields each endpoint takes. Any other is refused by name, as OpenAI's API refuses it, so that an
# option this server lacks (vLLM's top_k, min_p, repetition_penalty, ...) is never silently ignored.
USED = frozenset({"model", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "ignore_eos", "user"})
USED_BY = {"completions": USED | {"prompt", "max_tokens"},
           "chat": USED | {"messages", "max_tokens", "max_completion_tokens"}}
# OpenAI's fields that this server takes only at their defaults (``_check_unsupported`` names each)
DEFAULT_ONLY = {"completions": frozenset({"n", "best_of", "logprobs", "echo", "presence_penalty", "frequency_penalty",
                                          "suffix", "logit_bias"}),
                "chat": frozenset({"n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
                                   "logit_bias", "response_format", "tools", "tool_choice", "parallel_tool_calls",
                                   "functions", "function_call", "metadata", "store", "service_tier", "modalities",
                                   "audio", "prediction", "reasoning_effort", "web_search_options"})}
ABSENT = (None, False, 0, "", {}, [])  # what a field left at its default holds


def _check_known(body: dict, endpoint: str) -> None:
    unknown = [name for name in body if name not in USED_BY[endpoint] | DEFAULT_ONLY[endpoint]]
    if unknown:
        raise APIError(f"unrecognized request field {unknown[0]!r}: this server does not take it, and would "
                       f"otherwise ignore it (it uses {', '.join(sorted(USED_BY[endpoint]))}; OpenAI's other "
                       "fields only at their defaults)", unknown[0])


def _is_one(value: Any) -> bool:
    return value is None or (type(value) is int and value == 1)  # true == 1 in Python, not in JSON


def _check_unsupported(body: dict, endpoint: str) -> None:
    if not _is_one(body.get("n")):
        raise APIError(f"n={_shown(body['n'])}: this server returns one completion per request, n must be 1", "n")
    if not _is_one(body.get("best_of")):
        raise APIError(f"best_of={_shown(body['best_of'])} is not supported: leave it out or set it to 1", "best_of")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise APIError("response_format is not supported by this server: leave it out (plain text)", "response_format")
    for name in sorted(DEFAULT_ONLY[endpoint] - {"n", "best_of", "response_format"}):
        if body.get(name) not in ABSENT:
            raise APIError(f"{name} is not supported by this server: leave the field out", name)
    if endpoint == "chat" and None not in (body.get("max_tokens"), body.get("max_completion_tokens")):
        raise APIError("give max_completion_tokens or max_tokens, not both", "max_completion_tokens")


def parse_completion(body: Any, served: ServedModel, prompt: list[int] | None = None,
                     max_tokens_field: str = "max_tokens") -> Completion:
    """Check a completion request's fields; an ``APIError`` names the first that is wrong. ``prompt``:
    token ids already made (a chat's rendered messages) instead of the body's ``prompt``."""
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(f"model={_shown(model)} must be a string, the name of the model", "model")
    if model not in (None, served.name):
        raise APIError(f"the model {model!r} does not exist: this server serves {served.name!r}", "model",
                       status=404)  # as OpenAI's API and vLLM answer
    endpoint = "completions" if prompt is None else "chat"
    _check_known(body, endpoint)
    _check_unsupported(body, endpoint)
    ids = _prompt_ids(body.get("prompt"), served) if prompt is None else prompt
    room = served.max_seq_len - len(ids) + 1  # the last new token is never fed back
    if room < 1:
        raise APIError(f"the prompt has {len(ids)} tokens, more than the context of {served.max_seq_len}", "prompt")
    max_tokens = _integer(body, max_tokens_field, DEFAULT_MAX_TOKENS, 1)
    if max_tokens > room:
        given = "" if body.get(max_tokens_field) is not None else " (the default, as the request gives none)"
        raise APIError(f"{max_tokens_field}={max_tokens}{given} is too many: the prompt's {len(ids)} tokens leave "
                       f"room for at most {room} in a context of {served.max_seq_len}", max_tokens_field)
    if not isinstance(body.get("user"), (str, type(None))):
        raise APIError(f"user={_shown(body['user'])} must be a string", "user")
    stream = _flag(body, "stream")
    return Completion(ids, _sampling(body, max_tokens), _stops(body), stream, _include_usage(body, stream))


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options in (None, {}):
        return False
    if not isinstance(options, dict):
        raise APIError(f"stream_options={_shown(options)} must be an object such as {{\"include_usage\": true}}",
                       "stream_options")
    if not stream:
        raise APIError("stream_options is only for a streamed request: set stream to true, or leave it out",
                       "stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise APIError(f"stream_options has {unknown[0]!r}, which this server does not take (it takes "
                       "include_usage)", "stream_options")
    return _flag(options, "include_usage")


def _sampling(body: dict, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                          top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
                          seed=_integer(body, "seed", None, 0), stop_at_eos=not _flag(body, "ignore_eos"))


def chat_prompt(body: Any, served: ServedModel) -> list[int]:
    """The token ids of a chat request's messages, through the model's chat template."""
    if served.chat_template is None:
        raise APIError(f"the model {served.name!r} has no chat template (its folder holds no tokenizer_config.json "
                       "with a chat_template, nor a chat_template.jinja), so it cannot take chat messages: send a "
                       "prompt to /v1/completions instead", "messages")
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list of {\"role\": str, \"content\": str}", "messages")
    messages = [_plain_message(m, i) for i, m in enumerate(messages)]
    from jinja2 import TemplateError

    try:
        text = _template(served.chat_template).render(messages=messages, add_generation_prompt=True,
                                                      bos_token="", eos_token="")
    except TemplateError as error:
        raise APIError(f"the model's chat template failed on these messages: {error}", "messages") from None
    return _prompt_ids(text, served)


def _plain_message(message: Any, index: int) -> dict:
    """A message as a template takes it, its content one string: OpenAI's list of text parts joined
    (as vLLM joins them, by newlines), null (an assistant's turn that called a tool) as empty."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "\n".join(part["text"] for part in content)
    elif content is None and isinstance(message, dict) and "content" in message:
        content = ""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(content, str):
        raise APIError(f"messages[{index}] must be {{\"role\": str, \"content\": str}} (or content a list of "
                       "{\"type\": \"text\", \"text\": str} parts: this server takes text only)", "messages")
    _check_encodable(content, f"messages[{index}]'s content", "messages")
    return {**message, "content": content}


def _raise_exception(message: str) -> None:
    """What Hugging Face's templates call to refuse messages (a role out of turn, say)."""
    from jinja2 import TemplateError

    raise TemplateError(message)


@functools.cache
def _template(source: str) -> Any:
    """A chat template, compiled once, in Jinja's sandbox (a template is code from the model's folder)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment()
    environment.globals["raise_exception"] = _raise_exception
    return environment.from_string(source)


# generating -------------------------------------------------------------------------------------


@dataclass
class Piece:
    """Text to send, and, for the last piece of a request, why it ended and how many tokens it made."""

    text: str
    finish_reason: str | None = None
    tokens: int = 0


def pieces(engine: AsyncEngine, metrics: ServerMetrics, served: ServedModel, request_id: str,
           completion: Completion) -> AsyncIterator[Piece]:
    """The request's text, token by token (one piece per token; "" while a character is incomplete
    or a stop string may be starting), then a last piece with the finish reason. Raises now, before
    any answer is sent: ``QueueFull``, ``EngineStopped``, or ``ValueError`` for a request the engine
    could never serve."""
    request = Request(request_id, completion.prompt, completion.params)
    return _pieces(engine.stream(request), request, metrics, served, completion)


async def _pieces(events: RequestStream, request: Request, metrics: ServerMetrics, served: ServedModel,
                  completion: Completion) -> AsyncIterator[Piece]:
    text, stops = IncrementalDetokenizer(served.tokenizer), StopStrings(completion.stops)
    previous, count, reason = None, 0, None
    async with contextlib.aclosing(events):  # leaving early (a stop string, a client gone) aborts it
        try:
            async for event in events:
                if event.token is None:  # aborted: the server is shutting down
                    reason = "abort"
                    yield Piece(stops.flush(), reason, count)
                    return
                metrics.token(request, event, previous)
                previous, count = event.time, count + 1
                new = text.add(event.token) + (text.flush() if event.finish_reason else "")
                new, stopped = stops.add(new)
                if stopped or event.finish_reason:
                    reason = "stop" if stopped else event.finish_reason
                    yield Piece(new + ("" if stopped else stops.flush()), reason, count)
                    return
                yield Piece(new)
        except EngineStopped as error:
            reason = "abort"
            raise APIError(str(error), status=503, kind="server_shutting_down") from None
        except RuntimeError as error:  # a step failed: the engine goes on, this request cannot
            reason = "error"
            raise APIError(f"the request failed in the engine: {error}", status=500, kind="internal_error") from None
        finally:  # counted once, whichever way it ended (a client gone: abort)
            metrics.finish(request, reason or "abort", previous)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Responder:
    """Builds the answers of one endpoint: completions (``chat`` False) or chat completions."""

    def __init__(self, served: ServedModel, chat: bool) -> None:
        self.served, self.chat = served, chat
        self.object = "chat.completion" if chat else "text_completion"
        self.prefix = "chatcmpl" if chat else "cmpl"

    def choice(self, text: str, reason: str | None, delta: bool, first: bool = False) -> dict:
        """One choice: a completion's text, or a chat's message (``delta``: a streamed chunk's, which
        names the role in the first chunk only)."""
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        role = {"role": "assistant"} if first or not delta else {}
        return {"index": 0, "delta" if delta else "message": role | {"content": text}, "logprobs": None,
                "finish_reason": reason}

    def head(self, request_id: str, chunk: bool) -> dict:
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": request_id, "object": kind, "created": int(time.time()), "model": self.served.name}

    async def whole(self, request_id: str, completion: Completion, parts: AsyncIterator[Piece]) -> JSONResponse:
        texts, last = [], Piece("")
        async for last in parts:
            texts.append(last.text)
        choice = self.choice("".join(texts), last.finish_reason, delta=False)
        body = self.head(request_id, chunk=False) | {"choices": [choice],
                                                     "usage": _usage(len(completion.prompt), last.tokens)}
        return JSONResponse(body)

    async def events(self, request_id: str, completion: Completion, parts: AsyncIterator[Piece]) -> AsyncIterator[str]:
        """Server-sent events: one per piece, the usage if asked for, then ``[DONE]``; an error
        after the stream has begun is sent as an event with OpenAI's error object, as vLLM does."""
        head, first = self.head(request_id, chunk=True), True
        async with contextlib.aclosing(parts):
            try:
                async for piece in parts:
                    yield _sse(head | {"choices": [self.choice(piece.text, piece.finish_reason, True, first)]})
                    first = False
                    if piece.finish_reason and completion.include_usage:
                        yield _sse(head | {"choices": [], "usage": _usage(len(completion.prompt), piece.tokens)})
            except APIError as error:
                yield _sse(error.body())
        yield _sse("[DONE]")


# the application ----------------------------------------------------------------------------------


def create_app(engine: AsyncEngine, served: ServedModel, api_key: str | None = None,
               drain_s: float = 2.0) -> FastAPI:
    """The FastAPI application serving ``served`` through ``engine``."""
    metrics = ServerMetrics(lambda: engine.stats)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown(drain_s)

    app = FastAPI(title="labkit", lifespan=lifespan)
    app.state.engine, app.state.served = engine, served

    # a dependency of each /v1/ route, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps the
    # connection so that a route can no longer see its client disconnect
    async def check_key(request: HTTPRequest) -> None:  # async: a plain def would take a worker thread
        given = request.headers.get("authorization", "")
        if api_key and not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError("a valid API key is needed: send the header 'Authorization: Bearer <key>'",
                           status=401, kind="authentication_error")

    app.add_exception_handler(APIError, lambda request, error: error.response())
    app.add_exception_handler(HTTPException, lambda request, error: APIError(  # 404, 405: in OpenAI's shape too
        f"{request.method} {request.url.path}: {error.detail}", status=error.status_code).response())
    v1 = [Depends(check_key)]

    async def complete(request: HTTPRequest, chat: bool) -> Response:
        try:
            body = json.loads(await _body(request, served.max_body_bytes))
        except APIError as error:
            return error.response()
        except (ValueError, RecursionError) as error:  # JSON's own errors, and ints too long or lists too deep
            return APIError(f"the body is not valid JSON: {str(error) or type(error).__name__}").response()
        responder = Responder(served, chat)
        try:
            prompt = chat_prompt(body, served) if chat else None
            completion = parse_completion(body, served, prompt, "max_tokens" if not chat or body.get("max_tokens")
                                          is not None else "max_completion_tokens")
            request_id = f"{responder.prefix}-{uuid.uuid4().hex}"
            parts = pieces(engine, metrics, served, request_id, completion)
        except APIError as error:
            return error.response()
        except QueueFull as error:
            return APIError(str(error), status=503, kind="server_busy").response()
        except EngineStopped as error:
            return APIError(str(error), status=503, kind="server_shutting_down").response()
        except ValueError as error:  # the engine's own check: more blocks than its pool has
            return APIError(str(error), "max_tokens").response()
        if completion.stream:  # Starlette cancels the stream when the client disconnects
            return StreamingResponse(responder.events(request_id, completion, parts), media_type="text/event-stream")
        return await _unless_disconnected(request, responder.whole(request_id, completion, parts))

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: HTTPRequest) -> Response:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: HTTPRequest) -> Response:
        return await complete(request, chat=True)

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict:
        card = {"id": served.name, "object": "model", "created": 0, "owned_by": "labkit",
                "max_model_len": served.max_seq_len}
        return {"object": "list", "data": [card]}

    @app.post("/reset_prefix_cache", dependencies=v1)
    async def reset_prefix_cache() -> Response:
        """Empty the prefix cache, as vLLM's endpoint of that name does: a benchmark's cold start."""
        try:
            forgotten = await engine.reset_prefix_cache()
        except ValueError as error:  # requests are being served
            return APIError(str(error), status=409, kind="conflict").response()
        except EngineStopped as error:
            return APIError(str(error), status=503, kind="server_shutting_down").response()
        except RuntimeError as error:  # the engine failed (its process died) while the reset waited
            return APIError(f"the engine failed while the prefix cache was being reset ({error})", status=500,
                            kind="internal_error").response()
        return JSONResponse({"blocks_forgotten": forgotten})

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _body(request: HTTPRequest, limit: int) -> bytes:
    """The request's body, or a 413 as soon as it passes ``limit`` bytes (before it is all read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(f"the body has {int(declared):,} bytes, more than a request to this model needs "
                       f"({limit:,} at most)", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(f"the body passes {limit:,} bytes, more than a request to this model needs", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


async def _unless_disconnected(request: HTTPRequest, answer: Awaitable[Response]) -> Response:
    """``answer``, unless the client disconnects first: then it is cancelled (which aborts its request)."""
    task = asyncio.ensure_future(answer)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)  # nobody reads it: nginx's code for a client gone
    return task.result()


# the command line ---------------------------------------------------------------------------------


def chat_template_of(folder: Path) -> str | None:
    """A model folder's chat template: ``chat_template.jinja``, or ``tokenizer_config.json``'s."""
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text()
    config = folder / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.exists() else None
    return template if isinstance(template, str) else None


def decode_kernel(name: str):  # noqa: ANN201 - a DecodeKernel or None
    """The engine's decode attention: "cpp" (labkit's C++ operator, built now), "triton" or "none"."""
    if name == "cpp":
        from labkit.kernels.paged_decode_cpu import build, paged_decode_cpu
        build()
        return paged_decode_cpu
    if name == "triton":
        from labkit.kernels import paged_decode
        return paged_decode
    return None


def build_engine(args: argparse.Namespace) -> tuple[AsyncEngine, ServedModel]:
    """The engine the command line asks for (``--engine``: in a process of its own, or in a thread of
    this one), and what it serves (read here without the weights)."""
    from labkit.load import CHECKPOINTS, load_config, load_tokenizer, weight_files

    try:
        config, tokenizer = load_config(args.model), load_tokenizer(args.model)
        weight_files(args.model)  # here: the engine's process would report a missing file with its traceback
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"--model {args.model}: {error}") from None
    if tokenizer is None:
        raise SystemExit(f"--model {args.model}: a model without a tokenizer (a shape: preset) cannot serve text")
    folder = CHECKPOINTS / args.model if (CHECKPOINTS / args.model).is_dir() else Path(args.model).expanduser()
    served = ServedModel(args.served_name or Path(args.model).name, tokenizer, config.vocab_size,
                         config.max_seq_len, chat_template_of(folder))
    if args.engine == "thread":
        return AsyncEngine(engine_from_args(args), max_waiting=args.max_waiting), served
    try:
        return AsyncEngine(EngineSpec(engine_from_args, (args,)), max_waiting=args.max_waiting), served
    except RuntimeError as error:  # the engine's process could not build it
        raise SystemExit(f"--model {args.model}: {error}") from None


def engine_from_args(args: argparse.Namespace) -> Engine:
    """The engine on its model, as the command line asks (run in the engine's process)."""
    from labkit.load import load

    model, tokenizer = load(args.model, args.device)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    return Engine(model, args.num_blocks, args.block_size, config, prefix_caching=not args.no_prefix_caching,
                  eos_id=eos_id_of(tokenizer), decode_kernel=decode_kernel(args.decode_kernel))


class Server(uvicorn.Server):
    """uvicorn, which on SIGTERM or Ctrl-C (or when ``parent_pid`` is gone) first tells the engine to
    drain, so that open streams end and the process exits, with code 0, within a few seconds."""

    def __init__(self, app: FastAPI, host: str, port: int, drain_s: float, parent_pid: int | None = None) -> None:
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                        timeout_graceful_shutdown=drain_s + 2))
        self.engine: AsyncEngine = app.state.engine
        self.drain_s, self.parent_pid = drain_s, parent_pid
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.loop is not None and not self.should_exit:
            self.loop.call_soon_threadsafe(self._drain)
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        self.draining = self.loop.create_task(self.engine.shutdown(self.drain_s))

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:  # bound: say where (not before, when the port might be taken); --port 0's real port
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            print(f"labkit serves {self.engine_name} on http://{self.config.host}:{port}", flush=True)

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        if self.parent_pid is not None:
            threading.Thread(target=self._watch_parent, daemon=True).start()
        await super().serve(sockets)

    async def _serve(self, sockets: Any = None) -> None:
        await super()._serve(sockets)
        # uvicorn raises the signal it handled again once it has shut down, so that the process
        # dies of it; this server has drained and exits normally instead
        getattr(self, "_captured_signals", []).clear()

    def _watch_parent(self) -> None:
        """Exit when the process that started this server is gone (a notebook's kernel restarted)."""
        while _alive(self.parent_pid):
            if self.should_exit:
                return
            time.sleep(0.5)
        self.handle_exit(signal.SIGTERM, None)

    @property
    def engine_name(self) -> str:
        return repr(self.config.app.state.served.name)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def _key(text: str) -> str:
    if not text.strip():  # an unset variable ("$KEY") would otherwise turn the check off
        raise argparse.ArgumentTypeError("an empty key would let every request in: give a key, or leave the option out")
    return text


def _key_of_environment() -> str | None:
    key = os.environ.get("LABKIT_API_KEY")
    if key is not None and not key.strip():  # set, but to nothing: as --api-key "", no check at all
        raise SystemExit("LABKIT_API_KEY is set but empty, which would let every request in: give it a key, or "
                         "unset it")
    return key


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m labkit.serve", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default="target", help="a shipped checkpoint's name or a model folder (default: %(default)s)")
    add("--served-name", help="the model's name in the API (when left out: the model's folder name)")
    add("--host", default="127.0.0.1",
        help="the address to listen on; 0.0.0.0 opens the server to the network (default: %(default)s)")
    add("--port", type=option_in(int, 0, 65535), default=8000,
        help="the port to listen on; 0: a free one, printed (default: %(default)s)")
    add("--api-key", type=_key,
        help="the bearer key /v1/ requests must carry (when left out: $LABKIT_API_KEY if set, else none)")
    add("--device", help="cpu or cuda (when left out: the best there is)")
    add("--num-blocks", type=option_in(int, 1), default=512, help="KV-cache blocks in the pool (default: %(default)s)")
    add("--block-size", type=option_in(int, 1), default=16, help="tokens per KV-cache block (default: %(default)s)")
    add("--max-num-seqs", type=option_in(int, 1), default=32,
        help="most sequences in a step's batch (default: %(default)s)")
    add("--max-num-batched-tokens", type=option_in(int, 1), default=512,
        help="most tokens in a step (default: %(default)s)")
    add("--max-waiting", type=option_in(int, 1), default=256,
        help="requests queued beyond the batch before a 503 (default: %(default)s)")
    add("--no-prefix-caching", action="store_true", help="recompute every prompt")
    add("--decode-kernel", choices=("none", "cpp", "triton"), default="none",
        help="decode attention: gather the blocks then SDPA, labkit's C++ operator, or Triton (default: %(default)s)")
    add("--engine", choices=("process", "thread"), default="process",
        help="where the engine steps: a process of its own, which shares no GIL with the HTTP side, or a "
             "thread of the server's (default: %(default)s)")
    add("--drain", type=option_in(float, 0.0), default=2.0,
        help="seconds running requests get on SIGTERM (default: %(default)s)")
    add("--parent-pid", type=int, help="exit when this process is gone")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    key = args.api_key or _key_of_environment()  # before the engine starts
    engine, served = build_engine(args)
    app = create_app(engine, served, key, args.drain)
    try:
        Server(app, args.host, args.port, args.drain, args.parent_pid).run()
    except KeyboardInterrupt:  # a second Ctrl-C, while draining
        return 130
    return 0


if __name__ == "__main__":  # through the module's importable name, which the engine's process imports
    from labkit.serve import main as importable_main

    raise SystemExit(importable_main())
