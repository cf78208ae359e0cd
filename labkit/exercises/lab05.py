"""Notebook 05 (speculative decoding): the acceptance rule, greedy verification, the expected gain."""
from __future__ import annotations

import torch

from labkit.exercises.spec import Case, Exercise
from labkit.speculative import acceptance_rule, speculation_gain, verify_greedy


def _rule_cases() -> list[Case]:
    p, q = torch.tensor([0.5, 0.3, 0.2, 0.0]), torch.tensor([0.25, 0.6, 0.1, 0.05])
    generator = torch.Generator().manual_seed(5)
    p_rand, q_rand = torch.rand(2, 50, generator=generator).softmax(-1)
    pairs = [
        ("the target likes the token less than the draft: accepted half the time", (p, q, 1),
         "the acceptance probability: p[token] = 0.3 is below q[token] = 0.6, so it is their ratio, a Python "
         "float below 1. The residual: only the tokens where p exceeds q keep mass, max(p - q, 0), scaled to sum "
         "to 1"),
        ("the target likes it more: always accepted", (p, q, 0),
         "p[token] is above q[token]: their ratio exceeds 1, but an acceptance is a probability and stops at 1"),
        ("a token the target would never write: never accepted", (p, q, 3),
         "p[token] is 0 here, so the acceptance is 0.0; the residual has no mass wherever p <= q"),
        ("random distributions over 50 tokens", (p_rand, q_rand, int(q_rand.argmax())),
         "any p and q: the residual is max(p - q, 0) token by token over the whole vocabulary, divided by its own "
         "sum (not by the sum of p or of q)"),
        ("draft and target agree: nothing left over, the residual is p", (p, p.clone(), 2),
         "p equals q, so max(p - q, 0) is all zeros and dividing by its sum gives NaN: the text says what to return "
         "instead"),
    ]
    return [Case(label, args, acceptance_rule(*args), rtol=1e-5, atol=1e-6, unchanged=True, hint=hint)
            for label, args, hint in pairs]


def _verify_cases() -> list[Case]:
    logits = torch.eye(6)[[2, 4, 1, 5]] * 3  # the target's argmax after each prefix: 2, 4, 1, then 5
    generator = torch.Generator().manual_seed(3)
    noisy = torch.randn(6, 100, generator=generator)
    best = noisy.argmax(-1).tolist()
    runs = [
        ("all three accepted, then a bonus token", ([2, 4, 1], logits),
         "every draft token is the target's argmax, so all are accepted and the next token comes from the last row, "
         "the one that predicts the token after the whole draft (the bonus)"),
        ("the second draft token is wrong", ([2, 3, 1], logits),
         "draft[1] is not the argmax of row 1, so acceptance stops there (draft[2] matches row 2, but too late): "
         "only draft[0] is accepted, and the next token is the target's own choice from the row that predicts "
         "draft[1]"),
        ("the first is wrong: only the target's token", ([0, 4, 1], logits),
         "draft[0] already disagrees with row 0: nothing is accepted (an empty list), and the next token is the "
         "argmax of row 0"),
        ("no draft at all: one ordinary decode step", ([], logits[:1]),
         "an empty draft and a single row of logits: nothing to compare, so the answer is ([], the argmax of that "
         "row); make sure an empty draft does not index past the end"),
        ("random logits over 100 tokens, four of five right", (best[:3] + [(best[3] + 1) % 100, best[4]], noisy),
         "the fourth draft token is wrong and the fifth right again: acceptance ends at the first mismatch, later "
         "matches do not count; the argmax of a row is taken over the vocabulary, its last dimension"),
    ]
    return [Case(label, args, verify_greedy(*args), hint=hint) for label, args, hint in runs]


def _gain_cases() -> list[Case]:
    settings = [
        ("a = 0.8, k = 4, free draft", (0.8, 4, 0.0),
         "tokens_per_call: the target's own token, which every call emits, plus each draft token with the chance "
         "that it and every draft before it are accepted (a^1 for the first, up to a^k). The speedup: a round costs "
         "k draft steps of c target steps each plus one target step, the verification, so with a free draft "
         "(c = 0) it equals the tokens per call"),
        ("a = 0.6, k = 3, draft at 1/10 of the target", (0.6, 3, 0.1),
         "a round costs k draft steps of c target steps each, plus one verification costing one target step"),
        ("a perfect draft: k + 1 tokens per call", (1.0, 5, 0.05),
         "at a = 1 the closed form divides 0 by 0; every draft is accepted, so each call yields k + 1 tokens"),
        ("a useless draft: one token per call, and slower", (0.0, 4, 0.2),
         "at a = 0 nothing is accepted: one token per call, the target's own, while the k draft steps are still "
         "paid for, so the speedup is below 1"),
        ("no drafting, k = 0", (0.7, 0, 0.1),
         "k = 0 is plain decoding whatever a is: one token per call and a speedup of exactly 1"),
    ]
    return [Case(label, args, speculation_gain(*args), rtol=1e-6, hint=hint) for label, args, hint in settings]


EXERCISES = [
    Exercise(
        id="ex05.1", title="The acceptance rule and the residual", points=2, function="acceptance_rule",
        returns=("acceptance probability", "residual"),
        cases=_rule_cases,
        recipe="accept = min(1, p[token] / q[token]) as a Python float (float(...) or .item()); "
             "residual = (p - q).clamp(min=0), divided by its sum; when that sum is 0 (p == q) return p.",
    ),
    Exercise(
        id="ex05.2", title="Greedy verification", points=2, function="verify_greedy",
        returns=("accepted", "next_token"),
        cases=_verify_cases,
        recipe="Take the argmax of every row of target_logits: row i holds the logits that predict draft[i]. "
             "Accept draft[i] while it equals the argmax of row i; stop at the first mismatch. The next token "
             "is the argmax of the row right after the accepted ones (row len(draft) when all were accepted: the "
             "bonus). Return (list of accepted, int).",
    ),
    Exercise(
        id="ex05.3", title="Expected tokens per call and speedup", points=1, function="speculation_gain",
        returns=("tokens_per_call", "speedup"),
        cases=_gain_cases,
        recipe="tokens = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a), which is k + 1 when a = 1; "
             "speedup = tokens / (k * c + 1).",
    ),
]
