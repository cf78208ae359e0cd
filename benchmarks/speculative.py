"""Speculative decoding against target-only greedy decoding, for both drafters.

    python benchmarks/speculative.py [--prompts 4] [--new-tokens 128] [--ks 2 3 4 6 8] [--repeats 2]
                                     [--compiled-draft]

Two workloads of ``--prompts`` prompts each, greedy, EOS ignored, batch 1, fp32 on the CPU:
- continuation: the first three lines of functions from the validation split, drafted by the
  shipped draft model;
- editing: a function, then its first two lines again (the answer would repeat much of the
  prompt), drafted by prompt lookup.
For each k, target-only and speculative decoding generate from every prompt, timed alternately
(target, speculative, target, ...); the outputs must be identical, token for token. Printed per
k: speedup (ratio of median times), draft acceptance rate, mean accepted draft tokens per target
call, tokens per target call; then the cost of a draft step and of verifying k + 1 tokens,
relative to one target decode step. With ``--compiled-draft`` the draft model's one-token steps
run compiled (``labkit.compile``), and its step cost is printed both ways.
"""
from __future__ import annotations

import argparse
import datetime

import torch

import labkit
from labkit.bench import compare, measure
from labkit.compile import static_decoder
from labkit.device import device_name
from labkit.generate import SamplingParams, decode_step, stream
from labkit.speculative import (ModelDrafter, PromptLookupDrafter, SpeculationStats, continuation_prompts,
                                editing_prompts, speculative_stream)


def step_cost(model: torch.nn.Module, tokens: int, context: int = 128) -> float:
    """Median seconds of one forward call of ``tokens`` new tokens after ``context`` cached ones."""
    return measure(decode_step(model, context, tokens), warmup=5, repeats=50, device="cpu").median_s


def compiled_step_cost(model: torch.nn.Module, context: int = 128) -> float:
    """Median seconds of one compiled one-token step after ``context`` cached ones (static cache)."""
    _, step = static_decoder(model, context + 1)
    tokens, positions = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), context)
    return measure(lambda: step(tokens, positions), warmup=5, repeats=50, device="cpu").median_s


def sweep(target, drafter, prompts, params, ks, repeats) -> float:
    """Print one row per k; return the best speedup among those with identical output."""
    plain = lambda: [list(stream(target, p, params)) for p in prompts]
    expected = plain()
    for p in prompts:  # untimed: a compiled draft compiles its step here, outside the timings
        list(speculative_stream(target, drafter, p, params, ks[0]))
    best = 0.0
    print(f"{'k':>3}{'target s':>10}{'spec s':>9}{'speedup':>9}{'accept':>8}{'accepted':>10}{'tok/call':>10}"
          "  identical")
    for k in ks:
        stats = [SpeculationStats(k)]
        outputs = []

        def speculative() -> None:
            stats[0] = SpeculationStats(k)
            outputs[:] = [list(speculative_stream(target, drafter, p, params, k, stats=stats[0])) for p in prompts]
        result = compare(plain, speculative, labels=("target", "speculative"), warmup=0, repeats=repeats,
                         device="cpu")
        s = stats[0]
        print(f"{k:>3}{result.a.median_s:>10.2f}{result.b.median_s:>9.2f}{result.speedup:>8.2f}x"
              f"{s.acceptance_rate:>8.2f}{s.mean_accepted:>10.2f}{s.tokens_per_call:>10.2f}  {outputs == expected}")
        best = max(best, result.speedup if outputs == expected else 0.0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compiled-draft", action="store_true", help="compile the draft model's decode step")
    args = parser.parse_args()
    target, tokenizer = labkit.load("target", device="cpu")
    draft, _ = labkit.load("draft", device="cpu")
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_at_eos=False)
    print(f"{datetime.date.today()}  {device_name('cpu')}  torch {torch.__version__}  "
          f"{torch.get_num_threads()} threads")
    print(f"target {target.num_parameters():,} parameters, draft {draft.num_parameters():,}, fp32; greedy, "
          f"{args.prompts} prompts x {args.new_tokens} new tokens; times are totals over the prompts\n")
    print(f"draft model{' (compiled)' * args.compiled_draft}, continuation workload")
    drafter = ModelDrafter(draft, compiled=args.compiled_draft)
    best_draft = sweep(target, drafter, continuation_prompts(tokenizer, args.prompts), params, args.ks, args.repeats)
    print("\nprompt lookup, editing workload")
    lookup = PromptLookupDrafter(target.config.vocab_size)
    best_lookup = sweep(target, lookup, editing_prompts(tokenizer, args.prompts), params, args.ks, args.repeats)
    one = step_cost(target, 1)
    print(f"\none forward call, relative to a target decode step ({one * 1e3:.2f} ms) at context 128:")
    verify = ", ".join(f"k={k} {step_cost(target, k + 1) / one:.2f}" for k in args.ks)
    print(f"  draft decode step: {step_cost(draft, 1) / one:.3f}")
    if args.compiled_draft:
        print(f"  draft decode step, compiled: {compiled_step_cost(draft) / one:.3f}")
    print(f"  target verifying k + 1 tokens: {verify}")
    print("\ngoals (best k, identical output):")
    for name, best in (("draft model", best_draft), ("prompt lookup", best_lookup)):
        print(f"  {name} >= 1.5x: {best:.2f}x, {'met' if best >= 1.5 else 'MISSED'}")


if __name__ == "__main__":
    main()
