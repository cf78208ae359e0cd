"""Continuous against static batching and transformers' generate(), and prefix caching.

    .venv/bin/python benchmarks/continuous_batching.py [--requests 64] [--kv-tokens 4096] [--repeats 1]
                                                       [--device cpu] [--decode-kernel cpp|triton|none]
                                                       [--also-headroom H] [--also-free-attention] [--dtype fp32|bf16]

1. Throughput. ``--requests`` requests (lognormal prompts of 8 to 256 tokens, median 64; outputs
   uniform in [16, 256]; all arriving at 0; EOS ignored, so each generates exactly its drawn
   length) through three systems on the shipped ``target`` model, fp32 (``--dtype bf16``: all
   three in bfloat16, the engine without the fp32-only C++ kernel), on ``--device`` (the
   goals are this CPU's; ``cuda`` runs the same on a GPU), each with the
   same KV-cache memory of ``--kv-tokens`` token slots:
   - continuous batching: labkit's ``Engine`` over kv_tokens / block_size paged blocks, running
     as many requests as the blocks hold (up to ``--max-num-seqs``; admitting one only while a
     free block per running request remains, the scheduler's default headroom) and preempting
     when they run out (``--also-headroom 0`` adds a run that admits whenever a prompt fits;
     ``--also-free-attention`` one whose decode attention costs nothing, as a bound).
     Its decoding sequences attend through ``--decode-kernel``: on the CPU by default labkit's
     C++ operator (``labkit.kernels.paged_decode_cpu``), which reads the pools through the block
     tables; the engine then also runs without it (gathering each sequence's blocks, then SDPA),
     and both are printed;
   - static batching: ``run_static``, whose padded batch reserves for each request the longest
     prompt plus the longest output it may produce (256 + 256 = 512 slots): kv_tokens / 512
     requests per batch (8 by default);
   - transformers: ``LlamaForCausalLM.generate()`` on the same weights, batches of that size in
     request order, left-padded, greedy, every row running to the batch's longest output (the
     same padded work as static batching); each request keeps its first n tokens.
   Output throughput is the sum of the drawn output lengths over the wall time of the run. The
   systems run one after another in one process (A B C A B C with ``--repeats``; the run with
   the median wall time is shown), after a warm-up of each on a few requests. A statically
   batched request completes with its batch (``run_static``), so its TPOT includes the wait for
   the batch's longest member.
2. Prefix caching. ``--prefix-requests`` requests, each a shared ``--prefix``-token prefix (random
   tokens), then a 16 to 64-token question, answered in 16 to 32 tokens, through the ``Engine``
   with and without prefix caching (a fresh engine each, the same pool). The outputs must be
   identical; with caching, every request after the first reads the prefix's keys and values
   from the cache instead of recomputing them, which cuts the time to its first token.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, TypeVar

import torch
import transformers
from transformers import LlamaForCausalLM

import labkit
from labkit.device import device_name
from labkit.engine import Engine, Request, SchedulerConfig, StepRecord
from labkit.load import save_hf
from labkit.memory import kv_bytes_per_token, shape_of, weight_bytes
from labkit.metrics import summarize
from labkit.model import Transformer
from labkit.paged_attention import DecodeKernel
from labkit.static_batching import padded_prompts, run_static
from labkit.workload import lognormal, make_workload, uniform

T = TypeVar("T")
PROMPT = dict(median=64, sigma=0.8, low=8)  # throughput part: lognormal, clipped to [low, --max-prompt]
QUESTION, ANSWER = (16, 64), (16, 32)  # prefix part: lengths after the prefix, and of the outputs
GOALS = {"continuous / static": 3.0, "continuous / transformers": 3.0, "TTFT cut by prefix caching": 5.0}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GATHERS = "continuous, PyTorch gathers"  # the engine without a decode kernel, run too when it has one


def decode_kernel(args: argparse.Namespace) -> DecodeKernel | None:
    """The engine's decode attention by ``--decode-kernel``; None: gather the blocks, then SDPA. The
    C++ operator is built here, before any timing (the first build compiles for about 10 s); where
    it cannot be built and was not asked for by name, the engine runs without it and says why."""
    if args.decode_kernel == "triton":
        from labkit.kernels import paged_decode
        return paged_decode
    if args.decode_kernel is None and args.device == "cpu" and args.dtype != "fp32":
        print(f"(the engine runs without a decode kernel: the C++ one is fp32 only, not {args.dtype})")
        return None
    if args.decode_kernel in ("cpp", None) and args.device == "cpu":
        from labkit.kernels.paged_decode_cpu import build, paged_decode_cpu
        try:
            build()
        except RuntimeError as error:
            if args.decode_kernel == "cpp":
                raise
            print(f"(the engine runs without a decode kernel: {error})")
            return None
        return paged_decode_cpu
    if args.decode_kernel == "cpp":
        raise ValueError(f"--decode-kernel cpp runs on the CPU, not on --device {args.device}")
    return None


def free_decode_attention(q: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    """A decode kernel that costs nothing and returns zeros (``--also-free-attention``): the engine's
    time if decode attention were free, a bound on what any kernel can give. Its tokens are then
    meaningless, but its schedule is the same, since EOS is ignored."""
    return torch.zeros_like(q)


@dataclass
class Run:
    """One system's run: its wall time, the tokens each request generated, the engine's metrics
    (``summarize``; None for transformers), how it batched, the engine's preemptions and the tokens
    its requests read from the prefix cache (``Request.cached_tokens``), and the step log (labkit's
    systems; empty for transformers)."""

    name: str
    wall_s: float
    outputs: list[list[int]]
    figures: dict | None
    batching: str
    preemptions: int = 0
    cached_tokens: int = 0
    log: list[StepRecord] = field(default_factory=list)


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_engine(name: str, model: Transformer, requests: list[Request], num_blocks: int, block_size: int,
               config: SchedulerConfig, prefix_caching: bool = True, decode_kernel: DecodeKernel | None = None) -> Run:
    def serve() -> tuple[Engine, list[Request]]:  # the pool is allocated in the timing
        engine = Engine(model, num_blocks, block_size, config, prefix_caching, decode_kernel=decode_kernel)
        return engine, engine.run(requests)
    wall, (engine, done) = timed(serve)
    peak = max(len(step.batch) for step in engine.log)
    return Run(name, wall, [r.output for r in done], summarize(done), f"paged, up to {peak}",
               sum(r.preemptions for r in done), sum(r.cached_tokens for r in done), engine.log)


def run_static_batches(name: str, model: Transformer, requests: list[Request], batch_size: int) -> Run:
    wall, (done, log) = timed(lambda: run_static(model, requests, batch_size))
    return Run(name, wall, [r.output for r in done], summarize(done), f"padded, {batch_size}", log=log)


def run_transformers(name: str, hf: LlamaForCausalLM, requests: list[Request], batch_size: int) -> Run:
    """Batches of ``batch_size`` in order, left-padded with 0 (``padded_prompts``, masked out),
    greedy, no early stop: every row generates the batch's longest drawn output."""
    def generate() -> list[list[int]]:
        outputs = []
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            ids, positions = padded_prompts(batch, hf.device)
            new = max(r.params.max_new_tokens for r in batch)
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=(positions >= 0).long(), do_sample=False, max_new_tokens=new,
                                  min_new_tokens=new, eos_token_id=None, pad_token_id=0)
            width = ids.shape[1]
            outputs += [row[width:width + r.params.max_new_tokens].tolist() for row, r in zip(out, batch)]
        return outputs
    wall, outputs = timed(generate)
    return Run(name, wall, outputs, None, f"padded, {batch_size}")


def median_runs(runs: list[Run]) -> dict[str, Run]:
    """Per system, the run with the median wall time (the lower middle one of an even count)."""
    by_name: dict[str, list[Run]] = {}
    for run in runs:
        by_name.setdefault(run.name, []).append(run)
    return {name: sorted(rs, key=lambda r: r.wall_s)[(len(rs) - 1) // 2] for name, rs in by_name.items()}


def in_turn(systems: dict[str, Callable[[list[Request]], Run]], workload: Callable[..., list[Request]],
            warmup: int, repeats: int) -> dict[str, Run]:
    """Warm each system up on ``warmup`` other requests, then run them in turn ``repeats`` times,
    each on a fresh copy of the workload; the median run of each (every run's wall time printed)."""
    for system in systems.values():
        system(workload(warmup, seed=100))
    runs = [system(workload()) for _ in range(repeats) for system in systems.values()]
    if repeats > 1:
        print("wall s of each run, in order: " + "; ".join(
            f"{name} " + " ".join(f"{r.wall_s:.1f}" for r in runs if r.name == name) for name in systems) + "\n")
    return median_runs(runs)


def print_table(runs: dict[str, Run], output_tokens: int) -> None:
    print(f"{'':<30}{'batching':>16}{'wall s':>8}{'out tok/s':>11}{'req/s':>7}{'preempt':>9}"
          f"{'TTFT ms: mean':>15}{'p99':>8}{'TPOT ms: mean':>15}{'p99':>7}")
    for run in runs.values():
        f = run.figures
        latency = (f"{f['mean_ttft_ms']:>15.0f}{f['p99_ttft_ms']:>8.0f}{f['mean_tpot_ms']:>15.1f}"
                   f"{f['p99_tpot_ms']:>7.1f}" if f else f"{'-':>15}{'-':>8}{'-':>15}{'-':>7}")
        print(f"{run.name:<30}{run.batching:>16}{run.wall_s:>8.1f}{output_tokens / run.wall_s:>11.1f}"
              f"{len(run.outputs) / run.wall_s:>7.2f}{run.preemptions:>9}{latency}")


def print_steps(static: Run, cont: Run) -> None:
    """The throughput ratio as fewer steps times dearer steps: how many forward passes each ran,
    how many rows (sequences) and tokens a step, and the wall time per step."""
    for run in (static, cont):
        rows, tokens = (sum(f(step) for step in run.log) / len(run.log)
                        for f in (lambda s: len(s.batch), lambda s: sum(n for _, n, _ in s.batch)))
        print(f"{run.name}: {len(run.log)} steps of {rows:.1f} rows ({tokens:.1f} tokens) on average, "
              f"{run.wall_s / len(run.log) * 1e3:.1f} ms each")
    fewer, dearer = len(static.log) / len(cont.log), (cont.wall_s / len(cont.log)) / (static.wall_s / len(static.log))
    print(f"continuous runs {fewer:.2f}x fewer steps, each {dearer:.2f}x as long: {fewer / dearer:.2f}x")


def agreement(a: Run, b: Run) -> str:
    same = sum(x == y for x, y in zip(a.outputs, b.outputs))
    return f"{same}/{len(a.outputs)} requests"


def throughput(model: Transformer, args: argparse.Namespace) -> dict[str, float]:
    def workload(n: int = args.requests, seed: int = 0) -> list[Request]:
        return make_workload(n, lognormal(**PROMPT, high=args.max_prompt), uniform(args.min_output, args.max_output),
                             vocab_size=model.config.vocab_size, seed=seed)
    batch = args.kv_tokens // (args.max_prompt + args.max_output)
    if batch < 1:
        raise ValueError(f"--kv-tokens {args.kv_tokens} is less than one padded request, "
                         f"{args.max_prompt} + {args.max_output} slots")
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, Path(tmp))
        hf = LlamaForCausalLM.from_pretrained(tmp, dtype=DTYPES[args.dtype], attn_implementation="sdpa").eval()
    hf.to(model.device)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens)
    blocks, kernel = args.kv_tokens // args.block_size, args.kernel
    hf_name, wide = "transformers generate()", f"static, unconstrained batch {args.requests}"
    systems = {"static": lambda w: run_static_batches("static", model, w, batch),
               "continuous": lambda w: run_engine("continuous", model, w, blocks, args.block_size, config,
                                                  decode_kernel=kernel),
               hf_name: lambda w: run_transformers(hf_name, hf, w, batch)}
    if kernel is not None:
        systems[GATHERS] = lambda w: run_engine(GATHERS, model, w, blocks, args.block_size, config)
    if args.also_unconstrained:
        systems[wide] = lambda w: run_static_batches(wide, model, w, args.requests)
    if args.also_free_attention:
        free = "continuous, free decode attn"
        systems[free] = lambda w: run_engine(free, model, w, blocks, args.block_size, config,
                                             decode_kernel=free_decode_attention)
    if args.also_headroom is not None:
        other, extra = replace(config, headroom=args.also_headroom), f"continuous, headroom {args.also_headroom}"
        systems[extra] = lambda w: run_engine(extra, model, w, blocks, args.block_size, other)
    requests = workload()
    output_tokens = sum(r.params.max_new_tokens for r in requests)
    prompts = [len(r.prompt) for r in requests]
    print(f"\n1. Throughput: {len(requests)} requests at t=0, prompts {min(prompts)}..{max(prompts)} tokens "
          f"(mean {statistics.mean(prompts):.0f}), outputs uniform in [{args.min_output}, {args.max_output}] "
          f"({output_tokens} tokens, EOS ignored)")
    shape = shape_of(args.model, model.config, model.num_parameters())
    kv_mb, weights_mb = (x * 1e-6 for x in (args.kv_tokens * kv_bytes_per_token(shape, args.dtype),
                                            weight_bytes(shape, args.dtype)))
    print(f"KV memory {args.kv_tokens} token slots ({kv_mb:.1f} MB, {kv_mb / weights_mb:.2f}x the weights' "
          f"{weights_mb:.1f} MB) for each: continuous {blocks} blocks of {args.block_size} "
          f"(max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_batched_tokens}, headroom "
          f"{config.headroom}, decode kernel: {getattr(kernel, '__name__', 'none')}); static and "
          f"transformers batch {batch} = {args.kv_tokens} // ({args.max_prompt} + {args.max_output})")
    groups = [requests[i:i + batch] for i in range(0, len(requests), batch)]  # static's batches (all arrive at 0)
    rows = sum(len(group) * max(r.params.max_new_tokens for r in group) for group in groups)
    print(f"static batching decodes {rows} rows for these {output_tokens} tokens ({rows / output_tokens:.2f}x): "
          f"a batch runs every row until its longest output is done\n")
    runs = in_turn(systems, workload, args.warmup, args.repeats)
    print_table(runs, output_tokens)
    cont = runs["continuous"]
    ratios = {"continuous / static": runs["static"].wall_s / cont.wall_s,
              "continuous / transformers": runs[hf_name].wall_s / cont.wall_s}
    print("\noutput tok/s " + ", ".join(f"{k}: {v:.2f}x" for k, v in ratios.items()))
    print_steps(runs["static"], cont)
    if GATHERS in runs:
        slow = runs[GATHERS].wall_s
        print(f"{GATHERS}: {runs['static'].wall_s / slow:.2f}x static, {runs[hf_name].wall_s / slow:.2f}x "
              f"transformers; the decode kernel's engine is {slow / cont.wall_s:.2f}x as fast")
    print(f"greedy outputs equal to continuous's: static {agreement(runs['static'], cont)}, "
          f"transformers {agreement(runs[hf_name], cont)} (float differences can flip late tokens)")
    return ratios


def prefix_caching(model: Transformer, args: argparse.Namespace) -> dict[str, float]:
    needed = args.prefix + QUESTION[1] + ANSWER[1]
    long = Transformer(replace(model.config, max_seq_len=max(model.config.max_seq_len, needed)))
    long.load_state_dict(model.state_dict())  # copies into the column-major weights __init__ laid out
    long.eval().to(model.device, model.dtype)
    vocab = model.config.vocab_size
    prefix = torch.randint(vocab, (args.prefix,), generator=torch.Generator().manual_seed(1)).tolist()

    def workload(n: int = args.prefix_requests, seed: int = 1) -> list[Request]:
        return make_workload(n, uniform(*QUESTION), uniform(*ANSWER), rate=args.rate, vocab_size=vocab,
                             prefix=prefix, seed=seed)
    config = SchedulerConfig(max_num_seqs=args.prefix_requests, max_num_batched_tokens=args.max_batched_tokens)
    names = {True: "prefix caching", False: "no prefix caching"}
    kernel = args.kernel
    systems = {name: (lambda w, c=caching, name=name: run_engine(name, long, w, args.prefix_blocks, args.block_size,
                                                                 config, prefix_caching=c, decode_kernel=kernel))
               for caching, name in names.items()}
    arrivals = "all at t=0" if args.rate is None else f"Poisson arrivals at {args.rate} requests/s"
    print(f"\n2. Prefix caching: {args.prefix_requests} requests, {arrivals}: a shared {args.prefix}-token prefix, "
          f"then {QUESTION[0]}..{QUESTION[1]} tokens of question, {ANSWER[0]}..{ANSWER[1]} output tokens; "
          f"{args.prefix_blocks} blocks of {args.block_size}, max_num_seqs {args.prefix_requests}, "
          f"max_num_batched_tokens {args.max_batched_tokens}")
    if needed > model.config.max_seq_len:
        print(f"(the same weights with max_seq_len {long.config.max_seq_len}: positions past {model.config.max_seq_len} "
              f"are beyond the training length, so the outputs mean little, which does not change the timing)")
    print()
    runs = in_turn(systems, workload, args.warmup, args.repeats)
    on, off = runs[names[True]], runs[names[False]]
    # fp32 must give the same tokens. In bf16 the cached keys and values, computed in a batch of another
    # shape, can differ from the recomputed ones by a rounding, enough to flip a near-tied token
    assert args.dtype != "fp32" or on.outputs == off.outputs, "prefix caching changed the outputs"
    print(f"{'':<20}{'wall s':>8}{'out tok/s':>11}{'TTFT ms: mean':>15}{'p99':>8}{'cached tokens':>15}")
    for run in (off, on):
        f = run.figures
        print(f"{run.name:<20}{run.wall_s:>8.1f}{sum(map(len, run.outputs)) / run.wall_s:>11.1f}{f['mean_ttft_ms']:>15.0f}"
              f"{f['p99_ttft_ms']:>8.0f}{run.cached_tokens:>15}")
    ratio = off.figures["mean_ttft_ms"] / on.figures["mean_ttft_ms"]
    print(f"\nmean TTFT without / with prefix caching: {ratio:.2f}x; outputs equal: {agreement(on, off)}")
    return {"TTFT cut by prefix caching": ratio}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="target")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=256,
                        help=f"prompt lengths: lognormal, median {PROMPT['median']}, in [{PROMPT['low']}, this]")
    parser.add_argument("--min-output", type=int, default=16, help="output lengths: uniform in [this, --max-output]")
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--kv-tokens", type=int, default=4096, help="KV-cache memory of each system, in token slots")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=512, help="the engine's token budget per step")
    parser.add_argument("--also-unconstrained", action="store_true",
                        help="also static batching with every request in one batch (slow)")
    parser.add_argument("--also-free-attention", action="store_true",
                        help="also the engine with decode attention that costs nothing (a bound; its tokens are "
                             "meaningless)")
    parser.add_argument("--also-headroom", type=int, default=None,
                        help="also the continuous engine with this admission headroom (free blocks per running "
                             "request)")
    parser.add_argument("--prefix", type=int, default=1024, help="shared prefix length, tokens")
    parser.add_argument("--prefix-requests", type=int, default=16)
    parser.add_argument("--prefix-blocks", type=int, default=2048)
    parser.add_argument("--rate", type=float, default=None,
                        help="prefix part: arrivals per second, Poisson (default: all at 0)")
    parser.add_argument("--warmup", type=int, default=4, help="requests in each system's warm-up run")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="default: torch's")
    parser.add_argument("--device", default="cpu", help="cpu (the goals' device) or cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                        help="of all three systems' weights and activations (the goals': fp32)")
    parser.add_argument("--decode-kernel", choices=("cpp", "triton", "none"), default=None,
                        help="the engine's decode attention: labkit's C++ operator (the CPU's default), its Triton "
                             "kernel (GPU), or none: gather the blocks, then SDPA (the GPU's default). With a "
                             f"kernel, the engine also runs without one ('{GATHERS}')")
    args = parser.parse_args(argv)
    if args.decode_kernel == "cpp" and args.dtype != "fp32":
        parser.error(f"--decode-kernel cpp is fp32 only, not --dtype {args.dtype}")
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    transformers.logging.disable_progress_bar()
    device = torch.device(args.device)
    model, _ = labkit.load(args.model, device=device, dtype=DTYPES[args.dtype])
    print(f"{datetime.date.today()}  {device_name(device)}  torch {torch.__version__}  transformers "
          f"{transformers.__version__}  model {args.model} ({model.num_parameters():,} parameters, {args.dtype})")
    print("command: " + " ".join([os.path.relpath(sys.executable), *sys.argv]))
    args.kernel = decode_kernel(args)
    ratios = throughput(model, args) | prefix_caching(model, args)
    met = {name: ratios[name] >= goal for name, goal in GOALS.items()}
    print(f"\ngoals ({time.perf_counter() - start:.0f} s in all):")
    for name, goal in GOALS.items():
        print(f"  {name} >= {goal:g}x: {ratios[name]:.2f}x, {'met' if met[name] else 'MISSED'}")
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
