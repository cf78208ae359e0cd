"""Exercises of notebook 01: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

import math
import time

import pytest
import torch

from labkit.check import FAILED, PASSED, run_cases
from labkit.exercises import get
from labkit.model import ContiguousKVCache

from exercise_cells import fails, mistake


TEXTBOOK, MHA_RUN = "the textbook example: 10-token prompt, 100 new tokens", "MHA random model, 3-token prompt"


def failure(ex_id, fn, label):
    """The result of a check that must fail first at the case whose label starts with ``label``, and that
    case's hint, which the message shows."""
    result = run_cases(get(ex_id), fn)
    assert result.status == FAILED, result.verdict()
    assert result.failed_case.startswith(label), (label, result.message)
    case = next(c for c in get(ex_id).cases() if c.label == result.failed_case)
    assert case.hint in result.message
    return result, case.hint


def test_ex01_1_counts_are_ints_and_a_float_answer_fails():
    assert all(type(v) is int for case in get("ex01.1").cases() for v in case.expected)
    divides = lambda p, n: (n * p + n * (n - 1) / 2, p + n - 1)  # / where // was meant
    result = run_cases(get("ex01.1"), divides)
    assert result.status == FAILED, result.verdict()
    assert f"case 1 ({TEXTBOOK}): naive: expected a whole number, an int (5950), got float 5950.0" in result.message, \
        result.message
    # the value is right: the message says what to do, so no case hint (and no recipe) comes with it
    assert result.failed_case.startswith(TEXTBOOK) and not any(c.hint in result.message for c in get("ex01.1").cases())


@pytest.mark.parametrize("loops", [
    lambda p, n: (sum(p + i for i in range(n)), p + n - 1),  # a loop in Python: stopped at its second
    lambda p, n: (sum(range(p, p + n)), p + n - 1),  # a loop inside C, which no signal stops: fails once it returns
])
def test_ex01_1_a_loop_over_the_steps_fails_on_the_big_case_in_its_own_time(loops):
    start = time.perf_counter()
    result, hint = failure("ex01.1", loops, "300 million new tokens")
    assert time.perf_counter() - start < 30
    assert result.passed == result.total - 2  # the 300,000,003 case too
    assert "stopped after 1 s" in result.message and "closed form" in hint


def test_ex01_1_a_count_through_a_float_fails_where_floats_skip_integers():
    result, hint = failure("ex01.1", lambda p, n: (int(n * p + n * (n - 1) / 2), p + n - 1), "300,000,003 new tokens")
    assert result.passed == result.total - 1 and "expected 45000300750003003, got 45000300750003000" in result.message
    assert "Keep it in integers: //" in hint


@pytest.mark.parametrize("slip", [
    lambda p, n: (n * p + n * (n + 1) // 2, p + n),  # the textbook: feeds the last token back in
    lambda p, n: (n * p + n * (n - 1) // 2, p + n),  # the cached loop feeds the last token back in
])
def test_ex01_1_feeding_the_last_token_back_gets_the_hint_about_the_last_token(slip):
    result, hint = failure("ex01.1", slip, TEXTBOOK)
    assert "never fed back" in hint and "6,050 and 110" in hint
    assert "naive" in result.message or "cached: expected 109, got 110" in result.message


def test_ex01_2_plausible_mistakes_get_the_hint_of_what_they_got_wrong():
    def attend(scale, spread):
        def step(q, k_new, v_new, k_cache, v_cache):
            keys, values = torch.cat([k_cache, k_new], 2), torch.cat([v_cache, v_new], 2)
            keys, values = spread(keys, q.shape[1] // keys.shape[1]), spread(values, q.shape[1] // keys.shape[1])
            return (q @ keys.transpose(-2, -1) * scale(q)).softmax(-1) @ values, keys[:, ::1], values
        return step
    interleave = lambda x, g: x.repeat_interleave(g, dim=1)
    tiled = lambda x, g: x.repeat(1, g, 1, 1)  # KV head j % kv serves query head j: wrong
    right_scale, no_scale = (lambda q: 1 / math.sqrt(q.shape[-1])), (lambda q: 1.0)

    result, hint = failure("ex01.2", attend(right_scale, tiled), "GQA: 8 query heads share 2 KV heads")
    assert 0 < result.passed < result.total and "consecutive blocks of g query heads, not every other head" in hint
    result, hint = failure("ex01.2", attend(no_scale, interleave), "MHA: 4")
    assert "divided by sqrt(head_dim)" in hint

    def over_the_query(q, k_new, v_new, k_cache, v_cache):  # the softmax over the single query: every weight 1
        keys, values = torch.cat([k_cache, k_new], 2), torch.cat([v_cache, v_new], 2)
        keys, values = interleave(keys, q.shape[1] // keys.shape[1]), interleave(values, q.shape[1] // keys.shape[1])
        return (q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-2) @ values, keys, values
    result, hint = failure("ex01.2", over_the_query, "MHA, head_dim 1")
    assert "the softmax's axis" in hint

    def old_keys_only(q, k_new, v_new, k_cache, v_cache):  # attends to the cache before the new token joins it
        keys, values = interleave(k_cache, q.shape[1] // k_cache.shape[1]), interleave(v_cache, q.shape[1] // k_cache.shape[1])
        out = (q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1) @ values
        return out, torch.cat([k_cache, k_new], 2), torch.cat([v_cache, v_new], 2)
    result, hint = failure("ex01.2", old_keys_only, "empty cache")
    assert "including the new one" in hint

    def forgets_to_append(q, k_new, v_new, k_cache, v_cache):
        out, _, _ = get_reference()(q, k_new, v_new, k_cache, v_cache)
        return out, k_cache, v_cache
    result, hint = failure("ex01.2", forgets_to_append, "empty cache")
    assert "k_cache: " in result.message and "torch.Size([1, 4, 1, 16])" in result.message, result.message
    assert "return the caches with them appended" in hint


def get_reference():
    from labkit.exercises.lab01 import reference_attention_step
    return reference_attention_step


def loop(call=lambda m, t, p, c: m(t, plan=c.plan(p)), first_decode_position=0, feed_last_back=False, room=-1):
    """The solution's loop, with one thing written another way: the forward call, where the
    decode positions start (0: at P), whether the last token is fed back, the cache's room."""
    def cached_generate(model, prompt, new_tokens):
        cache, generated = ContiguousKVCache(model.config, 1, len(prompt) + new_tokens + room), []
        tokens, positions = torch.tensor([prompt]), torch.arange(len(prompt))[None]
        with torch.no_grad():
            for step in range(new_tokens + feed_last_back):
                logits = call(model, tokens, positions, cache)[0, -1]
                if len(generated) < new_tokens:
                    generated.append(int(logits.argmax()))
                position = len(prompt) + step + first_decode_position
                tokens, positions = torch.tensor([[generated[-1]]]), torch.tensor([[position]])
        return generated
    return cached_generate


def test_ex01_3_the_solution_passes_with_a_cache_of_p_plus_n_minus_1_positions():
    assert run_cases(get("ex01.3"), loop()).status == PASSED


def test_ex01_3_the_trained_models_case_catches_wrong_positions_by_itself():
    """The case on the shipped draft model checks what its hint promises: decode positions one off either way, or
    a new cache at every step, change its tokens (its first prompt, ending in a newline, gave 24 newlines, the
    same with decode positions one early)."""
    case = next(c for c in get("ex01.3").cases() if c.label.startswith("the shipped draft model"))
    case.run(loop())

    def new_cache_each_step(model, prompt, new_tokens):
        generated, tokens, positions = [], torch.tensor([prompt]), torch.arange(len(prompt))[None]
        with torch.no_grad():
            for step in range(new_tokens):
                cache = ContiguousKVCache(model.config, 1, len(prompt) + new_tokens)
                generated.append(int(model(tokens, plan=cache.plan(positions))[0, -1].argmax()))
                tokens, positions = torch.tensor([[generated[-1]]]), torch.tensor([[len(prompt) + step]])
        return generated
    for wrong in (loop(first_decode_position=1, room=0), loop(first_decode_position=-1), new_cache_each_step):
        with pytest.raises(AssertionError):
            case.run(wrong)
    result, hint = failure("ex01.3", new_cache_each_step, MHA_RUN)
    assert "a new cache each step forgets the prompt" in hint, hint


def test_ex01_3_plausible_mistakes_fail_with_the_hint_they_need():
    def naive(model, prompt, new_tokens):  # right tokens, no cache: the whole sequence again at every step
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(new_tokens):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        return ids[len(prompt):]
    result, hint = failure("ex01.3", naive, MHA_RUN)
    assert "cached generation makes" in result.message and "the prompt goes in once" in hint

    result, hint = failure("ex01.3", loop(feed_last_back=True, room=0), MHA_RUN)  # one call too many
    assert "calls of [3, 1, 1, 1, 1, '...'] tokens (15 in all)" in result.message, result.message
    assert "never fed back" in hint

    result, hint = failure("ex01.3", loop(first_decode_position=1, room=0), MHA_RUN)  # decode starts at P + 1
    assert "next position (P, P+1, ...)" in hint, result.message

    result, hint = failure("ex01.3", loop(room=-2), MHA_RUN)  # a cache one position short
    assert "does not fit a cache of max_len=13" in result.message and "holds P + N - 1 positions" in hint, \
        result.message


@pytest.mark.parametrize("call, says", [
    (lambda m, t, p, c: m(t, p, c), "cache.plan(positions), not a ContiguousKVCache"),
    (lambda m, t, p, c: m(t, p, c.plan(p)), "a plan carries its positions"),
])
def test_ex01_3_the_forward_call_written_wrongly_is_explained(call, says):
    result, _ = failure("ex01.3", loop(call), MHA_RUN)  # the error says what to do; the case's hint does not
    assert f"case 1 ({MHA_RUN}, 12 new tokens): raised " in result.message and says in result.message, result.message


def test_a_step_that_scales_the_query_in_place_fails(root):
    in_place = mistake(root, "ex01.2", "    scores = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])\n",
                       "    q /= math.sqrt(q.shape[-1])\n    scores = q @ keys.transpose(-2, -1)\n")
    fails("ex01.2", in_place, "empty cache", "changed its argument q in place")


def test_a_half_dropped_by_floor_division_first_is_named_where_n_is_odd(root):
    fails("ex01.1", mistake(root, "ex01.1", "new_tokens * (new_tokens - 1) // 2", "new_tokens // 2 * (new_tokens - 1)"),
          "long prompt, few new tokens", "N // 2 * (N - 1) drops the half")


def test_torchs_fused_attention_is_refused():
    def fused(q, k_new, v_new, k_cache, v_cache):
        keys, values = torch.cat([k_cache, k_new], 2), torch.cat([v_cache, v_new], 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        return out, keys, values
    result = fails("ex01.2", fused, "empty cache", "it comes from torch's scaled_dot_product_attention")
    assert "hint:" not in result.message
