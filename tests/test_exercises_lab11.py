"""Exercises of notebook 11: the solutions pass (and other right answers), the released stubs score nothing,
plausible mistakes fail at the case that tests them with a message that names the mistake, labkit's answers
agree with loops that know nothing of labkit.tree, and the cases hold what their labels promise."""
from __future__ import annotations

import pytest
import torch

from labkit.check import NOT_ATTEMPTED, PASSED, run_cases
from labkit.exercises import get, lab11
from labkit.release import strip_solutions
from labkit.tree import children

from exercise_cells import cells, define, fails, mistake

IDS = ("ex11.1", "ex11.2", "ex11.3")


def _source(root, ex_id):
    """The exercise cell as students see it in the solutions notebook: the mistakes below are made in it."""
    return cells("solutions", root)[ex_id]


def _solution(root, ex_id):
    return define(_source(root, ex_id), get(ex_id).function)


def _mistake(root, ex_id, right, wrong):
    source = _source(root, ex_id)
    assert right in source, (ex_id, right)
    return define(source.replace(right, wrong), get(ex_id).function)


def test_lab11_solutions_pass_and_released_stubs_are_not_attempted(root):
    for ex_id in IDS:
        assert run_cases(get(ex_id), _solution(root, ex_id)).status == PASSED, ex_id
        stub = define(strip_solutions(_source(root, ex_id), ex_id, ex_id), get(ex_id).function)
        result = run_cases(get(ex_id), stub)
        assert result.status == NOT_ATTEMPTED and result.points == 0, result.verdict()


# --- loops that know nothing of labkit.tree ------------------------------------------------------------


def ancestors(parents, node):
    """Node and every node above it, by following parents."""
    out = [node]
    while parents[out[-1]] != -1:
        out.append(parents[out[-1]])
    return out


def loop_mask_and_positions(parents, start):
    n = len(parents)
    mask = torch.tensor([[j in ancestors(parents, i) for j in range(n)] for i in range(n)])
    return mask, torch.tensor([start + len(ancestors(parents, i)) - 1 for i in range(n)])


def brute_force_branch(parents, tokens, choices, start):
    """The deepest node whose every node on the way down holds the target's choice at its parent."""
    agreed = [node for node in range(len(parents))
              if all(tokens[a] == choices[parents[a]] for a in ancestors(parents, node)[:-1])]
    last = max(agreed, key=lambda node: len(ancestors(parents, node)))
    branch = ancestors(parents, last)[::-1][1:]
    return branch, choices[last], [start + node for node in [0, *branch]]


def enumerated_expectation(parents, accept):
    """The mean accepted length over every way a walk can end: it stops at a node when none of the node's
    children is accepted."""
    mean = 0.0
    for node in range(len(parents)):
        path = ancestors(parents, node)[:-1]
        reached = 1.0
        for a in path:
            reached *= accept[a]
        stops = 1 - sum(accept[c] for c in range(1, len(parents)) if parents[c] == node)
        mean += reached * stops * len(path)
    return mean


def test_the_cases_agree_with_loops():
    for case in get("ex11.1").cases():
        case.run(loop_mask_and_positions)
    for case in get("ex11.2").cases():
        case.run(brute_force_branch)
        assert lab11.reference_branch(*case.args) == brute_force_branch(*case.args), case.label
    for case in get("ex11.3").cases():
        parents, accept = case.args
        case.run(lambda parents, accept: (enumerated_expectation(parents, accept),
                                          enumerated_expectation(parents, accept) + 1))


@pytest.mark.parametrize("seed", range(20))
def test_labkit_agrees_with_loops_on_random_trees(seed):
    from labkit.tree import expected_accepted, tree_mask, tree_positions

    generator = torch.Generator().manual_seed(seed)
    n = 1 + seed % 9
    parents = [-1] + [int(torch.randint(i, (), generator=generator)) for i in range(1, n)]
    mask, positions = loop_mask_and_positions(parents, seed)
    assert torch.equal(tree_mask(parents), mask) and torch.equal(tree_positions(parents, seed), positions)
    kids = children(parents)
    tokens = [0] * n
    for node in range(n):  # siblings hold different tokens
        for rank, kid in enumerate(kids[node]):
            tokens[kid] = rank
    choices = torch.randint(3, (n,), generator=generator).tolist()
    assert lab11.reference_branch(parents, tokens, choices, seed) == brute_force_branch(parents, tokens, choices, seed)
    accept = [1.0] * n
    for node in range(n):  # siblings' probabilities add up to at most 1
        shares = torch.rand(len(kids[node]) + 1, generator=generator)
        for kid, share in zip(kids[node], (shares / shares.sum()).tolist()):
            accept[kid] = share
    assert expected_accepted(parents, accept) == pytest.approx(enumerated_expectation(parents, accept))


# --- other right answers ------------------------------------------------------------------------------


def test_other_right_answers_pass():
    def by_matrix(parents, start):  # reachability: the parent matrix's powers, 0-d ints summed as floats
        n = len(parents)
        up = torch.zeros(n, n)
        for i, p in enumerate(parents[1:], start=1):
            up[i, p] = 1
        mask, step = torch.eye(n), torch.eye(n)
        for _ in range(n):
            step = step @ up
            mask = mask + step
        return mask > 0, (start + mask.sum(1) - 1).long()
    assert run_cases(get("ex11.1"), by_matrix).status == PASSED

    def as_tensors(parents, tokens, choices, start):
        branch, token, keep = brute_force_branch(parents, tokens, choices, start)
        return tuple(branch), token, torch.tensor(keep)
    assert run_cases(get("ex11.2"), as_tensors).status == PASSED

    def in_torch(parents, accept):
        accept = torch.tensor(accept, dtype=torch.float64)
        reach = torch.ones(len(parents), dtype=torch.float64)
        for i in range(1, len(parents)):
            reach[i] = reach[parents[i]] * accept[i]
        return reach[1:].sum(), reach.sum()  # 0-d tensors; the root's 1 is the bonus token
    assert run_cases(get("ex11.3"), in_torch).status == PASSED


# --- mistakes ------------------------------------------------------------------------------------------


def test_lab11_tree_mask_mistakes_fail(root):
    chain, siblings = "a chain of 3 candidates", "two candidates for the next token"
    mistakes = [  # (what the solution says, the slip, the case it fails first, what the message must say)
        ("j = parents[j]", "j = parents[j] if j == i else -1", chain, "each node sees itself and its parent only"),
        ("        j = i\n", "        j = parents[i]\n", chain, "no node sees itself"),
        ("mask[i, j] = True", "mask[j, i] = True", chain, "this mask is transposed"),
        ("mask[i, j] = True", "mask[i, :i + 1] = True", siblings, "this is a chain's causal mask"),
        ("start + torch.tensor(depth)", "start + torch.arange(n)", siblings, "start + the node's number"),
        ("depth = [0] * n", "depth = [1] * n", chain, "the root is at depth 0"),
        ("start + torch.tensor(depth)", "torch.tensor(depth)", chain, "these are the depths"),
        ("torch.zeros(n, n, dtype=torch.bool)", "torch.zeros(n, n)", chain, "the values are right, but the mask"),
        ("torch.tensor(depth)", "torch.tensor(depth, dtype=torch.float)", chain,
         "positions: the values are right, but of torch.float32"),
        ("while j != -1:", "while j > 0:", chain, "no node sees the root: the root (node 0) is the text's last token"),
        ("while j != -1:", "while j > 0 or j == i:", chain, "no node but the root itself sees the root"),
    ]
    for right, wrong, case, hint in mistakes:
        fails("ex11.1", _mistake(root, "ex11.1", right, wrong), case, hint)
    solution = _solution(root, "ex11.1")

    def additive(parents, start):
        mask, positions = solution(parents, start)
        return torch.zeros(mask.shape).masked_fill(~mask, float("-inf")), positions
    fails("ex11.1", additive, chain, "this is an additive mask")

    def inverted(parents, start):  # True where a node may NOT look: nn.MultiheadAttention's bool attn_mask
        mask, positions = solution(parents, start)
        return ~mask, positions
    # for a chain the inverse is also the transpose without its diagonal: both named; on a tree, the inverse alone
    fails("ex11.1", inverted, chain, "this mask is inverted: True where node i may NOT see node j")
    fails("ex11.1", _mistake(root, "ex11.1", "mask[i, j] = True", "mask[j, i] = i != j"), chain,
          ". Or, the same mask for this tree: this mask is transposed (row i: the nodes that see node i) and has no "
          "diagonal")
    with pytest.raises(AssertionError) as raised:
        get("ex11.1").cases()[1].run(inverted)  # two candidates for the next token, each with a child
    assert "this mask is inverted" in str(raised.value) and "transposed" not in str(raised.value)

    def a_stranger(parents, start):  # wrong in no known way: the row is named, no mistake is
        mask, positions = solution(parents, start)
        mask[-1, 0] = False
        return mask, positions
    result = fails("ex11.1", a_stranger, chain, "row 3 (what node 3 sees) should be nodes [0, 1, 2, 3], got [1, 2, 3]")
    assert "got [1, 2, 3]\n" in result.message


def test_lab11_accept_branch_mistakes_fail(root):
    chain, second, cousin = "a chain, every candidate accepted", "the target takes the second", "a cousin holds"
    mistakes = [
        ("for kid in kids[node] if", "for kid in kids[node][:1] if", second, "trying only the first child"),
        ("for kid in kids[node] if", "for kid in range(node + 1, len(parents)) if", cousin, "(a cousin)"),
        ("tokens[kid] == choices[node]", "tokens[kid] == choices[kid]", chain, "whether a child is accepted is decided "
                                                                               "at its parent"),
        ("tokens[kid] == choices[node]", "tokens[node] == choices[kid]", chain,  # the parent's token: also choices[kid]
         "that is what comparing with choices[child] gives, the target's token AFTER the child"),
        ("branch, node = [], 0", "branch, node = [0], 0", chain, "the root is not part of the branch"),
        ("branch.append(node)", "branch.append(tokens[node])", chain, "these are the accepted tokens"),
        ("return branch, choices[node], keep", "return branch, tokens[node], keep", chain,
         "2 is the token of node 3, the branch's last node"),
        ("[start + n for n in [0] + branch]", "[start + n for n in branch]", chain, "the root's slot, start + 0 = 4"),
        ("[start + n for n in [0] + branch]", "list(range(start, start + len(branch) + 1))", second,
         "these are the positions the kept entries move TO"),
        ("[start + n for n in [0] + branch]", "[0] + branch", chain, "these are node numbers"),
        ("[start + n for n in [0] + branch]", "[start + 1 + n for n in [0] + branch]", chain, "each slot is one off"),
        ("[start + n for n in [0] + branch]", "[start - 1 + n for n in [0] + branch]", chain, "each slot is one off"),
    ]
    for right, wrong, case, hint in mistakes:
        fails("ex11.2", _mistake(root, "ex11.2", right, wrong), case, hint)
    solution = _solution(root, "ex11.2")

    def root_token_when_empty(parents, tokens, choices, start):
        branch, token, keep = solution(parents, tokens, choices, start)
        return branch, token if branch else tokens[0], keep
    fails("ex11.2", root_token_when_empty, "nothing accepted", "that is the root's token")


def test_lab11_expected_accepted_length_mistakes_fail(root):
    one, chain, two = "one candidate", "a chain of three", "two guesses"
    reach = "reach[i] = reach[parents[i]] * accept[i]"
    mistakes = [
        (reach, "reach[i] = accept[i]", chain, "the sum of the probabilities, as if each node were tried on its own"),
        (reach, "reach[i] = accept[parents[i]] * accept[i]", chain, "by its parent's only"),
        (reach, "reach[i] = reach[parents[i]] * accept[parents[i]]", one, "not its own"),
        ("sum(reach[1:])", "sum(reach)", one, "the root is counted"),
        (reach, "reach[i] = reach[i - 1] * accept[i]", two, "that multiplies along the node numbers, node i after "
                                                            "node i - 1, as in a chain"),
        ("sum(reach[1:])", "sum(reach[i] for i in range(1, len(parents)) if i not in parents)", chain,
         "that counts the leaves alone"),
        ("return accepted, accepted + 1", "return accepted, accepted", one, "each target call also emits its own "
                                                                            "token after them"),
    ]
    for right, wrong, case, hint in mistakes:
        fails("ex11.3", _mistake(root, "ex11.3", right, wrong), case, hint)

    def best_branch(parents, accept):  # the best root-to-leaf branch alone
        reach = [1.0] * len(parents)
        for i in range(1, len(parents)):
            reach[i] = reach[parents[i]] * accept[i]
        leaves = [i for i in range(len(parents)) if i not in parents]
        best = max((sum(reach[a] for a in ancestors(parents, leaf)[:-1]) for leaf in leaves), default=0.0)
        return best, best + 1
    fails("ex11.3", best_branch, two, "the expected length of the best single branch")


# --- the cases are what their labels say ---------------------------------------------------------------


def test_the_cases_are_what_their_labels_say():
    for exercise in map(get, IDS):
        for case in exercise.cases():
            parents = case.args[0]
            assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents[1:], start=1)), case.label
            assert f"parents {parents}" in case.label
            if "chain" in case.label:
                assert parents == [-1, *range(len(parents) - 1)], case.label
    for number, case in enumerate(get("ex11.2").cases()):
        parents, tokens, choices, start = case.args
        kids = children(parents)
        assert all(len({tokens[k] for k in ks}) == len(ks) for ks in kids), case.label  # siblings differ
        branch, token, keep = lab11.reference_branch(*case.args)
        last = branch[-1] if branch else 0
        depth = len(ancestors(parents, last))
        cousins = [c for c in range(1, len(parents)) if parents[c] != last and len(ancestors(parents, c)) == depth + 1]
        says = {"every candidate accepted": lambda: len(branch) == len(parents) - 1,
                "the second candidate refused": lambda: branch == [1],
                "the second of two": lambda: len(branch) > 1 and branch[0] == kids[0][1],
                "a cousin holds": lambda: any(tokens[c] == choices[last] for c in cousins),
                "nothing accepted": lambda: not branch and len(parents) > 1,
                "three accepted": lambda: len(branch) == 3,
                "just the root": lambda: len(parents) == 1,
                "the root's token again": lambda: choices[last] == tokens[0]}
        assert [said() for words, said in says.items() if words in case.label] == [True], case.label
        moved = keep != list(range(start, start + len(keep)))  # a slot start + node is not the position start + depth
        assert moved == (number in (2, 5)), case.label  # the first: the case the positions-for-slots slip meets
    for case in get("ex11.3").cases():
        parents, accept = case.args
        assert accept[0] == 1.0 and all(sum(accept[k] for k in kids) <= 1 for kids in children(parents)), case.label



def test_a_walk_that_makes_the_root_a_child_is_stopped_and_fails(root):
    """Children listed from node 0: parents[0] = -1 makes the root the last node's child, and the walk goes
    round once the target repeats the root's token."""
    fails("ex11.2", mistake(root, "ex11.2", "range(1, len(parents))", "range(len(parents))"),
          "the target writes the root's token again", "kids[-1] would make the root the last node's child")


@pytest.mark.parametrize("ex_id, right, wrong, case, says", [
    ("ex11.1", "return mask, start + torch.tensor(depth)", "return start + torch.tensor(depth), mask", "a chain",
     "the two items are swapped"),
    ("ex11.3", "return accepted, accepted + 1", "return accepted + 1, accepted", "one candidate",
     "the two numbers are swapped"),
    ("ex11.1", "start + torch.tensor(depth)", "(start + torch.tensor(depth)).float()", "a chain",
     "positions: the values are right, but of torch.float32"),
    ("ex11.1", "start + torch.tensor(depth)", "(start + torch.tensor(depth)).tolist()", "a chain",
     "positions: the values are right, but a list"),
    ("ex11.1", "return mask,", "return mask.int(),", "a chain",
     "mask: the values are right, but the mask is torch.int32"),
    ("ex11.2", "choices[node], keep", "__import__('torch').tensor(choices[node]), keep", "a chain, every candidate",
     "but a tensor: return an int (.item())"),
])
def test_an_order_or_a_type_slip_is_named_without_the_cases_hint(root, ex_id, right, wrong, case, says):
    """Right values swapped or of another type: the message says what to change, and the case's hint, about values,
    is left out."""
    result = run_cases(get(ex_id), mistake(root, ex_id, right, wrong))
    assert result.status == "failed" and says in result.message, result.message
    assert result.failed_case.startswith(case) and "hint:" not in result.message, result.message
