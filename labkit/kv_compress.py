"""Shrinking the KV cache beyond GQA/MQA: keep fewer tokens, or fewer bits per value.

- Fewer tokens: attention sinks plus a sliding window (StreamingLLM, Xiao et al. 2023). A query
  at position p attends to the first ``sinks`` tokens, kept forever, and to the last ``window``
  ones, itself included:

      allowed(p, j) = j <= p  and  (j < sinks  or  p - window < j)

  so each layer holds at most sinks + window tokens, however long the text. The paper found
  that a plain sliding window (no sinks) breaks down once the first tokens leave it: softmax
  must put its weight somewhere, and trained models park much of it on the first tokens,
  whatever those say.
  ``attention_on_first`` measures how much attention a model's queries give its first tokens.
- Fewer bits: each key and value vector x (one token, one KV head) is stored as int8 with one
  fp32 scale:

      scale = max|x| / 127,   q = round(x / scale) in [-127, 127],   x ~ q * scale

  at most scale / 2 off per element, in (head_dim + 4) / (4 * head_dim) of the fp32 bytes
  (about a quarter; (head_dim + 4) / (2 * head_dim), about a half, of fp16).

Both are caches with the model's ``KVCache`` interface (a plan per step, then ``attend``): the
model does not change.
``cached_perplexity`` (one text) and ``cached_perplexities`` (a batch of them) measure what each costs in quality.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from labkit.model import (AttentionPlan, ContiguousKVCache, ModelConfig, RowCache, Transformer, attention,
                          causal_mask, kv_layout)
from labkit.validate import check_counts, check_positions

INT8_MAX = 127


def sink_window_mask(query_positions: Tensor, key_positions: Tensor, sinks: int, window: int) -> Tensor:
    """[T, S]: True where a query at position p may see a key at position j (j <= p, and j < sinks
    or p - window < j)."""
    q, k = query_positions[:, None], key_positions[None, :]
    return (k <= q) & ((k < sinks) | (k > q - window))


@dataclass(frozen=True, eq=False)
class SinkPlan(AttentionPlan):
    """A step through a ``SinkCache``: what each query sees of the held keys followed by the new
    ones, ``mask`` ``[B, 1, T, held + T]``, and which of them every layer keeps, and at which positions."""

    mask: Tensor
    keep: Tensor
    kept_positions: Tensor


class SinkCache:
    """Attention sinks plus a sliding window: per layer, the first ``sinks`` tokens and the last
    ``window`` ones, ``[batch, n_kv_heads, <= sinks + window, head_dim]``, and their positions.

    Keys keep the rotary angles of their absolute positions (the model rotates them before they
    reach the cache). That is exact here, as a labkit model is never run past its context. The
    paper instead numbers positions by slot inside the cache, so that a model can stream text
    longer than it was trained on; this version does not need that.

    All rows of a batch must be at the same positions (no padding): one set of kept positions
    serves every sequence.
    """

    def __init__(self, config: ModelConfig, batch_size: int = 1, sinks: int = 4, window: int = 256,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if sinks < 0:
            raise ValueError(f"sinks={sinks} must be 0 (a plain sliding window) or more")
        if window < 1:
            raise ValueError(f"window={window} must be at least 1: a query always sees its own token")
        check_counts(batch_size=batch_size)
        self.sinks, self.window, self.batch_size, self.max_seq_len = sinks, window, batch_size, config.max_seq_len
        self.layout = kv_layout(config)
        empty = torch.zeros(batch_size, config.n_kv_heads, 0, config.head_dim, dtype=dtype, device=device)
        self.k = [empty] * config.n_layers
        self.v = [empty] * config.n_layers
        self.held = [torch.zeros(0, dtype=torch.long, device=device)] * config.n_layers  # positions, in order

    @property
    def positions(self) -> Tensor:
        """The positions of the tokens held (every layer holds the same ones)."""
        return self.held[0]

    def plan(self, positions: Tensor) -> SinkPlan:
        """The mask over the held keys followed by the new ones, and which of them to keep."""
        self._check(positions)
        query = positions[0]
        keys = torch.cat([self.positions, query])
        mask = sink_window_mask(query, keys, self.sinks, self.window)
        keep = (keys < self.sinks) | (keys > int(query.max()) - self.window)  # what later queries can see
        return SinkPlan(self, positions, mask[None, None].expand(self.batch_size, 1, -1, -1), keep, keys[keep])

    def _check(self, positions: Tensor) -> None:
        check_positions(positions)
        if positions.shape[0] != self.batch_size:
            raise ValueError(f"positions has {positions.shape[0]} rows; this cache holds batch_size={self.batch_size}")
        if (positions < 0).any():
            raise ValueError("SinkCache takes no padding (position -1): give every row the same positions, "
                             "or use one cache per sequence")
        differs = (positions != positions[:1]).any(dim=1)
        if differs.any():
            raise ValueError(f"SinkCache needs every row of the batch at the same positions, but row "
                             f"{int(differs.nonzero()[0])} differs from row 0: use one cache per sequence")
        first, last = int(positions[0].min()), int(positions[0].max())
        if self.positions.numel() and first <= int(self.positions.max()):
            raise ValueError(f"position {first} is not after the last one held "
                             f"({int(self.positions.max())}): a SinkCache only appends")
        if last >= self.max_seq_len:
            raise ValueError(f"position {last} is past the context limit max_seq_len={self.max_seq_len}")

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, plan: SinkPlan) -> Tensor:
        keys = torch.cat([self.k[layer], k.to(self.k[layer].dtype)], dim=2)
        values = torch.cat([self.v[layer], v.to(self.v[layer].dtype)], dim=2)
        self.k[layer], self.v[layer] = keys[:, :, plan.keep], values[:, :, plan.keep]
        self.held[layer] = plan.kept_positions
        return attention(q, keys, values, plan.mask)

    @property
    def max_tokens(self) -> int:
        """The most tokens one layer holds between forward calls."""
        return self.sinks + self.window

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values held now, over all layers."""
        return sum(t.nbytes for t in self.k + self.v)


class _FirstTokensProbe:
    """For one forward pass without a cache: causal attention written out, each layer's softmax
    weights kept long enough to sum those on the first ``first`` keys."""

    def __init__(self, first: int) -> None:
        self.first, self.mass = first, []

    def plan(self, positions: Tensor) -> AttentionPlan:
        return AttentionPlan(self, positions)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan) -> Tensor:
        batch, heads, length, dim = q.shape
        grouped = q.view(batch, k.shape[1], heads // k.shape[1], length, dim)  # the query heads of each KV head
        scores = grouped @ k[:, :, None].transpose(-2, -1) / math.sqrt(dim)  # [B, kv, group, T, T]
        allowed = causal_mask(plan.positions, plan.positions)[:, :, None]  # [B, 1, 1, T, T]
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        self.mass.append(weights[..., :self.first].sum(dim=-1).mean(dim=(0, 1, 2)))  # [T]
        return (weights @ v[:, :, None]).reshape(batch, heads, length, dim)


def attention_on_first(model: Transformer, tokens: Tensor, first: int = 4) -> Tensor:
    """``[n_layers, T]``: the share of its attention (summed softmax weights) that the query at each
    position gives the first ``first`` tokens, in each layer, averaged over the query heads and the
    rows of ``tokens`` ``[B, T]`` (or one sequence ``[T]``). Spread evenly over the p + 1 tokens it
    sees, a query at position p would give them min(first, p + 1) / (p + 1); an attention sink
    shows as a share far above that, and stays high however long the text."""
    tokens = torch.as_tensor(tokens, device=model.device)
    tokens = tokens[None] if tokens.dim() == 1 else tokens
    if tokens.dim() != 2 or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be [T] or [batch, T] with T >= 1, got shape {tuple(tokens.shape)}")
    check_counts(first=first)
    probe = _FirstTokensProbe(first)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    with torch.no_grad():
        model(tokens, plan=probe.plan(positions))
    return torch.stack(probe.mass).cpu()


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """int8 values and fp32 scales ``[..., 1]``, one per vector along the last dimension. An
    all-zero vector gets scale 1 (its values are 0 whatever the scale)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float() / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x.float() / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """fp32 vectors back from int8 values and their scales ``[..., 1]``."""
    if q.dtype != torch.int8:
        raise ValueError(f"q must be int8 (from quantize_int8), got {q.dtype}")
    return q.float() * scale


class Int8KVCache(ContiguousKVCache):
    """The contiguous cache with int8 keys and values, ``[layers, batch, n_kv_heads, max_len,
    head_dim]``, and an fp32 scale per vector, ``[layers, batch, n_kv_heads, max_len, 1]``.

    It keeps the contiguous cache's plan and ``attend``, and changes only how a slot is written
    (quantized) and read back (dequantized, in the dtype of the queries).
    Dequantizing the whole cache at every step costs time: this saves memory, not time, unless
    a kernel reads int8 directly.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(config, batch_size, max_len, dtype=torch.int8, device=device)
        scale_shape = (*self.k.shape[:-1], 1)
        self.k_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
        self.v_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)

    def _write(self, layer: int, rows: Tensor | int, slots: Tensor | slice, k: Tensor, v: Tensor) -> None:
        for stored, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            stored[layer, rows, :, slots], scales[layer, rows, :, slots] = quantize_int8(new)

    def _read(self, layer: int, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        keys = dequantize_int8(self.k[layer, :, :, :length], self.k_scale[layer, :, :, :length])
        values = dequantize_int8(self.v[layer, :, :, :length], self.v_scale[layer, :, :, :length])
        return keys.to(dtype), values.to(dtype)

    @property
    def nbytes(self) -> int:
        """int8 keys and values plus their fp32 scales."""
        return super().nbytes + self.k_scale.nbytes + self.v_scale.nbytes


def cached_perplexity(model: Transformer, tokens: list[int] | Tensor, cache: RowCache, chunk: int = 32) -> float:
    """exp(mean negative log-likelihood) of each token given those before it, the sequence fed
    through ``cache`` (fresh, batch size 1) ``chunk`` tokens per forward call at positions 0, 1, ...:
    the model's perplexity when its attention reads only what the cache gives back."""
    ids = torch.as_tensor(tokens).long()
    if ids.dim() != 1:
        raise ValueError(f"tokens must be one sequence (1-D), got shape {tuple(ids.shape)}")
    return float(cached_perplexities(model, ids[None], cache, chunk)[0])


def cached_perplexities(model: Transformer, texts: Tensor, cache: RowCache, chunk: int = 32) -> Tensor:
    """``cached_perplexity`` of each row of ``texts`` ``[batch, T]``, as a float64 tensor ``[batch]``
    on the CPU: the rows fed together through ``cache`` (fresh, one row per text), all at the same
    positions, as a ``SinkCache`` needs. Fewer, larger forward calls than one text at a time, the
    same perplexities to float rounding."""
    ids = torch.as_tensor(texts, device=model.device).long()
    if ids.dim() != 2:
        raise ValueError(f"texts must be [batch, T], got shape {tuple(ids.shape)}")
    batch, n = ids.shape
    if batch < 1:
        raise ValueError("texts has no rows: give at least one text")
    if n < 2:
        raise ValueError(f"perplexity needs at least 2 tokens (one to read, one to predict), got {n}")
    if n > model.config.max_seq_len:
        raise ValueError(f"{n} tokens do not fit the context limit max_seq_len={model.config.max_seq_len}")
    check_counts(chunk=chunk)
    nll = torch.zeros(batch, dtype=torch.float64)
    for start in range(0, n - 1, chunk):  # the last token is only predicted, never fed
        end = min(start + chunk, n - 1)
        positions = torch.arange(start, end, device=ids.device).repeat(batch, 1)
        with torch.inference_mode():
            logits = model(ids[:, start:end], plan=cache.plan(positions)).float()
        losses = F.cross_entropy(logits.flatten(0, 1), ids[:, start + 1:end + 1].flatten(), reduction="none")
        nll += losses.view(batch, -1).sum(dim=1).cpu().double()  # float64 on the CPU: MPS has none
    return torch.exp(nll / (n - 1))
