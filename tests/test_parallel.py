"""labkit.parallel: the launcher (a rank that raises, dies or hangs stops the run and leaves nothing),
tensor parallelism on two gloo ranks against one process (MHA, GQA, MQA with its KV head replicated;
contiguous and paged caches), layouts refused before any process starts, and the communication fit."""
from __future__ import annotations

import os

import pytest
import torch

from labkit.generate import SamplingParams, stream
from labkit.interconnect import Link, ring_allreduce_seconds
from labkit.load import load, save_hf
from labkit.model import ModelConfig, forward_tokens
from labkit.parallel import RankError, launch
from labkit.parallel.comm import fit_line, link_from_allreduce, link_from_send
from labkit.parallel.tensor import check_layout, shard_heads, shard_state, weight_bytes
from labkit.parallel import tensor

import parallel_ranks

PROMPTS = [[5, 17, 301, 44, 9, 120, 7, 3000, 64, 12, 99, 250], [42, 8, 1999]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("name", ["mha", "gqa as a Hugging Face folder", "mqa"])
def test_two_ranks_match_one_process(name, tmp_path):
    model = load(name.split()[0], device="cpu")[0]
    if "Hugging Face" in name:  # the ranks shard a Hugging Face checkpoint as they do a labkit one
        save_hf(model, tmp_path)
        name = str(tmp_path)
    params = SamplingParams(max_new_tokens=10, stop_at_eos=False)
    expected = [list(stream(model, p, params)) for p in PROMPTS]
    got = launch(parallel_ranks.tensor_parallel_run, 2, (name, PROMPTS, 10), timeout_s=120)
    torch.testing.assert_close(got["logits"], forward_tokens(model, PROMPTS[0], 0, None), atol=1e-4, rtol=1e-4)
    assert got["contiguous"] == expected and got["paged"] == expected
    assert got["all_reduces"] > 0 and got["all_reduces"] % (2 * model.config.n_layers) == 0  # two per layer
    # each rank holds half the KV heads; MQA's one head is replicated on both
    assert got["kv_heads"] == max(1, model.config.n_kv_heads // 2)
    projections = sum(p.nbytes for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() == 2)
    replicated_kv = (got["kv_heads"] * 2 - model.config.n_kv_heads) * 2 * model.config.head_dim \
        * model.config.d_model * 4 * model.config.n_layers  # the k and v rows both ranks hold
    assert got["weight_bytes"] == weight_bytes(model) - projections // 2 + replicated_kv // 2


def test_a_rank_that_raises_stops_every_rank(tmp_path):
    with pytest.raises(RankError, match="rank 1 of 2 raised(.|\n)*rank one cannot go on"):
        launch(parallel_ranks.raise_on_rank_one, 2, (str(tmp_path),), timeout_s=60)
    pids = [int((tmp_path / str(r)).read_text()) for r in range(2)]
    assert not any(_alive(pid) for pid in pids)


def test_a_rank_that_hangs_or_dies_is_caught():
    with pytest.raises(RankError, match=r"ranks \[1\] of 2 did not finish"):
        launch(parallel_ranks.hang_on_rank_one, 2, timeout_s=8)
    with pytest.raises(RankError, match="rank 1 of 2 died \\(exit code 7\\)"):
        launch(parallel_ranks.exit_on_rank_one, 2, timeout_s=60)


def test_functions_that_cannot_reach_another_process_are_refused():
    with pytest.raises(ValueError, match="importable module"):
        launch(lambda rank: 0, 2)
    with pytest.raises(ValueError, match="world_size=0"):
        launch(parallel_ranks.hang_on_rank_one, 0)


def test_layouts_that_do_not_split_are_refused_by_name():
    config = ModelConfig(vocab_size=64, d_model=48, n_layers=2, n_heads=6, n_kv_heads=3, d_ff=96, max_seq_len=32)
    with pytest.raises(ValueError, match="n_heads=6 is not a multiple of world_size=4"):
        check_layout(config, 4)
    with pytest.raises(ValueError, match="n_kv_heads=3 is not a multiple of world_size=2"):
        check_layout(config, 2)
    with pytest.raises(ValueError, match="world_size=6 is not a multiple of n_kv_heads=4"):
        check_layout(ModelConfig(64, 48, 2, 12, 4, 96, 32), 6)
    with pytest.raises(ValueError, match="n_heads=8 is not a multiple of world_size=3"):
        tensor.generate("gqa", PROMPTS, 4, world_size=3)  # before any rank starts: no RankError


def test_shard_heads_keep_every_query_head_with_its_kv_head():
    for heads, kv, world in [(8, 8, 2), (8, 2, 2), (8, 2, 4), (8, 1, 2), (8, 1, 8), (12, 4, 4)]:
        group, owners = heads // kv, {}
        for rank in range(world):
            queries, kvs = shard_heads(heads, kv, rank, world)
            assert len(kvs) == max(1, kv // world)
            for h in queries:
                owners[h] = rank
                assert h // group in kvs, (heads, kv, world, rank, h)
        assert sorted(owners) == list(range(heads))


def test_shard_state_cuts_the_columns_that_the_rows_feed():
    """The shards' MLP partial sums add up to the whole MLP (checked here without processes)."""
    config = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=32, max_seq_len=16)
    torch.manual_seed(0)
    state = {"blocks.0.mlp.gate_up.weight": torch.randn(64, 16), "blocks.0.mlp.down.weight": torch.randn(16, 32)}
    x = torch.randn(3, 16)

    def mlp(s):
        gate, up = (x @ s["blocks.0.mlp.gate_up.weight"].T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ s["blocks.0.mlp.down.weight"].T
    parts = sum(mlp(shard_state(state, config, r, 4)) for r in range(4))
    torch.testing.assert_close(parts, mlp(state))


def test_fits_recover_the_link_that_made_the_times():
    link = Link("made up", latency_s=30e-6, bandwidth=2e9)
    sizes = [4 * 4**k for k in range(10)]
    intercept, slope = fit_line(sizes, [link.send_seconds(n) for n in sizes])
    assert intercept == pytest.approx(30e-6) and 1 / slope == pytest.approx(2e9)
    for world in (2, 4):
        fitted = link_from_allreduce(sizes, [ring_allreduce_seconds(n, world, link) for n in sizes], world)
        assert fitted.latency_s == pytest.approx(30e-6) and fitted.bandwidth == pytest.approx(2e9)
    noisy = link_from_send(sizes, [link.send_seconds(n) * (1.1 if i % 2 else 0.9) for i, n in enumerate(sizes)])
    assert noisy.latency_s >= 0 and 1.5e9 < noisy.bandwidth < 2.5e9
