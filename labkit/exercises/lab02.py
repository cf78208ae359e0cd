"""Notebook 02 (KV memory): the cache's size, attention with shared KV heads, what fits a GPU."""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from labkit import memory
from labkit.exercises.spec import Case, Exercise, SaysWhatToDo
from labkit.presets import GPU_PRESETS, MODEL_PRESETS


def _bytes_cases() -> list[Case]:
    runs = [  # preset, KV heads (None: its own), tokens, batch, cache dtype, what the case tests
        ("Llama-2-70B as if MHA (64 KV heads), 2,048 tokens, fp16", "Llama-2-70B", 64, 2048, 1, "fp16",
         "MHA, where both head counts are equal: if this fails, the formula itself is off (a key AND a value, "
         "per layer, per head, per token, head_dim elements each, times the bytes of one element: bytes, not "
         "bits, so 2 for fp16; and the count in bytes, not GB or GiB)"),
        ("Llama-2-70B with GQA (8 KV heads), 2,048 tokens, fp16", "Llama-2-70B", None, 2048, 1, "fp16",
         "GQA: 64 query heads but only 8 KV heads. Which of the two head counts has a key and a value in "
         "the cache?"),
        ("Llama-3.1-8B, 32K tokens, MQA (1 KV head), fp16", "Llama-3.1-8B", 1, 32768, 1, "fp16",
         "MQA: a single KV head serves all 32 query heads, so the cache is 32 times smaller than MHA's"),
        ("Mistral-7B, batch 16 of 4,096 tokens, int8", "Mistral-7B", None, 4096, 16, "int8",
         "a batch of 16: every sequence keeps a cache of its own; and int8 takes 1 byte per element"),
        ("Gemma-2-9B (head_dim 256), 8,192 tokens, fp32", "Gemma-2-9B", None, 8192, 1, "fp32",
         "fp32 is 4 bytes per element; and Gemma-2's heads are 256 wide, so take head_dim as given"),
        ("Qwen2.5-7B, 1,000 tokens, batch 3, int4", "Qwen2.5-7B", None, 1000, 3, "int4",
         "int4 is half a byte per element: make sure no integer division rounds that half away"),
        ("Llama-3.1-8B, 4,096 tokens, bf16", "Llama-3.1-8B", None, 4096, 1, "bf16",
         "bf16 is 2 bytes per element, like fp16: is it among the dtypes you handle?"),
        ("Llama-3.1-8B, batch 2 of 4,096 tokens, fp8", "Llama-3.1-8B", None, 4096, 2, "fp8",
         "fp8 is 1 byte per element, like int8: is it among the dtypes you handle, with the right size?"),
    ]
    cases = []
    for label, name, kv_heads, tokens, batch, dtype, hint in runs:
        shape = MODEL_PRESETS[name] if kv_heads is None else MODEL_PRESETS[name].with_kv_heads(kv_heads)
        args = (shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.head_dim, tokens, batch, dtype)
        cases.append(Case(label, args, float(memory.kv_cache_bytes(shape, tokens, batch, dtype)), hint=hint))
    return cases


def reference_gqa_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention with torch's fused kernel, each KV head shared by a group of query heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class _CopyWatch(TorchFunctionMode):
    """Watches one call of a student's ``gqa_attention``: remembers the first tensor computed from k
    alone, from v alone, or from the two alone, that holds more elements than they do (a copy of repeated
    heads: repeat_interleave, repeat, cat, reshape or contiguous of an expanded view; k and v stacked, then
    repeated). Views (k[:, :, None], expand, transpose)
    share k's memory and pass, as do operations that mix q with k, or attention weights with v."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        super().__init__()
        self.limit = k.numel()
        self.sources: dict[int, tuple[frozenset, Tensor]] = {}  # id -> (what it was computed from, the tensor)
        for name, tensor in (("q", q), ("k", k), ("v", v)):
            self._remember(tensor, frozenset(name))
        self.copy: str | None = None

    def _remember(self, tensor: Tensor, source: frozenset) -> None:
        self.sources[id(tensor)] = (source, tensor)  # the tensor is kept alive, so its id is not reused

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [self.sources[id(t)][0] for t in _tensors((args, kwargs)) if id(t) in self.sources]
        source = frozenset().union(*inputs)  # which of q, k and v the result was computed from
        for tensor in _tensors(out):
            if source:
                self._remember(tensor, source)
            held = tensor.untyped_storage().nbytes() // max(tensor.element_size(), 1)
            own = self.limit * len(source)  # what k, v, or the two stacked together hold
            if self.copy is None and source and source <= {"k", "v"} and held > own:
                name = getattr(func, "__name__", str(func))
                whose = " and ".join(sorted(source))
                self.copy = (f"{name} made a tensor from {whose} alone that holds {held / own:g} times "
                             f"{'its' if len(source) == 1 else 'their'} elements")
        return out


def _tensors(value: Any) -> list[Tensor]:
    """The tensors among the leaves of ``value`` (the lists of torch.cat's arguments, kwargs' dicts)."""
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, Tensor)]


class _ViewsCase(Case):
    """A case of ex02.2: the result must be right, and computed without copying k or v per query head."""

    def run(self, fn: Callable[..., Any]) -> None:
        watches = []

        @functools.wraps(fn)
        def watched(q, k, v):
            watches.append(_CopyWatch(q, k, v))
            with watches[-1]:
                return fn(q, k, v)

        super().run(watched)  # first the result: a wrong one is reported as such
        copy = next((watch.copy for watch in watches if watch.copy), None)
        if copy:
            raise SaysWhatToDo(f"the result is right, but {copy}: the text asks for views: expand (or a size-1 "
                               "axis, k[:, :, None]) shares k's memory; repeat_interleave, repeat, cat, or "
                               "reshaping an expanded k to n_heads heads copies each KV head once per query "
                               "head, the very memory GQA saves. Keep the group an axis of its own and let "
                               "broadcasting pair it with q's")


def _gqa_cases() -> list[Case]:
    shapes = [  # batch, query heads, KV heads, tokens, head_dim, what the case tests
        ("MHA: 4 query heads, 4 KV heads", (1, 4, 4, 6, 16),
         "one query head per KV head, plain causal attention: check the scale 1/sqrt(head_dim), that "
         "query i sees keys 0..i only (the future masked with -inf before the softmax), and that the softmax "
         "runs over the keys, the last dimension (each query's weights sum to 1)"),
        ("GQA: 8 query heads in 2 groups of 4, batch 2", (2, 8, 2, 9, 32),
         "query heads 0-3 share KV head 0 and 4-7 share KV head 1 (consecutive heads, not every other "
         "one); with batch 2, no shape may assume batch 1. The first case where a copy of k per query "
         "head would be larger than k: the check watches for one"),
        ("GQA: 6 query heads in 3 groups of 2", (1, 6, 3, 5, 8),
         "3 groups of 2: the group size is n_heads // n_kv_heads, read from the shapes, never a fixed number"),
        ("MQA: 8 query heads share 1 KV head", (1, 8, 1, 7, 16),
         "a single KV head serves every query head: the group axis is all 8 heads"),
        ("one token", (1, 4, 2, 1, 8),
         "T = 1: a single query sees only its own key, so the output is that token's value; a mask or "
         "a squeeze that assumes T > 1 breaks here"),
    ]
    generator = torch.Generator().manual_seed(2)
    cases = []
    for label, (batch, heads, kv_heads, tokens, dim), hint in shapes:
        q = torch.randn(batch, heads, tokens, dim, generator=generator)
        k, v = (torch.randn(batch, kv_heads, tokens, dim, generator=generator) for _ in range(2))
        cases.append(_ViewsCase(label, (q, k, v), reference_gqa_attention(q, k, v), rtol=1e-4, atol=1e-5, hint=hint,
                                refuses=(F.scaled_dot_product_attention,)))
    return cases


def _batch_cases() -> list[Case]:
    runs = [  # model, GPU, tokens per sequence, weight dtype, cache dtype, utilization, what the case tests
        ("Llama-3.1-8B on an H100 at 8K tokens", "Llama-3.1-8B", "H100-SXM", 8192, "bf16", "fp16", 0.9,
         "usable memory is utilization x memory_bytes, and the weights come out of it before any cache; what "
         "is left holds a whole number of sequences and a part of one: round it down"),
        ("Llama-2-7B (MHA) on an A100 40GB at 4K tokens", "Llama-2-7B", "A100-40GB", 4096, "fp16", "fp16", 0.9,
         "a big cache per sequence: round the count of sequences DOWN (a part of a sequence does not fit), "
         "and return an int"),
        ("Llama-2-70B in int4 on an H200 at 2K tokens, fp8 cache", "Llama-2-70B", "H200", 2048, "int4", "fp8", 0.95,
         "utilization is 0.95 here, not 0.9: use the argument, not a fixed fraction"),
        ("Mistral-7B on an L4 at 32K tokens", "Mistral-7B", "L4", 32768, "bf16", "fp16", 0.9,
         "only a few sequences fit: round down, and return a whole number (an int), not a float"),
    ]
    cases = []
    for label, name, gpu_name, tokens, weight_dtype, kv_dtype, utilization, hint in runs:
        shape, gpu = MODEL_PRESETS[name], GPU_PRESETS[gpu_name]
        args = (gpu.memory_bytes, utilization, memory.weight_bytes(shape, weight_dtype),
                memory.kv_cache_bytes(shape, tokens, 1, kv_dtype))
        cases.append(Case(label, args, memory.max_batch(shape, gpu, tokens, weight_dtype, kv_dtype, utilization),
                          hint=hint))
    cases.append(Case("the weights alone overflow: nothing fits", (24e9, 0.9, 140e9, 1e9), 0,
                      hint="the weights need more than the usable memory, so the room left is negative: the "
                           "answer is 0 sequences, never a negative count"))
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
