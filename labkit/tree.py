"""Token trees for speculative decoding: many candidate continuations checked in ONE forward pass.

A drafter that offers several candidates per position (Medusa's heads give a top-k each) makes a
tree rather than a chain. Node 0 is the root: the last token of the text, not yet in the KV cache.
Every other node is a candidate token whose parent is the node it would follow; ``parents[i]`` is
the parent of node i (``parents[0] == -1``), and a parent always comes before its children.

One forward pass runs all the nodes at once, after the cached text (``start`` tokens):
- node i sits at position ``start + depth(i)``: siblings share a position, each one a guess for it;
- node i attends to the cached text, to itself and to its ancestors, never to a sibling or a cousin
  (``tree_mask``), so its logits are exactly those the text along its branch would give;
- its key and value go to cache slot ``start + i`` (scratch: slot = node, not position).

Walking the tree from the root with the target's own choices (``walk``) keeps the longest branch
the target agrees with; ``ContiguousKVCache.compact`` then moves that branch's keys and values to
the slots of its positions and the rest is overwritten later. A chain (``chain(k)``) is the tree of
lab 05: one candidate per position.

The rule at each node: draw the target's token there (its argmax when greedy, a sample from its
distribution otherwise); if a child holds that token, move to the child and go on; otherwise emit
the drawn token and stop. Every emitted token is the target's own draw, so the output is exactly
the target's, greedy or sampled (candidates from top-k are certain proposals: with a one-hot q,
lab 05's rule min(1, p/q) and its residual come to the same thing).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from labkit.answers import answer_to
from labkit.generate import SamplingParams, sampling_probs
from labkit.model import ContiguousKVCache, ContiguousPlan
from labkit.validate import is_int


@answer_to("ex11.1")
def check_tree(parents: Sequence[int], max_depth: int | None = None) -> list[int]:
    """The depth of each node, after checking that ``parents`` is a tree rooted at node 0 whose
    parents come before their children, at most ``max_depth`` deep (e.g. the number of heads)."""
    if len(parents) == 0 or parents[0] != -1:
        raise ValueError(f"node 0 is the root: parents[0] must be -1, got {list(parents[:1])}")
    depths = [0]
    for node, parent in enumerate(parents[1:], start=1):
        if not is_int(parent) or not 0 <= parent < len(parents):
            raise ValueError(f"node {node}'s parent {parent!r} is not a node (0..{len(parents) - 1}): only the "
                             "root has parent -1")
        if parent >= node:
            kind = "a cycle" if _on_cycle(parents, node) else "a parent after its child"
            raise ValueError(f"{kind}: node {node}'s parent is node {parent}; list each parent before its children")
        depths.append(depths[parent] + 1)
        if max_depth is not None and depths[-1] > max_depth:
            raise ValueError(f"node {node} is at depth {depths[-1]}, beyond the {max_depth} the drafter predicts")
    return depths


def _on_cycle(parents: Sequence[int], node: int) -> bool:
    """Whether following parents from ``node`` comes back to it (before leaving the list)."""
    seen, here = set(), node
    while 0 <= here < len(parents) and here not in seen:
        seen.add(here)
        here = parents[here]
    return here == node


def chain(k: int) -> list[int]:
    """The parents of a chain: the root and k candidates, each following the one before."""
    return [-1, *range(k)]


@answer_to("ex11.1")
def tree_mask(parents: Sequence[int]) -> Tensor:
    """``[N, N]`` bool: node i may attend to node j when j is i or one of its ancestors."""
    check_tree(parents)
    mask = torch.eye(len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents[1:], start=1):
        mask[node] |= mask[parent]  # the parent's ancestors, already complete: parents come first
    return mask


@answer_to("ex11.1")
def tree_positions(parents: Sequence[int], start: int) -> Tensor:
    """``[N]`` positions: the root at ``start``, each node one past its parent."""
    return start + torch.tensor(check_tree(parents))


def tree_plan(cache: ContiguousKVCache, parents: Sequence[int], start: int) -> ContiguousPlan:
    """The plan of one forward pass over a tree's nodes (batch 1) after ``start`` cached tokens:
    node i at position start + depth(i), its key and value in slot start + i, seeing the cached
    text and its own branch."""
    nodes = len(parents)
    if start + nodes > cache.max_len:
        raise ValueError(f"a tree of {nodes} nodes after {start} cached tokens needs {start + nodes} slots; "
                         f"the cache has {cache.max_len}")
    positions = tree_positions(parents, start).to(cache.k.device)[None]
    mask = torch.cat([torch.ones(nodes, start, dtype=torch.bool), tree_mask(parents)], dim=1)
    return ContiguousPlan(cache, positions, 0, slice(None), slice(start, start + nodes), start + nodes,
                          mask[None, None].to(cache.k.device))


def children(parents: Sequence[int]) -> list[list[int]]:
    """The children of each node, in order."""
    kids: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        kids[parent].append(node)
    return kids


@answer_to("ex11.2")
def walk(parents: Sequence[int], tokens: Sequence[int], logits: Tensor, params: SamplingParams,
         generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """The accepted branch (node indices after the root, in order) and the target's token after it.
    ``tokens[i]`` is node i's token and ``logits[i]`` the target's logits there. At each node the
    target draws its token (argmax when greedy); a child holding it is accepted, else the walk stops."""
    kids, node, path = children(parents), 0, []
    while True:
        if params.temperature == 0:
            token = int(logits[node].argmax())
        else:
            token = int(torch.multinomial(sampling_probs(logits[node], params), 1, generator=generator))
        node = next((child for child in kids[node] if tokens[child] == token), None)
        if node is None:
            return path, token
        path.append(node)


@answer_to("ex11.3")
def expected_accepted(parents: Sequence[int], accept: Sequence[float]) -> float:
    """The expected number of accepted nodes when node i is accepted with probability ``accept[i]``
    once its parent is (the root's entry is ignored): each node counts with the product of its
    own and its ancestors' probabilities. Siblings hold different tokens, so at most one of them
    is accepted; their probabilities must add up to at most 1."""
    check_tree(parents)
    if len(accept) != len(parents):
        raise ValueError(f"one acceptance probability per node: {len(accept)} for {len(parents)} nodes")
    for node, kids in enumerate(children(parents)):
        if sum(accept[kid] for kid in kids) > 1 + 1e-9:
            raise ValueError(f"node {node}'s children {kids} are accepted with probabilities adding up to "
                             f"{sum(accept[kid] for kid in kids):.3f} > 1: siblings exclude each other")
    return sum(reach(parents, accept)[1:])


@answer_to("ex11.3")
def reach(parents: Sequence[int], accept: Sequence[float]) -> list[float]:
    """The chance that node i is accepted, ``accept[i]`` times its ancestors' (the root's is 1)."""
    chance = [1.0] * len(parents)
    for node, parent in enumerate(parents[1:], start=1):
        chance[node] = chance[parent] * accept[node]
    return chance
