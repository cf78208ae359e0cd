"""The engine's scheduler at GPU scale, without a GPU: each step's time comes from a cost model.

A step that runs, for each scheduled request, n new tokens after c tokens already cached:

    FLOPs  = 2 x parameters x (sum of n)  +  4 x layers x heads x head_dim x (keys attended)
             where a chunk's i-th new token attends to c + i + 1 keys
    bytes  = weights x bytes per weight  +  KV bytes per token x (sum of c + n)   (cache read, new written)
    time   = max(FLOPs / (GPUs x peak FLOP/s), bytes / (GPUs x bandwidth))  +  fixed overhead

the roofline of lab 02: a decode-heavy step is bound by bandwidth (the weights and the cache
are read once for the whole batch, so a bigger batch is nearly free), a prefill-heavy one by
FLOPs. Several GPUs split the model (tensor parallel): their memory, bandwidth and FLOP/s add
up; the communication between them is left out, so predictions for several are optimistic.
Every parameter counts for every token, though the engine computes logits only at each
request's last token and the embedding is a lookup: a prefill's FLOPs come out a little high.
The KV pool is whatever memory the weights leave, in blocks. Tokens are not computed: every
request generates exactly ``max_new_tokens`` placeholder tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from labkit.cost import attention_flops
from labkit.engine import EngineCore, ScheduledBatch, SchedulerConfig
from labkit.hardware import Hardware
from labkit.memory import ModelShape, check_utilization, kv_bytes_per_token, num_blocks_for_memory, weight_bytes
from labkit.paged import BlockAllocator


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds per engine step for ``model`` on ``n_gpus`` of ``hardware``."""

    model: ModelShape
    hardware: Hardware
    n_gpus: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "fp16"
    step_overhead_s: float = 0.0  # launch and framework time a step costs whatever it runs

    def __post_init__(self) -> None:
        if self.n_gpus < 1 or self.step_overhead_s < 0:
            raise ValueError(f"n_gpus={self.n_gpus} must be >= 1 and step_overhead_s={self.step_overhead_s} >= 0")

    def flops(self, batch: Sequence[tuple[int, int]]) -> float:
        """FLOPs of a step running (new tokens, cached tokens before them) per request."""
        m = self.model
        attention = sum(attention_flops(m.n_layers, m.n_heads, m.head_dim, n, c) for n, c in batch)
        return 2 * m.n_params * sum(n for n, _ in batch) + attention

    def bytes(self, batch: Sequence[tuple[int, int]]) -> float:
        kv = kv_bytes_per_token(self.model, self.kv_dtype) * sum(n + c for n, c in batch)
        return weight_bytes(self.model, self.weight_dtype) + kv

    def step_time(self, batch: Sequence[tuple[int, int]]) -> float:
        compute = self.flops(batch) / (self.n_gpus * self.hardware.peak_flops)
        memory = self.bytes(batch) / (self.n_gpus * self.hardware.bandwidth)
        return max(compute, memory) + self.step_overhead_s

    def kv_blocks(self, block_size: int = 16, utilization: float = 0.9) -> int:
        """Blocks of KV cache that fit in ``utilization`` of the GPUs' memory beside the weights."""
        check_utilization(utilization)
        free = utilization * self.n_gpus * self.hardware.memory_bytes - weight_bytes(self.model, self.weight_dtype)
        if free <= 0:
            raise ValueError(f"{self.model.name}'s weights do not fit {utilization:.0%} of {self.n_gpus} x "
                             f"{self.hardware.name}: use more GPUs")
        return num_blocks_for_memory(self.model, free, block_size, self.kv_dtype)


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
