"""The target with outlier features: the same function, a few activation channels made huge.

Large language models past a few billion parameters have a handful of hidden channels whose
activations at the projections' inputs are 10 to 100 times larger than the rest, in the same
channels in every layer (Dettmers et al., LLM.int8(), 2022; Xiao et al., SmoothQuant, 2023; Lin et
al., AWQ, 2023). They are why 4-bit rounding hurts real models, and why GPTQ and AWQ exist. The
lab's target, small and briefly trained, has only a trace of them. This module plants them
without changing the model's function. A block's norm multiplies by its weight g, and the
projection after it reads that through W, so for any factor f on channel c

    W (g * n) = (W with column c divided by f) (g with entry c multiplied by f, times n)

The recipe, ``outlier_model(model)``:

- channels ``CHANNELS``: the four channels of the target's residual stream with the largest mean
  |x| on text (``strongest_channels`` measures them; the card checks the list): in real models
  the outliers sit in the channels the model already leans on most, the same in every layer;
- factor ``FACTOR`` = 16 at both norms of every block (attn_norm before wqkv, mlp_norm before
  gate_up), which with their existing lead puts those channels at tens of times the median
  channel (the card prints the measured ratios), as in real models. A power of
  two: only the exponents move, so the rescaled weights are exact in fp32, bf16 and fp16, and
  the logits are the target's exactly;
- the final norm stays as it is: its projection is the LM head, tied to the embedding, whose
  columns cannot shrink without changing the embedding.

What rounding then meets: the columns of wqkv and gate_up for these channels are 16 times
smaller than the rest of their groups, whose weights set the grid, so round-to-nearest puts them
on the zero level or next to it and all but deletes the model's strongest channels. AWQ scales
those columns back up before rounding; GPTQ weighs each column's error by its input's variance
and pushes it onto the columns not yet rounded.

    python -m labkit.outliers --card    # measures it all and writes checkpoints/target-outliers/MODEL_CARD.md
"""
from __future__ import annotations

import argparse
import copy
import datetime
import math
import time

import torch
from torch import Tensor

import labkit
from labkit.awq import scale_model
from labkit.corpus import token_ids
from labkit.device import device_name
from labkit.load import CHECKPOINTS
from labkit.model import Transformer
from labkit.quant import Scheme, hooked, output_errors, quantize_model
from labkit.train import paired_difference, random_batch, window_losses

SCHEME = Scheme(4, 128)  # the lab's default grid (asymmetric) at the group size real INT4 models ship

CHANNELS = (266, 172, 34, 236)  # the target's strongest residual channels: strongest_channels(target, text, 4)
FACTOR = 16.0


def outlier_model(model: Transformer, channels: tuple[int, ...] = CHANNELS, factor: float = FACTOR) -> Transformer:
    """A copy of ``model`` whose norms before attention and MLP multiply ``channels`` by ``factor`` more,
    and whose wqkv and gate_up read those channels ``factor`` times weaker: the same function."""
    if not all(0 <= c < model.config.d_model for c in channels):
        raise ValueError(f"channels {channels} must lie in 0..d_model - 1 = {model.config.d_model - 1}")
    outliers = copy.deepcopy(model)
    picked = list(channels)
    with torch.no_grad():
        for block in outliers.blocks:
            for norm, projection in ((block.attn_norm, block.attn.wqkv), (block.mlp_norm, block.mlp.gate_up)):
                norm.weight[picked] *= factor
                projection.weight[:, picked] /= factor
    return outliers


def _at_norms(model: Transformer, tokens: Tensor, reduce) -> dict[str, tuple[Tensor, Tensor]]:
    """``reduce`` over the tokens of |x| per channel at the input (the residual stream) and at the
    output of each block's two norms, by norm name (``blocks.0.attn_norm``), on ``tokens`` ``[n, length]``."""
    found: dict[str, tuple[Tensor, Tensor]] = {}

    def recorder(name: str):
        def record(module: torch.nn.Module, args: tuple[Tensor], output: Tensor) -> None:
            found[name] = tuple(reduce(t.detach().abs().flatten(0, -2).float()) for t in (args[0], output))
        return record

    norms = {f"blocks.{i}.{kind}": getattr(block, kind) for i, block in enumerate(model.blocks)
             for kind in ("attn_norm", "mlp_norm")}
    hooks = [norm.register_forward_hook(recorder(name)) for name, norm in norms.items()]
    with hooked(hooks):
        model(tokens)
    return found


def norm_output_max(model: Transformer, tokens: Tensor) -> dict[str, Tensor]:
    """Max |x| per channel at the output of each block's two norms (the inputs of wqkv and gate_up),
    by norm name (``blocks.0.attn_norm``), over ``tokens`` ``[n, length]``."""
    return {name: output for name, (_, output) in _at_norms(model, tokens, lambda x: x.amax(0)).items()}


def strongest_channels(model: Transformer, tokens: Tensor, k: int) -> list[int]:
    """The ``k`` channels of the residual stream with the largest mean |x| where the blocks' norms
    read it, averaged over the norms, on ``tokens`` ``[n, length]``: largest first."""
    means = [residual for residual, _ in _at_norms(model, tokens, lambda x: x.mean(0)).values()]
    return torch.stack(means).mean(0).topk(k).indices.tolist()


def _planted_ratios(model: Transformer, tokens: Tensor, channels: tuple[int, ...]) -> dict[str, float]:
    """Max |x| of the planted channels and of the strongest other channel, over the median channel's,
    at the norms' outputs: the least and the most over norms and planted channels, and the other's most."""
    planted, others = [], []
    for found in norm_output_max(model, tokens).values():
        ratio = found / found.median()
        planted.append(ratio[list(channels)])
        others.append(ratio[[c for c in range(len(ratio)) if c not in channels]].max())
    planted = torch.stack(planted)
    return {"least": planted.min().item(), "median": planted.median().item(), "most": planted.max().item(),
            "other": torch.stack(others).max().item()}


def _errors_by_kind(errors: dict[str, float]) -> dict[str, float]:
    """Mean relative output error of each kind of projection (``attn.wqkv``...) over the blocks."""
    kinds: dict[str, list[float]] = {}
    for name, error in errors.items():
        kinds.setdefault(name.split(".", 2)[2], []).append(error)
    return {kind: sum(v) / len(v) for kind, v in kinds.items()}


def _quantized(model: Transformer, calibration: Tensor) -> tuple[dict[str, Transformer], Transformer]:
    """``model`` at INT4 ``SCHEME`` by RTN, GPTQ and AWQ, and AWQ's folded float model (what
    ``quantize_model(model, SCHEME, "awq", calibration)`` rounds), whose inputs its layers expect."""
    folded = copy.deepcopy(model)
    scale_model(folded, calibration, SCHEME)
    return {"RTN": quantize_model(model, SCHEME), "GPTQ": quantize_model(model, SCHEME, "gptq", calibration),
            "AWQ": quantize_model(folded, SCHEME)}, folded


def measure(windows: int, calibration_windows: int) -> dict:
    """Everything the card states, measured: the outlier model against the target, and both at INT4
    ``SCHEME`` (perplexity over validation windows of 256 tokens, per-layer output errors)."""
    start = time.perf_counter()
    target, tokenizer = labkit.load("target")
    val_ids = token_ids(tokenizer, "validation")
    calibration, _ = random_batch(token_ids(tokenizer, "train"), calibration_windows, 256,
                                  torch.Generator().manual_seed(0))
    calibration = calibration.to(target.device)
    model = outlier_model(target)
    held_out = torch.stack([val_ids[i * 256:(i + 1) * 256] for i in range(8)]).to(target.device)
    with torch.no_grad():
        logit_gap = (model(held_out) - target(held_out)).abs().max().item()
    quantized, folded = _quantized(model, calibration)
    losses = {"target": window_losses(target, val_ids, 256, windows),
              "target RTN": window_losses(quantize_model(target, SCHEME), val_ids, 256, windows),
              "fp32": window_losses(model, val_ids, 256, windows)}
    losses |= {name: window_losses(q, val_ids, 256, windows) for name, q in quantized.items()}
    errors = {name: _errors_by_kind(output_errors(folded if name == "AWQ" else model, q, held_out))
              for name, q in quantized.items()}
    return {"measured_channels": strongest_channels(target, calibration, len(CHANNELS)), "logit_gap": logit_gap,
            "ratios": {"target": _planted_ratios(target, calibration, CHANNELS),
                       "outliers": _planted_ratios(model, calibration, CHANNELS)},
            "losses": losses, "errors": errors, "windows": windows, "calibration_windows": calibration_windows,
            "machine": device_name(target.device), "seconds": time.perf_counter() - start,
            "date": str(datetime.date.today())}


def perplexities(stats: dict) -> dict[str, float]:
    """The perplexity of each of ``measure``'s models, by name."""
    return {name: math.exp(v.mean().item()) for name, v in stats["losses"].items()}


def against_fp32(stats: dict, name: str) -> tuple[float, float, float | None]:
    """For the outlier model's weights ``name`` (fp32, RTN, GPTQ or AWQ): the mean per-window loss minus
    fp32's, its standard error, and the share of RTN's perplexity increase taken back (None for fp32, RTN)."""
    losses, ppl = stats["losses"], perplexities(stats)
    gap, error = paired_difference(losses[name], losses["fp32"]) if name != "fp32" else (0.0, 0.0)
    recovered = (ppl["RTN"] - ppl[name]) / (ppl["RTN"] - ppl["fp32"]) if name in ("GPTQ", "AWQ") else None
    return gap, error, recovered


def card(stats: dict) -> str:
    """MODEL_CARD.md of the outlier model, from ``measure``'s figures."""
    losses, ppl = stats["losses"], perplexities(stats)
    rows = []
    for name in ("fp32", "RTN", "GPTQ", "AWQ"):
        gap, error, recovered = against_fp32(stats, name)
        rows.append(f"| {name if name == 'fp32' else f'INT4 g128 {name}'} | {ppl[name]:.3f} | "
                    f"{ppl[name] / ppl['fp32'] - 1:+.2%} | {gap:+.4f} +- {error:.4f} | "
                    f"{'' if recovered is None else f'{recovered:.0%}'} |")
    target_gap, target_error = paired_difference(losses["target RTN"], losses["target"])
    kinds = list(next(iter(stats["errors"].values())))
    error_rows = [f"| {name} | " + " | ".join(f"{stats['errors'][name][k]:.2%}" for k in kinds) + " |"
                  for name in stats["errors"]]
    before, after = stats["ratios"]["target"], stats["ratios"]["outliers"]
    planted = (f"{after['least']:.0f}x to {after['most']:.0f}x (median {after['median']:.0f}x); "
               f"in the target {before['least']:.1f}x to {before['most']:.1f}x")
    return f"""# labkit `target-outliers` model

The `target` with the outlier features of large language models planted in it: the same function,
with {len(CHANNELS)} activation channels made {FACTOR:g} times larger at the inputs of every block's wqkv and gate_up.
Not a checkpoint of its own: build it from the target with

```python
import labkit
from labkit.outliers import outlier_model
model = outlier_model(labkit.load("target")[0])
```

How it is made (`labkit/outliers.py`, whose docstring says why): in every block, the attention
norm's and the MLP norm's weights are multiplied by {FACTOR:g} in channels {list(CHANNELS)}, and the
columns of wqkv and gate_up that read those channels are divided by {FACTOR:g}. The channels are the
target's residual stream's strongest (largest mean |x|; re-measured here on the calibration text:
{stats['measured_channels']}); {FACTOR:g} is a power of two, so the weights are rescaled exactly.

| | |
|---|---|
| logits against the target's (fp32, 8 validation windows of 256 tokens) | max abs difference {stats['logit_gap']:.3g} |
| planted channels' max abs activation over the median channel's, at the norms' outputs | {planted} |
| strongest other channel, the same measure | {after['other']:.1f}x |
| validation perplexity, fp32 | {ppl['fp32']:.3f} (the target's: {ppl['target']:.3f}) |

INT4 weights, groups of 128, asymmetric (the lab's default grid), in the 32 projections of the
blocks (embedding and LM head fp32); perplexity over {stats['windows']} validation windows of 256
tokens; loss change: mean per-window loss minus fp32's, with its standard error; recovered: the
share of RTN's perplexity increase the method takes back. GPTQ and AWQ calibrate on
{stats['calibration_windows']} training windows of 256 tokens (seed 0).

| weights | perplexity | change | loss change (nats) | recovered |
|---|---|---|---|---|
{chr(10).join(rows)}

On the target itself, RTN at the same grid changes the loss by {target_gap:+.4f} +- {target_error:.4f}
nats per window (perplexity {ppl['target']:.3f} to {ppl['target RTN']:.3f}).

Each projection's relative output error ||X W_hat^T - X W^T|| / ||X W^T|| on 8 validation windows,
the mean over the blocks (AWQ's layers against the scaled float model they were rounded from, with
its inputs):

| method | {' | '.join(kinds)} |
|---|{'---|' * len(kinds)}
{chr(10).join(error_rows)}

Measured by `python -m labkit.outliers --card --windows {stats['windows']} --calibration {stats['calibration_windows']}`
on {stats['machine']}, torch {torch.__version__}, {stats['date']}, in {stats['seconds'] / 60:.1f} min.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m labkit.outliers", description="The target with planted outlier "
                                     "channels: measure it and print (or write) its card.")
    parser.add_argument("--card", action="store_true", help="write checkpoints/target-outliers/MODEL_CARD.md")
    parser.add_argument("--windows", type=int, default=128, help="validation windows of 256 tokens")
    parser.add_argument("--calibration", type=int, default=32, help="GPTQ and AWQ calibration windows of 256 tokens")
    args = parser.parse_args(argv)
    text = card(measure(args.windows, args.calibration))
    print(text)
    if args.card:
        folder = CHECKPOINTS / "target-outliers"
        folder.mkdir(exist_ok=True)
        (folder / "MODEL_CARD.md").write_text(text)
        print(f"written to {folder / 'MODEL_CARD.md'}")


if __name__ == "__main__":
    main()
