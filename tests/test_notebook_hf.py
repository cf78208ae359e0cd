"""The model-serving notebooks run on a user's own Hugging Face model: LABKIT_MODEL points at a
local Llama checkpoint (here a small random one, saved by transformers, with the lab's tokenizer)
and the solutions notebook runs top to bottom, checks strict."""
from __future__ import annotations

import shutil

import nbformat
import pytest
import torch
from nbclient import NotebookClient
from transformers import LlamaConfig, LlamaForCausalLM

from labkit.load import TOKENIZER


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1100)
    LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    return folder


@pytest.mark.parametrize("name", ["01_kv_cache.ipynb"])
def test_notebook_runs_on_a_hugging_face_model(root, tmp_path, monkeypatch, hf_folder, name):
    shutil.copy(root / "solutions" / name, tmp_path / name)  # the grade cell reads it from the cwd
    monkeypatch.setenv("LABKIT_MODEL", str(hf_folder))
    monkeypatch.setenv("LABKIT_STRICT", "1")
    nb = nbformat.read(tmp_path / name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="labkit", resources={"metadata": {"path": str(tmp_path)}}).execute()
    shown = "".join(output.get("text", "") for cell in nb.cells for output in cell.get("outputs", []))
    assert "2 layers, d_model 64, 4 query heads, 2 KV heads, context 1100" in shown  # the user's model, not target
