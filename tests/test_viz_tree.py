"""The token-tree pictures of notebook 11: where the nodes go, and that bad input is refused by name."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.tree import chain  # noqa: E402
from labkit.viz import plot_token_tree, plot_tree_mask, tree_layout  # noqa: E402


def test_a_chain_is_a_straight_line():
    assert tree_layout(chain(3)) == [(0.0, 0.0), (1.0, 0.0), (2.0, 0.0), (3.0, 0.0)]


def test_leaves_get_their_own_rows_and_parents_sit_between_their_children():
    #        0
    #      /   \
    #     1     2
    #    / \    |
    #   3   4   5
    where = tree_layout([-1, 0, 0, 1, 1, 2])
    assert [x for x, _ in where] == [0, 1, 1, 2, 2, 2]
    assert [where[n][1] for n in (3, 4, 5)] == [0.0, 1.0, 2.0]  # depth-first order, first child on top
    assert where[1][1] == 0.5 and where[2][1] == 2.0 and where[0][1] == 1.25


def test_a_parent_after_its_child_is_refused():
    with pytest.raises(ValueError, match="a parent after its child"):
        tree_layout([-1, 2, 0])


def test_the_pictures_draw_and_check_their_labels():
    parents = [-1, 0, 0, 1]
    fig = plot_token_tree(parents, ["root", "a", "b", "c"], [None, 0.5, 0.1, 1.0], value_label="accepted")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["root", "a", "b", "c"] and len(fig.axes) == 2  # the tree and its colour bar
    plt.close(fig)
    fig = plot_tree_mask(parents, ["root", "a", "b", "c"], start=5)
    image = fig.axes[0].images[0].get_array()
    assert image.shape == (4, 5) and image[:, 0].all()  # the cached text's column, seen by every node
    assert image[3, 1:].tolist() == [True, True, False, True]  # c sees the root, a and itself, not b
    plt.close(fig)
    with pytest.raises(ValueError, match="one label"):
        plot_token_tree(parents, ["root"])
