"""Eager against compiled (and, on a GPU, CUDA-graphed) decode steps, and what compiling costs.

    python benchmarks/compile.py [--models target draft] [--context 256] [--repeats 60]
                                 [--shape Llama-3.2-1B] [--new-tokens 1024] [--skip-cold] [--profile]
                                 [--no-cudnn-attention]

1. For each model (fp32, batch 1, ``--context`` tokens cached), timed alternately: the lab's
   eager decode step on the contiguous cache (``generate.decode_step``: what every earlier
   notebook times), the same step eager on the static cache, the static step compiled
   (``labkit.compile``; on CUDA ``mode="reduce-overhead"``), on a CPU compiled ahead of time
   (``labkit.aot``: no guard check and no Python wrapper left), once with the library's matrix
   products and once with products Inductor generates (``labkit.row_products``) and, on CUDA, recorded by hand as
   a CUDA graph (``labkit.cuda_graphs``), eager and compiled (``compile.graphed_compiled_step``:
   Inductor's fused kernels with neither guards nor wrapper). Each step's bytes (weights, KV read
   and written: ``cost.forward_bytes``) over its median time, against a copy of that many bytes
   (on a CPU the last-level cache holds the lab's models) or, on a GPU, the datasheet bandwidth.
2. Compile time: in this process, and in two fresh processes sharing an empty inductor cache
   folder: the first compiles from nothing, the second finds the first one's code on disk (on a
   CPU, the same for the step compiled ahead of time, whose second build loads a package).
   With ``--profile``, each step's time split by kind under ``torch.profiler``: matrix products,
   attention, TorchDynamo's guard check, Inductor's generated code, the rest.
3. Greedy output of 64 tokens: eager, compiled, (CPU) compiled ahead of time, both ways, and
   (CUDA) graphed must be identical.
4. On CUDA only: the engine, eager against CUDA graphs per batch bucket (32 requests at once);
   and ``--shape`` (random weights, bf16): eager against graphed decode and the fraction of the
   datasheet bandwidth, notebook 01's naive against cached generation of ``--new-tokens``
   tokens, cached with CUDA graphs and eagerly (twice: the first pass meets every key length
   for the first time), and the engine again.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # before torch: the profiler printed its start and stop lines
import torch  # noqa: E402

import labkit
from labkit import cost
from labkit.aot import PRODUCTS, AOTStep, aot_step
from labkit.bench import alternate, format_seconds
from labkit.compile import (cache_dir, compiler_problem, eager_step, failure_line, graphed_compiled_step,
                            inductor_start_up, one_row_cache, static_decoder)
from labkit.device import device_name, get_device, synchronize
from labkit.generate import SamplingParams, decode_step, stream
from labkit.hardware import measure_bandwidth
from labkit.model import Transformer, forward_tokens
from labkit.presets import GPU_PRESETS
from labkit.shapes import DTYPE_NAMES
from labkit.static_cache import StaticKVCache

def static_steps(model: Transformer, context: int, graphs: bool) -> dict:
    """The eager, compiled, (on a CPU) compiled ahead of time and (``graphs``) graphed decode
    steps, eager and compiled, at ``context`` on static caches, each a no-argument callable for
    ``alternate``, plus the compile times."""
    tokens = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    positions = torch.full((1, 1), context, device=model.device)

    _, compiled = static_decoder(model, context + 1)
    eager = eager_step(model, one_row_cache(model, context + 1))
    steps = {"eager static": lambda: eager(tokens, positions), "compiled": lambda: compiled(tokens, positions)}
    built = {"compile_s": getattr(compiled, "compile_s", float("nan"))}
    if model.device.type == "cpu":
        built["aot"] = ""
        for products in PRODUCTS:
            ahead = aot_step(model, one_row_cache(model, context + 1), products=products)
            steps[f"ahead of time, {products}"] = functools.partial(ahead, tokens, positions)
            built["aot"] += (f"; ahead of time, {products}: " + ("could not build, the row runs eagerly"
                             if not isinstance(ahead, AOTStep) else f"{ahead.build_s:.1f} s" +
                             (" (its package, from disk)" * ahead.from_disk)))
    if graphs:
        _, graphed = static_decoder(model, context + 1, use_cuda_graphs=True)
        steps["CUDA graph"] = lambda: graphed(tokens, positions)
        try:  # not yet timed on a GPU (session 36): a failure names itself, and the other rows still run
            both = graphed_compiled_step(model, one_row_cache(model, context + 1))
            steps["compiled + graph"] = lambda: both(tokens, positions)
        except Exception as error:
            print(f"compiled + graph: could not be built ({failure_line(error)})", flush=True)
    return {"steps": steps, **built}


LABEL = 26  # the width of a row's label in the tables printed


# what each profiler row is, by its name, the first kind that matches: attention first, because
# some attention kernels carry a matmul library's name too (fmha_cutlassF_...)
KINDS = {"attention": ("scaled_dot_product", "flash", "sdpa", "fmha"),
         "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "gemm", "gemv", "nvjet", "cutlass", "xmma"),
         "guards": ("TorchDynamo Cache Lookup",), "generated": ("CompiledFxGraph",)}


def kind_of(name: str) -> str:
    """The kind of a profiler row (a ``KINDS`` key), or "rest"."""
    return next((kind for kind, names in KINDS.items() if any(n in name for n in names)), "rest")


def profile_split(steps: dict, device: torch.device, calls: int = 50) -> None:
    """Where each step's time goes, per step under ``torch.profiler``: matrix products, attention,
    TorchDynamo's guard check, the code Inductor generated, and the rest (self times; on CUDA the
    kernels' GPU times, whose sum is the GPU's busy time)."""
    from torch.profiler import ProfilerActivity, profile
    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    for label, step in steps.items():
        for _ in range(5):
            step()
        with profile(activities=activities) as prof:
            for _ in range(calls):
                step()
            synchronize(device)
        split = dict.fromkeys([*KINDS, "rest"], 0.0)
        for row in prof.key_averages():
            split[kind_of(row.key)] += (row.self_device_time_total if gpu else row.self_cpu_time_total) / calls / 1e3
        print(f"  {label:<{LABEL}}{'GPU busy' if gpu else 'CPU'} {sum(split.values()):.3f} ms per step: " +
              ", ".join(f"{k} {v:.3f}" for k, v in split.items() if v or k == "rest"))


def reference_bandwidth(device: torch.device, step_bytes: float) -> tuple[float, str]:
    """What a step's bytes are measured against: the datasheet of a known GPU (the preset of its
    name with the nearest memory size), else a copy of ``step_bytes`` (source and destination
    together) on this device."""
    if device.type == "cuda":
        name, memory = torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory
        named = [p for p in GPU_PRESETS.values() if p.name.split()[0] in name.split()]
        if named:
            preset = min(named, key=lambda p: abs(p.memory_bytes - memory))
            return preset.bandwidth, f"datasheet {preset.name}"
    return measure_bandwidth(device, int(step_bytes) // 2, repeats=20), f"copy of {step_bytes / 1e6:.0f} MB"


def time_model(name: str, model: Transformer, context: int, repeats: int, profiled: bool = False) -> None:
    device, config = model.device, model.config
    built = static_steps(model, context, device.type == "cuda")
    steps = {"eager contiguous": decode_step(model, context), **built["steps"]}
    timings = alternate(steps, warmup=3, repeats=repeats, device=device)
    step_bytes = cost.forward_bytes(config, 1, context, weight_bytes=model.dtype.itemsize,
                                    kv_dtype=DTYPE_NAMES[model.dtype])
    bandwidth, against = reference_bandwidth(device, step_bytes)
    base = timings["eager contiguous"].median_s
    print(f"\n{name}: {model.num_parameters():,} parameters, {str(model.dtype)[6:]}, context {context}, "
          f"{step_bytes / 1e6:.1f} MB per step; compile {built['compile_s']:.1f} s{built.get('aot', '')}")
    print(f"{'':<{LABEL}}{'median':>10}{'min':>10}{'tokens/s':>10}{'speedup':>9}{'of bound':>10}   bound: "
          f"{against}, {bandwidth / 1e9:.0f} GB/s")
    for label, t in timings.items():
        print(f"{label:<{LABEL}}{format_seconds(t.median_s):>10}{format_seconds(t.min_s):>10}{1 / t.median_s:>10.0f}"
              f"{base / t.median_s:>8.2f}x{step_bytes / t.median_s / bandwidth:>10.2f}" + ("  (noisy)" * t.noisy))
    if profiled:
        print("where the time goes (ms per step, under the profiler, which slows what it records):")
        profile_split({label: step for label, step in steps.items() if not label.startswith("ahead")}, device)
        if any(label.startswith("ahead") for label in steps):
            print(f"  {'ahead of time':<{LABEL}}one call into its library, whose operators the profiler does not see")


def same_output(model: Transformer, prompt: list[int]) -> str:
    params = SamplingParams(max_new_tokens=64, stop_at_eos=False)
    runs = {"compiled": lambda: list(stream(model, prompt, params, compiled=True))}
    if model.device.type == "cpu":
        for products in PRODUCTS:
            runs[f"ahead of time, {products}"] = functools.partial(ahead_of_time_greedy, model, prompt,
                                                                   params.max_new_tokens, products)
    if model.device.type == "cuda":
        runs["graphed"] = lambda: list(stream(model, prompt, params, use_cuda_graphs=True))
        runs["compiled + graph"] = lambda: graphed_compiled_greedy(model, prompt, params.max_new_tokens)
    eager = list(stream(model, prompt, params))
    return ", ".join(f"{k} {_agreement(run, eager)}" for k, run in runs.items())


def _agreement(run, eager: list[int]) -> str:
    """Whether ``run()`` gives the ``eager`` tokens, or why it gave none."""
    try:
        return "identical" if run() == eager else "DIFFERENT"
    except Exception as error:  # a step that cannot be built on this machine: the others still compare
        return f"failed ({failure_line(error)})"


def ahead_of_time_greedy(model: Transformer, prompt: list[int], new_tokens: int, products: str) -> list[int]:
    """Greedy tokens with decode steps compiled ahead of time (``labkit.aot``) with ``products``, as
    ``stream(compiled=True)`` does with ``labkit.compile`` (``stream`` does not offer this step:
    each build keeps its cache for the life of the process)."""
    cache = one_row_cache(model, len(prompt) + new_tokens)
    return greedy_with(model, prompt, new_tokens, cache, aot_step(model, cache, products=products))


def graphed_compiled_greedy(model: Transformer, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens with decode steps compiled and recorded as a CUDA graph (``stream`` does not
    offer this step)."""
    cache = one_row_cache(model, len(prompt) + new_tokens)
    return greedy_with(model, prompt, new_tokens, cache, graphed_compiled_step(model, cache))


def greedy_with(model: Transformer, prompt: list[int], new_tokens: int, cache: StaticKVCache, step) -> list[int]:
    """Greedy tokens: the prompt prefilled eagerly into the static ``cache``, then ``step`` on it."""
    logits, tokens = forward_tokens(model, prompt, 0, cache), []
    for position in range(len(prompt), len(prompt) + new_tokens):
        tokens.append(int(logits[-1].argmax()))
        logits = step(torch.tensor([[tokens[-1]]], device=model.device),
                      torch.tensor([[position]], device=model.device))[0]
    return tokens


COLD_START = """
import sys, time, torch, labkit
from labkit.compile import compile_step
from labkit.static_cache import StaticKVCache
model, _ = labkit.load(sys.argv[1], device=sys.argv[2])
step = compile_step(model, StaticKVCache(model.config, 1, 512, model.dtype, model.device))
print(getattr(step, "compile_s", float("nan")))  # nan: no compiler, the step ran eagerly
if model.device.type == "cpu":
    from labkit.aot import aot_step
    step = aot_step(model, StaticKVCache(model.config, 1, 512, model.dtype, model.device))
    print(getattr(step, "build_s", float("nan")))
"""


def compile_times(name: str, device: torch.device) -> tuple[list[float], list[float]]:
    """Compile times in a fresh process with an empty inductor cache, then in another one that
    finds the first one's code on disk: ``torch.compile``'s and, on a CPU, the ahead-of-time build's."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": folder}
        run = lambda: [float(line) for line in subprocess.run(
            [sys.executable, "-c", COLD_START, name, str(device)], env=env, capture_output=True, text=True,
            check=True).stdout.split()]
        return run(), run()


def gpu_scale(shape: str, new_tokens: int, repeats: int, profiled: bool) -> None:
    model, _ = labkit.load(f"shape:{shape}", device="cuda", dtype=torch.bfloat16)
    print(f"\n{shape} shape, random weights, bf16, batch 1")
    time_model(shape, model, 512, repeats, profiled)
    prompt = list(range(100, 116))
    params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
    # eager twice: cuDNN's attention builds a plan for each new key length the first time it meets it
    for label, kw in [("cached, CUDA graphs", dict(use_cuda_graphs=True)), ("cached, eager", {}),
                      ("cached, eager again", {}), ("naive", dict(use_cache=False))]:
        start = time.perf_counter()
        tokens = list(stream(model, prompt, params, **kw))
        synchronize(model.device)
        seconds = time.perf_counter() - start
        print(f"{label:<22}{new_tokens} tokens in {seconds:6.2f} s = {new_tokens / seconds:7.1f} tokens/s "
              f"(last token {tokens[-1]})")
    engine_graphs(model)


def engine_graphs(model: Transformer, requests: int = 32, prompt: int = 64, new_tokens: int = 128) -> None:
    """The engine on ``model`` with its Triton decode kernel, eager against CUDA graphs per batch
    bucket: ``requests`` requests at once, greedy, EOS ignored."""
    from labkit.engine import Engine, Request, SchedulerConfig
    from labkit.kernels import paged_decode
    params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
    config = SchedulerConfig(max_num_seqs=requests, max_num_batched_tokens=2048)
    blocks = requests * -(-(prompt + new_tokens) // 16) + 8
    outputs, times = {}, {}
    for label, graphs in (("eager", False), ("CUDA graphs", True)):
        engine = Engine(model, blocks, 16, config, decode_kernel=paged_decode, use_cuda_graphs=graphs)
        batch = [Request(i, [(7 * i + j) % 1000 + 1 for j in range(prompt)], params) for i in range(requests)]
        engine.run(batch[:2])  # warm up
        batch = [Request(i, r.prompt, params) for i, r in enumerate(batch)]
        start = time.perf_counter()
        outputs[label] = [r.output for r in engine.run(batch)]
        times[label] = time.perf_counter() - start
    same = "identical" if outputs["eager"] == outputs["CUDA graphs"] else "DIFFERENT"
    print(f"engine, {requests} requests x {new_tokens} new tokens (prompts of {prompt}), greedy outputs {same}: " +
          ", ".join(f"{k} {requests * new_tokens / t:,.0f} tokens/s" for k, t in times.items()) +
          f" ({times['eager'] / times['CUDA graphs']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["target", "draft"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--shape", default="Llama-3.2-1B")
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--skip-cold", action="store_true", help="skip the compile times in fresh processes")
    parser.add_argument("--profile", action="store_true", help="also split each step's time by kind (profiler)")
    parser.add_argument("--no-cudnn-attention", action="store_true",
                        help="CUDA: attention without cuDNN, which plans anew for each new key length")
    args = parser.parse_args()
    device = get_device()
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    print(f"{datetime.date.today()}  {device_name(device)}  torch {torch.__version__}; inductor cache {cache_dir()}")
    if compiler_problem(device) is None:  # paid here, so that each model's compile time is its own
        print(f"Inductor's start-up, once per process (a one-line function compiled first): "
              f"{inductor_start_up(device):.1f} s")
    for name in args.models:
        model, tokenizer = labkit.load(name, device=device)
        time_model(name, model, args.context, args.repeats, args.profile)
        prompt = tokenizer.encode('def is_prime(n):\n    """Return True if n is a prime number."""').ids
        print(f"greedy, 64 tokens, against eager: {same_output(model, prompt)}")
        if device.type == "cuda":
            engine_graphs(model)
        if not args.skip_cold:
            cold, warm = compile_times(name, device)
            ahead = (f"; ahead of time (both products, timed) {cold[1]:.1f} s, then {warm[1]:.2f} s (their packages)"
                     if len(cold) > 1 else "")
            print(f"compile in a fresh process: {cold[0]:.1f} s with an empty inductor cache, {warm[0]:.1f} s "
                  f"with the first one's code on disk{ahead}")
    if device.type == "cuda":
        gpu_scale(args.shape, args.new_tokens, args.repeats, args.profile)


if __name__ == "__main__":
    main()
