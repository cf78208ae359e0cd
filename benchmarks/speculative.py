"""Speculative decoding against target-only greedy decoding: a draft model, prompt lookup, Medusa
heads (chains and trees) and early exit (lab 11).

    python benchmarks/speculative.py [--prompts 4] [--new-tokens 128] [--ks 2 3 4 6 8] [--repeats 2]
                                     [--compiled-draft | --aot-draft] [--tree-sizes 5 6 8 16 32]
                                     [--exit-layers 1 2 3] [--exit-ks 2 3 4 6]
                                     [--drafters draft lookup medusa early-exit]

Two workloads of ``--prompts`` prompts each, greedy, EOS ignored, batch 1, fp32 on the CPU:
- continuation: the first three lines of functions from the validation split, drafted by the
  shipped draft model, by the shipped Medusa heads (``labkit/checkpoints/medusa``: the chain of
  top-1 guesses at each depth, and trees of ``--tree-sizes`` nodes chosen from the heads'
  measured accuracies), and by the target's own first layers through the shipped early-exit
  adapters (``labkit/checkpoints/early-exit``);
- editing: a function, then its first two lines again (the answer would repeat much of the
  prompt), drafted by prompt lookup.
For each configuration, target-only and speculative decoding generate from every prompt, timed
alternately (target, speculative, target, ...); the outputs must be identical, token for token.
Printed per configuration: speedup (ratio of median times; beside it the ratio of the minima, which
a noisy machine disturbs less), draft acceptance rate, mean accepted
draft tokens per target call, tokens per target call, acceptance by depth; then the cost of a
draft step and of verifying k + 1 tokens, relative to one target decode step. With
``--compiled-draft`` the draft model's one-token steps run compiled (``labkit.compile``), with
``--aot-draft`` compiled ahead of time (``labkit.aot``), and its step cost is printed both ways.
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
from labkit import medusa
from labkit.early_exit import self_speculative_stream
from labkit.heads import load_exit_adapters, load_medusa
from labkit.speculative import (ModelDrafter, PromptLookupDrafter, SpeculationStats, continuation_prompts,
                                editing_prompts, speculative_stream)


def step_cost(model: torch.nn.Module, tokens: int, context: int = 128) -> float:
    """Median seconds of one forward call of ``tokens`` new tokens after ``context`` cached ones."""
    return measure(decode_step(model, context, tokens), warmup=5, repeats=50, device="cpu").median_s


def compiled_step_cost(model: torch.nn.Module, context: int = 128, ahead_of_time: bool = False) -> tuple[float, str]:
    """Median seconds of one compiled (or compiled ahead of time) one-token step after ``context``
    cached ones (static cache), and whose matrix products it runs (ahead of time, ``labkit.aot``
    may keep Inductor's in place of the library's)."""
    _, step = static_decoder(model, context + 1, ahead_of_time=ahead_of_time)
    tokens, positions = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), context)
    return (measure(lambda: step(tokens, positions), warmup=5, repeats=50, device="cpu").median_s,
            getattr(step, "products", "library"))


def sweep(target, runs, prompts, params, repeats) -> dict[str, float]:
    """Print one row per run ({label: (k, run(prompt, stats) -> token iterator)}), each timed in turn
    with the target alone; return each run's speedup (0 where its output was not identical)."""
    plain = lambda: [list(stream(target, p, params)) for p in prompts]
    expected = plain()
    for p in prompts:  # untimed: a compiled draft compiles its step here, outside the timings
        list(next(iter(runs.values()))[1](p, None))
    speedups = {}
    print(f"{'':>12}{'target s':>10}{'spec s':>9}{'speedup':>9}{'minima':>8}{'accept':>8}{'accepted':>10}"
          f"{'tok/call':>10}  identical  acceptance by depth")
    for label, (k, run) in runs.items():
        stats = [SpeculationStats(k)]
        outputs = []

        def speculative() -> None:
            stats[0] = SpeculationStats(k)
            outputs[:] = [list(run(p, stats[0])) for p in prompts]
        result = compare(plain, speculative, labels=("target", "speculative"), warmup=0, repeats=repeats,
                         device="cpu")
        s = stats[0]
        depths = " ".join("-" if a is None else f"{a:.2f}" for a in s.acceptance_by_position)
        print(f"{label:>12}{result.a.median_s:>10.2f}{result.b.median_s:>9.2f}{result.speedup:>8.2f}x"
              f"{result.speedup_of_minima:>7.2f}x{s.acceptance_rate:>8.2f}{s.mean_accepted:>10.2f}{s.tokens_per_call:>10.2f}  {outputs == expected!s:9}"
              f"  {depths}")
        speedups[label] = result.speedup if outputs == expected else 0.0
    return speedups


def drafter_runs(target, drafter, params, ks) -> dict:
    """Lab 05's runs: ``drafter`` with each k."""
    return {f"k={k}": (k, lambda p, s, k=k: speculative_stream(target, drafter, p, params, k, stats=s)) for k in ks}


def medusa_runs(target, tokenizer, params, sizes) -> dict:
    """Medusa with the shipped heads: the chain of top-1 guesses at each depth, then trees of
    ``sizes`` nodes chosen from the heads' accuracies by rank, measured on the target's own greedy
    text (32 validation prompts x 128 tokens, drawn with another seed than the timed ones)."""
    heads = load_medusa(target)
    topk = medusa.head_topk(target, heads, tokenizer, 32, 128)
    print("heads' top-1 / top-5 accuracy by depth: " + ", ".join(f"{topk[1][d]:.0%} / {topk[5][d]:.0%}"
                                                                 for d in range(heads.n)))
    chains = {f"chain {d}": medusa.chain_paths(d) for d in range(1, heads.n + 1)}
    trees = {f"tree {n}": medusa.choose_tree(medusa.rank_accuracy(topk), n) for n in sizes}
    return {label: (max(map(len, paths)), lambda p, s, paths=paths: medusa.medusa_stream(
        target, heads, p, params, paths, stats=s)) for label, paths in (chains | trees).items()}


def early_exit_runs(target, params, layers, ks) -> dict:
    """Self-speculation through the shipped adapters: each exit layer with each k."""
    adapters = load_exit_adapters(target)
    return {f"L'={layer} k={k}": (k, lambda p, s, layer=layer, k=k: self_speculative_stream(
        target, layer, p, params, k, adapter=adapters[layer], stats=s)) for layer in layers for k in ks}


def draft_label(args: argparse.Namespace) -> str:
    return " (compiled ahead of time)" if args.aot_draft else " (compiled)" if args.compiled_draft else ""


GOALS = {"draft": 1.5, "lookup": 1.5, "early-exit": 1.3}  # Medusa's goal is below: a tree, ahead of chains


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    parser.add_argument("--repeats", type=int, default=2)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--compiled-draft", action="store_true", help="compile the draft model's decode step")
    how.add_argument("--aot-draft", action="store_true", help="compile the draft's decode step ahead of time")
    parser.add_argument("--tree-sizes", type=int, nargs="+", default=[5, 6, 8, 16, 32], help="Medusa tree nodes")
    parser.add_argument("--exit-layers", type=int, nargs="+", default=[1, 2, 3], help="early-exit layers")
    parser.add_argument("--exit-ks", type=int, nargs="+", default=[2, 3, 4, 6], help="early-exit drafts per round")
    parser.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS),
                        help="which drafters to run (default: all)")
    args = parser.parse_args()
    target, tokenizer = labkit.load("target", device="cpu")
    draft, _ = labkit.load("draft", device="cpu")
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_at_eos=False)
    print(f"{datetime.date.today()}  {device_name('cpu')}  torch {torch.__version__}  "
          f"{torch.get_num_threads()} threads")
    print(f"target {target.num_parameters():,} parameters, draft {draft.num_parameters():,}, fp32; greedy, "
          f"{args.prompts} prompts x {args.new_tokens} new tokens; times are totals over the prompts")
    workloads = {"continuation": continuation_prompts(tokenizer, args.prompts),
                 "editing": editing_prompts(tokenizer, args.prompts)}
    speedups = {}
    for name in args.drafters:
        title, workload, make_runs = DRAFTERS[name]
        print(f"\n{title}{draft_label(args) * (name == 'draft')}, {workload} workload")
        speedups[name] = sweep(target, make_runs(target, draft, tokenizer, params, args), workloads[workload], params,
                               args.repeats)
    one = step_cost(target, 1)
    print(f"\none forward call, relative to a target decode step ({one * 1e3:.2f} ms) at context 128:")
    print(f"  draft decode step: {step_cost(draft, 1) / one:.3f}")
    if args.compiled_draft or args.aot_draft:
        cost, products = compiled_step_cost(draft, ahead_of_time=args.aot_draft)
        print(f"  draft decode step, {draft_label(args).strip(' ()')}: {cost / one:.3f} ({products} matrix products)")
    tokens = sorted({k + 1 for k in args.ks} | {n + 1 for n in args.tree_sizes})
    print("  the target over n tokens (verifying k = n - 1 drafts or a tree of n - 1 candidates): "
          + ", ".join(f"n={n} {step_cost(target, n) / one:.2f}" for n in tokens))
    print("\ngoals (the best run, identical output):")
    for name, found in speedups.items():
        if name == "medusa":
            chain = max(v for label, v in found.items() if label.startswith("chain"))
            tree = max(v for label, v in found.items() if label.startswith("tree"))
            print(f"  Medusa tree >= 1.8x and ahead of the best chain: tree {tree:.2f}x, chain {chain:.2f}x, "
                  f"{'met' if tree >= 1.8 and tree > chain else 'MISSED'}")
        else:
            best = max(found.values())
            print(f"  {DRAFTERS[name][0]} >= {GOALS[name]}x: {best:.2f}x, {'met' if best >= GOALS[name] else 'MISSED'}")


DRAFTERS = {  # name: (title, workload, runs(target, draft, tokenizer, params, args))
    "draft": ("draft model", "continuation", lambda target, draft, tokenizer, params, args: drafter_runs(
        target, ModelDrafter(draft, compiled=args.compiled_draft, ahead_of_time=args.aot_draft), params, args.ks)),
    "lookup": ("prompt lookup", "editing", lambda target, draft, tokenizer, params, args: drafter_runs(
        target, PromptLookupDrafter(target.config.vocab_size), params, args.ks)),
    "medusa": ("Medusa heads (chains, then trees)", "continuation",
               lambda target, draft, tokenizer, params, args: medusa_runs(target, tokenizer, params, args.tree_sizes)),
    "early-exit": ("early exit with the trained adapters", "continuation",
                   lambda target, draft, tokenizer, params, args: early_exit_runs(target, params, args.exit_layers,
                                                                                   args.exit_ks)),
}


if __name__ == "__main__":
    main()
