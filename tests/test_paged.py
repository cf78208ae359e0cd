"""The paged KV cache: the allocator's invariants under random operations (hypothesis), prefix
sharing and copy on write, attention through block tables, and generation identical to the
contiguous cache."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from labkit.exercises.lab01 import random_model
from labkit.generate import SamplingParams, stream
from labkit.memory import blocks_for, fragmentation, kv_cache_bytes, num_blocks_for_memory, shape_of
from labkit.model import ContiguousKVCache
from labkit.paged import (BlockAllocator, BlockPool, OutOfBlocks, PagedKVCache, check_invariants, generate_paged,
                          sequences_that_fit, step_logits)
from labkit.paged_attention import gather_kv, length_groups, paged_attention, slot_mapping
from labkit.workload import lognormal_lengths


def _state(allocator: BlockAllocator) -> tuple:
    """Everything the allocator, its pool and its prefix cache hold."""
    pool, prefix = allocator.pool, allocator.prefix
    return copy.deepcopy((vars(pool), allocator.lengths, allocator.names,
                          (prefix.blocks, prefix.keys, list(prefix.idle)) if prefix else None))


class AllocatorMachine(RuleBasedStateMachine):
    """Random add / append / fork / free on a small pool. Besides the bookkeeping, a shadow pool
    of slots holds the token each slot would hold keys and values for, written as a cache would
    (copies on write first): reading a sequence through its table must give back its tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator = BlockAllocator(num_blocks=12, block_size=3)
        self.slots: list[int | None] = [None] * 36
        self.expected: dict[int, list[int]] = {}
        self.next_id = 0

    def _write(self, seq: int, start: int) -> None:
        """What a step does: the forward pass writes the new tokens' slots; then they are marked computed."""
        tokens = self.expected[seq]
        for position, slot in enumerate(self.allocator.slot_mapping(seq, range(start, len(tokens))), start):
            self.slots[slot] = tokens[position]
        self.allocator.mark_computed(seq, tokens)

    def _atomic(self, operation) -> bool:
        before = _state(self.allocator)
        try:
            operation()
        except OutOfBlocks:
            assert _state(self.allocator) == before, "OutOfBlocks changed the allocator"
            return False
        return True

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def add(self, prompt):  # a 3-letter alphabet, so prompts often share prefixes
        seq, cached = self.next_id, []
        if self._atomic(lambda: cached.append(self.allocator.add_sequence(seq, prompt))):
            self.next_id += 1
            self.expected[seq] = list(prompt)
            self._write(seq, cached[0])  # the reused slots must already hold the prompt's start

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def abandon(self, prompt):  # reserved, never written (the forward failed), then freed
        if self._atomic(lambda: self.allocator.add_sequence("abandoned", prompt)):
            self.allocator.free("abandoned")

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=0, max_size=5))
    def append(self, data, tokens):
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        start = len(self.expected[seq])
        copies: list = []
        if self._atomic(lambda: copies.extend(self.allocator.append(seq, len(tokens)))):
            for old, new in copies:
                size = self.allocator.block_size
                self.slots[new * size:(new + 1) * size] = self.slots[old * size:(old + 1) * size]
            self.expected[seq] += tokens
            self._write(seq, start)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def truncate(self, data):  # roll back to a shorter prefix, then the sequence grows again
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        keep = data.draw(st.integers(1, len(self.expected[seq])))
        self.allocator.truncate(seq, keep)
        del self.expected[seq][keep:]

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.expected)))
        self.allocator.fork(parent, self.next_id)
        self.expected[self.next_id] = list(self.expected[parent])
        self.next_id += 1

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        self.allocator.free(seq)
        del self.expected[seq]

    @rule()
    def clear_prefix_cache(self):  # refused, and nothing changed, while a sequence holds a cached block
        before, free = _state(self.allocator), self.allocator.num_free
        held = any(block in self.allocator.prefix for seq in self.expected for block in self.allocator.table(seq))
        try:
            self.allocator.prefix.clear()
        except ValueError:
            assert held and _state(self.allocator) == before, "a refused clear was not due, or changed the allocator"
            return
        assert not held and "cached" not in self.allocator.block_states() and self.allocator.num_free == free

    @invariant()
    def bookkeeping_holds(self):
        self.allocator.check()
        assert self.allocator.lengths == {s: len(tokens) for s, tokens in self.expected.items()}

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        for seq, tokens in self.expected.items():
            assert [self.slots[s] for s in self.allocator.slot_mapping(seq, range(len(tokens)))] == tokens

    def teardown(self):
        for seq in list(self.expected):
            self.allocator.free(seq)
        self.allocator.check()
        assert self.allocator.num_free == self.allocator.num_blocks
        assert set(self.allocator.block_states()) <= {"free", "cached"}


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_out_of_blocks_leaves_the_pool_as_it_was():
    pool = BlockPool(4)
    pool.allocate("a", 3)
    before = copy.deepcopy(vars(pool))
    with pytest.raises(OutOfBlocks, match="need 2 free blocks but only 1 of 4"):
        pool.allocate("b", 2)
    assert vars(pool) == before


def test_fork_shares_and_copy_on_write_splits():
    pool = BlockPool(5)
    pool.allocate("parent", 2)
    pool.fork("parent", "child")
    assert pool.tables["child"] == pool.tables["parent"] and pool.ref_count[:2] == [2, 2]
    old, new = pool.copy_on_write("child", 1)
    assert (old, pool.tables["child"][1], pool.ref_count[old], pool.ref_count[new]) == (1, new, 1, 1)
    assert pool.copy_on_write("parent", 1) is None
    pool.check()


def test_check_invariants_names_what_is_wrong():
    with pytest.raises(AssertionError, match="block 1 leaked"):
        check_invariants([0], [0, 0], {})
    with pytest.raises(AssertionError, match="block 0 is free but sequences hold it"):
        check_invariants([0, 1], [1, 0], {"a": [0]})
    with pytest.raises(AssertionError, match="ref_count 2 but 1 owners"):
        check_invariants([1], [2, 0], {"a": [0]})


def _add(allocator: BlockAllocator, seq, prompt) -> int:
    """Start a sequence and mark its prompt computed, as a forward pass through the cache would."""
    cached = allocator.add_sequence(seq, prompt)
    allocator.mark_computed(seq, prompt)
    return cached


def test_a_prompt_reuses_the_cached_blocks_of_a_shared_prefix():
    allocator = BlockAllocator(num_blocks=10, block_size=4)
    system = list(range(100, 108))  # two full blocks
    assert _add(allocator, "a", system + [1, 2]) == 0
    assert _add(allocator, "b", system + [3]) == 8
    assert allocator.tables["b"][:2] == allocator.tables["a"][:2]
    assert _add(allocator, "c", system) == 4  # the block of the last token is computed again
    allocator.check()


def test_clearing_the_prefix_cache_forgets_idle_blocks_and_refuses_while_a_sequence_holds_one():
    allocator = BlockAllocator(num_blocks=10, block_size=4)
    system = list(range(100, 108))  # two full blocks
    _add(allocator, "a", system + [1])
    with pytest.raises(ValueError, match="2 cached blocks are in use by sequences"):
        allocator.prefix.clear()
    assert _add(allocator, "b", system + [2]) == 8  # refused, and nothing changed
    allocator.free("a")
    allocator.free("b")
    assert allocator.prefix.clear() == 2 and allocator.num_free == 10 == allocator.pool.num_free
    assert _add(allocator, "c", system + [3]) == 0  # cold
    allocator.check()


def test_blocks_needed_counts_what_add_sequence_takes_from_the_free_blocks():
    allocator = BlockAllocator(num_blocks=10, block_size=4)
    system = list(range(100, 108))  # two full blocks
    _add(allocator, "a", system + [1])
    assert allocator.blocks_needed(system + [2, 3]) == 1  # a holds the two shared blocks: only the third
    assert allocator.blocks_needed(system) == 1  # the last token's block is never reused: computed again
    allocator.free("a")  # now they are cached but free: reviving them takes them from the free blocks
    for prompt, needed in ((system + [2, 3], 3), (list(range(9)), 3), ([5], 1)):
        before = allocator.num_free
        assert allocator.blocks_needed(prompt) == needed
        allocator.add_sequence(prompt[0], prompt)
        assert before - allocator.num_free == needed
    allocator.check()


def test_blocks_are_offered_only_once_computed():
    allocator = BlockAllocator(num_blocks=8, block_size=2)
    allocator.add_sequence("failed", [1, 2, 3, 4, 5])  # reserved, but its forward never ran
    allocator.free("failed")
    assert _add(allocator, "next", [1, 2, 3, 4, 9]) == 0
    allocator.check()


def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    _add(allocator, "old", [1, 2, 3, 4, 5])  # [1 2] [3 4] named, [5] partial
    allocator.free("old")  # the tail first: [3 4] is less recently used than [1 2]
    _add(allocator, "new", [7, 8, 9, 10, 11])  # two uncached blocks, then evicts [3 4]
    allocator.free("new")
    assert allocator.block_states().count("cached") == 3
    assert _add(allocator, "first", [1, 2, 3, 4, 5]) == 2  # [1 2] revived, [3 4] recomputed
    allocator.free("first")  # taking a block again evicted [9 10], the least recent of new's
    assert _add(allocator, "again", [7, 8, 9, 10, 0]) == 2
    allocator.check()


def test_a_rolled_back_block_is_no_longer_offered():
    allocator = BlockAllocator(num_blocks=8, block_size=2)
    _add(allocator, "a", [1, 2, 3, 4, 5])
    allocator.truncate("a", 3)  # [3 4] becomes [3 .], to be overwritten
    allocator.append("a", 1)
    allocator.mark_computed("a", [1, 2, 3, 9])
    assert _add(allocator, "b", [1, 2, 3, 4, 0]) == 2
    assert _add(allocator, "c", [1, 2, 3, 9, 0]) == 4
    allocator.check()


def test_a_hash_collision_is_caught_by_the_tokens_and_the_parent_block(monkeypatch):
    import labkit.prefix_cache
    allocator = BlockAllocator(num_blocks=8, block_size=2)
    real = labkit.prefix_cache.block_key

    def colliding(parent, tokens):  # every first block hashes alike
        key = real(parent, tokens)
        return key._replace(hash=7) if parent is None else key
    monkeypatch.setattr(labkit.prefix_cache, "block_key", colliding)
    assert _add(allocator, "x", [1, 2, 0]) == 0
    assert _add(allocator, "y", [3, 4, 5, 6, 0]) == 0  # same first hash, other tokens: not reused
    assert _add(allocator, "z", [1, 2, 5, 6, 0]) == 2  # x's [1 2], but not y's [5 6]: it followed [3 4]
    allocator.check()


def test_bad_requests_are_refused_by_name():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    allocator.add_sequence("a", [1])
    with pytest.raises(ValueError, match="already exists"):
        allocator.add_sequence("a", [1])
    with pytest.raises(ValueError, match="prompt is empty"):
        allocator.add_sequence("b", [])
    with pytest.raises(KeyError, match="no sequence 'zz'"):
        allocator.append("zz", 1)
    with pytest.raises(IndexError, match="position 1 of sequence 'a' has no slot"):
        allocator.slot_mapping("a", [1])
    with pytest.raises(ValueError, match="block_size=0"):
        BlockAllocator(4, 0)
    with pytest.raises(ValueError, match="2 tokens computed for sequence 'a', which has slots for 1"):
        allocator.mark_computed("a", [1, 2])
    before = allocator.block_states()
    with pytest.raises(ValueError, match="n_tokens=1.5"):
        allocator.append("a", 1.5)
    with pytest.raises(ValueError, match="n_tokens=-1 must be 0 or more"):  # it would shrink the sequence
        allocator.append("a", -1)
    for caching in (True, False):
        wide = BlockAllocator(num_blocks=4, block_size=1, prefix_caching=caching)
        wide.add_sequence("w", [1, 2])
        with pytest.raises(ValueError, match="not a tensor"):  # its names would never match a prompt's
            wide.mark_computed("w", torch.tensor([1, 2]))
    for tokens in (torch.tensor([2, 3]), [2, 1.5]):  # a tensor's tokens would never match a cached prefix
        with pytest.raises(ValueError, match="token ids must be"):
            allocator.add_sequence("c", tokens)
    assert allocator.block_states() == before and allocator.length("a") == 1 and "c" not in allocator.tables


def test_what_fits_refuses_sizes_that_could_not_be():
    with pytest.raises(ValueError, match="a sequence of -5 tokens: every length must be at least 1"):
        sequences_that_fit([-5, 5], 16, 4)
    with pytest.raises(ValueError, match="block_size=0 must be at least 1"):
        sequences_that_fit([5], 16, 0)


def test_sizes_that_are_not_ints_are_refused_by_name():
    with pytest.raises(ValueError, match="num_blocks=2.5 must be an int"):
        BlockPool(2.5)
    with pytest.raises(ValueError, match="block_size=16.0 must be an int"):
        BlockAllocator(4, 16.0)


def test_the_pool_refuses_to_give_or_take_an_owner_of_a_free_block_and_shares_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate("a", 2)  # blocks 0 and 1; 2 and 3 free
    pool.truncate("a", 1)  # block 1 released: free again
    before = (list(pool.ref_count), list(pool.free_blocks), {k: list(v) for k, v in pool.tables.items()})
    with pytest.raises(ValueError, match="block 1 is free: it has no owner to release"):
        pool.release(1)  # a second release would send its count below 0
    with pytest.raises(ValueError, match="block 3 is free: only a block that someone holds"):
        pool.hold(3)  # it would be handed out again while in use
    with pytest.raises(ValueError, match="block 2 is free: share only blocks that others hold"):
        pool.share("b", [0, 2])
    with pytest.raises(ValueError, match=r"block 7 is not a block of the pool \(0..3\)"):
        pool.share("b", [0, 7])
    assert (pool.ref_count, pool.free_blocks, pool.tables) == before  # block 0 did not gain an owner
    pool.check()


def test_generate_paged_leaves_the_callers_sequences_alone():
    model = random_model(4, 2, seed=8)
    cache = PagedKVCache(model.config, BlockAllocator(8, 4))
    cache.allocator.add_sequence(("generate", 0), [1, 2])  # an id generate_paged would use
    with pytest.raises(ValueError, match="already exists"):
        generate_paged(model, cache, [[3, 4]], 2)
    assert cache.allocator.length(("generate", 0)) == 2
    with pytest.raises(ValueError, match="new_tokens=0"):
        generate_paged(model, cache, [[3, 4]], 0)
    with pytest.raises(ValueError, match=r"there must be a prompt \(got 0\)"):
        generate_paged(model, cache, [], 2)
    with pytest.raises(ValueError, match=f"token {model.config.vocab_size} is outside the vocabulary"):
        generate_paged(model, cache, [[3, model.config.vocab_size]], 2)


def test_slot_mapping_and_gather_follow_the_block_table():
    tables = torch.tensor([[5, 2, 7], [1, 0, 0]])
    positions = torch.tensor([[0, 4, 9], [3, -1, -1]])
    assert slot_mapping(tables, positions, 4).tolist() == [[20, 8, 29], [7, -1, -1]]
    pool = torch.arange(8 * 4).float().view(8, 4, 1, 1)  # slot s holds the value s
    assert gather_kv(pool, tables, 6)[0, 0, :, 0].tolist() == [20, 21, 22, 23, 8, 9]


def test_paged_attention_matches_attention_over_contiguous_keys():
    generator = torch.Generator().manual_seed(0)
    lengths, size = [5, 11], 4
    keys = [torch.randn(2, n, 8, generator=generator) for n in lengths]
    values = [torch.randn(2, n, 8, generator=generator) for n in lengths]
    q = torch.randn(2, 6, 8, generator=generator)
    k_pool, v_pool = torch.randn(9, size, 2, 8), torch.randn(9, size, 2, 8)
    tables = torch.tensor([[3, 8, 0], [6, 1, 4]])
    for b, n in enumerate(lengths):
        slots = slot_mapping(tables[b:b + 1], torch.arange(n)[None], size)[0]
        k_pool.view(-1, 2, 8)[slots], v_pool.view(-1, 2, 8)[slots] = keys[b].transpose(0, 1), values[b].transpose(0, 1)
    got = paged_attention(q, k_pool, v_pool, tables, torch.tensor(lengths))
    for b in range(2):
        expected = F.scaled_dot_product_attention(q[b, :, None], keys[b], values[b], enable_gqa=True)[:, 0]
        torch.testing.assert_close(got[b], expected)
    for bad_tables, bad_lengths, message in [(tables[:1], torch.tensor(lengths), r"got \(1, 3\) and \(2,\)"),
                                             (tables, torch.tensor(lengths[:1]), r"got \(2, 3\) and \(1,\)"),
                                             (tables, torch.tensor([5, 13]), r"every length must be in \[1, 12\]")]:
        with pytest.raises(ValueError, match=message):  # not broadcast, nor read past the table
            paged_attention(q, k_pool, v_pool, bad_tables, bad_lengths)


def _padded_slots(lengths, groups, overhead):
    return sum(len(g) * max(lengths[i] for i in g) + overhead for g in groups)


@pytest.mark.parametrize("seed", range(20))
def test_length_groups_split_at_least_cost(seed):
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 300, (int(torch.randint(1, 9, (1,), generator=rng)),), generator=rng).tolist()
    overhead = int(torch.randint(0, 400, (1,), generator=rng))
    groups = length_groups(lengths, overhead)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    every_split = [[order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))]
                   for n in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), n)]
    cheapest = min(_padded_slots(lengths, split, overhead) for split in every_split)
    assert _padded_slots(lengths, groups, overhead) == cheapest


def test_length_groups_at_the_extremes():
    assert length_groups([5, 300, 7, 290], overhead=10 ** 6) == [[0, 2, 3, 1]]
    assert sorted(map(sorted, length_groups([5, 300, 5, 290], overhead=1))) == [[0, 2], [1], [3]]
    assert length_groups([], overhead=512) == []


def _contiguous(model, prompt, new_tokens):
    return list(stream(model, prompt, SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)))


@pytest.mark.parametrize("block_size, group_overhead", [(1, 512), (3, 512), (16, 512), (3, 0), (16, 0)])
def test_batched_generation_through_the_paged_cache_equals_the_contiguous_cache(block_size, group_overhead):
    model = random_model(8, 2, seed=4)
    prompts = [[5, 17, 3, 9, 9, 1, 4], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 2], [5, 17, 3, 9, 9, 1, 8, 8]]
    num_blocks = 128 // block_size + 8
    cache = PagedKVCache(model.config, BlockAllocator(num_blocks, block_size))
    cache.group_overhead = group_overhead  # 0: every length decodes in a group of its own
    out, cached = generate_paged(model, cache, prompts, 12)  # the last prompt shares the first's blocks
    assert out == [_contiguous(model, p, 12) for p in prompts]
    assert cached == [0, 0, 0, 6 // block_size * block_size]
    again, cached = generate_paged(model, cache, [prompts[2][:9] + [3, 1]], 12)  # reuses the cached prefix
    assert cached[0] == 9 // block_size * block_size
    assert again == [_contiguous(model, prompts[2][:9] + [3, 1], 12)]
    cache.allocator.check()
    assert cache.allocator.num_free == num_blocks


def test_forked_sequences_write_their_own_copies():
    model = random_model(4, 4, seed=5)
    cache = PagedKVCache(model.config, BlockAllocator(16, 4))
    prompt = [3, 1, 4, 1, 5, 9]  # a partly filled second block, shared after the fork
    cache.allocator.add_sequence("a", prompt)
    step_logits(model, cache, [("a", 0, 6)], prompt)
    cache.allocator.fork("a", "b")
    cache.append("a", 1)
    cache.append("b", 1)
    assert cache.allocator.tables["a"][1] != cache.allocator.tables["b"][1]
    logits = step_logits(model, cache, [("a", 6, 1), ("b", 6, 1)], [2, 6])
    with torch.no_grad():
        alone = [model(torch.tensor([prompt + [t]]))[0, -1] for t in (2, 6)]
    torch.testing.assert_close(logits, torch.stack(alone), rtol=1e-4, atol=1e-5)


def test_prompts_in_one_row_prefill_like_each_alone():
    model = random_model(8, 2, seed=7)
    cache = PagedKVCache(model.config, BlockAllocator(16, 4))
    prompts = [[4, 8, 15, 16, 23, 42], [1, 2, 3]]
    for seq, prompt in enumerate(prompts):
        cache.allocator.add_sequence(seq, prompt)
    plan = cache.plan([(0, 0, 6), (1, 0, 3)])
    assert plan.positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2]] and plan.last.tolist() == [5, 8]
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0] + prompts[1]]), plan=plan)[0]
        torch.testing.assert_close(logits[:6], model(torch.tensor([prompts[0]]))[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(logits[6:], model(torch.tensor([prompts[1]]))[0], rtol=1e-4, atol=1e-5)


def test_the_cache_refuses_positions_without_slots():
    model = random_model(4, 2, seed=6)
    cache = PagedKVCache(model.config, BlockAllocator(8, 4))
    cache.allocator.add_sequence(0, [1, 2])
    with pytest.raises(ValueError, match="sequence 0: positions 0..2 .*has 2"):
        cache.plan([(0, 0, 3)])
    with pytest.raises(ValueError, match="positions -1..0"):
        cache.plan([(0, -1, 2)])
    assert step_logits(model, cache, [(0, 0, 2)], [1, 2]).shape == (1, model.config.vocab_size)


def test_the_shipped_model_generates_the_same_through_both_caches():
    from labkit.load import load
    model, tokenizer = load("draft", device="cpu")
    prompts = [tokenizer.encode(text).ids for text in ["def add(a, b):\n", "import os\n\nclass Config:\n"]]
    cache = PagedKVCache(model.config, BlockAllocator(32, 16), dtype=model.dtype)
    out, _ = generate_paged(model, cache, prompts, 16)
    assert out == [_contiguous(model, p, 16) for p in prompts]


def test_blocks_for_a_memory_budget_use_the_memory_labs_formula():
    model = random_model(8, 2, seed=0)
    shape = shape_of("tiny", model.config, model.num_parameters())
    budget = kv_cache_bytes(shape, 1000, 1, "fp16")
    assert num_blocks_for_memory(shape, budget, 16, "fp16") == 1000 // 16
    cache = PagedKVCache(model.config, BlockAllocator(1000 // 16, 16), dtype=torch.float16)
    assert cache.nbytes == kv_cache_bytes(shape, 1000 // 16 * 16, 1, "fp16")
    from dataclasses import replace
    longer = replace(model.config, max_seq_len=992)  # a contiguous cache holds at most the model's context
    assert ContiguousKVCache(longer, 1, 992, dtype=torch.float16).nbytes == cache.nbytes


def test_fragmentation_counts_slots():
    stats = fragmentation([1, 16, 17], context=32, block_size=16)
    assert (stats["used"], stats["paged_held"], stats["contiguous_reserved"]) == (34, 64, 96)
    assert stats["paged_waste"] == pytest.approx(30 / 64) and stats["contiguous_waste"] == pytest.approx(62 / 96)
    assert sequences_that_fit([1, 16, 17, 5], memory_slots=48, block_size=16) == 2
    with pytest.raises(ValueError, match="memory_slots=8 .*block_size=16"):
        sequences_that_fit([1], memory_slots=8, block_size=16)
    with pytest.raises(ValueError, match=r"lognormal\(64, 1, 9, 5\): need"):
        lognormal_lengths(3, 64, 1, 9, 5, seed=0)
    assert blocks_for(0, 4) == 0 and blocks_for(9, 4) == 3
