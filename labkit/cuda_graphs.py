"""CUDA graphs by hand: record a decode step's kernel launches once, replay them with one call.

A GPU runs a kernel in a few microseconds, and the CPU needs about as long to launch one; a
small model's decode step is hundreds of kernels, so the GPU waits on Python. A CUDA graph is
a recording of a stream's launches, with their arguments: replaying it launches them all at
once from the driver, with no Python and no dispatcher in between.

A recording fixes every address and shape, so:

- inputs live in static buffers that each step overwrites (``copy_``) before the replay, and
  the output appears in the same output tensor every time (read it before the next replay);
- the step may not synchronise with the host (no ``.item()``) and may not allocate in new
  places: the static KV cache (``labkit.static_cache``) keeps all of this true;
- a batch of another size needs another graph. Engines record one per batch-size *bucket*
  (1, 2, 4, 8, then multiples of 16, as nano-vllm does) and pad a batch up to its bucket with
  rows at position -1, which the static cache writes to its spare slot: nowhere that is read.

Every function here needs CUDA; on a CPU it says so.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from labkit.answers import answer_to
from labkit.model import Transformer
from labkit.static_cache import StaticKVCache, decode_static
from labkit.validate import check_counts


def require_cuda(device: torch.device | str) -> None:
    """A clear error unless ``device`` is a CUDA GPU."""
    if torch.device(device).type != "cuda":
        raise RuntimeError(f"CUDA graphs need a CUDA GPU, and this model is on {torch.device(device)}: "
                           "on a CPU, compile the step instead (labkit.compile.compile_step)")


def buckets(max_batch: int) -> list[int]:
    """The batch sizes to record a graph for: 1, 2, 4, 8, then multiples of 16, up to and
    including the first that holds ``max_batch``."""
    check_counts(max_batch=max_batch)
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
    return sizes[:next(i for i, b in enumerate(sizes) if b >= max_batch) + 1]


@answer_to("ex08.3")
def bucket_for(batch: int, sizes: Sequence[int]) -> int:
    """The smallest bucket that holds ``batch`` rows."""
    fitting = [b for b in sizes if b >= batch]
    if batch < 1 or not fitting:
        raise ValueError(f"a batch of {batch} rows has no bucket among {list(sizes)}")
    return min(fitting)


@answer_to("ex08.3")
def pad_to_bucket(tokens: Tensor, positions: Tensor, bucket: int) -> tuple[Tensor, Tensor]:
    """``tokens`` and ``positions`` ``[B, T]`` padded with rows of token 0 at position -1 up to
    ``bucket`` rows: rows that the static cache writes to its spare slot."""
    missing = bucket - tokens.shape[0]
    if missing < 0:
        raise ValueError(f"{tokens.shape[0]} rows do not fit a bucket of {bucket}")
    pad = (0, 0, 0, missing)
    return (torch.nn.functional.pad(tokens, pad, value=0),
            torch.nn.functional.pad(positions, pad, value=-1))


def record(forward: Callable[[], Tensor], device: torch.device, pool: tuple | None = None
           ) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """Record ``forward`` (a step that reads only static buffers) as a CUDA graph; returns the
    graph and the tensor its replays write their output into. It runs a few times on a side
    stream first, as CUDA asks: libraries pick their algorithms and allocate their workspaces
    then, not during the recording. ``pool``: a memory pool shared with other graphs."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(3):
            forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
        output = forward()
    return graph, output


def repeated(call: Callable[[], object], calls: int, device: torch.device) -> Callable[[], None]:
    """``calls`` calls of ``call`` recorded as one CUDA graph; returns its replay. Timing one
    kernel this way times the kernel, not its launch: the replay launches all of them at once."""
    if calls < 1:
        raise ValueError(f"calls={calls}: a graph of no calls times nothing")
    require_cuda(device)
    return record(lambda: [call() for _ in range(calls)], device)[0].replay


Decode = Callable[[Transformer, StaticKVCache, Tensor, Tensor], Tensor]


class GraphedStep:
    """One decode step of ``model`` on ``cache`` recorded as a CUDA graph for its batch size.

    ``step(tokens, positions)``, each ``[B, 1]`` (positions in 0..max_len - 1, or -1 for padding:
    the cache trusts them), copies the inputs into the static buffers, replays, and returns the
    static output buffer ``[B, 1, vocab]``, which the next replay overwrites. ``decode(model, cache,
    tokens, positions)`` is the step recorded: by default the eager one (``decode_static``); a
    compiled one (``labkit.compile.graphed_compiled_step``) records Inductor's fused kernels."""

    def __init__(self, model: Transformer, cache: StaticKVCache, pool: tuple | None = None,
                 decode: Decode = decode_static) -> None:
        model.check_cache(cache)  # before recording: a compiled decode's failure would hide why
        require_cuda(model.device)
        self.model, self.cache, self.decode = model, cache, decode
        shape = (cache.batch_size, 1)
        self.tokens = torch.zeros(shape, dtype=torch.long, device=model.device)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=model.device)  # padding until used
        self.graph, self.logits = record(self._forward, model.device, pool)

    def _forward(self) -> Tensor:
        return self.decode(self.model, self.cache, self.tokens, self.positions)

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        if tokens.shape != self.tokens.shape or positions.shape != self.positions.shape:
            raise ValueError(f"this graph was recorded for tokens and positions {tuple(self.tokens.shape)}, got "
                             f"{tuple(tokens.shape)} and {tuple(positions.shape)}: pad to the bucket (pad_to_bucket)")
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.logits


class BucketedGraphs:
    """Batches of any size up to ``max_batch`` on a static cache: one ``GraphedStep`` per batch-size
    bucket over one cache of as many rows as the largest bucket; the graph for bucket b drives the
    cache's first b rows (a view of the same memory), so a sequence keeps its row whichever bucket
    its batch falls in. Graphs are recorded largest first and share one memory pool, as their
    steps never overlap. (The engine's paged version is ``labkit.paged_graphs``.)"""

    def __init__(self, model: Transformer, max_batch: int, max_len: int) -> None:
        require_cuda(model.device)
        self.sizes = buckets(max_batch)
        self.cache = StaticKVCache(model.config, self.sizes[-1], max_len, model.dtype, model.device)
        self.graphs: dict[int, GraphedStep] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.graphs[size] = GraphedStep(model, self.cache.first_rows(size), pool=pool)

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Logits ``[B, 1, vocab]`` of a decode step for rows 0..B-1 of the cache: a view of the
        bucket's output buffer, which its next replay overwrites."""
        rows = tokens.shape[0]
        bucket = bucket_for(rows, self.sizes)
        return self.graphs[bucket](*pad_to_bucket(tokens, positions, bucket))[:rows]
