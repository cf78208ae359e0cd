"""Notebook 02 (KV memory): the cache's size, attention with shared KV heads, what fits a GPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from labkit import memory
from labkit.exercises.spec import Case, Exercise
from labkit.presets import GPU_PRESETS, MODEL_PRESETS


def _bytes_cases() -> list[Case]:
    runs = [  # preset, KV heads (None: its own), tokens, batch, cache dtype
        ("Llama-2-70B with GQA (8 KV heads), 2,048 tokens, fp16", "Llama-2-70B", None, 2048, 1, "fp16"),
        ("Llama-2-70B as if MHA (64 KV heads), 2,048 tokens, fp16", "Llama-2-70B", 64, 2048, 1, "fp16"),
        ("Llama-3.1-8B, 32K tokens, MQA (1 KV head), fp16", "Llama-3.1-8B", 1, 32768, 1, "fp16"),
        ("Mistral-7B, batch 16 of 4,096 tokens, int8", "Mistral-7B", None, 4096, 16, "int8"),
        ("Gemma-2-9B (head_dim 256), 8,192 tokens, fp32", "Gemma-2-9B", None, 8192, 1, "fp32"),
        ("Qwen2.5-7B, 1,000 tokens, batch 3, int4", "Qwen2.5-7B", None, 1000, 3, "int4"),
        ("Llama-3.1-8B, 4,096 tokens, bf16", "Llama-3.1-8B", None, 4096, 1, "bf16"),
        ("Llama-3.1-8B, batch 2 of 4,096 tokens, fp8", "Llama-3.1-8B", None, 4096, 2, "fp8"),
    ]
    cases = []
    for label, name, kv_heads, tokens, batch, dtype in runs:
        shape = MODEL_PRESETS[name] if kv_heads is None else MODEL_PRESETS[name].with_kv_heads(kv_heads)
        args = (shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.head_dim, tokens, batch, dtype)
        cases.append(Case(label, args, memory.kv_cache_bytes(shape, tokens, batch, dtype)))
    return cases


def reference_gqa_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention with torch's fused kernel, each KV head shared by a group of query heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _gqa_cases() -> list[Case]:
    shapes = [  # batch, query heads, KV heads, tokens, head_dim
        ("MHA: 4 query heads, 4 KV heads", (1, 4, 4, 6, 16)),
        ("GQA: 8 query heads in 2 groups of 4, batch 2", (2, 8, 2, 9, 32)),
        ("GQA: 6 query heads in 3 groups of 2", (1, 6, 3, 5, 8)),
        ("MQA: 8 query heads share 1 KV head", (1, 8, 1, 7, 16)),
        ("one token", (1, 4, 2, 1, 8)),
    ]
    generator = torch.Generator().manual_seed(2)
    cases = []
    for label, (batch, heads, kv_heads, tokens, dim) in shapes:
        q = torch.randn(batch, heads, tokens, dim, generator=generator)
        k, v = (torch.randn(batch, kv_heads, tokens, dim, generator=generator) for _ in range(2))
        cases.append(Case(label, (q, k, v), reference_gqa_attention(q, k, v), rtol=1e-4, atol=1e-5))
    return cases


def _batch_cases() -> list[Case]:
    runs = [  # model, GPU, tokens per sequence, weight dtype, cache dtype, utilization
        ("Llama-3.1-8B on an H100 at 8K tokens", "Llama-3.1-8B", "H100-SXM", 8192, "bf16", "fp16", 0.9),
        ("Llama-2-7B (MHA) on an A100 40GB at 4K tokens", "Llama-2-7B", "A100-40GB", 4096, "fp16", "fp16", 0.9),
        ("Llama-2-70B in int4 on an H200 at 2K tokens, fp8 cache", "Llama-2-70B", "H200", 2048, "int4", "fp8", 0.95),
        ("Mistral-7B on an L4 at 32K tokens", "Mistral-7B", "L4", 32768, "bf16", "fp16", 0.9),
    ]
    cases = []
    for label, name, gpu_name, tokens, weight_dtype, kv_dtype, utilization in runs:
        shape, gpu = MODEL_PRESETS[name], GPU_PRESETS[gpu_name]
        args = (gpu.memory_bytes, utilization, memory.weight_bytes(shape, weight_dtype),
                memory.kv_cache_bytes(shape, tokens, 1, kv_dtype))
        cases.append(Case(label, args, memory.max_batch(shape, gpu, tokens, weight_dtype, kv_dtype, utilization)))
    cases.append(Case("the weights alone overflow: nothing fits", (24e9, 0.9, 140e9, 1e9), 0))
    return cases


EXERCISES = [
    Exercise(
        id="ex02.1", title="KV-cache bytes", points=1, function="kv_cache_bytes",
        cases=_bytes_cases,
        recipe="Every layer stores a key and a value (2) per KV head (not per query head), each head_dim "
             "elements, for every token of every sequence: multiply them all, and the bytes per element.",
    ),
    Exercise(
        id="ex02.2", title="Grouped-query attention", points=2, function="gqa_attention",
        cases=_gqa_cases,
        recipe="With g = query heads // KV heads, KV head j serves query heads j*g .. j*g+g-1: view q as "
             "[batch, kv_heads, g, T, head_dim] and index k and v with [:, :, None] so they broadcast over "
             "the group. Mask the future with -inf before the softmax (query i sees keys 0..i), scale the "
             "scores by 1/sqrt(head_dim), and reshape the result back to [batch, n_heads, T, head_dim].",
    ),
    Exercise(
        id="ex02.3", title="The largest batch that fits", points=1, function="largest_batch",
        cases=_batch_cases,
        recipe="Usable memory is utilization x GPU memory; the weights take their share first; every "
             "sequence then needs its own KV cache. Round down, and never go below 0.",
    ),
]
