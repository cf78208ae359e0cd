"""Train one of the lab's models: ``python -m labkit.train --preset target``.

Next-token prediction on the standard-library corpus with AdamW, linear warm-up then cosine
decay, gradient clipping, all seeded. Writes, in ``labkit/checkpoints/NAME/`` (or ``--out``):
``model.safetensors`` (bf16) and ``config.json``, ``loss.png`` (the loss curves) and
``MODEL_CARD.md`` (parameters, tokens seen, wall time, machine, validation loss, perplexity).

The presets: ``target`` (about 14M parameters, GQA 8/2), ``draft`` (one layer, for
speculative decoding: a decode step is mostly fixed per-operation cost on a CPU, so depth is
what makes it cheap; after the corpus it is distilled from the target, see ``distill``), and
``mha``, ``gqa``, ``mqa``: three models identical but for ``n_kv_heads``, trained on the same
tokens, for the memory lab.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import matplotlib
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm

from labkit.corpus import VOCAB_SIZE, token_ids
from labkit.device import device_name, get_device
from labkit.engine import Engine, Request, SchedulerConfig
from labkit.generate import SamplingParams
from labkit.load import CHECKPOINTS, TOKENIZER, load_checkpoint, save_checkpoint
from labkit.model import ModelConfig, Transformer
from labkit.memory import blocks_for
from labkit.speculative import continuation_prompts


@dataclass(frozen=True)
class Distillation:
    """A second stage for a draft model: fit it to ``teacher`` where speculative decoding will
    use it, on the teacher's own greedy continuations of ``prompts`` function openings from the
    training split (``new_tokens`` each), learning the teacher's whole next-token distribution
    at every generated position. Its success is measured on validation functions: how often the
    student's top token is the one the teacher wrote, before and after."""

    teacher: str  # a shipped checkpoint, trained first
    prompts: int = 256
    new_tokens: int = 128
    epochs: int = 3
    lr: float = 3e-4
    batch_size: int = 16
    held_out: int = 32  # validation prompts for the agreement figure

    def __post_init__(self) -> None:
        counts = {"prompts": self.prompts, "new_tokens": self.new_tokens, "epochs": self.epochs,
                  "batch_size": self.batch_size, "held_out": self.held_out}
        if min(counts.values()) < 1 or self.lr <= 0:
            raise ValueError(f"distillation needs counts of at least 1 and a positive lr, got {counts}, lr={self.lr}")


@dataclass(frozen=True)
class Preset:
    config: ModelConfig
    tokens: int  # training budget
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 2e-3
    warmup_steps: int = 50
    eval_every: int = 100
    distill: Distillation | None = None


def _config(d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB_SIZE, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, d_ff=d_ff, max_seq_len=1024, tie_embeddings=True)


PRESETS: dict[str, Preset] = {
    "target": Preset(_config(384, 8, 8, 2, 1024), tokens=2_400_000),
    "draft": Preset(_config(128, 1, 4, 2, 384), tokens=2_400_000, lr=3e-3, distill=Distillation("target")),
    "mha": Preset(_config(192, 4, 8, 8, 512), tokens=2_000_000, lr=3e-3),
    "gqa": Preset(_config(192, 4, 8, 2, 512), tokens=2_000_000, lr=3e-3),
    "mqa": Preset(_config(192, 4, 8, 1, 512), tokens=2_000_000, lr=3e-3),
}


def random_batch(ids: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the corpus: inputs and the same shifted by one token."""
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def window_losses(model: Transformer, ids: torch.Tensor, seq_len: int = 256, max_windows: int = 64,
                  batch_size: int = 16) -> torch.Tensor:
    """Mean next-token loss of each of ``max_windows`` windows of ``ids``, spread evenly over all
    of it (disjoint when there is room), so that a few windows already sample the whole split."""
    was_training = model.training
    model.eval()
    count = min(max_windows, (len(ids) - 1) // seq_len)
    stride = (len(ids) - 1 - seq_len) // max(count - 1, 1)
    device = model.device
    losses = []
    for first in range(0, count, batch_size):
        starts = [i * stride for i in range(first, min(first + batch_size, count))]
        x = torch.stack([ids[s:s + seq_len] for s in starts]).to(device)
        y = torch.stack([ids[s + 1:s + seq_len + 1] for s in starts]).to(device)
        loss = F.cross_entropy(model(x).transpose(1, 2).float(), y, reduction="none")  # [windows, seq_len]
        losses.append(loss.mean(dim=1).cpu())
    model.train(was_training)
    return torch.cat(losses)


def t_95(samples: int) -> float:
    """The two-sided 95% critical value of Student's t for the mean of ``samples`` (``samples - 1``
    degrees of freedom): how many standard errors a paired difference must exceed to be measurable.
    About 2 for many samples; more for few (8 samples: 2.36), where 2 calls noise a difference too
    often. Found by bisection on the t distribution's function, integrated numerically."""
    if not isinstance(samples, int) or samples < 2:
        raise ValueError(f"samples={samples!r}: a standard error needs a whole number of at least 2")
    nu = samples - 1
    log_scale = math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2) - 0.5 * math.log(nu * math.pi)

    def upper_half(x: float) -> float:  # P(0 < t < x), by the trapezoid rule on 20,001 points
        grid = torch.linspace(0, x, 20_001, dtype=torch.float64)
        density = torch.exp(log_scale - (nu + 1) / 2 * torch.log1p(grid ** 2 / nu))
        return torch.trapezoid(density, grid).item()

    low, high = 1.0, 20.0  # the value lies between: 1.96 for many samples, 12.7 for 2
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if upper_half(middle) < 0.475 else (low, middle)
    return (low + high) / 2


def paired_difference(losses_a: torch.Tensor, losses_b: torch.Tensor) -> tuple[float, float]:
    """Mean over windows of ``losses_a - losses_b`` (two models' ``window_losses`` on the same
    windows) and the standard error of that mean: comparing window by window cancels how much
    harder one window is than another, which would swamp a small gap between the two means."""
    a, b = torch.as_tensor(losses_a, dtype=torch.float64), torch.as_tensor(losses_b, dtype=torch.float64)
    if a.dim() != 1 or a.shape != b.shape:
        raise ValueError(f"paired_difference needs two 1-D sequences of per-window losses on the same windows, "
                         f"got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if len(a) < 2:
        raise ValueError(f"paired_difference needs at least 2 windows for a standard error, got {len(a)}")
    diff = a - b
    return diff.mean().item(), diff.std().item() / math.sqrt(len(diff))


def perplexity_change(losses_a: torch.Tensor, losses_b: torch.Tensor) -> tuple[float, float, float]:
    """How much higher model a's perplexity is than model b's, in percent, over the same windows, and the
    two-sided 95% interval of that (Student's t over the windows, ``t_95``): perplexity is e to the mean
    loss, so the ratio of two is e to the mean paired gap (``paired_difference``)."""
    gap, error = paired_difference(losses_a, losses_b)
    margin = t_95(len(losses_a)) * error
    change, lowest, highest = (100 * math.expm1(g) for g in (gap, gap - margin, gap + margin))
    return change, lowest, highest


def validation_loss(model: Transformer, ids: torch.Tensor, seq_len: int = 256, max_windows: int = 64,
                    batch_size: int = 16) -> float:
    """Mean next-token loss over the windows of ``window_losses``."""
    return window_losses(model, ids, seq_len, max_windows, batch_size).mean().item()


def learning_rate(step: int, steps: int, preset: Preset) -> float:
    if step < preset.warmup_steps:
        return preset.lr * (step + 1) / preset.warmup_steps
    progress = (step - preset.warmup_steps) / max(1, steps - preset.warmup_steps)
    return preset.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def distillation_loss(student_logits: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, averaged: both ``[positions, vocab]``."""
    return F.kl_div(student_logits.float().log_softmax(-1), teacher_log_probs, log_target=True,
                    reduction="batchmean")


def teacher_continuations(teacher: Transformer, prompts: list[list[int]], new_tokens: int,
                          at_once: int = 64, block_size: int = 16) -> list[list[int]]:
    """``new_tokens`` greedy tokens after each prompt, EOS ignored, ``at_once`` sequences at a
    time (continuous batching, with blocks enough that none is ever preempted)."""
    params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
    requests = [Request(i, prompt, params) for i, prompt in enumerate(prompts)]
    blocks = at_once * blocks_for(max(map(len, prompts)) + new_tokens, block_size)
    Engine(teacher, blocks, block_size, SchedulerConfig(max_num_seqs=at_once, headroom=0)).run(requests)
    return [r.output for r in requests]


def continuation_batches(prompts: list[list[int]], outputs: list[list[int]], batch_size: int,
                         device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prompt + continuation, right-padded, ``batch_size`` rows at a time, with the mask of the
    positions whose next token is a continuation token (padding comes after every real token,
    so a causal model's outputs at those positions do not depend on it)."""
    if len(prompts) != len(outputs) or not all(outputs):
        raise ValueError(f"one non-empty continuation per prompt: {len(prompts)} prompts, "
                         f"continuation lengths {[len(o) for o in outputs]}")
    batches = []
    for first in range(0, len(prompts), batch_size):
        rows = list(zip(prompts[first:first + batch_size], outputs[first:first + batch_size]))
        width = max(len(p) + len(o) for p, o in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for row, (prompt, output) in enumerate(rows):
            tokens[row, :len(prompt) + len(output)] = torch.tensor(prompt + output)
            mask[row, len(prompt) - 1:len(prompt) + len(output) - 1] = True
        batches.append((tokens.to(device), mask.to(device)))
    return batches


def teacher_batches(teacher: Transformer, prompts: list[list[int]], spec: Distillation,
                    device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The prompts with the teacher's greedy continuations, batched as ``spec`` says."""
    return continuation_batches(prompts, teacher_continuations(teacher, prompts, spec.new_tokens), spec.batch_size,
                                device)


@torch.no_grad()
def agreement(model: Transformer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """How often the model's top next token is the continuation's (the teacher's greedy) token."""
    hits = [(model(x)[:, :-1].argmax(-1) == x[:, 1:])[mask[:, :-1]] for x, mask in batches]
    return torch.cat(hits).float().mean().item()


def distill(student: Transformer, teacher: Transformer, prompts: list[list[int]], spec: Distillation,
            seed: int = 0) -> list[tuple[int, float]]:
    """Fit ``student`` to ``teacher``'s next-token distributions on the teacher's greedy
    continuations of ``prompts`` (``spec.epochs`` passes, AdamW at a constant ``spec.lr``; the
    teacher is the model given, not ``spec.teacher``'s checkpoint); returns the loss of each step,
    against continuation tokens seen. The teacher's log-probabilities are computed once and kept:
    positions x vocabulary x 4 bytes (512 MiB for the draft preset)."""
    teacher.eval()
    device = student.device
    batches = teacher_batches(teacher, prompts, spec, device)
    with torch.no_grad():
        targets = [teacher(x)[mask].float().log_softmax(-1) for x, mask in batches]
    student.train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    history, seen = [], 0
    for _ in range(spec.epochs):
        for i in torch.randperm(len(batches), generator=generator).tolist():
            (x, mask), target = batches[i], targets[i]
            loss = distillation_loss(student(x)[mask], target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
            seen += len(target)
            history.append((seen, loss.item()))
    return history


def _plot(history: dict[str, list[tuple[int, float]]], title: str, path: Path,
          distilled: list[tuple[int, float]] | None = None) -> None:
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if distilled else 1, figsize=(12 if distilled else 7, 4), squeeze=False)
    ax = axes[0, 0]
    for label, points in history.items():
        ax.plot(*zip(*points), label=label, marker="o" if label == "validation" else None, lw=1)
    ax.set(xlabel="tokens seen", ylabel="cross-entropy (nats / token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    if distilled:
        ax = axes[0, 1]
        ax.plot(*zip(*distilled), lw=1)
        ax.set(xlabel="continuation tokens seen (all epochs)", ylabel="KL(teacher || model), nats / token",
               title="then distilled from the teacher")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _distillation_rows(spec: Distillation | None, stats: dict) -> str:
    if spec is None:
        return ""
    passes = f"{spec.epochs} pass{'es' * (spec.epochs != 1)}"
    return (f"| distillation | KL to `{spec.teacher}` (model.safetensors sha256 {stats['teacher_sha256'][:16]}...) "
            f"on its greedy continuations of {spec.prompts} training-split function openings "
            f"({spec.prompts * spec.new_tokens:,} tokens, {passes}) |\n"
            f"| agreement with `{spec.teacher}` | its top token is the one `{spec.teacher}` wrote "
            f"{stats['agreement_before']:.1%} of the time before distillation, {stats['agreement_after']:.1%} after "
            f"({spec.held_out} validation functions, {spec.new_tokens} tokens each) |\n"
            f"| validation loss before distillation | {stats['val_loss_before']:.4f} nats/token |\n")


def _card(name: str, preset: Preset, model: Transformer, stats: dict) -> str:
    return f"""# labkit `{name}` model

A Llama-style decoder trained from scratch by `python -m labkit.train --preset {name}`
on the Python {platform.python_version()} standard library (byte-level BPE, {preset.config.vocab_size} tokens).

| | |
|---|---|
| parameters | {model.num_parameters():,} |
| layers / d_model / heads / KV heads / d_ff | {preset.config.n_layers} / {preset.config.d_model} / {preset.config.n_heads} / {preset.config.n_kv_heads} / {preset.config.d_ff} |
| tokens seen | {stats['tokens']:,} ({stats['steps']} steps of {preset.batch_size} x {preset.seq_len}) |
{_distillation_rows(preset.distill, stats)}| wall time | {stats['seconds'] / 60:.1f} min |
| machine | {stats['machine']}, torch {torch.__version__} |
| validation loss | {stats['val_loss']:.4f} nats/token (256 windows of 256 tokens, evenly spread) |
| validation perplexity | {math.exp(stats['val_loss']):.2f} |
| date | {stats['date']} |
| seed | {stats['seed']} |

Config: `{asdict(preset.config)}`

![loss curve](loss.png)
"""


def corpus_steps(preset: Preset) -> int:
    """Optimizer steps in the preset's token budget; at least one."""
    steps = preset.tokens // (preset.batch_size * preset.seq_len)
    if steps < 1:
        raise ValueError(f"tokens={preset.tokens} is less than one batch of {preset.batch_size} x {preset.seq_len}")
    return steps


def check_teacher(spec: Distillation, config: ModelConfig) -> Path:
    """The teacher's checkpoint folder, if it is there and shares the student's vocabulary."""
    folder = CHECKPOINTS / spec.teacher
    if not (folder / "model.safetensors").exists():
        raise ValueError(f"distillation needs the {spec.teacher!r} checkpoint, not in {folder}: "
                         f"train it first with python -m labkit.train --preset {spec.teacher}")
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    if vocab != config.vocab_size:
        raise ValueError(f"teacher {spec.teacher!r} has a vocabulary of {vocab}, the student {config.vocab_size}")
    return folder


def train_on_corpus(model: Transformer, preset: Preset, train_ids: torch.Tensor, val_ids: torch.Tensor,
                    seed: int, label: str) -> dict[str, list[tuple[int, float]]]:
    """Next-token prediction on random windows of ``train_ids``; the train and validation loss curves."""
    device = model.device
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr, betas=(0.9, 0.95), weight_decay=0.1)
    steps = corpus_steps(preset)
    history: dict[str, list[tuple[int, float]]] = {"train": [], "validation": []}
    model.train()
    for step in (bar := tqdm(range(steps), desc=f"train {label}", file=sys.stdout, mininterval=5)):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, preset)
        x, y = (t.to(device) for t in random_batch(train_ids, preset.batch_size, preset.seq_len, generator))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        seen = (step + 1) * preset.batch_size * preset.seq_len
        history["train"].append((seen, loss.item()))
        if (step + 1) % preset.eval_every == 0 or step + 1 == steps:
            history["validation"].append((seen, validation_loss(model, val_ids, max_windows=32)))
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{history['validation'][-1][1]:.3f}")
    return history


def distill_stage(model: Transformer, spec: Distillation, folder: Path, tokenizer: Tokenizer, val_ids: torch.Tensor,
                  seed: int) -> tuple[list[tuple[int, float]], dict]:
    """``distill`` from the teacher checkpoint in ``folder`` (``check_teacher``'s) on training-split
    prompts; the loss curve, and for the card: the teacher's weights' digest, the validation loss
    before this stage, and the agreement on validation functions before and after."""
    device = model.device
    teacher = load_checkpoint(folder, device)
    held_out = continuation_prompts(tokenizer, spec.held_out, seed, split="validation")
    check = teacher_batches(teacher, held_out, spec, device)
    stats = {"teacher_sha256": hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest(),
             "val_loss_before": validation_loss(model, val_ids, max_windows=256),
             "agreement_before": agreement(model.eval(), check)}
    history = distill(model, teacher, continuation_prompts(tokenizer, spec.prompts, seed, split="train"), spec, seed)
    return history, stats | {"agreement_after": agreement(model.eval(), check)}


def train(name: str, out: Path | None = None, tokens: int | None = None, seed: int = 0,
          device: torch.device | None = None) -> dict:
    """Train preset ``name`` and write its checkpoint, loss curve and model card; return the stats."""
    preset = PRESETS[name] if tokens is None else replace(PRESETS[name], tokens=tokens)
    steps = corpus_steps(preset)
    teacher = check_teacher(preset.distill, preset.config) if preset.distill else None  # now, not after the corpus
    out = out or CHECKPOINTS / name
    device = device or get_device()
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    train_ids, val_ids = token_ids(tokenizer, "train"), token_ids(tokenizer, "validation")
    torch.manual_seed(seed)
    model = Transformer(preset.config).to(device)
    start = time.perf_counter()
    history = train_on_corpus(model, preset, train_ids, val_ids, seed, name)
    distilled, stats = (distill_stage(model, preset.distill, teacher, tokenizer, val_ids, seed) if teacher
                        else (None, {}))
    stats |= {"tokens": steps * preset.batch_size * preset.seq_len, "steps": steps, "seed": seed,
              "seconds": time.perf_counter() - start, "machine": device_name(device),
              "val_loss": validation_loss(model, val_ids, max_windows=256), "date": str(datetime.date.today())}
    save_checkpoint(model, out)
    _plot(history, f"labkit {name}: {model.num_parameters() / 1e6:.1f}M parameters", out / "loss.png", distilled)
    (out / "MODEL_CARD.md").write_text(_card(name, preset, model, stats))
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", type=Path, help="default: labkit/checkpoints/PRESET")
    parser.add_argument("--tokens", type=int, help="override the preset's token budget")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    stats = train(args.preset, args.out, args.tokens, args.seed)
    print(f"{args.preset}: validation loss {stats['val_loss']:.4f}, perplexity {math.exp(stats['val_loss']):.2f}, "
          f"{stats['seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
