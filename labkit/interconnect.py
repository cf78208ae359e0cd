"""What moving bytes between devices costs: a link's latency and bandwidth, and a ring all-reduce.

A message of n bytes over a link takes ``latency + n / bandwidth``. A ring all-reduce over W
ranks cuts the message into W pieces and passes them around the ring twice: W - 1 steps that
sum the pieces (reduce-scatter), then W - 1 steps that share the sums (all-gather). Each step
every rank sends one piece, n / W bytes, at once, so

    ring all-reduce time = 2 (W - 1) x (latency + n / (W x bandwidth))

which approaches 2 n / bandwidth for large W: the ring's bandwidth cost hardly grows with W,
while its latency cost does.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.answers import answer_to


@dataclass(frozen=True)
class Link:
    """A link between two ranks: seconds per message, and bytes per second in one direction."""

    name: str
    latency_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth <= 0:
            raise ValueError(f"link {self.name!r}: latency_s={self.latency_s} must be >= 0 and "
                             f"bandwidth={self.bandwidth} > 0 bytes/s")

    def send_seconds(self, nbytes: float) -> float:
        """One message of ``nbytes`` from one rank to another."""
        return self.latency_s + nbytes / self.bandwidth


@answer_to("ex10.3")
def ring_allreduce_seconds(nbytes: float, world_size: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` per rank over ``world_size`` ranks (0 for one rank)."""
    if world_size < 1 or nbytes < 0:
        raise ValueError(f"world_size={world_size} must be >= 1 and nbytes={nbytes} >= 0")
    return 2 * (world_size - 1) * link.send_seconds(nbytes / world_size)
