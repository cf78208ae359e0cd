"""Exercises of notebook 02: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

import torch

from labkit.check import FAILED, run_cases
from labkit.exercises import get


def test_lab02_plausible_mistakes_fail():
    import math

    size = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
    keys_only = lambda layers, heads, kv, dim, tokens, batch, dtype: layers * kv * dim * tokens * batch * size[dtype]
    assert run_cases(get("ex02.1"), keys_only).status == FAILED
    query_heads = lambda layers, heads, kv, dim, tokens, batch, dtype: 2 * layers * heads * dim * tokens * batch * size[dtype]
    result = run_cases(get("ex02.1"), query_heads)  # right only where the model is MHA
    assert result.status == FAILED and 0 < result.passed < result.total

    def no_mask(q, k, v):  # attends to the future too
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1) @ v
    result = run_cases(get("ex02.2"), no_mask)
    assert result.status == FAILED and result.passed == 1  # only the one-token case passes

    def tiled_heads(q, k, v):  # query head i uses KV head i % n_kv_heads: wrong grouping
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        future = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1)
        return scores.masked_fill(future, float("-inf")).softmax(-1) @ v
    result = run_cases(get("ex02.2"), tiled_heads)
    assert result.status == FAILED and 0 < result.passed < result.total

    for dtypes in ({"fp32": 4, "fp16": 2, "int8": 1, "int4": 0.5}, {**size, "fp8": 2}):  # bf16 and fp8 missing, or fp8 as 2
        wrong = lambda layers, heads, kv, dim, tokens, batch, dtype, dtypes=dtypes: (
            2 * layers * kv * dim * tokens * batch * dtypes[dtype])
        result = run_cases(get("ex02.1"), wrong)
        assert result.status == FAILED and "Llama-3.1-8B" in result.message, dtypes

    all_memory = lambda memory, utilization, weights, per_sequence: max(0, int((memory - weights) // per_sequence))
    assert run_cases(get("ex02.3"), all_memory).status == FAILED
