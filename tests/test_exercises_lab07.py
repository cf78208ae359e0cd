"""Exercises of notebook 07: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

import pytest
import torch

from labkit.check import FAILED, run_cases
from labkit.exercises import get

from exercise_cells import cells, define


# the NaN warnings come from the mistake that loads K past the head dims
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
def test_lab07_plausible_mistakes_fail(root):
    def no_rescale(m, l, acc, scores, values):  # forgets that the old sum and output were under the old maximum
        m_new = torch.maximum(m, scores.amax(-1))
        p = torch.exp(scores - m_new[:, None])
        return m_new, l + p.sum(-1), acc + p @ values
    result = run_cases(get("ex07.1"), no_rescale)
    assert result.status == FAILED and result.failed_case.startswith("a tile with larger scores"), result.message
    assert "exp(old m - new m)" in result.message and get("ex07.1").recipe not in result.message, result.message

    kernel = cells("solutions", root)["ex07.2"]
    mistakes = {
        "acc is not rescaled": ("acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot"),
        "no causal mask": ("visible = visible & (keys[None, :] <= position[:, None])", "visible = visible"),
        "keys past S are not masked": ("visible = keys[None, :] < S", "visible = keys[None, :] >= 0"),
        "diagonal tiles left unmasked": ("partly_masked = partly_masked | (start + BLOCK_N - 1 > first_position)",
                                         "partly_masked = partly_masked"),
        "exp of scores in log2 units": ("p = tl.exp2(scores", "p = tl.exp(scores"),
        "V's tokens at K's stride": ("V + keys[:, None] * stride_vt", "V + keys[:, None] * stride_kt"),
        "K's tile not masked to the head's dims": ("mask=(keys[None, :] < S) & (dims[:, None] < HEAD_DIM)",
                                                   "mask=(keys[None, :] < S)"),
    }
    first_failures = {"no causal mask": ("causal, 4 query heads", "a key later than the query's position"),
                      "V's tokens at K's stride": ("K laid out", "use stride_kt for keys and stride_vt for values")}
    for what, (right, wrong) in mistakes.items():
        assert right in kernel, what
        result = run_cases(get("ex07.2"), define(kernel.replace(right, wrong), "flash_attention_kernel"))
        assert result.status == FAILED, what
        if what in first_failures:  # the failing run's own hint points at what it tests
            case, hint = first_failures[what]
            assert result.failed_case.startswith(case) and hint in result.message, (what, result.message)
    # an error inside the kernel surfaces in Triton's interpreter code; the message names the kernel's line
    right = "k_t = tl.load(K + keys[None, :] * stride_kt + dims[:, None]"
    untransposed = kernel.replace(right, "k_t = tl.load(K + keys[:, None] * stride_kt + dims[None, :]")
    assert right in kernel
    result = run_cases(get("ex07.2"), define(untransposed.replace("mask=(keys[None, :] < S) & (dims[:, None]",
                                                                   "mask=(keys[:, None] < S) & (dims[None, :]"),
                                              "flash_attention_kernel"))
    assert result.status == FAILED and "of your flash_attention_kernel; raised in" in result.message, result.message


def test_labkits_own_kernel_is_refused_though_triton_wraps_it():
    """``@triton.jit`` makes a kernel an object of Triton's, whose ``fn`` is the Python function."""
    from labkit import kernels
    if kernels.flash_attention_kernel is None:
        pytest.skip("Triton is not installed")
    result = run_cases(get("ex07.2"), kernels.flash_attention_kernel)
    assert result.status == FAILED and "labkit's own (labkit.kernels.flash.flash_attention_kernel)" in result.message, \
        result.message
