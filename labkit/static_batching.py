"""Static batching, the baseline continuous batching is measured against.

Up to ``batch_size`` requests that have arrived form a batch, their prompts left-padded to the
longest (padding at position -1), in a contiguous cache that reserves the same slots for every
row. The batch decodes, every row every step, until its last member
finishes; only then do its requests complete and the next batch start. A short request sits
idle in its row, and a new one waits for the whole batch: the waste that iteration-level
scheduling (``labkit.engine``) removes.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

from labkit.engine import (FINISHED, RUNNING, Request, StepRecord, WallClock, check_fits, check_unique_ids,
                           is_finished, sample)
from labkit.model import ContiguousKVCache, Transformer
from labkit.validate import check_counts, check_eos


def run_static(model: Transformer, requests: Iterable[Request], batch_size: int,
               eos_id: int | None = None) -> tuple[list[Request], list[StepRecord]]:
    """Serve ``requests`` in static batches of up to ``batch_size`` (see the module docstring).
    Returns the requests (in the order given) and the step log."""
    check_counts(batch_size=batch_size)
    check_eos(eos_id, model.config.vocab_size)
    requests = list(requests)
    check_unique_ids(requests)
    for request in requests:
        check_fits(request, model.config.vocab_size, model.config.max_seq_len)
    pending, log, now = deque(sorted(requests, key=lambda r: r.arrival_time)), [], WallClock().now
    while pending:
        time.sleep(max(0.0, pending[0].arrival_time - now()))
        batch = []
        while pending and len(batch) < batch_size and pending[0].arrival_time <= now():
            batch.append(pending.popleft())
        _run_batch(model, batch, eos_id, now, log)
    return requests, log


def padded_prompts(batch: Sequence[Request], device: torch.device) -> tuple[Tensor, Tensor]:
    """Prompts left-padded to the longest: token ids (0 at padding) and positions (-1 there)."""
    width = max(len(r.prompt) for r in batch)
    tokens = [[0] * (width - len(r.prompt)) + r.prompt for r in batch]
    positions = [[-1] * (width - len(r.prompt)) + list(range(len(r.prompt))) for r in batch]
    return torch.tensor(tokens, device=device), torch.tensor(positions, device=device)


def _run_batch(model: Transformer, batch: list[Request], eos_id: int | None, now: Callable[[], float],
               log: list[StepRecord]) -> None:
    steps = max(r.params.max_new_tokens for r in batch)
    fed, positions = padded_prompts(batch, model.device)
    longest = max(r.max_tokens for r in batch)  # slot p holds position p: the farthest any row reaches
    cache = ContiguousKVCache(model.config, len(batch), longest, model.dtype, model.device)
    for r in batch:
        r.status = RUNNING
    active = list(batch)
    for step in range(steps):
        begin = now()
        with torch.inference_mode():
            logits = model(fed, plan=cache.plan(positions), logits_at=-1)[:, -1]  # only the last column is used
        rows = [i for i, r in enumerate(batch) if r in active]
        new = sample(logits[rows], active)
        end = now()
        log.append(StepRecord(begin, end, [(r.request_id, len(r.prompt) if step == 0 else 1,
                                            ("prefill" if step == 0 else "decode") if r in active else "idle")
                                           for r in batch]))
        for request, token in zip(list(active), new):
            request.output.append(token)
            request.token_times.append(end)
            if is_finished(request, eos_id):
                active.remove(request)
        if not active:
            break
        # a finished row still runs (its slot is held), as padding: nothing of it is stored
        fed = torch.tensor([[r.output[-1]] for r in batch], device=model.device)
        positions = torch.tensor([[len(r.prompt) + step if r in active else -1] for r in batch], device=model.device)
    end = now()
    for request in batch:
        request.status, request.finish_time, request.num_computed = FINISHED, end, request.num_tokens - 1
