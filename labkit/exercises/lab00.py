"""Notebook 00 (welcome): the roofline, in two small functions."""
from __future__ import annotations

from labkit.exercises.spec import Case, Exercise
from labkit.hardware import attainable_flops, matmul_intensity
from labkit.presets import GPU_PRESETS


def _intensity_cases() -> list[Case]:
    shapes = [
        ("decode step: one token through a 4096 x 4096 fp16 layer", (1, 4096, 4096, 2)),
        ("prefill: 512 tokens through a 4096 x 4096 fp16 layer", (512, 4096, 4096, 2)),
        ("square 4096 fp16 matmul", (4096, 4096, 4096, 2)),
        ("an MLP up-projection, 16 tokens, fp32", (16, 11008, 4096, 4)),
        ("rectangular int8", (64, 128, 256, 1)),
    ]
    return [Case(label, args, matmul_intensity(*args)) for label, args in shapes]


def _roofline_cases() -> list[Case]:
    h100 = GPU_PRESETS["H100-SXM"]
    t4 = GPU_PRESETS["T4"]
    points = [
        ("H100, decode (I = 1)", (1.0, h100.peak_flops, h100.bandwidth)),
        ("H100, at the ridge point", (h100.ridge_intensity, h100.peak_flops, h100.bandwidth)),
        ("H100, large matmul (I = 1365)", (1365.0, h100.peak_flops, h100.bandwidth)),
        ("T4, I = 50", (50.0, t4.peak_flops, t4.bandwidth)),
        ("T4, I = 500", (500.0, t4.peak_flops, t4.bandwidth)),
        ("no FLOPs at all (I = 0)", (0.0, t4.peak_flops, t4.bandwidth)),
    ]
    return [Case(label, args, attainable_flops(*args)) for label, args in points]


EXERCISES = [
    Exercise(
        id="ex00.1", title="Arithmetic intensity of a matmul", points=2, function="matmul_intensity",
        cases=_intensity_cases,
        hint="FLOPs are 2*m*n*k (a multiply and an add per term); bytes are bytes_per_element "
             "times the elements of A (m x k), B (k x n) and C (m x n).",
    ),
    Exercise(
        id="ex00.2", title="The roofline", points=1, function="attainable_flops",
        cases=_roofline_cases,
        hint="A kernel is capped by compute (peak_flops) and by memory (intensity * bandwidth): "
             "it gets the smaller of the two.",
    ),
]
