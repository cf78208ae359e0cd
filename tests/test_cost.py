"""Cost model: token counts against the loops' own counters, FLOPs against torch's FLOP counter
and a count of the causal mask, bytes against the model's own tensors."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit import cost
from labkit.exercises.lab01 import random_model
from labkit.generate import Counters, SamplingParams, stream
from labkit.model import ContiguousKVCache, causal_mask


@pytest.fixture(scope="module")
def model():
    return random_model(8, 2, seed=3)


@pytest.mark.parametrize("prompt_len, new_tokens", [(10, 100), (1, 1), (3, 17), (25, 2)])
def test_closed_form_matches_the_counters(model, prompt_len, new_tokens):
    params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
    counted = []
    for use_cache in (False, True):
        counters = Counters()
        list(stream(model, list(range(prompt_len)), params, use_cache=use_cache, counters=counters))
        counted.append(counters.tokens_processed)
    assert tuple(counted) == cost.tokens_processed(prompt_len, new_tokens)


def test_the_textbook_example():
    assert cost.tokens_processed(10, 100) == (5950, 109)


def test_a_forward_pass_of_negative_tokens_is_refused():
    config = random_model(4, 2, seed=0).config
    with pytest.raises(ValueError, match="tokens=-3 and cached=-2 must be 0 or more"):
        cost.forward_flops(config, -3, -2)


@pytest.mark.parametrize("bad", [(0, 5), (5, 0), (-1, 3)])
def test_lengths_are_validated(bad):
    with pytest.raises(ValueError, match="must both be at least 1"):
        cost.tokens_processed(*bad)


def _matmul_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("tokens, cached", [(9, 0), (1, 9), (4, 5)])
def test_forward_flops_match_the_flop_counter_and_the_mask(model, tokens, cached):
    c = model.config
    cache = ContiguousKVCache(c, 1, tokens + cached)
    with torch.no_grad():
        if cached:
            model(torch.zeros(1, cached, dtype=torch.long), plan=cache.plan(torch.arange(cached)[None]))
        positions = torch.arange(cached, cached + tokens)[None]
        plan = cache.plan(positions)
        # torch counts the projections' matmuls (not the fused attention kernel) ...
        matmuls = _matmul_flops(lambda: model(torch.ones(1, tokens, dtype=torch.long), plan=plan))
    # ... and the attention is 4 FLOPs per (query, visible key) pair per head dimension and layer
    pairs = int(causal_mask(positions, torch.arange(cached + tokens)[None]).sum())
    attention = 4 * c.n_layers * c.n_heads * c.head_dim * pairs
    assert cost.forward_flops(c, tokens, cached) == matmuls + attention


def test_generation_flops_sum_the_passes_of_each_loop(model):
    c = model.config
    naive, cached = cost.generation_flops(c, 5, 3)
    assert naive == cost.forward_flops(c, 5) + cost.forward_flops(c, 6) + cost.forward_flops(c, 7)
    assert cached == cost.forward_flops(c, 5) + cost.forward_flops(c, 1, 5) + cost.forward_flops(c, 1, 6)
    assert naive > cached


def test_forward_bytes_are_the_weights_and_the_cache(model):
    c = model.config
    weights = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and name != "embed.weight")
    weights += c.vocab_size * c.d_model if c.tie_embeddings else 0
    cache = ContiguousKVCache(c, 1, 10, dtype=torch.float16)
    assert cost.matmul_weights(c) == weights
    assert cost.forward_bytes(c, 1, 9, weight_bytes=2, kv_dtype="fp16") == 2 * weights + cache.nbytes
    assert cost.intensity(c, 1, 9) < 1.1 < cost.intensity(c, 64)
