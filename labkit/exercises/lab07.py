"""Notebook 07 (Triton attention): the online softmax update, and the inner loop of the kernel."""
from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial
from typing import Any, Callable

import torch

from labkit.exercises.spec import Case, Exercise, SaysWhatToDo, Scenario
from labkit.kernels import flash_attention, interpreted, online_softmax_update, reference_attention
from labkit.kernels.bounds import watched_loads


def _fresh(rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.full((rows,), -math.inf), torch.zeros(rows), torch.zeros(rows, dim)


def _fold_all(update: Callable[..., Any], scores: torch.Tensor, values: torch.Tensor, width: int) -> None:
    """Fold ``scores`` ``[rows, S]`` a tile of ``width`` keys at a time with the student's
    update; the result must be softmax(scores) @ values."""
    m, l, acc = _fresh(scores.shape[0], values.shape[1])
    for start in range(0, scores.shape[1], width):
        m, l, acc = update(m, l, acc, scores[:, start:start + width], values[start:start + width])
    expected = torch.softmax(scores, dim=-1) @ values
    torch.testing.assert_close(acc / l[:, None], expected, rtol=1e-5, atol=1e-6,
                               msg=lambda text: f"after folding tiles of {width} keys, acc / l != softmax(s) v: {text}")


def _online_cases() -> list[Case | Scenario]:
    generator = torch.Generator().manual_seed(7)
    scores, values = torch.randn(4, 24, generator=generator) * 3, torch.randn(24, 8, generator=generator)
    first = online_softmax_update(*_fresh(4, 8), scores[:, :8], values[:8])
    larger = scores[:, 8:16] + 5  # every row's maximum grows: what was summed must be rescaled
    masked = scores[:, 16:].masked_fill(torch.rand(4, 8, generator=generator) < 0.5, -math.inf)
    cases: list[Case | Scenario] = [
        Case("the first tile, from m = -inf, l = 0, acc = 0", (*_fresh(4, 8), scores[:, :8], values[:8]), first,
             rtol=1e-5, atol=1e-6,
             hint="from the empty state the factor exp(m - m_new) is exp(-inf) = 0, so m, l and acc are the tile's "
                  "own: its row maximum, the sum of exp(scores - that maximum), and those weights times values; "
                  "acc stays unnormalised (not divided by l: that happens once, after the last tile); "
                  "a NaN here comes from -inf - (-inf), taken where it should not be, or from exp of a positive "
                  "difference overflowing to inf, times a sum of 0 (the factor is exp(m - m_new), at most 1). The "
                  "scores come scaled already: an m below the tile's largest score means they were scaled again"),
        Case("a tile with larger scores: the running sum and output are rescaled", (*first, larger, values[8:16]),
             online_softmax_update(*first, larger, values[8:16]), rtol=1e-5, atol=1e-6,
             hint="every row's maximum grows here: l and acc were summed as exp(s - old m) and must be multiplied by "
                  "exp(old m - new m) before the tile's terms are added, or the old tiles weigh too much"),
        Case("a tile with smaller scores: the maximum stays", (*first, scores[:, 8:16] - 5, values[8:16]),
             online_softmax_update(*first, scores[:, 8:16] - 5, values[8:16]), rtol=1e-5, atol=1e-6,
             hint="the running maximum is the larger of the old m and the tile's maximum, not the tile's maximum "
                  "alone; the tile's weights p are taken against that running maximum"),
        Case("masked scores (-inf) add nothing", (*first, masked, values[16:]),
             online_softmax_update(*first, masked, values[16:]), rtol=1e-5, atol=1e-6,
             hint="half the scores are -inf: exp(-inf - m) is 0, so they must add nothing to l or acc, and must not "
                  "become the row's maximum"),
    ]
    row, row_values = torch.randn(3, 40, generator=generator) * 10, torch.randn(40, 5, generator=generator)
    cases += [Scenario(f"a whole row of 40 scores folded {width} keys at a time equals softmax(s) v",
                       partial(lambda width, fn: _fold_all(fn, row, row_values, width), width),
                       hint=f"tiles of {width} keys folded one after another"
                            f"{f', the last one {40 % width} wide' if 40 % width else ''}: if the single steps pass "
                            "but this fails, what you return is not the state the next call needs (the order "
                            "m, l, acc, or l and acc normalised early)")
              for width in (8, 16)]
    return cases


def _in_nan(x: torch.Tensor, token_major: bool = False, extra_dims: int = 0) -> torch.Tensor:
    """``x`` ``[B, heads, S, d]`` as a view into a buffer of NaN that holds 16 tokens more per head (and
    ``extra_dims`` more dims per token), laid out [B, heads, S, d], or [B, S, heads, d] when ``token_major``:
    a load not masked to keys < S (or to dims < d) reads NaN, whatever lies in memory past the tensor."""
    batch, heads, n_tokens, dim = x.shape
    order = (0, 2, 1, 3) if token_major else (0, 1, 2, 3)  # each its own inverse
    size = (batch, heads, n_tokens + 16, dim + extra_dims)
    buffer = torch.full([size[axis] for axis in order], math.nan, dtype=x.dtype, device=x.device).permute(order)
    buffer[:, :, :n_tokens, :dim] = x
    return buffer[:, :, :n_tokens, :dim]


def _run_kernel(kernel: Any, shape: tuple[int, int, int, int, int, int], causal: bool, dtype: torch.dtype,
                token_major_k: bool = False) -> None:
    """Launch the student's kernel through ``flash_attention`` and compare with PyTorch's SDPA. K and V
    are views into buffers of NaN past their S tokens and past their head's dims (rows 16 wider), so a
    load not masked to keys < S or to dims < HEAD_DIM reads NaN; in the interpreter the loads are also
    watched (``watched_loads``). With ``token_major_k``, K lies in [B, S, heads, d] order: its token
    stride is not V's."""
    batch, heads, kv_heads, n_queries, n_keys, dim = shape
    generator = torch.Generator().manual_seed(sum(shape))
    device = "cpu" if interpreted() else "cuda"
    q = torch.randn(batch, heads, n_queries, dim, generator=generator).to(device, dtype)
    k, v = (torch.randn(batch, kv_heads, n_keys, dim, generator=generator).to(device, dtype) for _ in range(2))
    k, v = _in_nan(k, token_major=token_major_k, extra_dims=16), _in_nan(v, extra_dims=16)
    try:
        with watched_loads(Q=q, K=k, V=v) if interpreted() else nullcontext([]) as strays:
            out = flash_attention(q, k, v, causal=causal, block_m=16, block_n=16, kernel=kernel)
    except Exception as error:  # a stub is not attempted: the interpreter wraps what it raised, and
        if isinstance(error.__cause__, NotImplementedError):  # a GPU compiler refuses its raise
            raise error.__cause__ from None
        compile_error = any(kind.__name__ == "CompilationError" for kind in type(error).__mro__)  # or a subclass,
        if compile_error and "Raise" in str(error):  # UnsupportedLanguageConstruct in Triton 3.6
            raise NotImplementedError("the kernel still raises NotImplementedError") from None
        raise
    tolerance = 2e-5 if dtype == torch.float32 and device == "cpu" else 2e-3  # a GPU runs fp32 dots in TF32
    try:
        torch.testing.assert_close(out.float(), reference_attention(q, k, v, causal), rtol=tolerance, atol=tolerance)
    except AssertionError as error:
        if strays:  # what it read may be what went wrong: said first
            raise AssertionError(f"the output is wrong, and a load read past a tensor: {_strays(strays)}: a mask too "
                                 "wide or missing, or a pointer at another tensor's stride, reads there, and what it "
                                 "reads can reach the output") from None
        if bool(out.isnan().any()):
            raise AssertionError(f"{error}\n{_NAN_IN_THE_STATE}") from None
        raise
    if strays:
        raise SaysWhatToDo(f"the output is right, but a load read past a tensor: {_strays(strays)}. Its values were "
                           "dropped later (a score set to -inf, a column never stored), so no output shows it here; on "
                           "a GPU such a read takes another allocation's memory, or stops the kernel with an illegal "
                           f"memory access. {_MASK_EACH_LOAD}")


_MASK_EACH_LOAD = "Mask each load to the lanes inside the tensor: keys < S and dims < HEAD_DIM"
_NAN_IN_THE_STATE = ("NaN in the output, though every load stayed inside its tensor. A NaN comes from: a masked load "
                     "without other=0.0 (in the interpreter this check makes its masked lanes NaN; on a GPU they are "
                     "undefined); a row that sees no key at all (a causal mask that hides the query's own position: "
                     "keys <= position, not <); in the running state, -inf - (-inf), where a row's keys in a tile are "
                     "all masked and the maximum is the tile's alone (the running maximum is tl.maximum(m_i, the "
                     "tile's), finite once a key was seen); or tl.exp2 of a positive difference, inf times a sum of 0 "
                     "(alpha = tl.exp2(m_i - m_new), at most 1)")


def _strays(strays: list[str]) -> str:
    """The first read past a tensor, and how many more there were."""
    more = f" (and {len(strays) - 1} more loads past a tensor)" if len(strays) > 1 else ""
    return f"{strays[0]}{more}"


def _kernel_cases() -> list[Scenario]:
    runs = [  # label, (batch, heads, kv_heads, queries, keys, head dim), causal, what the run tests (its hint)
        ("32 queries over 64 keys, not causal: whole tiles, nothing to mask", (1, 2, 2, 32, 64, 32), False,
         "no score is masked here, so this case tests the update alone. The scores are in log2 units (scaled "
         "by scale_log2e): alpha and p are tl.exp2 of differences, not tl.exp. The running state goes from "
         "one tile to the next: l_i and acc multiplied by alpha before the tile's terms are added, and m_i, "
         "l_i and acc set to their new values at the end of each step. An error in tl.dot about its dimensions "
         "is a load's shape: the keys' tile is loaded transposed, [head dim, keys] (dims down, keys across), "
         "so that tl.dot(q, k_t) is [queries, keys], while the values' tile is [keys, head dim]. And the tile's "
         "keys are start + cols: start already counts keys, BLOCK_N at a time (not start * BLOCK_N)"),
        ("40 queries and keys, not causal: neither a multiple of the 16-wide tile", (1, 2, 2, 40, 40, 32), False,
         "the last key tile runs past S: its keys at or past S must be -inf in the scores and masked in both "
         "loads, the key load and the value load, with other=0.0: a lane masked without it is undefined (on a "
         "GPU whatever its register held; NaN in this check), and p = 0 times NaN is NaN"),
        ("20 queries over 9 keys, not causal: fewer keys than one tile", (1, 2, 2, 20, 9, 32), False,
         "the only key tile is mostly past S: those keys are -inf in every row, so each row's maximum must be "
         "taken over its own scores (tl.max over axis 1, the keys), and the running state must stay finite"),
        ("causal, 4 query heads per KV head (GQA), 33 tokens", (1, 4, 1, 33, 33, 16), True,
         "causal: a key later than the query's position must be -inf, in the tiles on the diagonal, which are "
         "partly masked even where they lie inside S; a query sees its own key (keys <= position)"),
        ("causal prefill after a cached prefix: 20 queries, 45 keys, head dim 48", (2, 2, 1, 20, 45, 48), True,
         "the queries are the last 20 of 45 positions: compare keys with position (rows + S - T), not with the "
         "row index; the head of 48 is padded to a block of 64, so dims past HEAD_DIM must be masked, with other=0.0 "
         "(a lane masked without it is NaN in this check, and q's zero times NaN is NaN)"),
        ("fp16 inputs, causal, 2 heads per KV head", (1, 4, 2, 24, 24, 32), True,
         "fp16 keys and values: the weights p are float32, so they must be cast to the values' dtype for "
         "tl.dot(p, v), while the sums stay in float32"),
        ("K laid out [batch, keys, heads, 64] and cut to head dim 48: other strides than V's", (1, 4, 2, 20, 37, 48),
         True,
         "K's token stride differs from V's and K holds NaN past the head's 48 dims: use stride_kt for keys and "
         "stride_vt for values, and mask the key load to dims < HEAD_DIM"),
    ]
    return [Scenario(label, partial(_run_kernel, shape=shape, causal=causal, token_major_k="K laid out" in label,
                                    dtype=torch.float16 if "fp16" in label else torch.float32), hint=hint)
            for label, shape, causal, hint in runs]


EXERCISES = [
    Exercise(
        id="ex07.1", title="The online softmax update", points=2, function="online_softmax_update",
        returns=("m", "l", "acc"),
        cases=_online_cases,
        recipe="The new maximum is the larger of m and the tile's row maxima. Everything summed so far was "
             "weighted by exp(. - m): multiply the old l and acc by exp(m - m_new) before adding the tile's "
             "p = exp(scores - m_new), summed for l and times values for acc. exp(-inf - x) is 0, as it should be.",
    ),
    Exercise(
        id="ex07.2", title="The inner loop of the Triton attention kernel", points=3,
        function="flash_attention_kernel", cases=_kernel_cases, timeout_s=180.0,
        recipe="Load the key tile transposed ([BLOCK_D, BLOCK_N], masked by keys < S and dims < HEAD_DIM), "
             "scores = tl.dot(q, k_t) * scale_log2e; when the tile is partly masked, set -inf where keys >= S "
             "and, when CAUSAL, where keys > position; then ex07.1's update in base 2 (tl.maximum, tl.max, "
             "tl.exp2, tl.sum over axis 1); load the value tile [BLOCK_N, BLOCK_D] and add "
             "tl.dot(p.to(v.dtype), v) to the rescaled acc.",
    ),
]
