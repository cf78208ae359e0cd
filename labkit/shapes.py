"""Published models' full shapes, randomly initialised, for timing on a GPU.

How long a step takes depends on the shapes of the matmuls and of the KV cache, not on the
weights' values: a Llama-3.1-8B with random weights decodes as fast as the real one,
and its text is meaningless. So the shapes below are the models' published ``config.json``
values, and ``build_shape`` gives a ``Transformer`` of that shape, built on the device directly:

    model = build_shape("Llama-3.1-8B", "cuda", torch.bfloat16)   # or labkit.load("shape:Llama-3.1-8B", ...)

Before it allocates anything, it checks the model fits:

    needed = weights (parameters x bytes per element)
           + KV cache of one sequence of max_seq_len tokens + a tenth of the weights (activations)
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from labkit.device import get_device
from labkit.memory import kv_cache_bytes, shape_of
from labkit.model import ModelConfig, RMSNorm, Transformer

# max_seq_len sizes the rope table (max_seq_len x 2 head_dim fp32 values: 128 MiB at 131,072 tokens)
# and the default contiguous cache (16 GiB per sequence for Llama-3.1-8B in bf16 at 131,072), so a
# shape gets this many positions unless the caller asks for more.
DEFAULT_MAX_SEQ_LEN = 8192
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# The published config.json of each model (max_seq_len: its max_position_embeddings).
SHAPES: dict[str, ModelConfig] = {
    "Llama-3.2-1B": ModelConfig(128256, 2048, 16, 32, 8, 8192, 131072, rope_theta=500000.0, tie_embeddings=True,
                                rope_scaling={"factor": 32.0, **_LLAMA3_ROPE}),
    "Llama-3.2-3B": ModelConfig(128256, 3072, 28, 24, 8, 8192, 131072, rope_theta=500000.0, tie_embeddings=True,
                                rope_scaling={"factor": 32.0, **_LLAMA3_ROPE}),
    "Llama-3.1-8B": ModelConfig(128256, 4096, 32, 32, 8, 14336, 131072, rope_theta=500000.0,
                                rope_scaling={"factor": 8.0, **_LLAMA3_ROPE}),
    "Llama-2-7B": ModelConfig(32000, 4096, 32, 32, 32, 11008, 4096),
    # v0.1; its 4,096-token sliding window is not modelled: attention reads the whole cache
    "Mistral-7B": ModelConfig(32000, 4096, 32, 32, 8, 14336, 32768),
    # Qwen's q, k and v projections have biases, left out here: a bias is a vector (0.13M of the
    # 7.6B parameters) and the shape is what matters for timing
    "Qwen2.5-7B": ModelConfig(152064, 3584, 28, 28, 4, 18944, 131072, rope_theta=1000000.0, norm_eps=1e-6),
}


def shape_config(name: str, max_seq_len: int | None = None) -> ModelConfig:
    """A published model's config, with ``max_seq_len`` positions (None: its own context, capped at
    ``DEFAULT_MAX_SEQ_LEN``)."""
    try:
        config = SHAPES[name]
    except KeyError:
        raise KeyError(f"no model shape {name!r}; choose one of {', '.join(SHAPES)}") from None
    if max_seq_len is not None and max_seq_len > config.max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} is past {name}'s context of {config.max_seq_len} tokens")
    return replace(config, max_seq_len=max_seq_len or min(config.max_seq_len, DEFAULT_MAX_SEQ_LEN))


def free_bytes(device: torch.device) -> int | None:
    """Memory free on ``device``: the GPU's (CUDA), else the host's available memory (the CPU, and
    MPS, which shares it); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type not in ("cpu", "mps"):
        return None
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts in kB (KiB)
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().available


def check_fits(model: Transformer, device: torch.device, name: str) -> None:
    """Raise a ValueError if ``model`` (still on the meta device, in its final dtype) would not fit
    ``device``: its weights, plus working memory of the KV cache of one sequence of max_seq_len
    tokens and a tenth of the weights for activations, the rope table and the allocator's slack
    (a rule of thumb: enough for decode steps and prefills of a few thousand tokens)."""
    free = free_bytes(device)
    if free is None:
        return
    config, dtype, n_params = model.config, DTYPE_NAMES[model.dtype], model.num_parameters()
    weights = n_params * model.dtype.itemsize
    working = kv_cache_bytes(shape_of(name, config, n_params), config.max_seq_len, dtype=dtype) + weights / 10
    if weights + working > free:
        raise ValueError(f"{name} in {dtype} needs {weights / 1e9:.1f} GB of weights + {working / 1e9:.1f} GB of "
                         f"working memory, the device ({device}) has {free / 1e9:.1f} GB free; choose a smaller "
                         f"model, a 2-byte dtype or a shorter max_seq_len, or free memory")


def build_shape(shape: str | ModelConfig, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> Transformer:
    """A randomly initialised model of a published shape (a name in ``SHAPES``, or a config), in
    eval mode on ``device`` (None: ``get_device()``). It is made on the meta device, which allocates
    nothing, and then in place on ``device`` in ``dtype``: no copy through the CPU, so an 8B model
    takes seconds on a GPU. Weights are normal with std 0.02 (``reset_parameters``), norms ones."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    config = shape_config(shape) if isinstance(shape, str) else shape
    device = torch.device(device) if device is not None else get_device()
    with torch.device("meta"):
        model = Transformer(config).to(dtype)  # the rope table is built on the CPU, a real tensor
    check_fits(model, device, shape if isinstance(shape, str) else _name_of(config))
    model.to_empty(device=device)
    if config.tie_embeddings:  # to_empty gives each module a tensor of its own
        model.lm_head.weight = model.embed.weight
    model.reset_parameters()
    for module in model.modules():
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
    model.store_weights_column_major()
    return model.eval()


def projection_shapes(config: ModelConfig) -> list[tuple[str, int, int]]:
    """(kind, out, in) of each projection of a block, in the order they run: what a decode step
    multiplies by, layer after layer (the weights ``[out, in]`` of ``attn.wqkv``, ``attn.wo``,
    ``mlp.gate_up`` and ``mlp.down``)."""
    qkv = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
    return [("attn.wqkv", qkv, config.d_model), ("attn.wo", config.d_model, config.n_heads * config.head_dim),
            ("mlp.gate_up", 2 * config.d_ff, config.d_model), ("mlp.down", config.d_model, config.d_ff)]


def shape_name(config: ModelConfig) -> str | None:
    """The name of the shape a config has (at any max_seq_len); None for a config of none of them."""
    return next((name for name, c in SHAPES.items() if replace(c, max_seq_len=config.max_seq_len) == config), None)


def _name_of(config: ModelConfig) -> str:
    """The name of the shape a config has, or a description, for messages."""
    return shape_name(config) or f"a {config.n_layers}-layer model of d_model={config.d_model}"


# What the timing demos of notebooks 01, 04, 05 and 06 run on a GPU, largest first: the lab's own
# models are so small there that a step costs its kernel launches, not its bytes
TIMING_SHAPES = ("Llama-3.1-8B", "Llama-3.2-3B", "Llama-3.2-1B")
TIMING_SHARE = 0.4  # of the free memory for the weights: the rest holds KV caches and activations


def timing_shape(device: torch.device | str) -> str | None:
    """The shape a timing demo runs on ``device``: ``LABKIT_TIMING_SHAPE`` if set (a name in ``SHAPES``,
    or ``none`` for the lab's own models), else on CUDA the largest of ``TIMING_SHAPES`` whose bf16
    weights take at most ``TIMING_SHARE`` of the free memory; None (the lab's models) otherwise."""
    chosen = os.environ.get("LABKIT_TIMING_SHAPE", "").strip()
    if chosen:
        if chosen.lower() == "none":
            return None
        shape_config(chosen)  # an unknown name: a KeyError that lists the choices
        return chosen
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free = free_bytes(device)
    for name in TIMING_SHAPES:
        with torch.device("meta"):
            weights = Transformer(shape_config(name)).num_parameters() * 2
        if weights <= TIMING_SHARE * free:
            return name
    return None


def timing_model(model: Transformer, dtype: torch.dtype = torch.bfloat16) -> tuple[Transformer, str]:
    """The model a timing demo should time in place of ``model`` (one of the lab's), and a sentence
    that says which it is: ``model`` itself where ``timing_shape`` chooses none, else a model of that
    shape with random weights, on ``model``'s device in ``dtype``."""
    name = timing_shape(model.device)
    if name is None:
        return model, "the lab's own model"
    return (build_shape(name, model.device, dtype),
            f"a model of {name}'s shape with random weights ({DTYPE_NAMES[dtype]}): its timings are a real "
            f"{name}'s, its text is meaningless")
