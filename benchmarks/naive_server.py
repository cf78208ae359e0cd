"""The server a newcomer writes first: transformers' ``generate()`` behind FastAPI, one request at a time.

    .venv/bin/python benchmarks/naive_server.py MODEL_FOLDER [--host 127.0.0.1] [--port 8001]

``MODEL_FOLDER`` holds a Hugging Face Llama checkpoint and its ``tokenizer.json``
(``labkit.load.save_hf(model, folder, tokenizer)`` writes both). ``POST /v1/completions`` takes
what ``labkit.loadgen`` sends (a prompt string, ``max_tokens``, ``ignore_eos``, ``stream`` with
``stream_options.include_usage``; always greedy) and answers in OpenAI's format; ``GET /health``.

Each request holds one lock for its whole generation: requests are served one after another at
batch 1 while the others wait for the lock. There is no batching, which is what
``benchmarks/serving.py`` compares labkit's server against. To stream, ``generate()`` runs in a
worker thread and hands each new token to a streamer (transformers' ``BaseStreamer``), which
posts it to the request's asyncio queue; the endpoint sends one server-sent event per token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import AsyncIterator

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

from labkit.generate import eos_id_of


class QueueStreamer(BaseStreamer):
    """Hands each token ``generate()`` makes to an asyncio queue (from generate's thread); None at the
    end. generate() first puts the prompt, which is skipped."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, int(value.reshape(-1)[0]))
        self.prompt_seen = True

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def create_app(folder: Path) -> FastAPI:
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos_id, lock, app = eos_id_of(tokenizer), asyncio.Lock(), FastAPI()

    def generate(ids: list[int], max_tokens: int, ignore_eos: bool, streamer: BaseStreamer | None = None) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_tokens, streamer=streamer,
                                 eos_token_id=None if ignore_eos else eos_id, pad_token_id=eos_id)
        return out[0, len(ids):].tolist()

    def finish_reason(token: int, count: int, max_tokens: int, ignore_eos: bool) -> str | None:
        if not ignore_eos and token == eos_id:
            return "stop"
        return "length" if count == max_tokens else None

    async def events(ids: list[int], max_tokens: int, ignore_eos: bool, usage: bool) -> AsyncIterator[str]:
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": folder.name}
        async with lock:
            queue: asyncio.Queue = asyncio.Queue()
            worker = asyncio.create_task(asyncio.to_thread(
                generate, ids, max_tokens, ignore_eos, QueueStreamer(asyncio.get_running_loop(), queue)))
            count = 0
            while (token := await queue.get()) is not None:
                count += 1
                choice = {"index": 0, "text": tokenizer.decode([token]), "logprobs": None,
                          "finish_reason": finish_reason(token, count, max_tokens, ignore_eos)}
                yield f"data: {json.dumps(head | {'choices': [choice]})}\n\n"
            await worker
        if usage:
            counts = {"prompt_tokens": len(ids), "completion_tokens": count, "total_tokens": len(ids) + count}
            yield f"data: {json.dumps(head | {'choices': [], 'usage': counts})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        ids, max_tokens = tokenizer.encode(body["prompt"]).ids, int(body.get("max_tokens", 16))
        ignore_eos = bool(body.get("ignore_eos", False))
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(events(ids, max_tokens, ignore_eos, usage), media_type="text/event-stream")
        async with lock:
            new = await asyncio.to_thread(generate, ids, max_tokens, ignore_eos)
        reason = "stop" if not ignore_eos and new[-1] == eos_id else "length"
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                             "created": int(time.time()), "model": folder.name,
                             "choices": [{"index": 0, "text": tokenizer.decode(new), "logprobs": None,
                                          "finish_reason": reason}],
                             "usage": {"prompt_tokens": len(ids), "completion_tokens": len(new),
                                       "total_tokens": len(ids) + len(new)}})

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a Hugging Face Llama checkpoint with its tokenizer.json")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    uvicorn.run(create_app(args.folder), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
