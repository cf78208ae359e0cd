"""Notebook 11 (speculation without a draft model): a token tree's attention mask and positions, the branch
the target accepts in a verified tree and the cache entries to keep, and the expected accepted length of a
tree. The specs, as a student reads them:

A tree is given by ``parents``: node 0 is the root (the last token of the text, not yet in the KV cache),
``parents[0] == -1``, ``parents[i]`` is node i's parent, and a parent comes before its children. Siblings
hold different tokens.

ex11.1  ``tree_mask_and_positions(parents, start) -> (mask, positions)``
    The tree verified in one forward pass after ``start`` cached tokens: ``mask`` bool ``[N, N]``, mask[i, j]
    True when node j is node i itself or one of its ancestors (row i: what node i sees); ``positions`` int64
    ``[N]``, node i at start + depth(i), the root at depth 0. Checked against ``tree.tree_mask`` and
    ``tree.tree_positions``; a wrong mask or positions that are a known mistake (only the parent, no
    diagonal, the transpose, the inverse, a chain's causal mask; start + node number, the root at depth 1)
    are named.

ex11.2  ``accept_branch(parents, tokens, choices, start) -> (branch, next_token, keep)``
    Greedy verification of a tree: ``tokens[i]`` is node i's token, ``choices[i]`` the target's greedy
    token after node i (the argmax of its logits at node i). From the root, accept the child of the current
    node whose token is the target's choice at the current node, and go on from it; stop where no child holds
    it. ``branch``: the accepted nodes after the root, in order (a list of ints); ``next_token``: the target's
    choice at the branch's last node (the root's when nothing is accepted); ``keep``: the cache slots of the
    root and of the branch's nodes, start + node, in order: what ``ContiguousKVCache.compact`` is given.
    Checked against ``tree.walk`` (greedy, with one-hot logits); known mistakes are named.

ex11.3  ``expected_accepted_length(parents, accept) -> (accepted, tokens_per_call)``
    ``accept[i]``: the probability that node i is accepted once its parent is (``accept[0]``, the root's, is
    1.0: the root is not a candidate). ``accepted``: the expected number of accepted nodes, the sum over the
    nodes after the root of the product of ``accept`` along the path from the root to the node (the node's
    own included); ``tokens_per_call``: the tokens one target call emits on average, the accepted ones and
    the target's own token after them. Checked against ``tree.expected_accepted``; known mistakes are named.

The references are labkit.tree's; the tests check those against loops (every node's ancestors, every
branch tried, every outcome of the walk enumerated).
"""
from __future__ import annotations

import numbers
import operator
from itertools import accumulate
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from labkit.exercises.spec import (Case, Exercise, JudgedCase, SaysWhatToDo, WrongType, _short, int_list, items_of,
                                   number_of)
from labkit.generate import SamplingParams
from labkit.tree import check_tree, children, expected_accepted, reach, tree_mask, tree_positions, walk


# ex11.1 ------------------------------------------------------------------------------------------


def _sees(mask: Tensor, node: int) -> list[int]:
    return mask[node].nonzero().flatten().tolist()


def _mask_mistakes(parents: Sequence[int]) -> list[tuple[Tensor, str]]:
    """The masks that known slips give, each with what it means; the first that matches is named."""
    n = len(parents)
    right, eye = tree_mask(parents), torch.eye(n, dtype=torch.bool)
    parent_only = eye.clone()
    for node, parent in enumerate(parents[1:], start=1):
        parent_only[node, parent] = True
    ancestors_only = ("it must see its parent's parent too, and so on up to the root, for its logits must be "
                      "those the text along its whole branch gives")
    no_root, no_root_but_itself = right.clone(), right.clone()
    no_root[:, 0] = False
    no_root_but_itself[1:, 0] = False
    root_missing = ("the root (node 0) is the text's last token, not yet in the cache: it is written by this pass, "
                    "and every branch goes on from it, so every node sees it (column 0 all True, the root itself "
                    "included). Follow the parents until -1, not until 0")
    return [
        (~right, "this mask is inverted: True where node i may NOT see node j (the convention of a bool attn_mask in "
                 "nn.MultiheadAttention); here True means node i sees node j: itself and its ancestors"),
        (right.T, "this mask is transposed: row i says which nodes see node i (its descendants). Row i is node "
                  "i's query, column j the key it may read: mask[i, j] is True when j is i or an ancestor of i"),
        (right & ~eye, "no node sees itself: the diagonal must be True, for a token attends to its own key and "
                       "value, as in a causal mask"),
        (right.T & ~eye, "this mask is transposed (row i: the nodes that see node i) and has no diagonal: mask[i, j] "
                         "is True when j is i or an ancestor of i"),
        (parent_only, f"each node sees itself and its parent only; {ancestors_only}"),
        (parent_only & ~eye, f"each node sees its parent only; it must see itself (the diagonal), and "
                             f"{ancestors_only}"),
        (torch.ones(n, n, dtype=torch.bool).tril(), "this is a chain's causal mask: node i sees every node before it, "
                                                     "siblings and cousins too, candidates that are not on its branch; "
                                                     "it may see only itself and its ancestors"),
        (right | right.T, "node i sees its descendants as well as its ancestors; a node's descendants come after it "
                          "in the text, so only itself and its ancestors"),
        (no_root, f"no node sees the root: {root_missing}"),
        (no_root_but_itself, f"no node but the root itself sees the root: {root_missing}"),
    ]


def _shaped(value: Any, shape: tuple[int, ...]) -> bool:
    return isinstance(value, Tensor) and tuple(value.shape) == shape


def _tree_judge(parents: Sequence[int], start: int) -> Callable[[Any], None]:
    n = len(parents)
    right_mask, right_positions = tree_mask(parents), tree_positions(parents, start)
    depth = right_positions - start
    position_mistakes = [
        (start + torch.arange(n), "these are start + the node's number, as in a chain; in a tree, siblings are "
                                  "guesses for the same place in the text and share a position: start + depth"),
        (right_positions + 1, "the root is at depth 0, position start (the cached tokens hold 0 .. start - 1, the "
                              "root comes right after them), each node one past its parent"),
        (depth, "these are the depths; each is after the start cached tokens: start + depth"),
    ]

    def judge(got: Any) -> None:
        mask, positions = items_of(got, ("mask", "positions"))
        if _shaped(mask, (n,)) and _shaped(positions, (n, n)):
            raise SaysWhatToDo(f"the two items are swapped: a tensor of shape [{n}] first, then one of [{n}, {n}]; "
                               "return (mask, positions), the mask first")
        if int_list(positions) == right_positions.tolist() and not isinstance(positions, Tensor):
            raise WrongType(f"positions: the values are right, but a {type(positions).__name__}: return an int64 "
                            "tensor (torch.tensor(..., dtype=torch.long)), which the rotary embedding indexes with")
        if not isinstance(mask, Tensor) or tuple(mask.shape) != (n, n):
            raise AssertionError(f"mask: expected a bool tensor of shape [{n}, {n}], got {_short(mask)}")
        if not isinstance(positions, Tensor) or tuple(positions.shape) != (n,):
            raise AssertionError(f"positions: expected an int64 tensor of shape [{n}], got {_short(positions)}")
        if mask.is_floating_point() and bool(torch.isinf(mask).any()):
            raise AssertionError("mask: this is an additive mask, 0 where a node may look and -inf where it may not; "
                                 "the spec asks for a bool mask, True where node i may see node j")
        if not torch.equal(mask.cpu().bool(), right_mask):
            mask = mask.cpu().bool()
            why = ". Or, the same mask for this tree: ".join(text for wrong, text in _mask_mistakes(parents)
                                                               if torch.equal(mask, wrong))
            node = next(i for i in range(n) if not torch.equal(mask[i], right_mask[i]))
            row = (f"row {node} (what node {node} sees) should be nodes {_sees(right_mask, node)}, got "
                   f"{_sees(mask, node)}")
            raise AssertionError(f"mask: {row}" + (f": {why}" if why else ""))
        if mask.dtype != torch.bool:
            raise WrongType(f"mask: the values are right, but the mask is {mask.dtype}; attention takes a bool "
                                 "mask (.bool(), or torch.zeros(N, N, dtype=torch.bool) to start from)")
        if not torch.equal(positions.cpu().double(), right_positions.double()):
            why = next((text for wrong, text in position_mistakes
                        if torch.equal(positions.cpu().double(), wrong.double())), None)
            raise AssertionError(f"positions: expected {right_positions.tolist()}, got {positions.tolist()}"
                                 + (f": {why}" if why else ""))
        if positions.dtype != torch.long:
            raise WrongType(f"positions: the values are right, but of {positions.dtype}; positions are int64 "
                                 "(torch.long): the rotary embedding looks them up")
    return judge


def _tree_cases() -> list[Case]:
    trees = [
        ("a chain of 3 candidates after 5 cached tokens", [-1, 0, 1, 2], 5,
         "a chain is the tree of lab 05: each candidate follows the one before, so node i sees nodes 0 .. i and "
         "sits at position start + i. mask[i, j] is True when j is i or an ancestor of i: itself, its parent, its "
         "parent's parent, up to the root"),
        ("two candidates for the next token, each with a child", [-1, 0, 0, 1, 2], 3,
         "nodes 1 and 2 are two guesses for the same token: both at depth 1, position start + 1, and neither sees "
         "the other. Node 3 (under 1) sees 3, 1 and 0, never node 2 or its child 4"),
        ("a Medusa tree of 8 nodes, 3 deep", [-1, 0, 0, 0, 1, 1, 2, 4], 10,
         "three guesses at depth 1, three at depth 2, one at depth 3 (node 7, whose branch is 0, 1, 4, 7): each "
         "node sees its whole branch up to the root and nothing else"),
        ("just the root: nothing drafted", [-1], 7,
         "a tree of one node: the root sees itself, mask [[True]], at position start"),
        ("12 nodes in a random tree, after an empty cache (start 0)", [-1, 0, 1, 0, 2, 3, 3, 4, 0, 8, 6, 9], 0,
         "a deeper tree whose node numbers do not follow depth (node 8 is at depth 1): a node's depth is its "
         "parent's plus one; with start 0 a position is the depth itself"),
    ]
    return [JudgedCase(f"{label}: parents {parents}, start {start}", (parents, start),
                       judge=_tree_judge(parents, start), unchanged=True, hint=hint)
            for label, parents, start, hint in trees]


# ex11.2 ------------------------------------------------------------------------------------------


def reference_branch(parents: Sequence[int], tokens: Sequence[int], choices: Sequence[int], start: int
                     ) -> tuple[list[int], int, list[int]]:
    """labkit's answer: ``tree.walk``, greedy, on logits whose argmax at node i is ``choices[i]``."""
    logits = F.one_hot(torch.tensor(choices), max([*tokens, *choices]) + 1).float()
    branch, token = walk(parents, tokens, logits, SamplingParams())
    return branch, token, [start + node for node in (0, *branch)]


def _walk_with(matches: Callable[[int, int], bool], candidates: Callable[[int], list[int]]) -> list[int]:
    """The branch a walk takes when the candidates after ``node`` are ``candidates(node)`` and ``matches(node,
    child)`` says whether one is accepted."""
    branch, node = [], 0
    while (child := next((c for c in candidates(node) if matches(node, c)), None)) is not None:
        branch.append(child)
        node = child
    return branch


def _branch_judge(parents: Sequence[int], tokens: Sequence[int], choices: Sequence[int], start: int
                  ) -> Callable[[Any], None]:
    branch, token, keep = reference_branch(parents, tokens, choices, start)
    kids, depth = children(parents), check_tree(parents)
    last = branch[-1] if branch else 0
    by_choice = lambda node, child: tokens[child] == choices[node]
    branch_mistakes = [
        (_walk_with(by_choice, lambda node: kids[node][:1]),
         "that is what trying only the first child of each node gives: any child may hold the target's token "
         "(each is a different guess), so look through all of the current node's children"),
        (_walk_with(by_choice, lambda node: [c for c in range(1, len(parents)) if depth[c] == depth[node] + 1]),
         "that is what taking any node one level deeper gives: a node that holds the target's token but hangs "
         "under another parent (a cousin) follows a different text, which the target did not write; only the "
         "current node's children are candidates"),
        (_walk_with(lambda node, child: tokens[child] == choices[child], lambda node: kids[node]),
         "that is what comparing with choices[child] gives, the target's token AFTER the child; whether a child is "
         "accepted is decided at its parent: tokens[child] == choices[parent]"),
        ([0, *branch], "the root is not part of the branch: it is the last token of the text already; the branch "
                       "holds the nodes accepted after it"),
        ([tokens[node] for node in branch], "these are the accepted tokens; branch holds the nodes (numbers into "
                                            "parents), whose tokens are tokens[node]"),
    ]
    keep_mistakes = [
        ([start + node for node in branch], f"the root's slot, start + 0 = {start}, is missing: the root's key and "
                                            "value were written by this pass too (the root was not cached), and they "
                                            "stay"),
        (list(range(start, start + len(branch) + 1)), "these are the positions the kept entries move TO (start, "
                                                      "start + 1, ...); compact needs the slots they are IN: node n's "
                                                      "key and value were written to slot start + n"),
        ([0, *branch], "these are node numbers; the slots count from the start of the cache: node n's key and value "
                       "sit in slot start + n"),
        *(([start + shift + node for node in (0, *branch)], "each slot is one off: the start cached tokens fill slots "
                                                            "0 .. start - 1, so the pass wrote node 0 (the root) to "
                                                            "slot start, node n to start + n") for shift in (1, -1)),
    ]

    def judge(got: Any) -> None:
        got_branch, got_token, got_keep = items_of(got, ("branch", "next_token", "keep"))
        _check_int_list("branch", "the accepted nodes", got_branch, branch, branch_mistakes)
        if isinstance(got_token, Tensor) and got_token.numel() == 1 and got_token.item() == token:
            raise WrongType(f"next_token: the value is right ({token}), but a tensor: return an int (.item())")
        if not isinstance(got_token, numbers.Integral) or isinstance(got_token, bool):
            raise AssertionError(f"next_token: expected an int, got {_short(got_token)}")
        if got_token != token:
            if branch and got_token == tokens[last]:
                why = (f"{got_token} is the token of node {last}, the branch's last node, already emitted with the "
                       f"branch; the token after it is the target's own choice there, choices[{last}]")
            elif not branch and got_token == tokens[0]:
                why = ("that is the root's token, the last token of the text; with nothing accepted the next token "
                       "is the target's choice at the root, choices[0]")
            else:
                why = f"the target's choice at the branch's last node, choices[{last}]"
            raise AssertionError(f"next_token: expected {token}, got {got_token}: {why}")
        _check_int_list("keep", "the cache slots to keep", got_keep, keep, keep_mistakes)
    return judge


def _check_int_list(name: str, what: str, got: Any, want: list[int], mistakes: list[tuple[list[int], str]]) -> None:
    """``got`` must be the list of ints ``want``; a known wrong answer in ``mistakes`` names its mistake."""
    as_list = int_list(got)
    if as_list is None:
        raise AssertionError(f"{name}: expected a list of ints, {what}, got {_short(got)}")
    if as_list != want:
        why = next((text for wrong, text in mistakes if as_list == wrong), None)
        raise AssertionError(f"{name}: expected {want}, got {as_list}" + (f": {why}" if why else ""))


def _branch_cases() -> list[Case]:
    rounds = [
        ("a chain, every candidate accepted", [-1, 0, 1, 2], [7, 3, 5, 2], [3, 5, 2, 9], 4,
         "each candidate holds the target's choice at its parent (tokens[1] = choices[0] = 3, tokens[2] = "
         "choices[1] = 5, tokens[3] = choices[2] = 2), so all three are accepted and the next token is the target's "
         "choice after the last, choices[3] = 9. The slots to keep: the root's and the branch's, start + node"),
        ("a chain, the second candidate refused", [-1, 0, 1, 2], [7, 3, 4, 2], [3, 5, 2, 9], 4,
         "node 2 holds 4 where the target wrote choices[1] = 5: the walk stops at node 1 and the next token is the "
         "target's 5 (node 3's token equals choices[2], but node 2 was refused, so nothing under it counts). keep "
         "holds the slots of the root and of the accepted nodes only, not of the refused node 2"),
        ("the target takes the second of two guesses", [-1, 0, 0, 1, 2], [7, 3, 6, 5, 1], [6, 5, 1, 8, 4], 10,
         "the root's children are nodes 1 (token 3) and 2 (token 6); the target chose 6, so node 2 is accepted, then "
         "node 4, its child holding choices[2] = 1. Node 4's key and value sit in slot start + 4, though its place "
         "in the text is start + 2"),
        ("a cousin holds the target's token", [-1, 0, 0, 1, 2], [7, 3, 6, 5, 1], [3, 1, 5, 8, 4], 10,
         "node 1 is accepted; the target's choice after it is 1, which node 4 holds, but node 4 hangs under node 2, "
         "not node 1: the walk stops at node 1, and the next token is the target's 1"),
        ("nothing accepted: the target's own token only", [-1, 0, 0], [7, 3, 6], [5, 2, 2], 6,
         "neither child holds the target's choice at the root, 5: the branch is empty, the next token is 5, and the "
         "root's slot is still kept, for its key and value were written by this pass"),
        ("a Medusa tree of 10 nodes, three accepted", [-1, 0, 0, 0, 1, 1, 2, 4, 5, 7],
         [7, 12, 30, 8, 5, 17, 5, 21, 40, 3], [12, 17, 5, 9, 21, 40, 3, 3, 2, 11], 20,
         "the branch is 0, 1, 5, 8: node 5 is node 1's second child, node 8 its child; node 8 has no child, so the "
         "next token is choices[8]"),
        ("the target writes the root's token again after the branch", [-1, 0, 1], [7, 3, 5], [3, 5, 7], 8,
         "both candidates are accepted, and then the target repeats the root's token, 7 (text repeats). The root is "
         "no node's child: list children for nodes 1 .. n - 1 only (parents[0] is -1, and kids[-1] would make the "
         "root the last node's child, so that the walk goes round for ever)"),
        ("just the root: no candidates this round", [-1], [7], [4], 3,
         "a tree of one node (near the end of the cache): no child to accept, the next token is choices[0], and "
         "the root's slot is kept"),
    ]
    return [JudgedCase(f"{label}: parents {parents}, tokens {tokens}, choices {choices}, start {start}",
                       (parents, tokens, choices, start), judge=_branch_judge(parents, tokens, choices, start),
                       unchanged=True, hint=hint, within_s=5.0)  # a walk that goes round is stopped
            for label, parents, tokens, choices, start, hint in rounds]


# ex11.3 ------------------------------------------------------------------------------------------


def _branches(parents: Sequence[int]) -> list[list[int]]:
    """Every path from the root to a leaf, the root left out."""
    kids = children(parents)
    paths, stack = [], [(0, [])]
    while stack:
        node, path = stack.pop()
        if not kids[node] and path:
            paths.append(path)
        stack += [(kid, [*path, kid]) for kid in kids[node]]
    return paths


def _gain_judge(parents: Sequence[int], accept: Sequence[float]) -> Callable[[Any], None]:
    accepted = expected_accepted(parents, accept)
    chance = reach(parents, accept)
    per_branch = [sum(chance[node] for node in path) for path in _branches(parents)] or [0.0]
    mistakes = [
        (sum(accept[1:]), "that is the sum of the probabilities, as if each node were tried on its own; a node is "
                          "accepted only when its parent was, and its parent's parent, ...: multiply along the path"),
        (sum(accept[parent] * accept[node] for node, parent in enumerate(parents[1:], start=1)),
         "that multiplies a node's probability by its parent's only; the parent itself needed its own parent, "
         "and so on: the product runs over every node on the path from the root"),
        (accepted + 1, "the root is counted: it is the last token of the text, already there, not a candidate; "
                       "sum over the nodes after it"),
        (max(per_branch), "that is the expected length of the best single branch; the target may take any branch, "
                          "and each node adds its own chance of being accepted: sum over all the nodes"),
        (sum(chance[parent] for parent in parents[1:]), "each node counts with its ancestors' probabilities but not "
                                                       "its own; it must be accepted itself too"),
        (sum(accumulate(accept[1:], operator.mul)),
         "that multiplies along the node numbers, node i after node i - 1, as in a chain; node i's path runs through "
         "its parent, parents[i], and the parent's parent, up to the root"),
        (sum(chance[path[-1]] for path in _branches(parents)),
         "that counts the leaves alone, the chance that a whole branch is accepted; a walk that stops halfway down "
         "still yields the nodes it accepted: add every node's chance"),
    ]

    def judge(got: Any) -> None:
        got_accepted, got_tokens = items_of(got, ("accepted", "tokens_per_call"))
        value, tokens = number_of(got_accepted, "accepted"), number_of(got_tokens, "tokens_per_call")
        close = lambda a, b: abs(a - b) <= 1e-9 + 1e-6 * abs(b)
        if close(value, accepted + 1) and close(tokens, accepted):
            raise SaysWhatToDo(f"the two numbers are swapped: {value:.6g} is the tokens per call and {tokens:.6g} the "
                               "accepted nodes; return (accepted, tokens_per_call), the accepted nodes first")
        if not close(value, accepted):
            why = next((text for wrong, text in mistakes if close(value, wrong)), None)
            raise AssertionError(f"accepted: expected {accepted:.6g}, got {value:.6g}" + (f": {why}" if why else ""))
        if not close(tokens, accepted + 1):
            why = ("that is the accepted nodes alone; each target call also emits its own token after them (the "
                   "bonus): + 1" if close(tokens, accepted) else "the accepted nodes and the target's own token "
                                                                  "after them")
            raise AssertionError(f"tokens_per_call: expected {accepted + 1:.6g}, got {tokens:.6g}: {why}")
    return judge


def _gain_cases() -> list[Case]:
    trees = [
        ("one candidate, accepted 70% of the time", [-1, 0], [1.0, 0.7],
         "one candidate, accepted with probability 0.7: 0.7 accepted nodes on average, and each target call emits "
         "them plus its own token after them. The root (accept[0] = 1.0) is the text's last token, not a candidate"),
        ("a chain of three, each accepted half the time once its parent is", [-1, 0, 1, 2], [1.0, 0.5, 0.5, 0.5],
         "node 2 is accepted only when node 1 was (0.5) and then with probability 0.5: 0.25; node 3 needs nodes 1 "
         "and 2 too: 0.125. Expected accepted: 0.5 + 0.25 + 0.125"),
        ("two guesses for the next token", [-1, 0, 0], [1.0, 0.6, 0.3],
         "siblings hold different tokens, so at most one is accepted: node 1 with 0.6, node 2 with 0.3, together "
         "0.9 expected, more than either alone"),
        ("a Medusa tree of 7 nodes", [-1, 0, 0, 1, 1, 2, 3], [1.0, 0.5, 0.3, 0.4, 0.2, 0.9, 0.7],
         "each node counts with the product of accept along its path from the root: node 6 (path 1, 3, 6) with "
         "0.5 * 0.4 * 0.7; add every node's, not the best branch's alone"),
        ("just the root: nothing drafted", [-1], [1.0],
         "no candidate: nothing accepted, and the call still emits the target's own token"),
        ("a chain of four that is always right", [-1, 0, 1, 2, 3], [1.0, 1.0, 1.0, 1.0, 1.0],
         "every candidate accepted: all four, and the target's token after them"),
    ]
    return [JudgedCase(f"{label}: parents {parents}, accept {accept}", (parents, accept),
                       judge=_gain_judge(parents, accept), unchanged=True, hint=hint)
            for label, parents, accept, hint in trees]


EXERCISES = [
    Exercise(
        id="ex11.1", title="The tree attention mask and tree positions", points=2,
        function="tree_mask_and_positions", cases=_tree_cases, returns=("mask", "positions"), timeout_s=30,
        recipe="n = len(parents); mask = torch.zeros(n, n, dtype=torch.bool); depth = [0] * n. For each node i: "
               "j = i; while j != -1: mask[i, j] = True; j = parents[j] (itself, then each ancestor up to the "
               "root). For i >= 1: depth[i] = depth[parents[i]] + 1 (parents come first, so theirs is known). "
               "Return mask, start + torch.tensor(depth).",
    ),
    Exercise(
        id="ex11.2", title="The accepted branch of a verified tree, and the cache slots to keep", points=2,
        function="accept_branch", cases=_branch_cases, returns=("branch", "next_token", "keep"), timeout_s=30,
        recipe="branch = []; node = 0. Repeat: among the nodes c with parents[c] == node, find one with tokens[c] "
               "== choices[node]; if there is one, append c to branch and set node = c; otherwise stop. Return "
               "branch, choices[node], [start + n for n in [0] + branch].",
    ),
    Exercise(
        id="ex11.3", title="The expected accepted length of a tree", points=1,
        function="expected_accepted_length", cases=_gain_cases, returns=("accepted", "tokens_per_call"),
        timeout_s=30,
        recipe="reach = [1.0] * len(parents); for i in 1 .. len(parents) - 1: reach[i] = reach[parents[i]] * "
               "accept[i] (parents come first, so reach[parents[i]] is known: the chance that the whole path down "
               "to i is accepted). accepted = sum(reach[1:]); return accepted, accepted + 1.",
    ),
]
