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
from labkit.engine import Engine, Scheduler, SchedulerConfig, StepPlan
from labkit.hardware import Hardware
from labkit.memory import ModelShape, check_utilization, kv_bytes_per_token, weight_bytes
from labkit.paged import BlockAllocator, num_blocks_for_memory


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


class SimulatedEngine(Engine):
    """The engine's scheduler and bookkeeping on a simulated clock: a step takes the cost
    model's time, and waiting for an arrival takes none."""

    def __init__(self, cost: CostModel, num_blocks: int | None = None, block_size: int = 16,
                 config: SchedulerConfig = SchedulerConfig(), prefix_caching: bool = True) -> None:
        self.cost, self.eos_id = cost, None
        self.allocator = BlockAllocator(cost.kv_blocks(block_size) if num_blocks is None else num_blocks, block_size,
                                        prefix_caching)
        self.scheduler = Scheduler(self.allocator, config)
        self.log, self.clock = [], 0.0

    @property
    def max_seq_len(self) -> int:
        return self.cost.model.max_context

    @property
    def vocab_size(self) -> int:
        return 2**31

    def now(self) -> float:
        return self.clock

    def wait_until(self, t: float) -> None:
        self.clock = max(self.clock, t)

    def reset_clock(self) -> None:
        self.clock = 0.0

    def execute(self, plan: StepPlan, rows: Sequence[int]) -> list[int]:
        self.clock += self.cost.step_time([(n, r.num_computed) for r, n in plan.scheduled])
        for request, n in plan.scheduled:  # what the paged cache does after a forward pass
            self.allocator.mark_computed(request.request_id, request.num_computed + n)
        return [0] * len(rows)
