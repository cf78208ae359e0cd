"""Small models and settings that several test files share."""
from __future__ import annotations

from typing import Iterator

import torch

from labkit.model import ModelConfig, Transformer


def far_apart_model(vocab_size: int = 64) -> Transformer:
    """A float64 random model whose logits are far apart (std 0.3, as lab 01's random models),
    so that the greedy choice depends on the whole context and is never a near tie, batched or alone."""
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        model = Transformer(ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                        d_ff=64, max_seq_len=128))
        model.reset_parameters(std=0.3)
    return model.double().eval()


def one_torch_thread() -> Iterator[None]:
    """One torch thread while a module's tests run (as a fixture): their matrices are small, a second
    thread costs more than it saves, far more on a busy machine or beside a server process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
