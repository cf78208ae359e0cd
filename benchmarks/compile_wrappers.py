"""What compiling ahead of time saves over ``torch.compile`` on a CPU, taken apart: the Python
wrapper, the guard check, the Python entry. A counter-experiment for BENCHMARKS.md.

    OMP_NUM_THREADS=1 python benchmarks/compile_wrappers.py [--models target draft] [--context 256]
                                                           [--repeats 100]

For each model, timed alternately at batch 1 after ``--context`` cached tokens:
- eager, on the contiguous cache (``generate.decode_step``, the baseline of ``compile.py``);
- compiled (``labkit.compile``): guard check, then Inductor's generated Python wrapper;
- compiled with Inductor's C++ wrapper (``cpp_wrapper=True``): guard check, then one call;
- the same with the guard check skipped (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``:
  unsafe in general, since a model of other modules would run this graph without a check; the
  row pays for entering and leaving that stance at each call, a few microseconds);
- compiled ahead of time (``labkit.aot``): no TorchDynamo at all; with the library's matrix
  products, as every other row has (its products written by Inductor instead are
  ``benchmarks/compile.py``'s and ``benchmarks/row_products.py``'s subject).
"""
from __future__ import annotations

import argparse
import datetime

import torch

import labkit
from labkit.aot import AOTStep, aot_step
from labkit.bench import alternate, format_seconds
from labkit.compile import compile_step, fresh_decode
from labkit.device import device_name
from labkit.generate import decode_step
from labkit.model import Transformer
from labkit.static_cache import StaticKVCache, static_length


def cpp_wrapped(model: Transformer, cache: StaticKVCache, skip_guards: bool):
    """The static step compiled with a C++ wrapper, on a code object of its own (TorchDynamo
    caches per code object), run once; with ``skip_guards``, each call skips the guard check."""
    compiled = torch.compile(fresh_decode(), fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
    tokens = torch.zeros(1, 1, dtype=torch.long)
    padding = torch.full_like(tokens, -1)  # made outside inference mode, as the timed positions are: no recompile
    with torch.inference_mode():
        compiled(model, cache, tokens, padding)

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return compiled(model, cache, tokens, positions)

    def unguarded(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(), torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return compiled(model, cache, tokens, positions)
    return unguarded if skip_guards else step


def time_model(name: str, context: int, repeats: int) -> None:
    model, _ = labkit.load(name, device="cpu")
    length = static_length(model.config, context + 1)
    cache = lambda: StaticKVCache(model.config, 1, length, model.dtype, model.device)
    tokens, positions = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), context)
    steps = {"compiled": compile_step(model, cache()),
             "C++ wrapper": cpp_wrapped(model, cache(), skip_guards=False),
             "C++ wrapper, no guards": cpp_wrapped(model, cache(), skip_guards=True),
             "ahead of time": aot_step(model, cache(), products="library")}
    timings = alternate({"eager": decode_step(model, context),
                         **{label: (lambda s=step: s(tokens, positions)) for label, step in steps.items()}},
                        warmup=5, repeats=repeats)
    eager = timings["eager"].median_s
    print(f"\n{name}, context {context}, batch 1, float32")
    if not isinstance(steps["ahead of time"], AOTStep):
        print("ahead of time: could not build (the warning says why); its row ran eagerly")
    print(f"{'':<24}{'median':>10}{'min':>10}{'vs eager':>10}")
    for label, t in timings.items():
        print(f"{label:<24}{format_seconds(t.median_s):>10}{format_seconds(t.min_s):>10}{eager / t.median_s:>9.2f}x"
              + ("  (noisy)" * t.noisy))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["target", "draft"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    print(f"{datetime.date.today()}  {device_name(torch.device('cpu'))}  torch {torch.__version__}")
    for name in args.models:
        time_model(name, args.context, args.repeats)


if __name__ == "__main__":
    main()
