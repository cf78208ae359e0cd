"""Self-speculative decoding by early exit: the target's own first layers draft for the whole target.

Lab 05 drafts with a second, smaller model. Here the drafter is the target cut short: run a token
through blocks 0..L'-1 only, then the target's own final norm and LM head (optionally through a
small trained ``adapter`` that maps the layer-L' residual stream to one the head reads better):

    draft logits = head(adapter(h_L'))      target logits = head(h_L),   L = n_layers

No second set of weights, no second tokenizer, no second KV cache. A round, with the last emitted
token r at position P (not yet in the cache):

1. Draft: k one-token steps through blocks [0, L'), for r, d_1, ..., d_(k-1) at P, ..., P+k-1.
   Each writes its keys and values of the first L' layers into its slot (slot = position), and
   its layer-L' stream is kept. d_i = argmax of the exit logits.
2. Verify: run d_k through blocks [0, L') too (it is the one token the draft did not run), stack
   it under the kept streams, and run the k + 1 streams through blocks [L', L) in ONE call at
   positions P..P+k, then the head: k + 1 logits, as one full forward pass would give.

Step 2 is cheaper than lab 05's verification: the first L' layers of r, d_1..d_(k-1) are exactly
what the target's own forward pass would compute there (the same weights, the same inputs, the
same cached keys and values before them), so they are not computed again; only the remaining
L - L' layers run on the drafted tokens.

Acceptance is ``labkit.tree.walk`` on a chain: at each position the target draws its token (its
argmax when greedy, a sample otherwise); the draft token is accepted if it equals the draw, else
the draw is emitted and the round stops. Every emitted token is the target's own draw: greedy
output is the target's token for token, and sampled output has exactly the target's distribution
(the drafts are certain proposals, the argmax of the exit head, and take no randomness: with a
seed, the sampled output does not even depend on k, L' or the adapter).

Rolling back costs nothing: the next round starts at the position after the last accepted token,
and each of its steps writes its slot, in every layer it reads, before reading it. A rejected
draft's keys and values are overwritten before anything can see them.

If a draft step costs c of a full decode step (c ~ L'/L, plus the head), the verification call v
decode steps (one where k + 1 tokens cost as much as one, as on a GPU; more on a CPU, and there
less from a deep exit than from a shallow one at the same k) and each draft token is accepted
with probability a, the speedup is about E / (k c + v), E = (1 - a^(k+1)) / (1 - a)
(``labkit.speculative.speculation_gain``): the early exit trades acceptance (deeper exits agree
with the target more often) against cost (deeper exits cost more to draft, less to verify).
``exit_agreement`` measures a by exit layer, ``round_costs`` c and v, and ``best_exit`` picks the
exit and k.

``exit_layer`` runs from 1 to L; at L the draft is the whole target (every greedy draft is
accepted: a check of the machinery, not a speedup). The shipped adapters (``load_adapters``, one
per exit 1..L-1, trained by ``labkit.heads``) are residual blocks h + silu(h W + b).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from labkit.bench import alternate
from labkit.generate import SamplingParams, cache_after, decode_step, seeded_generator, sequence_length
from labkit.heads import EARLY_EXIT, load_exit_adapters, streams_at
from labkit.model import ContiguousKVCache, Transformer, forward_tokens
from labkit.speculative import Round, SpeculationStats, speculation_gain, timed
from labkit.tree import chain, walk
from labkit.validate import is_int

Adapter = Callable[[Tensor], Tensor]  # the layer-L' stream [..., d_model] to a stream for the head


def self_speculative_stream(target: Transformer, exit_layer: int, prompt: Sequence[int],
                            params: SamplingParams = SamplingParams(), k: int = 4, *, adapter: Adapter | None = None,
                            eos_id: int | None = None, stats: SpeculationStats | None = None) -> Iterator[int]:
    """Yield new token ids: the target's first ``exit_layer`` blocks (then ``adapter``, if any, and
    the target's head) draft ``k`` tokens a round, the rest of the target verifies them. Greedy
    output equals ``generate.stream``'s token for token; sampled output has the target's distribution.
    ``stats`` records one ``Round`` per target call, the prompt's prefill first (an empty draft)."""
    capacity = sequence_length(target, prompt, params, eos_id)
    n_layers = target.config.n_layers
    if not is_int(exit_layer) or not 1 <= exit_layer <= n_layers:
        raise ValueError(f"exit_layer={exit_layer!r} must be an int in 1..n_layers={n_layers} (the blocks "
                         "that draft; 1..n_layers-1 for a speedup)")
    if not is_int(k) or k < 0:
        raise ValueError(f"k={k!r} must be 0 (no drafting) or more")
    stats = stats if stats is not None else SpeculationStats(k)
    if stats.k != k:
        raise ValueError(f"stats count rounds of k={stats.k} drafts, but this run drafts k={k}: SpeculationStats(k)")
    cache = ContiguousKVCache(target.config, 1, capacity, target.dtype, target.device)
    yield from _rounds(target, exit_layer, prompt, params, k, adapter, eos_id, stats, cache)


def _rounds(target: Transformer, exit_layer: int, prompt: Sequence[int], params: SamplingParams, k: int,
            adapter: Adapter | None, eos_id: int | None, stats: SpeculationStats,
            cache: ContiguousKVCache) -> Iterator[int]:
    """``self_speculative_stream``'s loop, its arguments checked, in a cache the caller made (a test
    reads it afterwards)."""
    device, generator, start = target.device, seeded_generator(params, target.device), time.perf_counter()
    sequence, draft = list(prompt), []
    logits = timed(stats, "target_s", device, lambda: forward_tokens(target, prompt, 0, cache)[-1:])
    while True:
        path, token = walk(chain(len(draft)), [sequence[-1], *draft], logits, params, generator)
        stats.rounds.append(Round(tuple(draft), len(path), token))
        stats.wall_s = time.perf_counter() - start
        for new in [*draft[:len(path)], token]:
            sequence.append(new)
            yield new
            if params.stop_at_eos and new == eos_id:
                return
        left = params.max_new_tokens - (len(sequence) - len(prompt))
        if left == 0:
            return
        root, position = sequence[-1], len(sequence) - 1  # everything before the root is cached
        draft, streams = timed(stats, "draft_s", device,
                                lambda: _draft(target, exit_layer, adapter, root, position, min(k, left - 1), cache))
        logits = timed(stats, "target_s", device,
                        lambda: _verify(target, exit_layer, [root, *draft][-1], streams, position, cache))


def load_adapters(target: Transformer, folder: str | Path = EARLY_EXIT) -> dict[int, Adapter]:
    """The trained early-exit adapters of ``target`` ({exit layer: adapter}), from ``labkit.heads``."""
    return {layer: (lambda x, heads=heads: heads(x)[0]) for layer, heads in load_exit_adapters(target, folder).items()}


def exit_logits(target: Transformer, stream: Tensor, adapter: Adapter | None = None) -> Tensor:
    """The exit head: the target's final norm and LM head on a layer-L' ``stream`` [..., d_model],
    through ``adapter`` first if there is one."""
    return target.head(stream if adapter is None else adapter(stream))


def _early(target: Transformer, exit_layer: int, token: int, position: int, cache: ContiguousKVCache) -> Tensor:
    """The stream ``[1, 1, d_model]`` of one token after blocks [0, exit_layer), their keys and
    values written to the token's slot."""
    positions = torch.tensor([[position]], device=target.device)
    ids = torch.tensor([[token]], device=target.device)
    return target.layers(target.embed(ids), positions, cache.plan(positions), 0, exit_layer)


@torch.inference_mode()
def _draft(target: Transformer, exit_layer: int, adapter: Adapter | None, root: int, position: int, n: int,
           cache: ContiguousKVCache) -> tuple[list[int], list[Tensor]]:
    """``n`` draft tokens after ``root`` (at ``position``), and the layer-L' streams of the tokens
    the draft ran: root, d_1, ..., d_(n-1)."""
    tokens, streams, token = [], [], root
    for i in range(n):
        streams.append(_early(target, exit_layer, token, position + i, cache))
        token = int(exit_logits(target, streams[-1][0, -1], adapter).argmax())
        tokens.append(token)
    return tokens, streams


@torch.inference_mode()
def _verify(target: Transformer, exit_layer: int, last: int, streams: list[Tensor], position: int,
            cache: ContiguousKVCache) -> Tensor:
    """The target's logits ``[len(streams) + 1, vocab]`` at positions position, position + 1, ...:
    the ``last`` token's first layers run here, everyone's remaining layers in one call."""
    x = torch.cat([*streams, _early(target, exit_layer, last, position + len(streams), cache)], dim=1)
    positions = torch.arange(position, position + x.shape[1], device=target.device)[None]
    return target.head(target.layers(x, positions, cache.plan(positions), exit_layer))[0]


# --- measuring: acceptance and cost by exit layer -------------------------------------------------

@torch.inference_mode()
def exit_agreement(target: Transformer, exit_layers: Sequence[int], batches: Iterable[Tensor],
                   adapters: Mapping[int, Adapter] | None = None, starts: Sequence[int] | None = None
                   ) -> dict[int, float]:
    """Per exit layer: how often the exit head's top-1 is the target's own top-1, over the positions
    of ``batches`` (token ids ``[B, T]``, teacher-forced: one pass per batch, every exit read from the
    same run of the stream) from ``starts[i]`` on in batch i (default 0: every position). On the
    target's own greedy text (a prompt's continuation: start at the prompt's last token) this is the
    greedy acceptance rate a of that exit, as a draft's context is then exactly the target's."""
    layers, last = sorted(set(exit_layers)), target.config.n_layers
    if not layers or not 1 <= layers[0] <= layers[-1] <= last:
        raise ValueError(f"exit_layers={list(exit_layers)} must be ints in 1..n_layers={last}")
    batches = list(batches)
    if starts is not None and len(starts) != len(batches):
        raise ValueError(f"one start per batch: {len(starts)} starts for {len(batches)} batches")
    agree, total = dict.fromkeys(layers, 0), 0
    for i, batch in enumerate(batches):
        first = starts[i] if starts is not None else 0
        streams = streams_at(target, torch.as_tensor(batch, device=target.device), [*layers, last])
        truth = target.head(streams[last][:, first:]).argmax(-1)
        for layer in layers:
            guess = exit_logits(target, streams[layer][:, first:], (adapters or {}).get(layer)).argmax(-1)
            agree[layer] += int((guess == truth).sum())
        total += truth.numel()
    return {layer: agree[layer] / total for layer in layers}


def draft_step(target: Transformer, exit_layer: int, context: int,
               adapter: Adapter | None = None) -> Callable[[], tuple[list[int], list[Tensor]]]:
    """One draft step (one token through blocks [0, exit_layer) and the exit head) after ``context``
    cached tokens, as a callable to time: ``generate.decode_step``'s counterpart."""
    cache = cache_after(target, context, context + 1)
    return lambda: _draft(target, exit_layer, adapter, 0, context, 1, cache)


@torch.inference_mode()
def verify_step(target: Transformer, exit_layer: int, k: int, context: int) -> Callable[[], Tensor]:
    """The verification call of a round of ``k`` drafts after ``context`` cached tokens (the last
    draft through blocks [0, exit_layer), then all k + 1 tokens through the rest and the head), as
    a callable to time."""
    cache = cache_after(target, context, context + k + 1)
    streams = [_early(target, exit_layer, 0, context + i, cache) for i in range(k)]
    return lambda: _verify(target, exit_layer, 0, streams, context, cache)


class RoundCosts(NamedTuple):
    """A round's passes in full decode steps: ``draft[L']``, one draft step through exit L' (c), and
    ``verify[L', k]``, the verification call of k drafts from exit L' (v), for the k timed; ``noisy``: the
    timings among them whose runs spread widely (a busy machine), by label ("full", "draft 3", "verify 3 4")."""
    draft: dict[int, float]
    verify: dict[tuple[int, int], float]
    noisy: tuple[str, ...] = ()

    def v(self, exit_layer: int, k: int) -> float:
        """The verification of ``k`` drafts from ``exit_layer``: as timed, or on the straight line
        between the two k timed around it. ValueError for a k outside the timed range, or an exit
        with none timed."""
        timed = sorted(j for layer, j in self.verify if layer == exit_layer)
        if not timed or not timed[0] <= k <= timed[-1]:
            raise ValueError(f"k={k} from exit {exit_layer}: its verification was timed at k in {timed or 'none'}; "
                             f"time the k wanted (round_costs' ks)")
        return float(np.interp(k, timed, [self.verify[exit_layer, j] for j in timed]))

    def gain(self, a: float, exit_layer: int, k: int) -> tuple[float, float]:
        """``speculation_gain`` at ``exit_layer`` with ``k`` drafts and acceptance ``a``: expected
        tokens per target call, and the speedup E / (k c + v) with this exit's c and v."""
        return speculation_gain(a, k, self.draft[exit_layer], self.v(exit_layer, k))


def round_costs(target: Transformer, exit_layers: Sequence[int], ks: Sequence[int] = (1, 2, 4, 8),
                context: int = 128, repeats: int = 20, adapters: Mapping[int, Adapter] | None = None,
                warmup: int = 2) -> RoundCosts:
    """Per exit layer, the median time of a draft step, and per exit layer and k in ``ks``, that of a
    verification call, each over that of a full decode step, all timed in turn after ``context``
    cached tokens: the c and v of E / (k c + v) (``RoundCosts.v`` reads v between the k timed), and which
    timings spread widely."""
    steps = {"full": decode_step(target, context)}
    steps |= {f"draft {layer}": draft_step(target, layer, context, (adapters or {}).get(layer))
              for layer in exit_layers}
    steps |= {f"verify {layer} {k}": verify_step(target, layer, k, context) for layer in exit_layers for k in ks}
    timings = alternate(steps, warmup=warmup, repeats=repeats, device=target.device)
    full = timings["full"].median_s
    return RoundCosts({layer: timings[f"draft {layer}"].median_s / full for layer in exit_layers},
                      {(layer, k): timings[f"verify {layer} {k}"].median_s / full for layer in exit_layers for k in ks},
                      tuple(label for label, timing in timings.items() if timing.noisy))


def best_exit(agreement: Mapping[int, float], costs: RoundCosts | Mapping[int, float],
              ks: Sequence[int] = range(1, 9)) -> tuple[int, int, float]:
    """The exit layer and k with the highest expected speedup E / (k c + v) (``speculation_gain``),
    from measured ``agreement`` (a) by exit layer and ``costs``: ``round_costs``' c and v, or c
    alone by exit layer (then v = 1, a verification as dear as one decode step): (exit_layer, k,
    speedup)."""
    if not isinstance(costs, RoundCosts):
        costs = RoundCosts(dict(costs), {(layer, k): 1.0 for layer in costs for k in ks})
    return max(((layer, k, costs.gain(agreement[layer], layer, k)[1]) for layer in costs.draft for k in ks),
               key=lambda choice: choice[2])
