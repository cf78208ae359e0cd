"""Speculative decoding: greedy output identical to the target's own, sampled output distributed
as the target's (chi-square tests strong enough that a biased acceptance rule fails them), the
acceptance rule, verification, prompt lookup and the statistics."""
from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
import torch

import labkit
from labkit.exercises.lab01 import random_model
from labkit.generate import SamplingParams, sampling_probs, stream
from labkit.bench import Timing
from labkit.model import ModelConfig, Transformer
from labkit.speculative import (ModelDrafter, PromptLookupDrafter, Round, SpeculationStats, acceptance_rule,
                                chain_calls, continuation_prompts, editing_prompts, lookup, speculation_gain,
                                speculative_stream, teacher_forced_hits, verification_line, verification_verdict,
                                verify_greedy, verify_sampled)

from tiny_models import one_torch_thread


one_thread = pytest.fixture(autouse=True)(one_torch_thread)


@pytest.fixture(scope="module")
def shipped():
    target, tokenizer = labkit.load("target", device="cpu")
    draft, _ = labkit.load("draft", device="cpu")
    return target, draft, tokenizer


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` under ``probs`` (Pearson's chi-square; cells with probability 0
    must be empty, else the p-value is 0)."""
    n = counts.sum()
    if (counts[probs == 0] > 0).any():
        return 0.0
    keep = probs > 0
    expected = n * probs[keep]
    statistic = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic.double() / 2))


# --- greedy: identical output ---------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 3, 6])
def test_greedy_draft_model_output_is_the_targets(shipped, k):
    target, draft, tokenizer = shipped
    params = SamplingParams(max_new_tokens=32, stop_at_eos=False)
    prompt = continuation_prompts(tokenizer, 3)[k // 3]
    stats = SpeculationStats(k)
    assert list(speculative_stream(target, ModelDrafter(draft), prompt, params, k, stats=stats)) == \
        list(stream(target, prompt, params))
    assert stats.generated == 32 and 0 < stats.draft_s + stats.target_s <= stats.wall_s
    assert len(stats.rounds) == 32 if k == 0 else len(stats.rounds) < 32  # drafts accepted: fewer target calls


@pytest.mark.parametrize("k", [1, 4])
def test_the_calls_counted_from_one_pass_are_the_runs(shipped, k):
    """The draft's guesses teacher-forced on the target's own text give the run's target calls, uncounted."""
    target, draft, tokenizer = shipped
    params = SamplingParams(max_new_tokens=40, stop_at_eos=False)
    prompt = continuation_prompts(tokenizer, 2, seed=3)[k % 2]
    stats = SpeculationStats(k)
    out = list(speculative_stream(target, ModelDrafter(draft), prompt, params, k, stats=stats))
    hits = teacher_forced_hits(draft, prompt + out, torch.device("cpu"))
    assert chain_calls(hits, len(prompt), 40, k, prompt_pass=False) == len(stats.rounds) < 40
    with pytest.raises(ValueError, match="must lie within"):
        chain_calls(hits, len(prompt), 41, k, prompt_pass=False)
    with pytest.raises(ValueError, match="k=-1"):
        chain_calls(hits, len(prompt), 40, -1, prompt_pass=False)


@pytest.mark.parametrize("k", [2, 8])
def test_greedy_prompt_lookup_output_is_the_targets(shipped, k):
    target, _, tokenizer = shipped
    params = SamplingParams(max_new_tokens=32, stop_at_eos=False)
    prompt = editing_prompts(tokenizer, 2)[k // 8]
    stats = SpeculationStats(k)
    drafter = PromptLookupDrafter(target.config.vocab_size)
    assert list(speculative_stream(target, drafter, prompt, params, k, stats=stats)) == \
        list(stream(target, prompt, params))
    assert any(r.draft for r in stats.rounds)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_output_is_the_targets_for_random_models(seed):
    """Drafts that disagree (another model), agree (the target itself), agree in part (the target with
    a little noise: rounds whose drafts are accepted up to some point, then rolled back) and look up
    the text: every kind of round, the output always the target's."""
    target, draft = random_model(8, 2, seed), random_model(4, 1, seed + 100)
    noisy = copy.deepcopy(target)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.02)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (int(torch.randint(1, 20, (), generator=generator)),), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=30, stop_at_eos=False)
    rounds = {}
    for name, drafter in [("other", ModelDrafter(draft)), ("itself", ModelDrafter(target)),
                          ("noisy", ModelDrafter(noisy)), ("lookup", PromptLookupDrafter(97, max_ngram=2))]:
        stats = SpeculationStats(3)
        assert list(speculative_stream(target, drafter, prompt, params, 3, stats=stats)) == \
            list(stream(target, prompt, params))
        assert stats.generated == 30
        rounds[name] = [(r.accepted, len(r.draft)) for r in stats.rounds if r.draft]
    assert any(accepted == 0 for accepted, _ in rounds["other"])
    assert all(accepted == drafted for accepted, drafted in rounds["itself"])
    assert any(0 < accepted < drafted for accepted, drafted in rounds["noisy"])


def test_a_perfect_draft_is_always_accepted():
    target = random_model(4, 2, seed=7)
    stats = SpeculationStats(4)
    out = list(speculative_stream(target, ModelDrafter(target), [1, 2, 3], SamplingParams(max_new_tokens=26), 4,
                                  stats=stats))
    assert len(out) == 26 and stats.acceptance_rate == 1.0
    assert [len(r.emitted) for r in stats.rounds] == [5] * 5 + [1]  # the last round has no room to draft
    assert stats.tokens_per_call == 26 / 6


def test_stops_at_eos_inside_an_accepted_run():
    target = random_model(4, 2, seed=3)
    params = SamplingParams(max_new_tokens=30)
    plain = list(stream(target, [5, 6], SamplingParams(max_new_tokens=30, stop_at_eos=False)))
    eos = plain[7]
    expected = plain[:plain.index(eos) + 1]
    got = list(speculative_stream(target, ModelDrafter(target), [5, 6], params, 4, eos_id=eos))
    assert got == expected


def test_bad_arguments_are_named(shipped):
    target, draft, _ = shipped
    with pytest.raises(ValueError, match="prompt is empty"):
        list(speculative_stream(target, ModelDrafter(draft), [], SamplingParams()))
    with pytest.raises(ValueError, match="k=-1"):
        list(speculative_stream(target, ModelDrafter(draft), [1], SamplingParams(), k=-1))
    with pytest.raises(ValueError, match="context limit"):
        list(speculative_stream(target, ModelDrafter(draft), [1] * 1000, SamplingParams(max_new_tokens=64)))
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(10, max_ngram=1, min_ngram=2)
    with pytest.raises(TypeError, match=r"not a model: wrap the draft model as ModelDrafter\(draft\)"):
        list(speculative_stream(target, draft, [1], SamplingParams()))
    with pytest.raises(ValueError, match="k=2.5 must be an int"):
        list(speculative_stream(target, ModelDrafter(draft), [1], SamplingParams(), k=2.5))
    with pytest.raises(ValueError, match="vocabulary of 97 tokens"):
        list(speculative_stream(target, ModelDrafter(random_model(4, 2, 0)), [1], SamplingParams()))
    with pytest.raises(ValueError, match="rounds of k=2 drafts.*k=4"):
        list(speculative_stream(target, ModelDrafter(draft), [1], SamplingParams(), k=4, stats=SpeculationStats(2)))
    with pytest.raises(ValueError, match=r"a=70 .*\[0, 1\]"):
        speculation_gain(70, 4, 0.1)
    with pytest.raises(ValueError, match="c=-0.1 must be >= 0 and v=1.0 > 0"):
        speculation_gain(0.7, 4, -0.1)


# --- the acceptance rule and verification ---------------------------------------------------------

def test_acceptance_rule_by_hand():
    p, q = torch.tensor([0.5, 0.3, 0.2, 0.0]), torch.tensor([0.25, 0.6, 0.1, 0.05])
    accept, residual = acceptance_rule(p, q, 1)
    assert accept == pytest.approx(0.5)
    torch.testing.assert_close(residual, torch.tensor([0.25, 0.0, 0.1, 0.0]) / 0.35)
    assert acceptance_rule(p, q, 0)[0] == 1.0  # p > q: always accepted
    torch.testing.assert_close(acceptance_rule(p, p, 2)[1], p)  # nothing left: rejection cannot happen
    with pytest.raises(ValueError, match="probability 0.0 under q"):
        acceptance_rule(q, p, 3)


def test_verify_greedy_by_hand():
    logits = torch.eye(6)[[2, 4, 1, 5]] * 3  # the target's argmax after each prefix: 2, 4, 1, then 5
    assert verify_greedy([2, 4, 1], logits) == ([2, 4, 1], 5)  # all accepted, and a bonus
    assert verify_greedy([2, 3, 1], logits) == ([2], 4)
    assert verify_greedy([0, 4, 1], logits) == ([], 2)
    assert verify_greedy([], logits[:1]) == ([], 2)


def _two_tokens(verify, P: torch.Tensor, Q: torch.Tensor, k: int, start: int, generator) -> tuple[int, int]:
    """The first two tokens after ``start`` from speculative rounds over a bigram target ``P`` and a
    bigram draft ``Q`` ([vocab, vocab]: row = previous token)."""
    sequence = [start]
    while len(sequence) < 3:
        drafts, previous = [], sequence[-1]
        for _ in range(k):
            previous = int(torch.multinomial(Q[previous], 1, generator=generator))
            drafts.append(previous)
        q = Q[[sequence[-1], *drafts[:-1]]]
        p = P[[sequence[-1], *drafts]]
        accepted, token = verify(drafts, q, p, generator)
        sequence += [*accepted, token]
    return sequence[1], sequence[2]


def _biased_verify(draft, q, p, generator):
    """A plausible mistake: accept whenever the draft token is the target's argmax."""
    for i, token in enumerate(draft):
        if token == int(p[i].argmax()):
            continue
        accept, residual = acceptance_rule(p[i], q[i], token)
        if float(torch.rand((), generator=generator)) >= accept:
            return list(draft[:i]), int(torch.multinomial(residual, 1, generator=generator))
    return list(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


def _resample_from_target(draft, q, p, generator):
    """Another plausible mistake: after a rejection, draw from p instead of the residual."""
    for i, token in enumerate(draft):
        accept, _ = acceptance_rule(p[i], q[i], token)
        if float(torch.rand((), generator=generator)) >= accept:
            return list(draft[:i]), int(torch.multinomial(p[i], 1, generator=generator))
    return list(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


@pytest.mark.parametrize("verify, passes", [(verify_sampled, True), (_biased_verify, False),
                                            (_resample_from_target, False)])
def test_sampled_tokens_have_the_targets_distribution(verify, passes):
    """Joint distribution of the first two tokens, 16 cells, 4,000 samples: the exact rule passes
    a chi-square test at the 0.1% level, the two mistaken rules fail it."""
    generator = torch.Generator().manual_seed(0)
    P = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.6, 0.2, 0.1, 0.1]])
    Q = torch.tensor([[0.55, 0.15, 0.15, 0.15], [0.1, 0.1, 0.1, 0.7], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    counts = torch.zeros(4, 4)
    for _ in range(4_000):
        a, b = _two_tokens(verify, P, Q, 2, 0, generator)
        counts[a, b] += 1
    exact = P[0][:, None] * P
    assert (chi_square_p(counts.flatten(), exact.flatten()) > 1e-3) == passes


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_sampling_end_to_end_matches_the_target(drafter):
    """Tiny real models (vocabulary 5), temperature and top-k applied to both: the first two tokens
    speculative decoding writes have the target's own (filtered) distribution."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=5, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                                max_seq_len=32)
    target, draft = Transformer(config).eval(), Transformer(config).eval()
    target.reset_parameters(std=0.5)
    draft.reset_parameters(std=0.5)
    params = SamplingParams(max_new_tokens=2, temperature=0.9, top_k=3, stop_at_eos=False)
    prompt = [1, 3, 2, 1, 3]  # a lookup draft: after "1, 3" came "2"
    with torch.no_grad():
        first = sampling_probs(target(torch.tensor([prompt]))[0, -1], params)
        following = sampling_probs(target(torch.tensor([[*prompt, t] for t in range(5)]))[:, -1], params)
    exact = (first[:, None] * following).flatten()
    make = (lambda: ModelDrafter(draft)) if drafter == "model" else (lambda: PromptLookupDrafter(5, max_ngram=2))
    counts = torch.zeros(25)
    for seed in range(1500):
        a, b = speculative_stream(target, make(), prompt, replace(params, seed=seed), 2)
        counts[5 * a + b] += 1
    assert chi_square_p(counts, exact) > 1e-3


# --- prompt lookup and the statistics -------------------------------------------------------------

def test_lookup_takes_the_longest_latest_match_that_fills_the_proposal():
    text = [1, 2, 3, 9, 1, 2, 4, 5, 7, 2, 3, 8, 8, 1, 2]
    assert lookup(text, 3) == [4, 5, 7]  # "1 2" last seen before "4 5 7"
    assert lookup(text, 10) == [3, 9, 1, 2, 4, 5, 7, 2, 3, 8]  # only the first "1 2" is followed by 10 tokens
    assert lookup(text + [3], 2) == [9, 1]  # the 3-gram "1 2 3" beats the later 2-gram "2 3"
    assert lookup([5, 6, 7], 4) == []
    assert lookup([4, 4, 4], 4) == [4]  # the match may overlap the tail; only what followed it
    assert lookup([1, 2, 1], 3, max_ngram=1) == [2, 1]
    repeat = [7, 7, 1, 2, 3, 1, 2, 3, 1, 2]  # a short repeat: the latest "1 2" is followed by 1 token
    assert lookup(repeat, 4, max_ngram=2) == [3, 1, 2, 3]
    assert lookup(repeat, 1, max_ngram=2) == [3]
    assert lookup(repeat, 4) == [3, 1, 2]  # the 3-gram "3 1 2" occurred once before: what followed it


def test_statistics_from_rounds():
    stats = SpeculationStats(3, rounds=[Round((1, 2, 3), 3, 4), Round((1, 2, 3), 1, 5), Round((), 0, 6),
                                        Round((1, 2), 0, 7)])
    assert stats.position_counts() == ([3, 2, 1], [2, 1, 1])
    assert stats.acceptance_by_position == [2 / 3, 0.5, 1.0]
    assert stats.acceptance_rate == pytest.approx(4 / 6)
    assert stats.generated == 4 + 2 + 1 + 1 and stats.mean_accepted == 1.0
    assert [r.bonus for r in stats.rounds] == [True, False, False, False]
    assert SpeculationStats(2).acceptance_by_position == [None, None]


def test_prompts_are_reproducible(shipped):
    _, _, tokenizer = shipped
    assert continuation_prompts(tokenizer, 3, seed=1) == continuation_prompts(tokenizer, 3, seed=1)
    edit = tokenizer.decode(editing_prompts(tokenizer, 1, seed=2)[0])
    body, again = edit.split("\n\n", 1)[0], edit.rsplit("\n\n", 1)[1]
    assert body.startswith(again)


def test_all_drafts_are_checked_for_every_k():
    """Every combination of accepted count and draft length is counted once per position reached."""
    for k, accepted in itertools.product(range(4), range(4)):
        if accepted > k:
            continue
        stats = SpeculationStats(k, rounds=[Round(tuple(range(k)), accepted, 9)])
        reached, ok = stats.position_counts()
        assert sum(ok) == accepted and sum(reached) == min(k, accepted + 1)


def test_speculation_html_colours_every_token_by_kind():
    from labkit.viz import speculation_html

    rounds = [Round((1, 2), 2, 3), Round((4, 5), 1, 6), Round((8, 9, 10), 0, 11), Round((), 0, 7)]
    text = speculation_html(rounds, lambda t: f"<{t}>")
    body = text.split("</div>", 1)[1]
    kinds = [part.split('"', 1)[0] for part in body.split('title="')[1:]]
    assert kinds == ["accepted", "accepted", "bonus", "accepted", "rejected", "target",
                     "rejected", "unjudged", "unjudged", "target", "target"]  # after a rejection: unjudged
    assert text.split("</div>", 1)[0].count("<span") == 5  # a legend of the five kinds it has
    only_accepted = speculation_html([Round((1, 2), 2, 3)], str).split("</div>", 1)[0]
    assert "accepted" in only_accepted and "rejected" not in only_accepted and "unjudged" not in only_accepted
    assert "&lt;5&gt;" in body and "<5>" not in body


def test_a_rejected_newline_is_shown_without_breaking_the_line():
    from labkit.viz import speculation_html

    body = speculation_html([Round((1,), 0, 2), Round((1,), 1, 3), Round((4, 1), 0, 5)],
                            lambda t: "\n" if t == 1 else "x")
    body = body.split("</div>", 1)[1]
    assert body.count("↵") == 3 and body.count("<br>") == 1  # only the accepted newline ends a line


def _steps(v: dict[int, float], spread: float) -> dict[str, Timing]:
    """A target step of 10 ms and each verification at v[k] of it, each timing's quartiles ``spread`` of its
    median apart: four evenly spaced repeats, whose inclusive quartiles lie halfway between the median and the
    ends."""
    def timing(label: str, median_ms: float) -> Timing:
        return Timing(label, "cpu", tuple(median_ms * (1 + d * spread) / 1e3 for d in (-1, -1 / 3, 1 / 3, 1)))
    return {"target": timing("target", 10.0), **{f"verify {k}": timing(f"verify {k}", 10.0 * x) for k, x in v.items()}}


def test_the_verification_verdict_weighs_the_trend_against_the_spread_of_the_timings() -> None:
    free = {1: 1.05, 2: 1.08, 4: 1.1}
    assert "nearly free" in verification_verdict(free, "here", _steps(free, 0.02))
    growing = {1: 1.3, 2: 1.6, 4: 2.2, 6: 2.8}
    said = verification_verdict(growing, "on cpu", _steps(growing, 0.02))
    assert said.startswith("Verification costs 1.30 to 2.80 decode steps on cpu: it grows with k")
    assert "+0.300 decode steps per drafted token, +1.50 from k = 1 to k = 6" in said  # the least-squares line
    assert "no steady growth" in verification_verdict(growing, "on cpu", _steps(growing, 0.5))  # within the noise
    flat = {1: 1.5, 2: 1.52, 4: 1.48, 6: 1.5}
    assert "fixed extra cost per verification call, about 0.50 of a decode step" in verification_verdict(
        flat, "here", _steps(flat, 0.02))
    falling = {1: 1.3, 2: 2.0, 4: 1.5, 6: 2.8}
    said = verification_verdict(falling, "here", _steps(falling, 0.02))
    assert "no verdict" in said and "v falls from k = 2 to k = 4" in said
    with pytest.raises(ValueError, match="needs two k or more"):
        verification_verdict({4: 1.8}, "here", _steps({4: 1.8}, 0.02))


def test_the_verification_line_is_least_squares_kept_where_a_verification_can_be() -> None:
    assert verification_line({1: 1.3, 2: 1.6, 4: 2.2}) == pytest.approx((1.0, 0.3))  # on the line: exact
    assert verification_line({1: 1.5, 2: 1.7, 4: 2.1, 6: 2.5}) == pytest.approx((1.3, 0.2))
    # below one step at k = 0 by least squares (0.82 + 0.43 k): through (0, 1) instead, sum k (v - 1) / sum k^2
    assert verification_line({1: 1.26, 2: 1.56, 4: 2.77, 6: 3.29}) == pytest.approx((1.0, 22.2 / 57))
    assert verification_line({1: 1.6, 2: 1.5, 4: 1.4}) == pytest.approx((1.5, 0.0))  # falling: flat at the mean
    with pytest.raises(ValueError, match="needs two k or more"):
        verification_line({4: 1.8})
