"""The model-serving notebooks run on a user's own Hugging Face model: LABKIT_MODEL points at a
local Llama checkpoint (here a small random one, saved by transformers, with the lab's tokenizer)
and the solutions notebook runs top to bottom, checks strict; the speculative notebook takes its draft
from LABKIT_DRAFT_MODEL, a second such model."""
from __future__ import annotations

import shutil

import nbformat
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from labkit import execute
from labkit.load import TOKENIZER


def _tiny_llama(folder, layers: int, hidden: int):
    torch.manual_seed(layers)
    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1100)
    LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama"), layers=2, hidden=64)


@pytest.fixture(scope="module")
def hf_draft_folder(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama-draft"), layers=1, hidden=32)


@pytest.mark.parametrize("name, expected", [
    ("01_kv_cache.ipynb", ["2 layers, d_model 64, 4 query heads, 2 KV heads, context 1100"]),
    ("05_speculative_decoding.ipynb", ["2 layers, d_model 64, 4 query heads, 2 KV heads, context 1100",
                                       "1 layers, d_model 32, 4 query heads, 2 KV heads, context 1100"]),
])
def test_notebook_runs_on_a_hugging_face_model(root, tmp_path, monkeypatch, hf_folder, hf_draft_folder, name,
                                               expected):
    shutil.copy(root / "solutions" / name, tmp_path / name)  # the grade cell reads it from the cwd
    monkeypatch.setenv("LABKIT_MODEL", str(hf_folder))
    monkeypatch.setenv("LABKIT_DRAFT_MODEL", str(hf_draft_folder))
    monkeypatch.setenv("LABKIT_STRICT", "1")
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)  # pytest run from a notebook: the grade cell grades the copy
    nb = nbformat.read(tmp_path / name, as_version=4)
    execute.run(nb, tmp_path, timeout_s=300, kernel_name="labkit")
    shown = execute.printed(nb)
    for text in expected:  # the user's models, not the shipped ones
        assert text in shown
