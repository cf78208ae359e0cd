"""The engine's scheduler at GPU scale, without a GPU: each step's time comes from a cost model.

A step that runs, for each scheduled request, n new tokens after c tokens already cached, on W GPUs:

    FLOPs  = 2 x parameters x (sum of n)  +  4 x layers x heads x head_dim x (keys attended)
             where a chunk's i-th new token attends to c + i + 1 keys
    bytes  = weights x bytes per weight  +  KV bytes per token x (sum of c + n)   (cache read, new written)
    communication = 2 x layers x ring all-reduce of (sum of n) x d_model x activation bytes, over W
    time   = max(FLOPs / (W x peak FLOP/s), bytes / (W x bandwidth))  +  communication  +  fixed overhead

the roofline of lab 02: a decode-heavy step is bound by bandwidth (the weights and the cache
are read once for the whole batch, so a bigger batch is nearly free), a prefill-heavy one by
FLOPs. Several GPUs split the model (tensor parallel, Megatron-style): each holds 1/W of every
weight matrix and of the KV heads, so their FLOP/s and bandwidth add up, and each layer sums the
GPUs' partial activations twice, after attention's output projection and after the MLP's down
projection: an all-reduce of every token's d_model activations over the ``link`` between them
(``labkit.interconnect``'s ring formula). In this simple model the GPUs wait for it: communication
does not overlap compute. Without a link communication is free, so predictions for several GPUs
are optimistic. Left out: the KV heads a GPU repeats when W exceeds them, and the collectives of a
vocabulary-parallel embedding or LM head (one per step, not per layer); or, where every GPU keeps
the embedding, the LM head and the norms whole (as ``labkit.parallel`` does), their bytes on each.
Every parameter counts for every token, though the engine computes logits only at each
request's last token and the embedding is a lookup: a prefill's FLOPs come out a little high.
The KV pool is whatever memory the weights leave, in blocks. Tokens are not computed: every
request generates exactly ``max_new_tokens`` placeholder tokens. ``tp_table`` tabulates the
parts of a decode and a prefill step for several world sizes and links.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from labkit.cost import attention_flops
from labkit.engine import EngineCore, ScheduledBatch, SchedulerConfig
from labkit.hardware import Hardware
from labkit.interconnect import Link, ring_allreduce_seconds
from labkit.memory import (ModelShape, bytes_per_element, check_utilization, kv_bytes_per_token, num_blocks_for_memory,
                           weight_bytes)
from labkit.paged import BlockAllocator


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds per engine step for ``model`` on ``n_gpus`` of ``hardware``, tensor parallel
    over ``link`` (None: communication is free)."""

    model: ModelShape
    hardware: Hardware
    n_gpus: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "fp16"
    step_overhead_s: float = 0.0  # launch and framework time a step costs whatever it runs
    link: Link | None = None
    activation_dtype: str = "bf16"  # what the all-reduces carry

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelShape):
            raise TypeError(f"model must be a ModelShape (presets.model('Llama-3.1-8B'), or memory.shape_of for a "
                            f"labkit model), not {type(self.model).__name__}")
        if not isinstance(self.hardware, Hardware):
            raise TypeError(f"hardware must be a Hardware (presets.gpu('H100-SXM')), not {self.hardware!r:.60}")
        if self.n_gpus < 1 or self.step_overhead_s < 0:
            raise ValueError(f"n_gpus={self.n_gpus} must be >= 1 and step_overhead_s={self.step_overhead_s} >= 0")
        if self.link is not None and not isinstance(self.link, Link):
            raise ValueError(f"link={self.link!r} must be a labkit.interconnect.Link (e.g. presets.link('NVLink-4')) "
                             "or None")
        bytes_per_element(self.activation_dtype)  # a clear error now for an unknown dtype

    def flops(self, batch: Sequence[tuple[int, int]]) -> float:
        """FLOPs of a step running (new tokens, cached tokens before them) per request."""
        m = self.model
        attention = sum(attention_flops(m.n_layers, m.n_heads, m.head_dim, n, c) for n, c in batch)
        return 2 * m.n_params * sum(n for n, _ in batch) + attention

    def bytes(self, batch: Sequence[tuple[int, int]]) -> float:
        kv = kv_bytes_per_token(self.model, self.kv_dtype) * sum(n + c for n, c in batch)
        return weight_bytes(self.model, self.weight_dtype) + kv

    def allreduce_bytes(self, batch: Sequence[tuple[int, int]]) -> float:
        """Bytes each tensor-parallel all-reduce sums: the step's new tokens x d_model activations."""
        return sum(n for n, _ in batch) * self.model.d_model * bytes_per_element(self.activation_dtype)

    def communication_time(self, batch: Sequence[tuple[int, int]]) -> float:
        """Seconds of the step's all-reduces: two per layer, none on one GPU or without a link."""
        if self.link is None:
            return 0.0
        return 2 * self.model.n_layers * ring_allreduce_seconds(self.allreduce_bytes(batch), self.n_gpus, self.link)

    def step_parts(self, batch: Sequence[tuple[int, int]]) -> dict[str, float]:
        """The step's time and its parts, in seconds: compute and memory (the GPUs run the longer of
        the two), communication and overhead, which add to it."""
        compute = self.flops(batch) / (self.n_gpus * self.hardware.peak_flops)
        memory = self.bytes(batch) / (self.n_gpus * self.hardware.bandwidth)
        communication = self.communication_time(batch)
        return {"compute_s": compute, "memory_s": memory, "communication_s": communication,
                "overhead_s": self.step_overhead_s, "step_s": max(compute, memory) + communication + self.step_overhead_s}

    def step_time(self, batch: Sequence[tuple[int, int]]) -> float:
        return self.step_parts(batch)["step_s"]

    def kv_blocks(self, block_size: int = 16, utilization: float = 0.9) -> int:
        """Blocks of KV cache that fit in ``utilization`` of the GPUs' memory beside the weights."""
        check_utilization(utilization)
        free = utilization * self.n_gpus * self.hardware.memory_bytes - weight_bytes(self.model, self.weight_dtype)
        if free <= 0:
            raise ValueError(f"{self.model.name}'s weights do not fit {utilization:.0%} of {self.n_gpus} x "
                             f"{self.hardware.name}: use more GPUs")
        return num_blocks_for_memory(self.model, free, block_size, self.kv_dtype)


def tp_table(model: ModelShape, gpu: Hardware, links: Sequence[Link], worlds: Sequence[int] = (1, 2, 4, 8),
             batches: Sequence[int] = (1, 64), context: int = 1024, step_overhead_s: float = 0.0) -> list[dict]:
    """Predicted steps of ``model`` on each number of ``gpu``s in ``worlds``, tensor parallel over each
    link, one row per step (for pandas or a plot): a decode step of ``batch`` sequences that each have
    ``context`` tokens cached, for each of ``batches``, and the prefill of one ``context``-token prompt.
    A row has the step's parts in ms (``CostModel.step_parts``), the share of the step spent
    communicating, tokens per second, ``weights_fit``: whether the weights fit in the GPUs' memory at
    the cost model's utilisation, and ``kv_fits``: whether the step's KV cache fits in the memory the
    weights leave (False too where the weights alone do not fit)."""
    if context < 1 or not (links and worlds and batches) or min(batches) < 1:
        raise ValueError(f"need context={context} >= 1, at least one link, world size and batch, and batches={batches} "
                         ">= 1")
    rows = []
    for link in links:
        for world in worlds:
            cost = CostModel(model, gpu, world, step_overhead_s=step_overhead_s, link=link)
            try:
                kv_tokens, weights_fit = cost.kv_blocks(block_size=1), True
            except ValueError:  # the weights do not fit
                kv_tokens, weights_fit = 0, False
            steps = [("decode", b, [(1, context)] * b) for b in batches] + [("prefill", 1, [(context, 0)])]
            for kind, size, batch in steps:
                parts = cost.step_parts(batch)
                tokens = sum(n for n, _ in batch)
                rows.append({"link": link.name, "gpus": world, "step": kind, "batch": size, "tokens": tokens,
                             **{name.removesuffix("_s") + "_ms": seconds * 1e3 for name, seconds in parts.items()},
                             "communication_share": parts["communication_s"] / parts["step_s"],
                             "tokens_per_s": tokens / parts["step_s"],
                             "weights_fit": weights_fit, "kv_fits": sum(n + c for n, c in batch) <= kv_tokens})
    return rows


class SimulatedClock:
    """Simulated seconds: a step takes the cost model's time, and waiting for an arrival takes none."""

    def __init__(self) -> None:
        self.t = 0.0

    def reset(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def advance(self, seconds: float) -> None:
        self.t += seconds


class CostRunner:
    """Executes a scheduled batch on the cost model: the clock moves on by the step's predicted
    time, and every sampled request gets a placeholder token."""

    def __init__(self, cost: CostModel, clock: SimulatedClock) -> None:
        self.cost, self.clock = cost, clock
        self.max_seq_len, self.vocab_size = cost.model.max_context, 2**31

    def execute(self, batch: ScheduledBatch) -> list[int]:
        self.clock.advance(self.cost.step_time([(n, r.num_computed) for r, n in batch.scheduled]))
        return [0] * len(batch.sampled)


class SimulatedEngine(EngineCore):
    """The engine's scheduler and bookkeeping on a simulated clock (``EngineCore`` with a
    ``CostRunner``): by default, as many blocks as the GPUs' memory leaves for the KV cache."""

    def __init__(self, cost: CostModel, num_blocks: int | None = None, block_size: int = 16,
                 config: SchedulerConfig = SchedulerConfig(), prefix_caching: bool = True) -> None:
        blocks = cost.kv_blocks(block_size) if num_blocks is None else num_blocks
        clock = SimulatedClock()
        super().__init__(CostRunner(cost, clock), BlockAllocator(blocks, block_size, prefix_caching), config, clock)
