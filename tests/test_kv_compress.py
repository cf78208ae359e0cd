"""KV-cache compression: the sink + window cache against full attention and against a mask built
by hand, its bounded memory, int8 storage against fp32, perplexity against a plain forward."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from labkit.exercises.lab01 import random_model
from labkit.generate import SamplingParams, stream
from labkit.kv_compress import (Int8KVCache, SinkCache, attention_on_first, cached_perplexities, cached_perplexity,
                                dequantize_int8, quantize_int8)
from labkit.model import AttentionPlan, ContiguousKVCache, ModelConfig, Transformer, attention


def _tokens(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


def _feed(model: Transformer, tokens: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """Logits of every position, the tokens fed ``chunk`` at a time through ``cache``."""
    batch, n = tokens.shape
    out = []
    with torch.no_grad():
        for start in range(0, n, chunk):
            positions = torch.arange(start, min(start + chunk, n)).expand(batch, -1)
            out.append(model(tokens[:, start:start + chunk], plan=cache.plan(positions)))
    return torch.cat(out, dim=1)


class HandMaskCache:
    """For one forward over the whole text: its own keys, under the sink + window rule written out
    one (query, key) pair at a time."""

    def __init__(self, sinks: int, window: int) -> None:
        self.sinks, self.window = sinks, window

    def plan(self, positions):
        return AttentionPlan(self, positions)

    def attend(self, layer, q, k, v, plan):
        rows = [[[key <= p and (key < self.sinks or key > p - self.window) for key in row] for p in row]
                for row in plan.positions.tolist()]
        return attention(q, k, v, torch.tensor(rows)[:, None])


@pytest.mark.parametrize("batch", [1, 2])
def test_a_window_covering_the_sequence_is_full_attention(batch):
    model = random_model(8, 2, seed=0)
    tokens = _tokens(40, batch=batch)
    with torch.no_grad():
        full = model(tokens)
    cache = SinkCache(model.config, batch_size=batch, sinks=4, window=64)
    torch.testing.assert_close(_feed(model, tokens, cache, chunk=7), full, rtol=1e-4, atol=1e-4)


def test_cached_perplexity_equals_a_plain_forward():
    model = random_model(4, 4, seed=1)
    tokens = _tokens(60, seed=1)
    with torch.no_grad():
        expected = math.exp(F.cross_entropy(model(tokens)[0, :-1], tokens[0, 1:]).item())
    got = cached_perplexity(model, tokens[0], ContiguousKVCache(model.config, 1), chunk=16)
    assert got == pytest.approx(expected, rel=1e-4)
    assert cached_perplexity(model, tokens[0].tolist(), ContiguousKVCache(model.config, 1)) == pytest.approx(got)


@pytest.mark.parametrize("make", [
    lambda config, batch: ContiguousKVCache(config, batch),
    lambda config, batch: SinkCache(config, batch_size=batch, sinks=2, window=9),
    lambda config, batch: Int8KVCache(config, batch),
], ids=["contiguous", "sinks", "int8"])
def test_a_batch_of_texts_gets_each_texts_own_perplexity(make):
    model = random_model(4, 2, seed=3)
    texts = _tokens(41, batch=3, seed=3)
    alone = [cached_perplexity(model, text, make(model.config, 1), chunk=6) for text in texts]
    together = cached_perplexities(model, texts, make(model.config, 3), chunk=6)
    assert together.shape == (3,) and len(set(alone)) == 3  # three different texts, three different figures
    assert together.tolist() == pytest.approx(alone, rel=1e-5)


@pytest.mark.parametrize("sinks, window", [(4, 16), (0, 8), (2, 1)])
def test_a_small_window_matches_a_hand_built_mask_in_any_chunking(sinks, window):
    model = random_model(8, 2, seed=2)
    tokens = _tokens(48, seed=2)
    with torch.no_grad():
        reference = model(tokens, plan=HandMaskCache(sinks, window).plan(torch.arange(48)[None]))
        full = model(tokens)
    assert not torch.allclose(reference, full, atol=1e-2)  # the window does cut something here
    cache = SinkCache(model.config, sinks=sinks, window=window)
    torch.testing.assert_close(_feed(model, tokens, cache, chunk=5), reference, rtol=1e-4, atol=1e-4)
    reference_ppl = math.exp(F.cross_entropy(reference[0, :-1], tokens[0, 1:]).item())
    for chunk in (1, 3, 7, 64):
        ppl = cached_perplexity(model, tokens[0], SinkCache(model.config, sinks=sinks, window=window), chunk)
        assert ppl == pytest.approx(reference_ppl, rel=1e-4)


def test_memory_stays_bounded():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=512)
    model = Transformer(config).eval()
    batch, n = 2, 300
    cache = SinkCache(config, batch_size=batch, sinks=4, window=32)
    with torch.no_grad():
        for start, end in [(0, 50), (50, 51), (51, 130), (130, 300)]:
            model(_tokens(end - start, seed=start, batch=batch), plan=cache.plan(torch.arange(start, end).expand(batch, -1)))
            assert all(k.shape[2] <= cache.max_tokens for k in cache.k + cache.v)
    assert cache.max_tokens == 36
    assert [k.shape for k in cache.k + cache.v] == [(batch, 2, 36, 8)] * (2 * config.n_layers)
    assert all(held.tolist() == [0, 1, 2, 3] + list(range(n - 32, n)) for held in cache.held)
    assert cache.nbytes == 2 * config.n_layers * batch * config.n_kv_heads * 36 * config.head_dim * 4


def test_int8_round_trip_is_within_half_a_step():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=generator) * torch.logspace(-3, 3, 5)[:, None]
    x[1, 2] = 0
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 5, 1)
    error = (dequantize_int8(q, scale) - x).abs()
    assert (error <= scale / 2 * (1 + 1e-5)).all()
    assert q.abs().amax(-1).tolist() == [[127] * 5, [127, 127, 0, 127, 127], [127] * 5]  # scale = max|x| / 127
    assert (q[1, 2] == 0).all() and (scale > 0).all() and torch.isfinite(scale).all()  # x / scale is defined
    with pytest.raises(ValueError, match="q must be int8"):
        dequantize_int8(q.float(), scale)


def test_int8_cache_stays_close_to_fp32_when_generating():
    model = random_model(8, 2, seed=3)
    model.reset_parameters(std=0.1)  # std 0.3 amplifies every rounding error tenfold
    prompt = _tokens(8, seed=3)[0].tolist()
    greedy = list(stream(model, prompt, SamplingParams(max_new_tokens=40, stop_at_eos=False)))
    tokens = torch.tensor([prompt + greedy])
    exact = _feed(model, tokens, ContiguousKVCache(model.config, 1), chunk=1)  # one decode step per token
    int8 = _feed(model, tokens, Int8KVCache(model.config, 1), chunk=1)
    assert 0 < (int8 - exact).norm() / exact.norm() < 2e-2
    same = (int8.argmax(-1) == exact.argmax(-1)).float().mean()
    assert same >= 0.9, f"int8 picks the fp32 greedy token at only {same:.0%} of the steps"


def test_int8_cache_returns_the_queries_dtype_and_a_padded_mask():
    config = random_model(4, 2, seed=4).config
    cache = Int8KVCache(config, 2, max_len=8)
    k = torch.randn(2, 2, 3, config.head_dim, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 3, config.head_dim, dtype=torch.bfloat16)
    plan = cache.plan(torch.tensor([[0, 1, 2], [0, -1, -1]]))
    assert cache.attend(0, q, k, k, plan).dtype == torch.bfloat16 and cache.k.dtype == torch.int8
    keys, values = cache._read(0, 3, torch.bfloat16)
    assert keys.dtype == values.dtype == torch.bfloat16
    torch.testing.assert_close(keys[0], k[0], rtol=2e-2, atol=2e-2)
    assert plan.mask[1, 0].tolist() == [[True, False, False], [True, True, True], [True, True, True]]
    k = torch.randn(2, 2, 1, config.head_dim)
    cache.attend(0, torch.randn(2, 4, 1, config.head_dim), k, k, cache.plan(torch.tensor([[3], [1]])))
    keys, _ = cache._read(0, 4, torch.float32)
    expected = dequantize_int8(*quantize_int8(k))
    assert torch.equal(keys[0, :, 3], expected[0, :, 0]) and torch.equal(keys[1, :, 1], expected[1, :, 0])


def test_int8_cache_bytes_are_values_plus_scales():
    config = random_model(4, 2, seed=5).config  # head_dim 16
    layers, heads, dim, batch, length = config.n_layers, config.n_kv_heads, config.head_dim, 3, 100
    int8, fp32 = Int8KVCache(config, batch, length), ContiguousKVCache(config, batch, length)
    assert int8.nbytes == 2 * layers * batch * heads * length * (dim * 1 + 4)
    assert int8.nbytes / fp32.nbytes == (dim + 4) / (4 * dim)


@pytest.mark.parametrize("kwargs, message", [
    (dict(sinks=-1), "sinks=-1"),
    (dict(window=0), "window=0 must be at least 1"),
    (dict(batch_size=0), "batch_size=0 must be at least 1"),
])
def test_bad_sink_cache_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SinkCache(random_model(4, 2, seed=0).config, **kwargs)


def test_sink_cache_refuses_rows_at_different_positions():
    model = random_model(4, 2, seed=0)
    tokens = _tokens(3, batch=2)
    with pytest.raises(ValueError, match="row 1 differs from row 0"):
        SinkCache(model.config, batch_size=2).plan(torch.tensor([[0, 1, 2], [1, 2, 3]]))
    with pytest.raises(ValueError, match="takes no padding"):
        SinkCache(model.config, batch_size=2).plan(torch.tensor([[0, 1, 2], [0, 1, -1]]))
    with pytest.raises(ValueError, match="2 rows.*batch_size=1"):
        SinkCache(model.config, batch_size=1).plan(torch.arange(3).expand(2, -1))
    with pytest.raises(ValueError, match="position 128 .*max_seq_len=128"):
        SinkCache(model.config, batch_size=1).plan(torch.tensor([[127, 128]]))
    with pytest.raises(TypeError, match=r"a \[batch, T\] tensor"):
        SinkCache(model.config).plan([[0, 1]])
    cache = SinkCache(model.config)
    model(tokens[:1], plan=cache.plan(torch.arange(3)[None]))
    with pytest.raises(ValueError, match=r"position 1 is not after the last one held \(2\)"):
        cache.plan(torch.tensor([[1]]))


def test_perplexity_input_errors():
    model = random_model(4, 2, seed=0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        cached_perplexity(model, [5], ContiguousKVCache(model.config, 1))
    with pytest.raises(ValueError, match="129 tokens .*max_seq_len=128"):
        cached_perplexity(model, [5] * 129, ContiguousKVCache(model.config, 1))
    with pytest.raises(ValueError, match=r"one sequence \(1-D\)"):
        cached_perplexity(model, _tokens(5, batch=2), ContiguousKVCache(model.config, 2))
    with pytest.raises(ValueError, match="chunk=0 must be at least 1"):
        cached_perplexity(model, [5, 6], ContiguousKVCache(model.config, 1), chunk=0)
    with pytest.raises(ValueError, match=r"texts must be \[batch, T\], got shape \(5,\)"):
        cached_perplexities(model, torch.tensor([5] * 5), ContiguousKVCache(model.config, 1))
    with pytest.raises(ValueError, match="a batch of 2 sequences for a cache of 1"):
        cached_perplexities(model, _tokens(5, batch=2), ContiguousKVCache(model.config, 1))



def _attention_weights_by_hand(model, block, x):
    """Block ``block``'s softmax weights [B, heads, T, T] on its input stream ``x``, each query head
    against its KV head repeated."""
    from labkit.model import apply_rope

    c, (batch, length) = model.config, x.shape[:2]
    heads = model.blocks[block].attn.wqkv(model.blocks[block].attn_norm(x))
    heads = heads.view(batch, length, -1, c.head_dim).transpose(1, 2)
    qk = apply_rope(heads[:, :c.n_heads + c.n_kv_heads], *model.rotary(torch.arange(length).expand(batch, -1)))
    q, k = qk[:, :c.n_heads], qk[:, c.n_heads:].repeat_interleave(c.n_heads // c.n_kv_heads, 1)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    return (q @ k.transpose(-2, -1) / math.sqrt(c.head_dim)).masked_fill(future, float("-inf")).softmax(-1)


def test_attention_on_first_sums_the_softmax_weights_a_hand_computation_gives():
    from labkit.heads import streams_at

    model, first = random_model(8, 2, seed=3), 3
    tokens = _tokens(12, seed=3, batch=2)
    c, length = model.config, tokens.shape[1]
    with torch.no_grad():  # layers 0 and 1, each on the stream that enters it
        inputs = {0: model.embed(tokens), 1: streams_at(model, tokens, [1])[1]}
        weights = {block: _attention_weights_by_hand(model, block, x) for block, x in inputs.items()}
    mass = attention_on_first(model, tokens, first=first)
    assert mass.shape == (c.n_layers, length)
    for block, w in weights.items():
        torch.testing.assert_close(mass[block], w[..., :first].sum(-1).mean(dim=(0, 1)))
    torch.testing.assert_close(mass[:, :first], torch.ones(c.n_layers, first))  # the first queries see only them
    torch.testing.assert_close(attention_on_first(model, tokens, first=length), torch.ones(c.n_layers, length))
    more = attention_on_first(model, tokens[0], first=first + 2)  # one sequence; two more first tokens
    assert torch.all(more >= attention_on_first(model, tokens[0], first))


def test_the_first_tokens_probe_leaves_the_model_output_unchanged():
    from labkit.kv_compress import _FirstTokensProbe

    model, tokens = random_model(8, 2, seed=4), _tokens(10, seed=4, batch=2)
    with torch.no_grad():
        probed = model(tokens, plan=_FirstTokensProbe(2).plan(torch.arange(10).expand(2, -1)))
        torch.testing.assert_close(probed, model(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens, first, message", [
    (torch.zeros(2, 3, 4, dtype=torch.long), 2, "must be \\[T\\] or \\[batch, T\\]"),
    (torch.zeros(5, dtype=torch.long), 0, "first=0 must be at least 1"),
])
def test_attention_on_first_refuses_bad_input(tokens, first, message):
    with pytest.raises(ValueError, match=message):
        attention_on_first(random_model(4, 4, seed=0), tokens, first)
