"""The outlier model: the target's logits exactly, its planted channels measured at the norms'
outputs, and the channel choice re-derived on a model with a known strongest channel."""
from __future__ import annotations

import pytest
import torch

import labkit
from labkit.model import ModelConfig, Transformer
from labkit.outliers import CHANNELS, FACTOR, norm_output_max, outlier_model, strongest_channels
from tests.tiny_models import one_torch_thread

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


@pytest.fixture(scope="module")
def target_and_text():
    target, tokenizer = labkit.load("target", device="cpu")
    text = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
            "    return total / len(values)\n")
    return target, torch.tensor(tokenizer.encode(text * 3).ids)[None]


def test_the_outlier_model_has_the_targets_logits_exactly(target_and_text):
    target, tokens = target_and_text
    model = outlier_model(target)
    assert not torch.equal(model.blocks[0].attn_norm.weight, target.blocks[0].attn_norm.weight)
    with torch.no_grad():
        assert torch.equal(model(tokens), target(tokens))  # a power-of-two factor only moves exponents


def test_the_planted_channels_are_factor_times_larger_and_the_largest(target_and_text):
    target, tokens = target_and_text
    before, after = norm_output_max(target, tokens), norm_output_max(outlier_model(target), tokens)
    assert len(after) == 2 * target.config.n_layers
    planted = list(CHANNELS)
    for name, found in after.items():
        torch.testing.assert_close(found[planted], FACTOR * before[name][planted])
        others = [c for c in range(len(found)) if c not in CHANNELS]
        torch.testing.assert_close(found[others], before[name][others])  # the residual stream is untouched
        assert set(found.topk(len(CHANNELS)).indices.tolist()) == set(CHANNELS), name
        assert found[planted].min() > 10 * found.median(), name


def test_strongest_channels_find_a_loud_residual_channel():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                                    max_seq_len=32)).eval()
    with torch.no_grad():
        model.embed.weight[:, 9] *= 100
    assert strongest_channels(model, torch.randint(0, 50, (2, 16)), 1) == [9]


def test_channels_outside_the_model_are_refused(target_and_text):
    with pytest.raises(ValueError, match="0..d_model - 1 = 383"):
        outlier_model(target_and_text[0], channels=(3, 384))
