"""Fragmentation of contiguous against paged KV-cache allocation (issue 6, notebook 03).

A workload of requests with lognormal prompt and output lengths and a 2,048-token context,
every sequence at its full length. Contiguous allocation reserves the context for each;
paged allocation holds ceil(L / block_size) blocks. Prints the waste of each and how many
sequences fit in the memory of 16 contiguous ones (filling a real BlockAllocator).

    .venv/bin/python benchmarks/paged_fragmentation.py
"""
from __future__ import annotations

import argparse

from labkit.memory import fragmentation
from labkit.paged import sequences_that_fit
from labkit.workload import workload_lengths

GOALS = {"paged_waste": 0.04, "contiguous_waste": 0.60, "fit_ratio": 2.5}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--contiguous-sequences", type=int, default=16, help="the memory budget, in max-length sequences")
    args = parser.parse_args(argv)
    lengths = workload_lengths(args.requests, args.context)
    print(f"{len(lengths)} requests, context {args.context}, mean length {sum(lengths) / len(lengths):.0f}; "
          f"memory of {args.contiguous_sequences} contiguous sequences")
    print(f"{'block':>6}{'contiguous waste':>18}{'paged waste':>13}{'contiguous fit':>16}{'paged fit':>11}{'ratio':>8}")
    for block_size in (1, 4, 8, 16, 32, 64, 128, 256):
        stats = fragmentation(lengths, args.context, block_size)
        fitted = sequences_that_fit(lengths, args.contiguous_sequences * args.context, block_size)
        ratio = fitted / args.contiguous_sequences
        print(f"{block_size:>6}{stats['contiguous_waste']:>18.1%}{stats['paged_waste']:>13.1%}"
              f"{args.contiguous_sequences:>16}{fitted:>11}{ratio:>7.2f}x")
        if block_size == 16:
            goals = (stats["paged_waste"] <= GOALS["paged_waste"], stats["contiguous_waste"] >= GOALS["contiguous_waste"],
                     ratio >= GOALS["fit_ratio"])
    print(f"goals at block 16 (paged waste <= 4%, contiguous waste >= 60%, >= 2.5x sequences): "
          f"{'met' if all(goals) else 'MISSED'} {goals}")
    return 0 if all(goals) else 1


if __name__ == "__main__":
    raise SystemExit(main())
