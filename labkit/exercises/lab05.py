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
        ("the target likes the token less than the draft: accepted half the time", (p, q, 1)),
        ("the target likes it more: always accepted", (p, q, 0)),
        ("a token the target would never write: never accepted", (p, q, 3)),
        ("random distributions over 50 tokens", (p_rand, q_rand, int(q_rand.argmax()))),
        ("draft and target agree: nothing left over, the residual is p", (p, p.clone(), 2)),
    ]
    return [Case(label, args, acceptance_rule(*args), rtol=1e-5, atol=1e-6, unchanged=True) for label, args in pairs]


def _verify_cases() -> list[Case]:
    logits = torch.eye(6)[[2, 4, 1, 5]] * 3  # the target's argmax after each prefix: 2, 4, 1, then 5
    generator = torch.Generator().manual_seed(3)
    noisy = torch.randn(6, 100, generator=generator)
    best = noisy.argmax(-1).tolist()
    runs = [
        ("all three accepted, then a bonus token", ([2, 4, 1], logits)),
        ("the second draft token is wrong", ([2, 3, 1], logits)),
        ("the first is wrong: only the target's token", ([0, 4, 1], logits)),
        ("no draft at all: one ordinary decode step", ([], logits[:1])),
        ("random logits over 100 tokens, four of five right", (best[:3] + [(best[3] + 1) % 100, best[4]], noisy)),
    ]
    return [Case(label, args, verify_greedy(*args)) for label, args in runs]


def _gain_cases() -> list[Case]:
    settings = [
        ("a = 0.8, k = 4, free draft", (0.8, 4, 0.0)),
        ("a = 0.6, k = 3, draft at 1/10 of the target", (0.6, 3, 0.1)),
        ("a perfect draft: k + 1 tokens per call", (1.0, 5, 0.05)),
        ("a useless draft: one token per call, and slower", (0.0, 4, 0.2)),
        ("no drafting, k = 0", (0.7, 0, 0.1)),
    ]
    return [Case(label, args, speculation_gain(*args), rtol=1e-6) for label, args in settings]


EXERCISES = [
    Exercise(
        id="ex05.1", title="The acceptance rule and the residual", points=2, function="acceptance_rule",
        returns=("acceptance probability", "residual"),
        cases=_rule_cases,
        recipe="accept = min(1, p[token] / q[token]) as a float; residual = (p - q).clamp(min=0), divided by its "
             "sum; when that sum is 0 (p == q) return p.",
    ),
    Exercise(
        id="ex05.2", title="Greedy verification", points=2, function="verify_greedy",
        returns=("accepted", "next_token"),
        cases=_verify_cases,
        recipe="Take the argmax of every row of target_logits. Accept draft[i] while it equals argmax row i; "
             "stop at the first mismatch. The next token is the argmax of the row right after the accepted "
             "ones (row len(draft) when all were accepted: the bonus). Return (list of accepted, int).",
    ),
    Exercise(
        id="ex05.3", title="Expected tokens per call and speedup", points=1, function="speculation_gain",
        returns=("tokens_per_call", "speedup"),
        cases=_gain_cases,
        recipe="tokens = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a), which is k + 1 when a = 1; "
             "speedup = tokens / (k * c + 1).",
    ),
]
