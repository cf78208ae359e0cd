"""Token trees (labkit.tree) and Medusa's tree speculation (labkit.medusa): the mask and positions
against loops, a planted branch found in one pass with the cache left as if it alone had run,
greedy output identical to the target's whatever the heads guess, sampled output with the
target's distribution, and bad trees refused by name."""
from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch

import labkit
import labkit.medusa as medusa
from labkit.generate import SamplingParams, sampling_probs, stream
from labkit.heads import ResidualHeads, load_medusa
from labkit.model import ContiguousKVCache, ModelConfig, Transformer, forward_tokens
from labkit.speculative import SpeculationStats
from labkit.tree import chain, check_tree, expected_accepted, tree_mask, tree_plan, tree_positions, walk
from tests.test_speculative import chi_square_p
from tests.tiny_models import far_apart_model, one_torch_thread

one_thread = pytest.fixture(autouse=True)(one_torch_thread)
GREEDY = SamplingParams(max_new_tokens=24, stop_at_eos=False)


def random_tree(rng: random.Random, nodes: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, nodes)]


def ancestors(parents, node):
    out = {node}
    while parents[node] != -1:
        node = parents[node]
        out.add(node)
    return out


# --- the tree: mask, positions, checks --------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_mask_and_positions_against_loops(seed):
    parents = random_tree(random.Random(seed), 12)
    want = torch.tensor([[j in ancestors(parents, i) for j in range(12)] for i in range(12)])
    assert torch.equal(tree_mask(parents), want)
    depth = [len(ancestors(parents, i)) - 1 for i in range(12)]
    assert tree_positions(parents, 7).tolist() == [7 + d for d in depth]


def test_a_chain_is_causal():
    assert torch.equal(tree_mask(chain(4)), torch.ones(5, 5, dtype=torch.bool).tril())
    assert tree_positions(chain(4), 3).tolist() == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("parents, words", [
    ([0, 0], "root"), ([-1, 2, 1], "a cycle"), ([-1, 0, 3, 0], "a parent after its child"),
    ([-1, -1], "not a node"), ([-1, 0, 1, 2], "beyond the 2")])
def test_bad_trees_are_refused_by_name(parents, words):
    with pytest.raises(ValueError, match=words):
        check_tree(parents, max_depth=2)


def test_expected_accepted_against_enumeration():
    """Against the mean over every outcome: at each node, which child (if any) the target's token is."""
    parents = [-1, 0, 0, 1, 1, 2, 3]
    accept = [0.0, 0.5, 0.3, 0.4, 0.2, 0.9, 0.7]
    kids = {n: [c for c in range(len(parents)) if parents[c] == n] for n in range(len(parents))}

    def mean_from(node):
        return sum(accept[c] * (1 + mean_from(c)) for c in kids[node])
    assert expected_accepted(parents, accept) == pytest.approx(mean_from(0))
    with pytest.raises(ValueError, match="siblings exclude each other"):
        expected_accepted([-1, 0, 0], [0, 0.7, 0.6])


# --- the tree's paths --------------------------------------------------------------------------------

def test_tree_parents_orders_by_depth_and_needs_prefixes():
    parents, ordered = medusa.tree_parents([(1, 0), (0,), (1,), (0, 0), (0, 0, 2)])
    assert ordered == [(), (0,), (1,), (0, 0), (1, 0), (0, 0, 2)]
    assert parents == [-1, 0, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="lack their prefixes"):
        medusa.tree_parents([(0,), (1, 1)])


def test_choose_tree_takes_the_likeliest_paths():
    """Against brute force: every set of paths closed under prefixes, the one with the largest
    expected accepted length (the sum of the paths' probabilities)."""
    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.25], [0.4]]
    every = [p for d in (1, 2, 3) for p in itertools.product(*(range(len(a)) for a in accuracy[:d]))]

    def chance(path):
        return torch.tensor([accuracy[d][r] for d, r in enumerate(path)]).prod().item()
    for size in (1, 3, 5, 8):
        chosen = medusa.choose_tree(accuracy, size)
        best = max((s for s in itertools.combinations(every, size) if all(p[:-1] in s or len(p) == 1 for p in s)),
                   key=lambda s: sum(map(chance, s)))
        assert len(chosen) == size and all(p[:-1] in chosen or len(p) == 1 for p in chosen)
        assert sum(map(chance, chosen)) == pytest.approx(sum(map(chance, best)))


def test_rank_accuracy_from_top_k():
    shares = medusa.rank_accuracy({1: [0.5, 0.4], 2: [0.7, 0.5], 3: [0.75, 0.5]})
    assert torch.allclose(torch.tensor(shares), torch.tensor([[0.5, 0.2, 0.05], [0.4, 0.1, 0.0]]))
    with pytest.raises(ValueError, match="k = 1, 2"):
        medusa.rank_accuracy({1: [0.5], 3: [0.7]})


def test_rank_accuracy_refuses_top_k_accuracies_that_fall_and_choose_tree_percentages():
    with pytest.raises(ValueError, match=r"top-2 accuracy 0\.3 is below top-1 0\.5 at head 1: top-k accuracy "
                                         r"cannot fall as k grows"):
        medusa.rank_accuracy({1: [0.5], 2: [0.3]})  # else a share of -0.2
    with pytest.raises(ValueError, match=r"the top-1 accuracy of head 2 is 60: accuracies are probabilities in \[0, 1\]"):
        medusa.rank_accuracy({1: [0.5, 60], 2: [0.6, 80]})
    with pytest.raises(ValueError, match=r"top-2 accuracies are given for 1 heads, top-1 for 2"):
        medusa.rank_accuracy({1: [0.5, 0.4], 2: [0.6]})
    # measured accuracies: level as k grows (a share of 0), or a float rounding below, are not a fall
    shares = medusa.rank_accuracy({1: [0.5, 0.4], 2: [0.5, 0.4 - 1e-12], 3: [1.0, 0.4]})
    assert shares == [[0.5, 0.0, 0.5], [0.4, 0.0, pytest.approx(1e-12, abs=1e-11)]]
    assert min(min(head) for head in shares) >= 0
    with pytest.raises(ValueError, match=r"the accuracy of head 1, rank 0 is 60: accuracies are probabilities "
                                         r"in \[0, 1\]"):
        medusa.choose_tree([[60, 20], [50, 10]], 3)  # percentages: products past 1 pick another tree
    with pytest.raises(ValueError, match=r"the accuracy of head 2, rank 1 is -0\.1"):
        medusa.choose_tree([[0.6, 0.2], [0.5, -0.1]], 3)
    with pytest.raises(ValueError, match=r"the accuracy of head 1, rank 0 is '0\.6'"):
        medusa.choose_tree([["0.6", "0.2"]], 2)  # a string read from a file: not yet a number
    with pytest.raises(ValueError, match=r"size=2\.5 must be an int"):
        medusa.choose_tree([[0.6, 0.2]], 2.5)
    assert medusa.choose_tree([[0.6, 0.2], [0.5, 0.0]], 3) == [(0,), (0, 0), (1,)]
    assert medusa.choose_tree([[1.0 + 1e-9, 0.0]], 2) == [(0,), (1,)]  # float rounding past 1 is no percentage


# --- one verification pass ---------------------------------------------------------------------------

def test_a_planted_branch_is_found_and_the_cache_keeps_exactly_it():
    """A tree whose branch 0 -> 2 -> 5 -> 6 is the target's greedy text, among wrong siblings: one
    pass accepts that branch, the target's token after it is the next greedy token, each node's
    logits are those of its branch run alone, and after compaction the cache holds what running
    the accepted text alone would have written."""
    model = far_apart_model()
    prompt = [3, 14, 15, 9, 2]
    text = list(stream(model, prompt, replace(GREEDY, max_new_tokens=6)))
    wrong = [t for t in range(64) if t not in text][:4]
    parents = [-1, 0, 0, 1, 2, 2, 5, 3]
    tokens = [text[0], wrong[0], text[1], wrong[1], wrong[2], text[2], text[3], wrong[3]]
    cached = len(prompt)
    cache = ContiguousKVCache(model.config, 1, 32, model.dtype)
    forward_tokens(model, prompt, 0, cache)
    plan = tree_plan(cache, parents, cached)
    with torch.inference_mode():
        logits = model(torch.tensor([tokens]), plan=plan)[0]
    for node in range(len(parents)):
        branch = sorted(ancestors(parents, node))
        alone = forward_tokens(model, prompt + [tokens[n] for n in branch], 0, None)[-1]
        torch.testing.assert_close(logits[node], alone)
    path, token = walk(parents, tokens, logits, GREEDY)
    assert path == [2, 5, 6] and token == text[4]
    cache.compact([cached + n for n in [0, *path]], cached)
    fresh = ContiguousKVCache(model.config, 1, 32, model.dtype)
    forward_tokens(model, prompt + text[:4], 0, fresh)
    end = cached + 4
    torch.testing.assert_close(cache.k[:, :, :, :end], fresh.k[:, :, :, :end])
    torch.testing.assert_close(cache.v[:, :, :, :end], fresh.v[:, :, :, :end])


def test_a_tree_that_does_not_fit_the_cache_is_refused():
    model = far_apart_model()
    cache = ContiguousKVCache(model.config, 1, 8, model.dtype)
    with pytest.raises(ValueError, match="needs 9 slots"):
        tree_plan(cache, chain(3), 5)


# --- Medusa: greedy identity whatever the heads guess ------------------------------------------------

def oracle(reference: list[int], right: bool):
    """A stand-in for the heads' candidates that knows the greedy text: every candidate on the
    first branch is right (or, with ``right`` False, a token the text never holds). Under an
    oracle that is always right, round r starts after 1 + (r - 1) * (depth + 1) tokens."""
    never = next(t for t in range(10_000) if t not in reference)
    state = {"generated": 1}

    def candidates(target, heads, stream_, paths):
        start = state["generated"]
        out = [reference[start + len(p) - 1] if right and set(p) == {0} and start + len(p) - 1 < len(reference)
               else never for p in paths]
        state["generated"] += 1 + (sum(1 for p in paths if set(p) == {0}) if right else 0)
        return out
    return candidates


TREES = {"chain": medusa.chain_paths(3), "tree": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]}


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("guess", ["trained-like", "always right", "always wrong"])
def test_greedy_output_is_the_targets(tree, guess, monkeypatch):
    model = far_apart_model()
    prompt = [5, 1, 7, 7, 30]
    reference = list(stream(model, prompt, GREEDY))
    heads = ResidualHeads(model.config.d_model, 3).double()
    if guess == "trained-like":
        torch.manual_seed(0)
        for p in heads.parameters():
            torch.nn.init.normal_(p, std=0.3)
    else:
        monkeypatch.setattr(medusa, "_candidates", oracle(reference, guess == "always right"))
    stats = SpeculationStats(3)
    assert list(medusa.medusa_stream(model, heads, prompt, GREEDY, TREES[tree], stats=stats)) == reference
    assert stats.generated == len(reference)
    if guess == "always right":
        assert all(r.accepted == 3 for r in stats.rounds[1:-1])  # all but the prefill and the cut last round
        first = stats.rounds[1]  # the round's tree and the nodes it accepted: the first branch, all of it
        assert first.tree == tuple(medusa.tree_parents(TREES[tree])[0])
        assert [first.tree[n] for n in first.branch] == [0, *first.branch[:-1]] and len(first.branch) == 3
    if guess == "always wrong":
        assert stats.acceptance_rate == 0 and stats.tokens_per_call == 1


@pytest.mark.parametrize("seed", range(3))
def test_greedy_on_random_models_and_the_context_edge(seed):
    """Random models; generations that end at the context limit, where the tree is cut to fit."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, d_ff=64,
                                    max_seq_len=40)).double().eval()
    model.reset_parameters(std=0.3)
    heads = ResidualHeads(32, 3).double()
    prompt = [seed + 1, 4, 9]
    params = replace(GREEDY, max_new_tokens=model.config.max_seq_len - len(prompt) + 1)
    reference = list(stream(model, prompt, params))
    assert list(medusa.medusa_stream(model, heads, prompt, params, TREES["tree"])) == reference


def test_a_tree_cut_at_the_context_edge_keeps_its_accepted_branch(monkeypatch):
    """Right candidates up to the context limit: the last rounds verify a tree cut to the slots
    left, and their accepted branches (not only the root) must still give the target's text."""
    torch.manual_seed(3)
    model = Transformer(ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, d_ff=64,
                                    max_seq_len=30)).double().eval()
    model.reset_parameters(std=0.3)
    prompt = [2, 4, 9]
    params = replace(GREEDY, max_new_tokens=model.config.max_seq_len - len(prompt) + 1)
    reference = list(stream(model, prompt, params))
    monkeypatch.setattr(medusa, "_candidates", oracle(reference, True))
    wide = [(r,) for r in range(6)] + [(0, r) for r in range(4)] + [(0, 0, 0)]
    stats = SpeculationStats(3)
    assert list(medusa.medusa_stream(model, ResidualHeads(32, 3).double(), prompt, params, wide, stats=stats)) == reference
    cut = [r for r in stats.rounds[1:] if len(r.tree) < 12]
    assert cut and any(r.branch for r in cut)  # the edge was reached, and a cut tree accepted candidates


def test_greedy_medusa_on_the_shipped_target():
    target, tokenizer = labkit.load("target", device="cpu")
    heads = load_medusa(target)
    prompt = tokenizer.encode("def add(a, b):\n").ids
    reference = list(stream(target, prompt, GREEDY))
    for paths in (medusa.chain_paths(heads.n), [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)]):
        assert list(medusa.medusa_stream(target, heads, prompt, GREEDY, paths)) == reference


def test_the_calls_counted_from_one_pass_are_medusa_streams():
    """The heads' ranks teacher-forced on the target's own text give each tree's target calls, uncounted."""
    target, tokenizer = labkit.load("target", device="cpu")
    heads = load_medusa(target)
    prompt = tokenizer.encode("def read_config(path):\n").ids
    params = replace(GREEDY, max_new_tokens=40)
    out = list(stream(target, prompt, params))
    ranks = medusa.teacher_forced_ranks(target, heads, prompt + out, 10)
    for paths in (medusa.chain_paths(heads.n), [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]):
        stats = SpeculationStats(max(map(len, paths)))
        assert list(medusa.medusa_stream(target, heads, prompt, params, paths, stats=stats)) == out
        assert medusa.tree_calls(paths, ranks, len(prompt), 40) == len(stats.rounds) < 40
    nothing = medusa.Ranks([[-1] * len(found) for found in ranks.found], ranks.looked)
    assert medusa.tree_calls([(0,)], nothing, len(prompt), 40) == 40  # no right guess: one token a call
    with pytest.raises(ValueError, match="rank 10, but the ranks were found for 4 heads among 10"):
        medusa.tree_calls([(0,), (10,)], ranks, len(prompt), 40)  # a rank never looked at
    with pytest.raises(ValueError, match="must lie within the 48 tokens"):
        medusa.tree_calls([(0,)], ranks, len(prompt), 41)  # past the text the ranks were found on
    with pytest.raises(ValueError, match="each at least 1"):
        medusa.tree_calls([(0,)], ranks, 0, 40)
    with pytest.raises(ValueError, match="ranks=0"):
        medusa.teacher_forced_ranks(target, heads, prompt + out, 0)
    assert medusa.teacher_forced_ranks(target, heads, prompt[:3], 2).found[-1] == []  # shorter than the heads reach


def test_medusa_stops_at_eos_inside_an_accepted_branch(monkeypatch):
    model = far_apart_model()
    prompt = [5, 1, 7, 7, 30]
    reference = list(stream(model, prompt, GREEDY))
    eos = reference[3]
    monkeypatch.setattr(medusa, "_candidates", oracle(reference, True))
    params = replace(GREEDY, stop_at_eos=True)
    out = list(medusa.medusa_stream(model, ResidualHeads(32, 3).double(), prompt, params, TREES["chain"], eos_id=eos))
    assert out == reference[:reference.index(eos) + 1]


def test_bad_medusa_arguments_are_named():
    model = far_apart_model()
    heads = ResidualHeads(32, 2).double()
    with pytest.raises(ValueError, match="beyond the 2"):
        next(medusa.medusa_stream(model, heads, [1, 2], GREEDY, [(0,), (0, 0), (0, 0, 0)]))
    with pytest.raises(ValueError, match="SpeculationStats"):
        next(medusa.medusa_stream(model, heads, [1, 2], GREEDY, stats=SpeculationStats(5)))


# --- sampling: the target's distribution --------------------------------------------------------------

def eager_walk(parents, tokens, logits, params, generator=None):
    """A mistaken rule: take a candidate the target finds likely (p >= 0.25) without drawing."""
    kids = [[c for c in range(len(parents)) if parents[c] == n] for n in range(len(parents))]
    node, path = 0, []
    while True:
        probs = sampling_probs(logits[node], params)
        likely = [c for c in kids[node] if probs[tokens[c]] >= 0.25]
        if not likely:
            return path, int(torch.multinomial(probs, 1, generator=generator))
        node = likely[0]
        path.append(node)


@pytest.mark.parametrize("rule, passes", [("exact", True), ("eager", False)])
def test_sampled_medusa_output_has_the_targets_distribution(rule, passes, monkeypatch):
    """A vocabulary of 5 and heads that guess something: over 2000 seeds, the second and third
    tokens (drawn in the first tree round, the third either at an accepted node or in the next
    round) have the target's own filtered distribution (the first token summed out); a rule that
    accepts likely candidates without drawing fails the same test."""
    if rule == "eager":
        monkeypatch.setattr(medusa, "walk", lambda parents, *rest: (eager_walk if len(parents) > 1 else walk)(
            parents, *rest))
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=5, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32)
    target = Transformer(config).eval()
    target.reset_parameters(std=0.5)
    heads = ResidualHeads(16, 2)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    params = SamplingParams(max_new_tokens=3, temperature=1.5, top_k=3, stop_at_eos=False)
    prompt = [1, 3, 2, 1, 3]

    def probs(text):
        with torch.no_grad():
            return sampling_probs(target(torch.tensor([text]))[0, -1], params)
    exact = sum(probs(prompt)[a] * probs(prompt + [a])[:, None] * torch.stack([probs(prompt + [a, b]) for b in range(5)])
                for a in range(5)).flatten()
    counts = torch.zeros(25)
    for seed in range(2000):
        _, b, c = medusa.medusa_stream(target, heads, prompt, replace(params, seed=seed), [(0,), (1,), (0, 0)])
        counts[5 * b + c] += 1
    assert (chi_square_p(counts, exact) > 1e-3) == passes
