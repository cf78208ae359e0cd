"""Published specifications of common GPUs, interconnects and models, for rooflines, memory
planning and the simulator.

Figures are the vendors' datasheet values: memory in GB (10^9 bytes), peak memory bandwidth,
and the dense (no structured sparsity) tensor-core rate for bf16 or fp16 with fp32
accumulation (fp16 on the T4, which has no bf16); a link's bandwidth in one direction. They are
upper bounds, not measurements: ``labkit.hardware.probe`` measures the machine you are on, and
``labkit.parallel`` fits a link to all-reduces timed on it.
"""
from __future__ import annotations

from labkit.hardware import Hardware, IssueRate
from labkit.interconnect import Link
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


# Instruction issue, from NVIDIA's H100 datasheet and Hopper architecture whitepaper: the SXM5 part
# has 132 SMs of 4 warp schedulers, each issuing one warp instruction a cycle, at up to 1.98 GHz.
ISSUE_RATES: dict[str, IssueRate] = {"H100-SXM": IssueRate("H100 SXM 80GB", sms=132, schedulers=4, clock_hz=1.98e9)}


def gpu(name: str) -> Hardware:
    """A GPU preset by its key, e.g. ``gpu("H100-SXM")``."""
    try:
        return GPU_PRESETS[name]
    except KeyError:
        raise KeyError(f"no GPU preset {name!r}; choose one of {', '.join(GPU_PRESETS)}") from None


# Links between GPUs, bandwidth in bytes per second in ONE direction (datasheets quote both added).
# Sources, datasheet figures, none measured:
# - NVLink 4, H100 SXM: "NVLink 900GB/s" (NVIDIA H100 Tensor Core GPU datasheet): 18 links x 50 GB/s,
#   both directions added, so 450 GB/s each way; every GPU of an HGX H100 board reaches every other at
#   that rate through NVSwitch.
# - NVLink 3, A100 SXM: "NVLink 600GB/s" (NVIDIA A100 Tensor Core GPU datasheet): 300 GB/s each way.
# - PCIe Gen5 / Gen4 x16: 32 / 16 GT/s per lane (PCI-SIG, PCI Express Base Specification 5.0 / 4.0),
#   128b/130b encoding: 16 lanes carry 63.0 / 31.5 GB/s each way (the H100 and A100 datasheets round
#   this to "PCIe Gen5 128GB/s" and "PCIe Gen4 64GB/s", both directions). Through the host, as GPUs
#   without NVLink exchange data.
# - InfiniBand NDR: 400 Gb/s per port (NVIDIA ConnectX-7 and Quantum-2 datasheets) = 50 GB/s each way;
#   a DGX H100 has one such port per GPU.
# Latency per message: no datasheet gives one for a GPU collective, so each takes the time NCCL's
# own cost model charges a ring step with its LL128 protocol on that kind of link (hwLat in NCCL's
# src/graph/tuning.cc: 1.9 us over NVLink, 2.5 us over PCIe, 4.0 us over the network). NCCL adds
# a fixed cost per call besides (baseLat there, several us), which a Link leaves out: small
# all-reduces come out optimistic.
GB_S = 1e9


def _pcie(gt_per_s: float, lanes: int = 16) -> float:
    """Bytes per second in one direction: lanes x transfers per second x 128/130 (encoding) / 8 bits."""
    return lanes * gt_per_s * 1e9 * 128 / 130 / 8


LINK_PRESETS: dict[str, Link] = {link.name: link for link in [
    Link("NVLink-4", 1.9e-6, 450 * GB_S),
    Link("NVLink-3", 1.9e-6, 300 * GB_S),
    Link("PCIe-Gen5-x16", 2.5e-6, _pcie(32)),
    Link("PCIe-Gen4-x16", 2.5e-6, _pcie(16)),
    Link("InfiniBand-NDR", 4.0e-6, 400e9 / 8),
]}


def link(name: str) -> Link:
    """An interconnect preset by its name, e.g. ``link("NVLink-4")``."""
    try:
        return LINK_PRESETS[name]
    except KeyError:
        raise KeyError(f"no link preset {name!r}; choose one of {', '.join(LINK_PRESETS)}") from None


# Published configurations (each model's config.json / paper): parameters, layers, query heads,
# KV heads, head dimension, context; the hidden size (d_model) where it is not heads x head dimension
# (hidden_size in config.json: Gemma-2's heads are wider than its residual stream, DeepSeek-V3's
# heads are 128 x 128 over a 7,168-wide stream). Gemma-2 alternates sliding-window (4,096-token) and global
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
    ModelShape("Gemma-2-9B", 9.24e9, 42, 16, 8, 256, 8192, d_model=3584),
    ModelShape("Gemma-2-27B", 27.2e9, 46, 32, 16, 128, 8192, d_model=4608),
    ModelShape("DeepSeek-V3", 671e9, 61, 128, 128, 128, 131072, mla_latent_dim=512 + 64, d_model=7168),
]}


def model(name: str) -> ModelShape:
    """A published model's shape by name, e.g. ``model("Llama-3.1-8B")``."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise KeyError(f"no model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}") from None
