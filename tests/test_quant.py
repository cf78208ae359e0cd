"""Weight quantization: the grid against a per-group reference written with Python numbers, packing,
QuantLinear against F.linear on the dequantized weight, quantized models with every cache and the
engine, and GPTQ against a plain column-by-column reference and against rounding."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from labkit.engine import Engine, Request
from labkit.generate import SamplingParams, stream
from labkit.model import ContiguousKVCache, ModelConfig, Transformer
from labkit.quant import (QuantEmbedding, QuantLinear, Scheme, dequantize, gptq, hessian, output_errors, pack_int4,
                          quantize, quantize_model, unpack_int4, use_fused, weight_bytes)
from labkit.kernels.int4_linear import int4_linear


def reference_group(values: list[float], bits: int, symmetric: bool) -> tuple[list[int], float, float]:
    """One group by the formulas, one Python number at a time (the scale rounded through fp16)."""
    if symmetric:
        scale, zero = max(abs(v) for v in values) / (2 ** (bits - 1) - 1), None
    else:
        lo, hi = min(min(values), 0.0), max(max(values), 0.0)
        scale = (hi - lo) / (2 ** bits - 1)
    scale = float(torch.tensor(scale, dtype=torch.float16)) or 1.0
    zero = 2 ** (bits - 1) if symmetric else min(max(round(-lo / scale), 0), 2 ** bits - 1)
    codes = [min(max(round(v / scale) + zero, 0), 2 ** bits - 1) for v in values]
    return codes, scale, zero


@pytest.mark.parametrize("scheme", [Scheme(4, 32), Scheme(4, 64, True), Scheme(8, None, True), Scheme(3, 16)])
def test_quantize_matches_the_formulas_group_by_group(scheme):
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    w[0, :16] = w[0, :16].abs() + 0.01  # an all-positive group
    w[1, 16:32] = 0  # an all-zero group
    codes, scales, zeros = quantize(w, scheme)
    size = scheme.group_size or 64
    for row in range(6):
        for g in range(64 // size):
            expected_codes, scale, zero = reference_group(w[row, g * size:(g + 1) * size].tolist(), scheme.bits,
                                                          scheme.symmetric)
            assert codes[row, g * size:(g + 1) * size].tolist() == expected_codes
            assert (float(scales[row, g]), float(zeros[row, g])) == (scale, zero)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 8), st.sampled_from([8, 16, 32]), st.booleans(), st.floats(1e-3, 10.0), st.integers(0, 9))
def test_the_error_is_at_most_half_a_step_and_zero_stays_zero(bits, size, symmetric, spread, seed):
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed)) * spread
    w[:, 3] = 0
    codes, scales, zeros = quantize(w, Scheme(bits, size, symmetric))
    assert codes.dtype == torch.uint8 and int(codes.max()) < 2 ** bits
    w_hat = dequantize(codes, scales, zeros)
    step = scales.float().repeat_interleave(size, dim=1)
    zero = zeros.float().repeat_interleave(size, dim=1)
    bottom, top = -zero * step, (2 ** bits - 1 - zero) * step
    # weights inside the grid are within half a step. Rounding the zero point (asymmetric) can leave
    # an extreme weight past the last level by another half step, and rounding the scale to fp16
    # (off by a relative 2^-11, or by 2^-25 where the scale is subnormal, under 6.1e-5) shrinks the
    # grid's span by up to 2^bits times that
    outside = (w - top).clamp(min=0) + (bottom - w).clamp(min=0)
    assert (outside <= step * 0.5 + 2 ** bits * torch.clamp(step * 2 ** -11, min=2 ** -25)).all()
    assert ((w - w_hat).abs() <= step * 0.5 * (1 + 1e-5) + outside).all()
    assert (w_hat[:, 3] == 0).all()


def test_group_sizes_that_do_not_tile_a_row_are_refused():
    with pytest.raises(ValueError, match="in_features=96 .*group_size=64.*32"):
        quantize(torch.randn(4, 96), Scheme(4, 64))
    with pytest.raises(ValueError, match="bits=9"):
        Scheme(9)
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        quantize(torch.randn(4, 4, 4), Scheme(4, 4))


def test_packing_known_bytes_and_round_trip():
    assert pack_int4(torch.tensor([1, 2, 3, 4], dtype=torch.uint8)).tolist() == [0x21, 0x43]
    assert unpack_int4(torch.tensor([0x21, 0xF0], dtype=torch.uint8)).tolist() == [1, 2, 0, 15]
    codes = torch.randint(0, 16, (7, 3, 40), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (7, 3, 20) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"codes 0..16 do not fit in 4 bits"):
        pack_int4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"codes -1..3 do not fit in 4 bits"):  # would wrap to 15
        pack_int4(torch.tensor([-1, 3]))
    ones = torch.ones(2, 1)
    for scheme, codes, message in [(Scheme(8, None, True), [[300, 0], [1, 2]], r"codes 0..300 do not fit in 8 bits"),
                                   (Scheme(3, None), [[8, 0], [1, 2]], r"codes 0..8 do not fit in 3 bits \(0..7\)")]:
        with pytest.raises(ValueError, match=message):  # a byte each: 300 would be stored as 44
            QuantLinear(torch.tensor(codes), ones, ones, scheme)



def test_a_scheme_takes_int_bits_and_group_size_and_a_bool_symmetric():
    with pytest.raises(ValueError, match=r"bits=4\.5: choose an int from 2 to 8"):
        Scheme(bits=4.5)  # else a grid of 2^4.5 - 1 = 21.6 levels
    with pytest.raises(ValueError, match=r"group_size=64\.0 must be an int of at least 1"):
        Scheme(group_size=64.0)
    with pytest.raises(ValueError, match=r"group_size=0 must be an int"):
        Scheme(group_size=0)
    with pytest.raises(ValueError, match=r"symmetric='no' must be True or False"):
        Scheme(symmetric="no")  # a non-empty string is truthy: it would quantize symmetrically
    assert Scheme(8, None, True).name == "INT8 per-channel sym"


def test_scales_and_zeros_must_have_a_column_per_group():
    codes, scales, zeros = quantize(torch.randn(8, 96), Scheme(4, 32))
    assert scales.shape == zeros.shape == (8, 3)
    for columns in (1, 2):  # taken as one group of 96, or two of 48: a wrong weight, silently
        with pytest.raises(ValueError, match=rf"scales \[8, {columns}\] must be \[out, in / group_size\] = \[8, 3\]"):
            QuantLinear(codes, scales[:, :columns], zeros[:, :columns], Scheme(group_size=32))
        with pytest.raises(ValueError, match=rf"zeros \[8, {columns}\] must be \[out, in / group_size\] = \[8, 3\]"):
            QuantLinear(codes, scales, zeros[:, :columns], Scheme(group_size=32))
        with pytest.raises(ValueError, match=rf"scales \[8, {columns}\] must be \[out, in / group_size\] = \[8, 3\]"):
            dequantize(codes, scales[:, :columns], zeros[:, :columns], group_size=32)
    # without a group size, dequantize reads it from the scales, which must tile the row, and zeros must match them
    with pytest.raises(ValueError, match=r"scales \[8, 5\] must be \[out, in / group_size\] = \[8, n\], "
                                         r"n dividing in=96"):
        dequantize(codes, torch.ones(8, 5), torch.ones(8, 5))
    with pytest.raises(ValueError, match=r"zeros \[8, 1\] must be \[out, in / group_size\] = \[8, 3\]"):
        dequantize(codes, scales, zeros[:, :1])
    with pytest.raises(ValueError, match=r"INT4 g32 asym needs zeros"):
        QuantLinear(codes, scales, None, Scheme(group_size=32))
    symmetric = QuantLinear(codes, scales, None, Scheme(4, 32, True))  # a symmetric grid stores no zeros
    assert symmetric.zeros is None
    torch.testing.assert_close(QuantLinear(codes, scales, zeros, Scheme(4, 32)).dequantized_weight(),
                               dequantize(codes, scales, zeros))


def test_unpacking_takes_unsigned_bytes():
    packed = pack_int4(torch.tensor([[1, 15, 8, 0]], dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"packed must be uint8 \(two 4-bit codes a byte\), got torch\.int8"):
        unpack_int4(packed.to(torch.int8))  # 0xF1 as int8 is -15: its high nibble would unpack as -1
    assert unpack_int4(packed).tolist() == [[1, 15, 8, 0]]


@pytest.mark.parametrize("scheme, bytes_per_row", [(Scheme(4, 64), 64 + 2 * 2 * 2), (Scheme(4, 32, True), 64 + 4 * 2),
                                                   (Scheme(8, None, True), 128 + 2)])
def test_quant_linear_is_f_linear_on_the_dequantized_weight(scheme, bytes_per_row):
    linear = nn.Linear(128, 48, bias=False)
    layer = QuantLinear.from_linear(linear, scheme)
    x = torch.randn(3, 5, 128)
    w_hat = dequantize(*quantize(linear.weight.detach(), scheme))
    torch.testing.assert_close(layer(x), x @ w_hat.T)
    assert layer.nbytes == 48 * bytes_per_row
    assert layer.nbytes * 8 / (48 * 128) == scheme.bits_per_weight(128)
    relative = (layer(x) - linear(x)).norm() / linear(x).norm()
    assert relative < (0.12 if scheme.bits == 4 else 0.01)
    with pytest.raises(ValueError, match="bias"):
        QuantLinear.from_linear(nn.Linear(128, 4), scheme)


@pytest.mark.parametrize("scheme", [Scheme(4, 64), Scheme(4, 32, True), Scheme(4, None)])
def test_a_decode_step_takes_the_fused_kernel_and_agrees_with_the_pytorch_path(scheme, monkeypatch):
    from labkit import quant
    layer = QuantLinear.from_linear(nn.Linear(128, 40, bias=False), scheme)
    calls = []
    monkeypatch.setattr(quant, "int4_linear", lambda *args, **kwargs: calls.append(1) or int4_linear(*args, **kwargs))
    for shape in [(1, 1, 128), (4, 1, 128), (8, 128)]:  # one token, four sequences' tokens, eight rows: fused
        x = torch.randn(shape)
        fused = layer(x)
        layer.fused = False
        torch.testing.assert_close(fused, layer(x), rtol=1e-5, atol=1e-5)
        layer.fused = True
    assert len(calls) == 3
    layer(torch.randn(9, 128))  # a prefill's rows: dequantized in PyTorch
    assert len(calls) == 3
    transposed = nn.Linear(128, 40, bias=False)
    transposed.weight = nn.Parameter(torch.randn(128, 40).T)  # a checkpoint's layout may be a transpose
    QuantLinear.from_linear(transposed, scheme)(torch.randn(1, 128))
    assert len(calls) == 4


def test_greedy_generation_is_the_same_through_either_path(small, monkeypatch):
    from labkit import quant
    calls = []
    monkeypatch.setattr(quant, "int4_linear", lambda *args, **kwargs: calls.append(1) or int4_linear(*args, **kwargs))
    quantized = quantize_model(small, Scheme(4, 32), head=True)
    params = SamplingParams(max_new_tokens=8, stop_at_eos=False)
    fused = [list(stream(quantized, p, params)) for p in ([5, 9, 2, 7], [3, 3, 8])]
    assert len(calls) >= 2 * 7 * 9  # every projection and the head, at each of the 7 decode steps of each prompt
    assert use_fused(quantized, False) is quantized and not quantized.blocks[0].mlp.down.fused
    assert [list(stream(quantized, p, params)) for p in ([5, 9, 2, 7], [3, 3, 8])] == fused


def test_a_quantized_layer_traces_whole_under_torch_compile():
    """Dynamo cannot trace the fused kernel's checks: compiled, a layer dequantizes in PyTorch (which Inductor
    fuses into the matmul itself), with no graph break."""
    layer = QuantLinear.from_linear(nn.Linear(64, 24, bias=False), Scheme(4, 32))
    x = torch.randn(1, 64)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)


def test_hooked_removes_its_hooks_even_when_the_run_raises():
    from labkit.quant import hooked
    layer = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="boom"):
        with hooked([layer.register_forward_hook(lambda *args: None)]):
            raise RuntimeError("boom")
    assert not layer._forward_hooks


def dequantized_copy(model: Transformer) -> Transformer:
    """A plain model holding the quantized model's weights, dequantized: the reference for its outputs."""
    plain = Transformer(model.config)
    names = plain.state_dict().keys()
    state = {name: t for name, t in model.state_dict().items() if name in names}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, QuantLinear) and not name.startswith("embed."):
            state[f"{name}.weight"] = module.dequantized_weight()
    if isinstance(model.embed, QuantEmbedding):
        state["embed.weight"] = state["lm_head.weight"]
    plain.load_state_dict(state)
    return plain.eval()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def small(request):
    torch.manual_seed(3)
    config = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=128,
                         tie_embeddings=request.param)
    model = Transformer(config)
    model.reset_parameters(std=0.3)  # far-apart logits: clear-cut greedy choices
    return model.eval()


@pytest.mark.parametrize("head", [False, True])
def test_a_quantized_model_computes_what_its_dequantized_weights_do(small, head):
    quantized = quantize_model(small, Scheme(4, 32), head=head)
    assert all(isinstance(m, nn.Linear) for m in small.modules() if "Linear" in type(m).__name__)  # untouched
    kinds = [type(quantized.blocks[0].attn.wqkv), type(quantized.lm_head)]
    assert kinds == [QuantLinear, QuantLinear if head else nn.Linear]
    if head and small.config.tie_embeddings:
        assert isinstance(quantized.embed, QuantEmbedding) and quantized.embed.table is quantized.lm_head
    tokens = torch.randint(0, small.config.vocab_size, (2, 12))
    torch.testing.assert_close(quantized(tokens), dequantized_copy(quantized)(tokens), rtol=1e-5, atol=1e-5)


def test_output_errors_refuses_models_passed_the_wrong_way_round(small):
    quantized = quantize_model(small, Scheme(4, 32))
    tokens = torch.randint(0, small.config.vocab_size, (1, 8))
    assert set(output_errors(small, quantized, tokens)) == {
        f"blocks.{i}.{name}" for i in range(2) for name in ("attn.wqkv", "attn.wo", "mlp.gate_up", "mlp.down")}
    with pytest.raises(ValueError, match=r"quantized holds no QuantLinear layers: output_errors takes the "
                                         r"full-precision model first.*model holds 8: are the two swapped"):
        output_errors(quantized, small, tokens)
    with pytest.raises(ValueError, match=r"no layer is a Linear in model and a QuantLinear in quantized"):
        output_errors(quantized, quantized, tokens)


def test_weight_bytes_count_codes_scales_zeros_and_the_rest_at_fp16(small):
    quantized = quantize_model(small, Scheme(4, 32))
    linears = [m for b in small.blocks for m in (b.attn.wqkv, b.attn.wo, b.mlp.gate_up, b.mlp.down)]
    n_linear = sum(m.weight.numel() for m in linears)
    expected = 2 * (small.num_parameters() - n_linear) + n_linear * Scheme(4, 32).bits_per_weight(64) / 8
    assert weight_bytes(quantized) == expected
    assert weight_bytes(small) == 2 * small.num_parameters()


def test_a_quantized_model_works_with_the_contiguous_cache_the_paged_cache_and_the_engine(small):
    quantized = quantize_model(small, Scheme(4, 32), head=True)
    prompts = [[5, 9, 2, 7], [3, 3, 8], [11, 4, 6, 1, 2]]
    params = SamplingParams(max_new_tokens=6, stop_at_eos=False)
    expected = [list(stream(quantized, p, params, use_cache=False)) for p in prompts]
    assert [list(stream(quantized, p, params)) for p in prompts] == expected
    cache, tokens = ContiguousKVCache(quantized.config, 1, 16), torch.tensor([prompts[0]])
    with torch.no_grad():
        torch.testing.assert_close(quantized(tokens, plan=cache.plan(torch.arange(4)[None])), quantized(tokens))
    engine = Engine(quantized, num_blocks=16, block_size=4)
    served = engine.run([Request(str(i), p, params) for i, p in enumerate(prompts)])
    assert [r.output for r in sorted(served, key=lambda r: r.request_id)] == expected


def gptq_reference(w: torch.Tensor, h: torch.Tensor, scheme: Scheme, damp: float = 0.01) -> torch.Tensor:
    """GPTQ the plain way, in float64: one column at a time, each error applied to every later column
    through the inverse Hessian's rows, Hinv updated by elimination after each column."""
    w, h = w.double().clone(), h.double().clone()
    n = w.shape[1]
    size = scheme.group_size or n
    h += damp * h.diagonal().mean() * torch.eye(n, dtype=h.dtype)
    hinv = torch.linalg.inv(h)
    codes = torch.empty(w.shape, dtype=torch.uint8)
    for i in range(n):
        if i % size == 0:
            group_codes, group_scales, group_zeros = quantize(w[:, i:i + size].float(), Scheme(scheme.bits, None,
                                                                                              scheme.symmetric))
            scale, zero = group_scales.double(), group_zeros.double()
        code = (torch.round(w[:, i:i + 1] / scale) + zero).clamp(0, 2 ** scheme.bits - 1)
        codes[:, i] = code[:, 0].to(torch.uint8)
        err = (w[:, i:i + 1] - (code - zero) * scale) / hinv[i, i]
        w[:, i:] -= err * hinv[i:i + 1, i:]
        hinv[i:, i:] -= hinv[i:, i:i + 1] @ hinv[i:i + 1, i:] / hinv[i, i]  # drop column i from the problem
    return codes


def correlated_inputs(n: int, dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=generator) / math.sqrt(dim)
    return torch.randn(n, dim, generator=generator) @ mix + 0.3 * torch.randn(n, dim, generator=generator)


@pytest.mark.parametrize("scheme", [Scheme(4, 16), Scheme(3, 32, True), Scheme(4, None)])
def test_gptq_matches_the_plain_column_by_column_algorithm(scheme):
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    h = hessian(correlated_inputs(512, 64, 2))
    codes, scales, zeros = gptq(w, h, scheme, block=32)
    expected = gptq_reference(w, h, scheme)
    # float32 against float64: a code may land on the other side of a rounding boundary, rarely
    assert (codes != expected).float().mean() < 0.01
    assert scales.dtype == zeros.dtype == torch.float16 and scales.shape == (24, 64 // (scheme.group_size or 64))


def test_gptq_has_a_smaller_output_error_than_rounding():
    x = correlated_inputs(2048, 128, 4)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    scheme = Scheme(4, 32)
    rtn = dequantize(*quantize(w, scheme))
    optimal = dequantize(*gptq(w, hessian(x), scheme))
    error = lambda w_hat: (x @ (w - w_hat).T).norm().item()
    assert error(optimal) < 0.8 * error(rtn)
    # ... while each weight moves further from its own value than rounding would put it
    assert (w - optimal).norm() > (w - rtn).norm()


def test_gptq_model_needs_calibration_and_lowers_the_layer_error(small):
    with pytest.raises(ValueError, match="calibration"):
        quantize_model(small, method="gptq")
    with pytest.raises(ValueError, match="method='smoothquant'"):
        quantize_model(small, method="smoothquant")
    calibration = torch.randint(0, small.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    quantized = quantize_model(small, Scheme(4, 32), "gptq", calibration, head=True)
    assert all(isinstance(b.mlp.down, QuantLinear) for b in quantized.blocks)
    assert isinstance(quantized.lm_head, QuantLinear)
    torch.testing.assert_close(quantized(calibration[:1]), dequantized_copy(quantized)(calibration[:1]),
                               rtol=1e-5, atol=1e-5)


def test_embedding_rows_are_dequantized_from_the_shared_table():
    table = QuantLinear.from_linear(nn.Linear(32, 10, bias=False), Scheme(4, 16))
    tokens = torch.tensor([[3, 0, 9], [3, 3, 1]])
    assert torch.equal(QuantEmbedding(table)(tokens), F.embedding(tokens, table.dequantized_weight()))
