"""Workloads for serving experiments: how long prompts and outputs are, and when requests arrive.

Real chat traffic is mostly short requests and a few long ones: lengths are drawn lognormal
around a median, clipped to a range. Offline, every request is there at the start; online,
arrivals are a Poisson process (exponential gaps) at a given rate. Everything is seeded: the
same arguments give the same requests.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, Sequence

import torch

from labkit.engine import Request
from labkit.generate import SamplingParams
from labkit.validate import check_ints


def _arrivals_seed(seed: int) -> int:
    """The seed of a workload's arrivals, a hash of its ``seed``: the same seed would give the arrivals the very
    numbers its lengths were drawn from (long prompts would come in bunches), and so would ``seed`` plus any
    multiple of 2^32, since torch's CPU generator reads only a seed's low 32 bits."""
    return int.from_bytes(hashlib.sha256(f"arrivals {seed}".encode()).digest()[:4], "little")


def lognormal_lengths(n: int, median: float, sigma: float, low: int, high: int,
                      seed: int | torch.Generator) -> list[int]:
    """``n`` token counts, lognormal around ``median`` (spread ``sigma``), clipped to [low, high];
    drawn from ``seed``, a generator or the seed of a fresh one."""
    check_ints(n=n)
    _check_lognormal(median, sigma, low, high)
    generator = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    draws = torch.exp(math.log(median) + sigma * torch.randn(n, generator=generator, dtype=torch.float64))
    return draws.round().clamp(low, high).long().tolist()


def _check_lognormal(median: float, sigma: float, low: int, high: int) -> None:
    check_ints(low=low, high=high)
    if not (median > 0 and sigma >= 0 and 1 <= low <= high):
        raise ValueError(f"lognormal({median}, {sigma}, {low}, {high}): need median > 0, sigma >= 0, 1 <= low <= high")


def workload_lengths(n: int = 400, context: int = 2048, prompt_median: float = 256, output_median: float = 128,
                     spread: float = 1.0, seed: int = 0) -> list[int]:
    """Final lengths (prompt + output, capped at ``context``) of ``n`` requests whose prompt and
    output lengths are lognormal: most short, a few long."""
    check_ints(context=context)
    if context < 2:
        raise ValueError(f"context={context} must be at least 2: a prompt of 1 token and 1 new one")
    prompts = lognormal_lengths(n, prompt_median, spread, 1, context - 1, seed)
    outputs = lognormal_lengths(n, output_median, spread, 1, context, seed + 1)
    return [min(p + o, context) for p, o in zip(prompts, outputs)]


LengthDistribution = Callable[[int, torch.Generator], list[int]]


def uniform(low: int, high: int) -> LengthDistribution:
    """Token counts uniform in [low, high]."""
    check_ints(low=low, high=high)
    if not 1 <= low <= high:
        raise ValueError(f"uniform({low}, {high}): need 1 <= low <= high")
    return lambda n, generator: torch.randint(low, high + 1, (n,), generator=generator).tolist()


def lognormal(median: float, sigma: float, low: int, high: int) -> LengthDistribution:
    """Token counts lognormal around ``median`` (spread ``sigma``), clipped to [low, high]: most
    short, a few long, as in real chat traffic."""
    _check_lognormal(median, sigma, low, high)  # now, not at the first draw
    return lambda n, generator: lognormal_lengths(n, median, sigma, low, high, generator)


def poisson_arrivals(n: int, rate: float, seed: int | torch.Generator = 0, exact: bool = False) -> list[float]:
    """Arrival times (s) of ``n`` requests as a Poisson process at ``rate`` per second: exponential
    gaps of mean 1 / rate, the first at 0; drawn from ``seed``, a generator or the seed of a fresh one.

    The rate that ``n`` such arrivals make strays from ``rate`` by about 1 / sqrt(n) of it. With
    ``exact``, the gaps are scaled so that their mean is exactly 1 / rate: the last arrival comes at
    (n - 1) / rate, the others at random between, as a Poisson process does given how many arrivals
    fall in that time (exponential gaps divided by their sum are the gaps of points uniform at random)."""
    if n < 1 or not rate > 0:
        raise ValueError(f"n={n} must be >= 1 and rate={rate} requests/s > 0")
    generator = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    gaps = torch.empty(n, dtype=torch.float64).exponential_(rate, generator=generator)
    gaps[0] = 0.0
    if exact and n > 1:
        gaps *= (n - 1) / rate / gaps.sum()
    return gaps.cumsum(0).tolist()


def make_workload(n: int, prompt_lengths: LengthDistribution, output_lengths: LengthDistribution, *,
                  rate: float | None = None, vocab_size: int = 4096, prefix: Sequence[int] = (),
                  temperature: float = 0.0, seed: int = 0, id_prefix: str = "req", exact: bool = False
                  ) -> list[Request]:
    """``n`` requests with random prompt tokens (after a shared ``prefix``, if given) and
    lengths drawn from the distributions; each generates exactly its drawn output length (EOS
    ignored, as serving benchmarks do). Offline (``rate`` None): all arrive at 0; online: Poisson
    arrivals at ``rate`` requests per second (``exact``: at exactly that rate on average, as
    ``poisson_arrivals`` says). Seeded: the same arguments give the same requests, and the arrivals
    are drawn apart from the lengths and tokens, so the same seed and rate give the same arrival
    times whatever the lengths: two workloads that differ only in their lengths meet the same traffic."""
    check_ints(n=n, vocab_size=vocab_size)
    if n < 1 or vocab_size < 1 or (rate is not None and not rate > 0):
        raise ValueError(f"n={n} and vocab_size={vocab_size} must be >= 1, and rate={rate} None (offline) or > 0")
    generator = torch.Generator().manual_seed(seed)
    prompts, outputs = prompt_lengths(n, generator), output_lengths(n, generator)
    tokens = [torch.randint(vocab_size, (p,), generator=generator).tolist() for p in prompts]
    arrivals = poisson_arrivals(n, rate, _arrivals_seed(seed), exact) if rate else [0.0] * n
    return [Request(f"{id_prefix}{i}", list(prefix) + t,
                    SamplingParams(max_new_tokens=o, temperature=temperature, stop_at_eos=False, seed=seed + i),
                    arrival_time=a)
            for i, (t, o, a) in enumerate(zip(tokens, outputs, arrivals))]
