"""Exercises of notebook 06b: the solutions pass (and other right answers: fp16 weights, float64 arithmetic), stubs
score nothing, plausible mistakes fail at the case that tests them with a hint that helps, and the cases hold
what their labels promise."""
from __future__ import annotations

import torch

from labkit.check import NOT_ATTEMPTED, PASSED, run_cases
from labkit.exercises import get, lab06b

from exercise_cells import cells, define, fails, mistake, solution


def test_lab06b_solutions_pass_and_stubs_are_not_attempted(root):
    for ex_id in ("ex06b.1", "ex06b.2", "ex06b.3"):
        assert run_cases(get(ex_id), solution(ex_id)).status == PASSED, ex_id

        def stub(*args, **kwargs):
            raise NotImplementedError("replace this line with your code")
        result = run_cases(get(ex_id), stub)
        assert result.status == NOT_ATTEMPTED and result.points == 0, result.verdict()


def test_lab06b_int4_row_dot_mistakes_fail(root):
    mistakes = [  # (what the solution says, the slip, the case it fails first, what the message must say)
        ("(2 * j, byte & 0x0F), (2 * j + 1, byte >> 4)", "(2 * j, byte >> 4), (2 * j + 1, byte & 0x0F)",
         "four codes by hand", "column 0's code (5) in its low 4 bits"),
        ("(code - zeros[group])", "code", "one group of 64", "never left out"),
        ("(code - zeros[group]) * scales[group]", "(code * scales[group] - zeros[group])", "one group of 64",
         "code * scale - zero is wrong"),
        ("group = column // group_size", "group = j // group_size", "g32, 128 columns",
         "byte j // group_size is the group of the wrong columns"),
        ("enumerate(packed_row.tolist())", "enumerate(packed_row)", "g128 symmetric",  # uint8 codes minus 8 wrap
         "in uint8 arithmetic 3 - 8 is 251"),
        ("zeros = [8] * len(scales) if zeros_row is None else", "zeros =", "g128 symmetric", "every zero point is 8"),
    ]
    for right, wrong, case, hint in mistakes:
        fails("ex06b.1", mistake(root, "ex06b.1", right, wrong), case, hint)


def test_a_vectorised_int4_row_dot_with_fp16_weights_passes():
    """What a GPU kernel does: the weights made in fp16, the products summed in fp32."""
    def int4_row_dot(packed_row, scales_row, zeros_row, x, group_size):
        codes = torch.stack([packed_row & 0x0F, packed_row >> 4], -1).flatten().half()
        zeros = torch.full_like(scales_row, 8) if zeros_row is None else zeros_row
        group = torch.arange(len(codes)) // group_size
        return ((codes - zeros[group]) * scales_row[group]).float() @ x
    assert run_cases(get("ex06b.1"), int4_row_dot).status == PASSED


def test_zero_points_made_uint8_fail_at_the_first_asymmetric_case_with_a_hint_that_names_the_wraparound():
    """The codes kept as uint8 and the zero points made uint8 to match: a code below its zero point wraps."""
    def in_uint8(packed_row, scales_row, zeros_row, x, group_size):
        codes = torch.stack([packed_row & 0x0F, packed_row >> 4], -1).flatten()
        zeros = torch.full_like(scales_row, 8) if zeros_row is None else zeros_row
        group = torch.arange(len(codes)) // group_size
        return ((codes - zeros.to(torch.uint8)[group]).float() * scales_row[group].float()) @ x
    fails("ex06b.1", in_uint8, "one group of 64", "in uint8 a code below its zero point wraps around")


def test_the_zero_point_summed_over_the_whole_row_fails_at_the_first_case_of_several_groups():
    """The background's fused form, s (sum of c x - z sum of x) per group, with the row's sum of x for every group."""
    def whole_row(packed_row, scales_row, zeros_row, x, group_size):
        codes = torch.stack([packed_row & 0x0F, packed_row >> 4], -1).flatten().double()
        zeros = torch.full_like(scales_row, 8) if zeros_row is None else zeros_row
        products = (codes * x.double()).view(-1, group_size).sum(1)
        return (scales_row.double() * (products - zeros.double() * x.double().sum())).sum()
    fails("ex06b.1", whole_row, "g32, 128 columns", "both sums run over the group's own columns")


def test_lab06b_awq_search_mistakes_fail(root):
    planted = "a planted salient channel"
    mistakes = [
        ("(rows / s)", "(rows * s)", planted, "alpha: you chose 0, where every scale is 1"),
        ("(rows / s)", "rows", planted, "or x not divided: every alpha > 0 then scores worse than RTN"),
        ("quantize(weight * s, scheme)", "quantize(weight / s, scheme)", planted, "(W divided by s, or x not"),
        ("error < best[0]", "error > best[0]", planted, "alpha: 1 gives an output error of"),
        ("quantize(weight * s, scheme)", "quantize(weight, scheme)", planted, "it is W diag(s), W's columns times s"),
        ("s = s / (s.max() * s.min()).sqrt()", "s = s", "the planted layer again", "divided by sqrt(max(s) * min(s))"),
        ("s = s / (s.max() * s.min()).sqrt()", "s = s / s.max()", "the planted layer again", "straddle 1"),
        ("mean_abs = rows.abs().mean(0)", "mean_abs = x.abs().mean(0)", "g32, three salient channels",
         "flatten x to [rows, in]"),
        ("for k in range(grid + 1):\n        alpha = k / grid", "for k in range(21):\n        alpha = k / 20",
         "g32, three salient channels", "from the argument grid"),
        ("for k in range(grid + 1):", "for k in range(grid):", "one channel 1,000 times the others",
         "range(grid + 1)"),
        ("(exact - (rows / s) @ w_q.T)", "(weight * s - w_q)", "g32, three salient channels",
         "not the scaled weight's own rounding error"),
        ("(exact - (rows / s) @ w_q.T)", "(weight - w_q / s)", planted, "not W's own rounding error"),
    ]
    for right, wrong, case, hint in mistakes:
        fails("ex06b.2", mistake(root, "ex06b.2", right, wrong), case, hint)


def test_the_awq_cases_have_one_best_alpha_and_the_planted_channel_is_protected():
    """labkit.awq computes the error from the Hessian, the solution from x itself: equal but for float
    rounding, so each case's best alpha beats the next best by far more than that."""
    from labkit.awq import awq_scales, output_error, rtn_scaled
    from labkit.quant import hessian

    for case in get("ex06b.2").cases():
        weight, x, scheme, grid = case.args
        rows = x.reshape(-1, x.shape[-1])
        errors = sorted(output_error(weight, rtn_scaled(weight, awq_scales(rows.abs().mean(0), k / grid), scheme),
                                     hessian(rows)) for k in range(grid + 1))
        if "every alpha ties" in case.label:  # the case of a tie: the first alpha must be kept
            assert errors[0] == errors[-1], case.label
            continue
        assert errors[1] > errors[0] * 1.002, case.label
    weight, x, scheme, grid = get("ex06b.2").cases()[0].args
    scales, alpha = lab06b.reference_awq(weight, x, scheme, grid)
    assert alpha > 0 and int(scales.argmax()) == 5
    assert any(lab06b.reference_awq(*case.args)[1] == 1.0 for case in get("ex06b.2").cases()), \
        "no case's best alpha is 1: a search that stops before alpha = 1 would pass"


def _gptq_solution_with(u_of):
    right = solution("ex06b.3")
    return lambda weight, u, scale, zero, bits: right(weight, u_of(u), scale, zero, bits)


def test_the_step_k_for_alpha_is_named_without_the_cases_hint(root):
    result = fails("ex06b.2", mistake(root, "ex06b.2", "best = (error, s, alpha)", "best = (error, s, k)"),
                   "a planted salient channel", "alpha is k / grid, not the step k")
    assert "hint:" not in result.message


def test_lab06b_gptq_columns_mistakes_fail(root):
    spreads = "row i of u, which is given"
    mistakes = [
        ("        w[:, i + 1:] -= err[:, None] * u[i, i + 1:]\n", "", "correlated inputs",  # RTN
         "these are the codes of rounding each weight to nearest (RTN)"),
        ("u[i, i + 1:]", "u[i + 1:, i]", "correlated inputs", spreads),  # u's column: zero below the diagonal
        (" / u[i, i]", "", "u from a layer's Hessian", "divided by u[i, i]"),
        (".clamp(0, 2 ** bits - 1)", "", "correlated inputs", "the clamp to 0..2^bits - 1 did not keep"),
        ("w = weight.clone().float()", "w = weight", "correlated inputs", "changed its argument weight in place"),
        (".clamp(0, 2 ** bits - 1)", ".clamp(0, 2 ** bits)", "correlated inputs", "a code of 16, above 15"),
        ("q = (torch.round(w[:, i] / scale) + zero).clamp(0, 2 ** bits - 1)\n        codes[:, i] = q.to(torch.uint8)",
         "q = (torch.round(w[:, i] / scale) + zero).to(torch.uint8).clamp(0, 2 ** bits - 1)\n        codes[:, i] = q\n"
         "        q = q.float()", "correlated inputs", "makes each code uint8 before its clamp"),
        ("        codes[:, i] = q.to(torch.uint8)\n",  # the codes cast first, the error from the float codes, clamped
         "        codes[:, i] = (torch.round(w[:, i] / scale) + zero).to(torch.uint8).clamp(0, 2 ** bits - 1)\n",
         "correlated inputs", "made uint8 before the clamp wraps around"),
    ]
    for right, wrong, case, hint in mistakes:
        result = fails("ex06b.3", mistake(root, "ex06b.3", right, wrong), case, hint)
        assert "255" not in result.message or "16" not in hint  # a code of 16 has not wrapped around

    def factor_of_h(u):  # the upper Cholesky factor of H, not of its inverse
        return torch.linalg.cholesky(torch.linalg.inv(u.double().T @ u.double()), upper=True).float()
    fails("ex06b.3", _gptq_solution_with(factor_of_h), "correlated inputs", spreads)


def test_right_gptq_answers_pass_however_they_compute(root):
    """float64 arithmetic rounds a weight at a .5 boundary differently now and then, which the judge allows; an
    update of the columns before i as well (W -= err * u[i]) changes nothing, since u[i, :i] is 0 and those
    columns' codes are taken already, so it is not a mistake."""
    assert run_cases(get("ex06b.3"), _gptq_solution_with(lambda u: u.double())).status == PASSED
    source = cells("solutions", root)["ex06b.3"].replace("w = weight.clone().float()", "w = weight.clone().double()")
    assert run_cases(get("ex06b.3"), define(source, "gptq_columns")).status == PASSED
    whole_row = mistake(root, "ex06b.3", "w[:, i + 1:] -= err[:, None] * u[i, i + 1:]", "w -= err[:, None] * u[i]")
    assert run_cases(get("ex06b.3"), whole_row).status == PASSED


def test_the_gptq_cases_are_what_their_labels_say():
    from labkit.quant import Scheme, gptq, quantize

    cases = get("ex06b.3").cases()
    assert torch.equal(cases[0].args[1], torch.eye(len(cases[0].args[1])))
    assert (cases[1].args[1].diagonal() == 1).all() and not (cases[2].args[1].diagonal() == 1).all()
    assert cases[-1].args[0].shape[1] > 128  # past gptq's block: the last columns are updated in one matmul
    for case in cases[1:]:  # RTN is wrong in most rows of every case but the first
        weight, u, scale, zero, bits = case.args
        assert torch.equal(u, torch.triu(u)) and (u.diagonal() > 0).all(), case.label
        h = torch.linalg.inv(u.double().T @ u.double())  # the (damped) Hessian whose factor u is
        codes = gptq(weight, h, Scheme(bits, None), damp=0)[0]
        assert (codes != quantize(weight, Scheme(bits, None))[0]).any(1).float().mean() > 0.5, case.label


def test_awq_search_slips_that_fail_late_get_a_hint_that_names_them(root):
    """Slips that only the case with no planted channel, or the planted one, tells apart: the hint names them."""
    plain = "no planted channel"
    fails("ex06b.2", mistake(root, "ex06b.2", ".norm().item()", ".abs().mean().item()"), plain,
          "not a mean of absolute values")
    fails("ex06b.2", mistake(root, "ex06b.2", "range(grid + 1)", "range(1, grid + 1)"), plain,
          "the least error is at alpha = 0")
    fails("ex06b.2", mistake(root, "ex06b.2", "rows.abs().mean(0)", "rows.mean(0).abs()"),
          "a planted salient channel", "|x| first, then the mean")


def test_gptq_columns_slips_in_the_error_get_a_hint_that_names_them(root):
    correlated = "correlated inputs"
    fails("ex06b.3", mistake(root, "ex06b.3", "(w[:, i] - (q - zero) * scale)", "((q - zero) * scale - w[:, i])"),
          correlated, "the weight minus its rounded value")
    fails("ex06b.3", mistake(root, "ex06b.3", ("q = (torch.round(w[:, i] / scale) + zero).clamp(0, 2 ** bits - 1)",
                                               "(q - zero) * scale) / u"),
                             ("raw = torch.round(w[:, i] / scale) + zero\n        q = raw.clamp(0, 2 ** bits - 1)",
                              "(raw - zero) * scale) / u")),
          correlated, "the clamped code")
    fails("ex06b.3", mistake(root, "ex06b.3", "torch.round(w[:, i] / scale)", "torch.round(weight[:, i] / scale)"),
          correlated, "rounded from the caller's weight")


def test_awq_search_that_keeps_the_last_of_tied_alphas_fails(root):
    fails("ex06b.2", mistake(root, "ex06b.2", "error < best[0]", "error <= best[0]"), "every channel alike",
          "the spec keeps the first, alpha = 0")
