"""Where the memory goes when serving a model: its weights, and the KV cache.

Every layer keeps a key and a value vector per KV head for every token of every sequence:

    KV cache bytes = 2 (K and V) x layers x kv_heads x head_dim x tokens x batch x bytes per element

MHA has as many KV heads as query heads, GQA a few (each shared by a group of query heads),
MQA one. DeepSeek's multi-head latent attention (MLA) caches instead one compressed latent per
token and layer, ``kv_lora_rank + qk_rope_head_dim`` elements, shared by all heads:

    MLA cache bytes = layers x (kv_lora_rank + rope_dim) x tokens x batch x bytes per element

What fits on a GPU with ``memory`` bytes used up to a fraction ``utilization``:

    largest batch = floor((utilization x memory - weight bytes) / KV bytes of one sequence)

A paged cache (notebook 03) holds a sequence of L tokens in ceil(L / block_size) blocks, where a
contiguous one reserves the whole context for it; ``fragmentation`` compares the two.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from labkit.answers import answer_to
from labkit.hardware import Hardware
from labkit.model import ModelConfig
from labkit.validate import check_counts

GIB = 2**30
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class ModelShape:
    """What memory planning needs to know of a model: its size and its attention's shape."""

    name: str
    n_params: float
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_context: int
    mla_latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim; 0 for MHA/GQA/MQA
    d_model: int | None = None  # the residual stream's width (hidden_size); None: n_heads x head_dim

    def __post_init__(self) -> None:
        sizes = {"n_layers": self.n_layers, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                 "head_dim": self.head_dim, "max_context": self.max_context}
        if (bad := next((k for k, v in sizes.items() if v < 1), None)) is not None:
            raise ValueError(f"{self.name}: {bad}={sizes[bad]} must be at least 1")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.d_model is None:  # Llama-style models; Gemma-2 and DeepSeek-V3 differ and say so
            object.__setattr__(self, "d_model", self.n_heads * self.head_dim)

    def with_kv_heads(self, n_kv_heads: int) -> ModelShape:
        """The same model with another number of KV heads (MHA, GQA or MQA): one that does not
        divide ``n_heads`` is refused (``__post_init__``)."""
        return ModelShape(**{**self.__dict__, "n_kv_heads": n_kv_heads, "mla_latent_dim": 0})


def shape_of(name: str, config: ModelConfig, n_params: float) -> ModelShape:
    """A labkit model's shape, for the same formulas as the published presets."""
    return ModelShape(name, n_params, config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim,
                      config.max_seq_len, d_model=config.d_model)


def bytes_per_element(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(DTYPE_BYTES)}") from None


@answer_to("ex02.1")
def kv_bytes_per_token(model: ModelShape, dtype: str = "fp16") -> float:
    """KV-cache bytes one token of one sequence takes, over all layers."""
    per_layer = model.mla_latent_dim or 2 * model.n_kv_heads * model.head_dim
    return model.n_layers * per_layer * bytes_per_element(dtype)


@answer_to("ex02.1")
def kv_cache_bytes(model: ModelShape, seq_len: int, batch: int = 1, dtype: str = "fp16") -> float:
    """KV-cache bytes for ``batch`` sequences of ``seq_len`` tokens."""
    if seq_len < 0 or batch < 0:
        raise ValueError(f"seq_len={seq_len} and batch={batch} must not be negative")
    return kv_bytes_per_token(model, dtype) * seq_len * batch


def weight_bytes(model: ModelShape, dtype: str = "bf16") -> float:
    return model.n_params * bytes_per_element(dtype)


def kv_tokens_per_gib(model: ModelShape, dtype: str = "fp16") -> float:
    """How many tokens of KV cache one GiB holds."""
    return GIB / kv_bytes_per_token(model, dtype)


def check_utilization(utilization: float) -> None:
    """The share of a GPU's memory a server may use: in (0, 1], not a percentage."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization={utilization} must be in (0, 1] (a share of the memory, not a percentage)")


def _free_for_kv(model: ModelShape, gpu: Hardware, weight_dtype: str, utilization: float) -> float:
    check_utilization(utilization)
    free = utilization * gpu.memory_bytes - weight_bytes(model, weight_dtype)
    if free <= 0:
        need = weight_bytes(model, weight_dtype) / GIB
        raise ValueError(f"{model.name} weights in {weight_dtype} ({need:.1f} GiB) do not fit "
                         f"{utilization:.0%} of {gpu.name}'s {gpu.memory_bytes / GIB:.1f} GiB")
    return free


@answer_to("ex02.3")
def max_batch(model: ModelShape, gpu: Hardware, seq_len: int, weight_dtype: str = "bf16",
              kv_dtype: str = "fp16", utilization: float = 0.9) -> int:
    """The most sequences of ``seq_len`` tokens whose KV cache fits beside the weights. Memory only: a
    ``seq_len`` past ``model.max_context`` is counted too (notebook 02 asks what such a cache would take),
    so a caller that plans real requests checks the model's limit itself, as ``max_context`` does."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1")
    free = _free_for_kv(model, gpu, weight_dtype, utilization)
    return math.floor(free / kv_cache_bytes(model, seq_len, 1, kv_dtype))


def max_context(model: ModelShape, gpu: Hardware, batch: int = 1, weight_dtype: str = "bf16",
                kv_dtype: str = "fp16", utilization: float = 0.9) -> int:
    """The longest context ``batch`` sequences can each have, capped at the model's limit."""
    if batch < 1:
        raise ValueError(f"batch={batch} must be at least 1")
    free = _free_for_kv(model, gpu, weight_dtype, utilization)
    return min(model.max_context, math.floor(free / (batch * kv_bytes_per_token(model, kv_dtype))))


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that ``n_tokens`` tokens occupy: ceil(n_tokens / block_size)."""
    return -(-n_tokens // block_size)


def num_blocks_for_memory(model: ModelShape, memory_bytes: float, block_size: int, dtype: str = "fp16") -> int:
    """How many blocks of a paged cache a memory budget holds, at ``kv_bytes_per_token``."""
    if memory_bytes < 0 or block_size < 1:
        raise ValueError(f"memory_bytes={memory_bytes} must be >= 0 and block_size={block_size} >= 1")
    return math.floor(memory_bytes / (kv_bytes_per_token(model, dtype) * block_size))


def fragmentation(lengths: Sequence[int], context: int, block_size: int) -> dict[str, float]:
    """Memory, in token slots, for sequences of ``lengths`` tokens: reserved by contiguous
    allocation of ``context`` slots each, held by paged blocks, and the share of each not used."""
    if not lengths or min(lengths) < 1 or max(lengths) > context:
        raise ValueError(f"lengths must be a non-empty list of 1..context={context} tokens")
    check_counts(block_size=block_size)
    used = sum(lengths)
    reserved = len(lengths) * context
    held = sum(blocks_for(n, block_size) for n in lengths) * block_size
    return {"used": used, "contiguous_reserved": reserved, "paged_held": held,
            "contiguous_waste": 1 - used / reserved, "paged_waste": 1 - used / held}
