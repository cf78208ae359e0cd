"""A KV cache a compiler can capture whole: fixed shapes, tensor positions, no trip to the host.

The contiguous cache of notebook 01 plans each step on the host: it reads the positions
(``tolist``), picks a slice or index tensors, and attends over exactly the slots in use, so its
shapes change with every token. That is fast in eager mode and fatal to a compiler: each new
length is a new graph, and each ``tolist`` stops the graph and waits for the device.

``StaticKVCache`` keeps ``[batch, n_kv_heads, max_len + 1, head_dim]`` per layer and plans every
step from tensors alone:

- a token at position p is written to slot p of its row with ``index_put_`` (a scatter whose
  indices are tensors); padding (position -1) is sent to the spare last slot, which no query
  ever reads, so a padded row writes nowhere that matters;
- attention always reads all ``max_len`` slots, and a boolean mask built from the positions
  (slot <= position) hides the ones not yet written.

So every decode step has the same shapes and the same operations whatever its positions: what
``torch.compile(fullgraph=True)`` and CUDA graph capture need. The price is attention over
``max_len`` slots at every step, which is why the maximum length is chosen per generation.
The cache trusts its positions (checking them would read them on the host): its callers keep
them in 0..max_len - 1, or -1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from labkit.answers import answer_to
from labkit.model import AttentionPlan, ModelConfig, Transformer, attention, cache_length, kv_layout
from labkit.validate import check_counts, check_positions


LENGTH_STEP = 256


def static_length(config: ModelConfig, tokens: int) -> int:
    """The cache length for a generation of ``tokens`` tokens: rounded up to a multiple of
    ``LENGTH_STEP`` (at most the model's context), so that generations of similar lengths share
    one compiled step instead of compiling one each."""
    return min(config.max_seq_len, -(-tokens // LENGTH_STEP) * LENGTH_STEP)


def decode_static(model: Transformer, cache: StaticKVCache, tokens: Tensor, positions: Tensor) -> Tensor:
    """One step through the static cache: logits ``[B, T, vocab]``. The step that
    ``labkit.compile`` compiles and ``labkit.cuda_graphs`` records."""
    return model(tokens, plan=cache.plan(positions))


@dataclass(frozen=True, eq=False)
class StaticPlan(AttentionPlan):
    """Where a step's tokens go in a ``StaticKVCache`` (``slots`` ``[B, T]``: the position, or the
    spare slot for padding) and what each query sees (``mask`` ``[B, 1, T, max_len]``)."""

    slots: Tensor
    mask: Tensor


class StaticKVCache:
    """A preallocated cache of ``batch_size`` rows of ``max_len`` slots whose plans are pure tensor
    arithmetic on the positions (see the module's docstring)."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.max_len, self.layout = cache_length(config, max_len), kv_layout(config)
        check_counts(batch_size=batch_size)
        shape = (batch_size, config.n_kv_heads, self.max_len + 1, config.head_dim)
        # one tensor per layer, not one for all: a compiled step then writes each in place, where a
        # write into a slice of one shared tensor makes the compiler copy the whole cache, layer by layer
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.key_slots = torch.arange(self.max_len, device=device)
        self.rows = torch.arange(batch_size, device=device)[:, None]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    def first_rows(self, n: int) -> StaticKVCache:
        """A cache of this one's first ``n`` rows, sharing its memory: a step planned on it writes
        and reads those rows here (how one cache serves graphs of several batch sizes)."""
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"n={n} must be in 1..batch_size={self.batch_size}")
        return self.with_tensors([k[:n] for k in self.k], [v[:n] for v in self.v], self.key_slots, self.rows[:n])

    def with_tensors(self, k: list[Tensor], v: list[Tensor], key_slots: Tensor, rows: Tensor) -> StaticKVCache:
        """A cache of this one's length whose tensors are the ones given (no copy): a view of some
        of its rows, or its own tensors reached another way (``labkit.aot`` reads them as a module's
        buffers, so that ``torch.export`` sees them as state it may write)."""
        view = object.__new__(StaticKVCache)
        view.max_len, view.k, view.v, view.key_slots, view.rows = self.max_len, k, v, key_slots, rows
        view.layout = self.layout
        return view

    @answer_to("ex08.1")
    def plan(self, positions: Tensor) -> StaticPlan:
        """The plan of a step whose tokens are at ``positions`` ``[batch_size, T]`` (-1: padding),
        made without reading them on the host: a padding token is written to the spare slot, and
        a query sees every slot at or before its position (a padding query sees every slot, so
        that its ignored output stays finite)."""
        check_positions(positions)
        if positions.shape[0] != self.batch_size:
            raise ValueError(f"a batch of {positions.shape[0]} sequences for a cache of {self.batch_size}")
        slots = torch.where(positions >= 0, positions, self.max_len)
        query = positions[:, None, :, None]
        mask = (self.key_slots <= query) | (query < 0)
        return StaticPlan(self, positions, slots, mask)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, plan: StaticPlan) -> Tensor:
        rows = self.rows.expand_as(plan.slots)
        # [B, kv, T, d] -> [B, T, kv, d]: the values written at (row, :, slot)
        self.k[layer][rows, :, plan.slots] = k.transpose(1, 2).type_as(self.k[layer])
        self.v[layer][rows, :, plan.slots] = v.transpose(1, 2).type_as(self.v[layer])
        keys, values = self.k[layer][:, :, :self.max_len], self.v[layer][:, :, :self.max_len]
        return attention(q, keys, values, plan.mask)
