"""Hugging Face round trip: a random LlamaForCausalLM saved to disk loads into labkit with the
same logits. transformers is the independent reference for the whole forward pass."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from labkit.load import TOKENIZER, config_from_hf, load, load_config, load_tokenizer
from labkit.shapes import shape_config

BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _save_hf(folder, shard: bool = False, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**{**BASE, **overrides})
    hf = LlamaForCausalLM(config).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.1)
    hf.save_pretrained(folder, max_shard_size="40KB" if shard else "10GB")
    return hf


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(num_key_value_heads=8),
    dict(num_key_value_heads=1, tie_word_embeddings=True),
    dict(rope_parameters=LLAMA3_ROPE),
], ids=["gqa", "mha", "mqa-tied", "llama3-rope"])
def test_logits_match_transformers(tmp_path, overrides):
    hf = _save_hf(tmp_path, **overrides)
    model, tokenizer = load(str(tmp_path), device="cpu")
    assert tokenizer is None  # no tokenizer.json was saved
    tokens = torch.randint(0, 101, (2, 40))
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(model(tokens), expected, rtol=1e-4, atol=1e-4)


def test_sharded_checkpoints_load(tmp_path):
    hf = _save_hf(tmp_path, shard=True)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = load(str(tmp_path), device="cpu")
    tokens = torch.randint(0, 101, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gpt2"), "model_type='gpt2' is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn' is not supported"),
])
def test_unsupported_checkpoints_get_a_clear_error(change, message):
    hf = {**LlamaConfig(**BASE).to_dict(), **change}
    hf.pop("rope_parameters")  # the older config.json style: rope_theta and rope_scaling
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)


def test_older_config_style_reads_llama3_rope_scaling():
    hf = LlamaConfig(**BASE).to_dict()
    hf.pop("rope_parameters")
    llama3 = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    config = config_from_hf({**hf, "rope_theta": 500000.0, "rope_scaling": llama3})
    assert config.rope_theta == 500000.0 and config.rope_scaling["factor"] == 8.0


def test_a_folder_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig(**BASE).to_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="never loads pickled"):
        load(str(tmp_path), device="cpu")


def test_unknown_names_list_the_shipped_checkpoints():
    with pytest.raises(FileNotFoundError, match="no checkpoint 'nonesuch'.*shipped checkpoints"):
        load("nonesuch")


def test_labkit_model_selects_a_folder_with_its_tokenizer(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    from labkit.load import TOKENIZER, save_hf

    hf_dir = tmp_path / "my-llama"
    _save_hf(hf_dir)
    model, _ = load(str(hf_dir), device="cpu")
    save_hf(model, hf_dir, Tokenizer.from_file(str(TOKENIZER)))
    monkeypatch.setenv("LABKIT_MODEL", str(hf_dir))
    again, tokenizer = load(device="cpu")
    assert tokenizer is not None and tokenizer.get_vocab_size() == 4096
    tokens = torch.randint(0, 101, (1, 8))
    torch.testing.assert_close(again(tokens), model(tokens))


def test_a_local_folder_named_like_a_checkpoint_does_not_shadow_it(tmp_path, monkeypatch):
    (tmp_path / "draft").mkdir()
    monkeypatch.chdir(tmp_path)
    model, _ = load("draft", device="cpu")
    assert model.config.n_layers == 1


def test_greedy_generation_matches_transformers_token_for_token(tmp_path):
    from labkit.generate import SamplingParams, stream

    hf = _save_hf(tmp_path)
    model, _ = load(str(tmp_path), device="cpu")
    prompt = [3, 14, 15, 92, 65]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert list(stream(model, prompt, SamplingParams(max_new_tokens=30))) == expected


@pytest.mark.parametrize("tied", [False, True])
def test_a_labkit_model_saved_as_hugging_face_loads_in_transformers(tmp_path, tied):
    from labkit.load import save_hf
    from labkit.model import ModelConfig, Transformer

    torch.manual_seed(1)
    model = Transformer(ModelConfig(vocab_size=60, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    d_ff=48, max_seq_len=64, tie_embeddings=tied)).eval()
    save_hf(model, str(tmp_path))  # a path as a string will do
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 60, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)


def test_weights_of_layers_the_config_lacks_are_refused(tmp_path):
    """A config that lists fewer layers than the weights would silently make another model."""
    from labkit.load import load_checkpoint, save_checkpoint
    from labkit.model import ModelConfig, Transformer

    save_checkpoint(Transformer(ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32,
                                            max_seq_len=16)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layers": 1}))
    with pytest.raises(ValueError, match=r"no place for, e.g. \['blocks.1."):
        load_checkpoint(tmp_path, device=torch.device("cpu"))


def test_labkit_checkpoints_round_trip_from_a_path_given_as_a_string(tmp_path):
    from labkit.load import TOKENIZER, load_checkpoint, save_checkpoint
    from labkit.model import ModelConfig, Transformer
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(TOKENIZER)).get_vocab_size()
    model = Transformer(ModelConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                                    max_seq_len=16)).eval()
    save_checkpoint(model, str(tmp_path / "ckpt"), dtype=torch.float32)
    loaded = load_checkpoint(str(tmp_path / "ckpt"), device=torch.device("cpu"))
    by_name, tokenizer = load(str(tmp_path / "ckpt"), device="cpu")  # as LABKIT_MODEL would name it
    assert tokenizer.get_vocab_size() == vocab
    tokens = torch.randint(0, vocab, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens))
        torch.testing.assert_close(by_name(tokens), model(tokens))
    save_checkpoint(Transformer(ModelConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                                            max_seq_len=16)), tmp_path / "other")
    with pytest.raises(ValueError, match=f"vocabulary of 40 tokens.*tokenizer.*has {vocab}"):
        load(str(tmp_path / "other"), device="cpu")
    config = json.loads((tmp_path / "other/config.json").read_text())  # a Hugging Face config lacking model_type
    (tmp_path / "other/config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="model_type=None is not supported"):
        load(str(tmp_path / "other"), device="cpu")


def test_load_config_and_load_tokenizer_read_what_load_would_build_without_its_weights(tmp_path):
    """Shipped, Hugging Face and ``shape:`` names alike (the parallel labs check a layout with the config
    before any process starts; the server reads both while its engine's process loads the weights)."""
    _save_hf(tmp_path / "bare", num_key_value_heads=2)
    _save_hf(tmp_path / "with", num_key_value_heads=2)
    shutil.copy(TOKENIZER, tmp_path / "with" / "tokenizer.json")
    for name in ("target", "mqa", str(tmp_path / "bare"), str(tmp_path / "with")):
        model, tokenizer = load(name, device="cpu")
        assert load_config(name) == model.config
        own = load_tokenizer(name)
        assert (own is tokenizer is None) == name.endswith("bare") and (own is None or own.to_str() == tokenizer.to_str())
    assert load_tokenizer("shape:Llama-3.2-1B") is None
    assert load_config("shape:Llama-3.2-1B") == shape_config("Llama-3.2-1B")  # what load builds it from
    with pytest.raises(FileNotFoundError, match="no checkpoint 'nowhere'"):
        load_config("nowhere")
