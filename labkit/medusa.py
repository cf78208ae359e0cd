"""Medusa: the target drafts for itself with a few extra heads, and checks a whole tree at once.

After a forward pass, the stream at the last position gives the target's next token through its
LM head. Medusa heads (``labkit.heads``: K residual blocks on that same stream, read by the
target's own norm and LM head) guess further: head i the token i steps after that next token.
No second model, no second KV cache, no second tokenizer: a few d_model x d_model weights.

A head's top-1 guess is often wrong where its top-3 holds the right token, so Medusa checks
several candidates per position. Each candidate continuation is a path of ranks, ``(r1, r2, ...)``:
head 1's r1-th choice, then head 2's r2-th choice, and so on. A set of such paths, each one's
prefix included, is a token tree (``labkit.tree``) whose root is the target's next token. The tree
is fixed in advance, chosen from the heads' measured accuracies (``choose_tree``): the paths most
likely to be accepted, as many as the verification pass can afford.

One round (``medusa_stream``): the heads read the last accepted stream; their candidates fill the
tree; ONE forward pass of the target over the tree's nodes (tree mask and positions) gives each
node's logits and stream; the target's own choices walk the tree (``tree.walk``); the accepted
branch's keys and values move to their positions (``ContiguousKVCache.compact``); the emitted
tokens are the branch and the target's token after it, and the stream at the branch's last node
feeds the next round's heads. Every emitted token is the target's own draw, so the output is the
target's exactly, greedy or sampled.
"""
from __future__ import annotations

import heapq
import time
from numbers import Real
from typing import Iterator, NamedTuple, Sequence

import torch
from tokenizers import Tokenizer
from torch import Tensor

from labkit.generate import SamplingParams, seeded_generator, sequence_length
from labkit.heads import ResidualHeads, continuation_examples, head_accuracy, head_logits, streams_at
from labkit.model import ContiguousKVCache, ContiguousPlan, Transformer
from labkit.speculative import Round, SpeculationStats, check_run, timed
from labkit.train import Distillation
from labkit.tree import check_tree, tree_plan, walk
from labkit.validate import check_ints

Path = tuple[int, ...]

# how far a measured accuracy may stray past [0, 1], or a top-k accuracy below the top-(k - 1), by float
# rounding alone before it is refused: head_accuracy's are counts over counts, but others may be sums of floats
ROUNDING = 1e-6


def _check_probability(value: object, where: str) -> None:
    """ValueError unless ``value`` is a number in [0, 1] (give or take ``ROUNDING``); ``where`` says
    which accuracy it is, for the message."""
    if isinstance(value, bool) or not isinstance(value, Real) or not -ROUNDING <= value <= 1 + ROUNDING:
        raise ValueError(f"{where} is {value!r}: accuracies are probabilities in [0, 1] (not percentages)")


def chain_paths(depth: int) -> list[Path]:
    """The chain of every head's top-1 guess: (0,), (0, 0), ... ``depth`` deep."""
    return [(0,) * d for d in range(1, depth + 1)]


def tree_parents(paths: Sequence[Path]) -> tuple[list[int], list[Path]]:
    """The tree's parent array and each node's path (the root's is ``()``), from paths of ranks.
    Nodes are ordered by depth, then by path, so parents come first; every path's prefixes must be
    among the paths."""
    ordered = [()] + sorted(set(map(tuple, paths)), key=lambda p: (len(p), p))
    if any(not path or min(path) < 0 for path in ordered[1:]):
        raise ValueError("a path is a non-empty tuple of ranks, each 0 (a head's top choice) or more")
    index = {path: i for i, path in enumerate(ordered)}
    missing = [path for path in ordered[1:] if path[:-1] not in index]
    if missing:
        raise ValueError(f"paths {missing[:3]} lack their prefixes {[p[:-1] for p in missing[:3]]}: "
                         "a node's parent must be in the tree too")
    return [-1] + [index[path[:-1]] for path in ordered[1:]], ordered


def choose_tree(accuracy: Sequence[Sequence[float]], size: int) -> list[Path]:
    """The ``size`` paths most likely to be accepted, best first, when head d's rank-r candidate is
    right with probability ``accuracy[d - 1][r]`` independently of the others: a path's chance is
    the product along it. Grown best-first from the root, so each path's prefix (at least as
    likely) is chosen before it; Medusa picks its sparse trees the same way. Accuracies are
    probabilities in [0, 1] (not percentages), as ``rank_accuracy`` gives them."""
    check_ints(size=size)
    if size < 1 or not accuracy or not all(accuracy):
        raise ValueError(f"need size >= 1 and accuracies for at least one head and rank, got size={size}")
    for d, head in enumerate(accuracy):
        for r, value in enumerate(head):
            _check_probability(value, f"the accuracy of head {d + 1}, rank {r}")
    chosen: list[Path] = []
    frontier = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0]))]
    heapq.heapify(frontier)
    while frontier and len(chosen) < size:
        negative, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < len(accuracy):
            for r, right in enumerate(accuracy[len(path)]):
                heapq.heappush(frontier, (negative * right, (*path, r)))
    return chosen


def head_topk(target: Transformer, heads: ResidualHeads, tokenizer: Tokenizer, prompts: int, new_tokens: int,
              ranks: int = 10, seed: int = 1) -> dict[int, list[float]]:
    """The heads' top-k accuracy on text the target writes itself, for k = 1..``ranks``: {k: per
    head}. The text: the target's greedy continuations (``new_tokens`` each) of ``prompts`` function
    openings from the validation split (the heads trained on the training split)."""
    layer, spec = target.config.n_layers, Distillation("target", new_tokens=new_tokens, held_out=prompts)
    data = continuation_examples(target, tokenizer, spec, seed, "validation", {layer: tuple(range(1, heads.n + 1))})
    return head_accuracy(target, heads, data[layer].streams[layer], data[layer].labels, topk=range(1, ranks + 1))


def rank_accuracy(topk: dict[int, list[float]]) -> list[list[float]]:
    """accuracy[d][r]: how often head d + 1's rank-r candidate (alone) is right, from top-k
    accuracies {k: per head} for k = 1, 2, ...: top-(r + 1) minus top-r. ``choose_tree`` reads it.
    Top-k accuracy may stay level as k grows (the k-th choice was never the right one), not fall: a
    fall of float rounding only (``ROUNDING``) counts as level, a share of 0."""
    ranks = sorted(topk)
    if not ranks or ranks != list(range(1, len(ranks) + 1)):
        raise ValueError(f"need top-k accuracies for k = 1, 2, ..., n; got k = {ranks}")
    heads = len(topk[1])
    for k in ranks:
        if len(topk[k]) != heads:
            raise ValueError(f"top-{k} accuracies are given for {len(topk[k])} heads, top-1 for {heads}: one per head")
        for d, value in enumerate(topk[k]):
            _check_probability(value, f"the top-{k} accuracy of head {d + 1}")
            if k > 1 and value < topk[k - 1][d] - ROUNDING:
                raise ValueError(f"top-{k} accuracy {value:g} is below top-{k - 1} {topk[k - 1][d]:g} at head "
                                 f"{d + 1}: top-k accuracy cannot fall as k grows")
    return [[max(topk[r][d] - (topk[r - 1][d] if r > 1 else 0.0), 0.0) for r in ranks] for d in range(heads)]


class Ranks(NamedTuple):
    """``found[d - 1][j]``: the rank of the right token among head d's ``looked`` likeliest candidates
    at position j (-1 where it is not among them), for ``tree_calls``."""
    found: list[list[int]]
    looked: int


def teacher_forced_ranks(target: Transformer, heads: ResidualHeads, text: Sequence[int], ranks: int) -> Ranks:
    """For each head d and each position j of ``text`` (the target's own greedy text, prompt
    included, with no eos inside), the rank among head d's ``ranks`` likeliest candidates at j of
    the token the target wrote d steps after its next one, ``text[j + 1 + d]``, from one plain pass.
    On greedy text a round's heads read the stream the target computes at the round's position, so
    these are the ranks its tree would find."""
    check_ints(ranks=ranks)
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: look at 1 or more candidates per head")
    ids = torch.tensor([list(text)], device=target.device)
    layers = target.config.n_layers
    with torch.inference_mode():
        stream = streams_at(target, ids, [layers])[layers][0]
        guesses = head_logits(target, heads, stream).topk(ranks, dim=-1).indices  # [K, positions, ranks]
    found = []
    for d in range(1, heads.n + 1):
        hit = guesses[d - 1, :max(len(text) - 1 - d, 0)] == ids[0, 1 + d:, None]
        found.append(torch.where(hit.any(-1), hit.int().argmax(-1), -1).tolist())
    return Ranks(found, ranks)


def tree_calls(paths: Sequence[Path], ranks: Ranks, prompt_length: int, new_tokens: int) -> int:
    """The target calls ``medusa_stream`` makes for ``new_tokens`` greedy tokens with the tree
    ``paths``, counted from ``teacher_forced_ranks`` of the prompt and those tokens, without running
    it: the prompt's pass (its one token), then a round per accepted branch, the deepest path of the
    tree that the ranks follow, and the target's token after it; near the end the tree is cut to the
    tokens left. It assumes the run stays clear of the model's context limit, where ``medusa_stream``
    also cuts the tree to the cache's free slots."""
    tree = set(tree_parents(paths)[1])
    depth, deepest_rank = max(map(len, tree)), max(max(path) for path in tree if path)
    if depth > len(ranks.found) or deepest_rank >= ranks.looked:
        raise ValueError(f"the tree reaches depth {depth} and rank {deepest_rank}, but the ranks were found for "
                         f"{len(ranks.found)} heads among {ranks.looked} candidates each")
    check_run(prompt_length, new_tokens, len(ranks.found[0]) + 2)
    calls = emitted = 1
    while emitted < new_tokens:
        at, branch = prompt_length + emitted - 2, ()  # the position whose stream the round's heads read
        for d in range(min(depth, new_tokens - emitted - 1)):
            if (*branch, ranks.found[d][at]) not in tree:
                break
            branch = (*branch, ranks.found[d][at])
        emitted, calls = emitted + len(branch) + 1, calls + 1
    return calls


def _candidates(target: Transformer, heads: ResidualHeads, stream: Tensor, paths: Sequence[Path]) -> list[int]:
    """Each non-root node's token: for path (r1, ..., rd), the rd-th choice of head d on ``stream``."""
    depth, widest = max(map(len, paths)), 1 + max(max(p) for p in paths)
    with torch.inference_mode():
        logits = head_logits(target, heads, stream)[:depth]  # [depth, vocab]: through the target's LM head
        top = logits.topk(widest, dim=-1).indices.tolist()
    return [top[len(path) - 1][path[-1]] for path in paths]


def _fit(parents: list[int], paths: list[Path], depth: int, nodes: int) -> tuple[list[int], list[Path]]:
    """The tree cut to ``depth`` levels and its first ``nodes`` nodes (near the end of the
    generation, or of the cache): still a tree, since parents come before their children."""
    keep = [i for i, path in enumerate(paths[:nodes]) if len(path) <= depth]
    where = {old: new for new, old in enumerate(keep)}
    return [where.get(parents[i], -1) for i in keep], [paths[i] for i in keep]


def medusa_stream(target: Transformer, heads: ResidualHeads, prompt: Sequence[int],
                  params: SamplingParams = SamplingParams(), paths: Sequence[Path] | None = None, *,
                  eos_id: int | None = None, stats: SpeculationStats | None = None) -> Iterator[int]:
    """Yield new token ids, each round's candidates from ``heads`` (on the target's last stream) in
    the token tree ``paths`` (default: the chain of every head's top-1 guess), verified by
    ``target`` in one forward pass. Greedy output equals ``generate.stream``'s token for token;
    sampled output has the target's distribution. ``stats``: ``SpeculationStats(depth of the tree)``;
    each round's draft is its accepted branch and, where the tree goes on, the first candidate after it."""
    parents, ordered = tree_parents(paths if paths is not None else chain_paths(heads.n))
    depth = max(check_tree(parents, max_depth=heads.n))
    stats = stats if stats is not None else SpeculationStats(depth)
    if stats.k != depth:
        raise ValueError(f"stats count rounds of k={stats.k} drafts, but the tree is {depth} deep: "
                         f"SpeculationStats({depth})")
    capacity = sequence_length(target, prompt, params, eos_id)
    cache = ContiguousKVCache(target.config, 1, min(capacity + len(parents), target.config.max_seq_len),
                              target.dtype, target.device)
    generator, start, sequence = seeded_generator(params, target.device), time.perf_counter(), list(prompt)
    positions = torch.arange(len(sequence), device=target.device)[None]
    x, logits = timed(stats, "target_s", target.device, lambda: _forward(target, cache.plan(positions), sequence))
    token = walk([-1], sequence[-1:], logits[-1:], params, generator)[1]  # the target's own next token
    stats.rounds.append(Round((), 0, token))
    stream, emitted = x[-1], [token]
    while True:
        stats.wall_s = time.perf_counter() - start
        for new in emitted:
            sequence.append(new)
            yield new
            if params.stop_at_eos and new == eos_id:
                return
        room = params.max_new_tokens - (len(sequence) - len(prompt))  # tokens still to come
        if room == 0:
            return
        cached = len(sequence) - 1  # all but the root, the last token
        tree, nodes = _fit(parents, ordered, room - 1, cache.max_len - cached)
        candidates = (timed(stats, "draft_s", target.device, lambda: _candidates(target, heads, stream, nodes[1:]))
                      if len(tree) > 1 else [])
        tokens = [sequence[-1], *candidates]
        x, logits = timed(stats, "target_s", target.device,
                           lambda: _forward(target, tree_plan(cache, tree, cached), tokens))
        branch, token = walk(tree, tokens, logits, params, generator)
        cache.compact([cached + node for node in (0, *branch)], cached)
        stats.rounds.append(Round(_drafted(tree, tokens, branch), len(branch), token, tuple(tree), tuple(branch)))
        stream, emitted = x[branch[-1] if branch else 0], [*(tokens[node] for node in branch), token]


def _forward(target: Transformer, plan: ContiguousPlan, tokens: list[int]) -> tuple[Tensor, Tensor]:
    """One forward pass of ``tokens`` (a sequence's, or a tree's nodes) through the cache as
    ``plan`` says: each token's final stream ``[N, d_model]`` and logits ``[N, vocab]``."""
    with torch.inference_mode():
        x = target.layers(target.embed(torch.tensor([tokens], device=target.device)), plan.positions, plan)[0]
        return x, target.head(x)


def _drafted(parents: list[int], tokens: list[int], branch: list[int]) -> tuple[int, ...]:
    """What the round tried, in lab 05's terms: the accepted branch and, where the tree goes on
    below its last node, that node's first child (the candidate that was checked and refused)."""
    last = branch[-1] if branch else 0
    after = next((node for node, parent in enumerate(parents) if parent == last), None)
    return tuple(tokens[n] for n in [*branch, *([after] if after is not None else [])])
