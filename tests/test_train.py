"""Training is seeded and reproducible, and writes everything a checkpoint needs."""
from __future__ import annotations

import math

import pytest

from labkit.load import load_checkpoint
from labkit.train import PRESETS, Preset, learning_rate, main


def test_same_seed_same_weights_and_a_complete_checkpoint(tmp_path):
    runs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for out, seed in zip(runs, (0, 0, 1)):
        assert main(["--preset", "draft", "--tokens", "4096", "--seed", str(seed), "--out", str(out)]) == 0
    weights = [(out / "model.safetensors").read_bytes() for out in runs]
    assert weights[0] == weights[1] and weights[0] != weights[2]
    assert {p.name for p in runs[0].iterdir()} == {"model.safetensors", "config.json", "loss.png", "MODEL_CARD.md"}
    assert "| tokens seen | 4,096 (2 steps of 4 x 512) |" in (runs[0] / "MODEL_CARD.md").read_text()
    assert load_checkpoint(runs[0], device="cpu").num_parameters() == 721_280


def test_a_budget_under_one_batch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tokens=100 is less than one batch of 4 x 512"):
        main(["--preset", "draft", "--tokens", "100", "--out", str(tmp_path)])


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    preset = Preset(PRESETS["draft"].config, tokens=0, lr=1.0, warmup_steps=10)
    assert learning_rate(0, 100, preset) == pytest.approx(0.1)
    assert learning_rate(9, 100, preset) == pytest.approx(1.0)
    assert learning_rate(10, 100, preset) == pytest.approx(1.0)
    assert learning_rate(55, 100, preset) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(100, 100, preset) == pytest.approx(0.1)
