"""labkit's cached greedy decode against transformers' generate(), same weights, this device.

    python benchmarks/decode_vs_transformers.py [--model target] [--new-tokens 128] [--repeats 5]

The shipped model is written out as a Hugging Face Llama checkpoint and loaded with
``LlamaForCausalLM``; both generate greedily from the same prompt, batch 1, the same number of
new tokens, in fp32, timed alternately (labkit, transformers, labkit, ...). The outputs must be
identical token for token. Also times the draft's decode step against the target's, with torch's
default number of threads and with one, three ways: each model on its own (a run of its steps,
its weights warm in the caches); one call of each in turn (each draft step right after a target
step, which has pushed the draft's weights out of the core's L2); and as speculative decoding
runs them, a target step and then ``ROUND`` draft steps in a row (the first cold, the rest warm),
against a target step alone: the draft step is the difference over ``ROUND``. The draft's goal,
a step at most 1/8 of the target's, is judged the way speculative decoding uses it: in rounds,
with torch's default threads.
"""
from __future__ import annotations

import argparse
import datetime
import tempfile
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

import labkit
from labkit.bench import compare, measure
from labkit.device import device_name
from labkit.generate import SamplingParams, decode_step, stream
from labkit.load import save_hf
from labkit.model import Transformer

PROMPT = "import os\n\n\ndef read_config(path):\n"
ROUND = 4  # draft steps per round of speculative decoding
STEPS = 200  # timed decode steps per figure
DRAFT_GOAL = 1 / 8  # the draft's decode step against the target's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="target")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cpu")
    model, tokenizer = labkit.load(args.model, device=device)
    prompt = tokenizer.encode(PROMPT).ids
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_at_eos=False)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, Path(tmp))
        hf = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def run_labkit() -> list[int]:
        return list(stream(model, prompt, params))

    def run_hf() -> list[int]:
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    same = run_labkit() == run_hf()
    result = compare(run_labkit, run_hf, labels=("labkit", "transformers"), warmup=1,
                     repeats=args.repeats, device=device)
    print(f"{datetime.date.today()}  {device_name(device)}  torch {torch.__version__}  "
          f"model {args.model} ({model.num_parameters():,} parameters)  prompt {len(prompt)} tokens")
    print(f"greedy outputs identical: {same}")
    print(f"\n{'':<14}{'median s':>10}{'IQR s':>8}{'tokens/s':>10}")
    for timing in (result.a, result.b):
        print(f"{timing.label:<14}{timing.median_s:>10.3f}{timing.spread_s:>8.3f}"
              f"{args.new_tokens / timing.median_s:>10.1f}")
    print(f"labkit / transformers tokens/s: {1 / result.speedup:.2f}")

    draft, _ = labkit.load("draft", device=device)
    print()
    rounds = {threads: draft_against_target(model, draft, args.model, threads, device)
              for threads in sorted({torch.get_num_threads(), 1}, reverse=True)}  # torch's default, then one
    ratio = rounds[max(rounds)]
    print(f"\ngoals:\n  labkit / transformers tokens/s >= 1: {1 / result.speedup:.2f}, "
          f"{'met' if result.speedup <= 1 else 'MISSED'}")
    print(f"  draft / {args.model} decode step <= {DRAFT_GOAL:.3f} (in rounds, {max(rounds)} threads): {ratio:.3f}, "
          f"{'met' if ratio <= DRAFT_GOAL else 'MISSED'}")


def draft_against_target(model: Transformer, draft: Transformer, name: str, threads: int,
                         device: torch.device) -> float:
    """Print the draft's decode step against the target's, three ways, with ``threads``; return
    the ratio in rounds."""
    torch.set_num_threads(threads)
    target_step, draft_step = decode_step(model, 100), decode_step(draft, 100)

    def round_() -> None:
        target_step()
        for _ in range(ROUND):
            draft_step()

    def line(how: str, target_s: float, draft_s: float) -> None:
        print(f"  {how:<46}{name} {target_s * 1e3:5.2f} ms, draft {draft_s * 1e3:.2f} ms, "
              f"draft / {name} = {draft_s / target_s:.3f}")
    print(f"decode step at position 100, {threads} thread(s):")
    alone = [measure(step, warmup=20, repeats=STEPS, device=device).median_s for step in (target_step, draft_step)]
    line(f"each on its own, {STEPS} steps in a row:", *alone)
    steps = compare(target_step, draft_step, warmup=5, repeats=STEPS, device=device)
    line("one call of each in turn:", steps.a.median_s, steps.b.median_s)
    rounds = compare(target_step, round_, warmup=5, repeats=STEPS, device=device)
    drafted = (rounds.b.median_s - rounds.a.median_s) / ROUND
    line(f"in rounds, a {name} step then {ROUND} draft steps:", rounds.a.median_s, drafted)
    return drafted / rounds.a.median_s


if __name__ == "__main__":
    main()
