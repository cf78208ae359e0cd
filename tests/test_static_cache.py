"""The static KV cache: the same attention as the contiguous cache, from tensors alone."""
from __future__ import annotations

import pytest
import torch

from labkit.model import ContiguousKVCache, ModelConfig, Transformer, forward_tokens
from labkit.static_cache import LENGTH_STEP, StaticKVCache, static_length

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=600)


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CONFIG).eval()


def _logits(model, cache, tokens, positions):
    with torch.inference_mode():
        return model(tokens, plan=cache.plan(positions))


def test_prefill_and_decode_match_the_contiguous_cache(model):
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    contiguous, static = ContiguousKVCache(CONFIG, 1, 40), StaticKVCache(CONFIG, 1, 40)
    positions = torch.arange(12)[None]
    torch.testing.assert_close(_logits(model, static, prompt, positions), _logits(model, contiguous, prompt, positions))
    for p in range(12, 20):  # decode steps, each through both caches
        token, where = torch.tensor([[p % 64]]), torch.tensor([[p]])
        torch.testing.assert_close(_logits(model, static, token, where), _logits(model, contiguous, token, where))


def test_a_batch_with_padding_matches_each_row_alone_and_padding_writes_only_the_spare_slot(model):
    static = StaticKVCache(CONFIG, 3, 16)
    rows = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    tokens = torch.tensor([r + [0] * (4 - len(r)) for r in rows])
    positions = torch.tensor([list(range(len(r))) + [-1] * (4 - len(r)) for r in rows])
    logits = _logits(model, static, tokens, positions)
    keys = torch.stack(static.k)  # [layers, batch, kv heads, slots, head_dim]
    for i, row in enumerate(rows):
        alone = forward_tokens(model, row, 0, ContiguousKVCache(CONFIG, 1, 16))
        torch.testing.assert_close(logits[i, :len(row)], alone, rtol=1e-5, atol=1e-5)
        assert keys[:, i, :, len(row):16].abs().sum() == 0, f"row {i}: padding wrote a real slot"
    assert keys[:, 1, :, 16].abs().sum() > 0  # ... it went to the spare slot
    assert torch.isfinite(logits).all()


def test_first_rows_share_the_memory(model):
    static = StaticKVCache(CONFIG, 4, 8)
    view = static.first_rows(2)
    _logits(model, view, torch.tensor([[1], [2]]), torch.tensor([[0], [0]]))
    keys = torch.stack(static.k)
    assert keys[:, :2, :, 0].abs().sum() > 0 and keys[:, 2:].abs().sum() == 0
    with pytest.raises(ValueError, match="n=5 must be in 1..batch_size=4"):
        static.first_rows(5)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="max_len=601 must be in 1..max_seq_len=600"):
        StaticKVCache(CONFIG, 1, 601)
    with pytest.raises(ValueError, match="batch_size=0"):
        StaticKVCache(CONFIG, 0, 8)
    with pytest.raises(ValueError, match="a batch of 2 sequences for a cache of 1"):
        StaticKVCache(CONFIG, 1, 8).plan(torch.zeros(2, 1, dtype=torch.long))


def test_static_length_rounds_up_within_the_context():
    assert static_length(CONFIG, 1) == LENGTH_STEP and static_length(CONFIG, LENGTH_STEP + 1) == 2 * LENGTH_STEP
    assert static_length(CONFIG, 599) == 600
