"""KV-cache memory math against the worked cases quoted in the memory lab's issue."""
from __future__ import annotations

import pytest

from labkit.memory import GIB, kv_bytes_per_token, kv_cache_bytes, kv_tokens_per_gib, max_batch, max_context
from labkit.presets import MODEL_PRESETS, gpu, model

MIB = 2**20


def test_llama2_70b_at_2048_tokens_gqa_and_without():
    m = model("Llama-2-70B")
    assert kv_cache_bytes(m, 2048, dtype="fp16") == 0.625 * GIB
    assert kv_cache_bytes(m.with_kv_heads(64), 2048, dtype="fp16") == 5 * GIB


def test_llama3_8b_at_4k_and_128k():
    m = model("Llama-3.1-8B")
    assert kv_cache_bytes(m, 4096) == 512 * MIB
    assert kv_cache_bytes(m, 128 * 1024) == 16 * GIB


@pytest.mark.parametrize("kv_heads, gib", [(32, 16), (8, 4), (1, 0.5)])
def test_llama3_8b_at_32k_for_mha_gqa_mqa(kv_heads, gib):
    assert kv_cache_bytes(model("Llama-3.1-8B").with_kv_heads(kv_heads), 32 * 1024) == gib * GIB


def test_dtypes_batches_and_mla():
    m = model("Llama-3.1-8B")
    assert kv_cache_bytes(m, 1000, batch=3, dtype="int4") == kv_cache_bytes(m, 1000, 3, "fp16") / 4
    assert kv_cache_bytes(m, 1000, 1, "fp32") == 2 * kv_cache_bytes(m, 1000, 1, "bf16")
    assert kv_tokens_per_gib(m, "fp16") == GIB / (128 * 1024)
    assert kv_bytes_per_token(model("DeepSeek-V3"), "bf16") == 61 * 576 * 2  # 70,272 bytes, MLA latent
    with pytest.raises(ValueError, match="dtype='fp6'"):
        kv_cache_bytes(m, 10, dtype="fp6")
    with pytest.raises(ValueError, match="n_kv_heads=5 must divide n_heads=32"):
        m.with_kv_heads(5)


def test_shapes_and_block_sizes_that_could_not_be_are_refused():
    from dataclasses import replace

    from labkit.memory import fragmentation

    m = model("Llama-3.1-8B")
    with pytest.raises(ValueError, match="Llama-3.1-8B: n_layers=-32 must be at least 1"):
        replace(m, n_layers=-32)  # its KV bytes would come out negative
    with pytest.raises(ValueError, match="n_kv_heads=32 must divide n_heads=8"):
        replace(m, n_heads=8, n_kv_heads=32)
    for block_size, message in ((0, "block_size=0 must be at least 1"), (-4, "block_size=-4"), (2.5, "must be an int")):
        with pytest.raises(ValueError, match=message):  # -4 gave a negative waste, 0 a ZeroDivisionError
            fragmentation([5], 10, block_size)


def test_what_fits_on_a_gpu():
    m, h100 = model("Llama-3.1-8B"), gpu("H100-SXM")
    free = 0.9 * 80e9 - 8.03e9 * 2
    assert max_batch(m, h100, 8192) == int(free // (8192 * 128 * 1024))
    assert max_context(m, h100, batch=1) == 131072  # capped at the model's context
    assert max_context(m, h100, batch=64) == int(free // (64 * 128 * 1024))
    with pytest.raises(ValueError, match="do not fit 90% of L4 24GB"):
        max_batch(model("Llama-3.1-70B"), gpu("L4"), 1024)
    for bad, message in [(lambda: max_batch(m, h100, 0), "seq_len=0 must be at least 1"),
                         (lambda: max_context(m, h100, batch=0), "batch=0 must be at least 1"),
                         (lambda: max_batch(m, h100, 1024, utilization=90), r"utilization=90 must be in \(0, 1\]")]:
        with pytest.raises(ValueError, match=message):
            bad()


def test_presets_cover_the_published_models():
    assert len(MODEL_PRESETS) == 15 and all(p.n_heads % p.n_kv_heads == 0 for p in MODEL_PRESETS.values())


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_a_real_cache_holds_exactly_the_formula_bytes(kv_heads):
    import torch

    from labkit.memory import shape_of
    from labkit.model import ContiguousKVCache, ModelConfig

    config = ModelConfig(vocab_size=10, d_model=64, n_layers=3, n_heads=4, n_kv_heads=kv_heads, d_ff=8,
                         max_seq_len=96)
    cache = ContiguousKVCache(config, batch_size=5, max_len=96, dtype=torch.float16)
    assert cache.nbytes == kv_cache_bytes(shape_of("tiny", config, 0), 96, batch=5, dtype="fp16")
