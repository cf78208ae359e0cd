"""A Llama-style decoder-only transformer, written from scratch.

    x = embed(tokens)
    for each layer:   x = x + attention(rms_norm(x));   x = x + mlp(rms_norm(x))
    logits = lm_head(rms_norm(x))

- RMSNorm:  y = x / sqrt(mean(x^2) + eps) * weight
- Rotary embeddings (RoPE): in each head, the pair (x_i, x_{i + d/2}) is rotated by the angle
  position * theta^(-2i/d), so the dot product of a query and a key depends on their distance.
- SwiGLU MLP:  mlp(x) = W_down(silu(W_gate x) * W_up x)  (W_gate and W_up stored as one matrix,
  as are W_q, W_k and W_v: one matmul instead of three is faster when a step is one token)
- Attention has ``n_heads`` query heads and ``n_kv_heads`` key/value heads; each KV head is
  shared by a group of n_heads / n_kv_heads query heads. MHA when the two are equal, MQA when
  there is one KV head, GQA in between.

The model knows nothing of how keys and values are stored. ``forward`` takes token ids and
either their positions (no cache: the tokens attend causally among themselves) or a cache's
plan for the step (``KVCache``: the contiguous cache here; the int8, sink and paged caches of
later labs), which carries the positions; each layer then hands its attention to the cache in
one call. Position -1 marks padding in a batch of sequences of different lengths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from labkit.validate import check_counts, check_positions


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the model; checked on creation, with errors that name the problem."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    rope_scaling: dict[str, Any] | None = None  # Llama-3's: factor, low/high_freq_factor, original context

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} (d_model / n_heads) must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def group_size(self) -> int:
        """Query heads per KV head: 1 for MHA, n_heads for MQA."""
        return self.n_heads // self.n_kv_heads


class KVCache(Protocol):
    """Where attention keeps keys and values between forward passes.

    A forward pass through a cache is one step, in two parts:

    1. Before it, the caller asks the cache for the step's plan, once: ``plan = cache.plan(...)``,
       with the cache's own arguments (the positions of a batch of rows; for the paged cache, the
       sequences and how many new tokens each runs). The plan says where each new token's key and
       value go and what each query may see, and carries the tokens' positions. It is the same
       for every layer, and it is where the cache checks that the step fits.
    2. The model runs with it, ``model(tokens, plan=plan)``, and each layer's attention is one
       call, ``cache.attend(layer, q, k, v, plan)``: store the layer's new keys and values
       ``[B, n_kv_heads, T, head_dim]`` where the plan says, and return the attention output of
       the queries ``[B, n_heads, T, head_dim]``.

    ``attend`` writes keys and values and nothing else. What the step computed (which tokens a
    sequence now has in the cache, which blocks later prompts may share) is recorded by the
    caller once the step is done.
    """

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan) -> Tensor:
        ...


class RowCache(KVCache, Protocol):
    """A cache of a batch of rows, one sequence each (contiguous, int8, sinks): its plan is made
    from the step's positions ``[B, T]`` alone."""

    def plan(self, positions: Tensor) -> AttentionPlan:
        ...


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """One step's plan, made by a cache before the forward pass (see ``KVCache``): the cache, and
    the positions ``[B, T]`` of the step's tokens (-1: padding), which the rotary embeddings read.
    A cache that needs nothing more uses it as it is; the others add what their ``attend`` reads."""

    cache: KVCache
    positions: Tensor


def attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """Scaled dot-product attention of ``q`` ``[B, n_heads, T, d]`` over ``keys`` and ``values``
    ``[B, n_kv_heads, S, d]`` (cast to q's dtype), where ``mask`` ``[B, 1, T, S]`` allows (None:
    everywhere; a float mask is added to the scores); each KV head serves n_heads / n_kv_heads
    consecutive query heads.

    With one query per sequence (a decode step), the query heads that share a KV head are that
    head's queries, ``[B, n_kv_heads, group, d]``: plain attention over the KV heads as they are,
    which runs about twice as fast on a CPU as SDPA's GQA mode over the same numbers."""
    batch, heads, length, dim = q.shape
    kv_heads = keys.shape[1]
    keys, values = keys.type_as(q), values.type_as(q)
    if mask is not None and mask.is_floating_point():
        mask = mask.type_as(q)
    if length == 1 and heads != kv_heads:
        grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
        return out.reshape(batch, heads, 1, dim)  # a copy where a GPU kernel lays it out [B, group, n_kv, d]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=heads != kv_heads)


def causal_mask(query_positions: Tensor, key_positions: Tensor) -> Tensor:
    """[B, 1, T, S]: a query sees every real key at its own position or before. A padding query
    sees everything, so that its (ignored) output stays finite."""
    q, k = query_positions[:, None, :, None], key_positions[:, None, None, :]
    return ((k <= q) & (k >= 0)) | (q < 0)


@dataclass(frozen=True, eq=False)
class ContiguousPlan(AttentionPlan):
    """Where a step's tokens go in a ``ContiguousKVCache``: the (row, column) of each real token in
    the batch and its slot, how many slots attention reads, and what each query sees (None: all)."""

    rows: Tensor | int
    cols: Tensor | slice
    slots: Tensor | slice
    length: int
    mask: Tensor | None


def kv_layout(config: ModelConfig) -> tuple[int, int, int]:
    """What a KV cache must match of the model it serves: (layers, KV heads, head dim). Each cache
    keeps its model's as ``layout``, and the model checks it against its own at every call."""
    return config.n_layers, config.n_kv_heads, config.head_dim


def cache_length(config: ModelConfig, max_len: int | None) -> int:
    """The slots a cache of rows keeps per sequence: ``max_len``, checked, or the model's context."""
    length = config.max_seq_len if max_len is None else max_len
    if not 1 <= length <= config.max_seq_len:
        raise ValueError(f"max_len={length} must be in 1..max_seq_len={config.max_seq_len} "
                         "(None: the model's max_seq_len)")
    return length


class ContiguousKVCache:
    """One preallocated buffer per layer and sequence: ``[layers, batch, n_kv_heads, max_len, head_dim]``.

    Slot p of a row holds the key and value of the token at position p. So the cache keeps no
    lengths of its own: a step's positions say where its tokens go, and a query at position p
    reads slots 0..p. To roll a sequence back (speculative decoding), run its next step from
    the earlier position: the slots after it are written again before anything reads them.

    Simple and fast, but every sequence reserves ``max_len`` slots up front, used or not: the
    waste that the paged cache removes.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        check_counts(batch_size=batch_size)  # a row per sequence
        self.layout = kv_layout(config)
        self.max_len = cache_length(config, max_len)
        shape = (config.n_layers, batch_size, config.n_kv_heads, self.max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def plan(self, positions: Tensor) -> ContiguousPlan:
        """The plan of a step whose tokens are at ``positions`` ``[batch, T]`` (-1: padding): where
        they go, how many slots attention reads, and what each token may attend to. One copy of
        the positions to the host. One sequence at consecutive positions (prefill, decode) is
        written as one slice, with no index tensors, and its one new token (a decode step) sees
        every slot it reads: no mask at all."""
        check_positions(positions)
        table = positions.tolist()
        if len(table) != self.k.shape[1]:
            raise ValueError(f"a batch of {len(table)} sequences for a cache of {self.k.shape[1]}")
        real = [p for row in table for p in row if p != -1]
        if not real:
            raise ValueError("every position is padding (-1): the step runs no token")
        if (bad := next((p for p in real if not 0 <= p < self.max_len), None)) is not None:
            raise ValueError(f"position {bad} does not fit a cache of max_len={self.max_len} (positions count "
                             "from 0; -1 marks padding)")
        length = max(real) + 1
        run = table[0] if len(table) == 1 else []
        if run and run[0] >= 0 and run == list(range(run[0], run[0] + len(run))):
            rows, cols, slots = 0, slice(None), slice(run[0], run[-1] + 1)
            if len(run) == 1:
                return ContiguousPlan(self, positions, rows, cols, slots, length, None)
        else:
            rows, cols = (positions >= 0).nonzero(as_tuple=True)
            slots = positions[rows, cols]
        mask = causal_mask(positions, torch.arange(length, device=positions.device)[None])
        return ContiguousPlan(self, positions, rows, cols, slots, length, mask)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, plan: ContiguousPlan) -> Tensor:
        self._write(layer, plan.rows, plan.slots, k[plan.rows, :, plan.cols], v[plan.rows, :, plan.cols])
        return attention(q, *self._read(layer, plan.length, q.dtype), plan.mask)

    def compact(self, slots: Sequence[int], start: int) -> None:
        """Keep the keys and values of row 0's ``slots`` (in order, each at or after its new
        place) in slots start, start + 1, ... of every layer: after a token tree is verified, its
        accepted branch moves to the positions it now holds (``labkit.tree``)."""
        if (self.k.shape[1] != 1 or any(s < start + i for i, s in enumerate(slots))
                or any(s >= self.max_len for s in slots)):
            raise ValueError(f"compact moves row 0's slots down, within its {self.max_len} slots, in a cache of one "
                             f"row: slots {list(slots)} to {start}.. in a cache of {self.k.shape[1]} rows")
        source = torch.as_tensor(slots, dtype=torch.long, device=self.k.device)
        for buffer in (self.k, self.v):
            buffer[:, 0, :, start:start + len(slots)] = buffer[:, 0, :, source]  # gathered before written

    def _write(self, layer: int, rows: Tensor | int, slots: Tensor | slice, k: Tensor, v: Tensor) -> None:
        """Store the new keys and values at (row, slot): ``[tokens, n_kv_heads, head_dim]`` for index
        tensors, ``[n_kv_heads, tokens, head_dim]`` for one row's slice of slots."""
        self.k[layer, rows, :, slots] = k.type_as(self.k)
        self.v[layer, rows, :, slots] = v.type_as(self.v)

    def _read(self, layer: int, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The first ``length`` slots of a layer, as stored (attention casts them to its dtype)."""
        return self.k[layer, :, :, :length], self.v[layer, :, :, :length]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, over the last dimension; torch computes it in fp32
    for bf16 and fp16 inputs."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_frequencies(config: ModelConfig) -> Tensor:
    """theta^(-2i/d) for each pair, with Llama-3's long-context scaling when configured: wavelengths
    longer than the original context / low_freq_factor are slowed by ``factor``, shorter than
    context / high_freq_factor are kept, and those between are blended."""
    d = config.head_dim
    freq = config.rope_theta ** -(torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d)
    if config.rope_scaling is None:
        return freq.float()
    s = config.rope_scaling
    old_context, factor = s["original_max_position_embeddings"], s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelength = 2 * math.pi / freq
    blend = ((old_context / wavelength - low) / (high - low)).clamp(0, 1)
    return ((1 - blend) * freq / factor + blend * freq).float()


def rope_table(config: ModelConfig) -> Tensor:
    """cos and sin of position * frequency for every position, fp32 ``[max_seq_len, 2 * head_dim]``:
    cos for both halves of a head, then sin with its first half negated (see ``apply_rope``)."""
    positions = torch.arange(config.max_seq_len, dtype=torch.float32, device="cpu")
    angles = positions[:, None] * rope_frequencies(config)
    return torch.cat([angles.cos(), angles.cos(), -angles.sin(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x_i, x_{i + d/2}) of a head: x_i cos - x_{i + d/2} sin, x_{i + d/2} cos + x_i sin.
    Rolling a head by d/2 puts each element's partner in its place, and ``sin`` comes with its
    first half negated, so that is x * cos + roll(x) * sin; in fp32, as cos and sin are."""
    return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        # q, k and v come out of one matrix: rows for the n_heads query heads, then for the
        # n_kv_heads key heads, then for the n_kv_heads value heads
        self.wqkv = nn.Linear(config.d_model, (config.n_heads + 2 * config.n_kv_heads) * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=False)

    def forward(self, x: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor], plan: AttentionPlan | None) -> Tensor:
        c = self.config
        batch, length, _ = x.shape
        heads = self.wqkv(x).view(batch, length, -1, c.head_dim).transpose(1, 2)
        qk = apply_rope(heads[:, :c.n_heads + c.n_kv_heads], *rope)
        q, k = qk[:, :c.n_heads], qk[:, c.n_heads:]
        v = heads[:, c.n_heads + c.n_kv_heads:]
        if plan is None:  # no cache: the tokens attend causally among themselves
            out = attention(q, k, v, causal_mask(positions, positions))
        else:
            out = plan.cache.attend(self.layer, q, k, v, plan)
        return self.wo(out.transpose(1, 2).reshape(batch, length, c.n_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)  # gate rows, then up rows
        self.down = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, layer)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor], plan: AttentionPlan | None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), positions, rope, plan)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # a skeleton on the meta device (a loader's) skips Embedding's own normal_ draw, which there
        # goes through torch._refs and imports TorchDynamo: two seconds of every load
        skeleton = torch.empty(config.vocab_size, config.d_model) if torch.get_default_device().type == "meta" else None
        self.embed = nn.Embedding(config.vocab_size, config.d_model, _weight=skeleton)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = rope_table(config)  # fp32, kept out of .to(dtype) on purpose
        self.reset_parameters()
        self.store_weights_column_major()

    def store_weights_column_major(self) -> None:
        """Lay each projection's weight out transposed in memory: same shape [out, in] and values,
        but stored as W^T, so ``x @ W^T`` reads W^T row by row, the order a one-row (decode)
        matmul on a CPU streams fastest (about 10% off a decode step here). ``.to()`` keeps the
        layout; loading a checkpoint with ``assign=True`` replaces it, so the loader calls this again.
        A tied embedding shares the layout: looking up one token's row then reads strided memory."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.data = module.weight.data.t().contiguous().t()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Small normal weights; the projections that write into the residual stream are scaled
        down by sqrt(2 * n_layers), so the stream's variance does not grow with depth. Weights on
        the meta device (a loader's skeleton, filled from a checkpoint) have no values to draw."""
        for name, p in self.named_parameters():
            if p.dim() == 2 and not p.is_meta:
                scale = (2 * self.config.n_layers) ** -0.5 if name.endswith(("wo.weight", "down.weight")) else 1
                nn.init.normal_(p, std=std * scale)

    @property
    def device(self) -> torch.device:
        """Where the model runs (the final norm's weight: every model has one, quantized or not)."""
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (the final norm's weight)."""
        return self.norm.weight.dtype

    def forward(self, tokens: Tensor, positions: Tensor | None = None, plan: AttentionPlan | None = None,
                logits_at: Tensor | None = None) -> Tensor:
        """Logits ``[B, T, vocab]`` for token ids ``[B, T]``. Through a cache, ``plan`` is the plan
        the cache made for these tokens (``KVCache``), which carries their positions. Without one,
        the tokens attend causally among themselves, at ``positions`` ``[B, T]`` (default 0..T-1;
        -1 for padding). With ``logits_at``, indices along T, only those tokens' logits,
        ``[B, len(logits_at), vocab]``: every token still runs through the layers and the cache,
        but a prompt's tokens before its last skip the LM head, which for a 4096-token vocabulary
        is a tenth of the work."""
        positions = self._positions(tokens, positions, plan)
        x = self.layers(self.embed(tokens), positions, plan)
        if logits_at is not None:
            x = x[:, torch.as_tensor(logits_at, device=x.device).reshape(-1)]
        return self.head(x)

    def layers(self, x: Tensor, positions: Tensor, plan: AttentionPlan | None, start: int = 0,
               stop: int | None = None) -> Tensor:
        """The residual stream ``x`` ``[B, T, d_model]`` after blocks ``start`` to ``stop - 1`` (all
        by default), for tokens at ``positions`` (checked by the caller: ``forward`` or a plan's
        cache). Self-speculation runs the first blocks to draft and the rest to verify."""
        rope = self.rotary(positions)
        for block in self.blocks[start:stop]:
            x = block(x, positions, rope, plan)
        return x

    def head(self, x: Tensor) -> Tensor:
        """Logits from the residual stream: the final norm, then the LM head."""
        return self.lm_head(self.norm(x))

    def _positions(self, tokens: Tensor, positions: Tensor | None, plan: AttentionPlan | None) -> Tensor:
        """The tokens' positions, checked where a caller hands them in: a plan's were checked by the
        cache that made it; others are read once on the host, as a call without a cache is no hot path."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tuple(tokens.shape)}")
        if plan is not None:
            positions = self._plan_positions(positions, plan)
            self.check_cache(plan.cache)
        elif positions is None:
            if tokens.shape[1] > self.config.max_seq_len:
                raise ValueError(f"{tokens.shape[1]} tokens are past the context limit "
                                 f"max_seq_len={self.config.max_seq_len}")
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            if tokens.numel():
                self._check_vocabulary(*torch.stack(tokens.aminmax()).tolist())
        elif tokens.numel():
            lowest, highest, first, last = torch.stack([*positions.aminmax(), *tokens.aminmax()]).tolist()  # one copy
            if lowest < -1 or highest >= self.config.max_seq_len:
                raise ValueError(f"positions {lowest}..{highest} must be in 0..max_seq_len - 1 = "
                                 f"{self.config.max_seq_len - 1} (-1 marks padding)")
            self._check_vocabulary(first, last)
        if positions.shape != tokens.shape:
            raise ValueError(f"positions {tuple(positions.shape)} must match tokens {tuple(tokens.shape)}")
        return positions

    def check_cache(self, cache: KVCache) -> None:
        """ValueError if ``cache`` was made for another model (another ``kv_layout``): the draft's cache
        given to the target, say, whose keys would not fit it. A cache without a ``layout`` is not checked.
        Every call with a plan checks its cache; a compiler checks it first, as its failure would hide why."""
        layout = getattr(cache, "layout", None)
        if layout is not None and layout != kv_layout(self.config):
            raise ValueError(f"the cache was made for a model of (layers, KV heads, head dim) = {layout}, but this "
                             f"model has {kv_layout(self.config)}: make the cache from this model's config")

    def _check_vocabulary(self, lowest: int, highest: int) -> None:
        """ValueError unless token ids ``lowest``..``highest`` are in the vocabulary (where no cache's
        plan comes with them: such calls read their tokens on the host once, as they do positions)."""
        if lowest < 0 or highest >= self.config.vocab_size:
            raise ValueError(f"token ids must be in 0..{self.config.vocab_size - 1} (the vocabulary), "
                             f"got {lowest}..{highest}")

    @staticmethod
    def _plan_positions(positions: Tensor | None, plan: AttentionPlan) -> Tensor:
        if not isinstance(plan, AttentionPlan):
            raise TypeError(f"plan must be the plan a cache made for these tokens, e.g. cache.plan(positions), "
                            f"not a {type(plan).__name__}")
        if positions is not None:
            raise ValueError("a plan carries its positions: model(tokens, plan=cache.plan(positions))")
        return plan.positions

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin ``[B, 1, T, head_dim]`` for ``positions`` ``[B, T]`` (padding, -1, indexes
        the table's last row: finite values for an output that is ignored)."""
        if self.rope.device != positions.device:  # follows the model, but stays fp32
            with torch.inference_mode(False):  # a normal tensor, even when first moved during generation
                self.rope = self.rope.to(positions.device)
        return self.rope[positions][:, None].chunk(2, dim=-1)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters, each once (``parameters()`` yields a tied embedding and LM head once)."""
    return sum(p.nbytes for p in module.parameters())


def forward_tokens(model: Transformer, tokens: Sequence[int] | Tensor, start: int, cache: RowCache | None) -> Tensor:
    """Logits ``[len(tokens), vocab]`` of one sequence's ``tokens`` at positions start, start + 1,
    ...: through ``cache`` (row 0 of a batch of one, its plan made here), or, without one,
    attending among themselves. The one forward call of every loop over a single sequence:
    prefill, decode, drafting, verification, perplexity."""
    if start < 0:
        raise ValueError(f"start={start} must be 0 or more: the position of the first token")
    device = model.device
    ids = torch.as_tensor(tokens, device=device)[None]
    positions = torch.arange(start, start + ids.shape[1], device=device)[None]
    with torch.inference_mode():  # only around the model: a caller's code between steps runs as usual
        return (model(ids, positions) if cache is None else model(ids, plan=cache.plan(positions)))[0]
