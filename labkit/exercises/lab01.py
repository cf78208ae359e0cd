"""Notebook 01 (KV cache): count the work, write the cached attention step and the cached loop."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from labkit.cost import tokens_processed
from labkit.exercises.spec import Case, Exercise
from labkit.generate import CountingModel, SamplingParams, stream
from labkit.model import ModelConfig, Transformer


def _tokens_cases() -> list[Case]:
    sizes = [
        ("the textbook example: 10-token prompt, 100 new tokens", (10, 100)),
        ("one new token: a single forward pass of the prompt", (7, 1)),
        ("a one-token prompt", (1, 50)),
        ("16-token prompt, 512 new tokens", (16, 512)),
        ("long prompt, few new tokens", (2000, 3)),
    ]
    return [Case(label, args, tokens_processed(*args)) for label, args in sizes]


def reference_attention_step(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor,
                             v_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Append, then attend with torch's fused attention (each KV head serves a group of query heads)."""
    keys, values = torch.cat([k_cache, k_new], dim=2), torch.cat([v_cache, v_new], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=q.shape[1] != keys.shape[1])
    return out, keys, values


def _attention_cases() -> list[Case]:
    shapes = [  # batch, query heads, KV heads, cached tokens, head_dim
        ("MHA: 4 query heads, 4 KV heads, 7 cached tokens", (1, 4, 4, 7, 16)),
        ("GQA: 8 query heads share 2 KV heads, batch of 2", (2, 8, 2, 5, 32)),
        ("MQA: 6 query heads share 1 KV head", (1, 6, 1, 9, 8)),
        ("empty cache: the first token attends only to itself", (1, 4, 2, 0, 16)),
    ]
    generator = torch.Generator().manual_seed(1)
    cases = []
    for label, (batch, heads, kv_heads, cached, dim) in shapes:
        def draw(n_heads: int, length: int) -> Tensor:
            return torch.randn(batch, n_heads, length, dim, generator=generator)
        args = (draw(heads, 1), draw(kv_heads, 1), draw(kv_heads, 1), draw(kv_heads, cached), draw(kv_heads, cached))
        cases.append(Case(label, args, reference_attention_step(*args), rtol=1e-4, atol=1e-5))
    return cases


def _expect_cached(model: CountingModel, prompt: Sequence[int], new_tokens: int) -> None:
    """Prefill once with the whole prompt, then one token per decode step."""
    expected = [len(prompt)] + [1] * (new_tokens - 1)
    if model.calls != expected:
        shown = model.calls if len(model.calls) <= 6 else model.calls[:5] + ["..."]
        raise AssertionError(f"the right tokens, but the model ran {sum(model.calls)} tokens in calls of {shown}; "
                             f"cached generation runs {sum(expected)}: the prompt once, then one token per step")


def random_model(n_heads: int, n_kv_heads: int, seed: int) -> Transformer:
    """A small random model whose logits are far apart, so that greedy choices are clear-cut."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads,
                         d_ff=128, max_seq_len=128)
    model = Transformer(config)
    model.reset_parameters(std=0.3)
    return model.eval()


def _generate_cases() -> list[Case]:
    from labkit.load import load  # the shipped draft model, on the CPU

    draft, tokenizer = load("draft", device="cpu")
    runs = [
        ("MHA random model, 3-token prompt, 12 new tokens", random_model(4, 4, seed=0), [5, 17, 3], 12),
        ("GQA random model, 1-token prompt, 20 new tokens", random_model(8, 2, seed=1), [42], 20),
        ("one new token: the prefill alone", random_model(4, 1, seed=2), [1, 2, 3, 4], 1),
        ("the shipped draft model on Python code", draft, tokenizer.encode("def add(a, b):\n").ids, 24),
    ]
    cases = []
    for label, model, prompt, new_tokens in runs:
        params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
        naive = list(stream(model, prompt, params, use_cache=False))
        cases.append(Case(label, (CountingModel(model), prompt, new_tokens), naive, after=_expect_cached))
    return cases


EXERCISES = [
    Exercise(
        id="ex01.1", title="Tokens processed, in closed form", points=1, function="tokens_processed",
        cases=_tokens_cases,
        recipe="Naive step i (from 0) runs the prompt plus the i tokens generated so far; cached runs the "
             "prompt once, then one token per step. The last new token is never fed back in.",
    ),
    Exercise(
        id="ex01.2", title="One cached attention step", points=2, function="cached_attention_step",
        returns=("out", "k_cache", "v_cache"),
        cases=_attention_cases,
        recipe="Concatenate along the sequence axis (dim 2). Scores are q @ k^T / sqrt(head_dim), softmax "
             "over the keys, times v. With fewer KV heads, KV head j serves query heads "
             "j*g .. j*g+g-1 (g = query heads / KV heads): repeat_interleave the keys and values by g.",
    ),
    Exercise(
        id="ex01.3", title="The cached generation loop", points=2, function="cached_generate",
        cases=_generate_cases, timeout_s=120,
        recipe="Make a ContiguousKVCache(model.config, 1, len(prompt) + new_tokens, device=device). Prefill: run the whole "
             "prompt at positions 0..P-1, model(tokens, plan=cache.plan(positions)), and take the argmax of the "
             "last logits. Then feed only the newest token at its position, new_tokens - 1 times; the last "
             "token is never fed back.",
    ),
]
