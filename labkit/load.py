"""Load a model and its tokenizer: one of the lab's shipped checkpoints, or a Hugging Face
Llama-architecture checkpoint from a local folder (config.json, tokenizer.json and
safetensors weights, sharded or not); or, for timing, a published model's shape with random
weights (``labkit.shapes``). Nothing is downloaded, and pickles are never read.

    model, tokenizer = labkit.load("target")            # shipped with the lab
    model, tokenizer = labkit.load("~/models/SmolLM2-135M")  # your own, from disk
    model, _ = labkit.load("shape:Llama-3.1-8B", "cuda", torch.bfloat16)  # random weights, no tokenizer

``LABKIT_MODEL`` names the model the notebooks use (default ``target``).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from labkit.device import as_device, get_device
from labkit.model import ModelConfig, Transformer
from labkit.shapes import build_shape, shape_config

CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"
TOKENIZER = CHECKPOINTS / "tokenizer.json"

# Hugging Face Llama parameter names -> labkit's; labkit stacks q, k, v (and gate, up) row-wise.
_HF_LAYER = {
    "self_attn.o_proj": "attn.wo", "mlp.down_proj": "mlp.down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
}
_HF_STACKED = {"attn.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj")}
_HF_TOP = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}


def checkpoint_state(model: Transformer, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tensors ``save_checkpoint`` writes: every weight in ``dtype``, a tied LM head once."""
    return {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()
            if not (model.config.tie_embeddings and k == "lm_head.weight")}


def save_checkpoint(model: Transformer, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``model.safetensors`` and ``config.json`` (labkit's own parameter names)."""
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_state(model, dtype), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(asdict(model.config), indent=2) + "\n")


def _build(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device,
           dtype: torch.dtype) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    unexpected = model.load_state_dict(state, strict=False, assign=True).unexpected_keys
    if unexpected:  # weights of more layers than the config has, say: dropping them would be a different model
        raise ValueError(f"the checkpoint has {len(unexpected)} weights its config has no place for, e.g. "
                         f"{unexpected[:3]} (config: {config.n_layers} layers)")
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    model = model.to(device=device, dtype=dtype).eval()
    model.store_weights_column_major()
    return model


def _folder_config(folder: Path, kind: str) -> ModelConfig:
    """The config.json of a checkpoint folder, labkit's own (``kind`` "labkit") or Hugging Face's ("hf")."""
    config = json.loads((folder / "config.json").read_text())
    return ModelConfig(**config) if kind == "labkit" else config_from_hf(config)


def load_checkpoint(folder: str | Path, device: torch.device | None = None,
                    dtype: torch.dtype = torch.float32) -> Transformer:
    """A model saved by ``save_checkpoint``."""
    folder = Path(folder).expanduser()
    config = _folder_config(folder, "labkit")
    return _build(config, load_file(str(_weight_files(folder, "labkit")[0])), device or get_device(), dtype)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """labkit's config for a Hugging Face ``config.json``; other architectures get a clear error."""
    if hf.get("model_type") != "llama":
        raise ValueError(f"model_type={hf.get('model_type')!r} is not supported: labkit loads "
                         "Llama-architecture checkpoints (model_type 'llama')")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{flag}=True is not supported: labkit's Llama has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported; labkit's MLP is SwiGLU (silu)")
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"rope_type={kind!r} is not supported (only default and llama3)")
    config = ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)), norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling={k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings")} if kind == "llama3" else None,
    )
    if hf.get("head_dim", config.head_dim) != config.head_dim:
        raise ValueError(f"head_dim={hf['head_dim']} differs from hidden_size / num_attention_heads "
                         f"= {config.head_dim}, which labkit's attention assumes")
    return config


def _hf_name(name: str) -> str | None:
    stem, _, leaf = name.rpartition(".")
    if stem in _HF_TOP:
        return f"{_HF_TOP[stem]}.{leaf}"
    parts = stem.split(".")
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in _HF_LAYER:
        return f"blocks.{parts[2]}.{_HF_LAYER['.'.join(parts[3:])]}.{leaf}"
    return None


def state_from_hf(tensors: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Hugging Face Llama weights under labkit's names, with q/k/v and gate/up stacked."""
    state = {new: t for name, t in tensors.items() if (new := _hf_name(name))}
    for i in range(n_layers):
        for ours, theirs in _HF_STACKED.items():
            parts = [tensors.get(f"model.layers.{i}.{name}.weight") for name in theirs]
            if all(p is not None for p in parts):
                state[f"blocks.{i}.{ours}.weight"] = torch.cat(parts)
    return state


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """A Hugging Face ``config.json`` for a labkit model (the inverse of ``config_from_hf``)."""
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "vocab_size": config.vocab_size, "hidden_size": config.d_model, "intermediate_size": config.d_ff,
          "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
          "num_key_value_heads": config.n_kv_heads, "max_position_embeddings": config.max_seq_len,
          "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
          "tie_word_embeddings": config.tie_embeddings, "attention_bias": False, "mlp_bias": False}
    if config.rope_scaling:
        hf["rope_scaling"] = {"rope_type": "llama3", **config.rope_scaling}
    return hf


def save_hf(model: Transformer, folder: str | Path, tokenizer: Tokenizer | None = None) -> None:
    """Write a labkit model as a Hugging Face Llama checkpoint (config.json, safetensors)."""
    folder, c = Path(folder).expanduser(), model.config
    layer_names = {ours: theirs for theirs, ours in _HF_LAYER.items()}
    top_names = {ours: theirs for theirs, ours in _HF_TOP.items()}
    sizes = {"attn.wqkv": [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim],
             "mlp.gate_up": [c.d_ff, c.d_ff]}
    state = {}
    for name, tensor in model.state_dict().items():
        stem, _, leaf = name.rpartition(".")
        if stem.startswith("blocks."):
            _, layer, inner = stem.split(".", 2)
            if inner in _HF_STACKED:
                for theirs, piece in zip(_HF_STACKED[inner], tensor.split(sizes[inner])):
                    state[f"model.layers.{layer}.{theirs}.{leaf}"] = piece
            else:
                state[f"model.layers.{layer}.{layer_names[inner]}.{leaf}"] = tensor
        elif not (c.tie_embeddings and stem == "lm_head"):
            state[f"{top_names[stem]}.{leaf}"] = tensor
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config(c), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(str(folder / "tokenizer.json"))


def _weight_files(folder: Path, kind: str) -> list[Path]:
    """The safetensors files of a labkit (``kind`` "labkit": model.safetensors) or Hugging Face ("hf":
    every shard) folder; FileNotFoundError, naming what the folder holds, where there are none."""
    files = [folder / "model.safetensors"] if kind == "labkit" else sorted(folder.glob("*.safetensors"))
    files = [file for file in files if file.exists()]
    if not files:
        found = ", ".join(sorted(p.name for p in folder.iterdir()))
        raise FileNotFoundError(f"no {'model' if kind == 'labkit' else '*'}.safetensors weights in {folder} (found: "
                                f"{found}); labkit never loads pickled .bin checkpoints")
    return files


def weight_files(name: str | None = None) -> list[Path]:
    """The files of weights ``load(name)`` reads, without reading them ([] for a ``shape:``, whose
    weights are random); FileNotFoundError where the folder has none."""
    kind, where = _source(name)
    return [] if kind == "shape" else _weight_files(where, kind)


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder, "hf"):
        tensors.update(load_file(str(file)))
    return tensors


def load_hf(folder: str | Path, device: torch.device | None = None,
            dtype: torch.dtype = torch.float32) -> tuple[Transformer, Tokenizer | None]:
    """A Hugging Face Llama checkpoint from a local folder, as a labkit model."""
    folder = Path(folder).expanduser()
    config = _folder_config(folder, "hf")
    state = state_from_hf(_read_safetensors(folder), config.n_layers)
    return _build(config, state, device or get_device(), dtype), _hf_tokenizer(folder)


def _hf_tokenizer(folder: Path) -> Tokenizer | None:
    file = folder / "tokenizer.json"
    return Tokenizer.from_file(str(file)) if file.exists() else None


def _is_labkit_config(path: Path) -> bool:
    """Whether a config.json is labkit's own (``save_checkpoint``'s: ModelConfig's fields only)."""
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    return isinstance(config, dict) and set(config) <= {f.name for f in fields(ModelConfig)}


def _load_labkit_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> tuple[Transformer, Tokenizer]:
    """A folder ``save_checkpoint`` wrote, with its own tokenizer.json or else the lab's."""
    model = load_checkpoint(folder, device, dtype)
    return model, _labkit_tokenizer(folder, model.config)


def _labkit_tokenizer(folder: Path, config: ModelConfig) -> Tokenizer:
    own = folder / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(own if own.exists() else TOKENIZER))
    if tokenizer.get_vocab_size() > config.vocab_size:  # it would give ids the model has no row for
        which = own if own.exists() else "the lab's: the folder has no tokenizer.json"
        raise ValueError(f"{folder}: a vocabulary of {config.vocab_size} tokens, but its tokenizer "
                         f"({which}) has {tokenizer.get_vocab_size()}")
    return tokenizer


def _source(name: str | None) -> tuple[str, str | Path]:
    """Where ``load`` finds ``name``: ("shape", its SHAPES name), ("labkit", folder) or ("hf", folder)."""
    name = name or os.environ.get("LABKIT_MODEL", "target")
    if name.startswith("shape:"):
        return "shape", name.removeprefix("shape:")
    shipped, folder = CHECKPOINTS / name, Path(name).expanduser()
    if "/" not in name and (shipped / "model.safetensors").exists():  # shipped names come first
        return "labkit", shipped
    if (folder / "config.json").exists():
        return ("labkit" if _is_labkit_config(folder / "config.json") else "hf"), folder
    names = sorted(p.name for p in CHECKPOINTS.glob("*/") if (p / "model.safetensors").exists())
    raise FileNotFoundError(f"no checkpoint {name!r}: not a folder with a config.json, and not one of "
                            f"the shipped checkpoints {names}")


def load(name: str | None = None, device: torch.device | str | None = None,
         dtype: torch.dtype = torch.float32) -> tuple[Transformer, Tokenizer | None]:
    """A shipped checkpoint by name (``target``, ``draft``, ``mha``, ``gqa``, ``mqa``), or a local
    folder: a Hugging Face one, or one ``save_checkpoint`` wrote (with the lab's tokenizer unless it
    holds its own); ``LABKIT_MODEL`` when no name is given. ``shape:NAME`` (a name in
    ``labkit.shapes.SHAPES``, e.g. ``shape:Llama-3.1-8B``) is that model's shape with random
    weights, for timing: its text is meaningless, so it comes with no tokenizer (None)."""
    kind, where = _source(name)
    device = as_device(device) if device is not None else get_device()
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r} must be a torch dtype, e.g. torch.float16, not a {type(dtype).__name__}")
    if kind == "shape":
        return build_shape(where, device, dtype), None
    if kind == "labkit":
        return _load_labkit_folder(where, device, dtype)
    return load_hf(where, device, dtype)


def load_config(name: str | None = None) -> ModelConfig:
    """The config of what ``load(name)`` would load, read without its weights."""
    kind, where = _source(name)
    return shape_config(where) if kind == "shape" else _folder_config(where, kind)


def load_tokenizer(name: str | None = None) -> Tokenizer | None:
    """The tokenizer ``load(name)`` comes with, read without the weights (None for a ``shape:``)."""
    kind, where = _source(name)
    if kind == "shape":
        return None
    return _labkit_tokenizer(where, _folder_config(where, kind)) if kind == "labkit" else _hf_tokenizer(where)
