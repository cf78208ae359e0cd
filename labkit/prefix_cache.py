"""Prefix caching: full blocks of keys and values named by the text they hold, so that a new prompt
that starts with the same text reuses them instead of computing them again.

A full block's name chains its parent's, h_i = hash(h_(i-1), tokens of block i), so equal names
mean equal text from the start of the sequence. A hash can collide, so a hit must match the
whole ``BlockKey``: the tokens, and the block that holds the text before them.

The cache is one more owner of each block it caches: it holds a reference in the block pool's
counts, beside the sequences' tables. So a cached block outlives the sequences that computed it;
one the cache alone holds is idle, kept until a prompt revives it or the pool needs the block,
least recently used first. The contract:

- ``match(tokens)``: the cached blocks that continue ``tokens`` from its start, whole blocks only;
- ``insert(parent, tokens, block)``: name a full block whose keys and values are computed, and
  offer it to later prompts unless the same text is cached already;
- ``release(block)``: an owner let go of the block; if the cache alone holds it now, it is idle;
- ``revive(block)``: a prompt takes a cached block: it is not idle any more;
- ``evict()``: forget the least recently used idle block and give it back to the pool;
- ``before_rewrite(block)``, ``forget(block)``: forget a block whose text is about to change.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Protocol, Sequence

Name = tuple[int, int]  # a named block: (chained hash, the block that holds that text)


class Owners(Protocol):
    """What the prefix cache needs of a block pool (``labkit.paged.BlockPool``): each block's count
    of owners, and taking or dropping one."""

    ref_count: list[int]

    def hold(self, block: int) -> None: ...

    def release(self, block: int) -> None: ...


class BlockKey(NamedTuple):
    """What a full block holds: its chained ``hash``, the ``parent`` block holding the text before
    it (None for a sequence's first block), and its ``tokens``."""

    hash: int
    parent: int | None
    tokens: tuple[int, ...]


def block_key(parent: Name | None, tokens: Sequence[int]) -> BlockKey:
    """The key of a full block of ``tokens`` after the block named ``parent``."""
    tokens = tuple(tokens)
    return BlockKey(hash((parent[0] if parent else None, tokens)), parent[1] if parent else None, tokens)


class PrefixCache:
    """Named full blocks of a block pool that later prompts may reuse; see the module docstring."""

    def __init__(self, pool: Owners, block_size: int) -> None:
        self.pool, self.block_size = pool, block_size
        self.blocks: dict[int, int] = {}  # chained hash -> the block caching that text
        self.keys: dict[int, BlockKey] = {}  # cached block -> its key
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks the cache alone holds, least recent first

    def __contains__(self, block: int) -> bool:
        return block in self.keys

    @property
    def num_idle(self) -> int:
        """Cached blocks the cache alone holds: free to evict."""
        return len(self.idle)

    def is_idle(self, block: int) -> bool:
        return block in self.idle

    def match(self, tokens: Sequence[int]) -> list[Name]:
        """The name of each cached block that continues ``tokens`` from its start."""
        hits: list[Name] = []
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            key = block_key(hits[-1] if hits else None, tokens[start:start + size])
            block = self.blocks.get(key.hash)
            if block is None or self.keys[block] != key:  # a miss, or a hash collision
                break
            hits.append((key.hash, block))
        return hits

    def insert(self, parent: Name | None, tokens: Sequence[int], block: int) -> Name:
        """Name ``block``, a computed full block of ``tokens`` after ``parent``. If the same text is
        cached, that block's name, for later blocks to chain on (this one is not offered); else
        the cache holds ``block`` from now on, unless its hash is taken or it is cached already."""
        key = block_key(parent, tokens)
        holder = self.blocks.get(key.hash)
        if holder is not None and self.keys[holder] == key:
            return key.hash, holder
        if holder is None and block not in self.keys:
            self.blocks[key.hash], self.keys[block] = block, key
            self.pool.hold(block)
        return key.hash, block

    def release(self, block: int) -> None:
        """After an owner let go of ``block``: if the cache alone holds it now, it is idle, the most
        recently used."""
        if block in self.keys and self.pool.ref_count[block] == 1:
            self.idle[block] = None

    def revive(self, block: int) -> None:
        """A prompt takes ``block`` again (call it before the prompt holds it)."""
        self.idle.pop(block, None)

    def before_rewrite(self, block: int) -> None:
        """One sequence is about to write into ``block`` again (after a rollback): if the block is
        cached and that sequence is its only other owner, forget it, as its text will change. A
        block others hold too stays cached: the writer gets a copy of its own first."""
        if block in self.keys and self.pool.ref_count[block] == 2:
            self.forget(block)

    def evict(self) -> None:
        """Forget the least recently used idle block; the pool gets it back, free."""
        block, _ = self.idle.popitem(last=False)
        self.forget(block)

    def clear(self) -> int:
        """Forget every cached block, when the cache alone holds each (no sequence uses one); returns how many it
        forgot. A benchmark's cold start, or weights that changed: no later prompt finds an earlier one's blocks."""
        if busy := [block for block in self.keys if block not in self.idle]:
            raise ValueError(f"{len(busy)} cached blocks are in use by sequences: clear the cache once they end")
        forgotten = len(self.keys)
        for block in list(self.keys):
            self.forget(block)
        return forgotten

    def forget(self, block: int) -> None:
        """Stop offering ``block`` (its keys and values are about to change) and let go of it."""
        del self.blocks[self.keys.pop(block).hash]
        self.idle.pop(block, None)
        self.pool.release(block)

    def check(self) -> None:
        """Assert the cache's own invariants: each cached block under its key's hash, and the idle
        ones held by the cache alone."""
        if len(self.blocks) != len(self.keys):
            raise AssertionError(f"{len(self.blocks)} hashes name {len(self.keys)} cached blocks")
        for h, block in self.blocks.items():
            if self.keys[block].hash != h:
                raise AssertionError(f"block {block} is cached under a hash it does not carry")
        for block in self.keys:
            if (block in self.idle) != (self.pool.ref_count[block] == 1):
                raise AssertionError(f"cached block {block} has {self.pool.ref_count[block]} owners, and is "
                                     f"{'' if block in self.idle else 'not '}idle")
        if unknown := set(self.idle) - set(self.keys):
            raise AssertionError(f"idle blocks {sorted(unknown)} are not cached")
