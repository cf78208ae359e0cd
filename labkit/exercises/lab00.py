"""Notebook 00 (welcome): the roofline, in two small functions."""
from __future__ import annotations

from labkit.exercises.spec import Case, Exercise
from labkit.hardware import attainable_flops, matmul_intensity
from labkit.presets import GPU_PRESETS


def _intensity_cases() -> list[Case]:
    shapes = [
        ("decode step: one token through a 4096 x 4096 fp16 layer", (1, 4096, 4096, 2),
         "with m = 1 the weight matrix B is almost all the bytes moved, and each of its elements takes part in "
         "one multiply and one add, so the answer is close to 1 FLOP per byte; but A (1 x k) and C (1 x n) count "
         "too: an answer off in the 4th digit, above the right one, has left one of them out (or divided by the "
         "bytes of a part that is not moved); one below it counts bytes twice (C read and written) or divides bytes "
         "by FLOPs"),
        ("prefill: 512 tokens through a 4096 x 4096 fp16 layer", (512, 4096, 4096, 2),
         "with 512 rows the activations A and the output C are no longer negligible next to B: count all three"),
        ("square 4096 fp16 matmul", (4096, 4096, 4096, 2),
         "A, B and C are all 4096 x 4096 here: the bytes are three matrices, the FLOPs 2 * 4096**3"),
        ("an MLP up-projection, 16 tokens, fp32", (16, 11008, 4096, 4),
         "here n and k differ and an element is 4 bytes: check which dimensions each of A (m x k), B (k x n) "
         "and C (m x n) has, and that bytes_per_element scales all of them"),
        ("rectangular int8", (64, 128, 256, 1),
         "one byte per element: check that every matrix's element count uses its own two dimensions"),
    ]
    return [Case(label, args, matmul_intensity(*args), hint=hint) for label, args, hint in shapes]


def _roofline_cases() -> list[Case]:
    h100 = GPU_PRESETS["H100-SXM"]
    t4 = GPU_PRESETS["T4"]
    memory = "far below the ridge the memory system is the limit: each byte brought in allows I FLOPs"
    compute = "far above the ridge the bytes arrive faster than the FLOPs can be done: the limit is the peak"
    points = [
        ("H100, decode (I = 1)", (1.0, h100.peak_flops, h100.bandwidth), memory),
        ("H100, I = 4", (4.0, h100.peak_flops, h100.bandwidth),
         memory + ": the roof rises with I, as I x bandwidth (at I = 1 that is also bandwidth / I, which is why "
         "the case before passed)"),
        ("H100, at the ridge point", (h100.ridge_intensity, h100.peak_flops, h100.bandwidth),
         "at the ridge both limits are equal: the answer is the peak, reached exactly there"),
        ("H100, a little below the ridge (0.8 x)", (0.8 * h100.ridge_intensity, h100.peak_flops, h100.bandwidth),
         "just below the ridge memory still limits, at I x bandwidth, 80% of the peak: the two limits cross where "
         "I x bandwidth = peak, at I = peak / bandwidth for the machine given, not at a fixed I"),
        ("H100, a little above the ridge (1.25 x)", (1.25 * h100.ridge_intensity, h100.peak_flops, h100.bandwidth),
         "just above the ridge the peak is the limit already: the two limits cross where I x bandwidth = peak, "
         "at I = peak / bandwidth for the machine given, not at a fixed I"),
        ("H100, large matmul (I = 1365)", (1365.0, h100.peak_flops, h100.bandwidth), compute),
        ("T4, I = 50", (50.0, t4.peak_flops, t4.bandwidth), "a T4's ridge is near 200 FLOPs per byte, so "
         "I = 50 is below it: " + memory),
        ("T4, I = 500", (500.0, t4.peak_flops, t4.bandwidth), compute),
        ("no FLOPs at all (I = 0)", (0.0, t4.peak_flops, t4.bandwidth),
         "a kernel that does no arithmetic achieves 0 FLOP/s, however fast its memory"),
    ]
    return [Case(label, args, attainable_flops(*args), hint=hint) for label, args, hint in points]


EXERCISES = [
    Exercise(
        id="ex00.1", title="Arithmetic intensity of a matmul", points=2, function="matmul_intensity",
        cases=_intensity_cases,
        recipe="FLOPs are 2*m*n*k (a multiply and an add per term); bytes are bytes_per_element "
             "times the elements of A (m x k), B (k x n) and C (m x n).",
    ),
    Exercise(
        id="ex00.2", title="The roofline", points=1, function="attainable_flops",
        cases=_roofline_cases,
        recipe="A kernel is capped by compute (peak_flops) and by memory (intensity * bandwidth): "
             "it gets the smaller of the two.",
    ),
]
