"""Exercises of notebook 05: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

import torch

from labkit.check import FAILED, PASSED, run_cases
from labkit.exercises import get

from exercise_cells import fails, mistake, solution


def test_lab05_plausible_mistakes_fail():
    acceptance_rule, verify_greedy = solution("ex05.1"), solution("ex05.2")

    def unnormalised(p, q, token):  # forgets to renormalise the residual
        accept, _ = acceptance_rule(p, q, token)
        return accept, (p - q).clamp(min=0)
    result = fails("ex05.1", unnormalised, "the target likes the token less than the draft", "scaled to sum to 1")
    assert "residual: at index [0] expected 0.7143, got 0.25 (2 of 4 values differ" in result.message, \
        result.message  # names the residual and shows it, not the acceptance

    def ratio_uncapped(p, q, token):  # p / q without the min(1, .)
        return float(p[token] / q[token]), acceptance_rule(p, q, token)[1]
    assert run_cases(get("ex05.1"), ratio_uncapped).status == FAILED

    def no_bonus(draft, target_logits):  # all accepted: takes the last draft's row instead of the bonus row
        accepted, token = verify_greedy(draft, target_logits)
        return accepted, int(target_logits[len(accepted) - 1].argmax()) if accepted == list(draft) and draft else token
    result = fails("ex05.2", no_bonus, "all three accepted", "the one that predicts the token after the whole draft (the bonus)")
    assert "next_token: expected 5, got 1" in result.message, result.message

    def keeps_going(draft, target_logits):  # accepts every matching token, even after a mismatch
        best = target_logits.argmax(-1).tolist()
        kept = [t for t, b in zip(draft, best) if t == b]
        return kept, best[len(kept)]
    assert run_cases(get("ex05.2"), keeps_going).status == FAILED

    def k_terms(a, k, c):  # sums a^0..a^(k-1): forgets the bonus token
        tokens = k if a == 1 else (1 - a ** k) / (1 - a)
        return tokens, tokens / (k * c + 1)
    result = fails("ex05.3", k_terms, "a = 0.8, k = 4, free draft", "the target's own token, which every call emits")
    assert "tokens_per_call: expected 3.3616, got 2.952" in result.message, result.message


def test_lab05_acceptance_as_a_0d_tensor_fails_asking_for_item():
    acceptance_rule = solution("ex05.1")

    def tensor_accept(p, q, token):  # the text asks for a Python float
        return torch.clamp(p[token] / q[token], max=1.0), acceptance_rule(p, q, token)[1]
    result = run_cases(get("ex05.1"), tensor_accept)
    assert result.status == FAILED, result.message
    assert "acceptance probability: expected a Python number" in result.message and ".item()" in result.message

    def float_accept(p, q, token):  # the same, as a float: passes
        return min(1.0, (p[token] / q[token]).item()), acceptance_rule(p, q, token)[1]
    assert run_cases(get("ex05.1"), float_accept).status == PASSED


def test_lab05_a_failing_case_shows_its_own_hint():
    acceptance_rule = solution("ex05.1")

    def ratio_uncapped(p, q, token):
        return float(p[token] / q[token]), acceptance_rule(p, q, token)[1]
    message = run_cases(get("ex05.1"), ratio_uncapped).message
    assert "(the target likes it more" in message and "stops at 1" in message, message

    def no_fallback(p, q, token):  # p == q: divides zeros by zero
        residual = (p - q).clamp(min=0)
        return acceptance_rule(p, q, token)[0], residual / residual.sum()
    message = run_cases(get("ex05.1"), no_fallback).message
    assert "(draft and target agree" in message and "the text says what to return" in message, message

    def keeps_going(draft, target_logits):
        best = target_logits.argmax(-1).tolist()
        kept = [t for t, b in zip(draft, best) if t == b]
        return kept, best[len(kept)]
    message = run_cases(get("ex05.2"), keeps_going).message
    assert "(the second draft token is wrong" in message and "acceptance stops there" in message, message

    def closed_form_only(a, k, c):  # 0 / 0 at a = 1
        tokens = (1 - a ** (k + 1)) / (1 - a)
        return tokens, tokens / (k * c + 1)
    message = run_cases(get("ex05.3"), closed_form_only).message
    assert "(a perfect draft" in message and "divides 0 by 0" in message, message


def test_a_speedup_without_the_verification_step_fails_naming_the_rounds_cost(root):
    no_verification = mistake(root, "ex05.3", "tokens / (k * c + 1)", "tokens / (k * c)")  # the round's cost forgets v
    fails("ex05.3", no_verification, "a = 0.8, k = 4, free draft", "plus one target step, the verification")


def test_accepted_tokens_as_a_tensor_are_right_values_of_another_type(root):
    result = fails("ex05.2", mistake(root, "ex05.2", "list(draft[:accepted])", "torch.tensor(draft[:accepted])"),
                   "all three accepted", "the values are right, but in a tensor: expected a list")
    assert "hint:" not in result.message
