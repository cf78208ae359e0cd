"""Notebook 03 (paged attention): slot mapping, a reference-counted pool, fork with copy on
write, attention through block tables."""
from __future__ import annotations

import random
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from labkit.exercises.spec import Case, Exercise, SaysWhatToDo, Scenario
from labkit.paged import BlockPool, OutOfBlocks, check_invariants


def _slots_by_hand(tables: list[list[int]], positions: list[list[int]], block_size: int) -> Tensor:
    """The slot of each position, one at a time: block table entry p // size, offset p % size."""
    return torch.tensor([[-1 if p < 0 else table[p // block_size] * block_size + p % block_size for p in row]
                         for table, row in zip(tables, positions)])


def _slot_cases() -> list[Case]:
    runs = [  # block tables (one row per sequence), positions, block size, what the case tests
        ("one sequence, blocks in order", [[0, 1, 2]], [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]], 4,
         "with the blocks in order 0, 1, 2 every slot equals its position: a failure here is in the formula "
         "itself, or in the result's shape ([batch, T], like positions) or dtype (integers)"),
        ("one sequence, blocks scattered over the pool", [[7, 2, 9]], [[0, 3, 4, 8, 11]], 4,
         "the block of position p is the table's entry number p // block_size, and the entries are not in order "
         "here: a slot that comes out as the position itself skipped the block table. The block size is 4 here: "
         "use the block_size given, never a fixed one"),
        ("a decode step: one position per sequence", [[3, 5], [1, 0]], [[17], [6]], 16,
         "two sequences, two tables: sequence b's position looks up row b of block_tables and no other row"),
        ("padding (-1) stays -1", [[4, 2, 6], [5, 1, 3]], [[8, 9, 10], [2, -1, -1]], 4,
         "a position of -1 is padding, not a token: its slot is -1, and -1 must not be used to index the table "
         "(-1 // block_size is -1, which a lookup refuses or reads as the last entry)"),
        ("block size 1: one token per block", [[9, 4, 7, 1]], [[3, 2, 1, 0]], 1,
         "with one token per block the offset is always 0 and the slot is the table's entry p itself: use the "
         "block_size given, never a fixed one"),
    ]
    return [Case(label, (torch.tensor(tables), torch.tensor(positions), size),
                 _slots_by_hand(tables, positions, size), hint=hint, unchanged=True)
            for label, tables, positions, size, hint in runs]


_PARTS = ("the free blocks", "the reference counts", "the tables")


def _state(pool: Any) -> tuple:
    """What a refused call must leave as it was (the free blocks in any order: which is taken next does not matter)."""
    return sorted(pool.free_blocks), list(pool.ref_count), {s: list(t) for s, t in pool.tables.items()}


def _compare(pool: Any, reference: BlockPool, what: str) -> None:
    """The pool has as long tables as the reference, its invariants hold, and it has as many free blocks."""
    lengths = {s: len(t) for s, t in pool.tables.items()}
    expected = {s: len(t) for s, t in reference.tables.items()}
    if lengths != expected:
        raise AssertionError(f"after {what}: tables have {lengths} blocks, expected {expected}")
    try:
        check_invariants(pool.free_blocks, pool.ref_count, pool.tables)
    except AssertionError as error:
        raise AssertionError(f"after {what}: {error}") from None
    if len(pool.free_blocks) != reference.num_free:
        raise AssertionError(f"after {what}: {len(pool.free_blocks)} free blocks, expected {reference.num_free}")


def _refused(what: str, pool: Any, reference_call: Callable[[], Any], pool_call: Callable[[], Any],
             why: str) -> bool:
    """Run the reference; where it raises OutOfBlocks, the student's pool must raise it too and be
    left exactly as it was. True when both refused."""
    before = _state(pool)
    try:
        reference_call()
    except OutOfBlocks:
        try:
            pool_call()
        except OutOfBlocks:
            changed = [part for part, was, now in zip(_PARTS, before, _state(pool)) if was != now]
            if changed:
                raise AssertionError(f"{what} raised OutOfBlocks but changed {' and '.join(changed)} first") from None
            return True
        raise AssertionError(f"{what} should raise OutOfBlocks: {why}") from None
    return False


def _allocate(pool: Any, reference: BlockPool, seq: str, n: int) -> None:
    what = f"allocate({seq!r}, {n})"
    free_before = set(pool.free_blocks)
    if _refused(what, pool, lambda: reference.allocate(seq, n), lambda: pool.allocate(seq, n),
                f"only {len(free_before)} blocks are free"):
        return
    try:
        got = pool.allocate(seq, n)
    except OutOfBlocks:
        raise AssertionError(f"{what} raised OutOfBlocks, but {len(free_before)} blocks were free") from None
    if not isinstance(got, list) or len(got) != n or not set(got) <= free_before or len(set(got)) != n:
        raise AssertionError(f"{what} returned {got!r}: expected a list of {n} different blocks that were free")
    if pool.tables[seq][len(pool.tables[seq]) - n:] != got:
        raise AssertionError(f"{what}: the new blocks {got} must go at the end of the table, got {pool.tables[seq]}")
    _compare(pool, reference, what)


def _free(pool: Any, reference: BlockPool, seq: str) -> None:
    pool.free(seq)
    reference.free(seq)
    _compare(pool, reference, f"free({seq!r})")


def _free_all(pool: Any, reference: BlockPool) -> None:
    """Free every sequence left: afterwards nothing may be held (the invariants catch a leak)."""
    for seq in list(reference.tables):
        _free(pool, reference, seq)


def _play_allocate_free(seed: int, num_blocks: int, steps: int) -> Callable[[Any], None]:
    """Random allocations (some too large) and frees, checked after every one."""
    def play(pool_class: Any) -> None:
        rng = random.Random(seed)
        pool, reference = pool_class(num_blocks), BlockPool(num_blocks)
        for step in range(steps):
            live = list(reference.tables)
            if live and rng.random() < 0.35:
                _free(pool, reference, rng.choice(live))
            else:
                seq = rng.choice(live) if live and rng.random() < 0.4 else f"s{step}"
                _allocate(pool, reference, seq, rng.randint(1, max(1, num_blocks // 3)))
        _free_all(pool, reference)
    return play


def _free_a_shared_block(pool_class: Any) -> None:
    """Two tables hold the same blocks, as a fork leaves them (set by hand: SimplePool has no fork):
    freeing one drops a count, and the blocks stay held by the other."""
    pool, reference = pool_class(6), BlockPool(6)
    _allocate(pool, reference, "a", 2)
    for p in (pool, reference):
        p.tables["b"] = list(p.tables["a"])
        for block in p.tables["b"]:
            p.ref_count[block] += 1
    _free(pool, reference, "a")
    _allocate(pool, reference, "c", 4)
    _free_all(pool, reference)


_RANDOM_POOL = ("random operations, each checked as it happens; the message names the first one that went "
                "wrong and what it left: replay the operations before it on a small pool by hand, and compare "
                "free_blocks, ref_count and tables with what they should be")


def _allocate_free_cases() -> list[Scenario]:
    return [Scenario("allocate, then free everything", _play_fixed([("a", 3), ("b", 2), ("a", 1)], 8),
                     hint="the basic bookkeeping: a new sequence gets a table, a second allocate for 'a' adds to "
                          "its table, and once every sequence is freed every block is free again with count 0"),
            Scenario("asking for exactly the blocks that are free: all of them", _play_fixed([("a", 2), ("b", 2)], 4),
                     hint="a pool with n free blocks can hand out all n: refuse only a request for more than are "
                          "free (n > free, not n >= free)"),
            Scenario("allocate 0 blocks: nothing taken", _play_fixed([("a", 2), ("a", 0), ("b", 2)], 4),
                     hint="asking for 0 blocks takes none and returns an empty list; watch for expressions that "
                          "mean something else at n = 0 (a slice [-n:] with n = 0 is the whole list)"),
            Scenario("a block two tables hold stays held when one is freed", _free_a_shared_block,
                     hint="a block that two tables hold has count 2: freeing one of them drops the count to 1, "
                          "and the block is free again only when its last holder lets go"),
            Scenario("asking for more than is free: OutOfBlocks, nothing changed", _play_fixed([("a", 5), ("b", 4)], 8),
                     hint="an allocation the pool cannot satisfy raises OutOfBlocks without touching anything: "
                          "no block taken, no count set, no table created or grown"),
            *(Scenario(f"{steps} random operations on {blocks} blocks (seed {seed})",
                       _play_allocate_free(seed, blocks, steps), hint=f"allocations (some too large) and frees: "
                                                                      f"{_RANDOM_POOL}")
              for seed, blocks, steps in [(0, 8, 40), (1, 16, 80), (2, 5, 60)])]


def _play_fixed(allocations: list[tuple[str, int]], num_blocks: int) -> Callable[[Any], None]:
    def play(pool_class: Any) -> None:
        pool, reference = pool_class(num_blocks), BlockPool(num_blocks)
        for seq, n in allocations:
            _allocate(pool, reference, seq, n)
        _free_all(pool, reference)
    return play


def _fork(pool: Any, reference: BlockPool, parent: str, child: str) -> None:
    what = f"fork({parent!r}, {child!r})"
    parent_blocks = list(pool.tables[parent])
    counts_before = [pool.ref_count[block] for block in parent_blocks]
    pool.fork(parent, child)
    reference.fork(parent, child)
    if pool.tables[child] is pool.tables[parent]:
        raise SaysWhatToDo(f"after {what}: the child's table is the parent's list object itself; give the child "
                             f"a copy (list(...)), or a write to one would change both tables")
    if pool.tables[child] != pool.tables[parent]:
        raise AssertionError(f"after {what}: the child's table {pool.tables[child]} must be the parent's "
                             f"{pool.tables[parent]} (shared blocks, nothing copied)")
    for block, before in zip(parent_blocks, counts_before):
        if pool.ref_count[block] != before + 1:
            raise SaysWhatToDo(
                f"after {what}: block {block} {'still ' * (pool.ref_count[block] == before)}has ref_count "
                f"{pool.ref_count[block]}, expected {before + 1}: a fork gives each of the parent's blocks one more "
                f"owner, the child, so fork must raise each one's ref_count by one")
    _compare(pool, reference, what)


def _copy_on_write(pool: Any, reference: BlockPool, seq: str, index: int) -> None:
    what = f"copy_on_write({seq!r}, {index})"
    free_before = set(pool.free_blocks)
    old, shared = pool.tables[seq][index], reference.ref_count[reference.tables[seq][index]] > 1
    if _refused(what, pool, lambda: reference.copy_on_write(seq, index), lambda: pool.copy_on_write(seq, index),
                f"block {old} is shared and no block is free"):
        return
    try:
        got = pool.copy_on_write(seq, index)
    except OutOfBlocks:
        needed = "a free block was available" if shared else f"block {old} is not shared, so no block is needed"
        raise AssertionError(f"{what} raised OutOfBlocks, but {needed}") from None
    if not shared:
        if got is not None or pool.tables[seq][index] != old:
            raise AssertionError(f"{what}: block {old} is not shared, so nothing to copy: expected None and "
                                 f"the table unchanged, got {got!r}")
    elif isinstance(got, (tuple, list)) and list(got) == [pool.tables[seq][index], old] != [old, old]:
        raise SaysWhatToDo(f"{what}: returned {got!r}, the new block first; return (old, new), the old block first")
    elif (not isinstance(got, (tuple, list)) or tuple(got) != (old, pool.tables[seq][index])
          or got[1] not in free_before):
        raise AssertionError(f"{what}: block {old} is shared, so expected ({old}, a block that was free) with "
                             f"the table pointing at the new block, got {got!r} and table {pool.tables[seq]}")
    _compare(pool, reference, what)


def _play_fork(seed: int, num_blocks: int, steps: int) -> Callable[[Any], None]:
    """Random allocations, forks, copies on write and frees, checked after every one."""
    def play(pool_class: Any) -> None:
        rng = random.Random(seed)
        pool, reference = pool_class(num_blocks), BlockPool(num_blocks)
        for step in range(steps):
            live = [s for s, t in reference.tables.items() if t]
            roll = rng.random()
            if not live or roll < 0.25:
                _allocate(pool, reference, f"s{step}", rng.randint(1, 3))
            elif roll < 0.5:
                _fork(pool, reference, rng.choice(live), f"s{step}")
            elif roll < 0.8:
                seq = rng.choice(live)
                _copy_on_write(pool, reference, seq, rng.randrange(len(reference.tables[seq])))
            else:
                _free(pool, reference, rng.choice(live))
        _free_all(pool, reference)
    return play


def _fork_cases() -> list[Scenario]:
    def share_then_write(pool_class: Any) -> None:
        pool, reference = pool_class(6), BlockPool(6)
        _allocate(pool, reference, "parent", 2)
        _fork(pool, reference, "parent", "child")
        _copy_on_write(pool, reference, "child", 1)
        _copy_on_write(pool, reference, "child", 1)  # now its own: no second copy
        _copy_on_write(pool, reference, "parent", 1)  # the parent's block is its own again too
        _free_all(pool, reference)
    return [Scenario("fork, then both write the last block", share_then_write,
                     hint="after a fork both tables name the same blocks, each held twice; the child's first write "
                          "copies the shared block, its second finds the block its own (None), and then the "
                          "parent is the last holder of the old block, so its write copies nothing either"),
            *(Scenario(f"{steps} random operations on {blocks} blocks (seed {seed})", _play_fork(seed, blocks, steps),
                       hint="forks of forks, writes and frees, some with no block free (a write into a shared "
                            f"block must then raise OutOfBlocks and change nothing): {_RANDOM_POOL}")
              for seed, blocks, steps in [(3, 10, 60), (4, 6, 80), (5, 24, 120)])]


def _contiguous_attention(q: Tensor, keys: list[Tensor], values: list[Tensor]) -> Tensor:
    """Each sequence on its own, its keys and values side by side: no pool, no block table."""
    return torch.stack([F.scaled_dot_product_attention(q[b, :, None], k, v, enable_gqa=q.shape[1] != k.shape[0])[:, 0]
                        for b, (k, v) in enumerate(zip(keys, values))])


def _scatter_into_pool(keys: list[Tensor], block_size: int, num_blocks: int,
                       generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """Pools filled with noise, block tables of noise blocks, and a random order in which to hand
    out the blocks that the sequences' keys and values go into."""
    kv_heads, _, dim = keys[0].shape
    k_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator) * 100
    v_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator) * 100
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(-(-k.shape[1] // block_size) for k in keys)
    tables = torch.randint(num_blocks, (len(keys), width), generator=generator)
    return k_pool, v_pool, tables, order


def _attention_cases() -> list[Case]:
    shapes = [  # query heads, KV heads, head_dim, block size, sequence lengths, what the case tests
        ("MHA, one sequence filling 3 blocks exactly", 4, 4, 16, 4, [12],
         "the plainest layout (one sequence, a KV head per query head, no partly filled block): a failure here is "
         "in reading keys and values through the table (the pools are [num_blocks, block_size, n_kv_heads, "
         "head_dim]) or in the attention itself (the scale is 1/sqrt(head_dim), the softmax runs over positions)"),
        ("MHA, lengths not multiples of the block", 4, 4, 16, 4, [5, 13, 1],
         "the first case with several sequences: sequence b reads its blocks through row b of block_tables, no "
         "other row. And a sequence's last block is only partly its own: what lies past lengths[b] is noise, and "
         "must get no attention weight (mask positions >= lengths[b], not > )"),
        ("GQA (8 query heads, 2 KV heads), full blocks", 8, 2, 32, 4, [8, 12],
         "query heads come in groups that share a KV head: heads 0-3 read KV head 0 here, not heads 0, 2, 4, 6 "
         "(repeat_interleave, not repeat)"),
        ("MQA, block size 1", 6, 1, 8, 1, [7, 3],
         "one KV head serves every query head, and every token is a block of its own: nothing may assume a "
         "block size or a number of KV heads"),
        ("block size 16, a long and a short sequence", 4, 2, 16, 16, [40, 2],
         "the short sequence has 2 tokens in a batch padded to 40 positions: every position at or past "
         "lengths[b] must get no attention weight at all"),
    ]
    generator = torch.Generator().manual_seed(3)
    cases = []
    for label, heads, kv_heads, dim, size, lengths, hint in shapes:
        keys = [torch.randn(kv_heads, n, dim, generator=generator) for n in lengths]
        values = [torch.randn(kv_heads, n, dim, generator=generator) for n in lengths]
        q = torch.randn(len(lengths), heads, dim, generator=generator)
        num_blocks = sum(-(-n // size) for n in lengths) + 3
        k_pool, v_pool, tables, order = _scatter_into_pool(keys, size, num_blocks, generator)
        for b, (k, v) in enumerate(zip(keys, values)):
            for j in range(-(-k.shape[1] // size)):
                block = tables[b, j] = order.pop()
                chunk = slice(j * size, (j + 1) * size)
                filled = k[:, chunk].shape[1]
                k_pool[block, :filled], v_pool[block, :filled] = k[:, chunk].transpose(0, 1), v[:, chunk].transpose(0, 1)
        args = (q, k_pool, v_pool, tables, torch.tensor(lengths))
        cases.append(Case(label, args, _contiguous_attention(q, keys, values), rtol=1e-4, atol=1e-5, hint=hint))
    return cases


EXERCISES = [
    Exercise(
        id="ex03.1", title="Slot mapping", points=1, function="slot_mapping",
        cases=_slot_cases,
        recipe="Position p of a sequence is in block table[p // block_size], at offset p % block_size; its slot "
             "is block * block_size + offset. torch.gather along dim 1 looks up each row's own table. gather "
             "refuses the index -1, so look up with the padding clamped to 0 (positions.clamp(min=0)), then put "
             "-1 back wherever the position is -1 (torch.where).",
    ),
    Exercise(
        id="ex03.2", title="Allocate and free with reference counts", points=2, function="SimplePool",
        cases=_allocate_free_cases, methods=("allocate", "free"),
        recipe="allocate: when fewer than n_blocks are free, raise OutOfBlocks before taking any, so that a failed "
             "call changes nothing. Otherwise pop n_blocks blocks off free_blocks, set each one's count to 1, "
             "append them to the sequence's table (a new list for a new sequence, its existing table otherwise) "
             "and return them. free: take the sequence's table out of tables (pop), drop the count of each of its "
             "blocks by one, and put a block back on free_blocks only when its count reaches 0 (no table holds "
             "it any more).",
    ),
    Exercise(
        id="ex03.3", title="Fork with copy on write", points=2, function="ForkingPool",
        cases=_fork_cases, methods=("fork", "copy_on_write"),
        recipe="fork shares, it copies no data: the child gets a table of its own (a new list, "
             "list(self.tables[parent])) naming the parent's blocks, and each of them gains an owner (its count "
             "goes up by one). copy_on_write(seq_id, index): old = self.tables[seq_id][index]; a block with one "
             "owner is the sequence's own: return None. Otherwise take the fresh block first (new, = "
             "self.take(1), so that OutOfBlocks leaves everything as it was); it has one owner, old loses one, "
             "the table points at new, and (old, new) tells the cache what to copy.",
    ),
    Exercise(
        id="ex03.4", title="Paged attention through the block table", points=2, function="paged_attention",
        cases=_attention_cases,
        recipe="Build the slots of positions 0..longest-1 (longest = lengths.max()) for every sequence, as in "
             "ex03.1, and index the pools flattened to [num_blocks * block_size, n_kv_heads, head_dim] with them. "
             "Query head h reads KV head h // g, g = n_heads // n_kv_heads: repeat each KV head g times in a row "
             "(repeat_interleave on the head dim). Score q against the keys, scaled by 1/sqrt(head_dim); set "
             "position j of sequence b to -inf unless j < lengths[b]; softmax over the positions, and weight the "
             "values with it.",
    ),
]
