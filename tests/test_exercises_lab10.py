"""Exercises of notebook 10: the solutions pass (and other right answers), the released stubs score nothing,
plausible mistakes fail at the case that tests them with a message that names the mistake, the checks'
references agree with the formulas and with labkit (a counted schedule, a ring run step by step, a real
cache's bytes), and the cases hold what their labels promise."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from labkit import memory
from labkit.check import NOT_ATTEMPTED, PASSED, run_cases
from labkit.exercises import get, lab10
from labkit.interconnect import Link, ring_allreduce_seconds
from labkit.model import ContiguousKVCache, ModelConfig
from labkit.release import strip_solutions

from exercise_cells import cells, define, fails, mistake, solution

IDS = ("ex10.1", "ex10.2", "ex10.3", "ex10.4")


def test_lab10_solutions_pass_and_released_stubs_are_not_attempted(root):
    for ex_id in IDS:
        assert run_cases(get(ex_id), solution(ex_id)).status == PASSED, ex_id
        source = cells("solutions", root)[ex_id]
        stub = define(strip_solutions(source, ex_id, ex_id), get(ex_id).function)
        result = run_cases(get(ex_id), stub)
        assert result.status == NOT_ATTEMPTED and result.points == 0, result.verdict()


# --- the references against the formulas and labkit ---------------------------------------------------------


@pytest.mark.parametrize("stages", range(1, 9))
def test_the_counted_schedule_is_the_bubble_formula(stages):
    for micro_batches in range(1, 40):
        expected = (stages - 1) / (micro_batches + stages - 1)
        assert lab10.bubble_by_schedule(stages, micro_batches) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("world", range(1, 10))
def test_the_ring_run_step_by_step_is_labkits_formula(world):
    for nbytes, latency, bandwidth in [(16384, 1.9e-6, 450e9), (64e6, 2.5e-6, 31.5e9), (0, 1e-5, 1e9)]:
        link = Link("test", latency, bandwidth)
        assert lab10.ring_by_steps(nbytes, world, latency, bandwidth) == pytest.approx(
            ring_allreduce_seconds(nbytes, world, link), rel=1e-12, abs=1e-18)


def test_a_real_caches_bytes_are_labkits_formula():
    for config in (ModelConfig(64, 32, 2, 4, 2, 64, 64), ModelConfig(64, 64, 3, 8, 1, 64, 64),
                   ModelConfig(64, 48, 1, 6, 6, 64, 64)):
        for tokens, dtype, name in ((13, torch.float32, "fp32"), (7, torch.bfloat16, "bf16"),
                                    (64, torch.float16, "fp16")):
            shape = memory.shape_of("test", config, 0)
            assert lab10.cache_bytes(config, tokens, dtype) == memory.kv_cache_bytes(shape, tokens, 1, name)


ELEMENT = {0.5: torch.uint8, 1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}  # 0.5: 4-bit codes


def counted_on_meta(n_layers, n_heads, n_kv_heads, head_dim, prompt_tokens, bytes_per_element):
    """A ContiguousKVCache of the model's shape on the meta device (sized, never filled): its tensors' bytes. A
    4-bit cache packs two codes in a byte: a uint8 cache of half the head_dim."""
    stored_dim = head_dim // 2 if bytes_per_element == 0.5 else head_dim
    config = ModelConfig(64, n_heads * stored_dim, n_layers, n_heads, n_kv_heads, 64, prompt_tokens)
    cache = ContiguousKVCache(config, 1, prompt_tokens, ELEMENT[bytes_per_element], "meta")
    return cache.k.nbytes + cache.v.nbytes


def test_the_shipped_bytes_cases_agree_with_a_cache_of_each_shape():
    assert run_cases(get("ex10.4"), counted_on_meta).status == PASSED


def test_the_tensor_parallel_cases_agree_with_masked_full_products():
    """Rank r's column share: one dot product per output feature of the rank's, stacked (the whole product, which
    the check refuses to a rank, is not computed); its row partial sum: the full product of x with every feature but
    the rank's zeroed, which needs no slice of the weight at all."""
    class Masked:
        @staticmethod
        def column_parallel(x, weight, rank, world):
            if weight.shape[0] % world:
                raise ValueError("world does not divide out_features")
            features = weight.shape[0] // world
            return torch.stack([(x * weight[j]).sum(-1) for j in range(rank * features, (rank + 1) * features)], -1)

        @staticmethod
        def row_parallel(x_part, weight, rank, world):
            if weight.shape[1] % world:
                raise ValueError("world does not divide in_features")
            size = weight.shape[1] // world
            x = F.pad(x_part, (rank * size, (world - 1 - rank) * size))
            return x @ weight.T
    assert run_cases(get("ex10.1"), Masked).status == PASSED


def brute_force_heads(n_heads, n_kv_heads, rank, world):
    """Every head tried: the query heads whose rank (h // (n_heads / W)) is this one, and the KV heads some query
    head of this rank reads."""
    query = [h for h in range(n_heads) if h * world // n_heads == rank]
    kv = [k for k in range(n_kv_heads) if any(h * n_kv_heads // n_heads == k for h in query)]
    return query, kv


def test_the_sharding_cases_agree_with_every_head_tried():
    assert run_cases(get("ex10.2"), brute_force_heads).status == PASSED


# --- other right answers ------------------------------------------------------------------------------------


def test_other_right_answers_pass():
    class Linear:  # F.linear and torch.chunk; no @staticmethod (called on the class, a plain function is one)
        def column_parallel(x, weight, rank, world):
            if weight.shape[0] % world:
                raise ValueError("world does not divide out_features")
            return F.linear(x, weight.chunk(world)[rank])

        def row_parallel(x_part, weight, rank, world):
            if weight.shape[1] % world:
                raise ValueError("world does not divide in_features")
            return F.linear(x_part, weight.chunk(world, dim=1)[rank])
    assert run_cases(get("ex10.1"), Linear).status == PASSED

    def as_ranges_and_tensors(n_heads, n_kv_heads, rank, world):
        query, kv = brute_force_heads(n_heads, n_kv_heads, rank, world)
        return range(query[0], query[-1] + 1), torch.tensor(kv)
    assert run_cases(get("ex10.2"), as_ranges_and_tensors).status == PASSED

    class InTorch:  # 0-d tensors
        @staticmethod
        def bubble_fraction(stages, micro_batches):
            return 1 - torch.tensor(micro_batches, dtype=torch.float64) / (micro_batches + stages - 1)

        @staticmethod
        def ring_allreduce_seconds(nbytes, world, latency_s, bandwidth):
            reduce_scatter = (world - 1) * torch.tensor(latency_s + nbytes / world / bandwidth, dtype=torch.float64)
            return 2 * reduce_scatter
    assert run_cases(get("ex10.3"), InTorch).status == PASSED

    def per_token(n_layers, n_heads, n_kv_heads, head_dim, prompt_tokens, bytes_per_element):
        return prompt_tokens * (n_layers * 2 * n_kv_heads * head_dim * bytes_per_element)
    assert run_cases(get("ex10.4"), per_token).status == PASSED


# --- mistakes -----------------------------------------------------------------------------------------------


COLUMN_2, ROW_2, REFUSE = "column-parallel, 2 ranks", "row-parallel, 2 ranks", "3 ranks cannot share"
COLUMN_SLICE = "x @ weight[rank * size:(rank + 1) * size].T"
ROW_SLICE = "x_part @ weight[:, rank * size:(rank + 1) * size].T"


@pytest.mark.parametrize("right, wrong, case, hint", [
    (COLUMN_SLICE, "x @ weight[rank::world].T", COLUMN_2, "an interleaved (strided) split"),
    (COLUMN_SLICE, "x @ weight[(world - 1 - rank) * size:(world - rank) * size].T", COLUMN_2,
     "this is rank 1's share (rows 4 .. 7); rank 0 holds rows 0 .. 3"),
    (COLUMN_SLICE, "x @ weight.T", COLUMN_2, "this is the whole output"),
    (COLUMN_SLICE, "x @ weight[:, rank * size:(rank + 1) * size].T", COLUMN_2,
     "splits the weight by rows (output features): weight[0:4], shape [4, 6]"),
    (ROW_SLICE, "x_part @ weight[rank * size:(rank + 1) * size]", ROW_2, "a split by rows"),
    (ROW_SLICE, "x_part @ weight[rank * size:(rank + 1) * size].T", ROW_2, "a slice of rows does not fit x_part"),
    (ROW_SLICE, "x_part @ weight[:, rank::world].T", ROW_2, "an interleaved (strided) split"),
    (ROW_SLICE, ROW_SLICE + " / world", ROW_2, "it does not average them"),
    (ROW_SLICE, "x_part @ weight[:, (world - 1 - rank) * size:(world - rank) * size].T", ROW_2,
     "this uses rank 1's columns"),
    (COLUMN_SLICE, "x @ weight[rank:rank + size].T", COLUMN_2,
     "this uses rows 1 .. 4, a share that starts at row 1; rank 1's share starts at rank x 4 = 4: rows 4 .. 7"),
    (ROW_SLICE, "x_part @ weight[:, rank:rank + size].T", ROW_2, "a share that starts at column 1"),
    (ROW_SLICE, "x_part[..., rank * size:(rank + 1) * size] @ weight[:, rank * size:(rank + 1) * size].T", ROW_2,
     "x_part is already rank 1's share of the input, 4 of the 8 features (use it whole"),  # sliced once more
    (COLUMN_SLICE, f"({COLUMN_SLICE}).float()", COLUMN_2,  # fp32 out of fp64: a dtype named, not a crash in the check
     "expected torch.float64, the dtype of x and weight, got torch.float32"),
    ("if out_features % world:", "if False:", REFUSE, "column_parallel(..., weight of shape [8, 6], rank=0, world=3) "
                                                      "returned tensor(shape=(2, 2)"),
    ("if out_features % world:", "if weight.shape[1] % world:", "column-parallel, 4 ranks",  # the other dimension's
     "The dimension split is the output features"),
    ("if in_features % world:", "if False:", REFUSE, "row_parallel(..., weight of shape [6, 8], rank=0, world=3) "
                                                     "returned tensor(shape=(2, 6)"),
])
def test_lab10_tensor_parallel_mistakes_fail(root, right, wrong, case, hint):
    result = fails("ex10.1", mistake(root, "ex10.1", right, wrong), case, hint)
    if case == REFUSE:
        assert "raise ValueError when world does not divide" in result.message


def test_a_tensor_changed_in_place_is_said_without_the_cases_hint(root):
    """The result is right (x doubled, the product halved): the message says what to change; the case's hint,
    about the weight's split, would mislead."""
    in_place = mistake(root, "ex10.1", COLUMN_SLICE, "x.mul_(2) @ weight[rank * size:(rank + 1) * size].T / 2")
    result = fails("ex10.1", in_place, "column-parallel", "changed a tensor it was given in place")
    assert "hint:" not in result.message, result.message


QUERY = "query_heads = list(range(rank * per_rank, (rank + 1) * per_rank))"
KV_SHARE = "kv_heads = list(range(rank * kv_per_rank, (rank + 1) * kv_per_rank))"
KV_ONE = "kv_heads = [query_heads[0] // (n_heads // n_kv_heads)]"


@pytest.mark.parametrize("right, wrong, case, hint", [
    (QUERY, "query_heads = list(range(rank, n_heads, world))", "MHA on 2 ranks",
     "this is a round robin, one head in 2 from head 0"),
    ("if world <= n_kv_heads:", "if True:", "GQA on 4 ranks: 8 query heads, 2 KV heads",
     "got []: its query heads [0, 1] read KV heads [0] (query head h reads h // 4), which it does not hold. With "
     "more ranks (4) than KV heads (2) the KV heads cannot be split"),
    (KV_SHARE, "kv_heads = list(range(n_kv_heads))", "MHA on 2 ranks",
     "every rank holds all 8 KV heads. Holding them all, a rank has the ones its query heads read, so attention "
     "comes out right, but it caches keys and values those heads never read: 2 times the KV-cache memory"),
    (KV_ONE, "kv_heads = list(range(n_kv_heads))", "GQA on 4 ranks: 8 query heads, 2 KV heads",
     "2 times the KV-cache memory"),
    (KV_ONE, "kv_heads = [rank % n_kv_heads]", "GQA on 4 ranks: 8 query heads, 2 KV heads",
     "shard_heads(8, 2, rank=1, world=4): kv_heads: expected [0], got [1]"),
    (KV_SHARE, "kv_heads = list(range(rank, n_kv_heads, world))", "MHA on 2 ranks",
     "got [0, 2, 4, 6]: this is a round robin, one KV head in 2; its query heads [0, 1, 2, 3] read KV heads "
     "[0, 1, 2, 3]"),
    (KV_SHARE, "kv_heads = list(range((world - 1 - rank) * kv_per_rank, (world - rank) * kv_per_rank))",
     "MHA on 2 ranks", "got [4, 5, 6, 7]: its query heads [0, 1, 2, 3] read KV heads [0, 1, 2, 3] (query head h "
                       "reads h // 1); a rank must hold each KV head its query heads read"),
    ("return query_heads, kv_heads", "return kv_heads, query_heads", "GQA on 2 ranks: 8 query heads, 4 KV heads",
     "got ([0, 1], [0, 1, 2, 3]): the two lists are swapped"),
])
def test_lab10_shard_heads_mistakes_fail(root, right, wrong, case, hint):
    fails("ex10.2", mistake(root, "ex10.2", right, wrong), case, hint)


BUBBLE = "(stages - 1) / (micro_batches + stages - 1)"
RING_TIME = "steps * (latency_s + nbytes / (world * bandwidth))"


@pytest.mark.parametrize("right, wrong, case, hint", [
    (BUBBLE, "(stages - 1) / micro_batches", "bubble: 4 stages, 1 micro-batch", "the idle time over the busy time"),
    (BUBBLE, "(micro_batches - 1) / (micro_batches + stages - 1)", "bubble: one stage", "are swapped"),
    (BUBBLE, "(stages - 1) / (micro_batches + stages)", "bubble: 4 stages, 1 micro-batch", "not m + p"),
    (BUBBLE, "(stages - 1) // (micro_batches + stages - 1)", "bubble: 4 stages, 1 micro-batch", "got the int 0: //"),
    ("steps = 2 * (world - 1)", "steps = world - 1", "ring all-reduce: 2 ranks", "a reduce-scatter (W - 1 steps"),
    ("nbytes / (world * bandwidth)", "nbytes / bandwidth", "ring all-reduce: 2 ranks",
     "each step sends the whole message"),
    ("steps = 2 * (world - 1)", "steps = 2 * world", "ring all-reduce: 2 ranks", "2 W steps"),
    ("steps * (latency_s + nbytes / (world * bandwidth))", "latency_s + steps * nbytes / (world * bandwidth)",
     "ring all-reduce: 2 ranks", "the latency counted once"),
    ("steps * (latency_s + nbytes / (world * bandwidth))", "steps * nbytes / (world * bandwidth)",
     "ring all-reduce: 2 ranks", "the latency is left out"),
    (RING_TIME, "steps * latency_s + 2 * nbytes / bandwidth", "ring all-reduce: 2 ranks",
     "the (W - 1) / W is missing"),
    (RING_TIME, "steps * latency_s + (world - 1) * nbytes / (world * bandwidth)", "ring all-reduce: 2 ranks",
     "the bytes only W - 1 times"),
])
def test_lab10_cost_mistakes_fail(root, right, wrong, case, hint):
    fails("ex10.3", mistake(root, "ex10.3", right, wrong), case, hint)


@pytest.mark.parametrize("right, wrong, case, hint, not_named", [
    # with one stage, (m - 1) / m is both stages and micro_batches swapped and the brackets left out: the probe decides
    (BUBBLE, "stages - 1 / (micro_batches + stages - 1)", "bubble: one stage", "/ binds before -", "swapped"),
    (BUBBLE, "1 - 1 / micro_batches", "bubble: one stage", "expected 0, got 0.875\n", "swapped"),  # no known slip
    (BUBBLE, "100 * (stages - 1) / (micro_batches + stages - 1)", "bubble: 4 stages", "that is a percentage", None),
    (RING_TIME, "steps / world * (latency_s + nbytes / bandwidth)", "ring all-reduce: 2 ranks",
     "the / W cuts the latency too", "the latency counted once"),
    (RING_TIME, "(world - 1) * latency_s + steps * nbytes / (world * bandwidth)", "ring all-reduce: 2 ranks",
     "got 1.93641e-06 s\n", "the latency counted once"),  # once at W = 2, W - 1 times in general: not named
    ("nbytes / (world * bandwidth)", "8 * nbytes / (world * bandwidth)", "ring all-reduce: 2 ranks", "that counts bits",
     None),
    ("return steps", "return 1e3 * steps", "ring all-reduce: 2 ranks", "that is in milliseconds", None),
])
def test_a_cost_mistake_is_named_only_where_it_fits_a_second_point(root, right, wrong, case, hint, not_named):
    result = fails("ex10.3", mistake(root, "ex10.3", right, wrong), case, hint)
    assert not_named is None or not_named not in result.message, result.message


@pytest.mark.parametrize("mistakes, probe, right", [
    (lab10.BUBBLE_MISTAKES, lab10.BUBBLE_PROBE, lab10.bubble_by_schedule),
    (lab10.RING_MISTAKES, lab10.RING_PROBE, lab10.ring_by_steps),
])
def test_the_probes_tell_the_known_mistakes_apart(mistakes, probe, right):
    values = [right(*probe), *(formula(*probe) for formula, _ in mistakes)]
    assert all(a != pytest.approx(b, rel=1e-6) for i, a in enumerate(values) for b in values[i + 1:]), values


SHIPPED = "2 * n_layers * n_kv_heads * head_dim * prompt_tokens * bytes_per_element"
LLAMA = "Qwen2.5-7B, a 2,048-token prompt"


@pytest.mark.parametrize("wrong, hint", [
    ("2 * n_layers * n_kv_heads * head_dim * bytes_per_element", "that is one token's"),
    ("n_layers * n_kv_heads * head_dim * prompt_tokens * bytes_per_element", "the factor 2"),
    ("2 * n_layers * n_heads * head_dim * prompt_tokens * bytes_per_element", "that counts the 28 query heads"),
    ("2 * n_kv_heads * head_dim * prompt_tokens * bytes_per_element", "every one of the 28 layers"),
    ("2 * n_layers * n_kv_heads * head_dim * prompt_tokens", "that is a count of elements"),
    ("2 * n_layers * n_kv_heads * head_dim * prompt_tokens * bytes_per_element * 8", "that is bits"),
    ("2 * n_layers * n_kv_heads * head_dim * (prompt_tokens + 1) * bytes_per_element", "that counts 2048 + 1 tokens"),
    ("2 * n_layers * n_kv_heads * head_dim * prompt_tokens * bytes_per_element / 1e6", "that is in megabytes"),
    ("2 * n_layers * n_kv_heads * head_dim * prompt_tokens * bytes_per_element / 2**20", "that is in MiB"),
    ("2 * n_layers * n_kv_heads * head_dim * prompt_tokens * bytes_per_element / 2**30", "that is in GiB"),
    ("2 * n_layers * n_kv_heads * head_dim * (prompt_tokens - 1) * bytes_per_element", "that counts 2048 - 1 tokens"),
    ("2 * n_layers * (n_heads // n_kv_heads) * head_dim * prompt_tokens * bytes_per_element",
     "that counts heads // kv_heads = 7 KV heads, the query heads that share one"),
])
def test_lab10_shipped_bytes_mistakes_fail(root, wrong, hint):
    result = fails("ex10.4", mistake(root, "ex10.4", SHIPPED, wrong), LLAMA, hint)
    assert "; or " not in result.message  # the first case's sizes give each slip a value of its own


def test_where_two_slips_give_one_value_both_are_said(root):
    """32 // 8 = 4 = 8 / 2 (Llama-3.2-1B): the group size as the KV heads gives the keys alone's value too."""
    group = "2 * n_layers * (n_heads // n_kv_heads) * head_dim * prompt_tokens * bytes_per_element"
    right_on_the_first = f"({SHIPPED} if prompt_tokens == 2048 else {group})"
    fails("ex10.4", mistake(root, "ex10.4", SHIPPED, right_on_the_first), "Llama-3.2-1B, a 512-token prompt",
          "the factor 2; or that counts heads // kv_heads = 4 KV heads")



@pytest.mark.parametrize("whole", ["int(bytes_per_element)", "max(1, bytes_per_element)"])
def test_a_whole_bytes_per_element_fails_on_the_int4_cache(root, whole):
    """Rounded down or up: 0.5 made 1 gives 2 x elements, a count of elements too, which it is not (the cases of whole
    bytes passed)."""
    result = fails("ex10.4", mistake(root, "ex10.4", SHIPPED, SHIPPED.replace("bytes_per_element", whole)),
                   "Llama-3.1-8B, a 1,000-token prompt", "0.5 here, a fraction")
    assert "count of elements" not in result.message


# --- the cases are what their labels say --------------------------------------------------------------------


class Spy:
    """Records the calls of a run's cases and answers them right."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.answer(*args)


def _calls(ex_id, answer, methods=()):
    """For each case of ``ex_id``, the calls it made of each method (or of the function)."""
    out = []
    for case in get(ex_id).cases():
        spies = {name: Spy(getattr(answer, name)) for name in methods}
        fn = type("Recorded", (), {name: staticmethod(spy) for name, spy in spies.items()}) if methods else Spy(answer)
        case.run(fn)
        out.append((case.label, {name: spy.calls for name, spy in spies.items()} if methods else fn.calls))
    return out


def _numbers(label):
    return [int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", label)]


def test_the_cases_are_what_their_labels_say(root):
    for label, calls in _calls("ex10.1", solution("ex10.1"), ("column_parallel", "row_parallel")):
        worlds = {args[3] for method in calls.values() for args in method}
        ranks = re.search(r"(\d) ranks?", label)
        assert worlds == {int(ranks[1])}, label
        column, row = calls["column_parallel"], calls["row_parallel"]
        if label.startswith("column-parallel"):
            assert not row and [a[2] for a in column] == list(range(len(column)))
            assert f"x {list(column[0][0].shape)}, weight {list(column[0][1].shape)}" in label
        if label.startswith("row-parallel"):
            assert not column and f"x_part {list(row[0][0].shape)}, weight {list(row[0][1].shape)}" in label
            assert row[0][1].shape[0] == row[0][1].shape[1] or "2 ranks" not in label  # the rows-slice mistake fits
        if label.startswith("Llama's MLP"):
            assert len(column) == 2 * len(row) and f"d_ff {column[0][1].shape[0]}" in label
    for label, calls in _calls("ex10.2", brute_force_heads):
        (n_heads, n_kv_heads, _, world), = {(*args[:2], 0, args[3]) for args in calls}
        assert [args[2] for args in calls] == list(range(world)), label
        assert f"{world} rank" in label and f"{n_heads} " in label, label
        kind = "MHA" if n_kv_heads == n_heads else "MQA" if n_kv_heads == 1 else "GQA"
        assert kind in label or "Llama" in label or "Qwen" in label, label
        assert ("replicated" in label) == (world > n_kv_heads > 1), label
    for label, calls in _calls("ex10.3", solution("ex10.3"), ("bubble_fraction", "ring_allreduce_seconds")):
        (args,) = calls["bubble_fraction"] or calls["ring_allreduce_seconds"]
        if label.startswith("bubble"):
            stages, micro_batches = args
            assert _numbers(label) == ([micro_batches] if stages == 1 else [stages, micro_batches]), label
            assert (stages == 1) == ("one stage" in label), label
        else:
            assert _numbers(label)[0] == args[1] and ("nothing" in label) == (args[1] == 1), label
    for label, calls in _calls("ex10.4", counted_on_meta):
        (args,) = calls
        assert f"{args[4]:,}-token" in label or f"{args[4]} tokens" in label or f"{args[4] // 1024}K" in label, label
        assert (args[1] == args[2]) == ("MHA" in label), label


def test_a_rank_that_computes_the_whole_output_to_keep_its_share_fails(root):
    whole = "(x @ weight.T)[..., rank * size:(rank + 1) * size]"
    result = fails("ex10.1", mistake(root, "ex10.1", COLUMN_SLICE, whole), "column-parallel, 2 ranks",
                   "computes the whole output, all 8 features, on the way")
    assert "hint:" not in result.message
