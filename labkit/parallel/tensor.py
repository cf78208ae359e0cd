"""Tensor parallelism (Megatron-style): every weight matrix split across W ranks, two all-reduces per layer.

A linear layer y = x W^T can be split two ways. **Column-parallel**: rank r keeps a slice of W's
rows (output features) and computes its slice of y from the whole x; no communication. **Row-
parallel**: rank r keeps a slice of W's columns (input features), takes the matching slice of x
and computes a partial sum; the sum over ranks, an all-reduce, is y. Chained, column then row,
the slice that the first layer leaves on a rank is exactly the input slice the second needs:

    attention:  wqkv column-parallel (whole heads: rank r runs n_heads / W query heads and
                their KV heads)  ->  attention per head, on the rank  ->  wo row-parallel, all-reduce
    MLP:        gate_up column-parallel (the same slice of gate and of up rows)  ->  silu(gate) * up
                ->  down row-parallel, all-reduce

so a layer costs two all-reduces of [tokens, d_model], and a rank stores 1/W of the projections
and of the KV cache. KV heads are split too, n_kv_heads / W per rank; when W exceeds the KV
heads (GQA with few, MQA with one) a rank keeps the one KV head its query heads share, so KV
heads are replicated W / n_kv_heads times, as vLLM does.

The embedding and the LM head are replicated: the vocabulary is 4,096 tokens, so they are small
here, and every rank then holds the same logits and samples the same token with no more
communication (a vocabulary-parallel head would split them and gather the logits). The norms
are replicated too: they act on the whole residual stream, which every rank holds.

A rank's shard is itself a ``Transformer``, of a ``ShardConfig``: the rank's query heads, KV
heads and MLP width around the whole model's d_model. So every cache (contiguous, paged) and
every loop (``generate``, the engine) runs on a shard unchanged, and its KV cache holds the
rank's KV heads only.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from labkit.answers import answer_to
from labkit.device import device_name, synchronize
from labkit.engine import Engine, Request
from labkit.generate import SamplingParams, decode_step, stream
from labkit.load import load, load_config
from labkit.hardware import Hardware
from labkit.interconnect import Link
from labkit.memory import blocks_for, shape_of
from labkit.model import ContiguousKVCache, ModelConfig, Transformer, forward_tokens, parameter_bytes
from labkit.parallel.launch import Rank, launch
from labkit.shapes import DTYPE_NAMES
from labkit.simulate import CostModel
from labkit.validate import check_counts, generation_prompts


@dataclass(frozen=True)
class ShardConfig(ModelConfig):
    """One rank's share of a model: its ``n_heads``, ``n_kv_heads`` and ``d_ff``; ``d_model`` stays the
    whole model's (the residual stream), and so the head dimension is given, not derived."""

    shard_head_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.shard_head_dim


def check_layout(config: ModelConfig, world_size: int) -> None:
    """A ValueError naming what does not divide, unless ``config`` splits over ``world_size`` ranks."""
    check_counts(world_size=world_size)
    kv = config.n_kv_heads
    problems = [f"n_heads={config.n_heads} is not a multiple of world_size={world_size}"
                if config.n_heads % world_size else "",
                f"d_ff={config.d_ff} is not a multiple of world_size={world_size}" if config.d_ff % world_size else "",
                f"n_kv_heads={kv} is not a multiple of world_size={world_size}"
                if world_size <= kv and kv % world_size else "",
                f"world_size={world_size} is not a multiple of n_kv_heads={kv} (to replicate KV heads, each "
                "rank's query heads must share one)" if world_size > kv and world_size % kv else ""]
    if any(problems):
        raise ValueError("cannot split the model over the ranks: " + "; ".join(p for p in problems if p))


@answer_to("ex10.2")
def shard_heads(n_heads: int, n_kv_heads: int, rank: int, world_size: int) -> tuple[range, range]:
    """Rank ``rank``'s query heads and KV heads: query heads in W contiguous parts; KV heads in W parts
    when W <= n_kv_heads, else the one KV head its query heads share (replicated)."""
    per_rank = n_heads // world_size
    queries = range(rank * per_rank, (rank + 1) * per_rank)
    if world_size <= n_kv_heads:
        kv_per_rank = n_kv_heads // world_size
        return queries, range(rank * kv_per_rank, (rank + 1) * kv_per_rank)
    shared = queries.start // (n_heads // n_kv_heads)
    return queries, range(shared, shared + 1)


def shard_config(config: ModelConfig, world_size: int) -> ShardConfig:
    """The config of each rank's shard (every rank's has the same sizes)."""
    check_layout(config, world_size)
    _, kv = shard_heads(config.n_heads, config.n_kv_heads, 0, world_size)
    fields = {name: getattr(config, name) for name in ModelConfig.__dataclass_fields__}
    return ShardConfig(**{**fields, "n_heads": config.n_heads // world_size, "n_kv_heads": len(kv),
                          "d_ff": config.d_ff // world_size}, shard_head_dim=config.head_dim)


def _rows(heads: range, first: int, head_dim: int) -> Tensor:
    """The weight rows of ``heads``, the block of heads starting at head ``first``."""
    return torch.arange((first + heads.start) * head_dim, (first + heads.stop) * head_dim)


def shard_state(state: dict[str, Tensor], config: ModelConfig, rank: int, world_size: int) -> dict[str, Tensor]:
    """Rank ``rank``'s weights from a whole model's ``state``: wqkv's rows of its query, key and value
    heads; wo's matching columns; gate_up's slice of gate rows and the same slice of up rows; down's
    matching columns; everything else whole."""
    check_layout(config, world_size)
    queries, kv = shard_heads(config.n_heads, config.n_kv_heads, rank, world_size)
    d, width = config.head_dim, config.d_ff // world_size
    qkv_rows = torch.cat([_rows(queries, 0, d), _rows(kv, config.n_heads, d),
                          _rows(kv, config.n_heads + config.n_kv_heads, d)])
    ff = torch.arange(rank * width, (rank + 1) * width)
    pieces = {"attn.wqkv.weight": lambda w: w[qkv_rows],
              "attn.wo.weight": lambda w: w[:, _rows(queries, 0, d)],
              "mlp.gate_up.weight": lambda w: w[torch.cat([ff, ff + config.d_ff])],
              "mlp.down.weight": lambda w: w[:, ff]}
    return {name: next((cut(w) for suffix, cut in pieces.items() if name.endswith(suffix)), w)
            for name, w in state.items()}


class Stopwatch:
    """Seconds spent in the all-reduces, and how many ran (a rank's share of a step's time that is
    communication: with gloo the call returns when the sum has arrived)."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0


class RowParallelLinear(nn.Linear):
    """A row-parallel projection: this rank's partial sum x_r W_r^T, then the all-reduce that sums
    the ranks' parts (the only communication in a tensor-parallel layer), timed by ``stopwatch``."""

    def __init__(self, in_features: int, out_features: int, stopwatch: Stopwatch) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.stopwatch = stopwatch

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        if dist.get_world_size() == 1:  # one rank holds the whole sum
            return out
        synchronize(out.device)  # on a GPU, the matmul first: only the all-reduce is timed
        start = time.perf_counter()
        dist.all_reduce(out)
        synchronize(out.device)
        self.stopwatch.seconds += time.perf_counter() - start
        self.stopwatch.calls += 1
        return out


def shard_model(model: Transformer, rank: int, world_size: int) -> Transformer:
    """Rank ``rank``'s shard of ``model`` (``ShardConfig``), its output and down projections row-parallel;
    ``shard.stopwatch`` times its all-reduces. Run it on every rank of a process group, in step."""
    if any(type(m) is not nn.Linear for m in model.modules() if isinstance(m, nn.Linear)) or \
            type(model.config) is not ModelConfig:
        raise ValueError("shard_model splits a whole model with plain nn.Linear projections (not a quantized "
                         "model, not a shard)")
    config = shard_config(model.config, world_size)
    stopwatch = Stopwatch()
    with torch.device("meta"):
        shard = Transformer(config)
        for block in shard.blocks:
            block.attn.wo = RowParallelLinear(config.n_heads * config.head_dim, config.d_model, stopwatch)
            block.mlp.down = RowParallelLinear(config.d_ff, config.d_model, stopwatch)
    state = shard_state(model.state_dict(), model.config, rank, world_size)
    shard.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    if config.tie_embeddings:
        shard.lm_head.weight = shard.embed.weight
    shard.to(device=model.device, dtype=model.dtype).eval()
    shard.store_weights_column_major()
    shard.stopwatch = stopwatch
    return shard


# Running it: each function below runs on every rank (``labkit.parallel.launch``), in step.


def _shard(rank: Rank, name: str) -> Transformer:
    """Rank ``rank``'s shard of checkpoint ``name``; each rank reads the whole checkpoint, then keeps its share
    (the lab's models are small; a large one would be read slice by slice, e.g. safetensors' ``get_slice``)."""
    model, _ = load(name, device=rank.device)
    return shard_model(model, rank.rank, rank.world_size)


def _generate_rank(rank: Rank, name: str, prompts: list[list[int]], new_tokens: int, cache: str) -> dict:
    shard = _shard(rank, name)
    params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
    if cache == "contiguous":
        caches = [ContiguousKVCache(shard.config, 1, len(p) + new_tokens - 1, shard.dtype, shard.device)  # as stream
                  for p in prompts]
        outputs = [list(stream(shard, p, params, cache=c)) for p, c in zip(prompts, caches)]
        kv_bytes = caches[0].nbytes
    else:
        engine = Engine(shard, num_blocks=sum(blocks_for(len(p) + new_tokens, 16) for p in prompts))
        requests = engine.run([Request(i, p, params) for i, p in enumerate(prompts)])
        outputs, kv_bytes = [r.output for r in requests], engine.cache.nbytes
    all_reduces = shard.stopwatch.calls  # those of the generation, not of the logits' pass below
    return {"outputs": outputs, "logits": forward_tokens(shard, prompts[0], 0, None).cpu(),
            "weight_bytes": parameter_bytes(shard), "kv_bytes": kv_bytes,
            "heads": shard.config.n_heads, "kv_heads": shard.config.n_kv_heads, "all_reduces": all_reduces}


def generate(name: str, prompts: list[list[int]], new_tokens: int, world_size: int, cache: str = "contiguous",
             threads: int | None = None, backend: str | None = None, timeout_s: float = 300.0) -> dict:
    """Greedy continuations of ``prompts`` (token ids) by checkpoint ``name`` split over ``world_size`` ranks,
    through the ``contiguous`` cache (one sequence at a time) or the ``paged`` one (the engine, all at once):
    rank 0's outputs, the logits of the first prompt ``[len, vocab]`` (a forward pass without a cache), and
    rank 0's weight and KV-cache bytes (the first prompt's cache, for ``contiguous``) and how many all-reduces
    the generation ran. ``threads`` and ``backend``: see ``launch``."""
    if cache not in ("contiguous", "paged"):
        raise ValueError(f"cache={cache!r} must be 'contiguous' or 'paged'")
    config = load_config(name)
    ids = generation_prompts(prompts, new_tokens, config.vocab_size, config.max_seq_len)
    check_layout(config, world_size)
    return launch(_generate_rank, world_size, (name, ids, new_tokens, cache), timeout_s, threads, backend)


def _step_rank(rank: Rank, name: str, context: int, repeats: int) -> dict:
    shard = _shard(rank, name)
    step = decode_step(shard, context)
    for _ in range(3):  # warm-up, then the timed steps: every rank runs the same count, in step
        step()
    calls, steps, comms = shard.stopwatch.calls, [], []
    for _ in range(repeats):
        before = shard.stopwatch.seconds
        start = time.perf_counter()
        step()
        synchronize(rank.device)
        steps.append(time.perf_counter() - start)
        comms.append(shard.stopwatch.seconds - before)
    return {"step_s": statistics.median(steps), "comm_s": statistics.median(comms),
            "compute_s": statistics.median(t - c for t, c in zip(steps, comms)),
            "all_reduces": (shard.stopwatch.calls - calls) / repeats, "device": device_name(rank.device)}


def decode_step_time(name: str, world_size: int, context: int = 256, repeats: int = 30, threads: int | None = None,
                     backend: str | None = None, timeout_s: float = 300.0) -> dict:
    """Medians over ``repeats`` decode steps on rank 0 of checkpoint ``name`` split over ``world_size`` ranks (one
    sequence of ``context`` cached tokens): the step, the part of it spent in all-reduces, and the rest
    (``compute_s``); ``threads`` per rank and ``backend``: see ``launch`` (name the backend to compare one rank
    with two on the same devices)."""
    check_layout(load_config(name), world_size)
    return launch(_step_rank, world_size, (name, context, repeats), timeout_s, threads, backend)


def predicted_step(model: Transformer, hardware: Hardware, link: Link, world_size: int, one_rank_s: float,
                   context: int = 256) -> dict[str, float]:
    """The simulator's decode step (``CostModel.step_parts``, seconds) for ``model`` split over
    ``world_size`` ranks of ``hardware`` joined by ``link``, one sequence of ``context`` cached tokens,
    calibrated on ``one_rank_s``, the measured step on one rank: what the roofline does not explain
    there (Python and operator dispatch, which every rank pays whole: it runs as many operations,
    only narrower) is the step's fixed overhead."""
    shape = shape_of("model", model.config, model.num_parameters())
    dtype = DTYPE_NAMES[model.dtype]
    batch = [(1, context)]

    def cost(world: int, overhead_s: float) -> CostModel:
        return CostModel(shape, hardware, world, dtype, dtype, overhead_s, link, dtype)
    return cost(world_size, max(0.0, one_rank_s - cost(1, 0.0).step_time(batch))).step_parts(batch)
