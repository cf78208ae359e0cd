"""Notebook 06 (INT4 quantization): one group's grid, packing two codes per byte, QuantLinear's forward."""
from __future__ import annotations

from typing import Any, Callable

import torch

from labkit.exercises.spec import Case, Exercise, Scenario, assert_equal_tensors
from labkit.quant import QuantLinear, Scheme, dequantize, pack_int4, quantize, unpack_int4, use_fused


def reference_group(w: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, float, float, torch.Tensor]:
    """labkit's answer for one group: codes, scale, zero point and the dequantized group."""
    codes, scales, zeros = quantize(w[None], Scheme(bits, None, symmetric))
    return codes[0], scales.item(), zeros.item(), dequantize(codes, scales, zeros)[0]


def _group_cases() -> list[Case]:
    generator = torch.Generator().manual_seed(6)
    w = torch.randn(64, generator=generator) * 0.02
    outlier, negative_outlier, even, wide = w.clone(), w.clone(), w.clone(), w.clone()
    outlier[7], negative_outlier[7] = 0.3, -0.3
    even[:2] = torch.tensor([-0.07, 0.07])  # the fp16 scale rounds down: the top weight's code needs the clamp
    wide[:2] = torch.tensor([-0.1, 0.1])  # the fp16 scale rounds up: the zero point differs by one without it
    groups = [  # label, arguments, what the case tests (its hint)
        ("64 weights, 4 bits, asymmetric", (w, 4, False),
         "the plain asymmetric grid: scale (hi - lo) / 15 from the range widened to include 0, zero = round(-lo / "
         "scale), codes rounded to nearest (torch.round, not truncated by a cast); a scale off by less than 0.1% "
         "was not rounded to fp16, the precision it is stored in "
         "(scale.half().float()); if only w_hat is off, look at the dequantization (codes as float32 before "
         "subtracting the zero)"),
        ("64 weights, 4 bits, symmetric", (w, 4, True),
         "the symmetric grid: the scale comes from the largest |w| over 2^(bits-1) - 1 = 7 levels, and the zero "
         "point is fixed at 2^(bits-1) = 8, whatever the weights are"),
        ("one large outlier stretches the grid", (outlier, 4, False),
         "one weight of 0.3 among weights of about 0.02: the scale must follow the outlier, so most weights share "
         "a few codes near the zero point; check that hi is the group's true maximum"),
        ("all positive: the range still includes 0, so zero = 0", (w.abs() + 0.01, 4, False),
         "every weight is positive, so lo = min(w_min, 0) is 0 and the zero point is 0: a grid from w_min to "
         "w_max, without 0, is what this case catches"),
        ("all negative: the range still includes 0", (-(w.abs() + 0.01), 4, False),
         "every weight is negative, so hi = max(w_max, 0) is 0 and the zero point is the top code, 15"),
        ("symmetric, the largest weight is negative", (negative_outlier, 4, True),
         "the largest weight in size is -0.3: a symmetric scale must use the largest absolute value, not the "
         "largest value"),
        ("min = -max: the top code is clamped to the grid", (even, 4, False),
         "the fp16 scale rounds down here, so the largest weight rounds one code past 15: the codes must be "
         "clamped to 0..2^bits - 1 before they are made uint8"),
        ("min = -max: the zero point comes from the fp16 scale", (wide, 4, False),
         "the fp16 scale rounds up here, and the zero point differs by one depending on which scale divides "
         "-lo: use the scale after rounding it to fp16, the one that is stored"),
        ("all zero: scale 1, every code is the zero point", (torch.zeros(32), 4, False),
         "a group of zeros has a range of 0 and a scale of 0: dividing by it gives NaN; the spec replaces a scale "
         "of 0 by 1"),
        ("8 bits, symmetric", (w, 8, True),
         "8 bits: 255 levels, a scale over 127 and a zero point of 128; a number 4, 7, 8 or 15 written into the "
         "function instead of computed from bits fails here"),
        ("3 bits, asymmetric", (w[:32], 3, False),
         "3 bits: 8 levels, codes 0..7: the level count and the clamp must come from bits, not be fixed at 4"),
    ]
    return [Case(label, args, reference_group(*args), rtol=1e-6, atol=1e-8, numbers_as_tensors=True, unchanged=True,
                 hint=hint) for label, args, hint in groups]


def _expect(got: Any, expected: torch.Tensor, what: str, in_hex: bool = False) -> None:
    """``got`` equal to ``expected``, or an error that begins with ``what``; ``in_hex``: a few wrong bytes shown in
    hex, where a nibble in the wrong half shows (0x21 against 0x12; 33 against 18 does not)."""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a uint8 tensor, got {got!r:.80}")
    try:
        assert_equal_tensors(got, expected)
    except AssertionError as error:
        if in_hex and type(error) is AssertionError and got.shape == expected.shape and got.dtype == expected.dtype:
            raise AssertionError(f"{what}: expected the bytes {_hex(expected)}, got {_hex(got)}") from None
        raise type(error)(f"{what}: {error}") from None  # a WrongType stays one: no hint about the values


def _hex(tensor: torch.Tensor) -> str:
    return "[" + ", ".join(f"0x{byte:02X}" for byte in tensor.flatten().tolist()) + "]"


def _raises(call: Callable[[], Any], what: str) -> None:
    try:
        call()
    except ValueError:
        return
    except NotImplementedError:  # a stub: the check says so
        raise
    except Exception as error:  # the student's own assert would otherwise read as the check's verdict
        raise AssertionError(f"{what} raised {type(error).__name__}({str(error)!r}); it should raise ValueError"
                             ) from None
    raise AssertionError(f"{what} should raise ValueError")


def _packing_cases() -> list[Scenario]:
    generator = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (5, 64), generator=generator, dtype=torch.uint8)

    def packs(packer: Any) -> None:
        _expect(packer.pack(torch.tensor([1, 2, 3, 4], dtype=torch.uint8)), torch.tensor([0x21, 0x43]).byte(),
                "pack([1, 2, 3, 4]) (the code at an even position in the low nibble)", in_hex=True)

    def unpacks(packer: Any) -> None:  # a case of its own: an unpack written before pack passes it
        _expect(packer.unpack(torch.tensor([0x21, 0xF0], dtype=torch.uint8)), torch.tensor([1, 2, 0, 15]).byte(),
                "unpack([0x21, 0xF0])")

    def round_trip(packer: Any) -> None:
        given = codes.clone()
        packed = packer.pack(given)
        _expect(packed, pack_int4(codes), "pack of a [5, 64] matrix of codes, row by row")
        _expect(given, codes, "the codes after pack, which must leave its input as it was")
        _expect(packer.unpack(packed), codes, "unpack(pack(codes))")
        _expect(packer.unpack(pack_int4(codes)), unpack_int4(pack_int4(codes)), "unpack of a [5, 32] matrix")

    def refuses(packer: Any) -> None:
        _raises(lambda: packer.pack(torch.tensor([1, 2, 3], dtype=torch.uint8)), "pack of an odd number of codes")
        _raises(lambda: packer.pack(torch.zeros(2, 3, dtype=torch.uint8)), "pack of rows of 3 codes (6 in all)")
        _raises(lambda: packer.pack(torch.tensor([1, 16], dtype=torch.uint8)), "pack of a code above 15")

    return [Scenario("pack: known bytes", packs,
                     hint="four codes into two bytes, worked out by hand: the code at the even position goes in the "
                          "low 4 bits, the next one in the high 4 bits (0x21 holds 1 low and 2 high)"),
            Scenario("unpack: known bytes", unpacks,
                     hint="two bytes back into four codes, worked out by hand: the low 4 bits first (0x21 gives 1, "
                          "then 2), byte by byte, interleaved (byte 0's low and high, then byte 1's: not every low "
                          "nibble, then every high one). 0xF0 is 240 as uint8 but -16 as int8, where >> 4 keeps the "
                          "sign (-1, not 15): shift the bytes as uint8"),
            Scenario("a matrix, there and back", round_trip,
                     hint="[5, 64] codes, packed row by row along the last dimension, then unpacked: the result "
                          "keeps the leading dimensions, and pack must not change the tensor it was given. Every "
                          "code from 0 to 15 packs (15 too), and only the last dimension must be even"),
            Scenario("what does not fit is refused", refuses,
                     hint="an odd number of codes in a row, or a code of 16 or more, cannot be packed two to a "
                          "byte: check the last dimension (not the total count) and the largest code, and raise "
                          "ValueError")]


class SealedQuantLinear(QuantLinear):
    """A QuantLinear whose own forward and dequantization are off limits to the exercise."""

    def _sealed(self, *args: Any) -> Any:
        raise RuntimeError("compute the output from layer.packed, layer.scales and layer.zeros yourself")

    forward = dequantized_weight = codes = zero_points = _sealed


def sealed_layer(out_features: int, in_features: int, scheme: Scheme, seed: int
                 ) -> tuple[SealedQuantLinear, QuantLinear]:
    """A random layer, sealed for the exercise, and the same layer unsealed for the expected output, which
    dequantizes in PyTorch as the exercise does (not the fused kernel, which would also be built for it)."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    quantized = quantize(weight, scheme)
    return SealedQuantLinear(*quantized, scheme), use_fused(QuantLinear(*quantized, scheme), False)


def _forward_cases() -> list[Case]:
    generator = torch.Generator().manual_seed(8)
    layers = [  # label, (sealed layer, unsealed layer), x's shape, what the case tests (its hint)
        ("INT4 g32 asymmetric, x [3, 64]", sealed_layer(16, 64, Scheme(4, 32), 1), (3, 64),
         "two groups of 32 per row, each a run of 32 consecutive columns with its own scale and zero point: "
         "unpack the codes, then subtract each group's zero point and multiply by its scale before the matmul. "
         "Do that arithmetic in x's dtype: codes are uint8 (a zero point subtracted there wraps around) and the "
         "scales fp16 (a weight rebuilt in fp16 is off by about 1e-4, past this case's tolerance of 1e-5)"),
        ("INT4 g128 asymmetric, one token", sealed_layer(40, 256, Scheme(4, 128), 3), (1, 1, 256),
         "a group size other than the first case's: read it from the shapes (in / layer.scales.shape[1]) rather "
         "than fixing it"),
        ("INT4 g64 symmetric (no stored zeros), x [2, 5, 128]", sealed_layer(24, 128, Scheme(4, 64, True), 2),
         (2, 5, 128),
         "a symmetric layer stores no zero points (layer.zeros is None): every group's zero point is "
         "2^(bits-1); x has two leading dimensions, which the output keeps"),
        ("INT8 per-channel symmetric: codes not packed", sealed_layer(8, 96, Scheme(8, None, True), 4), (4, 96),
         "8 bits: layer.packed holds the codes themselves, one per byte, not to be unpacked; its symmetric zero "
         "point is 2^(bits-1) = 128, not 4 bits' 8; per channel, one group spans the whole row "
         "(layer.scheme.group_size is None, layer.scales is [out, 1])"),
        ("x in bfloat16: the output in bfloat16 too", sealed_layer(16, 64, Scheme(4, 32), 5), (3, 64),
         "the scales are fp16 and x is bfloat16: the output must come back in x's dtype"),
    ]
    cases = []
    for label, (sealed, layer), shape, hint in layers:
        x = torch.randn(shape, generator=generator).to(torch.bfloat16 if "bfloat16" in label else torch.float32)
        loose = x.dtype == torch.bfloat16
        cases.append(Case(label, (sealed, x), layer(x), rtol=1e-2 if loose else 1e-5, atol=1e-2 if loose else 1e-5,
                          hint=hint))
    return cases


EXERCISES = [
    Exercise(
        id="ex06.1", title="Quantize and dequantize one group", points=2, function="quantize_group",
        returns=("codes", "scale", "zero", "w_hat"),
        cases=_group_cases,
        recipe="The usual slips: subtracting the zero point from uint8 codes, which wraps around (3 - 8 is 251 "
             "in uint8): make the codes float32 first; a grid that does not include 0 (lo and hi are widened to "
             "take it in); the zero point computed from the scale before it was rounded to fp16; a scale of 0 "
             "for an all-zero group, which must become 1.",
    ),
    Exercise(
        id="ex06.2", title="Pack and unpack 4-bit codes", points=2, function="Int4Packer",
        cases=_packing_cases, methods=("pack", "unpack"),
        recipe="pack: low nibble = codes[..., 0::2], high nibble = codes[..., 1::2] << 4, combined with |, as uint8; "
             "raise ValueError for an odd count or a code above 15. unpack: packed & 0x0F and packed >> 4, "
             "interleaved back (torch.stack([...], dim=-1).flatten(-2)).",
    ),
    Exercise(
        id="ex06.3", title="QuantLinear.forward", points=2, function="quant_linear_forward",
        cases=_forward_cases,
        recipe="codes = unpack_int4(layer.packed) for 4 bits (layer.packed itself for 8); zeros = layer.zeros, or "
             "2**(bits-1) everywhere when it is None. Make the codes x's dtype before subtracting (uint8 arithmetic "
             "wraps around). groups = layer.scales.shape[1], group size = in / groups (per channel: one group, "
             "the whole row). Reshape codes to [out, groups, group size], subtract the "
             "zeros and multiply by the scales (both [out, groups, 1]), reshape back to [out, in] and return "
             "F.linear(x, weight) in x's dtype.",
    ),
]
