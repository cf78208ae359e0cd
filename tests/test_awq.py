"""AWQ: folding its scales leaves a model's function unchanged, the error it minimises is the layer's
output error, the search finds a planted salient channel and beats rounding on it, and
quantize_model's "awq" is the folded model rounded to nearest."""
from __future__ import annotations

import copy

import pytest
import torch

from labkit.awq import KINDS, awq_scales, fold_scales, output_error, rtn_scaled, scale_model, search_scales
from labkit.model import ModelConfig, Transformer
from labkit.outliers import outlier_model
from labkit.quant import QuantLinear, Scheme, dequantize, hessian, quantize, quantize_model
from tests.tiny_models import one_torch_thread

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)
SCHEME = Scheme(4, 16)


@pytest.fixture(scope="module")
def small() -> Transformer:
    """float64, GQA (4 query heads on 2 KV heads: wo's scales must be shared), two planted outlier channels."""
    torch.manual_seed(3)
    model = Transformer(ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                                    max_seq_len=64, tie_embeddings=True))
    model.reset_parameters(std=0.3)
    return outlier_model(model.double().eval(), channels=(5, 40), factor=16)


@pytest.fixture(scope="module")
def calibration() -> torch.Tensor:
    return torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", KINDS)
def test_folding_any_scales_leaves_the_function_unchanged(small, calibration, kind):
    folded = copy.deepcopy(small)
    width = folded.blocks[0].get_submodule(kind).in_features
    s = torch.rand(width, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 4 + 0.25
    if kind == "attn.wo":  # one scale per KV channel, the same for the query heads that share it
        s = s.view(2, 2, 16)[:, :1].expand(2, 2, 16).flatten()
    with torch.no_grad():
        for block in folded.blocks:
            fold_scales(block, kind, s)
        assert not torch.equal(folded.blocks[0].get_submodule(kind).weight, small.blocks[0].get_submodule(kind).weight)
        torch.testing.assert_close(folded(calibration), small(calibration), rtol=1e-10, atol=1e-10)


def test_scale_model_changes_the_weights_but_not_the_logits(small, calibration):
    folded = copy.deepcopy(small)
    scales = scale_model(folded, calibration, SCHEME)
    assert not torch.equal(folded.blocks[0].attn.wqkv.weight, small.blocks[0].attn.wqkv.weight)
    assert not torch.equal(folded.blocks[0].attn_norm.weight, small.blocks[0].attn_norm.weight)
    assert set(scales) == {f"blocks.{i}.{kind}" for i in range(2) for kind in KINDS}
    assert scales["blocks.0.attn.wqkv"].argmax() in (5, 40)  # the planted outliers get the largest scales
    with torch.no_grad():
        torch.testing.assert_close(folded(calibration), small(calibration), rtol=1e-10, atol=1e-10)


def test_output_error_from_the_hessian_is_the_error_on_the_inputs():
    x = torch.randn(300, 32, generator=torch.Generator().manual_seed(0))
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    w_hat = dequantize(*quantize(w, SCHEME))
    direct = (x @ w_hat.T - x @ w.T).norm() / (x @ w.T).norm()
    assert output_error(w, w_hat, hessian(x)) == pytest.approx(direct.item(), rel=1e-4)


def test_the_search_protects_a_planted_salient_channel_and_beats_rounding():
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=generator) * 0.05
    x = torch.randn(1024, 128, generator=generator)
    x[:, 37] *= 30  # one channel with large activations: its weights are the salient ones
    h = hessian(x)
    s, alpha, error = search_scales(w, x.abs().mean(0), h, Scheme(4, 32))
    assert int(s.argmax()) == 37 and alpha > 0
    rounded = dequantize(*quantize(w, Scheme(4, 32)))
    direct = lambda w_hat: ((x @ w_hat.T - x @ w.T).norm() / (x @ w.T).norm()).item()
    assert error == pytest.approx(direct(rtn_scaled(w, s, Scheme(4, 32))), rel=1e-4)
    assert error < 0.7 * direct(rounded)
    # alpha = 0 is plain rounding, so the search never does worse on its own inputs
    torch.testing.assert_close(rtn_scaled(w, awq_scales(x.abs().mean(0), 0.0), Scheme(4, 32)), rounded)


def test_awq_model_needs_calibration_by_name(small):
    with pytest.raises(ValueError, match="AWQ needs calibration"):
        quantize_model(small, SCHEME, "awq")


def test_awq_model_is_the_folded_model_rounded_and_beats_rtn_on_outliers(small, calibration):
    quantized = quantize_model(small, SCHEME, "awq", calibration)
    assert sum(isinstance(m, QuantLinear) for m in quantized.modules()) == 2 * len(KINDS)  # else the loop checks none
    folded = copy.deepcopy(small)
    scale_model(folded, calibration, SCHEME)
    rounded = quantize_model(folded, SCHEME)
    for name, layer in quantized.named_modules():
        if isinstance(layer, QuantLinear):
            assert torch.equal(layer.packed, rounded.get_submodule(name).packed)
    with torch.no_grad():
        exact = small(calibration)
        gap = lambda m: (m(calibration) - exact).norm().item()
        assert gap(quantized) < 0.8 * gap(quantize_model(small, SCHEME))
