"""Communication in the simulator: the ring all-reduce formula against a ring run step by step, the
interconnect presets against their datasheet arithmetic, tensor-parallel step times by hand (and
unchanged without a link), the tensor-parallel table, and the disaggregated split."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from labkit import presets
from labkit.engine import Request, SchedulerConfig
from labkit.exercises.lab10 import ring_by_steps
from labkit.generate import SamplingParams
from labkit.hardware import Hardware
from labkit.interconnect import Link, ring_allreduce_seconds
from labkit.memory import ModelShape, kv_bytes_per_token, shape_of, weight_bytes
from labkit.model import ModelConfig
from labkit.shapes import SHAPES
from labkit.simulate import CostModel, tp_table
from labkit.simulate_disagg import SLO, compare_disaggregated
from labkit.workload import make_workload, uniform

TOY = ModelShape("toy", 1e9, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_context=4096)  # d_model 32
TOY_GPU = Hardware("toy GPU", memory_bytes=10e9, bandwidth=1e12, peak_flops=1e14, dtype="bf16")
TOY_LINK = Link("toy link", latency_s=1e-6, bandwidth=1e9)
NVLINK, PCIE = presets.link("NVLink-4"), presets.link("PCIe-Gen5-x16")
LLAMA_70B, H100 = presets.model("Llama-3.1-70B"), presets.gpu("H100-SXM")


# ---------------------------------------------------------------- the ring

@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_a_ring_run_step_by_step_takes_the_formulas_time(world):
    """``ring_by_steps`` (the exercises' reference, which checks that every rank ends with every sum)."""
    nbytes = 24 * world * 8
    assert ring_allreduce_seconds(nbytes, world, TOY_LINK) == pytest.approx(
        ring_by_steps(nbytes, world, TOY_LINK.latency_s, TOY_LINK.bandwidth), rel=1e-12)
    assert ring_allreduce_seconds(1e6, 1, TOY_LINK) == 0


# ---------------------------------------------------------------- the presets

def test_link_presets_are_the_datasheet_figures():
    assert set(presets.LINK_PRESETS) == {"NVLink-4", "NVLink-3", "PCIe-Gen5-x16", "PCIe-Gen4-x16", "InfiniBand-NDR"}
    gb = 1e9
    assert NVLINK.bandwidth == 900 * gb / 2  # H100: 900 GB/s both directions added
    assert presets.link("NVLink-3").bandwidth == 600 * gb / 2  # A100
    assert PCIE.bandwidth == pytest.approx(32 * 16 / 8 * gb * 128 / 130)  # 32 GT/s x 16 lanes, 128b/130b
    assert PCIE.bandwidth == pytest.approx(2 * presets.link("PCIe-Gen4-x16").bandwidth)
    assert PCIE.bandwidth == pytest.approx(128 * gb / 2, rel=0.02)  # the H100 datasheet's "PCIe Gen5: 128GB/s"
    assert presets.link("InfiniBand-NDR").bandwidth == 400 * gb / 8  # 400 Gb/s
    assert all(name == link.name and 0.5e-6 <= link.latency_s <= 20e-6 for name, link in presets.LINK_PRESETS.items())
    assert NVLINK.latency_s < PCIE.latency_s < presets.link("InfiniBand-NDR").latency_s
    with pytest.raises(KeyError, match="no link preset 'NVLink-5'; choose one of NVLink-4"):
        presets.link("NVLink-5")


def test_the_hidden_size_is_heads_times_head_dim_unless_given():
    assert LLAMA_70B.d_model == 8192 and presets.model("Llama-3.2-1B").d_model == 2048
    assert presets.model("Gemma-2-9B").d_model == 3584 and presets.model("DeepSeek-V3").d_model == 7168
    for name in SHAPES.keys() & presets.MODEL_PRESETS.keys():  # the published config.json's hidden_size
        assert presets.model(name).d_model == SHAPES[name].d_model, name
    assert presets.model("Gemma-2-9B").with_kv_heads(1).d_model == 3584
    config = ModelConfig(vocab_size=64, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=32)
    assert shape_of("tiny", config, 1e5).d_model == 48


# ---------------------------------------------------------------- tensor-parallel steps

DECODE = [(1, 100), (1, 50)]  # KV: 2 layers x 2 (K, V) x 2 heads x 8 dims x 2 bytes = 128 bytes a token
DECODE_BYTES = 2e9 + 128 * (101 + 51)


def test_without_a_link_communication_is_free_as_before():
    for cost in (CostModel(TOY, TOY_GPU, n_gpus=2, step_overhead_s=0.001),
                 CostModel(TOY, TOY_GPU, n_gpus=1, step_overhead_s=0.001, link=TOY_LINK)):
        w = cost.n_gpus
        assert cost.step_time(DECODE) == pytest.approx(DECODE_BYTES / (w * 1e12) + 0.001)
        assert cost.communication_time(DECODE) == 0


def test_a_tensor_parallel_step_by_hand():
    cost = CostModel(TOY, TOY_GPU, n_gpus=4, step_overhead_s=0.001, link=TOY_LINK)
    assert cost.allreduce_bytes(DECODE) == 2 * 32 * 2  # 2 tokens x d_model 32 x 2 bytes (bf16)
    # 2 layers x 2 all-reduces, each 2 x 3 ring steps of a 128 / 4 = 32-byte piece
    communication = 2 * 2 * 6 * (1e-6 + 32 / 1e9)
    parts = cost.step_parts(DECODE)
    assert parts["communication_s"] == pytest.approx(communication)
    assert parts["memory_s"] == pytest.approx(DECODE_BYTES / 4e12) and parts["compute_s"] < parts["memory_s"]
    assert parts["step_s"] == pytest.approx(DECODE_BYTES / 4e12 + communication + 0.001) == cost.step_time(DECODE)
    fp32 = CostModel(TOY, TOY_GPU, n_gpus=4, link=TOY_LINK, activation_dtype="fp32")
    assert fp32.allreduce_bytes(DECODE) == 2 * cost.allreduce_bytes(DECODE)
    with pytest.raises(ValueError, match="dtype='float32': choose one of"):
        CostModel(TOY, TOY_GPU, n_gpus=2, link=TOY_LINK, activation_dtype="float32")
    with pytest.raises(ValueError, match="link='NVLink-4' must be a labkit.interconnect.Link"):
        CostModel(TOY, TOY_GPU, n_gpus=2, link="NVLink-4")
    with pytest.raises(TypeError, match="hardware must be a Hardware"):
        CostModel(TOY, "H100-SXM")  # the name, where the preset was meant: it failed at the first step
    with pytest.raises(TypeError, match="model must be a ModelShape"):
        CostModel(TOY_GPU, TOY_GPU)


def test_a_measured_cpu_and_a_fitted_link_predict_the_labs_model():
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=128)
    cpu = Hardware("this cpu", 8e9, 10e9, 50e9, "float32", measured=True)
    fitted = Link("gloo, fitted", latency_s=40e-6, bandwidth=2e9)
    cost = CostModel(shape_of("tiny", config, 1e5), cpu, n_gpus=2, weight_dtype="fp32", kv_dtype="fp32",
                     step_overhead_s=1e-3, link=fitted, activation_dtype="fp32")
    # 4 tokens x 32 x 4 bytes = 512 bytes, 2 ring steps of 256 bytes, 2 per layer, 2 layers
    assert cost.communication_time([(4, 0)]) == pytest.approx(2 * 2 * 2 * (40e-6 + 256 / 2e9))


def test_the_communication_share_grows_with_gpus_and_is_smaller_over_nvlink():
    rows = tp_table(LLAMA_70B, H100, [NVLINK, PCIE], worlds=(1, 2, 4, 8), batches=(1, 64), context=1024)
    assert len(rows) == 2 * 4 * 3
    share = {(r["link"], r["gpus"], r["step"], r["batch"]): r["communication_share"] for r in rows}
    for link in (NVLINK.name, PCIE.name):
        for step, batch in (("decode", 1), ("decode", 64), ("prefill", 1)):
            shares = [share[link, w, step, batch] for w in (1, 2, 4, 8)]
            assert shares[0] == 0 and shares == sorted(shares) and shares[1] < shares[2] < shares[3]
    assert all(share[NVLINK.name, *key[1:]] < share[key] for key in share if key[0] == PCIE.name and key[1] > 1)
    row = next(r for r in rows if (r["link"], r["gpus"], r["step"], r["batch"]) == (PCIE.name, 4, "decode", 64))
    cost = CostModel(LLAMA_70B, H100, 4, link=PCIE)
    assert row["step_ms"] == pytest.approx(cost.step_time([(1, 1024)] * 64) * 1e3)
    assert row["tokens_per_s"] == pytest.approx(64 / cost.step_time([(1, 1024)] * 64))
    assert row["compute_ms"] < row["memory_ms"] and row["kv_fits"]
    fits = {(r["gpus"], r["step"], r["batch"]): r["kv_fits"] for r in rows if r["link"] == NVLINK.name}
    assert not any(fits[1, *rest] for rest in (("decode", 1), ("prefill", 1)))  # 141 GB of weights, 80 GB GPUs
    assert fits[2, "decode", 1] and not fits[2, "decode", 64]  # 2 GPUs leave 3 GB: 64 x 1,025 tokens do not fit
    assert {r["gpus"] for r in rows if not r["weights_fit"]} == {1}  # 141 GB on one 80 GB GPU; on two they fit
    smaller = replace(H100, memory_bytes=75e9)  # two hold the weights' 141 GB, but not within 90% of their memory
    assert weight_bytes(LLAMA_70B, H100.dtype) < 2 * smaller.memory_bytes
    assert not any(r["weights_fit"] for r in tp_table(LLAMA_70B, smaller, [NVLINK], worlds=(2,)))
    with pytest.raises(ValueError, match="context=0"):
        tp_table(LLAMA_70B, H100, [NVLINK], context=0)


# ---------------------------------------------------------------- disaggregated prefill and decode

def test_a_disaggregated_request_by_hand():
    request = Request("a", list(range(100)), SamplingParams(max_new_tokens=3, stop_at_eos=False), arrival_time=0.5)
    for w in (1, 2):
        cost = CostModel(TOY, TOY_GPU, n_gpus=w, step_overhead_s=1e-3, link=TOY_LINK)
        out = compare_disaggregated(cost, TOY_LINK, [request], w, w, SLO(1.0, 1.0), num_blocks=64)
        prefill, first, second = cost.step_time([(100, 0)]), cost.step_time([(1, 100)]), cost.step_time([(1, 101)])
        transfer = 1e-6 + 128 * 100 / w / 1e9  # 128 bytes of KV a token, each of the w GPUs sends its share
        (split,), (together,) = out["disaggregated"]["per_request"], out["colocated"]["per_request"]
        assert split["ttft_ms"] == pytest.approx(prefill * 1e3) == together["ttft_ms"]
        assert split["tpot_ms"] == pytest.approx((transfer + first + second) / 2 * 1e3)
        assert together["tpot_ms"] == pytest.approx((first + second) / 2 * 1e3)
        assert split["kv_bytes"] == out["disaggregated"]["kv_bytes"] == 128 * 100
        assert out["disaggregated"]["duration_s"] == pytest.approx(0.5 + prefill + transfer + first + second)
    assert request.output == [] and request.status == "waiting"  # served as copies


def test_every_request_is_served_both_ways_and_ships_the_formulas_kv():
    requests = make_workload(40, uniform(5, 120), uniform(1, 30), rate=1000.0, seed=1)
    cost = CostModel(TOY, TOY_GPU, n_gpus=1, step_overhead_s=1e-4)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, headroom=0)  # 24 blocks: some preempted
    out = compare_disaggregated(cost, PCIE, requests, 2, 1, SLO(ttft_s=0.01, tpot_s=0.0025), config, num_blocks=24)
    wanted = {r.request_id: r for r in requests}
    for mode in ("colocated", "disaggregated"):
        report = out[mode]
        rows = {row["request_id"]: row for row in report["per_request"]}
        assert rows.keys() == wanted.keys() and report["requests"] == len(requests) and report["gpus"] == 3
        assert report["preemptions"] > 0
        assert all(row["output_tokens"] == wanted[i].params.max_new_tokens for i, row in rows.items())
        met = sum(row["meets_slo"] for row in rows.values())
        assert report["goodput"] == pytest.approx(met / report["duration_s"]) and 0 < met < len(requests)
        assert report["slo_attainment"] == met / len(requests)
        assert report["p99_ttft_ms"] == pytest.approx(
            torch.tensor([row["ttft_ms"] for row in rows.values()], dtype=torch.float64).quantile(0.99).item())
    shipped = {row["request_id"]: row["kv_bytes"] for row in out["disaggregated"]["per_request"]}
    for request_id, request in wanted.items():  # one that stops at its first token ships nothing
        tokens = len(request.prompt) if request.params.max_new_tokens > 1 else 0
        assert shipped[request_id] == kv_bytes_per_token(TOY, "fp16") * tokens
    assert out["disaggregated"]["kv_bytes"] == sum(shipped.values()) > 0
    assert all(r.status == "waiting" and not r.output for r in requests)


def test_disaggregation_cuts_the_inter_token_tail_of_a_mixed_workload():
    # long prompts arriving while others decode, prefilled whole: a colocated decode waits for each
    requests = make_workload(60, uniform(1500, 3000), uniform(20, 60), rate=20.0, seed=2)
    cost = CostModel(presets.model("Llama-3.1-8B"), H100, step_overhead_s=2e-3)
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, chunked_prefill=False)
    out = compare_disaggregated(cost, presets.link("InfiniBand-NDR"), requests, 1, 1, SLO(0.5, 0.02), config,
                                num_blocks=8000, prefix_caching=False)
    together, split = out["colocated"], out["disaggregated"]
    assert split["p99_itl_ms"] < together["p99_itl_ms"] / 2
    assert split["request_throughput"] == pytest.approx(together["request_throughput"], rel=0.1)


def test_a_split_that_does_not_fit_the_instances_is_refused():
    cost = CostModel(LLAMA_70B, H100, n_gpus=2, link=NVLINK)
    requests = make_workload(2, uniform(5, 10), uniform(2, 3), seed=0)
    with pytest.raises(ValueError, match="prefill_gpus=3 must be a positive multiple of cost.n_gpus=2"):
        compare_disaggregated(cost, NVLINK, requests, 3, 2, SLO(1, 1))
    with pytest.raises(ValueError, match="decode_gpus=0 must be a positive multiple"):
        compare_disaggregated(cost, NVLINK, requests, 2, 0, SLO(1, 1))
    with pytest.raises(ValueError, match="both limits must be positive"):
        compare_disaggregated(cost, NVLINK, requests, 2, 2, SLO(0.5, 0))
    with pytest.raises(ValueError, match="requests is empty"):
        compare_disaggregated(cost, NVLINK, [], 2, 2, SLO(1, 1))
