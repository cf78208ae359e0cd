"""One decode step's attention over a paged cache on the CPU: gathers and SDPA against labkit's C++ kernel.

    .venv/bin/python benchmarks/paged_decode_cpu.py [--model target] [--sequences 18] [--min-length 40]
                                                    [--max-length 420] [--block-size 16] [--repeats 200]

A batch like a decode step of the continuous-batching benchmark's engine: ``--sequences``
sequences, lengths uniform in [``--min-length``, ``--max-length``] (seeded), each with one new
query, the heads and head size of ``--model``, their blocks scattered at random over the pools.
Each is timed on its own, call after call (``labkit.bench.measure``), two ways:
- one layer: the same layer's pools every call, so that they stay in the caches (a few MB);
- every layer: one call per layer of the model, each with its own pools, as in an engine step,
  so that each layer's keys and values have left the nearest caches by the time they are read
  again.
The gather path is ``labkit.paged_attention.paged_attention`` (each sequence's blocks copied out, padded to
the longest, then SDPA); the kernel is ``labkit.kernels.paged_decode_cpu``, checked against it
first. The kernel's build folder names the vector instructions it was compiled for.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

import labkit
from labkit.bench import measure
from labkit.device import device_name
from labkit.kernels.paged_decode_cpu import build, build_directory, paged_decode_cpu
from labkit.kernels.speed import paged_decode_batch
from labkit.paged_attention import paged_attention


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="target")
    parser.add_argument("--sequences", type=int, default=18)
    parser.add_argument("--min-length", type=int, default=40)
    parser.add_argument("--max-length", type=int, default=420)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    if not 1 <= args.min_length <= args.max_length:
        parser.error(f"need 1 <= --min-length <= --max-length, got {args.min_length} and {args.max_length}")
    build()
    model, _ = labkit.load(args.model)
    g, config = torch.Generator().manual_seed(0), model.config
    lengths = torch.randint(args.min_length, args.max_length + 1, (args.sequences,), generator=g)
    q, k, v, tables, lengths = paged_decode_batch(lengths, config.n_heads, config.n_kv_heads, config.head_dim,
                                                  args.block_size, layers=(config.n_layers,), generator=g)
    error = (paged_decode_cpu(q, k[0], v[0], tables, lengths) - paged_attention(q, k[0], v[0], tables, lengths))
    print(f"{datetime.date.today()}  {device_name(torch.device('cpu'))}  torch {torch.__version__}  kernel built in "
          f"{build_directory().name}")
    print("command: " + " ".join([os.path.relpath(sys.executable), *sys.argv]))
    print(f"{args.sequences} sequences of {lengths.min()}..{lengths.max()} tokens (mean {lengths.float().mean():.0f}), "
          f"{config.n_heads} query heads, {config.n_kv_heads} KV heads of {config.head_dim}, blocks "
          f"of {args.block_size}; kernel against gathers: max abs difference {error.abs().max():.1e}\n")
    layers = range(config.n_layers)
    layer_bytes = int(lengths.sum()) * 2 * k[0, 0, 0].numel() * k.element_size()  # the keys and values read
    ways = {(1, "one layer"): (lambda: paged_attention(q, k[0], v[0], tables, lengths),
                               lambda: paged_decode_cpu(q, k[0], v[0], tables, lengths)),
            (len(layers), f"every layer ({len(layers)})"): (
                lambda: [paged_attention(q, k[i], v[i], tables, lengths) for i in layers],
                lambda: [paged_decode_cpu(q, k[i], v[i], tables, lengths) for i in layers])}
    for (n, name), (gathers, kernel) in ways.items():  # each back to back: the other's copies would evict the pools
        slow, fast = (measure(fn, repeats=args.repeats, label=label, device="cpu")
                      for fn, label in ((gathers, "gathers + SDPA"), (kernel, "kernel")))
        print(f"{name}:\n{slow}\n{fast}\nthe kernel is {slow.median_s / fast.median_s:.2f}x as fast; it reads "
              f"{n * layer_bytes / 1e6:.1f} MB of keys and values: {n * layer_bytes / fast.median_s / 1e9:.1f} GB/s\n")


if __name__ == "__main__":
    main()
