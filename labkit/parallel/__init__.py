"""Serving across processes with torch.distributed: W ranks, each a process with its own share.

- ``launch``: start the ranks, run a function on each, return rank 0's result, leave nothing running;
- ``tensor``: tensor parallelism, each weight matrix split across the ranks (Megatron-style);
- ``pipeline``: pipeline parallelism, the layers split, micro-batches in flight;
- ``disaggregate``: prefill on one rank, decode on another, the KV cache shipped between them;
- ``comm``: what an all-reduce and a send cost, measured and fitted to latency + bytes / bandwidth.
"""
from labkit.parallel.launch import Rank, RankError, launch

__all__ = ["Rank", "RankError", "launch"]
