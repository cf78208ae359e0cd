"""Exercises of notebook 02: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

import math

import pytest
import torch

from labkit.check import FAILED, PASSED, run_cases
from labkit.exercises import get

from exercise_cells import fails


def test_lab02_plausible_mistakes_fail():
    size = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
    keys_only = lambda layers, heads, kv, dim, tokens, batch, dtype: layers * kv * dim * tokens * batch * size[dtype]
    fails("ex02.1", keys_only, "Llama-2-70B as if MHA", "a key AND a value")
    query_heads = lambda layers, heads, kv, dim, tokens, batch, dtype: 2 * layers * heads * dim * tokens * batch * size[dtype]
    fails("ex02.1", query_heads, "Llama-2-70B with GQA", "Which of the two head counts")  # right where it is MHA
    bits = lambda layers, heads, kv, dim, tokens, batch, dtype: 2 * layers * kv * dim * tokens * batch * 8 * size[dtype]
    fails("ex02.1", bits, "Llama-2-70B as if MHA", "bytes, not bits")  # 8 times too many, as GQA's 64 / 8 heads

    def no_mask(q, k, v):  # attends to the future too
        batch, heads, length, dim = q.shape
        grouped = q.view(batch, k.shape[1], heads // k.shape[1], length, dim)
        weights = (grouped @ k[:, :, None].transpose(-2, -1) / math.sqrt(dim)).softmax(-1)
        return (weights @ v[:, :, None]).reshape(q.shape)
    result = fails("ex02.2", no_mask, "MHA: 4 query heads", "the future masked with -inf before the softmax")
    assert result.passed == 1  # only the one-token case passes

    def tiled_heads(q, k, v):  # query head i uses KV head i % n_kv_heads: wrong grouping
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        future = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1)
        return scores.masked_fill(future, float("-inf")).softmax(-1) @ v
    result = fails("ex02.2", tiled_heads, "GQA: 8 query heads in 2 groups of 4", "consecutive heads, not every other one")
    assert 0 < result.passed < result.total

    for dtypes, case, hint in [  # bf16 and fp8 missing, or fp8 as 2 bytes
            ({"fp32": 4, "fp16": 2, "int8": 1, "int4": 0.5}, "Llama-3.1-8B, 4,096 tokens, bf16", "bf16 is 2 bytes"),
            ({**size, "fp8": 2}, "Llama-3.1-8B, batch 2 of 4,096 tokens, fp8", "fp8 is 1 byte per element")]:
        wrong = lambda layers, heads, kv, dim, tokens, batch, dtype, dtypes=dtypes: (
            2 * layers * kv * dim * tokens * batch * dtypes[dtype])
        fails("ex02.1", wrong, case, hint)

    all_memory = lambda memory, utilization, weights, per_sequence: max(0, int((memory - weights) // per_sequence))
    result = fails("ex02.3", all_memory, "Llama-3.1-8B on an H100", "usable memory is utilization x memory_bytes")
    assert "expected 52, got 59" in result.message, result.message


def _causal(q, k, v):
    """Causal attention of q over k and v of the same heads (or k and v broadcast over a group axis)."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    future = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def _grouped_views(q, k, v):  # the text's way, with expand
    batch, heads, length, dim = q.shape
    shape = (batch, k.shape[1], heads // k.shape[1], length, dim)
    return _causal(q.view(shape), k[:, :, None].expand(shape), v[:, :, None].expand(shape)).reshape(q.shape)


def _copies(copy):
    """Right values, reached by copying every KV head once per query head with ``copy(x, group)``."""
    return lambda q, k, v: _causal(q, copy(k, q.shape[1] // k.shape[1]), copy(v, q.shape[1] // k.shape[1]))


def test_ex02_2_views_pass():
    assert run_cases(get("ex02.2"), _grouped_views).status == PASSED


@pytest.mark.parametrize("copy, name", [
    (lambda x, group: x.repeat_interleave(group, 1), "repeat_interleave"),
    (lambda x, group: torch.cat([x[:, :, None]] * group, 2).flatten(1, 2), "cat"),
    (lambda x, group: x[:, :, None].expand(-1, -1, group, -1, -1).reshape(x.shape[0], -1, *x.shape[2:]), "reshape"),
    (lambda x, group: x[:, torch.arange(x.shape[1] * group) // group], "__getitem__"),
])
def test_ex02_2_copying_the_kv_heads_fails_though_the_values_are_right(copy, name):
    result = run_cases(get("ex02.2"), _copies(copy))
    assert result.status == FAILED and result.passed >= 1  # the MHA case has nothing to copy
    assert f"the result is right, but {name} made a tensor from k alone" in result.message, result.message
    assert "the text asks for views: expand" in result.message and "repeat_interleave, repeat" in result.message
    assert "hint:" not in result.message  # the case's hint is about the values, which are right


def test_ex02_2_stacking_k_and_v_then_repeating_them_together_fails():
    def stacked(q, k, v):
        both = torch.stack([k, v]).repeat_interleave(q.shape[1] // k.shape[1], 2)  # both copied per query head
        return _causal(q, both[0], both[1])
    result = run_cases(get("ex02.2"), stacked)
    assert result.status == FAILED and "the result is right, but repeat_interleave made a tensor from k and v alone " \
        "that holds 4 times their elements" in result.message, result.message


def test_ex02_3_reference_counts_are_ints_and_a_float_count_fails():
    assert all(type(case.expected) is int for case in get("ex02.3").cases())
    floored = lambda memory, utilization, weights, per_sequence: (
        max(0.0, (utilization * memory - weights) // per_sequence))
    result = run_cases(get("ex02.3"), floored)
    assert result.status == FAILED and "expected a whole number, an int" in result.message, result.message
    assert "where an input is a float, // gives a float too: round down with math.floor" in result.message  # its case
    rounded = lambda memory, utilization, weights, per_sequence: (
        max(0, round((utilization * memory - weights) / per_sequence)))
    result = fails("ex02.3", rounded, "Mistral-7B on an L4", "only a few sequences fit: round down")  # 1.5 and up
    assert "expected 1, got 2" in result.message, result.message
    ceiling = lambda memory, utilization, weights, per_sequence: (
        max(0, math.ceil((utilization * memory - weights) / per_sequence)))
    fails("ex02.3", ceiling, "Llama-3.1-8B on an H100", "round it down")
    negative = lambda memory, utilization, weights, per_sequence: int((utilization * memory - weights) // per_sequence)
    result = run_cases(get("ex02.3"), negative)
    assert result.status == FAILED and "never a negative count" in result.message



def test_torchs_fused_attention_is_refused():
    def fused(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    result = fails("ex02.2", fused, "MHA", "it comes from torch's scaled_dot_product_attention")
    assert "hint:" not in result.message
