"""Exercises of notebook 01: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

import torch

from labkit.check import FAILED, PASSED, run_cases
from labkit.exercises import get


def test_lab01_plausible_mistakes_fail():
    import math

    from labkit.generate import SamplingParams, stream

    textbook = lambda p, n: (n * p + n * (n + 1) // 2, p + n)  # feeds the last token back in
    assert run_cases(get("ex01.1"), textbook).status == FAILED

    def tiled_heads(q, k_new, v_new, k_cache, v_cache):  # KV head j % kv serves query head j: wrong
        keys, values = torch.cat([k_cache, k_new], 2), torch.cat([v_cache, v_new], 2)
        group = q.shape[1] // keys.shape[1]
        scores = q @ keys.repeat(1, group, 1, 1).transpose(-2, -1) / math.sqrt(q.shape[-1])
        return scores.softmax(-1) @ values.repeat(1, group, 1, 1), keys, values
    result = run_cases(get("ex01.2"), tiled_heads)
    assert result.status == FAILED and 0 < result.passed < result.total  # MHA and MQA cases still pass

    def naive(model, prompt, new_tokens):  # right tokens, no cache
        return list(stream(model, prompt, SamplingParams(new_tokens, stop_at_eos=False), use_cache=False))
    result = run_cases(get("ex01.3"), naive)
    assert result.status == FAILED and "cached generation runs" in result.message

    from labkit.model import ContiguousKVCache

    def through(call):  # the solution's loop, with the forward call written another way
        def cached_generate(model, prompt, new_tokens):
            cache, generated = ContiguousKVCache(model.config, 1, len(prompt) + new_tokens), []
            tokens, positions = torch.tensor([prompt]), torch.arange(len(prompt))[None]
            with torch.no_grad():
                for step in range(new_tokens):
                    generated.append(int(call(model, tokens, positions, cache)[0, -1].argmax()))
                    tokens, positions = torch.tensor([[generated[-1]]]), torch.tensor([[len(prompt) + step]])
            return generated
        return cached_generate
    assert run_cases(get("ex01.3"), through(lambda m, t, p, c: m(t, plan=c.plan(p)))).status == PASSED
    for call, says in [(lambda m, t, p, c: m(t, p, c), "cache.plan(positions), not a ContiguousKVCache"),
                       (lambda m, t, p, c: m(t, p, c.plan(p)), "a plan carries its positions")]:
        result = run_cases(get("ex01.3"), through(call))
        assert result.status == FAILED and says in result.message, result.message
