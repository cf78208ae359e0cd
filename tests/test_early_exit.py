"""Self-speculative decoding by early exit: greedy output identical to the target's for every exit
layer and k, an exact drafter always accepted and a wrong one never, the cache after a run equal to
the final sequence's own, sampled output the target's (the same draws whatever drafts, and a
chi-square test), the measuring helpers, and bad arguments refused by name."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import labkit
from labkit.early_exit import (RoundCosts, _rounds, best_exit, exit_agreement, exit_logits, round_costs,
                               self_speculative_stream, verify_step)
from labkit.exercises.lab01 import random_model
from labkit.generate import SamplingParams, stream
from labkit.model import ContiguousKVCache, ModelConfig, Transformer, forward_tokens
from labkit.heads import streams_at
from labkit.speculative import SpeculationStats, chain_calls, continuation_prompts, teacher_forced_hits

from test_speculative import chi_square_p
from tiny_models import one_torch_thread


one_thread = pytest.fixture(autouse=True)(one_torch_thread)


def layered_model(n_layers: int, seed: int = 0) -> Transformer:
    """A random model of ``n_layers`` blocks, otherwise ``random_model``'s (std 0.3: far-apart logits)."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=97, d_model=64, n_layers=n_layers, n_heads=8, n_kv_heads=2,
                                    d_ff=128, max_seq_len=128))
    model.reset_parameters(std=0.3)
    return model.eval()


def last_attention_off(model: Transformer) -> Transformer:
    """The model with its last block's attention output zeroed: that block is then x + mlp(norm(x)),
    which an adapter on the stream of the layer before can compute exactly."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.blocks[-1].attn.wo.weight.zero_()
    return model


def last_block_mlp(model: Transformer):
    block = model.blocks[-1]
    return lambda x: x + block.mlp(block.mlp_norm(x))


# --- greedy: identical output ---------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_greedy_output_is_the_targets_for_every_exit_and_k(seed):
    target = layered_model(3, seed)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (int(torch.randint(1, 20, (), generator=generator)),), generator=generator).tolist()
    for new in (1, 2, 5, 23):  # every room at the end: none, one, k - 1 ...
        params = SamplingParams(max_new_tokens=new, stop_at_eos=False)
        expected = list(stream(target, prompt, params))
        for exit_layer in range(1, 4):
            for k in (0, 1, 4):
                stats = SpeculationStats(k)
                assert list(self_speculative_stream(target, exit_layer, prompt, params, k, stats=stats)) == expected
                assert stats.generated == new and stats.rounds[0].draft == ()
                assert all(len(r.draft) <= k for r in stats.rounds)


def test_greedy_on_the_shipped_target():
    target, tokenizer = labkit.load("target", device="cpu")
    params = SamplingParams(max_new_tokens=24, stop_at_eos=False)
    prompt = continuation_prompts(tokenizer, 1)[0]
    stats = SpeculationStats(3)
    out = list(self_speculative_stream(target, 4, prompt, params, 3, stats=stats))
    assert out == list(stream(target, prompt, params))
    assert len(stats.rounds) < 24 and 0 < stats.draft_s + stats.target_s <= stats.wall_s
    # the calls counted from one pass over the target's text, the exit's guesses teacher-forced, are the run's
    hits = teacher_forced_hits(lambda ids: exit_logits(target, streams_at(target, ids, [4])[4]), prompt + out, "cpu")
    assert chain_calls(hits, len(prompt), 24, 3, prompt_pass=True) == len(stats.rounds)
    assert chain_calls([False] * len(hits), len(prompt), 24, 3, prompt_pass=True) == 24  # no hit: one token a call


def test_stops_at_eos_inside_an_accepted_run():
    target = random_model(4, 2, seed=3)
    plain = list(stream(target, [5, 6], SamplingParams(max_new_tokens=30, stop_at_eos=False)))
    eos = plain[7]
    got = list(self_speculative_stream(target, 2, [5, 6], SamplingParams(max_new_tokens=30), 4, eos_id=eos))
    assert got == plain[:plain.index(eos) + 1]


# --- drafters that are always right, or always wrong ----------------------------------------------

@pytest.mark.parametrize("exit_layer", [1, 2])
def test_an_exact_drafter_is_always_accepted(exit_layer):
    """Exit 1 of 2 with an adapter that computes the last block (its attention zeroed), and exit 2
    of 2 (the whole target): every draft accepted, k + 1 tokens a call."""
    target = last_attention_off(random_model(4, 2, seed=7))
    adapter = last_block_mlp(target) if exit_layer == 1 else None
    stats = SpeculationStats(4)
    out = list(self_speculative_stream(target, exit_layer, [1, 2, 3], SamplingParams(max_new_tokens=26), 4,
                                       adapter=adapter, stats=stats))
    assert out == list(stream(target, [1, 2, 3], SamplingParams(max_new_tokens=26)))
    assert stats.acceptance_rate == 1.0
    assert [len(r.emitted) for r in stats.rounds] == [1] + [5] * 5  # the prefill, then k + 1 a call
    assert stats.tokens_per_call == 26 / 6


def test_a_drafter_that_is_always_wrong_is_never_accepted():
    """An adapter that sends every stream to one vector whose exit token the target never writes."""
    target = random_model(4, 2, seed=5)
    params = SamplingParams(max_new_tokens=30, stop_at_eos=False)
    expected = list(stream(target, [4, 8], params))
    never = next(t for t in range(97) if t not in expected)
    wrong = target.lm_head.weight[never].detach()
    assert int(exit_logits(target, wrong).argmax()) == never
    stats = SpeculationStats(3)
    out = list(self_speculative_stream(target, 1, [4, 8], params, 3, adapter=lambda x: wrong.expand_as(x), stats=stats))
    assert out == expected
    assert stats.acceptance_rate == 0.0 and stats.tokens_per_call == 1.0 and len(stats.rounds) == 30


# --- the cache ------------------------------------------------------------------------------------

@pytest.mark.parametrize("exit_layer, k", [(1, 3), (2, 2), (1, 6)])
def test_cache_after_a_run_is_the_final_sequences(exit_layer, k):
    """After rounds with rejections, every layer's keys and values of the generated prefix equal
    those of the final sequence fed alone."""
    target = layered_model(3, seed=1).double()
    prompt, params = [3, 1, 4, 1, 5], SamplingParams(max_new_tokens=40, stop_at_eos=False)
    capacity = len(prompt) + params.max_new_tokens - 1
    cache = ContiguousKVCache(target.config, 1, capacity, target.dtype)
    stats = SpeculationStats(k)
    out = list(_rounds(target, exit_layer, prompt, params, k, None, None, stats, cache))
    assert 0 < stats.acceptance_rate < 1  # rejections: slots written again
    alone = ContiguousKVCache(target.config, 1, capacity, target.dtype)
    forward_tokens(target, prompt + out[:-1], 0, alone)  # the last token is never fed
    torch.testing.assert_close(cache.k, alone.k)
    torch.testing.assert_close(cache.v, alone.v)


# --- sampling -------------------------------------------------------------------------------------

def test_sampled_output_is_the_same_draws_whatever_drafts():
    """Drafts are the exit head's argmax and take no randomness; every emitted token is one draw of
    the target's, in order: with a seed, the output does not depend on k, the exit or the adapter."""
    target = last_attention_off(layered_model(3, seed=2).double())
    params = SamplingParams(max_new_tokens=30, temperature=0.8, top_k=20, seed=11, stop_at_eos=False)
    prompt = [7, 7, 1]
    once = list(self_speculative_stream(target, 1, prompt, params, 0))
    assert once == list(self_speculative_stream(target, 1, prompt, params, 0))
    for exit_layer, k, adapter in [(1, 3, None), (2, 2, None), (2, 4, last_block_mlp(target)), (3, 5, None)]:
        assert list(self_speculative_stream(target, exit_layer, prompt, params, k, adapter=adapter)) == once
    assert list(self_speculative_stream(target, 1, prompt, replace(params, seed=12), 3)) != once


def test_sampling_matches_the_target():
    """A tiny model (vocabulary 3, two blocks, exit after one): the three tokens a run writes (a
    prefill, then a round with one draft, accepted or not) have the target's own joint distribution."""
    torch.manual_seed(0)
    target = Transformer(ModelConfig(vocab_size=3, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32,
                                     max_seq_len=16)).eval()
    target.reset_parameters(std=0.5)
    params = SamplingParams(max_new_tokens=3, temperature=0.9, stop_at_eos=False)
    prompt = [1, 2, 0, 1]
    with torch.no_grad():
        contexts = [[*prompt, *t] for t in [()] + [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]]
        # the target's own distribution, written out: not labkit's sampling_probs, which the stream samples with
        p = {tuple(c[len(prompt):]): torch.softmax(target(torch.tensor([c]))[0, -1].double() / params.temperature, -1)
             for c in contexts}
    exact = torch.tensor([p[()][a] * p[(a,)][b] * p[(a, b)][c] for a in range(3) for b in range(3) for c in range(3)])
    counts, stats = torch.zeros(27), SpeculationStats(1)
    for seed in range(2000):
        a, b, c = self_speculative_stream(target, 1, prompt, replace(params, seed=seed), 1, stats=stats)
        counts[9 * a + 3 * b + c] += 1
    assert 0.2 < stats.acceptance_rate < 0.9  # both branches taken often
    assert chi_square_p(counts, exact) > 1e-3


# --- measuring ------------------------------------------------------------------------------------

def test_exit_agreement_against_truncated_models():
    target = layered_model(4, seed=3)
    batches = [torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    got = exit_agreement(target, [3, 1, 4], batches)
    with torch.no_grad():
        truth = torch.cat([target(b).argmax(-1).flatten() for b in batches])
        for layer in (1, 3):
            cut = copy.deepcopy(target)
            cut.blocks = cut.blocks[:layer]
            guess = torch.cat([cut(b).argmax(-1).flatten() for b in batches])
            assert got[layer] == pytest.approx(float((guess == truth).float().mean()))
    assert list(got) == [1, 3, 4] and got[4] == 1.0
    late = exit_agreement(target, [1], batches, starts=[5, 9])  # counted from position 5, then 9
    with torch.no_grad():
        cut = copy.deepcopy(target)
        cut.blocks = cut.blocks[:1]
        hits = [(cut(b).argmax(-1) == target(b).argmax(-1))[:, s:] for b, s in zip(batches, (5, 9))]
    assert late[1] == pytest.approx(float(torch.cat([h.flatten() for h in hits]).float().mean()))


def test_exit_agreement_with_an_exact_adapter_is_one():
    target = last_attention_off(random_model(4, 2, seed=7))
    batch = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    assert exit_agreement(target, [1], [batch], {1: last_block_mlp(target)}) == {1: 1.0}


@pytest.mark.parametrize("exit_layer, k", [(1, 1), (3, 4)])
def test_the_timed_verification_is_a_full_pass_over_k_plus_one_tokens(exit_layer, k):
    target = layered_model(4)
    with torch.inference_mode():
        logits = verify_step(target, exit_layer, k, 16)()
        assert logits.shape == (k + 1, target.config.vocab_size)
        # the last k + 1 tokens (all 0) after 16 cached zeros, through the whole model at once
        full = target(torch.zeros(1, 16 + k + 1, dtype=torch.long))[0, 16:]
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)


def test_round_costs_and_best_exit():
    target = layered_model(4)
    costs = round_costs(target, [1, 3], ks=[1, 4], context=16, repeats=3)
    assert list(costs.draft) == [1, 3] and all(0 < c for c in costs.draft.values())
    assert sorted(costs.verify) == [(1, 1), (1, 4), (3, 1), (3, 4)] and all(0 < v for v in costs.verify.values())
    assert set(costs.noisy) <= {"full", "draft 1", "draft 3", "verify 1 1", "verify 1 4", "verify 3 1", "verify 3 4"}
    for k in (0, 5):  # outside the k timed: no guess
        with pytest.raises(ValueError, match=f"k={k} from exit 1: its verification was timed at k in \\[1, 4\\]"):
            costs.v(1, k)
    with pytest.raises(ValueError, match="exit 2: its verification was timed at k in none"):
        costs.v(2, 1)
    layer, k, speedup = best_exit({1: 0.5, 2: 0.9, 3: 0.95}, {1: 0.3, 2: 0.5, 3: 0.75}, ks=range(1, 5))
    assert (layer, k) == (2, 3)  # v = 1: E = 1 + .9 + .81 + .729 = 3.439 over 3 c + 1 = 2.5
    assert speedup == pytest.approx(3.439 / 2.5)
    # a verification three steps dear from exit 2 hands the choice to exit 1: E = 1.5 over .3 + 1
    dear = RoundCosts({1: 0.3, 2: 0.5}, {(1, 1): 1.0, (1, 4): 1.0, (2, 1): 3.0, (2, 4): 3.0})
    assert best_exit({1: 0.5, 2: 0.9}, dear, ks=range(1, 5)) == (1, 1, pytest.approx(1.5 / 1.3))
    # between the k timed, v is read off a straight line
    line = RoundCosts({1: 0.3}, {(1, 1): 1.0, (1, 4): 2.5})
    assert [line.v(1, k) for k in (1, 2, 3, 4)] == pytest.approx([1.0, 1.5, 2.0, 2.5])


# --- bad arguments --------------------------------------------------------------------------------

def test_bad_arguments_are_named():
    target = random_model(4, 2, seed=0)
    run = lambda *args, **kwargs: list(self_speculative_stream(target, *args, **kwargs))  # noqa: E731
    with pytest.raises(ValueError, match="exit_layer=3 must be an int in 1..n_layers=2"):
        run(3, [1])
    with pytest.raises(ValueError, match="exit_layer=0"):
        run(0, [1])
    with pytest.raises(ValueError, match="exit_layer=1.5"):
        run(1.5, [1])
    with pytest.raises(ValueError, match="k=-1"):
        run(1, [1], SamplingParams(), -1)
    with pytest.raises(ValueError, match="prompt is empty"):
        run(1, [])
    with pytest.raises(ValueError, match="context limit"):
        run(1, [1] * 100, SamplingParams(max_new_tokens=64))
    with pytest.raises(ValueError, match="rounds of k=2 drafts.*k=4"):
        run(1, [1], SamplingParams(), 4, stats=SpeculationStats(2))
    with pytest.raises(ValueError, match=r"exit_layers=\[5\] must be ints in 1..n_layers=2"):
        exit_agreement(target, [5], [])


@pytest.mark.parametrize("spread, noisy", [(False, ()), (True, ("draft 3",))])
def test_round_costs_names_the_timings_that_spread_widely(monkeypatch, spread, noisy):
    """round_costs says which of its timings spread widely (a busy machine), by label, and none when all ran
    steadily: timings made up here, every label steady but one."""
    from labkit import early_exit
    from labkit.bench import Timing

    def made_up(steps, **_):
        return {label: Timing(label, "cpu", (1.0, 1.0, 3.0, 3.0) if spread and label == "draft 3" else
                              (1.0, 1.0, 1.0, 1.0)) for label in steps}
    monkeypatch.setattr(early_exit, "alternate", made_up)
    assert round_costs(layered_model(4), [1, 3], ks=[1, 4], context=16, repeats=3).noisy == noisy
