"""The decoder: config checks, cache against no cache, batching with padding, GQA grouping."""
from __future__ import annotations

import math

import pytest
import torch

from labkit.model import AttentionPlan, ContiguousKVCache, ModelConfig, Transformer, attention

TINY = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64)


def _model(n_kv_heads: int = 2, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(n_kv_heads=n_kv_heads, **TINY)).eval()
    for p in model.parameters():  # larger than the default init, so that mistakes show
        torch.nn.init.normal_(p, std=0.2)
    return model


@pytest.mark.parametrize("change, message", [
    (dict(n_heads=5), "d_model=32 is not a multiple of n_heads=5"),
    (dict(n_kv_heads=3), "n_heads=4 is not a multiple of n_kv_heads=3"),
    (dict(d_model=12, n_heads=4), "head_dim=3"),
    (dict(n_layers=0), "n_layers=0 must be at least 1"),
])
def test_bad_configs_name_the_problem(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**TINY, "n_kv_heads": 2, **change})


def _through(model, tokens, positions, cache):
    """A forward pass through ``cache``: its plan for ``positions`` (None: 0..T-1), then the model."""
    if positions is None:
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, plan=cache.plan(positions))


def test_a_cache_made_for_another_model_is_refused_before_any_key_is_written():
    from labkit.kv_compress import SinkCache
    from labkit.paged import BlockAllocator, PagedKVCache, step_logits
    from labkit.static_cache import StaticKVCache

    model, other = _model(n_kv_heads=2), _model(n_kv_heads=1)  # the draft's cache given to the target, say
    refused = r"made for a model of \(layers, KV heads, head dim\) = \(\d+, 1, \d+\), but this model has \(\d+, 2, \d+\)"
    contiguous = ContiguousKVCache(other.config, 1)
    for cache in (contiguous, StaticKVCache(other.config, 1), SinkCache(other.config)):
        with pytest.raises(ValueError, match=refused):
            model(torch.tensor([[1, 2]]), plan=cache.plan(torch.tensor([[0, 1]])))
    assert not contiguous.k.any()  # refused before the first layer wrote its keys
    paged = PagedKVCache(other.config, BlockAllocator(8, 4))
    paged.allocator.add_sequence("a", [1, 2])
    with pytest.raises(ValueError, match=refused):
        step_logits(model, paged, [("a", 0, 2)], [1, 2])


def test_a_compiler_refuses_a_cache_of_another_model_by_name_and_a_view_keeps_its_layout():
    from labkit.aot import aot_step
    from labkit.compile import compile_step
    from labkit.cuda_graphs import GraphedStep
    from labkit.model import kv_layout
    from labkit.static_cache import StaticKVCache

    model, other = _model(n_kv_heads=2), _model(n_kv_heads=1)
    for build in (compile_step, aot_step, GraphedStep):  # a failure to compile would hide why: the check comes first
        with pytest.raises(ValueError, match="made for a model of"):
            build(model, StaticKVCache(other.config, 1))
    assert StaticKVCache(other.config, 2).first_rows(1).layout == kv_layout(other.config)  # a view is checked too


def test_positions_past_the_context_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="positions 63..64 .*max_seq_len"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[63, 64]]))
    with pytest.raises(ValueError, match="65 tokens .*max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=r"tokens must be \[batch, length\]"):
        model(torch.zeros(5, dtype=torch.long))
    for max_len in (0, 65):
        with pytest.raises(ValueError, match=f"max_len={max_len} must be in 1..max_seq_len=64"):
            ContiguousKVCache(model.config, 1, max_len=max_len)
    with pytest.raises(ValueError, match="positions -2..0"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[-2, 0]]))
    cache = ContiguousKVCache(model.config, 1, max_len=8)
    for positions, key in [([[-2, 0]], "position -2 does not fit"), ([[8]], "position 8 does not fit"),
                           ([[-1, -1]], "every position is padding")]:
        with pytest.raises(ValueError, match=key):
            cache.plan(torch.tensor(positions))
    with pytest.raises(TypeError, match="a .batch, T. tensor"):
        cache.plan([[0, 1]])
    plan = cache.plan(torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="a plan carries its positions"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[0, 1]]), plan)
    with pytest.raises(TypeError, match="not a ContiguousKVCache"):
        model(torch.zeros(1, 2, dtype=torch.long), None, cache)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_cached_decoding_matches_recomputing_everything(n_kv_heads):
    model = _model(n_kv_heads)
    tokens = torch.randint(0, 97, (2, 12))
    full = model(tokens)
    cache = ContiguousKVCache(model.config, batch_size=2, max_len=16)
    steps = [_through(model, tokens[:, :5], None, cache)]
    for t in range(5, 12):
        steps.append(_through(model, tokens[:, t:t + 1], torch.full((2, 1), t), cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_one_sequence_decodes_unmasked_and_a_rewritten_position_sees_only_its_past():
    model = _model()
    tokens = torch.randint(0, 97, (1, 10))
    full = model(tokens)
    cache = ContiguousKVCache(model.config, batch_size=1, max_len=12)
    steps = [_through(model, tokens[:, :4], None, cache)]
    for t in range(4, 10):  # a decode step at batch 1: its query sees every slot it reads, and no mask is built
        plan = cache.plan(torch.tensor([[t]]))
        assert plan.mask is None and plan.length == t + 1
        steps.append(model(tokens[:, t:t + 1], plan=plan))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
    # position 5 again, without rolling back: slots 6 to 9 still hold keys it must not see
    other = torch.tensor([[(int(tokens[0, 5]) + 1) % 97]])
    again = _through(model, other, torch.tensor([[5]]), cache)
    torch.testing.assert_close(again[0, 0], model(torch.cat([tokens[:, :5], other], 1))[0, -1], rtol=1e-4, atol=1e-4)


def test_a_padded_batch_equals_each_sequence_alone():
    model = _model()
    a, b = torch.randint(0, 97, (1, 7)), torch.randint(0, 97, (1, 4))
    tokens = torch.cat([a, torch.cat([b, torch.zeros(1, 3, dtype=torch.long)], 1)])
    positions = torch.tensor([list(range(7)), [0, 1, 2, 3, -1, -1, -1]])
    cache = ContiguousKVCache(model.config, batch_size=2, max_len=10)
    batched = _through(model, tokens, positions, cache)
    torch.testing.assert_close(batched[0], model(a)[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batched[1, :4], model(b)[0], rtol=1e-4, atol=1e-4)
    # decode one more token for each, at their own next positions
    nxt = torch.randint(0, 97, (2, 1))
    step = _through(model, nxt, torch.tensor([[7], [4]]), cache)
    torch.testing.assert_close(step[1, 0], model(torch.cat([b, nxt[1:]], 1))[0, -1], rtol=1e-4, atol=1e-4)


def test_gqa_equals_mha_with_each_kv_head_copied_to_its_group():
    gqa = _model(n_kv_heads=2)
    mha = Transformer(ModelConfig(n_kv_heads=4, **TINY)).eval()
    state = gqa.state_dict()
    head_dim = 8
    for name in list(state):
        if name.endswith("attn.wqkv.weight"):
            q, k, v = state[name].split([4 * head_dim, 2 * head_dim, 2 * head_dim])
            copy = lambda kv: kv.view(2, head_dim, 32).repeat_interleave(2, dim=0).reshape(4 * head_dim, 32)
            state[name] = torch.cat([q, copy(k), copy(v)])
    mha.load_state_dict(state)
    tokens = torch.randint(0, 97, (1, 9))
    torch.testing.assert_close(mha(tokens), gqa(tokens), rtol=1e-5, atol=1e-5)


def test_rolling_back_is_running_from_an_earlier_position():
    model = _model()
    tokens = torch.randint(0, 97, (1, 8))
    cache = ContiguousKVCache(model.config, batch_size=1, max_len=8)
    _through(model, (tokens[:, :6] + 1) % 97, None, cache)  # positions 4 and 5 get other tokens first
    _through(model, tokens[:, :4], None, cache)
    again = _through(model, tokens[:, 4:8], torch.arange(4, 8)[None], cache)
    torch.testing.assert_close(again, model(tokens)[:, 4:], rtol=1e-4, atol=1e-4)


class ListCache:
    """A second cache implementation, as plain as can be: per layer, a growing list of (k, v)
    for one sequence, and the plain plan of the protocol. The model must work with it exactly as
    with the contiguous cache."""

    def __init__(self) -> None:
        self.layers: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def plan(self, positions):
        return AttentionPlan(self, positions)

    def attend(self, layer, q, k, v, plan):
        self.layers.setdefault(layer, []).append((k, v))
        keys = torch.cat([kk for kk, _ in self.layers[layer]], dim=2)
        values = torch.cat([vv for _, vv in self.layers[layer]], dim=2)
        seen = torch.arange(keys.shape[2])[None, None, None, :]
        return attention(q, keys, values, seen <= plan.positions[:, None, :, None])


def test_attention_works_through_any_cache_implementation():
    model = _model()
    tokens = torch.randint(0, 97, (1, 10))
    cache = ListCache()
    out = [_through(model, tokens[:, :6], None, cache)] + [_through(model, tokens[:, t:t + 1], torch.tensor([[t]]), cache)
                                                           for t in range(6, 10)]
    torch.testing.assert_close(torch.cat(out, 1), model(tokens), rtol=1e-4, atol=1e-4)


def _reference_attention(q, keys, values, mask):
    """Softmax attention written out, each query head over its KV head (head h uses h // group)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ values


@pytest.mark.parametrize("n_kv_heads", [6, 3, 2, 1])
@pytest.mark.parametrize("length", [1, 4])
@pytest.mark.parametrize("masked", [True, False])
def test_attention_matches_softmax_attention_written_out(n_kv_heads, length, masked):
    generator = torch.Generator().manual_seed(n_kv_heads * 10 + length)
    q = torch.randn(3, 6, length, 8, generator=generator)
    keys, values = (torch.randn(3, n_kv_heads, 9, 8, generator=generator) for _ in range(2))
    mask = torch.rand(3, 1, length, 9, generator=generator) < 0.7 if masked else None
    if masked:
        mask[..., 0] = True  # every query sees at least one key
    torch.testing.assert_close(attention(q, keys, values, mask), _reference_attention(q, keys, values, mask))


def test_attention_takes_sdpa_output_in_any_layout(monkeypatch):
    """A GPU kernel may return a decode step's grouped output laid out [B, group, n_kv, d] in memory."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kw: sdpa(*args, **kw).transpose(1, 2).contiguous().transpose(1, 2))
    generator = torch.Generator().manual_seed(1)
    q, keys, values = torch.randn(2, 6, 1, 8, generator=generator), *torch.randn(2, 2, 2, 5, 8, generator=generator)
    torch.testing.assert_close(attention(q, keys, values, None), _reference_attention(q, keys, values, None))


def test_one_sequence_with_padding_or_gaps_is_placed_by_its_positions():
    model = _model()
    tokens = torch.randint(0, 97, (1, 6))
    cache = ContiguousKVCache(model.config, batch_size=1, max_len=8)
    padded = _through(model, torch.cat([tokens[:, :3], torch.zeros(1, 2, dtype=torch.long)], 1),
                      torch.tensor([[0, 1, 2, -1, -1]]), cache)
    torch.testing.assert_close(padded[:, :3], model(tokens[:, :3]), rtol=1e-4, atol=1e-4)
    shuffled = _through(model, tokens[:, [4, 3, 5]], torch.tensor([[4, 3, 5]]), cache)  # not in order: the general path
    torch.testing.assert_close(shuffled, model(tokens)[:, [4, 3, 5]], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="a batch of 2 sequences for a cache of 1"):
        cache.plan(torch.tensor([[6], [6]]))


def test_logits_at_gives_those_positions_and_fills_the_cache_the_same():
    model = _model()
    tokens = torch.randint(0, 97, (2, 7))
    full, caches = model(tokens), [ContiguousKVCache(model.config, 2, 8) for _ in range(2)]
    positions = torch.arange(7).expand(2, -1)
    some = model(tokens, plan=caches[0].plan(positions), logits_at=torch.tensor([6, 2]))
    torch.testing.assert_close(some, full[:, [6, 2]])
    torch.testing.assert_close(model(tokens, logits_at=-1), full[:, -1:])
    _through(model, tokens, positions, caches[1])
    assert torch.equal(caches[0].k, caches[1].k)
