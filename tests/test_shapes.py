"""Published shapes with random weights: each shape has its model's published parameter count
(counted on the meta device, nothing allocated), a built model runs, and a model that does not
fit the device is refused before anything is allocated."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from labkit import shapes
from labkit.load import load
from labkit.model import ModelConfig, RMSNorm, Transformer
from labkit.presets import MODEL_PRESETS
from labkit.shapes import SHAPES, build_shape, shape_config

# Parameter counts of the published checkpoints (their safetensors' totals); Qwen2.5-7B's
# includes the q/k/v biases the shape leaves out.
PUBLISHED = {"Llama-3.2-1B": 1_235_814_400, "Llama-3.2-3B": 3_212_749_824, "Llama-3.1-8B": 8_030_261_248,
             "Llama-2-7B": 6_738_415_616, "Mistral-7B": 7_241_732_096, "Qwen2.5-7B": 7_615_616_512}
TINY = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=32,
                   rope_theta=500000.0, rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 16})


def _meta_parameters(name: str) -> int:
    with torch.device("meta"):
        return Transformer(shape_config(name)).num_parameters()


@pytest.mark.parametrize("name", list(SHAPES))
def test_parameter_count_is_the_published_one(name):
    n_params = _meta_parameters(name)
    assert n_params == pytest.approx(PUBLISHED[name], rel=0.03)
    if name in MODEL_PRESETS:
        assert n_params == pytest.approx(MODEL_PRESETS[name].n_params, rel=0.03)


def test_shapes_agree_with_the_memory_presets():
    both = SHAPES.keys() & MODEL_PRESETS.keys()
    assert {"Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B"} <= both
    for name in both:
        config, preset = SHAPES[name], MODEL_PRESETS[name]
        assert (config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim, config.max_seq_len) == (
            preset.n_layers, preset.n_heads, preset.n_kv_heads, preset.head_dim, preset.max_context), name


def test_context_is_capped_unless_asked():
    assert shape_config("Llama-3.1-8B").max_seq_len == shapes.DEFAULT_MAX_SEQ_LEN
    assert shape_config("Llama-2-7B").max_seq_len == 4096  # shorter than the cap: its own
    assert shape_config("Llama-3.1-8B", max_seq_len=32768).max_seq_len == 32768
    with pytest.raises(ValueError, match="past Llama-2-7B's context of 4096"):
        shape_config("Llama-2-7B", max_seq_len=8192)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_built_model_runs(tied, dtype):
    config = replace(TINY, tie_embeddings=tied)
    model = build_shape(config, "cpu", dtype)
    assert model.device == torch.device("cpu") and model.dtype == dtype and not model.training
    assert all(p.device.type == "cpu" and p.dtype == dtype for p in model.parameters())
    assert (model.lm_head.weight is model.embed.weight) == tied
    assert not model.rope.is_meta and model.rope.dtype == torch.float32
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in model.modules() if isinstance(m, RMSNorm))
    assert model.embed.weight.float().std().item() == pytest.approx(0.02, rel=0.1)
    with torch.no_grad():
        logits = model(torch.randint(0, TINY.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, TINY.vocab_size) and logits.dtype == dtype and logits.isfinite().all()


def test_a_model_that_does_not_fit_is_refused(monkeypatch):
    monkeypatch.setattr(shapes, "free_bytes", lambda device: 1_000_000_000)
    # 1.236e9 parameters x 2 bytes; working: KV cache 2 x 16 x 8 x 64 x 8192 x 2 bytes + a tenth of the weights
    with pytest.raises(ValueError, match=r"Llama-3.2-1B in bf16 needs 2\.5 GB of weights \+ 0\.5 GB .* 1\.0 GB free"):
        load("shape:Llama-3.2-1B", device="cpu", dtype=torch.bfloat16)


def test_unknown_shape_lists_the_choices():
    with pytest.raises(KeyError, match="Llama-3.1-8B.*Qwen2.5-7B"):
        load("shape:Llama-9B", device="cpu")


def test_unsupported_dtype_is_refused():
    with pytest.raises(ValueError, match="torch.bfloat16"):
        build_shape(TINY, "cpu", torch.float64)


def test_free_memory_is_read_from_meminfo_in_bytes(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4096 kB\nMemFree:         512 kB\nMemAvailable:   2048 kB\n")
    monkeypatch.setattr(shapes, "Path", lambda path: meminfo if path == "/proc/meminfo" else Path(path))
    assert shapes.free_bytes(torch.device("cpu")) == 2048 * 1024  # MemAvailable, not MemFree; kB are KiB
    assert shapes.free_bytes(torch.device("meta")) is None


def test_timing_demos_keep_the_lab_models_on_a_cpu_and_obey_the_override(monkeypatch):
    model = Transformer(ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                                    max_seq_len=16))
    monkeypatch.delenv("LABKIT_TIMING_SHAPE", raising=False)
    assert shapes.timing_shape("cpu") is None and shapes.timing_model(model) == (model, "the lab's own model")
    monkeypatch.setenv("LABKIT_TIMING_SHAPE", "none")
    assert shapes.timing_shape("cuda") is None
    monkeypatch.setenv("LABKIT_TIMING_SHAPE", "Llama-3.2-1B")
    assert shapes.timing_shape("cpu") == "Llama-3.2-1B"
    monkeypatch.setenv("LABKIT_TIMING_SHAPE", "Llama-9")
    with pytest.raises(KeyError, match="no model shape 'Llama-9'"):
        shapes.timing_shape("cpu")


def test_on_a_gpu_the_timing_shape_is_the_largest_that_leaves_room(monkeypatch):
    monkeypatch.delenv("LABKIT_TIMING_SHAPE", raising=False)
    for free_gb, expected in ((80, "Llama-3.1-8B"), (24, "Llama-3.2-3B"), (8, "Llama-3.2-1B"), (4, None)):
        monkeypatch.setattr(shapes, "free_bytes", lambda device, free=free_gb: free * 1e9)
        assert shapes.timing_shape("cuda") == expected, free_gb


def test_projection_shapes_are_the_blocks_weights():
    from labkit.shapes import projection_shapes
    config = ModelConfig(vocab_size=64, d_model=48, n_layers=1, n_heads=6, n_kv_heads=2, d_ff=80, max_seq_len=32)
    block = Transformer(config).blocks[0]
    assert projection_shapes(config) == [(kind, *block.get_submodule(kind).weight.shape)
                                         for kind in ("attn.wqkv", "attn.wo", "mlp.gate_up", "mlp.down")]
