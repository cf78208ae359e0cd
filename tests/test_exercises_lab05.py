"""Exercises of notebook 05: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

from labkit.check import FAILED, run_cases
from labkit.exercises import get


def test_lab05_plausible_mistakes_fail():
    from labkit.speculative import acceptance_rule, speculation_gain, verify_greedy

    def unnormalised(p, q, token):  # forgets to renormalise the residual
        accept, _ = acceptance_rule(p, q, token)
        return accept, (p - q).clamp(min=0)
    assert run_cases(get("ex05.1"), unnormalised).status == FAILED

    def ratio_uncapped(p, q, token):  # p / q without the min(1, .)
        return float(p[token] / q[token]), acceptance_rule(p, q, token)[1]
    assert run_cases(get("ex05.1"), ratio_uncapped).status == FAILED

    def no_bonus(draft, target_logits):  # all accepted: takes the last draft's row instead of the bonus row
        accepted, token = verify_greedy(draft, target_logits)
        return accepted, int(target_logits[len(accepted) - 1].argmax()) if accepted == list(draft) and draft else token
    assert run_cases(get("ex05.2"), no_bonus).status == FAILED

    def keeps_going(draft, target_logits):  # accepts every matching token, even after a mismatch
        best = target_logits.argmax(-1).tolist()
        kept = [t for t, b in zip(draft, best) if t == b]
        return kept, best[len(kept)]
    assert run_cases(get("ex05.2"), keeps_going).status == FAILED

    def k_terms(a, k, c):  # sums a^0..a^(k-1): forgets the bonus token
        tokens = k if a == 1 else (1 - a ** k) / (1 - a)
        return tokens, tokens / (k * c + 1)
    assert run_cases(get("ex05.3"), k_terms).status == FAILED
