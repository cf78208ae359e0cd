"""The lab's training text, and its tokenizer.

The corpus is Python source that every machine has: the standard library of the running
interpreter (site-packages excluded). Files are split into train and validation by a hash of
their path inside the library, so the split is the same on every machine with the same Python.
The tokenizer is a byte-level BPE (about 4k tokens) trained on the train split; files are
joined with an end-of-text token.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
import tokenize
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
VALIDATION_PERCENT = 5


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
    """'validation' for about 5% of files, chosen by a hash of the path; else 'train'."""
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest()[:8], 16) % 100
    return "validation" if bucket < VALIDATION_PERCENT else "train"


def source_files(split: str) -> list[Path]:
    """The standard library's .py files in ``split`` ('train' or 'validation'), sorted."""
    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r}: choose 'train' or 'validation'")
    root = stdlib_root()
    files = (p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    return sorted(p for p in files if split_of(p.relative_to(root).as_posix()) == split)


def read_texts(split: str) -> list[str]:
    """Each file's text, decoded as Python declares it; unreadable files are skipped."""
    texts = []
    for path in source_files(split):
        try:
            with tokenize.open(path) as f:
                texts.append(f.read())
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
    return texts


def train_tokenizer(vocab_size: int = 4096) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the train split."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(read_texts("train"), trainer=trainer)
    return tokenizer


def cache_dir() -> Path:
    return Path(os.environ.get("LABKIT_CACHE", Path.home() / ".cache" / "labkit"))


def token_ids(tokenizer: Tokenizer, split: str) -> torch.Tensor:
    """The whole split as one 1-D tensor of token ids, files joined by EOS (cached on disk)."""
    digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:12]
    path = cache_dir() / f"{split}-{stdlib_root().name}-{digest}.safetensors"
    if path.exists():
        return load_file(str(path))["ids"].long()
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(read_texts(split)):
        ids.extend(encoding.ids)
        ids.append(eos)
    tensor = torch.tensor(ids, dtype=torch.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"ids": tensor}, str(path))
    return tensor.long()
