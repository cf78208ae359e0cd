"""Generation: naive equals cached, the token counters, sampling filters, seeds, EOS, validation."""
from __future__ import annotations

import math

import pytest
import torch

from labkit.generate import (Counters, SamplingParams, decode_step, filter_logits, next_token, sampling_probs,
                             stream)
from labkit.model import ModelConfig, Transformer


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                                max_seq_len=128)).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def test_naive_and_cached_greedy_agree_and_count_as_the_closed_form(model):
    prompt = list(range(10))
    naive, cached = Counters(), Counters()
    params = SamplingParams(max_new_tokens=100)
    out_naive = list(stream(model, prompt, params, use_cache=False, counters=naive))
    out_cached = list(stream(model, prompt, params, counters=cached))
    assert out_naive == out_cached and len(out_cached) == 100
    assert naive.tokens_processed == 5950 and cached.tokens_processed == 109
    assert naive.forward_calls == cached.forward_calls == 100


def test_seeded_sampling_repeats_and_seeds_differ(model):
    run = lambda seed: list(stream(model, [1, 2, 3], SamplingParams(30, temperature=1.0, seed=seed)))
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_eos_stops_generation(model):
    greedy = list(stream(model, [4, 5], SamplingParams(20)))
    stopped = list(stream(model, [4, 5], SamplingParams(20), eos_id=greedy[3]))
    assert stopped == greedy[:greedy.index(greedy[3]) + 1]


def test_top_k_and_top_p_keep_the_right_tokens():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    keep = lambda out: torch.isfinite(out)[0].tolist()
    assert keep(filter_logits(logits, 2, 1.0)) == [False, True, False, True]
    assert keep(filter_logits(logits, 0, 0.8)) == [False, True, False, True]  # 0.5 + 0.3 reaches 0.8
    assert keep(filter_logits(logits, 0, 0.81)) == [False, True, True, True]
    assert keep(filter_logits(logits, 0, 0.4)) == [False, True, False, False]  # the top token always stays


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_follows_the_softmax_of_the_logits_over_the_temperature(temperature):
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([next_token(logits.expand(1000, -1), SamplingParams(temperature=temperature), generator)
                         for _ in range(20)]).flatten()
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    weights = [math.exp(x / temperature) for x in logits[0].tolist()]  # the softmax, written out
    torch.testing.assert_close(freq, torch.tensor([w / sum(weights) for w in weights]), atol=0.012, rtol=0)


def test_the_sampled_distribution_applies_the_temperature_before_top_k():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    kept = [math.exp(1.0 / 0.5), math.exp(2.0 / 0.5)]  # the top 2, sharpened by T = 0.5; the rest never drawn
    expected = torch.tensor([0.0, kept[0], kept[1], 0.0]) / sum(kept)
    torch.testing.assert_close(sampling_probs(logits, SamplingParams(temperature=0.5, top_k=2)), expected)


@pytest.mark.parametrize("bad, message", [
    (dict(max_new_tokens=0), "max_new_tokens=0"), (dict(temperature=-1), "temperature=-1"),
    (dict(top_k=-2), "top_k=-2"), (dict(top_p=0), "top_p=0"),
    (dict(max_new_tokens=2.5), "max_new_tokens=2.5 must be an int"), (dict(top_k=2.5), "top_k=2.5 must be an int"),
    (dict(seed=1.0), "seed=1.0 must be an int"), (dict(max_new_tokens=True), "max_new_tokens=True must be an int"),
    (dict(temperature=float("nan")), "temperature=nan must be a finite number"),
    (dict(top_p=float("inf")), "top_p=inf must be a finite number"), (dict(temperature="1"), "temperature='1'"),
])
def test_bad_sampling_params(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_prompts_that_are_not_token_ids_of_the_model_are_refused(model):
    vocab = model.config.vocab_size
    for prompt, message in [([1, vocab], f"token {vocab} is outside the vocabulary of {vocab}"),
                            ([1, -2], "non-negative ints: got -2"), ([1, 2.5], "got 2.5"),
                            (torch.tensor([1, 2]), "not a tensor")]:
        with pytest.raises(ValueError, match=message):
            next(stream(model, prompt, SamplingParams(max_new_tokens=2)))


def test_an_end_token_that_no_token_could_equal_is_refused(model):
    from labkit.engine import Request
    from labkit.speculative import ModelDrafter, speculative_stream
    from labkit.static_batching import run_static

    params = SamplingParams(max_new_tokens=2)
    for eos_id in ("</s>", model.config.vocab_size, -1, 2.0):  # generation would never stop at it
        for run in (lambda: next(stream(model, [1, 2], params, eos_id=eos_id)),
                    lambda: next(speculative_stream(model, ModelDrafter(model), [1, 2], params, eos_id=eos_id)),
                    lambda: run_static(model, [Request("a", [1, 2], params)], 1, eos_id=eos_id)):
            with pytest.raises(ValueError, match=f"eos_id={eos_id!r} must be a token id in 0..49 or None"):
                run()


def test_token_ids_and_start_outside_their_range_are_refused_by_the_model(model):
    from labkit.model import forward_tokens

    for tokens in ([[1, 50]], [[-1, 2]]):  # torch's embedding would raise a bare IndexError
        with pytest.raises(ValueError, match=r"token ids must be in 0..49 \(the vocabulary\), got"):
            model(torch.tensor(tokens))
        with pytest.raises(ValueError, match=r"token ids must be in 0..49"):
            model(torch.tensor(tokens), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="start=-1 must be 0 or more"):  # -1 would mark the first token padding
        forward_tokens(model, [5, 7], -1, None)


def test_a_step_to_time_names_its_bad_sizes(model):
    from labkit.model import ContiguousKVCache

    with pytest.raises(ValueError, match="context=-1 cached tokens must be 0 or more"):
        decode_step(model, -1)
    with pytest.raises(ValueError, match="tokens=0 new ones 1 or more"):
        decode_step(model, 4, 0)
    for batch, message in ((-1, "batch_size=-1 must be at least 1"), (2.0, "batch_size=2.0 must be an int")):
        with pytest.raises(ValueError, match=message):
            ContiguousKVCache(model.config, batch)


def test_sampling_probs_refuses_greedy_params():
    with pytest.raises(ValueError, match="temperature=0 is greedy decoding"):
        sampling_probs(torch.zeros(1, 4), SamplingParams())  # it would divide by 0: NaN everywhere


def test_too_long_and_empty_requests(model):
    with pytest.raises(ValueError, match="exceed the context limit max_seq_len=128"):
        next(stream(model, [1] * 100, SamplingParams(max_new_tokens=40)))
    with pytest.raises(ValueError, match="prompt is empty"):
        next(stream(model, [], SamplingParams()))


def test_decode_step_repeats_the_same_step_on_a_prefilled_cache(model):
    step = decode_step(model, 7)
    with torch.no_grad():
        full = model(torch.zeros(1, 8, dtype=torch.long))[:, -1:]
    first, second = step(), step()
    torch.testing.assert_close(first, full, rtol=1e-5, atol=1e-5)
    assert torch.equal(first, second)


def test_decode_step_of_several_tokens_matches_the_full_forward(model):
    step = decode_step(model, 5, tokens=3)
    with torch.no_grad():
        full = model(torch.zeros(1, 8, dtype=torch.long))[:, -3:]
    torch.testing.assert_close(step(), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step(), full, rtol=1e-5, atol=1e-5)
