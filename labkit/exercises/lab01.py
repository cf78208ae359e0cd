"""Notebook 01 (KV cache): count the work, write the cached attention step and the cached loop."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from labkit.cost import tokens_processed
from labkit.exercises.spec import Case, Exercise
from labkit.generate import CountingModel, SamplingParams, stream
from labkit.model import ModelConfig, Transformer


def _tokens_cases() -> list[Case]:
    never_fed_back = "the last new token is never fed back in"
    sizes = [
        ("the textbook example: 10-token prompt, 100 new tokens", (10, 100),
         "Demo 2's counters ran this very example: compare with them. The often-quoted 6,050 and 110 assume that "
         "step i already holds the token it is about to produce, and feed the last one back; but the first call runs "
         f"the prompt alone, and {never_fed_back}"),
        ("one new token: a single forward pass of the prompt", (7, 1),
         f"one new token takes one forward call of the 7 prompt tokens alone, in either loop: {never_fed_back}, so "
         "nothing else runs"),
        ("a one-token prompt", (1, 50),
         "with P = 1 the naive calls run 1, 2, ..., up to the tokens of the last call: check where your sum starts "
         f"and where it stops ({never_fed_back})"),
        ("16-token prompt, 512 new tokens", (16, 512),
         "many new tokens: the part that grows as N squared dominates; an off-by-one in where the sum over steps "
         "stops, or a division that leaves a float, shows here"),
        ("long prompt, few new tokens", (2000, 3),
         "a long prompt: the naive loop runs the whole prompt again in each of its N calls, the cached loop only "
         "once; and N = 3 is odd: a sum 0 + 1 + ... + (N - 1) is N (N - 1) / 2, and N // 2 * (N - 1) drops the half, "
         "where N * (N - 1) // 2 does not"),
    ]
    # big enough that no loop over the steps answers within the second, small enough that one running
    # inside C, which no signal interrupts (sum(range(...))), still returns in seconds, to fail here
    formula = Case("300 million new tokens: only a formula answers in time", (1000, 3 * 10**8),
                   tokens_processed(1000, 3 * 10**8), within_s=1.0,
                   hint="the counts must come from a formula, not from a loop over the steps: this case has "
                        "300 million of them. What is 0 + 1 + ... + (N-1) in closed form?")
    # N (N - 1) here is past 2^53, where floats skip integers: a / on the way makes the count inexact
    exact = Case("300,000,003 new tokens: a count past what a float holds exactly", (1000, 3 * 10**8 + 3),
                 tokens_processed(1000, 3 * 10**8 + 3), within_s=1.0,
                 hint="N (N - 1) is about 9 x 10^16 here, beyond 2^53, past which a float cannot hold every "
                      "integer: a / (or a float anywhere on the way, int() around it or not) rounds the count. Keep "
                      "it in integers: //")
    return [Case(label, args, tokens_processed(*args), hint=hint) for label, args, hint in sizes] + [formula, exact]


def reference_attention_step(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor,
                             v_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Append, then attend with torch's fused attention (each KV head serves a group of query heads)."""
    keys, values = torch.cat([k_cache, k_new], dim=2), torch.cat([v_cache, v_new], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=q.shape[1] != keys.shape[1])
    return out, keys, values


def _attention_cases() -> list[Case]:
    shapes = [  # batch, query heads, KV heads, cached tokens, head_dim, hint: each case catches its slip first
        ("empty cache: the first token attends only to itself", (1, 4, 4, 0, 16),
         "with S = 0 the caches have length 0 on the sequence axis: append the new key and value there (dim 2) "
         "first, attend over every key including the new one, and return the caches with them appended; the new "
         "token's softmax weight is then 1, so each head's output is its own new value"),
        ("MHA, head_dim 1: where the softmax runs", (1, 4, 4, 7, 1),
         "the first case with a cache: the new key and value go after the 7 cached ones (torch.cat([cache, new], "
         "dim=2), in that order), and the query attends over all 8. With head_dim 1 the scale 1/sqrt(head_dim) is "
         "1 (head_dim is the last dimension of q, not the number of tokens), so if the caches come out right, the "
         "softmax's axis is what is left: it runs over the keys (the last axis of the scores [batch, heads, 1, "
         "S + 1]), not over the single query. No mask either: the new query sees all S + 1 keys"),
        ("MHA: 4 query heads, 4 KV heads, 7 cached tokens", (1, 4, 4, 7, 16),
         "the scores are q . k divided by sqrt(head_dim) (4 here) before the softmax"),
        ("GQA: 8 query heads share 2 KV heads, batch of 2", (2, 8, 2, 5, 32),
         "query heads 0-3 read KV head 0 and query heads 4-7 read KV head 1: consecutive blocks of g query heads, "
         "not every other head; and the batch of 2 must stay two independent sequences"),
        ("MQA: 6 query heads share 1 KV head", (1, 6, 1, 9, 8),
         "a single KV head serves all 6 query heads: each of them attends over the same keys and values"),
    ]
    generator = torch.Generator().manual_seed(1)
    cases = []
    for label, (batch, heads, kv_heads, cached, dim), hint in shapes:
        def draw(n_heads: int, length: int) -> Tensor:
            return torch.randn(batch, n_heads, length, dim, generator=generator)
        args = (draw(heads, 1), draw(kv_heads, 1), draw(kv_heads, 1), draw(kv_heads, cached), draw(kv_heads, cached))
        cases.append(Case(label, args, reference_attention_step(*args), rtol=1e-4, atol=1e-5, hint=hint,
                          unchanged=True, refuses=(F.scaled_dot_product_attention,)))
    return cases


def _expect_cached(model: CountingModel, prompt: Sequence[int], new_tokens: int) -> None:
    """Prefill once with the whole prompt, then one token per decode step."""
    expected = [len(prompt)] + [1] * (new_tokens - 1)
    if model.calls != expected:
        def shown(calls: list[int]) -> str:
            return f"{len(calls)} calls of {calls if len(calls) <= 6 else calls[:5] + ['...']} tokens ({sum(calls)} in all)"
        raise AssertionError(f"the right tokens, but the model ran in {shown(model.calls)}; cached generation makes "
                             f"{shown(expected)}: the prompt once, then one token per step")


def random_model(n_heads: int, n_kv_heads: int, seed: int) -> Transformer:
    """A small random model whose logits are far apart, so that greedy choices are clear-cut."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads,
                         d_ff=128, max_seq_len=128)
    model = Transformer(config)
    model.reset_parameters(std=0.3)
    return model.eval()


def _generate_cases() -> list[Case]:
    from labkit.load import load  # the shipped draft model, on the CPU

    draft, tokenizer = load("draft", device="cpu")
    runs = [
        ("MHA random model, 3-token prompt, 12 new tokens", random_model(4, 4, seed=0), [5, 17, 3], 12,
         "the prompt goes in once, at positions 0..P-1, and its last logits give the first new token; then each call "
         "feeds only the newest token, at the next position (P, P+1, ...), through the one cache made before the "
         "loop (a new cache each step forgets the prompt): N new tokens take N calls, because the last new token "
         "is never fed back, so the cache holds P + N - 1 positions, not fewer"),
        ("GQA random model, 1-token prompt, 20 new tokens", random_model(8, 2, seed=1), [42], 20,
         "a one-token prompt: the prefill is a single token at position 0, and the first decode step's token sits at "
         "position 1; the cache must have room for every position the model is fed"),
        ("one new token: the prefill alone", random_model(4, 1, seed=2), [1, 2, 3, 4], 1,
         "one new token: the argmax of the prefill's last logits is the whole answer, so no decode call may run"),
        ("the shipped draft model on Python code", draft, tokenizer.encode("def add(a, b):\n    return").ids, 24,
         "a trained model on real text, 24 tokens: every token must equal naive greedy generation's; where the first "
         "one differs, look at that step's input token and position"),
    ]
    cases = []
    for label, model, prompt, new_tokens, hint in runs:
        params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
        naive = list(stream(model, prompt, params, use_cache=False))
        cases.append(Case(label, (CountingModel(model), prompt, new_tokens), naive, after=_expect_cached, hint=hint))
    return cases


EXERCISES = [
    Exercise(
        id="ex01.1", title="Tokens processed, in closed form", points=1, function="tokens_processed",
        cases=_tokens_cases, returns=("naive", "cached"),
        recipe="Naive step i (i = 0 .. N-1) runs the prompt plus the i tokens generated so far: add P + i over "
             "those steps (N times P, plus 0 + 1 + ... + (N-1), a sum with a closed form; keep it in integers "
             "with //). Cached runs the prompt once, then one token per step for each new token but the last, "
             "which is never fed back in. Return two ints.",
    ),
    Exercise(
        id="ex01.2", title="One cached attention step", points=2, function="cached_attention_step",
        returns=("out", "k_cache", "v_cache"),
        cases=_attention_cases,
        recipe="Concatenate along the sequence axis (dim 2). Scores are q @ k^T / sqrt(head_dim), softmax "
             "over the keys, times v. With fewer KV heads, KV head j serves query heads "
             "j*g .. j*g+g-1 (g = query heads / KV heads): repeat_interleave the keys and values by g.",
    ),
    Exercise(
        id="ex01.3", title="The cached generation loop", points=2, function="cached_generate",
        cases=_generate_cases, timeout_s=120,
        recipe="The cache must hold every position the model is fed: the P prompt tokens and each new token but "
             "the last (never fed back), so P + N - 1 positions: make it once, before the loop, and pass a plan of "
             "that same cache to every call. Prefill: run the whole prompt at positions "
             "0..P-1 through a plan of the cache and take the argmax of the last position's logits. Then, "
             "N - 1 times, feed only the newest token at the next position (P, P+1, ...) and take the argmax again.",
    ),
]
