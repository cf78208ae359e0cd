"""Generating text, one token at a time: without a cache, or with one.

- Naive: every step runs the whole sequence so far through the model. For a prompt of P
  tokens and N new tokens that is P + (P+1) + ... + (P+N-1) = N*P + N(N-1)/2 tokens processed.
- Cached: the prompt goes through once (prefill), then each step feeds only the newest token
  (decode), its keys and values appended to a KV cache: P + N - 1 tokens processed.

Choosing the next token: greedy takes the argmax. Sampling divides the logits by the
temperature, keeps the ``top_k`` most likely tokens and the smallest set whose probability
reaches ``top_p``, renormalises and draws. Temperature 0 means greedy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Callable, Iterator, Sequence

import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from labkit.answers import answer_to
from labkit.compile import static_decoder
from labkit.model import AttentionPlan, ContiguousKVCache, RowCache, Transformer, forward_tokens
from labkit.static_cache import StaticKVCache
from labkit.validate import as_token_ids, check_eos, check_ints

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        check_ints(max_new_tokens=self.max_new_tokens, top_k=self.top_k,
                   **({} if self.seed is None else {"seed": self.seed}))
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be 0 (greedy) or positive")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be 0 (no limit) or positive")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


@dataclass
class Counters:
    """What a generation loop did: tokens run through the model, and forward calls."""

    tokens_processed: int = 0
    forward_calls: int = 0


class CountingModel(nn.Module):
    """Wraps a model and records how many tokens (per sequence) each forward call carried."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model, self.config = model, model.config
        self.calls: list[int] = []

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def forward(self, tokens: Tensor, positions: Tensor | None = None, plan: AttentionPlan | None = None) -> Tensor:
        self.calls.append(tokens.shape[1])
        return self.model(tokens, positions, plan)


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus ([..., vocab])."""
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = ordered.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p  # the mass before this token already reaches top_p
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


def sampling_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution sampling draws from (temperature > 0): fp32 probabilities, [..., vocab]."""
    if params.temperature == 0:
        raise ValueError("temperature=0 is greedy decoding: there is no distribution to sample from; "
                         "give SamplingParams(temperature=...) > 0")
    return filter_logits(logits.float() / params.temperature, params.top_k, params.top_p).softmax(-1)


def next_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """The next token id for each row of ``logits`` ([batch, vocab])."""
    if params.temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, params), 1, generator=generator).squeeze(-1)


def seeded_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """One generator for a whole seeded run (None without a seed)."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def token_generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator | None:
    """The generator that draws the ``index``-th new token of a seeded generation (None without a
    seed), seeded from (seed, index) alone: a token is drawn the same way whatever ran before it
    and however often its step runs (a step interrupted and run again, a preempted request
    recomputed), so a seeded request gets the same tokens alone, in a batch, or in an engine."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed((params.seed * 1_000_003 + index) % 2**64)


def sequence_length(model: Transformer, prompt: Sequence[int], params: SamplingParams,
                    eos_id: int | None = None) -> int:
    """The tokens a generation from ``prompt`` keeps in the cache at most (the last new token is
    never fed back); a ValueError if the prompt is empty, holds anything but token ids of the model's
    vocabulary, or that exceeds the model's context, or if ``eos_id`` is no token id (``check_eos``)."""
    as_token_ids(prompt, model.config.vocab_size)
    check_eos(eos_id, model.config.vocab_size)
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    total = len(prompt) + params.max_new_tokens - 1
    if total > model.config.max_seq_len:
        raise ValueError(f"{len(prompt)} prompt tokens + {params.max_new_tokens} new ones exceed the "
                         f"context limit max_seq_len={model.config.max_seq_len}")
    return total


@answer_to("ex01.3")
def stream(model: Transformer, prompt: Sequence[int], params: SamplingParams = SamplingParams(), *,
           use_cache: bool = True, cache: RowCache | None = None, eos_id: int | None = None,
           counters: Counters | None = None, compiled: bool = False, use_cuda_graphs: bool = False) -> Iterator[int]:
    """Yield new token ids one at a time. With ``use_cache`` (default) the prompt is prefilled
    into ``cache`` (a fresh contiguous one if none is given); without, every step recomputes.
    With ``compiled`` or ``use_cuda_graphs``, the prompt is prefilled eagerly into a static cache
    and each decode step runs compiled (``labkit.compile``) or replayed from a CUDA graph
    (``labkit.cuda_graphs``): the same tokens, fewer launches."""
    total = sequence_length(model, prompt, params, eos_id)
    counters = counters if counters is not None else Counters()
    device = model.device
    step = None
    if compiled or use_cuda_graphs:
        cache, step = _static_decoder(model, total, cache, use_cache, use_cuda_graphs)
    elif use_cache and cache is None:
        cache = ContiguousKVCache(model.config, 1, total, model.dtype, device)
    fed, start = list(prompt), 0  # what the next forward call runs, from which position
    for index in range(params.max_new_tokens):
        if step is not None and index:
            logits = step(torch.tensor([fed], device=device), torch.tensor([[start]], device=device))[0]
        else:
            logits = forward_tokens(model, fed, start, cache if use_cache else None)
        token = int(next_token(logits[-1:], params, token_generator(params, index, device)))
        counters.tokens_processed += len(fed)
        counters.forward_calls += 1
        yield token
        if params.stop_at_eos and token == eos_id:
            return
        start, fed = (start + len(fed), [token]) if use_cache else (0, fed + [token])


def _static_decoder(model: Transformer, total: int, cache: RowCache | None, use_cache: bool,
                    use_cuda_graphs: bool) -> tuple[StaticKVCache, Callable[[Tensor, Tensor], Tensor]]:
    """``stream``'s static cache and decode step (``labkit.compile.static_decoder``)."""
    if not use_cache or cache is not None:
        raise ValueError("a compiled or graphed decode step brings its own static cache: "
                         "leave use_cache=True and cache=None")
    return static_decoder(model, total, use_cuda_graphs)  # a graph on a CPU: GraphedStep says it needs CUDA


def cache_after(model: Transformer, context: int, slots: int) -> ContiguousKVCache:
    """A one-row cache of ``slots`` slots holding ``context`` cached tokens (zeros): where a step
    to time runs after them."""
    cache = ContiguousKVCache(model.config, 1, slots, model.dtype, model.device)
    if context:
        forward_tokens(model, [0] * context, 0, cache)
    return cache


def decode_step(model: Transformer, context: int, tokens: int = 1) -> Callable[[], Tensor]:
    """One cached forward call of ``tokens`` new tokens (1: a decode step; more: what speculative
    decoding's verification runs) after ``context`` cached ones, as a callable to time that returns
    the logits ``[1, tokens, vocab]``: every call writes the same slots, so every call does the
    same work, planning the step included."""
    check_ints(context=context, tokens=tokens)
    if context < 0 or tokens < 1:
        raise ValueError(f"context={context} cached tokens must be 0 or more and tokens={tokens} new ones 1 or more")
    cache = cache_after(model, context, context + tokens)
    fed = torch.zeros(1, tokens, dtype=torch.long, device=model.device)
    positions = torch.arange(context, context + tokens, device=model.device)[None]

    def step() -> Tensor:
        with torch.inference_mode():
            return model(fed, plan=cache.plan(positions))
    return step


def eos_id_of(tokenizer: Tokenizer) -> int | None:
    """The tokenizer's end-of-text token id, under any of the usual names."""
    return next((i for name in EOS_NAMES if (i := tokenizer.token_to_id(name)) is not None), None)


def generate(model: Transformer, tokenizer: Tokenizer, prompt: str, params: SamplingParams = SamplingParams(),
             *, use_cache: bool = True, compiled: bool = False, use_cuda_graphs: bool = False) -> str:
    """The text the model writes after ``prompt`` (``stream`` says what the flags do)."""
    ids = tokenizer.encode(prompt).ids
    new = list(stream(model, ids, params, use_cache=use_cache, eos_id=eos_id_of(tokenizer),
                      compiled=compiled, use_cuda_graphs=use_cuda_graphs))
    return tokenizer.decode(new)
