"""labkit.parallel: the launcher (a rank that raises, dies or hangs stops the run and leaves nothing),
tensor parallelism on two gloo ranks against one process (MHA, GQA, MQA with its KV head replicated;
contiguous and paged caches), layouts refused before any process starts, and the communication fit."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labkit.generate import SamplingParams, stream
from labkit.interconnect import Link, ring_allreduce_seconds
from labkit.load import load, save_hf
from labkit.model import ModelConfig, forward_tokens, parameter_bytes
from labkit.parallel import RankError, launch
from labkit.parallel import comm
from labkit.parallel.comm import fit_line, link_from_allreduce, link_from_send
from labkit.parallel.tensor import check_layout, shard_heads, shard_state
from labkit.parallel import tensor

import parallel_ranks

PROMPTS = [[5, 17, 301, 44, 9, 120, 7, 3000, 64, 12, 99, 250], [42, 8, 1999]]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pids(folder: Path) -> list[int]:
    """The pids the ranks wrote into ``folder`` (each rank a file named by its rank; a rank stopped
    while writing leaves only a ``.partial`` file)."""
    return [int(f.read_text()) for f in folder.iterdir() if f.suffix != ".partial"]


def _all_gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(pid) for pid in pids)


@pytest.mark.parametrize("name", ["mha", "gqa as a Hugging Face folder", "mqa"])
def test_two_ranks_match_one_process(name, tmp_path):
    model = load(name.split()[0], device="cpu")[0]
    if "Hugging Face" in name:  # the ranks shard a Hugging Face checkpoint as they do a labkit one
        save_hf(model, tmp_path)
        name = str(tmp_path)
    params = SamplingParams(max_new_tokens=10, stop_at_eos=False)
    expected = [list(stream(model, p, params)) for p in PROMPTS]
    runs = {cache: tensor.generate(name, PROMPTS, 10, world_size=2, cache=cache, timeout_s=120)
            for cache in ("contiguous", "paged")}
    for got in runs.values():
        torch.testing.assert_close(got["logits"], forward_tokens(model, PROMPTS[0], 0, None), atol=1e-4, rtol=1e-4)
        assert got["outputs"] == expected
        assert got["all_reduces"] > 0 and got["all_reduces"] % (2 * model.config.n_layers) == 0  # two per layer
    # each rank holds half the query heads and half the KV heads; MQA's one KV head is replicated on both
    assert got["heads"] == model.config.n_heads // 2 and got["kv_heads"] == max(1, model.config.n_kv_heads // 2)
    projections = sum(p.nbytes for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() == 2)
    replicated_kv = (got["kv_heads"] * 2 - model.config.n_kv_heads) * 2 * model.config.head_dim \
        * model.config.d_model * 4 * model.config.n_layers  # the k and v rows both ranks hold
    assert got["weight_bytes"] == parameter_bytes(model) - projections // 2 + replicated_kv // 2


def test_a_rank_that_raises_stops_every_rank(tmp_path):
    with pytest.raises(RankError, match="rank 1 of 2 raised(.|\n)*rank one cannot go on"):
        launch(parallel_ranks.raise_on_rank_one, 2, (str(tmp_path),), timeout_s=60)
    assert _all_gone(_pids(tmp_path), within_s=0)


def test_a_rank_that_hangs_or_dies_is_caught(tmp_path):
    for folder in ("hang", "exit"):
        (tmp_path / folder).mkdir()
    with pytest.raises(RankError, match=r"ranks \[(0, )?1\] of 2 did not finish"):  # rank 0 too, if slow to start
        launch(parallel_ranks.hang_on_rank_one, 2, (str(tmp_path / "hang"),), timeout_s=10)
    with pytest.raises(RankError, match="rank 1 of 2 died \\(exit code 7\\)"):
        launch(parallel_ranks.exit_on_rank_one, 2, (str(tmp_path / "exit"),), timeout_s=60)
    assert _all_gone(_pids(tmp_path / "hang") + _pids(tmp_path / "exit"), within_s=0)


def test_a_rank_that_dies_is_named_before_the_error_it_caused_another_to_raise():
    """Rank 1 dies during the group's start; rank 0's report of the closed connection reaches the
    launcher before it sees the death (the order a faster machine gave): the death is named first."""
    import queue

    from labkit.parallel.launch import _collect

    class Process:
        def __init__(self, exitcode):
            self.exitcode = exitcode

        def join(self, timeout=None):
            pass

        def is_alive(self):
            return self.exitcode is None

    reports = queue.Queue()
    reports.put((0, False, "RuntimeError: Gloo connectFullMesh failed ... Connection closed by peer"))
    with pytest.raises(RankError, match=r"rank 1 of 2 died \(exit code 7\) before it reported; then rank 0 of 2 "
                                        r"raised:\nRuntimeError: Gloo connectFullMesh failed"):
        _collect([Process(None), Process(7)], reports, time.monotonic() + 60)
    reports.put((0, False, "ValueError: its own mistake"))
    with pytest.raises(RankError, match=r"^rank 0 of 2 raised:\nValueError: its own mistake$"):
        _collect([Process(None), Process(None)], reports, time.monotonic() + 60)  # no death: the error alone


def test_ranks_end_when_their_starter_is_killed(tmp_path):
    """A notebook kernel killed or restarted mid-run: its ranks end themselves."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import parallel_ranks; "
            f"from labkit.parallel import launch; launch(parallel_ranks.sleep_forever, 2, ({str(tmp_path)!r},), "
            "timeout_s=300)")
    starter = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / str(r)).exists() for r in range(2)):
            assert starter.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
        pids = _pids(tmp_path)
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        starter.kill()
        starter.wait()
        assert _all_gone(pids, within_s=10)
    finally:
        starter.kill()


def test_a_rank_runs_with_its_starters_environment_as_it_is_at_the_launch(monkeypatch):
    """Ranks fork from a server started at the first launch: a variable set after it still reaches them."""
    launch(parallel_ranks.environment_variable, 2, ("LABKIT_RANK_TEST",), timeout_s=60)  # the server runs now
    monkeypatch.setenv("LABKIT_RANK_TEST", "set after the first launch")
    assert launch(parallel_ranks.environment_variable, 2, ("LABKIT_RANK_TEST",), timeout_s=60) == \
        "set after the first launch"


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
    for prompts, new_tokens, world_size, message in [
            ([], 4, 2, r"there must be a prompt \(got 0\)"), ([[1, 10**6]], 4, 2, "outside the vocabulary"),
            (torch.tensor([[1, 2]]), 4, 2, "not a tensor"),
            (PROMPTS, 0, 2, "new_tokens=0 must be at least 1"), (PROMPTS, 4, 2.0, "world_size=2.0 must be an int")]:
        with pytest.raises(ValueError, match=message):  # each before any rank starts
            tensor.generate("gqa", prompts, new_tokens, world_size=world_size)


def test_a_prompt_at_the_context_limit_passes_the_check_and_runs_through_both_caches():
    """The longest prompt the check lets through fits the ranks' caches too (the last token is never fed)."""
    config, new_tokens = load("gqa", device="cpu")[0].config, 2
    prompt = [1, 2] * ((config.max_seq_len - new_tokens + 1) // 2) + [3] * ((config.max_seq_len - new_tokens + 1) % 2)
    runs = [tensor.generate("gqa", [prompt], new_tokens, world_size=2, cache=cache, timeout_s=120)
            for cache in ("contiguous", "paged")]
    assert runs[0]["outputs"] == runs[1]["outputs"] and len(runs[0]["outputs"][0]) == new_tokens


def test_shard_heads_keep_every_query_head_with_its_kv_head():
    for heads, kv, world in [(8, 8, 2), (8, 2, 2), (8, 2, 4), (8, 1, 2), (8, 1, 8), (12, 4, 4)]:
        group, owned = heads // kv, []
        for rank in range(world):
            queries, kvs = shard_heads(heads, kv, rank, world)
            assert len(queries) == heads // world and len(kvs) == max(1, kv // world)
            for h in queries:
                assert h // group in kvs, (heads, kv, world, rank, h)
            owned += queries
        assert sorted(owned) == list(range(heads))  # each query head on exactly one rank


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


def test_times_that_fall_with_the_size_give_no_bandwidth():
    with pytest.raises(ValueError, match="do not grow"):
        fit_line([64, 256, 1024], [3e-4, 2e-4, 1e-4])


def test_measure_times_each_size_on_two_ranks_and_fits_links():
    sizes = (64, 16 * 2**20)
    result = comm.measure(2, sizes=sizes, repeats=3, backend="gloo", timeout_s=120)
    assert result["sizes"] == list(sizes) and result["world_size"] == 2 and result["backend"] == "gloo"
    for key in ("allreduce_s", "send_s"):
        assert len(result[key]) == 2 and result[key][0] > 0 and result[key][1] > result[key][0]
    assert result["allreduce_link"].bandwidth > 0 and result["send_link"].latency_s >= 0
    assert result["send_fit_error"] is None


def test_send_times_that_give_no_line_are_said_and_the_all_reduce_link_still_fitted(monkeypatch):
    """A busy machine can bend the send times' line (seen at 2 of 6 re-runs of notebook 10): the measurement is kept,
    the send's fit is None with the reason, and the all-reduce's link, which the lab's predictions use, stands."""
    def timed(rank, sizes, repeats):
        return {"sizes": list(sizes), "allreduce_s": [1e-5 * (1 + n / 1e5) for n in sizes], "world_size": 2,
                "send_s": [1e-4 * (len(sizes) - i) for i in range(len(sizes))], "backend": "gloo"}
    monkeypatch.setattr(comm, "launch", lambda fn, world, args, *rest: timed(None, *args))
    result = comm.measure(2, sizes=(64, 4096, 2**20), repeats=1)
    assert result["send_link"] is None and result["allreduce_link"].bandwidth > 0
    assert result["send_fit_error"].startswith("one-way send: the times do not grow with the message size")
