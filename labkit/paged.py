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
- Prefix sharing: a full block whose keys and values have been written is named by a chained
  hash, hash(parent's hash, its tokens), so equal names mean equal text from the start of the
  sequence. A new prompt that starts with named blocks reuses them, after checking their
  tokens and parent block (a hash can collide). A freed named block keeps its keys and values
  until the pool needs it back, least recently used first: the pool doubles as a prefix cache.

``BlockPool`` is the bare bookkeeping (free list, counts, tables); ``BlockAllocator`` adds
forking, tokens and prefix sharing; ``PagedKVCache`` holds the tensors and plugs into the
model's ``KVCache`` interface. ``paged_attention`` is the reference decode attention that
gathers keys and values through the block tables.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from labkit.kernels import check_paged_decode
from labkit.memory import ModelShape, kv_bytes_per_token
from labkit.model import ModelConfig, Transformer, attention, causal_mask, check_ints, token_ids

# q [B, n_heads, d], k_pool, v_pool, block_tables, lengths -> [B, n_heads, d]: as paged_attention
DecodeKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class OutOfBlocks(RuntimeError):
    """Too few free blocks for the request; raised before anything changed."""


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that ``n_tokens`` tokens occupy: ceil(n_tokens / block_size)."""
    return -(-n_tokens // block_size)


def num_blocks_for_memory(model: ModelShape, memory_bytes: float, block_size: int, dtype: str = "fp16") -> int:
    """How many blocks a memory budget holds, by the memory lab's bytes per token."""
    if memory_bytes < 0 or block_size < 1:
        raise ValueError(f"memory_bytes={memory_bytes} must be >= 0 and block_size={block_size} >= 1")
    return math.floor(memory_bytes / (kv_bytes_per_token(model, dtype) * block_size))


def lognormal_lengths(n: int, median: float, sigma: float, low: int, high: int,
                      seed: int | torch.Generator) -> list[int]:
    """``n`` token counts, lognormal around ``median`` (spread ``sigma``), clipped to [low, high];
    drawn from ``seed``, a generator or the seed of a fresh one."""
    check_ints(n=n, low=low, high=high)
    if not (median > 0 and sigma >= 0 and 1 <= low <= high):
        raise ValueError(f"lognormal({median}, {sigma}, {low}, {high}): need median > 0, sigma >= 0, 1 <= low <= high")
    generator = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    draws = torch.exp(math.log(median) + sigma * torch.randn(n, generator=generator, dtype=torch.float64))
    return draws.round().clamp(low, high).long().tolist()


def workload_lengths(n: int = 400, context: int = 2048, prompt_median: float = 256, output_median: float = 128,
                     spread: float = 1.0, seed: int = 0) -> list[int]:
    """Final lengths (prompt + output, capped at ``context``) of ``n`` requests whose prompt and
    output lengths are lognormal: most short, a few long."""
    prompts = lognormal_lengths(n, prompt_median, spread, 1, context - 1, seed)
    outputs = lognormal_lengths(n, output_median, spread, 1, context, seed + 1)
    return [min(p + o, context) for p, o in zip(prompts, outputs)]


def fragmentation(lengths: Sequence[int], context: int, block_size: int) -> dict[str, float]:
    """Memory, in token slots, for sequences of ``lengths`` tokens: reserved by contiguous
    allocation of ``context`` slots each, held by paged blocks, and the share of each not used."""
    if not lengths or min(lengths) < 1 or max(lengths) > context:
        raise ValueError(f"lengths must be a non-empty list of 1..context={context} tokens")
    used = sum(lengths)
    reserved = len(lengths) * context
    held = sum(blocks_for(n, block_size) for n in lengths) * block_size
    return {"used": used, "contiguous_reserved": reserved, "paged_held": held,
            "contiguous_waste": 1 - used / reserved, "paged_waste": 1 - used / held}


def sequences_that_fit(lengths: Sequence[int], memory_slots: int, block_size: int) -> int:
    """How many of the sequences, in order, a pool of ``memory_slots`` token slots holds at once:
    a real ``BlockAllocator`` of that size, filled until it runs out of blocks."""
    if memory_slots < block_size:
        raise ValueError(f"memory_slots={memory_slots} is less than one block of block_size={block_size}")
    allocator = BlockAllocator(memory_slots // block_size, block_size, prefix_caching=False)
    for fitted, n in enumerate(lengths):
        try:
            allocator.add_sequence(fitted, range(n))
        except OutOfBlocks:
            return fitted
    return len(lengths)


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
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be at least 1")
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.ref_count = [0] * num_blocks
        self.tables: dict[Hashable, list[int]] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now."""
        return len(self.free_blocks)

    def allocate(self, seq_id: Hashable, n_blocks: int) -> list[int]:
        """Append ``n_blocks`` fresh blocks to ``seq_id``'s table (a new table if it has none)."""
        if n_blocks < 0:
            raise ValueError(f"n_blocks={n_blocks} must not be negative")
        blocks = self._take(n_blocks)
        for block in blocks:
            self.ref_count[block] = 1
        self.tables.setdefault(seq_id, []).extend(blocks)
        return blocks

    def free(self, seq_id: Hashable) -> None:
        """Drop ``seq_id``: each of its blocks loses an owner; a block nobody holds is free again."""
        for block in reversed(self.table(seq_id)):  # the tail first: it is the least likely to be shared
            self._release(block)
        del self.tables[seq_id]

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Start ``child`` as a copy of ``parent`` that shares all its blocks; no data is copied."""
        if child in self.tables:
            raise ValueError(f"sequence {child!r} already exists")
        table = list(self.table(parent))
        for block in table:
            self.ref_count[block] += 1
        self.tables[child] = table

    def copy_on_write(self, seq_id: Hashable, index: int) -> tuple[int, int] | None:
        """Before ``seq_id`` writes into block ``index`` of its table: if others share that block,
        move ``seq_id`` to a fresh block and return (old, new) for the data copy; else None."""
        table = self.table(seq_id)
        old = table[index]
        if self.ref_count[old] == 1:
            return None
        table[index], = self._take(1)
        self.ref_count[table[index]] = 1
        self._release(old)
        return old, table[index]

    def table(self, seq_id: Hashable) -> list[int]:
        try:
            return self.tables[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id!r} in the pool; it holds {list(self.tables)}") from None

    def _ensure_free(self, n: int) -> None:
        """OutOfBlocks, before anything changes, unless ``n`` blocks can be handed out."""
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} free blocks but only {self.num_free} of {self.num_blocks} are free")

    def _take(self, n: int) -> list[int]:
        """``n`` free blocks, or OutOfBlocks with nothing taken."""
        self._ensure_free(n)
        return [self.free_blocks.pop() for _ in range(n)]

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_blocks.append(block)

    def check(self) -> None:
        """Assert the pool's invariants (see ``check_invariants``)."""
        check_invariants(self.free_blocks, self.ref_count, self.tables)


class BlockAllocator(BlockPool):
    """Blocks for sequences of tokens, with prefix sharing.

    ``add_sequence`` starts a sequence from its prompt and ``append`` grows it: each reserves
    the slots of tokens whose keys and values the next forward pass writes. ``mark_computed``
    (which ``PagedKVCache`` calls after that pass) records that they are written; only then
    are full blocks named and offered to later prompts. ``fork`` and ``free`` as in ``BlockPool``.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        super().__init__(num_blocks)
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be at least 1")
        self.block_size, self.prefix_caching = block_size, prefix_caching
        self.tokens: dict[Hashable, list[int]] = {}  # every token a sequence has a slot for
        self.computed: dict[Hashable, int] = {}  # how many of them have their keys and values written
        self.names: dict[Hashable, list[tuple[int, int]]] = {}  # (hash, cached block) of each named full block
        self.cached: dict[int, int] = {}  # chained hash -> the block holding those tokens
        self.block_key: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}  # block -> (hash, parent block, tokens)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but still cached, least recent first

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    def length(self, seq_id: Hashable) -> int:
        """Tokens ``seq_id`` has slots for."""
        self.table(seq_id)
        return len(self.tokens[seq_id])

    def allocate(self, seq_id: Hashable, n_blocks: int) -> list[int]:
        raise TypeError("a BlockAllocator reserves slots for tokens: use add_sequence(seq_id, prompt) "
                        "or append(seq_id, tokens)")

    def add_sequence(self, seq_id: Hashable, prompt: Sequence[int]) -> int:
        """Start ``seq_id`` with slots for its prompt, reusing cached blocks for the longest
        cached run of whole blocks at its start (never the block of the last token, whose logits
        the next forward must compute). Returns how many prompt tokens are already cached."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already exists")
        prompt = token_ids(prompt)  # hashed into the prefix cache's keys: a tensor's would never match
        if not prompt:
            raise ValueError("the prompt is empty: a sequence starts with at least one token")
        hits = self._reusable_prefix(prompt)
        self._ensure_free(self._blocks_taken(prompt, hits))
        for _, block in hits:
            if self.ref_count[block] == 0:
                del self.evictable[block]
            self.ref_count[block] += 1
        cached = len(hits) * self.block_size
        self.tables[seq_id] = [block for _, block in hits]
        self.tokens[seq_id], self.computed[seq_id], self.names[seq_id] = list(prompt[:cached]), cached, hits
        self.append(seq_id, prompt[cached:])
        return cached

    def blocks_needed(self, prompt: Sequence[int]) -> int:
        """How many free blocks ``add_sequence`` would take for this prompt now: its blocks but the
        cached ones it reuses (never the last token's), plus those of them that are free (cached,
        held by nobody), which it takes back from the free ones."""
        return self._blocks_taken(prompt, self._reusable_prefix(prompt))

    def _blocks_taken(self, prompt: Sequence[int], hits: list[tuple[int, int]]) -> int:
        reviving = sum(self.ref_count[block] == 0 for _, block in hits)
        return blocks_for(len(prompt), self.block_size) - len(hits) + reviving

    def cached_length(self, prompt: Sequence[int]) -> int:
        """How many of the prompt's tokens ``add_sequence`` would find in the cache now."""
        return len(self._reusable_prefix(prompt)) * self.block_size

    def _reusable_prefix(self, prompt: Sequence[int]) -> list[tuple[int, int]]:
        """The cached blocks a new sequence with this prompt reuses: never the last token's block."""
        return self._cached_prefix(prompt)[:(len(prompt) - 1) // self.block_size]

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """Reserve slots for ``tokens`` after ``seq_id``'s last one. If its last block is partly
        filled and shared, it gets its own copy first: returns the (source, destination) block
        copies the cache must make before writing."""
        table, have, tokens = self.table(seq_id), self.tokens[seq_id], token_ids(tokens)
        shared_tail = len(have) % self.block_size != 0 and self.ref_count[table[-1]] > 1 and len(tokens) > 0
        new_blocks = blocks_for(len(have) + len(tokens), self.block_size) - len(table)
        self._ensure_free(new_blocks + shared_tail)
        copies = [self.copy_on_write(seq_id, len(table) - 1)] if shared_tail else []
        BlockPool.allocate(self, seq_id, new_blocks)
        have.extend(tokens)
        return copies

    def mark_computed(self, seq_id: Hashable, n_tokens: int) -> None:
        """The keys and values of ``seq_id``'s first ``n_tokens`` tokens are now in the cache: name
        the full blocks among them so that, with prefix caching, later prompts may reuse them."""
        if not 0 <= n_tokens <= self.length(seq_id):
            raise ValueError(f"n_tokens={n_tokens}: sequence {seq_id!r} has slots for {self.length(seq_id)} tokens")
        self.computed[seq_id] = max(self.computed[seq_id], n_tokens)
        self._name_full_blocks(seq_id)

    def uncompute(self, seq_id: Hashable, n_tokens: int) -> None:
        """Count only the first ``n_tokens`` of ``seq_id``'s tokens as computed, the rest to be run
        again (an engine step interrupted after its forward pass): they keep their slots, and blocks
        of theirs that are cached stay cached (what was written in them is right)."""
        if not 0 <= n_tokens <= self.computed[seq_id]:
            raise ValueError(f"n_tokens={n_tokens}: sequence {seq_id!r} has {self.computed[seq_id]} computed tokens")
        self.computed[seq_id] = n_tokens
        del self.names[seq_id][n_tokens // self.block_size:]

    def truncate(self, seq_id: Hashable, n_tokens: int) -> None:
        """Keep only the first ``n_tokens`` tokens of ``seq_id`` (a rollback, as speculative decoding
        needs): blocks past them are released, and a kept block that will be written again stops
        being offered as a cached prefix."""
        if not 0 < n_tokens <= self.length(seq_id):
            raise ValueError(f"n_tokens={n_tokens}: keep 1..{self.length(seq_id)} tokens of sequence {seq_id!r}")
        table, keep = self.tables[seq_id], blocks_for(n_tokens, self.block_size)
        for block in reversed(table[keep:]):
            self._release(block)
        del table[keep:], self.tokens[seq_id][n_tokens:]
        self.uncompute(seq_id, min(self.computed[seq_id], n_tokens))
        tail = table[-1]
        if n_tokens % self.block_size and self.ref_count[tail] == 1 and tail in self.block_key:
            del self.cached[self.block_key.pop(tail)[0]]

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """As ``BlockPool.fork``; fork after the parent's forward pass, so the shared blocks hold
        its keys and values when a copy on write copies them."""
        super().fork(parent, child)
        self.tokens[child], self.names[child] = list(self.tokens[parent]), list(self.names[parent])
        self.computed[child] = self.computed[parent]

    def free(self, seq_id: Hashable) -> None:
        super().free(seq_id)
        del self.tokens[seq_id], self.computed[seq_id], self.names[seq_id]

    def slot_mapping(self, seq_id: Hashable, positions: Sequence[int]) -> list[int]:
        """The cache slot of each position of ``seq_id``."""
        positions, length = list(positions), self.length(seq_id)
        for p in positions:
            if not 0 <= p < length:
                raise IndexError(f"position {p} of sequence {seq_id!r} has no slot: it has {length}")
        return slot_mapping(torch.tensor([self.tables[seq_id]]), torch.tensor([positions], dtype=torch.long),
                            self.block_size)[0].tolist()

    def block_states(self) -> list[str]:
        """Per block: "free", "cached" (free, but holding a prefix that can be revived), "used"
        or "shared" (held by more than one sequence)."""
        def state(block: int) -> str:
            if self.ref_count[block]:
                return "shared" if self.ref_count[block] > 1 else "used"
            return "cached" if block in self.evictable else "free"
        return [state(block) for block in range(self.num_blocks)]

    def check(self) -> None:
        check_invariants([*self.free_blocks, *self.evictable], self.ref_count, self.tables)
        for seq_id, table in self.tables.items():
            tokens, computed = len(self.tokens[seq_id]), self.computed[seq_id]
            if len(table) != blocks_for(tokens, self.block_size):
                raise AssertionError(f"sequence {seq_id!r} has {tokens} tokens in {len(table)} blocks")
            if not computed <= tokens or len(self.names[seq_id]) != computed // self.block_size:
                raise AssertionError(f"sequence {seq_id!r}: {len(self.names[seq_id])} named blocks for "
                                     f"{computed} computed tokens of {tokens}")
        if not set(self.evictable) <= set(self.block_key):
            raise AssertionError("a cached free block has no name")
        for h, block in self.cached.items():
            if self.block_key[block][0] != h:
                raise AssertionError(f"block {block} is cached under a hash it does not carry")

    def _take(self, n: int) -> list[int]:
        """Uncached free blocks first; then cached ones, least recently used first, forgetting them."""
        self._ensure_free(n)
        fresh = [self.free_blocks.pop() for _ in range(min(n, len(self.free_blocks)))]
        return fresh + [self._evict() for _ in range(n - len(fresh))]

    def _evict(self) -> int:
        block, _ = self.evictable.popitem(last=False)
        del self.cached[self.block_key.pop(block)[0]]
        return block

    def _release(self, block: int) -> None:
        """A named block its last owner lets go of stays cached, at the most recently used end."""
        if self.ref_count[block] == 1 and block in self.block_key:
            self.ref_count[block] = 0
            self.evictable[block] = None
        else:
            super()._release(block)

    @staticmethod
    def _block_key(parent: tuple[int, int] | None, tokens: Sequence[int]) -> tuple[int, int | None, tuple[int, ...]]:
        """A full block's name: the hash of its parent's name and its tokens, kept with the
        parent's block and the tokens, which a hit must match too (hashes can collide)."""
        tokens = tuple(tokens)
        return (hash((parent[0] if parent else None, tokens)), parent[1] if parent else None, tokens)

    def _cached_prefix(self, prompt: Sequence[int]) -> list[tuple[int, int]]:
        """(hash, block) of each cached block that continues the prompt from its start."""
        hits: list[tuple[int, int]] = []
        size = self.block_size
        for start in range(0, len(prompt) - size + 1, size):
            key = self._block_key(hits[-1] if hits else None, prompt[start:start + size])
            block = self.cached.get(key[0])
            if block is None or self.block_key[block] != key:  # a miss, or a hash collision
                break
            hits.append((key[0], block))
        return hits

    def _name_full_blocks(self, seq_id: Hashable) -> None:
        """Name the sequence's newly computed full blocks; with prefix caching, offer each to
        later prompts unless an identical block is cached already."""
        tokens, names, table, size = self.tokens[seq_id], self.names[seq_id], self.tables[seq_id], self.block_size
        for index in range(len(names), self.computed[seq_id] // size):
            key = self._block_key(names[-1] if names else None, tokens[index * size:(index + 1) * size])
            holder = self.cached.get(key[0])
            if holder is not None and self.block_key[holder] == key:
                names.append((key[0], holder))  # the same text is cached: later prompts find that block
                continue
            if holder is None and self.prefix_caching and table[index] not in self.block_key:
                self.cached[key[0]], self.block_key[table[index]] = table[index], key
            names.append((key[0], table[index]))



def slot_mapping(block_tables: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Cache slots ``[B, T]`` for ``positions`` ``[B, T]`` of the sequences whose block tables are
    the rows of ``block_tables`` ``[B, max_blocks]``; position -1 (padding) maps to -1."""
    clamped = positions.clamp(min=0)
    blocks = block_tables.gather(1, clamped // block_size)
    return torch.where(positions >= 0, blocks * block_size + clamped % block_size, -1)


def gather_kv(pool: Tensor, block_tables: Tensor, length: int) -> Tensor:
    """Positions 0..length-1 of each sequence, ``[B, n_kv_heads, length, head_dim]``, read from a
    layer's pool ``[num_blocks, block_size, n_kv_heads, head_dim]`` a whole block at a time
    through the block tables ``[B, >= ceil(length / block_size)]``."""
    batch, (_, size, heads, dim) = block_tables.shape[0], pool.shape
    ids = block_tables[:, :blocks_for(length, size)].flatten()
    blocks = pool.flatten(1).index_select(0, ids)  # one row per block: far faster than pool[tables]
    return blocks.view(batch, -1, heads, dim)[:, :length].transpose(1, 2)


def attend_blocks(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, mask: Tensor) -> Tensor:
    """Attention of ``q`` ``[B, n_heads, T, head_dim]`` over the first ``S = mask.shape[-1]`` keys
    and values of each sequence, gathered from the pools through ``block_tables``, where
    ``mask`` ``[B, 1, T, S]`` allows."""
    length = mask.shape[-1]
    return attention(q, gather_kv(k_pool, block_tables, length), gather_kv(v_pool, block_tables, length), mask)


def paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, lengths: Tensor) -> Tensor:
    """Decode attention, one new query per sequence: ``q`` ``[B, n_heads, head_dim]`` attends
    to the first ``lengths[b]`` keys and values of sequence b, gathered from the pools
    ``[num_blocks, block_size, n_kv_heads, head_dim]`` through ``block_tables`` ``[B, max_blocks]``.
    Checked as the decode kernels check their operands (``labkit.kernels.check_paged_decode``)."""
    check_paged_decode(q, k_pool, v_pool, block_tables, lengths, dtypes=(q.dtype,))
    mask = torch.arange(int(lengths.max()), device=q.device)[None] < lengths[:, None]
    return attend_blocks(q[:, :, None], k_pool, v_pool, block_tables, mask[:, None, None])[:, :, 0]


def length_groups(lengths: Sequence[int], overhead: int) -> list[list[int]]:
    """Split the indices of ``lengths`` into groups of similar length, to be attended one group
    at a time, each padded to its longest: the split, among groups of consecutive lengths in
    sorted order, that minimises the padded slots (members x longest, summed over the groups)
    plus ``overhead`` slots per group, the fixed cost of one more call. Dynamic programming
    over the sorted lengths, longest group first."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best, cut = [0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):  # the first ``end`` sorted lengths, last group ending there
        longest = lengths[order[end - 1]]
        for start in range(end):
            cost = best[start] + (end - start) * longest + overhead
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return groups


@dataclass
class _Batch:
    """What one forward pass over the paged cache does, the same for every layer: the flat index
    and slot of each real token; the decoding sequences (one new token each), attended in groups
    of similar length; and each sequence with several new tokens (a prompt or a chunk of one),
    attended on its own. Each group or chunk: flat indices, block tables, mask."""

    tokens: Tensor  # flat indices (in B * T) of the real tokens
    slots: Tensor
    decodes: list[tuple[Tensor, Tensor, Tensor]]  # per group: indices, tables [G, M], mask [G, 1, 1, longest]
    # (with a decode kernel, one group of all of them, and their lengths [G] in place of the mask)
    chunks: list[tuple[Tensor, Tensor, Tensor]]  # per sequence: indices, table [1, M], causal mask [1, 1, n, end]
    ends: list[int]  # per sequence: its tokens in the cache after this pass


class PagedKVCache:
    """The model's KV cache, in blocks: per layer a K pool and a V pool of
    ``[num_blocks, block_size, n_kv_heads, head_dim]``, handed out by a ``BlockAllocator``.

    Before each forward pass, reserve the slots of the tokens it runs (``allocator.add_sequence``
    for a prompt, ``cache.append`` after it, which also makes copy-on-write copies) and name the
    sequences it runs in ``seq_ids``: one per batch row, or, with ``query_lens``, all in a single
    row, ``query_lens[i]`` tokens of sequence i after those of sequence i - 1 (a ragged batch: a
    prompt chunk and many one-token decodes together, no padding). A sequence runs only tokens
    not yet in the cache; once the last layer has written them, the cache marks them computed.

    The cache does attention itself (``attend``): decoding sequences in batched calls, grouped by
    length so that few are padded far past their own (``group_overhead``: the padded key slots one
    more call is worth), each sequence with several new tokens in its own causal call.
    ``decode_kernel``, a function with the arguments of ``paged_attention``, attends for all the
    decoding sequences at once instead, straight from the pools: ``labkit.kernels.paged_decode``
    (Triton, on a GPU) or ``labkit.kernels.paged_decode_cpu.paged_decode_cpu`` (C++, on a CPU).
    """

    def __init__(self, config: ModelConfig, allocator: BlockAllocator, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", decode_kernel: DecodeKernel | None = None) -> None:
        self.allocator, self.decode_kernel = allocator, decode_kernel
        shape = (config.n_layers, allocator.num_blocks, allocator.block_size, config.n_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.seq_ids: list[Hashable] = []
        self.query_lens: list[int] | None = None
        # on a CPU a call costs about what attending to 500 padded slots does; a GPU pads cheaply
        # and pays per kernel launch, so there all go in one group (the engine benchmark's
        # workload on an H100: 3.4 to 4.7 s in one group, 3.8 to 5.7 s split at 512 slots a call)
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

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Reserve slots for ``tokens`` after ``seq_id``'s last one, copying a shared last block first."""
        self.copy_blocks(self.allocator.append(seq_id, tokens))

    def copy_blocks(self, copies: Iterable[tuple[int, int]]) -> None:
        """Copy the keys and values of block ``old`` into block ``new`` for each (old, new), every layer."""
        for old, new in copies:
            self.k[:, new], self.v[:, new] = self.k[:, old], self.v[:, old]

    def block_tables(self) -> Tensor:
        """``[B, max_blocks]``: the tables of ``seq_ids``, padded with block 0 (gathered, then masked)."""
        tables = [self.allocator.table(s) for s in self.seq_ids]
        width = max(map(len, tables))
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=self.k.device)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
        """Write the new keys and values ``[B, n_kv_heads, T, head_dim]`` at their slots, then
        the attention output ``[B, n_heads, T, head_dim]`` of the queries (zero at padding)."""
        if layer >= self.k.shape[0]:
            raise ValueError(f"the model runs layer {layer}, but this cache has layers 0..{self.k.shape[0] - 1}: "
                             "build it from the model's own config")
        if layer == 0:  # the slots, tables and masks are the same for every layer of one forward
            self._step = self._plan(positions)
        step, (batch, heads, length, dim) = self._step, q.shape
        q, k, v = (x.transpose(1, 2).flatten(0, 1) for x in (q, k, v))  # [B * T, heads, dim]
        if len(step.tokens) < len(k):  # padding: write the real tokens only
            k, v = k[step.tokens], v[step.tokens]
        self.k[layer].flatten(0, 1)[step.slots] = k.type_as(self.k)
        self.v[layer].flatten(0, 1)[step.slots] = v.type_as(self.v)
        out = self._attend_tokens(q, (self.k[layer], self.v[layer]), step)
        if layer == self.k.shape[0] - 1:  # every layer has written: these tokens are computed
            for seq_id, end in zip(self.seq_ids, step.ends):
                self.allocator.mark_computed(seq_id, end)
        return out.view(batch, length, heads, dim).transpose(1, 2)

    def _attend_tokens(self, q: Tensor, pools: tuple[Tensor, Tensor], step: _Batch) -> Tensor:
        """The attention output of each query ``[B * T, heads, dim]`` (zero at padding), by group
        and by chunk; when a decode kernel serves every query, straight from the kernel."""
        if self.decode_kernel is not None and not step.chunks and len(step.tokens) == len(q):
            (_, tables, lengths), = step.decodes  # every query decodes, in order: nothing to scatter
            return self.decode_kernel(q, *pools, tables, lengths)
        out = torch.zeros_like(q)
        for tokens, tables, mask in step.decodes:
            if self.decode_kernel is not None:  # mask: the group's lengths
                out[tokens] = self.decode_kernel(q[tokens], *pools, tables, mask)
            else:
                out[tokens] = attend_blocks(q[tokens][:, :, None], *pools, tables, mask)[:, :, 0]
        for tokens, table, mask in step.chunks:
            query = q[tokens].transpose(0, 1)[None]  # [1, heads, n, dim]
            out[tokens] = attend_blocks(query, *pools, table, mask)[0].transpose(0, 1)
        return out

    def _sequence_of_tokens(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The flat index of each real token, and the index in ``seq_ids`` of its sequence."""
        rows, width = positions.shape
        if self.query_lens is None and len(self.seq_ids) != rows:
            raise ValueError(f"the batch has {rows} rows but seq_ids names {len(self.seq_ids)} sequences")
        if self.query_lens is not None and (rows != 1 or len(self.query_lens) != len(self.seq_ids)
                                            or sum(self.query_lens) != width or min(self.query_lens) < 1):
            raise ValueError(f"a ragged batch is one row of sum(query_lens) tokens, one length >= 1 per sequence: "
                             f"got {rows} rows of {width} for query_lens {self.query_lens} of {len(self.seq_ids)} sequences")
        tokens = (positions.flatten() >= 0).nonzero()[:, 0]
        if not len(tokens):
            raise ValueError("the batch has no tokens to run: every position is padding (-1)")
        if self.query_lens is None:
            return tokens, tokens // width
        counts = torch.tensor(self.query_lens, device=positions.device)
        return tokens, torch.repeat_interleave(torch.arange(len(counts), device=positions.device), counts)

    def _plan(self, positions: Tensor) -> _Batch:
        """Where this forward's tokens go, what each query sees, and where each sequence ends."""
        tokens, seq = self._sequence_of_tokens(positions)
        at = positions.flatten()[tokens]
        n = len(self.seq_ids)
        ends = torch.full((n,), -1, device=at.device).scatter_reduce(0, seq, at + 1, reduce="amax").tolist()
        firsts = torch.full((n,), 2 ** 62, device=at.device).scatter_reduce(0, seq, at, reduce="amin").tolist()
        counts = torch.bincount(seq, minlength=n).tolist()
        for seq_id, first, end in zip(self.seq_ids, firsts, ends):
            if end > self.allocator.length(seq_id):
                raise ValueError(f"position {end - 1} of sequence {seq_id!r} has no slot (it has "
                                 f"{self.allocator.length(seq_id)}): reserve it with add_sequence or append first")
            if first < self.allocator.computed[seq_id]:
                raise ValueError(f"position {first} of sequence {seq_id!r} is in the cache already (its first "
                                 f"{self.allocator.computed[seq_id]} tokens are): run only the tokens after them")
        tables = self.block_tables()
        slots = slot_mapping(tables[seq], at[:, None], self.allocator.block_size)[:, 0]
        chunks = [(tokens[seq == i], self._tables(tables, [i], ends[i]),
                   self._additive(causal_mask(at[seq == i][None], torch.arange(ends[i], device=at.device)[None])))
                  for i, count in enumerate(counts) if count > 1]
        return _Batch(tokens, slots, self._decode_groups(tokens, seq, tables, counts, ends), chunks, ends)

    def _decode_groups(self, tokens: Tensor, seq: Tensor, tables: Tensor, counts: list[int],
                       ends: list[int]) -> list[tuple[Tensor, Tensor, Tensor]]:
        """The sequences with one new token, in groups of similar length (``length_groups``): a
        group's keys and values are gathered and attended padded to its longest member. With a
        decode kernel, all in one group, which reads each sequence's own length."""
        decoding = [i for i, count in enumerate(counts) if count == 1]
        token_of = dict(zip(seq.tolist(), tokens.tolist()))  # a decoding sequence's only token
        device = tokens.device
        split = [list(range(len(decoding)))] if self.decode_kernel is not None and decoding else \
            length_groups([ends[i] for i in decoding], self.group_overhead)
        groups = []
        for group in split:
            members = [decoding[g] for g in group]
            longest = max(ends[i] for i in members)
            lengths = torch.tensor([ends[i] for i in members], device=device)
            mask = lengths if self.decode_kernel is not None else \
                self._additive((torch.arange(longest, device=device) < lengths[:, None])[:, None, None])
            groups.append((torch.tensor([token_of[i] for i in members], device=device),
                           self._tables(tables, members, longest), mask))
        return groups

    def _tables(self, tables: Tensor, rows: list[int], length: int) -> Tensor:
        """The block tables of ``rows``, cut to the blocks of their first ``length`` positions and
        laid out in one piece, once per forward pass instead of in every layer's gather."""
        return tables[rows, :blocks_for(length, self.allocator.block_size)].contiguous()

    def _additive(self, mask: Tensor) -> Tensor:
        """A boolean mask as SDPA's additive one (0 where allowed, -inf elsewhere), made once per
        forward pass instead of inside every layer's attention call."""
        return torch.zeros(mask.shape, dtype=self.k.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def generate_paged(model: Transformer, cache: PagedKVCache, prompts: Sequence[Sequence[int]],
                   new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Greedy generation of several prompts through the paged cache: each prompt's uncached
    tokens prefilled on its own (no padding), then one token per sequence per step, all in one
    batch. Returns the new tokens of each prompt and how many of its tokens the prefix cache
    already held. The sequences are freed at the end: their full blocks stay cached."""
    if new_tokens < 1 or len(prompts) == 0:
        raise ValueError(f"new_tokens={new_tokens} must be at least 1, and there must be a prompt "
                         f"(got {len(prompts)})")
    allocator, device = cache.allocator, cache.k.device
    prompts = [token_ids(p, model.config.vocab_size) for p in prompts]
    seq_ids = [("generate", i) for i in range(len(prompts))]
    added: list[Hashable] = []  # freed at the end, and only these: the caller's sequences stay
    out: list[list[int]] = []
    cached: list[int] = []
    try:
        with torch.inference_mode():
            for seq, prompt in zip(seq_ids, prompts):
                cached.append(allocator.add_sequence(seq, prompt))
                added.append(seq)
                cache.seq_ids = [seq]
                positions = torch.arange(cached[-1], len(prompt), device=device)[None]
                logits = model(torch.tensor([prompt[cached[-1]:]], device=device), positions, cache)
                out.append([int(logits[0, -1].argmax())])
            cache.seq_ids = seq_ids
            for step in range(1, new_tokens):
                for seq, new in zip(seq_ids, out):
                    cache.append(seq, new[-1:])
                tokens = torch.tensor([new[-1:] for new in out], device=device)
                positions = torch.tensor([[len(p) + step - 1] for p in prompts], device=device)
                for new, token in zip(out, model(tokens, positions, cache)[:, -1].argmax(-1).tolist()):
                    new.append(token)
        return out, cached
    finally:
        for seq in added:
            allocator.free(seq)
