"""Exercises of notebook 07: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

import math

import pytest
import torch

from labkit.check import FAILED, run_cases
from labkit.exercises import get
from labkit.kernels import interpreted

from exercise_cells import cells, define, fails, solution

V_MASK = "mask=(keys[:, None] < S) & (dims[None, :] < HEAD_DIM)"
K_MASK = "mask=(keys[None, :] < S) & (dims[:, None] < HEAD_DIM)"
WHOLE_TILES, RAGGED, FEWER_KEYS, GQA, PREFIX, STRIDES = (
    "32 queries over 64 keys", "40 queries and keys", "20 queries over 9 keys", "causal, 4 query heads",
    "causal prefill after a cached prefix", "K laid out")
RUNNING_STATE = "The running state goes from one tile to the next"
KERNEL_MISTAKES = {  # what: ((right, wrong) replacements, the case it must fail first, words of that case's hint)
    "acc is not rescaled": ((("acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot"),), WHOLE_TILES,
                            RUNNING_STATE),
    "m_i is not updated": ((("        m_i = m_new\n", ""),), WHOLE_TILES, RUNNING_STATE),
    "the tile's keys from start * BLOCK_N": ((("keys = start + cols", "keys = start * BLOCK_N + cols"),), WHOLE_TILES,
                                             "keys are start + cols"),
    "exp of scores in log2 units": ((("p = tl.exp2(scores", "p = tl.exp(scores"),
                                     ("alpha = tl.exp2(", "alpha = tl.exp(")), WHOLE_TILES,
                                    "tl.exp2 of differences, not tl.exp"),
    "keys past S are not masked": ((("visible = keys[None, :] < S", "visible = keys[None, :] >= 0"),), RAGGED,
                                   "must be -inf in the scores"),
    "the value load masked to the dims only": (((V_MASK, "mask=dims[None, :] < HEAD_DIM"),), RAGGED,
                                               "masked in both loads"),
    "neither load masked to keys < S": (((V_MASK, "mask=dims[None, :] < HEAD_DIM"),
                                         (K_MASK, "mask=dims[:, None] < HEAD_DIM")), RAGGED, "masked in both loads"),
    "no causal mask": ((("visible = visible & (keys[None, :] <= position[:, None])", "visible = visible"),), GQA,
                       "a key later than the query's position"),
    "diagonal tiles left unmasked": ((("partly_masked = partly_masked | (start + BLOCK_N - 1 > first_position)",
                                       "partly_masked = partly_masked"),), GQA, "in the tiles on the diagonal"),
    "K's tile not masked to the head's dims": (((K_MASK, "mask=(keys[None, :] < S)"),), PREFIX,
                                               "dims past HEAD_DIM must be masked"),
    "the key load reads one key past S": (((K_MASK, "mask=(keys[None, :] <= S) & (dims[:, None] < HEAD_DIM)"),),
                                          RAGGED, "a load read past a tensor: 32 elements outside the tensors; "
                                                  "the first: K[0, 0, 40, 0], outside K's shape [1, 2, 40, 32]"),
    "the value load reads one dim past the head": (
        ((V_MASK, "mask=(keys[:, None] < S) & (dims[None, :] <= HEAD_DIM)"),), PREFIX,
        "V[0, 0, 0, 48], outside V's shape [2, 1, 45, 48]"),
    "the key load without other=0.0": (((K_MASK + ", other=0.0", K_MASK),), PREFIX,
                                        "q's zero times NaN is NaN"),
    "the value load without other=0.0": (((V_MASK + ", other=0.0", V_MASK),), RAGGED, "p = 0 times NaN is NaN"),
    "each row's maximum over the queries": ((("tl.max(scores, 1)", "tl.max(scores, 0)"),), FEWER_KEYS,
                                            "tl.max over axis 1, the keys"),
    "V's tokens at K's stride": ((("V + keys[:, None] * stride_vt", "V + keys[:, None] * stride_kt"),), STRIDES,
                                 "use stride_kt for keys and stride_vt for values"),
    "the value load reads one key past S": (((V_MASK, "mask=(keys[:, None] <= S) & (dims[None, :] < HEAD_DIM)"),),
                                            RAGGED, "the output is wrong, and a load read past a tensor: 32 "
                                                    "elements outside the tensors; the first: V[0, 0, 40, 0]"),
    "the running maximum dropped": ((("m_new = tl.maximum(m_i, tl.max(scores, 1))", "m_new = tl.max(scores, 1)"),),
                                    PREFIX, "in the running state, -inf - (-inf)"),
    "the causal mask hides the query's own key": (
        (("keys[None, :] <= position[:, None]", "keys[None, :] < position[:, None]"),),
        GQA, "a row that sees no key at all"),
}


def test_ex07_1_mistakes_fail_first_where_their_hint_names_them():
    def no_rescale(m, l, acc, scores, values):  # forgets that the old sum and output were under the old maximum
        m_new = torch.maximum(m, scores.amax(-1))
        p = torch.exp(scores - m_new[:, None])
        return m_new, l + p.sum(-1), acc + p @ values
    result = fails("ex07.1", no_rescale, "a tile with larger scores", "exp(old m - new m)")
    assert get("ex07.1").recipe not in result.message, result.message

    def normalised(m, l, acc, scores, values):  # divides by l at every step, not once after the last tile
        m_new, l_new, acc_new = solution("ex07.1")(m, l, acc, scores, values)
        return m_new, l_new, acc_new / l_new[:, None]
    fails("ex07.1", normalised, "the first tile", "acc stays unnormalised")

    def scaled_again(m, l, acc, scores, values):  # the scores come scaled: divided by sqrt(d) once more
        return solution("ex07.1")(m, l, acc, scores / math.sqrt(values.shape[-1]), values)
    fails("ex07.1", scaled_again, "the first tile", "they were scaled again")


# caught by watching the loads, which only Triton's interpreter allows: on a GPU the check passes them
WATCHED_ONLY = {"the key load reads one key past S", "the value load reads one key past S",
                "the value load reads one dim past the head",
                "the key load without other=0.0", "the value load without other=0.0"}


# the NaN warnings come from the mistakes that load K or V past the tensor or the head dims
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("what", KERNEL_MISTAKES)
def test_ex07_2_mistakes_fail_first_where_their_hint_names_them(root, what):
    """K and V lie in buffers of NaN past S, so a missing mask fails at its own case whatever lies in memory."""
    assert WATCHED_ONLY <= set(KERNEL_MISTAKES)
    if what in WATCHED_ONLY and not interpreted():
        pytest.skip("the loads are watched only in Triton's interpreter")
    replacements, case, hint = KERNEL_MISTAKES[what]
    kernel = cells("solutions", root)["ex07.2"]
    for right, wrong in replacements:
        assert right in kernel, (what, right)
        kernel = kernel.replace(right, wrong)
    fails("ex07.2", define(kernel, "flash_attention_kernel"), case, hint)


def test_ex07_2_an_error_inside_the_kernel_names_its_line(root):
    """An error inside the kernel surfaces in Triton's interpreter code; the message names the kernel's line."""
    kernel = cells("solutions", root)["ex07.2"]
    right = "k_t = tl.load(K + keys[None, :] * stride_kt + dims[:, None]"
    untransposed = kernel.replace(right, "k_t = tl.load(K + keys[:, None] * stride_kt + dims[None, :]")
    assert right in kernel
    result = run_cases(get("ex07.2"), define(untransposed.replace("mask=(keys[None, :] < S) & (dims[:, None]",
                                                                   "mask=(keys[:, None] < S) & (dims[None, :]"),
                                              "flash_attention_kernel"))
    assert result.status == FAILED and "of your flash_attention_kernel; raised in" in result.message, result.message
    # the first case fails, at tl.dot(q, k_t); its hint names the shapes of the loads too
    assert result.failed_case == WHOLE_TILES + ", not causal: whole tiles, nothing to mask", result.message
    assert f"case 1 ({WHOLE_TILES}, not causal: whole tiles, nothing to mask): raised " in result.message
    assert "An error in tl.dot about its dimensions is a load's shape: the keys' tile is loaded transposed" in \
        result.message, result.message


def test_labkits_own_kernel_is_refused_though_triton_wraps_it():
    """``@triton.jit`` makes a kernel an object of Triton's, whose ``fn`` is the Python function."""
    from labkit import kernels
    if kernels.flash_attention_kernel is None:
        pytest.skip("Triton is not installed")
    result = run_cases(get("ex07.2"), kernels.flash_attention_kernel)
    assert result.status == FAILED and "labkit's own (labkit.kernels.flash.flash_attention_kernel)" in result.message, \
        result.message
