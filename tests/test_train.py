"""Training is seeded and reproducible, and writes everything a checkpoint needs."""
from __future__ import annotations

import math

import pytest
import torch

from labkit import train
from labkit.load import load_checkpoint
from labkit.train import PRESETS, Preset, learning_rate, main


def test_same_seed_same_weights_and_a_complete_checkpoint(tmp_path, monkeypatch):
    # The closing validation over 256 windows took most of each run; 8 windows still run the
    # same code (validation_loss itself is checked below), and the weights never depend on it.
    validation_loss = train.validation_loss
    monkeypatch.setattr(train, "validation_loss",
                        lambda model, ids, seq_len=256, max_windows=64: validation_loss(model, ids, seq_len,
                                                                                         min(max_windows, 8)))
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


def test_window_losses_spread_over_the_ids_and_keep_the_mode():
    import torch.nn.functional as F

    from labkit.exercises.lab01 import random_model
    from labkit.train import validation_loss, window_losses

    model = random_model(4, 2, seed=0).train()
    ids = torch.randint(0, 97, (5000,), generator=torch.Generator().manual_seed(0))
    losses = window_losses(model, ids, seq_len=64, max_windows=10, batch_size=4)
    assert model.training and losses.shape == (10,)
    stride = (len(ids) - 1 - 64) // 9  # first window at 0, last ending at the end of the ids
    with torch.no_grad():
        expected = [F.cross_entropy(model.eval()(ids[s:s + 64][None])[0], ids[s + 1:s + 65]).item()
                    for s in range(0, 10 * stride, stride)]
    torch.testing.assert_close(losses, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert validation_loss(model.train(), ids, 64, 10) == pytest.approx(sum(expected) / 10, rel=1e-5)
