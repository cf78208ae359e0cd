"""CUDA graphs for the engine: its decode steps through the paged cache, one graph per bucket.

The engine's steps change shape all the time: which sequences run, how long each is, whether a
prompt joins. Only one kind of step is both frequent and regular, a batch of sequences that
each decode one token, and that is the step nano-vllm and vLLM record. It becomes static:

- its inputs live in buffers of the bucket's size: the tokens and positions, each token's cache
  slot, the block tables padded to the longest a sequence can have (``max_seq_len``), and each
  sequence's length; the host fills them before each replay;
- attention reads the blocks through those tables (on a GPU the cache's Triton decode kernel if
  it has one, else a gather of every table's blocks, masked by the lengths), so nothing depends
  on the lengths' values;
- a batch is padded up to its bucket with rows that write their keys and values to the cache's
  spare block (``PagedKVCache(spare_block=True)``), which the allocator never hands out.

Steps with a prompt or a chunk of one in them run eagerly, as before.
"""
from __future__ import annotations

import inspect

import torch
from torch import Tensor

from labkit.cuda_graphs import bucket_for, buckets, record, require_cuda
from labkit.memory import blocks_for
from labkit.model import AttentionPlan, Transformer
from labkit.paged import PagedKVCache, Run
from labkit.paged_attention import attend_blocks, slot_mapping


class StaticPagedDecode:
    """A decode step of ``rows`` sequences through ``cache`` that reads only static buffers: the
    step a graph records (on any device it also runs as it is, eagerly, which is how a CPU checks
    it). ``load`` fills the buffers for a batch; ``forward`` gives the logits ``[rows, vocab]``."""

    def __init__(self, model: Transformer, cache: PagedKVCache, rows: int) -> None:
        if cache.spare_slot is None:
            raise ValueError("a graphed decode step pads its batch with rows that write to the cache's spare "
                             "block: build the cache with PagedKVCache(..., spare_block=True)")
        model.check_cache(cache)
        self.model, self.cache, self.rows, self.layout = model, cache, rows, cache.layout  # it stands in the plan
        block_size, device = cache.allocator.block_size, model.device
        self.width = blocks_for(model.config.max_seq_len, block_size)
        self.tokens = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), cache.spare_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros(rows, self.width, dtype=torch.long, device=device)
        self.lengths = torch.ones(rows, dtype=torch.long, device=device)
        self.key_slots = torch.arange(self.width * block_size, device=device)
        self.plan = AttentionPlan(self, self.positions)

    def load(self, runs: list[Run], tokens: list[int]) -> None:
        """Fill the buffers for one decode token per run, padding the rest of the rows."""
        allocator, pad = self.cache.allocator, self.rows - len(runs)
        if pad < 0 or any(n != 1 for _, _, n in runs):
            raise ValueError(f"a graphed step decodes one token for each of at most {self.rows} sequences")
        positions = torch.tensor([start for _, start, _ in runs] + [0] * pad)
        tables = torch.tensor([t + [0] * (self.width - len(t)) for t in (allocator.table(s) for s, _, _ in runs)]
                              + [[0] * self.width] * pad)
        real = torch.arange(self.rows) < len(runs)
        slots = torch.where(real, slot_mapping(tables, positions[:, None], allocator.block_size)[:, 0],
                            self.cache.spare_slot)
        self.tokens.copy_(torch.tensor([list(tokens) + [0] * pad]))
        self.positions.copy_(positions[None])
        self.slots.copy_(slots)
        self.tables.copy_(tables)
        self.lengths.copy_(torch.where(real, positions + 1, 1))

    def forward(self) -> Tensor:
        return self.model(self.tokens, plan=self.plan)[0]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan) -> Tensor:
        """The cache protocol's ``attend`` for this step: write each row's key and value at its slot,
        then attend over its blocks, as many keys as its length."""
        q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))  # [rows, heads, dim]
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]
        k_pool.flatten(0, 1)[self.slots] = k.type_as(k_pool)
        v_pool.flatten(0, 1)[self.slots] = v.type_as(v_pool)
        if self.cache.decode_kernel is not None and q.is_cuda:  # Triton's: told not to read its operands
            out = self.cache.decode_kernel(q, k_pool, v_pool, self.tables, self.lengths, ranges=False)
        else:
            mask = (self.key_slots < self.lengths[:, None])[:, None, None]  # [rows, 1, 1, keys]
            out = attend_blocks(q[:, :, None], k_pool, v_pool, self.tables, mask)[:, :, 0]
        return out.transpose(0, 1)[None]


class PagedGraphs:
    """One recorded ``StaticPagedDecode`` per batch-size bucket up to ``max_batch``, sharing one
    memory pool (recorded largest first). ``graphs(runs, tokens)``: the logits ``[len(runs), vocab]``
    of a decode step, replayed from the smallest bucket that holds it."""

    def __init__(self, model: Transformer, cache: PagedKVCache, max_batch: int) -> None:
        kernel = cache.decode_kernel
        if kernel is not None and "ranges" not in inspect.signature(kernel).parameters:
            raise ValueError(f"decode_kernel {getattr(kernel, '__name__', kernel)!r} cannot run in a CUDA graph: a "
                             "recorded step may not read its operands on the host, so the kernel must take "
                             "ranges=False and then skip its range checks, as labkit.kernels.paged_decode does")
        require_cuda(model.device)
        self.sizes, self.max_batch = buckets(max_batch), max_batch
        pool = torch.cuda.graph_pool_handle()
        self.steps: dict[int, tuple[StaticPagedDecode, torch.cuda.CUDAGraph, Tensor]] = {}
        for size in reversed(self.sizes):
            step = StaticPagedDecode(model, cache, size)
            self.steps[size] = (step, *record(step.forward, model.device, pool))

    def __call__(self, runs: list[Run], tokens: list[int]) -> Tensor:
        step, graph, logits = self.steps[bucket_for(len(runs), self.sizes)]
        step.load(runs, tokens)
        graph.replay()
        return logits[:len(runs)]
