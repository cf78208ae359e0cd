"""Exercises of notebook 03: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

import pytest
import torch

from labkit.check import FAILED, run_cases
from labkit.exercises import get

from exercise_cells import cells, define, fails, mistake


def test_lab03_plausible_mistakes_fail(root):
    from labkit.paged import BlockPool, OutOfBlocks
    solution = define(cells("solutions", root)["ex03.2"], "SimplePool")  # each mistake is in one method only

    def no_padding(block_tables, positions, block_size):  # -1 becomes a real slot
        return block_tables.gather(1, positions.clamp(min=0) // block_size) * block_size + positions % block_size
    result = fails("ex03.1", no_padding, "padding (-1) stays -1", "a position of -1 is padding, not a token: its slot is -1")
    assert "expected -1, got 23" in result.message, result.message

    class Leaky(solution):  # frees the table but never returns blocks to the free list
        def free(self, seq_id):
            for block in self.tables.pop(seq_id):
                self.ref_count[block] -= 1
    result = run_cases(get("ex03.2"), Leaky)
    assert result.status == FAILED and "leaked" in result.message, result.message

    class Greedy(solution):  # takes what it can, then raises: the pool is changed
        def allocate(self, seq_id, n_blocks):
            blocks = [self.free_blocks.pop() for _ in range(min(n_blocks, len(self.free_blocks)))]
            for block in blocks:
                self.ref_count[block] = 1
            self.tables.setdefault(seq_id, []).extend(blocks)
            if len(blocks) < n_blocks:
                raise OutOfBlocks("too few")
            return blocks
    result = run_cases(get("ex03.2"), Greedy)
    assert result.status == FAILED and "raised OutOfBlocks but changed the free blocks" in result.message, \
        result.message

    class IgnoresCounts(solution):  # every block back to the free list, whoever else holds it
        def free(self, seq_id):
            for block in self.tables.pop(seq_id):
                self.ref_count[block] = 0
                self.free_blocks.append(block)
    result = run_cases(get("ex03.2"), IgnoresCounts)
    assert result.status == FAILED and "two tables hold" in result.message, result.message

    class SlicesFromTheEnd(solution):  # free_blocks[-0:] is all of them
        def allocate(self, seq_id, n_blocks):
            if n_blocks > len(self.free_blocks):
                raise OutOfBlocks("too few")
            blocks = self.free_blocks[-n_blocks:]
            del self.free_blocks[-n_blocks:]
            for block in blocks:
                self.ref_count[block] = 1
            self.tables.setdefault(seq_id, []).extend(blocks)
            return blocks
    result = run_cases(get("ex03.2"), SlicesFromTheEnd)
    assert result.status == FAILED and "allocate 0 blocks" in result.message, result.message

    class AlwaysCopies(BlockPool):  # copies even an exclusive block
        def fork(self, parent, child):
            self.tables[child] = list(self.tables[parent])
            for block in self.tables[child]:
                self.ref_count[block] += 1

        def copy_on_write(self, seq_id, index):
            new, = self.take(1)
            old, self.tables[seq_id][index], self.ref_count[new] = self.tables[seq_id][index], new, 1
            self.release(old)
            return old, new
    result = fails("ex03.3", AlwaysCopies, "fork, then both write", "block 2 is not shared, so nothing to copy")
    assert "labkit's own" not in result.message, result.message

    def unmasked(q, k_pool, v_pool, block_tables, lengths):  # attends to the noise past each length
        longest = int(lengths.max())
        keys, values = gather_kv(k_pool, block_tables, longest), gather_kv(v_pool, block_tables, longest)
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True)[:, :, 0]
    result = fails("ex03.4", unmasked, "MHA, lengths not multiples of the block", "must get no attention weight")
    assert 0 < result.passed < result.total


def gather_kv(pool, block_tables, length):
    """A student's gather of each sequence's first ``length`` keys or values, [B, kv_heads, length, head_dim]
    (labkit's own is its answer to ex03.4, which refuses a student's call)."""
    return pool[block_tables].flatten(1, 2)[:, :length].transpose(1, 2)


def test_labkits_own_gather_and_share_are_refused(root):
    from labkit.paged import BlockPool
    from labkit.paged_attention import gather_kv as labkits_gather

    def borrows(q, k_pool, v_pool, block_tables, lengths):
        longest = int(lengths.max())
        keys, values = labkits_gather(k_pool, block_tables, longest), labkits_gather(v_pool, block_tables, longest)
        mask = torch.arange(longest)[None] < lengths[:, None]
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True,
                                                                attn_mask=mask[:, None, None])[:, :, 0]
    assert "labkit's answer to ex03.4" in run_cases(get("ex03.4"), borrows).message
    solution = define(cells("solutions", root)["ex03.3"], "ForkingPool")

    class ForksByShare(solution):
        def fork(self, parent, child):
            BlockPool.share(self, child, self.tables[parent])
    assert "labkit's answer to ex03.3" in run_cases(get("ex03.3"), ForksByShare).message


def test_lab03_a_failing_case_shows_its_own_hint(root):
    solution = define(cells("solutions", root)["ex03.2"], "SimplePool")

    def position_as_slot(block_tables, positions, block_size):  # never looks at the table
        return positions
    result = run_cases(get("ex03.1"), position_as_slot)
    assert result.failed_case == "one sequence, blocks scattered over the pool", result.message
    assert "skipped the block table" in result.message and "recipe (" not in result.message, result.message

    class IgnoresCounts(solution):  # every block back to the free list, whoever else holds it
        def free(self, seq_id):
            for block in self.tables.pop(seq_id):
                self.ref_count[block] = 0
                self.free_blocks.append(block)
    message = run_cases(get("ex03.2"), IgnoresCounts).message
    assert "only when its last holder lets go" in message, message

    def heads_round_robin(q, k_pool, v_pool, block_tables, lengths):  # .repeat: head h reads KV head h % kv_heads
        longest, group = int(lengths.max()), q.shape[1] // k_pool.shape[2]
        keys, values = (gather_kv(pool, block_tables, longest).repeat(1, group, 1, 1) for pool in (k_pool, v_pool))
        mask = torch.arange(longest)[None] < lengths[:, None]
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], keys, values,
                                                                attn_mask=mask[:, None, None])[:, :, 0]
    result = run_cases(get("ex03.4"), heads_round_robin)
    assert result.failed_case.startswith("GQA") and "heads 0-3 read KV head 0" in result.message, result.message
    again = run_cases(get("ex03.4"), heads_round_robin, failed_before={result.failed_case: 1}).message
    assert "recipe (this case failed before)" in again and "repeat_interleave" in again, again


def test_a_slot_mapping_that_writes_into_positions_fails(root):
    in_place = mistake(root, "ex03.1", ("    clamped = positions.clamp(min=0)\n",
                                        "torch.where(positions >= 0,"),
                       ("    pad = positions < 0\n    clamped = positions.clamp_(min=0)\n", "torch.where(~pad,"))
    fails("ex03.1", in_place, "padding (-1) stays -1", "changed its argument positions in place")


def test_each_paged_mistake_fails_at_the_case_that_names_it(root):
    grouping = "n_heads // kv_heads, dim=2)"
    for right, wrong, case, hint in [
            ("if n_blocks > len(self.free_blocks):", "if n_blocks >= len(self.free_blocks):",
             "asking for exactly the blocks that are free", "n > free, not n >= free"),
            ("positions[None, None] >= lengths", "positions[None, None] > lengths", "MHA, lengths not multiples",
             "mask positions >= lengths[b]"),
            (("keys = k_pool.flatten(0, 1)[slots].repeat_interleave(" + grouping,
              "values = v_pool.flatten(0, 1)[slots].repeat_interleave(" + grouping),
             ("keys = k_pool.flatten(0, 1)[slots].repeat(1, 1, n_heads // kv_heads, 1)",
              "values = v_pool.flatten(0, 1)[slots].repeat(1, 1, n_heads // kv_heads, 1)"),
             "GQA (8 query heads, 2 KV heads), full blocks", "repeat_interleave, not repeat")]:
        ex_id = "ex03.2" if "free_blocks" in str(right) else "ex03.4"
        fails(ex_id, mistake(root, ex_id, right, wrong), case, hint)


def test_a_fork_that_leaves_the_counts_as_they_were_fails_and_says_so(root):
    """The child's table is right, but the parent's blocks did not gain an owner: the message says
    that the fork must raise the counts, not only that a count and the owners disagree."""
    counted = "        for block in self.tables[child]:\n            self.ref_count[block] += 1\n"
    uncounted = mistake(root, "ex03.3", counted, "")
    fails("ex03.3", uncounted, "fork, then both write the last block",
          "block 0 still has ref_count 1, expected 2: a fork gives each of the parent's blocks one more owner")


@pytest.mark.parametrize("right, wrong, case, says", [
    ("        for block in self.tables.pop(seq_id):", "        for block in self.tables[seq_id]:",  # the table stays
     "allocate, then free everything", "tables have {'a': 4, 'b': 2} blocks, expected {'b': 2}"),
])
def test_lab03_pool_mistakes_name_what_they_left(root, right, wrong, case, says):
    fails("ex03.2", mistake(root, "ex03.2", right, wrong), case, says)


def test_an_undo_that_puts_the_free_blocks_back_in_another_order_passes(root):
    """Which free block is taken next does not matter: a refused allocation may leave them in another order."""
    undoes = ("        if n_blocks > len(self.free_blocks):\n"
              "            raise OutOfBlocks(f\"need {n_blocks} blocks, {len(self.free_blocks)} free\")\n"
              "        blocks = [self.free_blocks.pop() for _ in range(n_blocks)]\n",
              "        blocks = []\n        try:\n            for _ in range(n_blocks):\n"
              "                blocks.append(self.free_blocks.pop())\n        except IndexError:\n"
              "            self.free_blocks.extend(blocks)  # the taken ones back, in the order taken\n"
              "            raise OutOfBlocks('too few') from None\n")
    assert run_cases(get("ex03.2"), mistake(root, "ex03.2", *undoes)).status == "passed"


@pytest.mark.parametrize("wrong, says", [
    ("return new", "expected (1, a block that was free)"),  # not a pair: said, not the check's own TypeError
    ("return new, old", "the new block first; return (old, new)"),
])
def test_copy_on_write_returning_the_wrong_shape_is_said(root, wrong, says):
    result = fails("ex03.3", mistake(root, "ex03.3", "return old, new", wrong), "fork, then both write", says)
    assert "TypeError" not in result.message
