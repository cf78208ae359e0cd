"""Pipeline parallelism on two gloo ranks: the same greedy tokens as one process, a timeline with
every piece in causal order, the bubble formula by hand, and bad layouts refused before any rank starts."""
from __future__ import annotations

import copy
import itertools

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from labkit.generate import SamplingParams, stream  # noqa: E402
from labkit.load import save_checkpoint  # noqa: E402
from labkit.parallel import pipeline  # noqa: E402
from labkit.parallel.pipeline import (Piece, bubble_fraction, cut_stage, even_split, measure_bubble,  # noqa: E402
                                      measured_bubble, pipeline_generate)
from labkit.model import parameter_bytes  # noqa: E402
from labkit.viz import plot_pipeline_timeline  # noqa: E402
from tests.tiny_models import far_apart_model  # noqa: E402

PROMPTS = [[5, 9, 33], [1, 2, 3, 4, 5, 6, 7], [100], [7, 8, 9, 10, 11, 12], [42, 43]]  # 3 + 2, padded
NEW = 5


@pytest.fixture(scope="module")
def model():
    """A float64 two-layer model with the lab tokenizer's vocabulary (so that labkit.load takes its folder)."""
    return far_apart_model(vocab_size=4096)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline") / "tiny"
    save_checkpoint(model, path, dtype=torch.float64)
    return str(path)


@pytest.fixture(scope="module")
def two_ranks(folder):
    return pipeline_generate(folder, PROMPTS, NEW, world_size=2, micro_batches=2, dtype=torch.float64)


def test_even_split_puts_the_remainder_first():
    assert [len(r) for r in even_split(8, 3)] == [3, 3, 2]
    assert even_split(5, 2) == [range(0, 3), range(3, 5)]
    with pytest.raises(ValueError, match="cannot be split into 3"):
        even_split(2, 3)


def test_the_bubble_formula_against_a_hand_count():
    # p = 3 stages, m = 2 micro-batches of one time unit each: micro-batch j runs on stage r in
    # slot j + r, so the pass spans m + p - 1 = 4 slots; 6 of the 3 x 4 rank-slots work, 6 idle
    ideal = [Piece(r, j, 0, float(j + r), float(j + r + 1)) for r in range(3) for j in range(2)]
    assert measured_bubble(ideal, 3) == pytest.approx(6 / 12)
    assert bubble_fraction(3, 2) == pytest.approx(6 / 12)
    assert bubble_fraction(2, 1) == 0.5 and bubble_fraction(1, 8) == 0 and bubble_fraction(4, 4) == 3 / 7
    with pytest.raises(ValueError, match="m=0 micro-batches"):
        bubble_fraction(2, 0)


def test_two_stages_in_one_process_equal_the_model(model):
    """The cut itself: stage 0 then stage 1 give the full model's greedy token, each holding only its share."""
    first, second = cut_stage(copy.deepcopy(model), 0, 2), cut_stage(copy.deepcopy(model), 1, 2)
    assert (len(first.model.blocks), first.model.lm_head, second.model.embed) == (1, None, None)
    assert second.model.blocks[0].attn.layer == 0 and second.config.n_layers == 1  # its own cache's layer 0
    assert parameter_bytes(first.model) + parameter_bytes(second.model) == sum(p.nbytes for p in model.parameters())
    tokens = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    positions = torch.arange(5).expand(2, 5)
    last = torch.tensor([4, 4])
    hidden = first.forward(tokens, positions, None, last)
    with torch.inference_mode():
        expected = model(tokens)[:, -1].argmax(-1)
    assert torch.equal(second.forward(hidden, positions, None, last), expected)


def test_pipeline_greedy_equals_one_process(two_ranks, folder, model):
    one_rank = pipeline_generate(folder, PROMPTS, NEW, world_size=1, micro_batches=2, dtype=torch.float64)
    assert two_ranks.tokens == one_rank.tokens  # the same code on one rank
    alone = [list(stream(model, p, SamplingParams(max_new_tokens=NEW, stop_at_eos=False))) for p in PROMPTS]
    assert two_ranks.tokens == alone  # each prompt by itself, unpadded: float64 keeps the argmax apart
    assert two_ranks.layers == [range(0, 1), range(1, 2)]
    assert sum(two_ranks.parameter_bytes) == one_rank.parameter_bytes[0]  # untied: each weight on one rank
    assert max(two_ranks.parameter_bytes) < 0.6 * one_rank.parameter_bytes[0]
    assert two_ranks.kv_bytes[0] == two_ranks.kv_bytes[1] == one_rank.kv_bytes[0] / 2  # a layer each


def test_the_timeline_has_every_piece_in_causal_order(two_ranks):
    timeline = two_ranks.timeline
    keys = [(p.rank, p.micro_batch, p.step) for p in timeline]
    assert sorted(keys) == list(itertools.product(range(2), range(2), range(NEW)))
    piece = {(p.rank, p.micro_batch, p.step): p for p in timeline}
    for j, step in itertools.product(range(2), range(NEW)):
        assert piece[1, j, step].start >= piece[0, j, step].end  # rank 1 waits for rank 0's activations
        if step:
            assert piece[0, j, step].start >= piece[1, j, step - 1].end  # rank 0 waits for the sampled token
    assert min(p.start for p in timeline) == 0 and all(p.end >= p.start for p in timeline)
    assert 0 < two_ranks.bubble() < 1


def test_measure_bubble_keeps_one_pass_of_each_count(folder):
    runs = measure_bubble(folder, world_size=2, micro_batches=(1, 2, 4), rows=4, length=8, passes=3)
    assert [r.micro_batches for r in runs] == [1, 2, 4]
    for run in runs:
        m = run.micro_batches
        assert sorted((p.rank, p.micro_batch) for p in run.timeline) == list(itertools.product(range(2), range(m)))
        assert run.formula == bubble_fraction(2, m) and 0 < run.measured < 1
        assert run.measured == measured_bubble(run.timeline, 2)


def test_measure_bubble_keeps_each_counts_pass_of_median_bubble(folder, monkeypatch):
    def run(idle):  # two ranks, one piece each; rank 1 starts after ``idle`` seconds: bubble idle / (1 + idle)
        return [Piece(0, 0, 0, 0.0, 1.0), Piece(1, 0, 0, idle, 1.0 + idle)]
    idles = [0.9, 0.0, 0.3, 0.1, 0.5, 0.2]  # counts (1, 2) taking turns, three passes each
    monkeypatch.setattr(pipeline, "launch", lambda *args, **kwargs: [run(i) for i in idles])
    runs = measure_bubble(folder, world_size=2, micro_batches=(1, 2), rows=4, length=8, passes=3)
    assert [r.timeline[1].start for r in runs] == [0.5, 0.1]  # of 0.9, 0.3, 0.5 and of 0.0, 0.1, 0.2
    assert runs[0].measured == pytest.approx(0.5 / 1.5)


@pytest.mark.parametrize("call, match", [
    (lambda f: pipeline_generate(f, PROMPTS, NEW, world_size=3), r"world_size=3 must be in 1..n_layers=2"),
    (lambda f: pipeline_generate(f, PROMPTS, NEW, micro_batches=0), r"micro_batches=0 must be in 1..5"),
    (lambda f: pipeline_generate(f, PROMPTS, NEW, micro_batches=6), r"micro_batches=6 must be in 1..5"),
    (lambda f: pipeline_generate(f, PROMPTS, 0), r"new_tokens=0 must be at least 1"),
    (lambda f: pipeline_generate(f, [[1, 2], []], NEW), r"a prompt of 0 tokens"),
    (lambda f: measure_bubble(f, micro_batches=(1, 3), rows=4), r"rows=4 do not split into micro_batches=3"),
    (lambda f: measure_bubble(f, world_size=3), r"world_size=3 must be in 1..n_layers=2"),
    (lambda f: measure_bubble(f, passes=0), r"passes=0 must be at least 1"),
])
def test_bad_layouts_are_refused_before_any_process_starts(folder, monkeypatch, call, match):
    def no_launch(*args, **kwargs):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(pipeline, "launch", no_launch)
    with pytest.raises(ValueError, match=match):
        call(folder)


def test_the_timeline_plot_shows_each_rank_and_both_bubbles():
    ideal = [Piece(r, j, 0, float(j + r), float(j + r + 1)) for r in range(3) for j in range(2)]
    fig = plot_pipeline_timeline(ideal, "ideal")
    ax = fig.axes[0]
    assert "measured 50%" in ax.get_title() and "= 50% (p = 3, m = 2)" in ax.get_title()
    assert [t.get_text() for t in ax.texts] == ["0", "1"] * 3
    assert len(ax.patches) == 3 + 6  # an idle row per rank under the six pieces
    plt.close(fig)
