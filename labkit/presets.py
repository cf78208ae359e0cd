"""Published specifications of common GPUs and models, for rooflines and memory planning.

Figures are the vendors' datasheet values: memory in GB (10^9 bytes), peak memory bandwidth,
and the dense (no structured sparsity) tensor-core rate for bf16 or fp16 with fp32
accumulation (fp16 on the T4, which has no bf16). They are upper bounds, not measurements:
``labkit.hardware.probe`` measures the machine you are on.
"""
from __future__ import annotations

from labkit.hardware import Hardware
from labkit.memory import ModelShape

GB = 1e9
TB_S = 1e12
TFLOPS = 1e12


def _gpu(name: str, memory_gb: float, bandwidth_tb_s: float, tflops: float, dtype: str = "bf16") -> Hardware:
    return Hardware(name, memory_gb * GB, bandwidth_tb_s * TB_S, tflops * TFLOPS, dtype)


GPU_PRESETS: dict[str, Hardware] = {
    "A100-40GB": _gpu("A100 40GB SXM", 40, 1.555, 312),
    "A100-80GB": _gpu("A100 80GB SXM", 80, 2.039, 312),
    "H100-SXM": _gpu("H100 SXM 80GB", 80, 3.35, 989),
    "H200": _gpu("H200 SXM 141GB", 141, 4.8, 989),
    "L4": _gpu("L4 24GB", 24, 0.3, 121),
    "T4": _gpu("T4 16GB", 16, 0.32, 65, dtype="fp16"),
    "RTX-4090": _gpu("RTX 4090 24GB", 24, 1.008, 165),
}


def gpu(name: str) -> Hardware:
    """A GPU preset by its key, e.g. ``gpu("H100-SXM")``."""
    try:
        return GPU_PRESETS[name]
    except KeyError:
        raise KeyError(f"no GPU preset {name!r}; choose one of {', '.join(GPU_PRESETS)}") from None


# Published configurations (each model's config.json / paper): parameters, layers, query heads,
# KV heads, head dimension, context. Gemma-2 alternates sliding-window (4,096-token) and global
# layers; counted here as if all were global, an upper bound. Mixtral's parameters count all
# eight experts, which all stay in memory. DeepSeek-V3 caches an MLA latent of
# kv_lora_rank 512 + rope dimension 64 per layer instead of keys and values.
MODEL_PRESETS: dict[str, ModelShape] = {m.name: m for m in [
    ModelShape("Llama-2-7B", 6.74e9, 32, 32, 32, 128, 4096),
    ModelShape("Llama-2-13B", 13.0e9, 40, 40, 40, 128, 4096),
    ModelShape("Llama-2-70B", 69.0e9, 80, 64, 8, 128, 4096),
    ModelShape("Llama-3.1-8B", 8.03e9, 32, 32, 8, 128, 131072),
    ModelShape("Llama-3.1-70B", 70.6e9, 80, 64, 8, 128, 131072),
    ModelShape("Llama-3.1-405B", 405.9e9, 126, 128, 8, 128, 131072),
    ModelShape("Llama-3.2-1B", 1.24e9, 16, 32, 8, 64, 131072),
    ModelShape("Llama-3.2-3B", 3.21e9, 28, 24, 8, 128, 131072),
    ModelShape("Mistral-7B", 7.24e9, 32, 32, 8, 128, 32768),
    ModelShape("Mixtral-8x7B", 46.7e9, 32, 32, 8, 128, 32768),
    ModelShape("Qwen2.5-7B", 7.62e9, 28, 28, 4, 128, 131072),
    ModelShape("Qwen2.5-72B", 72.7e9, 80, 64, 8, 128, 131072),
    ModelShape("Gemma-2-9B", 9.24e9, 42, 16, 8, 256, 8192),
    ModelShape("Gemma-2-27B", 27.2e9, 46, 32, 16, 128, 8192),
    ModelShape("DeepSeek-V3", 671e9, 61, 128, 128, 128, 131072, mla_latent_dim=512 + 64),
]}


def model(name: str) -> ModelShape:
    """A published model's shape by name, e.g. ``model("Llama-3.1-8B")``."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise KeyError(f"no model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}") from None
