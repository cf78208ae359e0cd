"""The lab's training text, and its tokenizer.

The corpus is Python source that every machine has: the standard library of the running
interpreter (site-packages excluded). Files are split into train and validation by a hash of
their path inside the library, so the split is the same on every machine with the same Python.
The tokenizer is a byte-level BPE (4096 tokens) trained on the train split by
``python -m labkit.corpus``; files are joined with an end-of-text token.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import os
import platform
import re
import sysconfig
import textwrap
import tokenize
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
VALIDATION_PERCENT = 5
VOCAB_SIZE = 4096


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
    return [p for p in _python_files(root) if split_of(p.relative_to(root).as_posix()) == split]


@functools.cache
def _python_files(root: Path) -> tuple[Path, ...]:
    """Every .py file under ``root`` outside site-packages, sorted: walked once per process, since every
    ``token_ids`` call needs the list for its cache key. site-packages is never entered (where the
    interpreter has many packages installed, walking it took most of the time)."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name != "site-packages"]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    return tuple(sorted(p for p in found if p.is_file()))


def read_texts(files: list[Path]) -> list[str]:
    """Each file's text, decoded as Python declares it; unreadable files are skipped."""
    texts = []
    for path in files:
        try:
            with tokenize.open(path) as f:
                texts.append(f.read())
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
    return texts


@functools.cache
def functions(split: str) -> tuple[str, ...]:
    """Every function in the split's files (a ``def`` line up to the first blank line, dedented),
    in file order: prompts for the generation labs. A method with a line at column 0 inside it
    (a comment, a string's continuation) cannot be dedented and is left out."""
    found: list[str] = []
    for text in read_texts(source_files(split)):
        found += [f for f in map(textwrap.dedent, _FUNCTION.findall(text)) if f.startswith("def ")]
    return tuple(found)


# a def up to its first blank line, or to the end of its file (whose last newline is not the def's)
_FUNCTION = re.compile(r"^[ \t]*def \w+\(.*?(?=\n[ \t]*\n|\n?\Z)", re.M | re.S)


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the train split."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(read_texts(source_files("train")), trainer=trainer)
    return tokenizer


def cache_dir() -> Path:
    return Path(os.environ.get("LABKIT_CACHE", Path.home() / ".cache" / "labkit"))


def token_ids(tokenizer: Tokenizer, split: str) -> torch.Tensor:
    """The whole split as one 1-D tensor of token ids, files joined by EOS (cached on disk)."""
    files = source_files(split)
    names = "\n".join(p.relative_to(stdlib_root()).as_posix() for p in files)
    key = "\n".join([tokenizer.to_str(), platform.python_version(), str(stdlib_root()), names])
    path = cache_dir() / f"{split}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"
    if path.exists():
        return load_file(str(path))["ids"].long()
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(read_texts(files)):
        ids.extend(encoding.ids)
        ids.append(eos)
    tensor = torch.tensor(ids, dtype=torch.int32)
    partial = path.with_suffix(f".{os.getpid()}.partial")  # written whole, then renamed: a reader
    try:  # in another process never sees half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"ids": tensor}, str(partial))
        os.replace(partial, path)
    except (OSError, SafetensorError):  # a cache that cannot be written (a full disk, the grader's limit
        partial.unlink(missing_ok=True)  # on file sizes) costs the next call the tokenizing, nothing more
    return tensor.long()


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit.corpus``: train the tokenizer on the train split and write it."""
    from labkit.load import TOKENIZER

    parser = argparse.ArgumentParser(prog="python -m labkit.corpus", description=main.__doc__)
    parser.add_argument("--out", type=Path, default=TOKENIZER)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    train_tokenizer(args.vocab_size).save(str(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
