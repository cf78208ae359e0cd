"""A paged KV cache: a pool of fixed-size blocks, a block table per sequence, shared prefixes.

A contiguous cache reserves ``max_len`` slots for every sequence up front, used or not. A paged
cache cuts the memory into ``num_blocks`` blocks of ``block_size`` token slots and gives a
sequence another block only when its last one is full. A sequence's block table lists its
blocks in order, so the token at position p lives at

    block = table[p // block_size],   offset = p % block_size,   slot = block * block_size + offset

and a sequence of L tokens holds ceil(L / block_size) blocks: fewer than ``block_size`` slots
wasted per sequence, whatever its length.

- Reference counts let sequences share blocks. ``fork`` gives a new sequence its parent's
  blocks (each count + 1, no data copied); a shared block is copied only when one of its
  owners is about to write into it (copy on write).
- Prefix sharing (``labkit.prefix_cache``): a full block whose keys and values have been written
  is named by the text it holds, and a new prompt that starts with named blocks reuses them. The
  prefix cache holds a reference to each block it names, so a finished sequence's full blocks
  stay until the pool needs them back, least recently used first.

``BlockPool`` is the bare bookkeeping (free list, counts, tables); ``BlockAllocator`` has a pool
and a prefix cache, and reserves slots for sequences of tokens; ``PagedKVCache`` holds the
tensors and speaks the model's ``KVCache`` protocol: ``plan`` a step, then ``attend`` per layer.
What a step computed is recorded after it, by whoever ran it (``BlockAllocator.mark_computed``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import accumulate
from typing import Hashable, Iterable, Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from labkit.answers import answer_to
from labkit.memory import blocks_for
from labkit.model import AttentionPlan, ModelConfig, Transformer, causal_mask, kv_layout
from labkit.paged_attention import DecodeKernel, attend_blocks, length_groups, slot_mapping
from labkit.prefix_cache import Name, PrefixCache
from labkit.validate import as_token_ids, check_counts, check_ints, is_int

class Run(NamedTuple):
    """A step's work for one sequence: its tokens at positions start .. start + count - 1."""

    seq_id: Hashable
    start: int
    count: int


class OutOfBlocks(RuntimeError):
    """Too few free blocks for the request; raised before anything changed."""


def ensure_free(n: int, free: int, total: int) -> None:
    """OutOfBlocks, before anything changes, unless ``n`` of the ``free`` blocks (of ``total``) are asked for."""
    if n > free:
        raise OutOfBlocks(f"need {n} free blocks but only {free} of {total} are free")


def check_invariants(free_blocks: Iterable[int], ref_count: Sequence[int],
                     tables: Mapping[Hashable, Sequence[int]]) -> None:
    """Raise AssertionError naming the first broken rule: every block is free or owned, never
    both, never listed free twice; its count equals the number of tables that hold it."""
    listed = Counter(free_blocks)
    if twice := sorted(b for b, n in listed.items() if n > 1):
        raise AssertionError(f"blocks {twice} are on the free list more than once")
    owners = Counter(block for table in tables.values() for block in table)
    for block in range(len(ref_count)):
        is_free = block in listed
        if is_free and owners[block]:
            raise AssertionError(f"block {block} is free but sequences hold it")
        if not is_free and not owners[block]:
            raise AssertionError(f"block {block} leaked: neither free nor held by any sequence")
        if ref_count[block] != owners[block]:
            raise AssertionError(f"block {block} has ref_count {ref_count[block]} but {owners[block]} owners")
    if unknown := (set(owners) | set(listed)) - set(range(len(ref_count))):
        raise AssertionError(f"blocks {sorted(unknown)} are outside the pool of {len(ref_count)}")


class BlockPool:
    """A fixed pool of blocks: a free list, a reference count per block, a table per sequence;
    allocate, free, fork, and copy on write."""

    def __init__(self, num_blocks: int) -> None:
        check_counts(num_blocks=num_blocks)
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.ref_count = [0] * num_blocks
        self.tables: dict[Hashable, list[int]] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now."""
        return len(self.free_blocks)

    def take(self, n: int) -> list[int]:
        """``n`` blocks off the free list (their counts are the caller's to set), or OutOfBlocks
        with nothing taken."""
        ensure_free(n, self.num_free, self.num_blocks)
        return [self.free_blocks.pop() for _ in range(n)]

    def _check_held(self, block: int, what: str) -> None:
        """ValueError unless ``block`` is a block of the pool that someone holds: a free block has no
        owner to lose, and one that gained an owner would be handed out again while in use."""
        if not is_int(block) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block!r} is not a block of the pool (0..{self.num_blocks - 1})")
        if self.ref_count[block] < 1:
            raise ValueError(f"block {block} is free: {what}")

    def hold(self, block: int) -> None:
        """One more owner for ``block``, which others hold."""
        self._check_held(block, "only a block that someone holds can gain an owner (allocate hands out free ones)")
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        """One owner fewer for ``block``; a block nobody holds is free again."""
        self._check_held(block, "it has no owner to release")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_blocks.append(block)

    @answer_to("ex03.2")
    def allocate(self, seq_id: Hashable, n_blocks: int) -> list[int]:
        """Append ``n_blocks`` fresh blocks to ``seq_id``'s table (a new table if it has none)."""
        if n_blocks < 0:
            raise ValueError(f"n_blocks={n_blocks} must not be negative")
        blocks = self.take(n_blocks)
        for block in blocks:
            self.ref_count[block] = 1
        self.tables.setdefault(seq_id, []).extend(blocks)
        return blocks

    @answer_to("ex03.3")  # a fork in one call
    def share(self, seq_id: Hashable, blocks: Sequence[int]) -> None:
        """Append ``blocks``, which others hold, to ``seq_id``'s table (a new table if it has none):
        each gains an owner, and no data is copied. Every block is checked before any is held."""
        for block in blocks:
            self._check_held(block, "share only blocks that others hold")
        for block in blocks:
            self.hold(block)
        self.tables.setdefault(seq_id, []).extend(blocks)

    def truncate(self, seq_id: Hashable, n_blocks: int) -> list[int]:
        """Keep the first ``n_blocks`` of ``seq_id``'s table; the others lose this owner, the tail
        first (it is the least likely to be shared). Returns them, in that order."""
        table = self.table(seq_id)
        dropped = table[n_blocks:][::-1]
        for block in dropped:
            self.release(block)
        del table[n_blocks:]
        return dropped

    @answer_to("ex03.2")
    def free(self, seq_id: Hashable) -> list[int]:
        """Drop ``seq_id``: each of its blocks loses an owner (see ``truncate``); returns them."""
        dropped = self.truncate(seq_id, 0)
        del self.tables[seq_id]
        return dropped

    @answer_to("ex03.3")
    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Start ``child`` as a copy of ``parent`` that shares all its blocks; no data is copied."""
        if child in self.tables:
            raise ValueError(f"sequence {child!r} already exists")
        self.share(child, list(self.table(parent)))

    @answer_to("ex03.3")
    def copy_on_write(self, seq_id: Hashable, index: int) -> tuple[int, int] | None:
        """Before ``seq_id`` writes into block ``index`` of its table: if others share that block,
        move ``seq_id`` to a fresh block and return (old, new) for the data copy; else None."""
        table = self.table(seq_id)
        old = table[index]
        if self.ref_count[old] == 1:
            return None
        table[index], = self.take(1)
        self.ref_count[table[index]] = 1
        self.release(old)
        return old, table[index]

    def table(self, seq_id: Hashable) -> list[int]:
        try:
            return self.tables[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id!r} in the pool; it holds {list(self.tables)}") from None

    def check(self) -> None:
        """Assert the pool's invariants (see ``check_invariants``)."""
        check_invariants(self.free_blocks, self.ref_count, self.tables)


class BlockAllocator:
    """Slots for sequences of tokens, in the blocks of a ``BlockPool``, with prefix sharing.

    ``add_sequence`` starts a sequence from its prompt and ``append`` grows it: each reserves the
    slots of tokens whose keys and values the next forward pass writes. After the pass the caller
    says which tokens are computed (``mark_computed``): only then are full blocks named and, with
    ``prefix_caching``, offered to later prompts by the allocator's ``PrefixCache``. The allocator
    keeps how many slots each sequence has and the names of its blocks; the tokens are the caller's.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        check_counts(block_size=block_size)
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.prefix = PrefixCache(self.pool, block_size) if prefix_caching else None
        self.lengths: dict[Hashable, int] = {}  # slots each sequence has
        self.names: dict[Hashable, list[Name]] = {}  # each sequence's named (computed, full) blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def tables(self) -> dict[Hashable, list[int]]:
        return self.pool.tables

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: the free ones, and the cached ones nobody else holds."""
        return self.pool.num_free + (self.prefix.num_idle if self.prefix else 0)

    def table(self, seq_id: Hashable) -> list[int]:
        return self.pool.table(seq_id)

    def length(self, seq_id: Hashable) -> int:
        """Tokens ``seq_id`` has slots for."""
        self.pool.table(seq_id)
        return self.lengths[seq_id]

    def add_sequence(self, seq_id: Hashable, prompt: Sequence[int]) -> int:
        """Start ``seq_id`` with slots for its prompt, reusing cached blocks for the longest
        cached run of whole blocks at its start (never the block of the last token, whose logits
        the next forward must compute). Returns how many prompt tokens are already cached."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already exists")
        prompt = as_token_ids(prompt)  # hashed into the prefix cache's keys: a tensor's would never match
        if not prompt:
            raise ValueError("the prompt is empty: a sequence starts with at least one token")
        hits = self._reusable_prefix(prompt)
        ensure_free(self._blocks_taken(prompt, hits), self.num_free, self.num_blocks)
        for _, block in hits:
            self.prefix.revive(block)
        self.pool.share(seq_id, [block for _, block in hits])
        cached = len(hits) * self.block_size
        self.lengths[seq_id], self.names[seq_id] = cached, hits
        self.append(seq_id, len(prompt) - cached)
        return cached

    def blocks_needed(self, prompt: Sequence[int]) -> int:
        """How many free blocks ``add_sequence`` would take for this prompt now: its blocks but the
        cached ones it reuses (never the last token's), plus those of them that are free (cached,
        held by nobody), which it takes back from the free ones."""
        return self._blocks_taken(prompt, self._reusable_prefix(prompt))

    def cached_length(self, prompt: Sequence[int]) -> int:
        """How many of the prompt's tokens ``add_sequence`` would find in the cache now."""
        return len(self._reusable_prefix(prompt)) * self.block_size

    def append(self, seq_id: Hashable, n_tokens: int) -> list[tuple[int, int]]:
        """Reserve slots for ``n_tokens`` more tokens of ``seq_id``. If its last block is partly
        filled and shared, it gets its own copy first: returns the (source, destination) block
        copies the cache must make before writing."""
        table, length = self.pool.table(seq_id), self.lengths[seq_id]
        check_ints(n_tokens=n_tokens)
        if n_tokens < 0:
            raise ValueError(f"n_tokens={n_tokens} must be 0 or more: append reserves slots for new tokens "
                             "(truncate gives slots back)")
        shared_tail = n_tokens > 0 and length % self.block_size != 0 and self.pool.ref_count[table[-1]] > 1
        new_blocks = blocks_for(length + n_tokens, self.block_size) - len(table)
        self._make_room(new_blocks + shared_tail)
        copies = [self._copy_on_write(seq_id, len(table) - 1)] if shared_tail else []
        self.pool.allocate(seq_id, new_blocks)
        self.lengths[seq_id] = length + n_tokens
        return copies

    def mark_computed(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """``tokens``, the first tokens of ``seq_id``, now have their keys and values in the cache
        (the steps so far wrote them: not a token just sampled, which the next step writes): name
        the full blocks among them, so that, with prefix caching, later prompts may reuse them."""
        if isinstance(tokens, Tensor):  # its blocks' names would never match a prompt's
            raise ValueError(f"sequence {seq_id!r}: the computed tokens must be a list of ints, not a tensor")
        if len(tokens) > self.length(seq_id):
            raise ValueError(f"{len(tokens)} tokens computed for sequence {seq_id!r}, which has slots for "
                             f"{self.length(seq_id)}")
        if self.prefix is None:
            return
        names, table, size = self.names[seq_id], self.pool.tables[seq_id], self.block_size
        first = len(names)  # the first full block not named yet
        new = as_token_ids(tokens[first * size:len(tokens) // size * size])  # checked where they are hashed
        for i in range(len(new) // size):
            names.append(self.prefix.insert(names[-1] if names else None, new[i * size:(i + 1) * size], table[first + i]))

    def truncate(self, seq_id: Hashable, n_tokens: int) -> None:
        """Keep only the first ``n_tokens`` tokens of ``seq_id`` (a rollback, as speculative decoding
        needs): blocks past them are released, and a kept block that will be written again stops
        being offered as a cached prefix."""
        if not 0 < n_tokens <= self.length(seq_id):
            raise ValueError(f"n_tokens={n_tokens}: keep 1..{self.length(seq_id)} tokens of sequence {seq_id!r}")
        self._released(self.pool.truncate(seq_id, blocks_for(n_tokens, self.block_size)))
        self.lengths[seq_id] = n_tokens
        if self.prefix is not None:
            del self.names[seq_id][n_tokens // self.block_size:]
            if n_tokens % self.block_size:  # the last kept block is written again from n_tokens on
                self.prefix.before_rewrite(self.pool.tables[seq_id][-1])

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """As ``BlockPool.fork``; fork after the parent's forward pass, so the shared blocks hold
        its keys and values when a copy on write copies them."""
        self.pool.fork(parent, child)
        self.lengths[child], self.names[child] = self.lengths[parent], list(self.names[parent])

    def free(self, seq_id: Hashable) -> None:
        """Drop ``seq_id``; its named blocks stay cached while the cache holds them."""
        self._released(self.pool.free(seq_id))
        del self.lengths[seq_id], self.names[seq_id]

    def slot_mapping(self, seq_id: Hashable, positions: Sequence[int]) -> list[int]:
        """The cache slot of each position of ``seq_id``."""
        positions, length = list(positions), self.length(seq_id)
        for p in positions:
            if not 0 <= p < length:
                raise IndexError(f"position {p} of sequence {seq_id!r} has no slot: it has {length}")
        return slot_mapping(torch.tensor([self.tables[seq_id]]), torch.tensor([positions], dtype=torch.long),
                            self.block_size)[0].tolist()

    def block_states(self) -> list[str]:
        """Per block: "free", "cached" (held by the prefix cache alone, revivable), "used" or
        "shared" (held by more than one sequence)."""
        def state(block: int) -> str:
            cached = self.prefix is not None and block in self.prefix
            owners = self.pool.ref_count[block] - cached
            if owners:
                return "shared" if owners > 1 else "used"
            return "cached" if cached else "free"
        return [state(block) for block in range(self.num_blocks)]

    def check(self) -> None:
        """Assert the invariants: the pool's, with the prefix cache as one more owner; each table as
        long as its sequence's slots need; no more named blocks than full ones."""
        cached = {self.prefix: list(self.prefix.keys)} if self.prefix else {}
        check_invariants(self.pool.free_blocks, self.pool.ref_count, {**self.tables, **cached})
        if set(self.lengths) != set(self.tables) or set(self.names) != set(self.tables):
            raise AssertionError(f"sequences {set(self.lengths) ^ set(self.tables)} lack a table or a length")
        for seq_id, table in self.tables.items():
            length, named = self.lengths[seq_id], len(self.names[seq_id])
            if len(table) != blocks_for(length, self.block_size) or named > length // self.block_size:
                raise AssertionError(f"sequence {seq_id!r} has {length} slots in {len(table)} blocks, {named} named")
        if self.prefix:
            self.prefix.check()

    def _reusable_prefix(self, prompt: Sequence[int]) -> list[Name]:
        """The cached blocks a new sequence with this prompt reuses: never the last token's block."""
        if self.prefix is None:
            return []
        return self.prefix.match(prompt)[:(len(prompt) - 1) // self.block_size]

    def _blocks_taken(self, prompt: Sequence[int], hits: list[Name]) -> int:
        reviving = sum(self.prefix.is_idle(block) for _, block in hits)
        return blocks_for(len(prompt), self.block_size) - len(hits) + reviving

    def _make_room(self, n: int) -> None:
        """``n`` blocks on the pool's free list: uncached ones first, then cached ones that nobody
        else holds, evicted least recently used first (OutOfBlocks, nothing changed, if too few)."""
        ensure_free(n, self.num_free, self.num_blocks)
        while self.pool.num_free < n:
            self.prefix.evict()

    def _copy_on_write(self, seq_id: Hashable, index: int) -> tuple[int, int]:
        copy = self.pool.copy_on_write(seq_id, index)
        self._released([copy[0]])
        return copy

    def _released(self, blocks: Iterable[int]) -> None:
        """Tell the prefix cache, in order, which blocks lost an owner."""
        for block in blocks if self.prefix else ():
            self.prefix.release(block)


def sequences_that_fit(lengths: Sequence[int], memory_slots: int, block_size: int) -> int:
    """How many of the sequences, in order, a pool of ``memory_slots`` token slots holds at once:
    a real ``BlockAllocator`` of that size, filled until it runs out of blocks."""
    check_ints(memory_slots=memory_slots)
    check_counts(block_size=block_size)
    if (bad := next((n for n in lengths if n < 1), None)) is not None:
        raise ValueError(f"a sequence of {bad} tokens: every length must be at least 1")
    if memory_slots < block_size:
        raise ValueError(f"memory_slots={memory_slots} is less than one block of block_size={block_size}")
    allocator = BlockAllocator(memory_slots // block_size, block_size, prefix_caching=False)
    for fitted, n in enumerate(lengths):
        try:
            allocator.add_sequence(fitted, range(n))
        except OutOfBlocks:
            return fitted
    return len(lengths)


class DecodeGroup(NamedTuple):
    """Sequences with one new token each, attended in one call: where their tokens are in the
    step's row, their block tables ``[G, M]``, how many keys each attends to ``[G]``, and (for
    the gather path, None with a decode kernel) the additive mask ``[G, 1, 1, longest]``."""

    tokens: Tensor
    tables: Tensor
    lengths: Tensor
    mask: Tensor | None


class Chunk(NamedTuple):
    """One sequence with several new tokens (a prompt, or a chunk of one), attended on its own:
    where its tokens are in the row, its table ``[1, M]``, its additive causal mask ``[1, 1, n, end]``."""

    tokens: Tensor
    table: Tensor
    mask: Tensor


@dataclass(frozen=True, eq=False)
class PagedPlan(AttentionPlan):
    """A step through the paged cache, the same for every layer: the step's tokens in one row
    (``positions`` ``[1, total]``), the cache slot of each, the decoding sequences in groups of
    similar length and each longer run on its own, and where each sequence's last token is."""

    slots: Tensor
    decodes: list[DecodeGroup]
    chunks: list[Chunk]
    last: Tensor


class PagedKVCache:
    """The model's KV cache, in blocks: per layer a K pool and a V pool of
    ``[num_blocks, block_size, n_kv_heads, head_dim]``, handed out by a ``BlockAllocator``.

    A step: reserve the slots of the tokens it runs (``allocator.add_sequence`` for a prompt,
    ``cache.append`` after it, which also makes copy-on-write copies), ``plan`` it, run the model
    with the plan, and then record what was computed (``allocator.mark_computed``); ``step_logits``
    does the middle two. A step runs any mix of sequences, each from its first uncached token, all
    in a single row: a prompt chunk and many one-token decodes together, no padding.

    ``attend`` runs decoding sequences in batched calls, grouped by length so that few are padded
    far past their own (``group_overhead``: the padded key slots one more call is worth; on a CPU
    a call costs about what attending to 500 padded slots does, while a GPU pads cheaply and pays
    per kernel launch, so there all go in one group: issue 7's H100 run in BENCHMARKS' history),
    and each sequence with several new tokens in its own causal call. ``decode_kernel``, a
    function with the arguments of ``paged_attention``, attends for all the decoding sequences at
    once instead, straight from the pools: ``labkit.kernels.paged_decode`` (Triton, on a GPU) or
    ``labkit.kernels.paged_decode_cpu`` (C++, on a CPU).
    """

    def __init__(self, config: ModelConfig, allocator: BlockAllocator, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", decode_kernel: DecodeKernel | None = None,
                 spare_block: bool = False) -> None:
        self.allocator, self.decode_kernel, self.max_seq_len = allocator, decode_kernel, config.max_seq_len
        self.layout = kv_layout(config)
        # a spare block after the allocator's, which it never hands out: where the padding rows of a
        # CUDA graph's batch write (labkit.paged_graphs)
        self.spare_slot = allocator.num_blocks * allocator.block_size if spare_block else None
        shape = (config.n_layers, allocator.num_blocks + spare_block, allocator.block_size, config.n_kv_heads,
                 config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.group_overhead = 512 if self.k.device.type == "cpu" else 1 << 40
        if decode_kernel is not None:
            self._try_kernel(config)

    def _try_kernel(self, config: ModelConfig) -> None:
        """Run the decode kernel once, one query over slot 0 of block 0, so that a kernel that cannot
        serve this cache (another dtype or device, a block size it refuses) fails now, saying so."""
        q = torch.zeros(1, config.n_heads, config.head_dim, dtype=self.k.dtype, device=self.k.device)
        one = torch.ones(1, 1, dtype=torch.long, device=self.k.device)
        try:
            self.decode_kernel(q, self.k[0], self.v[0], one - 1, one[0])
        except (ValueError, RuntimeError, ImportError) as error:
            name = getattr(self.decode_kernel, "__name__", repr(self.decode_kernel))
            raise ValueError(f"decode_kernel {name} cannot attend over this cache ({self.k.dtype} on "
                             f"{self.k.device}, blocks of {self.allocator.block_size}): {error}") from error

    def append(self, seq_id: Hashable, n_tokens: int) -> None:
        """Reserve slots for ``n_tokens`` more tokens of ``seq_id``, copying a shared last block first."""
        self.copy_blocks(self.allocator.append(seq_id, n_tokens))

    def copy_blocks(self, copies: Iterable[tuple[int, int]]) -> None:
        """Copy the keys and values of block ``old`` into block ``new`` for each (old, new), every layer."""
        for old, new in copies:
            self.k[:, new], self.v[:, new] = self.k[:, old], self.v[:, old]

    def block_tables(self, seq_ids: Sequence[Hashable]) -> Tensor:
        """``[len(seq_ids), max_blocks]``: their tables, padded with block 0 (gathered, then masked)."""
        tables = [self.allocator.table(s) for s in seq_ids]
        width = max(map(len, tables))
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=self.k.device)

    def plan(self, runs: Sequence[Run]) -> PagedPlan:
        """The plan of a step that runs, for each (sequence id, start, count) of ``runs``, the
        sequence's tokens at positions start .. start + count - 1, whose slots are reserved: all in
        one row, each sequence's after the previous one's."""
        self._check(runs)
        device, counts = self.k.device, [n for _, _, n in runs]
        ends = [start + n for _, start, n in runs]
        offsets = list(accumulate(counts, initial=0))  # where each sequence's tokens start in the row
        positions = torch.tensor([p for _, start, n in runs for p in range(start, start + n)], device=device)
        tables = self.block_tables([seq_id for seq_id, _, _ in runs])
        owner = torch.repeat_interleave(torch.arange(len(runs), device=device), torch.tensor(counts, device=device))
        slots = slot_mapping(tables[owner], positions[:, None], self.allocator.block_size)[:, 0]
        chunks = [Chunk(torch.arange(offsets[i], offsets[i + 1], device=device), self._tables(tables, [i], ends[i]),
                        self._additive(causal_mask(positions[offsets[i]:offsets[i + 1]][None],
                                                   torch.arange(ends[i], device=device)[None])))
                  for i, n in enumerate(counts) if n > 1]
        decoding = [i for i, n in enumerate(counts) if n == 1]
        decodes = self._decode_groups(decoding, [offsets[i] for i in decoding], [ends[i] for i in decoding], tables)
        last = torch.tensor(offsets[1:], device=device) - 1
        return PagedPlan(self, positions[None], slots, decodes, chunks, last)

    def _check(self, runs: Sequence[Run]) -> None:
        """A clear error for runs given as anything but (sequence id, start, count) triples, a run
        that is empty, that reaches past the slots its sequence reserved or past the context."""
        if isinstance(runs, Tensor):
            raise TypeError(f"plan takes the step's runs, [(sequence id, first position, new tokens), ...], "
                            f"not positions: {runs!r:.60}")
        if not runs:
            raise ValueError("a step runs at least one sequence: give plan one run or more")
        for seq_id, start, n in runs:
            if n < 1 or start < 0 or start + n > self.allocator.length(seq_id):
                raise ValueError(f"sequence {seq_id!r}: positions {start}..{start + n - 1} need slots 0..{start + n - 1}, "
                                 f"and it has {self.allocator.length(seq_id)} (reserve them with add_sequence or "
                                 "append first); a run has at least one token")
            if start + n > self.max_seq_len:
                raise ValueError(f"sequence {seq_id!r}: position {start + n - 1} is past the context limit "
                                 f"max_seq_len={self.max_seq_len}")

    def _decode_groups(self, members: list[int], tokens: list[int], lengths: list[int],
                       tables: Tensor) -> list[DecodeGroup]:
        """The sequences with one new token (``members``, rows of ``tables``; their tokens' places in
        the row; how many keys each reads), in groups of similar length (``length_groups``): a group's
        keys and values are gathered and attended padded to its longest member. With a decode kernel,
        all in one group, which reads each sequence's own length."""
        device, groups = self.k.device, []
        split = [list(range(len(members)))] if self.decode_kernel is not None and members else \
            length_groups(lengths, self.group_overhead)
        for group in split:
            longest = max(lengths[g] for g in group)
            group_lengths = torch.tensor([lengths[g] for g in group], device=device)
            mask = None if self.decode_kernel is not None else \
                self._additive((torch.arange(longest, device=device) < group_lengths[:, None])[:, None, None])
            groups.append(DecodeGroup(torch.tensor([tokens[g] for g in group], device=device),
                                      self._tables(tables, [members[g] for g in group], longest), group_lengths, mask))
        return groups

    def _tables(self, tables: Tensor, rows: list[int], length: int) -> Tensor:
        """The block tables of ``rows``, cut to the blocks of their first ``length`` positions and
        laid out in one piece, once per step instead of in every layer's gather."""
        return tables[rows, :blocks_for(length, self.allocator.block_size)].contiguous()

    def _additive(self, mask: Tensor) -> Tensor:
        """A boolean mask as SDPA's additive one (0 where allowed, -inf elsewhere), made once per
        step instead of inside every layer's attention call."""
        return torch.zeros(mask.shape, dtype=self.k.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, plan: PagedPlan) -> Tensor:
        """Write the step's new keys and values ``[1, n_kv_heads, total, head_dim]`` at their slots,
        then the attention output ``[1, n_heads, total, head_dim]`` of its queries."""
        q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))  # [total, heads, dim]
        self.k[layer].flatten(0, 1)[plan.slots] = k.type_as(self.k)
        self.v[layer].flatten(0, 1)[plan.slots] = v.type_as(self.v)
        return self._attend_tokens(q, (self.k[layer], self.v[layer]), plan).transpose(0, 1)[None]

    def _attend_tokens(self, q: Tensor, pools: tuple[Tensor, Tensor], plan: PagedPlan) -> Tensor:
        """The attention output of each query ``[total, heads, dim]``, by group and by chunk; when a
        decode kernel serves every query, straight from the kernel."""
        if self.decode_kernel is not None and not plan.chunks:
            (_, tables, lengths, _), = plan.decodes  # every query decodes, in order: nothing to scatter
            return self.decode_kernel(q, *pools, tables, lengths)
        out = torch.zeros_like(q)
        for tokens, tables, lengths, mask in plan.decodes:
            if self.decode_kernel is not None:
                out[tokens] = self.decode_kernel(q[tokens], *pools, tables, lengths)
            else:
                out[tokens] = attend_blocks(q[tokens][:, :, None], *pools, tables, mask)[:, :, 0]
        for tokens, table, mask in plan.chunks:
            query = q[tokens].transpose(0, 1)[None]  # [1, heads, n, dim]
            out[tokens] = attend_blocks(query, *pools, table, mask)[0].transpose(0, 1)
        return out

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def step_logits(model: Transformer, cache: PagedKVCache, runs: Sequence[Run], tokens: Sequence[int],
                rows: Sequence[int] | None = None) -> Tensor:
    """One forward pass over the paged cache: ``tokens`` (those the ``runs`` run, one after another)
    through the model with the step's plan; the logits ``[len(rows), vocab]`` of the last token of
    each run at ``rows`` (default: every run). It records nothing: that is the caller's, after."""
    plan = cache.plan(runs)
    last = plan.last if rows is None else plan.last[list(rows)]
    with torch.inference_mode():
        return model(torch.tensor([tokens], device=model.device), plan=plan, logits_at=last)[0]


def generate_paged(model: Transformer, cache: PagedKVCache, prompts: Sequence[Sequence[int]],
                   new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Greedy generation of several prompts through the paged cache: each prompt's uncached
    tokens prefilled on its own (no padding), then one token per sequence per step, all in one
    batch. Returns the new tokens of each prompt and how many of its tokens the prefix cache
    already held. The sequences are freed at the end: their full blocks stay cached."""
    if new_tokens < 1 or len(prompts) == 0:
        raise ValueError(f"new_tokens={new_tokens} must be at least 1, and there must be a prompt "
                         f"(got {len(prompts)})")
    allocator = cache.allocator
    prompts = [as_token_ids(p, model.config.vocab_size) for p in prompts]
    seq_ids = [("generate", i) for i in range(len(prompts))]
    added: list[Hashable] = []  # freed at the end, and only these: the caller's sequences stay
    out: list[list[int]] = []
    cached: list[int] = []
    try:
        for seq, prompt in zip(seq_ids, prompts):
            cached.append(allocator.add_sequence(seq, prompt))
            added.append(seq)
            logits = step_logits(model, cache, [(seq, cached[-1], len(prompt) - cached[-1])], prompt[cached[-1]:])
            allocator.mark_computed(seq, prompt)
            out.append([int(logits[0].argmax())])
        for step in range(1, new_tokens):
            for seq in seq_ids:
                cache.append(seq, 1)
            runs = [(seq, len(p) + step - 1, 1) for seq, p in zip(seq_ids, prompts)]
            logits = step_logits(model, cache, runs, [new[-1] for new in out])
            for seq, prompt, new, token in zip(seq_ids, prompts, out, logits.argmax(-1).tolist()):
                allocator.mark_computed(seq, prompt + new)
                new.append(token)
        return out, cached
    finally:
        for seq in added:
            allocator.free(seq)
