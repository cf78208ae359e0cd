"""Residual heads on the target's stream: an untrained head is the model's own prediction, labels
and accuracies against Python-loop references, training reproducible bit for bit and useful,
checkpoints round-trip and refuse another target, the shipped ones load and match their cards,
and bad arguments are refused by name."""
from __future__ import annotations

import re

import pytest
import torch

import labkit
from labkit import heads as H
from labkit.heads import (IGNORE, ResidualHeads, continuation_labels, examples, head_accuracy, head_logits, head_loss,
                          load_exit_adapters, load_heads, load_medusa, save_heads, streams_at,
                          train_heads, weights_sha256)
from labkit.train import continuation_batches

from tiny_models import far_apart_model, one_torch_thread

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)
VOCAB = 64


def random_continuations(seed: int, rows: int = 6) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and 'continuations' of random lengths (1 token upwards: a head may have no label)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [(int(torch.randint(1, 8, (), generator=g)), int(torch.randint(1, 12, (), generator=g)))
               for _ in range(rows)]
    return ([torch.randint(0, VOCAB, (p,), generator=g).tolist() for p, _ in lengths],
            [torch.randint(0, VOCAB, (c,), generator=g).tolist() for _, c in lengths])


def tiny_examples(offsets=(1, 2, 3), seed: int = 0, model=None):
    model = model or far_apart_model(VOCAB)
    prompts, outputs = random_continuations(seed, rows=24)
    return model, examples(model, continuation_batches(prompts, outputs, 5), [model.config.n_layers], offsets)


def trained_heads(model, n: int, seed: int = 0) -> ResidualHeads:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        heads = ResidualHeads(model.config.d_model, n).to(model.dtype)
        torch.nn.init.normal_(heads.weight, std=0.3)
        torch.nn.init.normal_(heads.bias, std=0.3)
    return heads


def test_an_untrained_head_is_the_models_own_prediction():
    model = far_apart_model(VOCAB)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    stream = streams_at(model, ids, [model.config.n_layers])[model.config.n_layers]
    torch.testing.assert_close(model.head(stream), model(ids))
    logits = head_logits(model, ResidualHeads(model.config.d_model, 3).double(), stream)
    assert logits.shape == (3, 2, 9, VOCAB)
    for head in logits:  # equal but for float64 rounding: a batch of 3 heads may take another matmul kernel
        torch.testing.assert_close(head, model.head(stream), rtol=1e-13, atol=1e-13)


def test_streams_at_several_layers_in_one_pass_equal_each_alone():
    model = far_apart_model(VOCAB)
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(1))
    both = streams_at(model, ids, [2, 1])
    for layer in (1, 2):
        assert torch.equal(both[layer], streams_at(model, ids, [layer])[layer])
    assert not torch.equal(both[1], both[2])


def test_heads_run_as_one_batched_matmul_of_each_heads_block():
    heads = trained_heads(far_apart_model(VOCAB), 3)
    x = torch.randn(2, 5, heads.d_model, dtype=torch.float64)
    out = heads(x)
    for i in range(3):
        torch.testing.assert_close(out[i], x + torch.nn.functional.silu(x @ heads.weight[i] + heads.bias[i]))
    assert heads(x[0, 0]).shape == (3, heads.d_model)  # one token, as a decode round runs them


def test_labels_against_a_loop_over_prompts_and_continuations():
    prompts, outputs = random_continuations(3)
    offsets = (0, 1, 4)
    [(tokens, mask)] = continuation_batches(prompts, outputs, len(prompts))
    labels = continuation_labels(tokens, mask, offsets)
    expected = torch.full_like(labels, IGNORE)
    for row, (prompt, output) in enumerate(zip(prompts, outputs)):
        text = prompt + output
        for p in range(len(prompt) - 1, len(text) - 1):  # p's next token is a continuation token
            for i, o in enumerate(offsets):
                if p + 1 + o < len(text):
                    expected[i, row, p] = text[p + 1 + o]
    assert torch.equal(labels, expected)


def test_examples_keep_the_continuation_positions_streams_and_labels():
    prompts, outputs = random_continuations(4)
    model = far_apart_model(VOCAB)
    batches = continuation_batches(prompts, outputs, 4)
    data = examples(model, batches, [1, 2], (0, 2))
    streams, labels = {1: [], 2: []}, []
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt + output])
        for layer in (1, 2):
            streams[layer].append(streams_at(model, ids, [layer])[layer][0, len(prompt) - 1:-1])
        [(tokens, mask)] = continuation_batches([prompt], [output], 1)
        labels.append(continuation_labels(tokens, mask, (0, 2))[:, 0, len(prompt) - 1:-1])
    for layer in (1, 2):
        torch.testing.assert_close(data.streams[layer], torch.cat(streams[layer]))
    assert torch.equal(data.labels, torch.cat(labels, dim=1)) and data.offsets == (0, 2)


def test_accuracy_against_a_loop():
    model, data = tiny_examples()
    heads = trained_heads(model, 3)
    stream, labels = data.streams[2], data.labels
    found = head_accuracy(model, heads, stream, labels, topk=(1, 3), batch_size=7)
    for i in range(3):
        for k in (1, 3):
            hits = total = 0
            for p in range(len(stream)):
                if labels[i, p] != IGNORE:
                    logits = model.head(stream[p] + torch.nn.functional.silu(stream[p] @ heads.weight[i] + heads.bias[i]))
                    hits += int(labels[i, p]) in logits.topk(k).indices.tolist()
                    total += 1
            assert found[k][i] == pytest.approx(hits / total)


def test_loss_averages_each_heads_cross_entropy_over_its_labelled_positions():
    model, data = tiny_examples()
    heads = trained_heads(model, 3)
    logits = head_logits(model, heads, data.streams[2])
    expected = sum(torch.nn.functional.cross_entropy(logits[i], data.labels[i], ignore_index=IGNORE)
                   for i in range(3)) / 3
    torch.testing.assert_close(head_loss(model, heads, data.streams[2], data.labels), expected.float())


def test_training_is_reproducible_bit_for_bit_and_lowers_the_loss():
    model, data = tiny_examples()
    runs = []
    for seed in (0, 0, 1):
        heads = ResidualHeads(model.config.d_model, 3).double()
        history = train_heads(model, heads, data.streams[2], data.labels, epochs=20, lr=1e-2, seed=seed, batch_size=32)
        runs.append((heads, history))
    (a, history), (b, _), (c, _) = runs
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.weight, c.weight)
    untrained = head_loss(model, ResidualHeads(model.config.d_model, 3).double(), data.streams[2], data.labels)
    assert head_loss(model, a, data.streams[2], data.labels) < 0.9 * untrained
    assert history[-1][0] == 20 * len(data.streams[2])
    assert all(p.grad is None for p in model.parameters()) and all(p.requires_grad for p in model.parameters())


def test_save_then_load_gives_the_bf16_weights_on_the_targets_dtype(tmp_path):
    model = far_apart_model(VOCAB)
    heads = {2: trained_heads(model, 3), 1: trained_heads(model, 1, seed=1)}
    save_heads(tmp_path, heads, {2: (1, 2, 3), 1: (0,)}, model)
    assert {p.name for p in tmp_path.iterdir()} == {H.WEIGHTS, "config.json"}
    loaded, offsets = load_heads(tmp_path, model)
    assert offsets == {2: (1, 2, 3), 1: (0,)}
    for layer, h in heads.items():
        assert loaded[layer].weight.dtype == model.dtype and not loaded[layer].training
        assert torch.equal(loaded[layer].weight, h.weight.detach().to(torch.bfloat16).to(model.dtype))
        assert torch.equal(loaded[layer].bias, h.bias.detach().to(torch.bfloat16).to(model.dtype))


def test_medusa_and_exit_loaders_check_what_the_folder_holds(tmp_path):
    model = far_apart_model(VOCAB)
    save_heads(tmp_path / "medusa", {2: trained_heads(model, 3)}, {2: (1, 2, 3)}, model)
    save_heads(tmp_path / "exit", {1: trained_heads(model, 1)}, {1: (0,)}, model)
    assert load_medusa(model, tmp_path / "medusa").n == 3
    assert list(load_exit_adapters(model, tmp_path / "exit")) == [1]
    with pytest.raises(ValueError, match="not Medusa heads"):
        load_medusa(model, tmp_path / "exit")
    with pytest.raises(ValueError, match="not next-token exit adapters"):
        load_exit_adapters(model, tmp_path / "medusa")
    with pytest.raises(FileNotFoundError, match="no heads.safetensors"):
        load_medusa(model, tmp_path / "nowhere")


def test_heads_of_another_target_are_refused(tmp_path):
    model = far_apart_model(VOCAB)
    save_heads(tmp_path, {2: trained_heads(model, 3)}, {2: (1, 2, 3)}, model)
    other = far_apart_model(VOCAB)
    with torch.no_grad():
        other.blocks[0].mlp.down.weight[0, 0] += 1.0
    with pytest.raises(ValueError, match="trained on the target with weights sha256"):
        load_heads(tmp_path, other)


def test_bad_arguments_are_refused_by_name():
    model, data = tiny_examples()
    with pytest.raises(ValueError, match="n >= 1"):
        ResidualHeads(32, 0)
    for layer in (0, 3):
        with pytest.raises(ValueError, match=f"layer={layer} is out of range"):
            streams_at(model, torch.zeros(1, 2, dtype=torch.long), [layer])
    with pytest.raises(ValueError, match="2 heads need 2 offsets, got labels for 3"):
        train_heads(model, ResidualHeads(32, 2).double(), data.streams[2], data.labels, 1, 1e-3)
    with pytest.raises(ValueError, match="d_model=16 do not fit a target of d_model=32"):
        head_accuracy(model, ResidualHeads(16, 3).double(), data.streams[2], data.labels)
    with pytest.raises(ValueError, match="cannot be negative"):
        continuation_labels(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool), (0, -1))
    with pytest.raises(ValueError, match="epochs >= 1"):
        train_heads(model, ResidualHeads(32, 3).double(), data.streams[2], data.labels, 0, 1e-3)


def test_the_command_writes_a_reproducible_checkpoint_and_card(tmp_path, monkeypatch):
    """``python -m labkit.heads``, shrunk to a few short continuations of fixed openings (choosing
    them from the corpus tokenizes all of its functions)."""
    openings = {"train": ["def read(path):\n", "class Cache:\n", "import os\n"], "validation": ["def parse(text):\n"]}
    monkeypatch.setattr(H, "continuation_prompts", lambda tokenizer, n, seed, split: [
        tokenizer.encode(text).ids for text in openings[split][:n]])
    small = ["--prompts", "3", "--new-tokens", "6", "--held-out", "1", "--epochs", "2"]
    for out in ("a", "b"):
        assert H.main(["early-exit", "--out", str(tmp_path / out), *small]) == 0
    assert (tmp_path / "a" / H.WEIGHTS).read_bytes() == (tmp_path / "b" / H.WEIGHTS).read_bytes()
    card = (tmp_path / "a" / "MODEL_CARD.md").read_text()
    assert "python -m labkit.heads early-exit --out" in card and "| training | 2 epochs" in card
    assert sorted(_card_top1(tmp_path / "a")) == list(range(1, 8))
    with pytest.raises(SystemExit):
        H.main(["medusa", "early-exit", "--out", str(tmp_path / "c")])


# --- the shipped checkpoints --------------------------------------------------------------------

def _card_top1(folder) -> dict[int, list[float]]:
    """{layer: per-head top-1} from a card's accuracy table."""
    found: dict[int, list[float]] = {}
    for layer, top1 in re.findall(r"^\| layer (\d+) \| \+\d+ \| ([\d.]+)% \|", (folder / "MODEL_CARD.md").read_text(), re.M):
        found.setdefault(int(layer), []).append(float(top1) / 100)
    return found


def test_the_shipped_heads_load_onto_the_shipped_target_and_are_small():
    target, _ = labkit.load("target", device="cpu")
    medusa, adapters = load_medusa(target), load_exit_adapters(target)
    assert medusa.n == 4 and medusa.weight.abs().sum() > 0
    assert sorted(adapters) == list(range(1, target.config.n_layers)) and all(a.n == 1 for a in adapters.values())
    for folder in (H.MEDUSA, H.EARLY_EXIT):
        assert (folder / H.WEIGHTS).stat().st_size < 3e6
        assert not (folder / "model.safetensors").exists(), "labkit.load would take it for a model"
        assert weights_sha256(target)[:16] in (folder / "MODEL_CARD.md").read_text()


def test_the_shipped_cards_figures_are_what_the_code_measures():
    """Recompute the cards' validation top-1 figures as ``make`` does (greedy continuations of the same
    validation openings): each as printed, to its rounding (and a near tie flipped by another thread count)."""
    target, tokenizer = labkit.load("target", device="cpu")
    n_layers = target.config.n_layers
    wanted = {**H.layer_offsets("medusa", n_layers), **H.layer_offsets("early-exit", n_layers)}
    val = H.continuation_examples(target, tokenizer, H.SPECS["medusa"], 0, "validation", wanted)
    for folder, loaded in ((H.MEDUSA, {n_layers: load_medusa(target)}), (H.EARLY_EXIT, load_exit_adapters(target))):
        card = _card_top1(folder)
        assert sorted(card) == sorted(loaded)
        for layer, heads in loaded.items():
            found = head_accuracy(target, heads, val[layer].streams[layer], val[layer].labels)[1]
            assert found == pytest.approx(card[layer], abs=0.0015)
