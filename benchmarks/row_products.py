"""How fast this CPU's one-row matrix products read their weights: the library's, Inductor's own, and a plain sum.

    python benchmarks/row_products.py [--models target draft] [--repeats 100]

For each model, every projection weight of a decode step multiplied by one row, timed
alternately on torch's threads (``OMP_NUM_THREADS=1``, as BENCHMARKS.md runs it):

- the BLAS library, ``F.linear``, on the weights as the model stores them (transposed:
  ``Transformer.store_weights_column_major``) and on copies laid out by rows;
- Inductor's generated product (``labkit.row_products``' rewrite, compiled as one graph), on the
  copies laid out by rows;
- a sum over the same weights: how fast this CPU reads those bytes at all.

Inductor's row is one call of a compiled function, and so includes entering it (its guards, its
wrapper), which a step compiled ahead of time does not pay: it weighs on the draft's few tens of
microseconds, not on the target's milliseconds.

Each is printed as GB/s of weights read. The weights are the model's own, so whether they fit in
the last-level cache is the model's size against this CPU's.
"""
from __future__ import annotations

import argparse
import datetime

import torch
import torch.nn.functional as F

import labkit
from labkit.bench import alternate, format_seconds
from labkit.device import device_name
from labkit.row_products import OneRowProducts, row_major_copies


def products_of(weights: list[torch.Tensor]):
    """The one-row products of ``weights``, each a ``[1, in]`` row times a weight's transpose."""
    rows = [torch.randn(1, w.shape[1]) for w in weights]
    return lambda: [F.linear(x, w) for x, w in zip(rows, weights)]


def generated(weights: list[torch.Tensor]):
    """The same products, compiled as one graph with the rewrite (the weights must be row-major)."""
    rows = [torch.randn(1, w.shape[1]) for w in weights]
    rewrite = OneRowProducts()
    compiled = torch.compile(lambda xs, ws: [F.linear(x, w) for x, w in zip(xs, ws)], fullgraph=True, dynamic=False,
                             options={"post_grad_custom_post_pass": rewrite,
                                      "fx_graph_cache": False})  # compiled here, so that the rewrites are counted
    with torch.inference_mode():
        compiled(rows, weights)
    if rewrite.rewritten != len(weights):
        raise RuntimeError(f"the rewrite applied to {rewrite.rewritten} of {len(weights)} products")
    return lambda: compiled(rows, weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["target", "draft"])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    print(f"{datetime.date.today()}  {device_name('cpu')}  torch {torch.__version__}")
    for name in args.models:
        model, _ = labkit.load(name)
        stored = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
        by_rows = list(row_major_copies(model).values())
        nbytes = sum(w.numel() * w.element_size() for w in stored)
        with torch.inference_mode():
            timings = alternate({"library, as stored": products_of(stored),
                                 "library, by rows": products_of(by_rows),
                                 "generated, by rows": generated(by_rows),
                                 "sum of the weights": lambda: [w.sum() for w in stored]},
                                warmup=5, repeats=args.repeats, device="cpu")
        print(f"\n{name}: {len(stored)} projection weights, {nbytes / 1e6:.1f} MB")
        for label, t in timings.items():
            print(f"  {label:<20}{format_seconds(t.median_s):>10}  {nbytes / t.median_s / 1e9:6.1f} GB/s"
                  + "  (noisy)" * t.noisy)


if __name__ == "__main__":
    main()
