"""The shipped checkpoints: all five there, within 50 MB, with cards, and the target writes Python."""
from __future__ import annotations

import json
import re

import pytest

import labkit
from labkit.engine import Engine, Request
from labkit.generate import SamplingParams, eos_id_of
from labkit.load import CHECKPOINTS

PRESETS = ("target", "draft", "mha", "gqa", "mqa")


def _config(name: str) -> dict:
    return json.loads((CHECKPOINTS / name / "config.json").read_text())


@pytest.mark.parametrize("name", PRESETS)
def test_each_checkpoint_ships_weights_config_card_and_curve(name):
    folder = CHECKPOINTS / name
    for file in ("model.safetensors", "config.json", "MODEL_CARD.md", "loss.png"):
        assert (folder / file).is_file(), f"{folder / file} is missing"
    card = (folder / "MODEL_CARD.md").read_text()
    for field in ("parameters", "tokens seen", "wall time", "machine", "validation loss", "validation perplexity"):
        assert f"| {field} |" in card
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.pt")), "weights are safetensors only"


def test_all_checkpoints_together_fit_in_50_mb():
    total = sum(p.stat().st_size for p in CHECKPOINTS.rglob("*") if p.is_file())
    assert total <= 50e6, f"checkpoints take {total / 1e6:.1f} MB"


def test_the_memory_lab_trio_differs_only_in_kv_heads():
    configs = {name: _config(name) for name in ("mha", "gqa", "mqa")}
    assert [c.pop("n_kv_heads") for c in configs.values()] == [8, 2, 1]
    assert configs["mha"] == configs["gqa"] == configs["mqa"]
    seen = {re.search(r"\| tokens seen \| ([\d,]+)", (CHECKPOINTS / n / "MODEL_CARD.md").read_text()).group(1)
            for n in configs}
    assert len(seen) == 1, "trained on different token budgets"


def test_target_and_draft_share_the_tokenizer_and_sizes_are_as_promised():
    target, draft = _config("target"), _config("draft")
    assert target["vocab_size"] == draft["vocab_size"] == 4096
    assert (target["n_heads"], target["n_kv_heads"]) == (8, 2)
    model, tokenizer = labkit.load("target", device="cpu")
    assert 12e6 <= model.num_parameters() <= 18e6
    assert tokenizer.get_vocab_size() == target["vocab_size"]


# openings of methods, as a student would prompt the model; greedy, so the test is deterministic
_CLASS_OPENINGS = ("class Config:\n    def __init__(self, path):\n",
                   "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
                   "class Reader:\n    def read(self, size=-1):\n",
                   "class Server:\n    def __init__(self, host, port):\n",
                   "class Cache(dict):\n    def get(self, key, default=None):\n",
                   "class Parser:\n    def parse(self, text):\n",
                   "class Node:\n    def __init__(self, value, children=()):\n",
                   "class Timer:\n    def start(self):\n")


def test_target_writes_python_looking_code():
    """Over eight method openings: indentation in steps of four everywhere, and most continuations
    define functions that return, on attributes of self (one prompt alone may fall into a loop)."""
    model, tokenizer = labkit.load("target", device="cpu")
    # in one batch: the engine gives each request the tokens generate() would (tests/test_engine.py)
    requests = [Request(i, tokenizer.encode(p).ids, SamplingParams(max_new_tokens=160))
                for i, p in enumerate(_CLASS_OPENINGS)]
    Engine(model, num_blocks=128, eos_id=eos_id_of(tokenizer)).run(requests)
    texts = [tokenizer.decode(r.output) for r in requests]
    shown = "\n-----\n".join(texts)
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    assert len(lines) >= 4 * len(texts), f"too little code:\n{shown}"
    assert all((len(line) - len(line.lstrip(" "))) % 4 == 0 for line in lines), f"odd indentation:\n{shown}"
    assert sum(bool(re.search(r"\bdef \w+\(", t)) for t in texts) >= 6, f"few defs:\n{shown}"
    assert sum(bool(re.search(r"\breturn\b", t)) for t in texts) >= 6, f"few returns:\n{shown}"
    assert sum(bool(re.search(r"\bself\.\w+", t)) for t in texts) >= 4, f"little attribute access:\n{shown}"
