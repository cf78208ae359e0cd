"""Speculative decoding: a cheap drafter proposes k tokens, the target checks them in one call.

A round, with the text so far x:
1. The drafter proposes d_1..d_k, each d_i drawn from its distribution q_i(. | x, d_1..d_{i-1}).
2. The target runs ONCE on [last token of x, d_1, ..., d_k] and gives p_1..p_{k+1}, where
   p_i = p(. | x, d_1..d_{i-1}): k + 1 next-token distributions for the price of one call.
3. For i = 1..k: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)). At the first rejection
   draw the next token from the residual norm(max(p_i - q_i, 0)) and stop. If all k are
   accepted, draw a bonus token from p_{k+1}.

Every round emits between 1 and k + 1 tokens, and each is distributed exactly as the target
alone would draw it (Leviathan et al., 2023; Chen et al., 2023): a token x is emitted either
by acceptance, with probability q(x) min(1, p(x)/q(x)) = min(q(x), p(x)), or after a rejection,
with probability (1 - sum min(p, q)) * max(p(x) - q(x), 0) / sum max(p - q, 0) = max(p(x) - q(x), 0);
the two add up to p(x). Greedy (temperature 0) is the special case of one-hot distributions:
accept while d_i is the target's argmax, then emit the target's argmax.

If each draft token is accepted with probability a, independently, a round emits on average

    E = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens for one target call; when a draft step costs c target steps and verifying k + 1 tokens
costs what one step does, the speedup is E / (k c + 1).

Drafters: a smaller model with the same tokenizer (``ModelDrafter``: its own KV cache, rolled
back with the target's), or ``PromptLookupDrafter``: find an earlier occurrence of the text's
last n tokens and propose what followed it; no second model. A lookup's proposal is
certain (q is one-hot), so its token is accepted with probability p(d_i).
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Protocol, Sequence, TypeVar

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor

from labkit.answers import answer_to
from labkit.compile import static_decoder
from labkit.corpus import functions
from labkit.device import synchronize
from labkit.generate import SamplingParams, sampling_probs, seeded_generator, sequence_length
from labkit.model import ContiguousKVCache, Transformer, forward_tokens
from labkit.static_cache import StaticKVCache, static_length
from labkit.validate import check_ints

if TYPE_CHECKING:
    from labkit.bench import Timing


@answer_to("ex05.1")
def acceptance_rule(p: Tensor, q: Tensor, token: int) -> tuple[float, Tensor]:
    """For a draft ``token`` drawn from ``q``: the probability of accepting it, min(1, p/q), and the
    residual distribution norm(max(p - q, 0)) to draw from if it is rejected (``p`` itself when
    nothing is left, p == q, where rejection cannot happen)."""
    if q[token] <= 0:
        raise ValueError(f"draft token {token} has probability {float(q[token])} under q: "
                         "it cannot have been drawn from q")
    accept = min(1.0, float(p[token] / q[token]))
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    return accept, residual / total if total > 0 else p


@answer_to("ex05.2")
def verify_greedy(draft: Sequence[int], target_logits: Tensor) -> tuple[list[int], int]:
    """Greedy verification: ``target_logits`` ``[len(draft) + 1, vocab]`` are the target's logits
    after each prefix (row i: the logits that predict draft[i]). Accept the draft tokens
    while each is the target's argmax; the next token is the target's argmax after them."""
    best = target_logits.argmax(-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == best[accepted]:
        accepted += 1
    return list(draft[:accepted]), best[accepted]


def verify_sampled(draft: Sequence[int], q: Tensor, p: Tensor,
                   generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Speculative sampling: ``q`` ``[k, vocab]`` are the distributions the k draft tokens were drawn
    from, ``p`` ``[k + 1, vocab]`` the target's. Returns the accepted tokens and the next token
    (from the residual at the first rejection, else the bonus from p's last row). ``q`` is moved
    to ``p``'s device: prompt lookup builds its one-hot q on the CPU."""
    q = q.to(p.device) if q is not None else q
    for i, token in enumerate(draft):
        accept, residual = acceptance_rule(p[i], q[i], token)
        if float(torch.rand((), generator=generator, device=p.device)) >= accept:
            return list(draft[:i]), int(torch.multinomial(residual, 1, generator=generator))
    return list(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


@answer_to("ex05.3")
def speculation_gain(a: float, k: int, c: float, v: float = 1.0) -> tuple[float, float]:
    """Expected tokens per target call, (1 - a^(k+1)) / (1 - a) (k + 1 when a = 1), and the
    expected speedup over the target alone, that over k c + v, for acceptance rate ``a``, ``k``
    draft tokens, a draft step costing ``c`` target steps and verification of k + 1 tokens ``v``
    (1 where a few more tokens per call are free, as on a GPU)."""
    if not 0 <= a <= 1:
        raise ValueError(f"a={a} is an acceptance rate: it must be in [0, 1] (not a percentage)")
    if k < 0 or c < 0 or v <= 0:
        raise ValueError(f"k={k} and c={c} must be >= 0 and v={v} > 0")
    tokens = k + 1.0 if a == 1 else (1 - a ** (k + 1)) / (1 - a)
    return tokens, tokens / (k * c + v)


def verification_line(v: Mapping[int, float]) -> tuple[float, float]:
    """``(v_call, v_token)``: the line v = v_call + v_token k through the verification costs ``v`` (k -> target
    decode steps that verifying k + 1 tokens costs) by least squares, kept where a verification can be: through
    v = 1 at k = 0 where it would start below one decode step, flat at the mean of v (at least 1) where it would
    fall with k."""
    ks = _two_ks_at_least(v)
    slope, intercept = statistics.linear_regression(ks, [v[k] for k in ks])
    if intercept < 1:
        slope, intercept = sum(k * (v[k] - 1) for k in ks) / sum(k * k for k in ks), 1.0
    if slope < 0:
        slope, intercept = 0.0, max(1.0, statistics.fmean(v.values()))
    return intercept, slope


def _two_ks_at_least(v: Mapping[int, float]) -> list[int]:
    """The k of ``v`` in order; a ValueError unless there are two or more: one k makes no line."""
    if len(v) < 2:
        raise ValueError(f"verification costs at {len(v)} k ({sorted(v)}): a line against k needs two k or more")
    return sorted(v)


def verification_verdict(v: Mapping[int, float], where: str, timings: Mapping[str, Timing]) -> str:
    """What the verification costs ``v`` (k -> target decode steps that verifying k + 1 tokens costs) say, with
    the timings' spread considered: nearly free; growing with k (a line fitted to v against k rises by more than
    twice the spread, and v never falls by more than the spread from one k to the next); inconsistent (it
    falls); or no steady growth, a fixed extra cost per call. ``timings`` holds the timed steps, ``"target"``
    and ``"verify k"`` for each k, whose quartiles give each v its spread; ``where`` ends the first sentence."""
    ks = _two_ks_at_least(v)
    verdict = f"Verification costs {min(v.values()):.2f} to {max(v.values()):.2f} decode steps {where}: "
    if max(v.values()) < 1.2:
        return verdict + "nearly free here: a step's cost hardly grows with its tokens."
    target = timings["target"]
    # the spread of one v: the relative spreads (interquartile ranges) of its two timings, added; median over k
    spread = statistics.median(v[k] * (timings[f"verify {k}"].spread_s / timings[f"verify {k}"].median_s
                                       + target.spread_s / target.median_s) for k in ks)
    slope = statistics.linear_regression(ks, [v[k] for k in ks]).slope
    rise = slope * (ks[-1] - ks[0])
    falls = [(j, k) for j, k in zip(ks, ks[1:]) if v[k] < v[j] - spread]
    trend = (f"a line fitted to v against k rises {slope:+.3f} decode steps per drafted token, {rise:+.2f} from "
             f"k = {ks[0]} to k = {ks[-1]}, against a spread of {spread:.2f} in each v (quartiles of its timings)")
    if rise > 2 * spread and not falls:
        return verdict + (f"it grows with k: {trend}, and v never falls by more than that spread from one k to the "
                          "next. Each extra token adds time, as arithmetic that grows with the tokens would, and "
                          "every round pays for its k.")
    if falls or rise < -2 * spread:  # a verification of more tokens cheaper than one of fewer: inconsistent timings
        where_falls = (f"v falls from k = {falls[0][0]} to k = {falls[0][1]} by more than the spread" if falls else
                       "the fitted line falls")
        return verdict + (f"no verdict: {trend}, and {where_falls}, though a verification of more tokens does the "
                          "work of one of fewer and more. The timings are not consistent across k: rerun demo 3.")
    return verdict + (f"no steady growth with k: {trend}, not beyond twice the spread. Mostly a fixed extra cost "
                      f"per verification call, about {statistics.fmean(v.values()) - 1:.2f} of a decode step on "
                      "average, which every round pays once. What makes a call of several tokens cost more than a "
                      "step is not measured here; a candidate: it takes another path than a decode step (a causal "
                      "mask, masked attention: more kernels whatever the tokens).")


@dataclass
class Proposal:
    """Draft tokens, and the distributions ``[len(tokens), vocab]`` they were drawn from (None when greedy)."""

    tokens: list[int]
    probs: Tensor | None = None


class Drafter(Protocol):
    vocab_size: int

    def start(self, capacity: int) -> None:
        """Get ready for a new sequence of at most ``capacity`` tokens."""

    def propose(self, sequence: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        """Up to ``k`` tokens to follow ``sequence`` (the whole text so far)."""

    def rollback(self, length: int) -> None:
        """Only the first ``length`` tokens of the sequence are final: forget anything after them."""


class ModelDrafter:
    """A small model with the target's vocabulary drafts k tokens, one forward call each, keeping
    its own KV cache; after verification it drafts on from the last token the target accepted
    (the cache's later slots are written again).

    With ``compiled``, the draft keeps a static cache and its one-token steps run compiled
    (``labkit.compile``): a small draft's step is almost all overhead, which compiling removes.
    With ``ahead_of_time`` (a CPU only), they run compiled ahead of time (``labkit.aot``), which
    removes the guard check and the Python wrapper too, and may make its matrix products its own,
    on copies of the draft's weights (where that is faster here; a step with copies refuses to run
    once a weight has been changed in place or given new memory); the step is built once per cache
    length and reused by every generation. Catching up on several tokens (the prompt, or a bonus
    token) stays eager."""

    def __init__(self, model: Transformer, compiled: bool = False, ahead_of_time: bool = False) -> None:
        self.model, self.vocab_size = model, model.config.vocab_size
        self.compiled, self.ahead_of_time = compiled or ahead_of_time, ahead_of_time
        self.cache: ContiguousKVCache | StaticKVCache | None = None
        self.step: Callable[[Tensor, Tensor], Tensor] | None = None
        self.length = 0  # tokens of the sequence in the cache

    def start(self, capacity: int) -> None:
        config, dtype, device = self.model.config, self.model.dtype, self.model.device
        self.length = 0
        if not self.compiled:
            self.cache = ContiguousKVCache(config, 1, capacity, dtype, device)
            return
        if self.cache is None or self.cache.max_len != static_length(config, capacity):  # else reused
            self.cache, self.step = static_decoder(self.model, capacity, ahead_of_time=self.ahead_of_time)

    def _logits(self, fed: list[int]) -> Tensor:
        """The last logits of ``fed`` run after the cached tokens."""
        if self.step is not None and len(fed) == 1:
            device = self.model.device
            return self.step(torch.tensor([fed], device=device), torch.tensor([[self.length]], device=device))[0, -1]
        return forward_tokens(self.model, fed, self.length, self.cache)[-1]

    def propose(self, sequence: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        tokens, probs = [], []
        fed = sequence[self.length:]  # what the cache has not seen: the last token or two, or the prompt
        for _ in range(k):
            logits = self._logits(fed)
            self.length += len(fed)
            if params.temperature == 0:
                tokens.append(int(logits.argmax()))
            else:
                probs.append(sampling_probs(logits, params))
                tokens.append(int(torch.multinomial(probs[-1], 1, generator=generator)))
            fed = tokens[-1:]
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def rollback(self, length: int) -> None:
        self.length = min(self.length, length)


class PromptLookupDrafter:
    """Prompt lookup (n-gram) drafting: match the text's last n tokens (n from ``max_ngram`` down
    to ``min_ngram``) against everything before them and propose the tokens that followed the
    match (``lookup``). Certain proposals: q is one-hot."""

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram

    def start(self, capacity: int) -> None:
        pass

    def rollback(self, length: int) -> None:
        pass

    def propose(self, sequence: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        tokens = lookup(sequence, k, self.max_ngram, self.min_ngram)
        if params.temperature == 0:
            return Proposal(tokens)
        return Proposal(tokens, F.one_hot(torch.tensor(tokens, dtype=torch.long), self.vocab_size).float())


def lookup(sequence: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the sequence's last n tokens, for
    the longest n in [min_ngram, max_ngram] that occurs; [] when none does. Of the occurrences,
    the latest that is followed by k tokens, else the one followed by the most (the earliest): in
    text that repeats a short stretch, the latest occurrence runs into the end of the text after a
    few tokens, while an earlier one can propose all k."""
    for n in range(min(max_ngram, len(sequence) - 1), min_ngram - 1, -1):
        tail, earliest = list(sequence[-n:]), None
        for start in range(len(sequence) - n - 1, -1, -1):
            if list(sequence[start:start + n]) == tail:
                if len(sequence) - start - n >= k:
                    return list(sequence[start + n:start + n + k])
                earliest = start
        if earliest is not None:
            return list(sequence[earliest + n:earliest + n + k])
    return []


@dataclass(frozen=True)
class Round:
    """One target call: what was drafted, how many of those tokens were accepted, the token the
    target added (a correction after a rejection, or a bonus after all were accepted). A call that
    verified a token tree (``labkit.medusa``) also keeps the tree's parents and the accepted nodes."""

    draft: tuple[int, ...]
    accepted: int
    token: int
    tree: tuple[int, ...] = ()
    branch: tuple[int, ...] = ()

    @property
    def emitted(self) -> list[int]:
        return [*self.draft[:self.accepted], self.token]

    @property
    def bonus(self) -> bool:
        """All drafted tokens accepted, so the target's token came free."""
        return bool(self.draft) and self.accepted == len(self.draft)


@dataclass
class SpeculationStats:
    """What a speculative run did, round by round, and how long it took (seconds)."""

    k: int
    rounds: list[Round] = field(default_factory=list)
    draft_s: float = 0.0
    target_s: float = 0.0
    wall_s: float = 0.0

    @property
    def generated(self) -> int:
        return sum(len(r.emitted) for r in self.rounds)

    def position_counts(self) -> tuple[list[int], list[int]]:
        """Per draft position i: how many rounds reached it (every token before it accepted, one
        drafted there), and how many of those accepted it."""
        reached, accepted = [0] * self.k, [0] * self.k
        for r in self.rounds:
            for i in range(min(len(r.draft), r.accepted + 1)):
                reached[i] += 1
                accepted[i] += i < r.accepted
        return reached, accepted

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """Acceptance rate at each draft position, given that the round got there (None if none did)."""
        return [a / n if n else None for n, a in zip(*self.position_counts())]

    @property
    def acceptance_rate(self) -> float:
        """Draft tokens accepted over draft tokens judged (in each round, those up to and including the first
        rejected; the drafts after it are thrown away unjudged): the a of (1 - a^(k+1)) / (1 - a)."""
        reached, accepted = self.position_counts()
        return sum(accepted) / sum(reached) if sum(reached) else 0.0

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per round."""
        return sum(r.accepted for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def tokens_per_call(self) -> float:
        return self.generated / len(self.rounds) if self.rounds else 0.0


def speculative_stream(target: Transformer, drafter: Drafter, prompt: Sequence[int],
                       params: SamplingParams = SamplingParams(), k: int = 4, *, eos_id: int | None = None,
                       stats: SpeculationStats | None = None) -> Iterator[int]:
    """Yield new token ids, produced ``k`` drafts at a time and verified by ``target``. Greedy
    output equals ``generate.stream``'s token for token; sampled output has the target's distribution."""
    capacity = sequence_length(target, prompt, params, eos_id)
    check_ints(k=k)
    if k < 0:
        raise ValueError(f"k={k} must be 0 (no drafting) or more")
    if isinstance(drafter, Transformer):
        raise TypeError("drafter must be a Drafter, not a model: wrap the draft model as ModelDrafter(draft)")
    if drafter.vocab_size != target.config.vocab_size:
        raise ValueError(f"the drafter has a vocabulary of {drafter.vocab_size} tokens, the target "
                         f"{target.config.vocab_size}: they must share one tokenizer")
    stats = stats if stats is not None else SpeculationStats(k)
    if stats.k != k:
        raise ValueError(f"stats count rounds of k={stats.k} drafts, but this run drafts k={k}: SpeculationStats(k)")
    generator = seeded_generator(params, target.device)
    cache = ContiguousKVCache(target.config, 1, capacity, target.dtype, target.device)
    drafter.start(capacity)
    sequence, cached, start = list(prompt), 0, time.perf_counter()
    while len(sequence) - len(prompt) < params.max_new_tokens:
        room = min(k, params.max_new_tokens - (len(sequence) - len(prompt)) - 1)  # drafts that could be emitted
        proposal = timed(stats, "draft_s", target.device,
                          lambda: drafter.propose(sequence, room, params, generator) if room else Proposal([]))
        fed = sequence[cached:] + proposal.tokens
        logits = timed(stats, "target_s", target.device, lambda: forward_tokens(target, fed, cached, cache))
        logits = logits[-len(proposal.tokens) - 1:]
        if params.temperature == 0:
            accepted, token = verify_greedy(proposal.tokens, logits)
        else:
            accepted, token = verify_sampled(proposal.tokens, proposal.probs, sampling_probs(logits, params), generator)
        stats.rounds.append(Round(tuple(proposal.tokens), len(accepted), token))
        cached = len(sequence) + len(accepted)  # the next round runs from here: rejected slots are written again
        drafter.rollback(cached)
        stats.wall_s = time.perf_counter() - start
        for new in [*accepted, token]:
            sequence.append(new)
            yield new
            if params.stop_at_eos and new == eos_id:
                return


def teacher_forced_hits(logits_of: Callable[[Tensor], Tensor], text: Sequence[int], device: torch.device) -> list[bool]:
    """``hits[t]``: whether a drafter's greedy guess after position ``t`` of ``text`` (the target's own
    greedy text, prompt included, with no eos inside) is ``text[t + 1]``, from one pass: ``logits_of``
    maps token ids ``[1, T]`` to logits ``[1, T, vocab]`` (a draft model; the target's exit). A greedy
    round's i-th draft reads the text with its i - 1 drafts before it, which is the target's text for as
    long as they are accepted, so these hits are what the rounds would see."""
    with torch.inference_mode():
        guessed = logits_of(torch.tensor([list(text)], device=device))[0].argmax(-1).tolist()
    return [guess == truth for guess, truth in zip(guessed, text[1:])]


def check_run(prompt_length: int, new_tokens: int, text_length: int) -> None:
    """ValueError unless a run of ``new_tokens`` after a prompt of ``prompt_length`` (both at least 1)
    fits in the ``text_length`` tokens whose hits or ranks were found."""
    check_ints(prompt_length=prompt_length, new_tokens=new_tokens)
    if min(prompt_length, new_tokens) < 1 or prompt_length + new_tokens > text_length:
        raise ValueError(f"a prompt of {prompt_length} and {new_tokens} new tokens (each at least 1) must lie within "
                         f"the {text_length} tokens of text the hits or ranks were found on")


def chain_calls(hits: Sequence[bool], prompt_length: int, new_tokens: int, k: int, prompt_pass: bool) -> int:
    """The target calls a greedy run of ``k`` drafts a round makes for ``new_tokens`` tokens, counted
    from ``teacher_forced_hits`` of the prompt and those tokens, without running it: each round
    accepts drafts while they hit, then emits the target's token; near the end a round drafts only
    what could still be emitted. The first call verifies drafts after the prompt
    (``speculative_stream``), or, with ``prompt_pass``, is the prompt's own pass, which emits one
    token (``self_speculative_stream``)."""
    check_ints(k=k)
    if k < 0:
        raise ValueError(f"k={k} must be 0 (no drafting) or more")
    check_run(prompt_length, new_tokens, len(hits) + 1)
    calls = emitted = int(prompt_pass)
    while emitted < new_tokens:
        room, at, accepted = min(k, new_tokens - emitted - 1), prompt_length + emitted - 1, 0
        while accepted < room and hits[at + accepted]:
            accepted += 1
        emitted, calls = emitted + accepted + 1, calls + 1
    return calls


T = TypeVar("T")


def timed(stats: SpeculationStats, name: str, device: torch.device, work: Callable[[], T]) -> T:
    """Run ``work`` and add the seconds it took to ``stats.<name>``."""
    start = time.perf_counter()
    result = work()
    synchronize(device)
    setattr(stats, name, getattr(stats, name) + time.perf_counter() - start)
    return result


def continuation_prompts(tokenizer: Tokenizer, n: int, seed: int = 0, lines: int = 3,
                         split: str = "validation") -> list[list[int]]:
    """The first ``lines`` lines of ``n`` functions of ``split``, chosen at random with ``seed``:
    the model writes the rest."""
    chosen = _sample_functions(tokenizer, n, seed, split)
    return [tokenizer.encode("\n".join(f.split("\n")[:lines])).ids for f in chosen]


def editing_prompts(tokenizer: Tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """Editing code: a function, a blank line, then its first two lines again, so that what comes
    next is, for a model that copies, much of the prompt once more."""
    chosen = _sample_functions(tokenizer, n, seed)
    return [tokenizer.encode(f + "\n\n" + "\n".join(f.split("\n")[:2])).ids for f in chosen]


def _sample_functions(tokenizer: Tokenizer, n: int, seed: int, split: str = "validation",
                      tokens: tuple[int, int] = (60, 160)) -> list[str]:
    """``n`` functions of ``split`` of ``tokens`` (low, high) tokens, chosen at random with ``seed``."""
    found = functions(split)
    pool = [f for f, e in zip(found, tokenizer.encode_batch(list(found))) if tokens[0] <= len(e.ids) <= tokens[1]]
    return random.Random(seed).sample(pool, n)
