"""The rewrite of one-row matrix products into loops Inductor generates (``labkit.row_products``):
where it applies, where it must not, and the products it gives against float64."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.aot import DecodeModule
from labkit.model import ModelConfig, Transformer
from labkit.row_products import OneRowProducts, row_major_copies
from labkit.static_cache import StaticKVCache, decode_static

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64,
                     tie_embeddings=True)


def _compiled(fn):
    """``fn`` compiled with the rewrite, compiled here (not Inductor's cached code, for which no pass
    runs), and the pass, to count what it rewrote."""
    rewrite = OneRowProducts()
    options = {"post_grad_custom_post_pass": rewrite, "fx_graph_cache": False}
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options), rewrite


def test_a_one_row_product_with_a_row_major_weight_is_rewritten_and_matches_float64():
    torch.manual_seed(0)
    x, w = torch.randn(1, 1, 48), torch.randn(80, 48)
    product, rewrite = _compiled(F.linear)
    out = product(x, w)
    assert rewrite.rewritten == 1
    torch.testing.assert_close(out, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)


def test_column_major_weights_and_several_rows_are_left_to_the_library():
    """Along a transposed weight the generated loop would stride across rows; several rows are not
    a walk over the weights once."""
    torch.manual_seed(0)
    w = torch.randn(80, 48)
    for x, weight in ((torch.randn(1, 48), w.t().contiguous().t()), (torch.randn(3, 48), w)):
        product, rewrite = _compiled(F.linear)
        torch.testing.assert_close(product(x, weight), x @ w.T, rtol=1e-5, atol=1e-5)
        assert rewrite.rewritten == 0


def test_every_projection_of_a_decode_step_is_rewritten_on_the_copies():
    """labkit.aot's one-row step with generated products, compiled here with torch.compile."""
    torch.manual_seed(0)
    model = Transformer(CONFIG).eval()  # stores its weights transposed
    copies = row_major_copies(model)
    assert set(copies) == {name for name, p in model.named_parameters(remove_duplicate=False)
                           if p.dim() == 2 and name != "embed.weight"}  # the tied LM head under its Linear's name
    assert all(c.is_contiguous() and torch.equal(c, model.get_parameter(name)) for name, c in copies.items())
    step, rewrite = _compiled(DecodeModule(model, StaticKVCache(CONFIG, 1, 8), "generated"))
    tokens, positions = torch.tensor([[5]]), torch.tensor([[0]])
    with torch.inference_mode():
        torch.testing.assert_close(step(tokens, positions),
                                   decode_static(model, StaticKVCache(CONFIG, 1, 8), tokens, positions),
                                   rtol=1e-5, atol=1e-5)
    assert rewrite.rewritten == len(copies) == CONFIG.n_layers * 4 + 1


def test_copies_are_copies_even_of_weights_already_laid_out_by_rows():
    layer = torch.nn.Linear(8, 4)
    copy = row_major_copies(layer)["weight"]
    assert copy.data_ptr() != layer.weight.data_ptr() and torch.equal(copy, layer.weight)
