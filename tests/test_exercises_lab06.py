"""Exercises of notebook 06: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

import torch

from labkit.check import FAILED, PASSED, run_cases
from labkit.exercises import get

from exercise_cells import fails, mistake, solution


def test_lab06_plausible_mistakes_fail():
    reference_group = solution("ex06.1")  # labkit's group_params refuses calls from a student's ex06.1
    packer = solution("ex06.2")  # labkit's pack_int4 and unpack_int4 refuse calls from a student's ex06.2
    pack_int4, unpack_int4 = packer.pack, packer.unpack

    def fp32_scale(w, bits, symmetric):  # keeps the scale in fp32: not what an fp16 scale dequantizes to
        codes, scale, zero, _ = reference_group(w, bits, symmetric)
        exact = (w.abs().max() / (2 ** (bits - 1) - 1) if symmetric else
                 (w.max().clamp(min=0) - w.min().clamp(max=0)) / (2 ** bits - 1)).item() or 1.0
        return codes, exact, zero, (codes.float() - zero) * exact
    result = fails("ex06.1", fp32_scale, "64 weights, 4 bits, asymmetric", "was not rounded to fp16")
    assert "scale: expected 0.00613403, got 0.00613484" in result.message, result.message

    def symmetric_over_8(w, bits, symmetric):  # divides the largest weight by 2^(bits-1), not 2^(bits-1) - 1
        if not symmetric:
            return reference_group(w, bits, symmetric)
        scale = float((w.abs().max() / 2 ** (bits - 1)).half()) or 1.0
        codes = (torch.round(w / scale) + 2 ** (bits - 1)).clamp(0, 2 ** bits - 1).to(torch.uint8)
        return codes, scale, float(2 ** (bits - 1)), (codes.float() - 2 ** (bits - 1)) * scale
    fails("ex06.1", symmetric_over_8, "64 weights, 4 bits, symmetric", "over 2^(bits-1) - 1 = 7 levels")

    def divides_in_place(w, bits, symmetric):  # w.float() of a float32 tensor is w itself, not a copy
        codes, scale, zero, w_hat = reference_group(w.clone(), bits, symmetric)
        w /= scale
        return codes, scale, zero, w_hat
    fails("ex06.1", divides_in_place, "64 weights, 4 bits, asymmetric", "changed its argument")

    class Concatenated:  # every low nibble, then every high one: not interleaved
        pack = staticmethod(pack_int4)
        unpack = staticmethod(lambda packed: torch.cat([packed & 0x0F, packed >> 4], -1))
    fails("ex06.2", Concatenated, "unpack: known bytes", "not every low nibble, then every high one")

    def grid(w, bits, symmetric, hi=lambda w: w.max().clamp(min=0), top=lambda w: w.abs().max(), exact_zero=False,
             clamp=True):
        """ex06.1 as the spec says, but for the part a keyword replaces (each call below makes one slip)."""
        if symmetric:
            exact = top(w) / (2 ** (bits - 1) - 1)
        else:
            lo = w.min().clamp(max=0)
            exact = (hi(w) - lo) / (2 ** bits - 1)
        scale = exact.half().float() if exact > 0 else torch.tensor(1.0)
        zero = torch.tensor(2.0 ** (bits - 1)) if symmetric else torch.round(-lo / (exact if exact_zero and exact > 0
                                                                                   else scale))
        codes = torch.round(w / scale) + zero
        codes = (codes.clamp(0, 2 ** bits - 1) if clamp else codes).to(torch.uint8)
        return codes, scale.item(), zero.item(), (codes.float() - zero) * scale
    assert run_cases(get("ex06.1"), grid).status == PASSED  # the helper itself is right
    for slip, case in [(dict(hi=lambda w: w.max()), "all negative"),
                       (dict(top=lambda w: w.max()), "the largest weight is negative"),
                       (dict(clamp=False), "the top code is clamped"),
                       (dict(exact_zero=True), "the zero point comes from the fp16 scale")]:
        result = run_cases(get("ex06.1"), lambda w, bits, symmetric, slip=slip: grid(w, bits, symmetric, **slip))
        assert result.status == FAILED and result.passed == result.total - 1 and case in result.message, case

    class Swapped:  # the odd code in the low nibble
        pack = staticmethod(lambda codes: pack_int4(codes.flip(-1)).flip(-1) if codes.shape[-1] % 2 == 0
                            else pack_int4(codes))
        unpack = staticmethod(lambda packed: unpack_int4(packed.flip(-1)).flip(-1))
    result = fails("ex06.2", Swapped, "pack: known bytes", "0x21 holds 1 low and 2 high")
    assert "(the code at an even position in the low nibble): expected the bytes [0x21, 0x43], got [0x12, 0x34]" in result.message, \
        result.message  # in hex, where the swapped nibbles show

    class UnpackOnly:  # unpack written, pack still the stub: attempted, and told what to write next
        @staticmethod
        def pack(codes):
            raise NotImplementedError("ex06.2: replace this line with your code")
        unpack = staticmethod(unpack_int4)
    result = run_cases(get("ex06.2"), UnpackOnly)
    assert result.status == FAILED and result.passed == 1, result  # it read "not attempted"
    assert "pack still raises NotImplementedError: write it next" in result.message, result.message

    class Unchecked:  # packs whatever it is given
        pack = staticmethod(lambda codes: codes[..., 0::2] | (codes[..., 1::2] << 4))
        unpack = staticmethod(unpack_int4)
    fails("ex06.2", Unchecked, "what does not fit", "pack of an odd number of codes should raise ValueError")

    def checked(codes):
        if codes.numel() % 2 or int(codes.max()) > 15:  # an odd count over the whole tensor, not each row
            raise ValueError("does not fit")
        return codes[..., 0::2] | (codes[..., 1::2] << 4)  # rows of 3 broadcast to rows of 2
    result = run_cases(get("ex06.2"), type("Int4Packer", (), {"pack": staticmethod(checked),
                                                               "unpack": staticmethod(lambda p: unpack_int4(p))}))
    assert result.status == FAILED and "rows of 3 codes" in result.message, result.message

    def shifts_in_place(codes):  # the odd codes shifted in the caller's tensor
        pack_int4(codes)  # its checks
        high = codes[..., 1::2]
        high <<= 4
        return codes[..., 0::2] | high
    result = run_cases(get("ex06.2"), type("Int4Packer", (), {"pack": staticmethod(shifts_in_place),
                                                               "unpack": staticmethod(lambda p: unpack_int4(p))}))
    assert result.status == FAILED and "must leave its input as it was" in result.message, result.message
    result = run_cases(get("ex06.2"), type("Int4Packer", (), {"pack": staticmethod(lambda c: pack_int4(c)),
                                                               "unpack": staticmethod(lambda p: unpack_int4(p).flatten())}))
    assert result.status == FAILED and "expected shape [5, 64] of uint8, got shape [320]" in result.message, result.message

    forward = solution("ex06.3")

    def forgets_zeros(layer, x):  # treats every grid as symmetric around 0
        codes = unpack_int4(layer.packed) if layer.scheme.bits == 4 else layer.packed
        groups = codes.reshape(codes.shape[0], layer.scales.shape[1], -1).float()
        return torch.nn.functional.linear(x, (groups * layer.scales[..., None].float()).reshape(codes.shape).to(x.dtype))
    fails("ex06.3", forgets_zeros, "INT4 g32", "subtract each group's zero point")

    def always_fp32(layer, x):  # the output in fp32 whatever x is
        return forward(layer, x.float())
    result = run_cases(get("ex06.3"), always_fp32)
    assert result.status == FAILED and result.passed == result.total - 1 and "bfloat16" in result.message

    def calls_the_layer(layer, x):  # the layer's own forward is sealed in the exercise
        return layer(x)
    fails("ex06.3", calls_the_layer, "INT4 g32", "compute the output from layer.packed, layer.scales and layer.zeros yourself")


def test_lab06_a_failing_case_gives_its_own_hint_not_the_recipe():
    from labkit.quant import unpack_int4

    def group_size_from_the_scheme(layer, x):  # reads layer.scheme.group_size, None for per-channel INT8
        codes = unpack_int4(layer.packed) if layer.scheme.bits == 4 else layer.packed
        zeros = layer.zeros if layer.zeros is not None else torch.full_like(layer.scales, 2 ** (layer.scheme.bits - 1))
        groups = codes.reshape(codes.shape[0], -1, layer.scheme.group_size).to(x.dtype)
        weight = (groups - zeros[..., None].to(x.dtype)) * layer.scales[..., None].to(x.dtype)
        return torch.nn.functional.linear(x, weight.reshape(codes.shape))
    exercise = get("ex06.3")
    result = run_cases(exercise, group_size_from_the_scheme)
    assert result.status == FAILED and result.failed_case == "INT8 per-channel symmetric: codes not packed"
    assert "group_size is None" in result.message and exercise.recipe not in result.message, result.message

    def no_zero_in_range(w, bits, symmetric):  # spans the group's own range, without 0
        if symmetric:
            return solution("ex06.1")(w, bits, symmetric)
        scale = ((w.max() - w.min()) / (2 ** bits - 1)).half().float()
        scale = scale if scale > 0 else torch.tensor(1.0)
        zero = torch.round(-w.min() / scale)
        codes = (torch.round(w / scale) + zero).clamp(0, 2 ** bits - 1).to(torch.uint8)
        return codes, scale.item(), zero.item(), (codes.float() - zero) * scale
    result = run_cases(get("ex06.1"), no_zero_in_range)
    assert result.status == FAILED and result.failed_case.startswith("all positive"), result.message
    assert "lo = min(w_min, 0) is 0" in result.message, result.message


def test_labkits_quantizer_reached_through_its_other_functions_is_refused():
    """ex06.1's answer is group_params, which quant.quantize calls; ex06.3's is dequantize."""
    from labkit.quant import Scheme, dequantize, quantize

    def through_quantize(w, bits, symmetric):
        codes, scale, zero = quantize(w[None], Scheme(bits, None, symmetric))
        return codes[0], scale.float().item(), zero.float().item(), dequantize(codes, scale, zero)[0]
    result = run_cases(get("ex06.1"), through_quantize)
    assert result.status == FAILED and "labkit.quant.group_params, which is labkit's answer to ex06.1" in result.message

    unpack = solution("ex06.2").unpack

    def through_dequantize(layer, x):
        codes = unpack(layer.packed) if layer.scheme.bits == 4 else layer.packed
        zeros = layer.zeros if layer.zeros is not None else torch.full_like(layer.scales, 2 ** (layer.scheme.bits - 1))
        return torch.nn.functional.linear(x, dequantize(codes, layer.scales, zeros, x.dtype))
    result = run_cases(get("ex06.3"), through_dequantize)
    assert result.status == FAILED and "labkit.quant.dequantize, which is labkit's answer to ex06.3" in result.message


def test_three_more_lab06_slips_meet_the_hint_that_names_them():
    packer = solution("ex06.2")

    def scale_kept_in_fp32(w, bits, symmetric):  # skips the fp16 rounding of the scale
        w = w.float()
        levels = 2 ** bits - 1
        if symmetric:
            scale, zero = w.abs().max() / (2 ** (bits - 1) - 1), torch.tensor(float(2 ** (bits - 1)))
        else:
            lo, hi = w.min().clamp(max=0), w.max().clamp(min=0)
            scale = (hi - lo) / levels
            scale = scale if scale > 0 else torch.tensor(1.0)
            zero = torch.round(-lo / scale)
        codes = (torch.round(w / scale) + zero).clamp(0, levels).to(torch.uint8)
        return codes, scale, zero, (codes.float() - zero) * scale
    result = run_cases(get("ex06.1"), scale_kept_in_fp32)
    assert result.status == FAILED and result.failed_case.startswith("64 weights, 4 bits, asymmetric")
    assert "scale.half().float()" in result.message, result.message

    def asserts(codes):  # the student's own assert (pytest rewrites a test's assert) instead of the ValueError asked for
        if codes.shape[-1] % 2:
            raise AssertionError("odd")
        return packer.pack(codes)
    result = run_cases(get("ex06.2"), type("Int4Packer", (), {"pack": staticmethod(asserts),
                                                               "unpack": staticmethod(packer.unpack)}))
    assert result.status == FAILED and "raised AssertionError('odd'); it should raise ValueError" in result.message, \
        result.message

    def groups_of_32(layer, x):  # the first case's group size, fixed
        codes = packer.unpack(layer.packed) if layer.scheme.bits == 4 else layer.packed
        zeros = layer.zeros if layer.zeros is not None else torch.full_like(layer.scales, 2 ** (layer.scheme.bits - 1))
        groups = codes.reshape(codes.shape[0], -1, 32).to(x.dtype)
        weight = ((groups - zeros[..., None].to(x.dtype)) * layer.scales[..., None].to(x.dtype)).reshape(codes.shape)
        return torch.nn.functional.linear(x, weight)
    result = run_cases(get("ex06.3"), groups_of_32)
    assert result.status == FAILED and result.failed_case == "INT4 g128 asymmetric, one token", result.message
    assert "read it from the shapes" in result.message


def test_packed_bytes_of_the_right_values_in_int64_are_a_wrong_type_without_the_cases_hint():
    class WidePacker:
        @staticmethod
        def pack(codes):
            if codes.shape[-1] % 2 or (codes.numel() and int(codes.max()) > 15):
                raise ValueError("codes must come in pairs of 4-bit values")
            codes = codes.long()
            return codes[..., 0::2] | (codes[..., 1::2] << 4)  # the right bytes, as int64

        @staticmethod
        def unpack(packed):
            return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    result = run_cases(get("ex06.2"), WidePacker)
    assert result.status == FAILED and "the values are right, but of int64: expected uint8" in result.message
    assert "hint:" not in result.message, result.message


def test_a_scale_in_a_one_element_tensor_is_a_right_value_of_another_type(root):
    in_one = mistake(root, "ex06.1", "scale = scale.half().float()", "scale = scale.half().float()[None]")
    result = fails("ex06.1", in_one, "64 weights, 4 bits, asymmetric", "got a tensor of shape [1]")
    assert "hint:" not in result.message


def test_a_weight_rebuilt_in_fp16_is_told_by_the_precision_it_misses(root):
    """uint8 codes minus fp16 zero points, times fp16 scales: the natural path, in fp16 throughout."""
    in_fp16 = mistake(root, "ex06.3", ("scales = layer.scales.to(x.dtype)", "zeros = layer.zeros.to(x.dtype)",
                                       ".reshape(out_features, scales.shape[1], -1).to(x.dtype)",
                                       "return F.linear(x, weight)"),
                      ("scales = layer.scales", "zeros = layer.zeros", ".reshape(out_features, scales.shape[1], -1)",
                       "return F.linear(x, weight.to(x.dtype))"))
    fails("ex06.3", in_fp16, "INT4 g32 asymmetric", "a weight rebuilt in fp16 is off by about 1e-4")
