"""Prediction heads on the target's own residual stream: Medusa heads and early-exit adapters.

Speculation without a second model reads the future off the target itself. After the first
L blocks the target holds, at every position p, a residual stream h_L(p) [d_model]; its final
norm and LM head turn h_{n_layers}(p) into the logits of the token at p + 1. A head is a residual
block on that stream, and its logits go through the SAME norm and LM head (tied: no new
vocabulary projection, so a head costs d_model^2 + d_model parameters, not d_model x vocab):

    head_i(h) = h + silu(h W_i + b_i)          logits_i = lm_head(norm(head_i(h)))

W_i and b_i start at zero, so an untrained head repeats the target's own prediction from that
stream. Two uses, one construction:

- Medusa heads (Cai et al., 2024): K heads on the stream after ALL blocks; head i (1-based,
  offset i) predicts the token i steps after the target's own next token, i.e. the token at
  p + 1 + i. One decode step of the target then proposes K + 1 tokens.
- Early-exit adapters (self-speculation): one head per exit layer L' < n_layers on the stream
  after the first L' blocks, predicting the NEXT token (offset 0): the target's first L' layers
  draft for the whole target. The untrained head is the raw early exit.

Training (the target frozen, only the heads learn): the target's greedy continuations of
training-split function openings, exactly the draft model's distillation data
(``labkit.train.teacher_continuations``). The streams at every continuation position are
computed once, without gradients, and kept; a head with offset o at position p is labelled
with the token at p + 1 + o while that token is still inside the continuation. Loss: the
cross-entropy of each head, averaged over the heads; AdamW, seeded, so training twice gives the
same weights bit for bit.

    python -m labkit.heads medusa early-exit   # both, on the same continuations

writes ``labkit/checkpoints/medusa/`` and ``labkit/checkpoints/early-exit/``: ``heads.safetensors``
(bf16: what loads is what the card measured), ``config.json`` (sizes, layers and offsets, the
target's weights' sha256: a different target is refused) and ``MODEL_CARD.md``.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save, save_file
from tokenizers import Tokenizer
from torch import Tensor, nn

from labkit.device import device_name, get_device
from labkit.load import CHECKPOINTS, TOKENIZER, checkpoint_state, load_checkpoint
from labkit.model import Transformer
from labkit.speculative import continuation_prompts
from labkit.train import Distillation, teacher_batches

MEDUSA, EARLY_EXIT = CHECKPOINTS / "medusa", CHECKPOINTS / "early-exit"
IGNORE = -100  # the label of a position a head has no token for (cross_entropy's ignore_index)
WEIGHTS = "heads.safetensors"  # not model.safetensors: labkit.load lists only full models


class ResidualHeads(nn.Module):
    """``n`` residual heads on a ``d_model`` stream: head i maps x to x + silu(x W_i + b_i).
    The weights are one batched tensor ``weight`` [n, d_model, d_model] (x @ W, input rows) and
    ``bias`` [n, d_model], so all heads run as one batched matmul: a decode round applies them
    to one token. Both start at zero: an untrained head returns its input, and its logits
    (``model.head``, the target's tied norm and LM head) are the model's own."""

    def __init__(self, d_model: int, n: int) -> None:
        super().__init__()
        if d_model < 1 or n < 1:
            raise ValueError(f"ResidualHeads needs d_model >= 1 and n >= 1 heads, got d_model={d_model}, n={n}")
        self.d_model, self.n = d_model, n
        self.weight = nn.Parameter(torch.zeros(n, d_model, d_model))
        self.bias = nn.Parameter(torch.zeros(n, d_model))

    def forward(self, x: Tensor) -> Tensor:
        """``x`` [..., d_model] -> every head's stream [n, ..., d_model]."""
        if x.shape[-1] != self.d_model:
            raise ValueError(f"the heads read a stream of d_model={self.d_model}, got shape {tuple(x.shape)}")
        flat = x.reshape(1, -1, self.d_model)
        hidden = torch.baddbmm(self.bias.unsqueeze(1), flat.expand(self.n, -1, -1), self.weight)
        return (flat + F.silu(hidden)).reshape(self.n, *x.shape)


def _check_layer(model: Transformer, layer: int) -> None:
    if not 1 <= layer <= model.config.n_layers:
        raise ValueError(f"layer={layer} is out of range: the model has blocks 1..{model.config.n_layers}")


def streams_at(model: Transformer, ids: Tensor, layers: Sequence[int]) -> dict[int, Tensor]:
    """The residual stream [B, T, d_model] of token ids [B, T] after the first L blocks, for each
    L in ``layers``, in one pass (no cache: the tokens attend causally among themselves)."""
    for layer in layers:
        _check_layer(model, layer)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    x, done, found = model.embed(ids), 0, {}
    for layer in sorted(set(layers)):
        x, done = model.layers(x, positions, None, done, layer), layer
        found[layer] = x
    return found


def continuation_labels(tokens: Tensor, mask: Tensor, offsets: Sequence[int]) -> Tensor:
    """Labels [len(offsets), B, T] of ``continuation_batches``' tokens and mask: at position p,
    the token at p + 1 + o for offset o, where p's next token is a continuation token and so is
    that one (``mask[p + o]``: the mask is one run of positions); IGNORE elsewhere."""
    if min(offsets, default=0) < 0:
        raise ValueError(f"offsets count tokens after the next one and cannot be negative, got {list(offsets)}")
    width = tokens.shape[1]
    labels = torch.full((len(offsets), *tokens.shape), IGNORE, dtype=torch.long, device=tokens.device)
    for i, o in enumerate(offsets):
        if o + 1 < width:
            valid = mask[:, :width - 1 - o] & mask[:, o:width - 1]
            labels[i, :, :width - 1 - o] = tokens[:, o + 1:].where(valid, IGNORE)
    return labels


@dataclass
class Examples:
    """What the heads learn from: the stream at every continuation position after each layer of
    ``streams`` ({layer: [P, d_model]}, from the frozen target) and the labels [len(offsets), P]."""

    streams: dict[int, Tensor]
    labels: Tensor
    offsets: tuple[int, ...]


@torch.no_grad()
def examples(model: Transformer, batches: list[tuple[Tensor, Tensor]], layers: Sequence[int],
             offsets: Sequence[int]) -> Examples:
    """The streams after each of ``layers`` and the labels for ``offsets`` at the positions of
    ``continuation_batches``' masks, computed once."""
    streams: dict[int, list[Tensor]] = {layer: [] for layer in layers}
    labels = []
    for tokens, mask in batches:
        for layer, stream in streams_at(model, tokens, layers).items():
            streams[layer].append(stream[mask])
        labels.append(continuation_labels(tokens, mask, offsets)[:, mask])
    return Examples({layer: torch.cat(s) for layer, s in streams.items()}, torch.cat(labels, dim=1), tuple(offsets))


def _check_heads(model: Transformer, heads: ResidualHeads, labels: Tensor) -> None:
    if heads.d_model != model.config.d_model:
        raise ValueError(f"heads of d_model={heads.d_model} do not fit a target of d_model={model.config.d_model}")
    if len(labels) != heads.n:
        raise ValueError(f"{heads.n} heads need {heads.n} offsets, got labels for {len(labels)}")


def head_logits(model: Transformer, heads: ResidualHeads, stream: Tensor) -> Tensor:
    """Every head's logits [n, ..., vocab] from a stream [..., d_model], through the target's head."""
    return model.head(heads(stream.to(heads.weight.dtype)).to(model.dtype))


def head_loss(model: Transformer, heads: ResidualHeads, stream: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy of each head against its labels [n, P] (IGNORE skipped), averaged over heads."""
    logits = head_logits(model, heads, stream).float()
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none")
    counts = (labels != IGNORE).sum(dim=1).clamp(min=1)
    return (losses.view_as(labels).sum(dim=1) / counts).mean()


@contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """No gradients for ``model``'s parameters inside (the backward pass then skips the LM head's
    weight gradient, a matmul as large as its forward); their flags are restored after."""
    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)


def train_heads(model: Transformer, heads: ResidualHeads, stream: Tensor, labels: Tensor, epochs: int,
                lr: float, seed: int = 0, batch_size: int = 1024) -> list[tuple[int, float]]:
    """Fit ``heads`` to ``labels`` [n, P] from the kept ``stream`` [P, d_model] (``Examples``'):
    ``epochs`` passes over the positions in a seeded random order, ``batch_size`` at a time,
    AdamW at ``lr`` decayed linearly to zero; the target frozen. Returns (positions seen, loss)
    per step."""
    _check_heads(model, heads, labels)
    if epochs < 1 or lr <= 0 or batch_size < 1:
        raise ValueError(f"training needs epochs >= 1, lr > 0 and batch_size >= 1, got {epochs}, {lr}, {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * -(-len(stream) // batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    history, seen = [], 0
    with frozen(model):
        for _ in range(epochs):
            for rows in torch.randperm(len(stream), generator=generator).split(batch_size):
                rows = rows.to(stream.device)
                loss = head_loss(model, heads, stream[rows], labels[:, rows])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                seen += len(rows)
                history.append((seen, loss.item()))
    return history


@torch.no_grad()
def head_accuracy(model: Transformer, heads: ResidualHeads, stream: Tensor, labels: Tensor,
                  topk: Sequence[int] = (1, 5), batch_size: int = 4096) -> dict[int, list[float]]:
    """For each k in ``topk``, per head: how often its label (the target's continuation token) is
    among the head's k most likely tokens, over the positions where it has one."""
    _check_heads(model, heads, labels)
    hits = {k: torch.zeros(heads.n) for k in topk}
    for rows in torch.arange(len(stream)).split(batch_size):
        best = head_logits(model, heads, stream[rows]).topk(max(topk), dim=-1).indices  # [n, P, max k]
        found = best == labels[:, rows, None]
        for k in topk:
            hits[k] += found[..., :k].any(-1).sum(-1).cpu()
    counts = (labels != IGNORE).sum(dim=1).clamp(min=1).cpu()
    return {k: (h / counts).tolist() for k, h in hits.items()}


# ---- checkpoints ----

def weights_sha256(model: Transformer) -> str:
    """The sha256 of the target's weights as ``labkit.load.save_checkpoint`` writes them (bf16,
    the tied LM head once): for a shipped target, the sha256 of its ``model.safetensors``."""
    return hashlib.sha256(save(checkpoint_state(model))).hexdigest()


def save_heads(folder: str | Path, heads: dict[int, ResidualHeads], offsets: dict[int, Sequence[int]],
               target: Transformer) -> None:
    """Write ``heads`` ({layer read: heads}) in bf16 to ``heads.safetensors`` and their layers,
    offsets and the target's ``weights_sha256`` to ``config.json``."""
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    state = {f"layer{layer}.{name}": p.detach().to(torch.bfloat16).contiguous().cpu()
             for layer, h in heads.items() for name, p in h.named_parameters()}
    save_file(state, str(folder / WEIGHTS))
    config = {"d_model": target.config.d_model, "layers": {str(layer): list(offsets[layer]) for layer in heads},
              "target_sha256": weights_sha256(target)}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_heads(folder: str | Path, target: Transformer) -> tuple[dict[int, ResidualHeads], dict[int, tuple[int, ...]]]:
    """Heads ``save_heads`` wrote, on ``target``'s device and dtype, and their offsets ({layer: ...});
    refused unless ``target`` is the model they were trained on."""
    folder = Path(folder).expanduser()
    if not (folder / WEIGHTS).exists():
        raise FileNotFoundError(f"no {WEIGHTS} in {folder}: train heads with python -m labkit.heads")
    config = json.loads((folder / "config.json").read_text())
    if (found := weights_sha256(target)) != config["target_sha256"]:
        raise ValueError(f"the heads in {folder} were trained on the target with weights sha256 "
                         f"{config['target_sha256'][:16]}..., not on this model ({found[:16]}...): "
                         "heads read one model's residual stream and mean nothing on another's")
    state = load_file(str(folder / WEIGHTS))
    heads, offsets = {}, {}
    for key, offs in config["layers"].items():
        heads[int(key)] = ResidualHeads(config["d_model"], len(offs))
        heads[int(key)].load_state_dict({n: state[f"layer{key}.{n}"] for n in ("weight", "bias")})
        heads[int(key)].to(device=target.device, dtype=target.dtype).eval()
        offsets[int(key)] = tuple(offs)
    return heads, offsets


def load_medusa(target: Transformer, folder: str | Path = MEDUSA) -> ResidualHeads:
    """The shipped Medusa heads for ``target``: head i (1-based) reads the stream after all blocks
    and predicts the token i steps after the target's next one."""
    heads, offsets = load_heads(folder, target)
    layer = target.config.n_layers
    if list(offsets) != [layer] or offsets[layer] != tuple(range(1, heads[layer].n + 1)):
        raise ValueError(f"{folder} holds heads {offsets} ({{layer: offsets}}), not Medusa heads on layer {layer}")
    return heads[layer]


def load_exit_adapters(target: Transformer, folder: str | Path = EARLY_EXIT) -> dict[int, ResidualHeads]:
    """The shipped early-exit adapters for ``target``: {exit layer L': one head (n=1) on the stream
    after the first L' blocks, predicting the next token}."""
    heads, offsets = load_heads(folder, target)
    if any(offs != (0,) for offs in offsets.values()):
        raise ValueError(f"{folder} holds heads {offsets} ({{layer: offsets}}), not next-token exit adapters")
    return heads


# ---- the shipped checkpoints: python -m labkit.heads medusa early-exit ----

# The data (the target's greedy continuations, as the draft's distillation, four times the prompts)
# and the optimizer; batch_size is sequences per pass of the target for the streams. Both kinds
# share the data, so that made together they share the continuations; the seven exit adapters
# take one pass over it, to stay within minutes (they learn fast: a next-token head is an easy task).
SPECS = {"medusa": Distillation("target", prompts=1024, new_tokens=128, epochs=2, lr=3e-3, held_out=64)}
SPECS["early-exit"] = replace(SPECS["medusa"], epochs=1)
FOLDERS = {"medusa": MEDUSA, "early-exit": EARLY_EXIT}
CONSTRUCTION = {
    "medusa": "Medusa heads: K residual heads on the stream after all of the target's blocks; head i "
              "(offset i) predicts the token i steps after the target's own next token",
    "early-exit": "Early-exit adapters: one residual head per exit layer L' < n_layers on the stream after "
                  "the target's first L' blocks, predicting the next token (offset 0), so that the first L' "
                  "layers can draft for the whole target",
}


def layer_offsets(kind: str, n_layers: int, medusa_heads: int = 4) -> dict[int, tuple[int, ...]]:
    """{layer read: offsets} of each kind of checkpoint."""
    if kind == "medusa":
        return {n_layers: tuple(range(1, medusa_heads + 1))}
    return {layer: (0,) for layer in range(1, n_layers)}


def continuation_examples(target: Transformer, tokenizer: Tokenizer, spec: Distillation, seed: int, split: str,
                          wanted: dict[int, tuple[int, ...]]) -> dict[int, Examples]:
    """``Examples`` for each {layer: offsets} of ``wanted`` on the target's greedy continuations of
    ``spec.prompts`` function openings of the training split (``spec.held_out`` of the validation
    split), all from one pass of the target."""
    prompts = continuation_prompts(tokenizer, spec.prompts if split == "train" else spec.held_out, seed, split=split)
    batches = teacher_batches(target, prompts, spec, target.device)
    every = sorted({o for offsets in wanted.values() for o in offsets})
    both = examples(target, batches, list(wanted), every)
    return {layer: Examples({layer: both.streams[layer]}, both.labels[[every.index(o) for o in offsets]], offsets)
            for layer, offsets in wanted.items()}


def _card(kind: str, spec: Distillation, stats: dict) -> str:
    exits = kind == "early-exit"
    rows = "".join(f"| layer {layer} | +{o} | {acc[1][i]:.1%} | {acc[5][i]:.1%} |"
                   + (f" {stats['raw'][layer][1][i]:.1%} | {stats['raw'][layer][5][i]:.1%} |" if exits else "") + "\n"
                   for layer, acc in stats["accuracy"].items() for i, o in enumerate(stats["offsets"][layer]))
    return f"""# labkit `{kind}` heads for the `target` model

{CONSTRUCTION[kind]}. Each head is a residual block, h + silu(h W + b), with W [d_model, d_model]
and b zero at the start (an untrained head repeats the target's prediction from that stream); its
logits come from the target's own final norm and LM head (tied: no vocabulary projection of its
own). Trained with the target frozen, on the target's own greedy continuations.

| | |
|---|---|
| made by | `{stats['command']}` |
| target | `target`, model.safetensors sha256 {stats['target_sha256'][:16]}... (any other model is refused) |
| heads | {stats['heads']} of {stats['d_model']} x {stats['d_model']} + bias: {stats['parameters']:,} parameters, stored in bf16 |
| training data | the target's greedy continuations of {spec.prompts} training-split function openings, {spec.new_tokens} tokens each: {stats['train_positions']:,} positions |
| training | {spec.epochs} epoch{"s" * (spec.epochs != 1)}, AdamW at lr {spec.lr:g} decayed linearly to 0, batches of 1024 positions, cross-entropy averaged over the heads |
| wall time | {stats['seconds'] / 60:.1f} min, of which {stats['data_seconds'] / 60:.1f} min the continuations and streams (shared when both kinds are made together) |
| machine | {stats['machine']}, torch {torch.__version__} |
| validation data | the target's greedy continuations of {spec.held_out} validation-split function openings, {spec.new_tokens} tokens each: {stats['val_positions']:,} positions |
| date | {stats['date']} |
| seed | {stats['seed']} |

Agreement with the target on the validation data: how often the token the target wrote is the
head's top-1 / among its top-5 (each head over the positions whose label is inside the continuation).

| stream after | predicts (tokens after the next) | top-1 | top-5 |{' untrained top-1 | untrained top-5 |' * exits}
|---|---|---|---|{'---|---|' * exits}
{rows}"""


def make(kind: str, folder: Path, target: Transformer, spec: Distillation, train: dict[int, Examples],
         val: dict[int, Examples], seed: int, command: str, data_seconds: float) -> dict:
    """Train one head set per layer of ``train``, write them to ``folder`` with a card measured on
    ``val`` (with the bf16 weights that ship); return the card's figures."""
    start = time.perf_counter()
    heads = {}
    for layer, ex in train.items():
        heads[layer] = ResidualHeads(target.config.d_model, len(ex.offsets)).to(target.device)
        train_heads(target, heads[layer], ex.streams[layer], ex.labels, spec.epochs, spec.lr, seed)
    offsets = {layer: ex.offsets for layer, ex in train.items()}
    save_heads(folder, heads, offsets, target)
    loaded, _ = load_heads(folder, target)

    def accuracy(of: dict[int, ResidualHeads]) -> dict[int, dict[int, list[float]]]:
        return {layer: head_accuracy(target, h, val[layer].streams[layer], val[layer].labels) for layer, h in of.items()}
    stats = {"command": command, "target_sha256": weights_sha256(target), "d_model": target.config.d_model,
             "heads": sum(h.n for h in heads.values()),
             "parameters": sum(p.numel() for h in heads.values() for p in h.parameters()),
             "train_positions": next(iter(train.values())).labels.shape[1],
             "val_positions": next(iter(val.values())).labels.shape[1], "offsets": offsets,
             "accuracy": accuracy(loaded), "raw": accuracy({layer: ResidualHeads(h.d_model, h.n).to(target.device, target.dtype)
                             for layer, h in loaded.items()}),
             "seconds": data_seconds + time.perf_counter() - start, "data_seconds": data_seconds,
             "machine": device_name(target.device), "seed": seed, "date": str(datetime.date.today())}
    (folder / "MODEL_CARD.md").write_text(_card(kind, spec, stats))
    return stats


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m labkit.heads", description=__doc__.split("\n\n")[0])
    parser.add_argument("kinds", nargs="+", choices=sorted(SPECS), help="one or both (then on the same data)")
    parser.add_argument("--out", type=Path, help="the folder, for one kind (default: labkit/checkpoints/KIND)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, help="training prompts (default 1024)")
    parser.add_argument("--new-tokens", type=int, help="continuation tokens per prompt (default 128)")
    parser.add_argument("--held-out", type=int, help="validation prompts for the card (default 64)")
    parser.add_argument("--epochs", type=int, help="default: 2 for medusa, 1 for early-exit")
    parser.add_argument("--lr", type=float, help="default 3e-3")
    parser.add_argument("--medusa-heads", type=int, default=4)
    args = parser.parse_args(argv)
    kinds = list(dict.fromkeys(args.kinds))
    if args.out and len(kinds) > 1:
        parser.error("--out names one folder: give one kind with it")
    given = {name: getattr(args, name) for name in ("prompts", "new_tokens", "held_out", "epochs", "lr")}
    specs = {kind: replace(SPECS[kind], **{k: v for k, v in given.items() if v is not None}) for kind in kinds}
    data = specs[kinds[0]]  # the kinds' data sizes are the same
    target = load_checkpoint(CHECKPOINTS / data.teacher, get_device())
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    wanted = {kind: layer_offsets(kind, target.config.n_layers, args.medusa_heads) for kind in kinds}
    every = {layer: offsets for w in wanted.values() for layer, offsets in w.items()}
    start = time.perf_counter()
    train, val = (continuation_examples(target, tokenizer, data, args.seed, split, every)
                  for split in ("train", "validation"))
    data_seconds = time.perf_counter() - start
    for kind in kinds:
        stats = make(kind, args.out or FOLDERS[kind], target, specs[kind], {layer: train[layer] for layer in wanted[kind]},
                     {layer: val[layer] for layer in wanted[kind]}, args.seed, " ".join(["python -m labkit.heads", *argv]),
                     data_seconds)
        print(f"{kind}: {stats['seconds'] / 60:.1f} min; top-1 by layer: "
              + "; ".join(f"{layer}: {' / '.join(f'{a:.1%}' for a in acc[1])}" for layer, acc in stats["accuracy"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
