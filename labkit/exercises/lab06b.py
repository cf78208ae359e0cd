"""Notebook 06b (fast quantized decode): a fused INT4 kernel's inner loop, AWQ's scale search for one layer,
and GPTQ's column loop. The specs, as a student reads them:

ex06b.1  ``int4_row_dot(packed_row, scales_row, zeros_row, x, group_size) -> float``
    One output of an INT4 matrix-vector product, as a fused kernel computes it, without building the
    dequantized row: byte j of ``packed_row`` (uint8 ``[in / 2]``) holds the code of column 2j in its low
    4 bits and that of column 2j + 1 in its high 4 bits; column c belongs to group c // group_size, whose
    fp16 scale and zero point are ``scales_row[g]`` and ``zeros_row[g]`` (``zeros_row`` None: a symmetric
    grid, zero point 2^(4-1) = 8). Return sum over c of (code_c - zero) * scale * x[c], a number (a 0-d
    tensor will do). Checked against ``dequantize(codes, scales, zeros) @ x`` in float64, within 1e-3 of
    sum |w_hat_c * x_c| (so weights rounded to fp16 on the way, as GPU kernels do, are fine).

ex06b.2  ``awq_search(weight, x, scheme, grid=20) -> (scales, alpha)``
    AWQ's search for one layer ``weight [out, in]`` on its calibration inputs ``x [..., in]``: for alpha =
    0, 1/grid, ..., 1, the scales s = m^alpha, m the mean |x| of each input channel over all rows, divided
    by sqrt(max(s) * min(s)) so that they straddle 1; the layer's output error with them,
    ||x W^T - (x / s) Q(W diag(s))^T|| (Q: round to nearest with ``scheme``, ``quant.quantize`` then
    ``quant.dequantize``), and the (s, alpha) of the least error (the first, on a tie). Returns s
    ``[in]`` and alpha, a number. Checked on a layer with a planted salient channel (alpha > 0, the largest
    scale there, less error than RTN, the best alpha of the grid) and against ``labkit.awq.search_scales``
    (the same definitions, with the error computed from the Hessian 2 x^T x / n).

ex06b.3  ``gptq_columns(weight, u, scale, zero, bits) -> codes``
    GPTQ's column loop for ``weight [out, in]``, with a per-row grid fixed up front (``scale``, ``zero``:
    ``[out]``) and ``u [in, in]`` the upper Cholesky factor of H^-1, given. On a copy of ``weight`` (the
    caller's stays as it was), for each column i in order:
        code_i = clamp(round(w_i / scale) + zero, 0, 2^bits - 1)
        err    = (w_i - (code_i - zero) * scale) / u[i, i]
        W[:, i+1:] -= err[:, None] * u[i, i+1:]
    Returns the codes, uint8 ``[out, in]``. Checked against ``labkit.quant.gptq`` with ``Scheme(bits, None)``:
    the codes must agree in all rows but at most one in eight (``gptq`` updates the columns past a block of
    128 in one matmul, the same arithmetic in another order, and a weight at a .5 boundary may round the
    other way there; one code off changes the rest of its row).

The references: ex06b.1's is ``quant.dequantize`` in float64, ex06b.2's ``awq.search_scales``, ex06b.3's
``quant.gptq`` (whose H^-1 factor, ``quant.inverse_hessian_factor``, the cases built from inputs use).
"""
from __future__ import annotations

import numbers
from typing import Any, Callable

import torch
from torch import Tensor

from labkit.awq import awq_scales, output_error, rtn_scaled, search_scales, squared_output
from labkit.exercises.spec import Case, Exercise, JudgedCase, SaysWhatToDo, _short
from labkit.quant import (Scheme, dequantize, gptq, group_params, hessian, inverse_hessian_factor, pack_int4, quantize,
                          unpack_int4)


# ex06b.1 -----------------------------------------------------------------------------------------


def _row_case(label: str, packed: Tensor, scales: Tensor, zeros: Tensor | None, x: Tensor, group_size: int,
              hint: str) -> Case:
    """The dot product of the row with x, from the dequantized row in float64."""
    zero_points = torch.full_like(scales, 8) if zeros is None else zeros
    w_hat = dequantize(unpack_int4(packed)[None], scales[None], zero_points[None], torch.float64)[0]
    terms = w_hat * x.double()
    return Case(label, (packed, scales, zeros, x, group_size), terms.sum().item(), rtol=0,
                atol=1e-3 * terms.abs().sum().item(), numbers_as_tensors=True, hint=hint)


def _random_row(in_features: int, scheme: Scheme, seed: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """A row quantized with ``scheme``, its groups of different ranges, and an x of both signs."""
    generator = torch.Generator().manual_seed(seed)
    groups = scheme.groups(in_features)
    spread = 0.5 + 2.5 * torch.rand(groups, 1, generator=generator)  # each group a scale of its own
    weight = (torch.randn(groups, in_features // groups, generator=generator) * 0.05 * spread).reshape(1, -1)
    codes, scales, zeros = quantize(weight, scheme)
    x = torch.randn(in_features, generator=generator)
    return pack_int4(codes)[0], scales[0], None if scheme.symmetric else zeros[0], x


def _row_cases() -> list[Case]:
    by_hand = (torch.tensor([0x95, 0xF3], dtype=torch.uint8), torch.tensor([0.5]).half(),
               torch.tensor([0.0]).half(), torch.tensor([1.0, -2.0, 3.0, 0.5]))
    return [
        _row_case("four codes by hand: bytes 0x95, 0xF3", *by_hand, 4,
                  "the codes of columns 0, 1, 2, 3 are 5, 9, 3, 15: byte 0x95 holds column 0's code (5) in its low "
                  "4 bits (& 0x0F) and column 1's (9) in its high 4 bits (>> 4). With zero point 0 and scale 0.5 "
                  "the weights are 2.5, 4.5, 1.5, 7.5, and the dot product with x = (1, -2, 3, 0.5) is 1.75: four "
                  "terms from two bytes, the last byte's too"),
        _row_case("one group of 64, asymmetric: a zero point of its own", *_random_row(64, Scheme(4, 64), 1), 64,
                  "one group whose zero point is not 0: a weight is (code - zero) * scale, the zero point "
                  "subtracted from the code before the scale multiplies (it is a code, not a weight: code * "
                  "scale - zero is wrong), and never left out; and subtracted in floats or Python ints: in uint8 a code "
                  "below its zero point wraps around"),
        _row_case("g32, 128 columns: four groups, each its own scale and zero", *_random_row(128, Scheme(4, 32), 2),
                  32,
                  "each group of 32 columns has its own scale and zero point. A weight's group is its column // "
                  "group_size, and byte j holds columns 2j and 2j + 1: byte j // group_size is the group of the "
                  "wrong columns from byte 16 on. With the zero point taken out of the sum, s (sum of c x - z sum "
                  "of x) per group, both sums run over the group's own columns, not the whole row"),
        _row_case("g128 symmetric, 256 columns: zeros_row is None", *_random_row(256, Scheme(4, 128, True), 3), 128,
                  "a symmetric grid stores no zero points: every zero point is 8. Codes below 8 give negative "
                  "weights; in uint8 arithmetic 3 - 8 is 251, not -5: turn codes into Python ints or floats "
                  "(.tolist(), int(...)) or a float tensor before subtracting"),
        _row_case("g64 asymmetric, 512 columns", *_random_row(512, Scheme(4, 64), 4), 64,
                  "a longer row of eight groups of 64, each its own scale and zero point, against x of both signs"),
    ]


# ex06b.2 -----------------------------------------------------------------------------------------


def _calibration(seed: int, out_features: int, in_features: int, rows: int, salient: list[int], factor: float
                 ) -> tuple[Tensor, Tensor]:
    """A weight and inputs whose channels differ in size (0.5x to 1.5x), ``salient`` ones ``factor`` times more."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    x = torch.randn(rows, in_features, generator=generator) * (0.5 + torch.rand(in_features, generator=generator))
    x[:, salient] *= factor
    return weight, x


def reference_awq(weight: Tensor, x: Tensor, scheme: Scheme, grid: int = 20) -> tuple[Tensor, float]:
    """labkit's answer: ``awq.search_scales`` on x's mean |x| per channel and Hessian."""
    rows = x.reshape(-1, x.shape[-1]).float()
    scales, alpha, _ = search_scales(weight, rows.abs().mean(0), hessian(rows), scheme, grid)
    return scales, alpha


def _planted(weight: Tensor, x: Tensor, scheme: Scheme, grid: int, channel: int, factor: float
             ) -> Callable[[Any], None]:
    """Judge an answer on a layer whose input ``channel`` is salient by what that implies."""
    in_features = weight.shape[1]
    m, h = x.abs().mean(0), hessian(x)
    reference = squared_output(weight.float(), h)
    errors = [output_error(weight, rtn_scaled(weight, awq_scales(m, k / grid), scheme), h, reference)
              for k in range(grid + 1)]
    best = min(range(grid + 1), key=errors.__getitem__)

    def judge(got: Any) -> None:
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise AssertionError(f"expected a tuple (scales, alpha), got {_short(got)}")
        scales, alpha = got
        if not isinstance(scales, Tensor) or tuple(scales.shape) != (in_features,) or not scales.is_floating_point():
            raise AssertionError(f"at index 0: expected a float tensor of shape [{in_features}], one scale per input "
                                 f"channel, got {_short(scales)}")
        alpha = alpha.item() if isinstance(alpha, Tensor) and alpha.dim() == 0 else alpha
        if not isinstance(alpha, numbers.Real) or isinstance(alpha, bool):
            raise AssertionError(f"at index 1: expected a number, got {_short(alpha)}")
        k = round(float(alpha) * grid)
        if not 0 <= k <= grid or abs(alpha - k / grid) > 1e-6:
            raise SaysWhatToDo(f"at index 1: expected a number on the grid 0, 1/{grid}, ..., 1, got {alpha!r} (alpha "
                               f"is k / grid, not the step k)" if 0 <= alpha <= grid and alpha == int(alpha) else
                               f"at index 1: expected a number on the grid 0, 1/{grid}, ..., 1, got {alpha!r}")
        if k == 0:
            raise AssertionError(f"alpha: you chose 0, where every scale is 1: plain RTN, output error "
                                 f"{errors[0]:.4f}; alpha = {best / grid:g} brings it down to {errors[best]:.4f}. "
                                 "A search keeps 0 when its scaling runs the wrong way (W divided by s, or x not "
                                 "divided: every alpha > 0 then scores worse than RTN), or when it never compares "
                                 "the alphas (a return inside the loop, an error that is NaN)")
        if errors[k] > errors[best]:
            raise AssertionError(f"alpha: {alpha:g} gives an output error of {errors[k]:.4f}, but alpha = "
                                 f"{best / grid:g} gives less, {errors[best]:.4f} (plain RTN, alpha = 0: "
                                 f"{errors[0]:.4f})")
        if int(scales.argmax()) != channel:
            raise AssertionError(f"scales: the largest is at channel {int(scales.argmax())}, not at channel {channel}, "
                                 f"whose activations are {factor:g} times the others'")
        error = output_error(weight, rtn_scaled(weight, scales.detach().float(), scheme), h)
        if not error < errors[0]:
            raise AssertionError(f"scales: with yours the layer's output error is {error:.4f}, no less than plain "
                                 f"RTN's {errors[0]:.4f}")
    return judge


def _awq_cases() -> list[Case]:
    planted = _calibration(0, 32, 64, 128, [5], 30.0)
    several = _calibration(1, 48, 128, 64, [3, 40, 77], 10.0)
    symmetric = _calibration(2, 24, 96, 64, [10, 50], 8.0)
    plain = _calibration(3, 16, 64, 96, [], 1.0)
    extreme = _calibration(4, 16, 64, 48, [7], 1000.0)
    several = several[0], several[1].reshape(4, 16, 128)  # x [batch, tokens, in]: the mean is over all rows
    alike = plain[0], torch.where(plain[1] >= 0, 1.0, -1.0)  # |x| = 1 everywhere: s = 1, whatever alpha
    cases: list[Case] = [JudgedCase(
        "a planted salient channel: channel 5's activations 30 times the others'",
        (*planted, Scheme(4, 64), 20), judge=_planted(*planted, Scheme(4, 64), 20, 5, 30.0),
        hint="the weights that meet channel 5 cost 30 times more output error when rounded, so the search must "
             "find an alpha > 0 that gives channel 5 the largest scale and beats RTN (alpha = 0). If it does not: "
             "it is W diag(s), W's columns times s, that is rounded, while x is divided by s; the error is the "
             "layer's output error on x, ||x W^T - (x / s) Q(W diag(s))^T||, not W's own rounding error, which "
             "ignores how large each channel's inputs are; m is the mean of "
             "|x| per channel, |x| first, then the mean (x's own mean is near 0 in every channel); and the alpha to "
             "keep is the one of least error")]
    for label, (weight, x), scheme, grid, hint in [
        ("the planted layer again: labkit's scales and alpha", planted, Scheme(4, 64), 20,
         "alpha is right if the case before passed; now the scales themselves: m is the mean of |x| per input "
         "channel over every row, s = m^alpha divided by sqrt(max(s) * min(s)), so that the largest and the "
         "smallest scale straddle 1 (only their ratios matter to the error, but the spec fixes their size)"),
        ("g32, three salient channels, x of shape [4, 16, 128], grid 10", several, Scheme(4, 32), 10,
         "x has two leading dimensions: the mean |x| and the error run over all 64 rows (flatten x to [rows, in]); "
         "the grid has 10 steps, alpha = 0, 0.1, ..., 1, from the argument grid; the error compared is the layer's "
         "output error on those rows, not the scaled weight's own rounding error"),
        ("INT4 per-channel symmetric, grid 8", symmetric, Scheme(4, None, True), 8,
         "another scheme: Q is quantize then dequantize with the scheme given (per-channel: one group per row), "
         "and alpha = 0, 1/8, ..., 1"),
        ("one channel 1,000 times the others, grid 4: the best alpha is the last, 1", extreme, Scheme(4, 32), 4,
         "the grid has both ends: alpha = k / grid for k = 0, 1, ..., grid, grid + 1 values (range(grid + 1)); "
         "with so salient a channel alpha = 1 has the least error, less than half of alpha = 0.75's"),
        ("no planted channel: channels only 0.5 to 1.5 times each other", plain, Scheme(4, 32), 10,
         "no channel stands out much, and the least error is at alpha = 0, plain RTN: the grid starts at 0 "
         "(k = 0, 1, ..., grid). The error compared is the norm ||...||, the square root of the sum of squares (its "
         "square picks the same alpha), not a mean of absolute values, which picks another alpha here"),
        ("every channel alike (|x| = 1 everywhere): every alpha ties", alike, Scheme(4, 32), 10,
         "with every channel's mean |x| equal, s = 1 for every alpha, and every alpha's error is the same: a tie, "
         "where the spec keeps the first, alpha = 0 (replace the best only on a strictly smaller error)"),
    ]:
        cases.append(Case(label, (weight, x, scheme, grid), reference_awq(weight, x, scheme, grid), rtol=1e-4,
                          atol=1e-6, numbers_as_tensors=True, hint=hint))
    return cases


# ex06b.3 -----------------------------------------------------------------------------------------


def _codes_judge(expected: Tensor, rtn: Tensor, bits: int, cast_first: Tensor | None = None) -> Callable[[Any], None]:
    """Codes of ``bits`` equal to ``expected`` in all rows but one in eight (at least one row may differ);
    ``cast_first``: the codes of the loop that makes each code uint8 before its clamp, a mistake named."""
    out_features, in_features = expected.shape
    top = 2 ** bits - 1
    allowed = max(1, out_features // 8)

    def judge(got: Any) -> None:
        if not isinstance(got, Tensor) or tuple(got.shape) != tuple(expected.shape) or got.dtype != torch.uint8:
            raise AssertionError(f"expected codes of shape [{out_features}, {in_features}] of uint8, got {_short(got)}")
        if int(got.max()) > top:
            wrapped = " (255: a negative one, wrapped around in uint8)" if int(got.max()) == 255 else ""
            raise SaysWhatToDo(f"a code of {int(got.max())}, above {top} = 2^bits - 1: a value past the grid{wrapped} "
                               "that the clamp to 0..2^bits - 1 did not keep on it")
        wrong = (got.cpu() != expected).any(1)
        if int(wrong.sum()) <= allowed:
            return
        if cast_first is not None and int(((got.cpu() != cast_first).any(1)).sum()) <= allowed:
            raise SaysWhatToDo(f"these are the codes of a loop that makes each code uint8 before its clamp: a "
                               f"negative value wraps around (-1 becomes 255), which the clamp then takes to {top} "
                               "where it should be 0; clamp the float codes to 0..2^bits - 1 first, then convert")
        row = int(wrong.nonzero()[0])
        column = int((got[row].cpu() != expected[row]).nonzero()[0])
        if (int(got[row, column]), int(expected[row, column])) == (top, 0):  # the same cast, another error spread
            raise AssertionError(f"a code of {top} where labkit's is 0, first at row {row}, column {column}: a "
                                 "negative value made uint8 before the clamp wraps around (-1 becomes 255), which "
                                 f"the clamp takes to {top}; clamp the float codes first, then convert")
        if torch.equal(got.cpu(), rtn) and not torch.equal(expected, rtn):
            raise AssertionError("these are the codes of rounding each weight to nearest (RTN): no column's rounding "
                                 "error reached the columns after it (or each column was rounded from the caller's "
                                 "weight, not from the copy that the errors update)")
        raise AssertionError(f"the codes differ from labkit's gptq in {int(wrong.sum())} of {out_features} rows, first "
                             f"at row {row}, column {column}: expected {int(expected[row, column])}, got "
                             f"{int(got[row, column])} (a right answer differs in {allowed} row"
                             f"{'s' * (allowed > 1)} at most, where a weight at a .5 boundary rounds the other way)")
    return judge


def _gptq_case(label: str, weight: Tensor, h: Tensor, u: Tensor, bits: int, damp: float, hint: str) -> Case:
    scale, zero = group_params(weight, bits, symmetric=False)  # the grid gptq sets at column 0: the whole row
    expected = gptq(weight, h, Scheme(bits, None), damp=damp)[0]
    rtn = quantize(weight, Scheme(bits, None))[0]
    cast_first = _columns_cast_first(weight, u, scale, zero, bits)
    cast_first = None if int(((cast_first != expected).any(1)).sum()) <= max(1, weight.shape[0] // 8) else cast_first
    return JudgedCase(label, (weight, u, scale, zero, bits), judge=_codes_judge(expected, rtn, bits, cast_first),
                      unchanged=True, hint=hint)


def _columns_cast_first(weight: Tensor, u: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """ex06b.3's loop with a mistake: each code made uint8 before its clamp, so that -1 wraps to 255, then 2^bits - 1."""
    w, codes = weight.clone().float(), torch.empty(weight.shape, dtype=torch.uint8)
    for i in range(w.shape[1]):
        codes[:, i] = (torch.round(w[:, i] / scale) + zero).to(torch.uint8).clamp(0, 2 ** bits - 1)
        err = (w[:, i] - (codes[:, i].float() - zero) * scale) / u[i, i]
        w[:, i + 1:] -= err[:, None] * u[i, i + 1:]
    return codes


def _layer(seed: int, out_features: int, in_features: int, rows: int = 256) -> tuple[Tensor, Tensor]:
    """A weight and the Hessian of inputs whose channels are correlated, as a real layer's are."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    mixing = torch.eye(in_features) + 0.3 * torch.randn(in_features, in_features, generator=generator)
    return weight, hessian(torch.randn(rows, in_features, generator=generator) @ mixing)


def _gptq_cases() -> list[Case]:
    generator = torch.Generator().manual_seed(11)
    identity_weight = torch.randn(8, 16, generator=generator) * 0.05
    unit_weight = torch.randn(8, 24, generator=generator) * 0.05
    unit_u = torch.eye(24) + torch.triu(0.3 * torch.randn(24, 24, generator=generator), diagonal=1)
    unit_h = torch.linalg.inv(unit_u.double().T @ unit_u.double())  # H^-1 = u^T u exactly, as gptq recovers it
    cases = [
        _gptq_case("u = identity: nothing to spread, every code is RTN's", identity_weight, torch.eye(16),
                   torch.eye(16), 4, 0.0,
                   "with u the identity no error spreads, so every code is plain rounding on the row's grid: "
                   "code = clamp(round(w / scale) + zero, 0, 2^bits - 1), returned as uint8 [out, in]"),
        _gptq_case("correlated inputs, u with a unit diagonal (8 x 24, 4 bits)", unit_weight, unit_h, unit_u, 4, 0.0,
                   "here the columns' inputs are correlated: once column i is rounded, its error err must change "
                   "the columns not yet rounded, W[:, i+1:] -= err[:, None] * u[i, i+1:] (row i of u, which is "
                   "given: no inverse or factor to compute), before column i + 1 is rounded. err is the weight "
                   "minus its rounded value, w_i - (code_i - zero) * scale with the clamped code (in weights, not "
                   "codes), divided by u[i, i]"),
    ]
    for label, seed, shape, bits, hint in [
        ("u from a layer's Hessian: its diagonal is not 1 (16 x 32, 4 bits)", 12, (16, 32), 4,
         "u comes from real inputs now, and u[i, i] is not 1: the error to spread is the rounding error "
         "divided by u[i, i]"),
        ("3 bits, 24 x 96: updated weights may leave the grid", 13, (24, 96), 3,
         "8 levels (0..7) from bits; the updates can push a weight past the row's grid, whose code the clamp "
         "to 0..2^bits - 1 keeps on it, and the error that spreads is the clamped code's. The layer is wider than "
         "before too: each column's error must reach every column after it, in float32 (half precision drifts)"),
        ("192 columns: labkit's gptq updates the last 64 in one matmul", 14, (32, 192), 4,
         "a wider layer: every column's error reaches every column after it, up to the last"),
    ]:
        weight, h = _layer(seed, *shape)
        cases.append(_gptq_case(label, weight, h, inverse_hessian_factor(h), bits, 0.01, hint))
    return cases


EXERCISES = [
    Exercise(
        id="ex06b.1", title="A fused INT4 kernel's inner loop: one output, from packed codes", points=2,
        function="int4_row_dot", cases=_row_cases, timeout_s=30,
        recipe="For each byte j of packed_row (packed_row.tolist() gives Python ints): column 2j's code is "
               "byte & 0x0F, column 2j + 1's is byte >> 4. For a column c, g = c // group_size; zero = 8 if "
               "zeros_row is None else zeros_row[g]; add (code - zero) * scales_row[g] * x[c] to a running total "
               "(in Python floats, or float tensors: never in uint8, where 3 - 8 is 251). Return the total.",
    ),
    Exercise(
        id="ex06b.2", title="AWQ's scale search for one layer", points=2, function="awq_search",
        cases=_awq_cases, returns=("scales", "alpha"), timeout_s=30,
        recipe="rows = x.reshape(-1, x.shape[-1]); m = rows.abs().mean(0); exact = rows @ weight.T. For k in "
               "0..grid: alpha = k / grid; s = m ** alpha; s = s / (s.max() * s.min()).sqrt(); w_q = "
               "dequantize(*quantize(weight * s, scheme)); error = (exact - (rows / s) @ w_q.T).norm(). Keep the "
               "s and alpha of the smallest error (replace the best only on a strictly smaller one) and return "
               "them.",
    ),
    Exercise(
        id="ex06b.3", title="GPTQ's column loop: round a column, spread its error", points=1,
        function="gptq_columns", cases=_gptq_cases, timeout_s=30,
        recipe="w = weight.clone().float(); codes = torch.empty(w.shape, dtype=torch.uint8). For i in "
               "range(w.shape[1]): q = (torch.round(w[:, i] / scale) + zero).clamp(0, 2 ** bits - 1); codes[:, i] = "
               "q.to(torch.uint8); err = (w[:, i] - (q - zero) * scale) / u[i, i]; w[:, i + 1:] -= err[:, None] * "
               "u[i, i + 1:]. Return codes.",
    ),
]
