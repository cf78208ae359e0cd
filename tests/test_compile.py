"""Compiled and CUDA-graphed decode steps: the same logits and tokens as eager, or a clear refusal."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from labkit import compile as compiling
from labkit.cuda_graphs import BucketedGraphs, GraphedStep, bucket_for, buckets, pad_to_bucket, repeated
from labkit.generate import SamplingParams, stream
from labkit.model import ModelConfig, Transformer
from labkit.static_cache import StaticKVCache

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=512)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def _model(device: str = "cpu") -> Transformer:
    torch.manual_seed(0)
    return Transformer(CONFIG).to(device).eval()


@pytest.fixture(scope="module")
def model() -> Transformer:
    return _model()


def test_the_compiled_step_gives_the_eager_logits(model):
    step = compiling.compile_step(model, StaticKVCache(CONFIG, 2, 32))
    assert isinstance(step, compiling.CompiledStep) and step.compile_s > 0
    assert step.built_from in ("code generated", "Inductor's disk cache"), step.built_from  # as the runs before left it
    assert compiling.compile_step(model, StaticKVCache(CONFIG, 2, 32)).built_from == "this process"
    eager = compiling.eager_step(model, StaticKVCache(CONFIG, 2, 32))
    for p in range(4):
        tokens, positions = torch.tensor([[p + 1], [p + 7]]), torch.tensor([[p], [p if p < 2 else -1]])
        torch.testing.assert_close(step(tokens, positions), eager(tokens, positions), rtol=1e-5, atol=1e-5)


def test_inductors_start_up_is_paid_by_a_function_of_its_own():
    from torch._dynamo.utils import counters
    before = counters["stats"]["unique_graphs"]
    assert compiling.inductor_start_up(torch.device("cpu")) > 0
    assert counters["stats"]["unique_graphs"] == before + 1  # it compiled one graph, its own


def test_each_set_of_shapes_gets_a_compiled_function_of_its_own(model):
    """TorchDynamo's recompile limit counts per function, and with fullgraph=True reaching it raises:
    shapes must not share one function."""
    def function_for(batch, length):
        return compiling._compiled_decode(model, StaticKVCache(CONFIG, batch, length), None)
    assert function_for(1, 256) is function_for(1, 256)
    assert len({id(function_for(b, n)) for b in (1, 2) for n in (256, 512)}) == 4


def test_a_llama3_config_with_rope_scaling_gets_its_compiled_function():
    """Llama-3's rope_scaling is a dict: the compiled functions' key must still hash."""
    config = dataclasses.replace(CONFIG, rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 128})
    llama3 = Transformer(config).eval()
    function = compiling._compiled_decode(llama3, StaticKVCache(config, 1, 256), None)
    assert function is compiling._compiled_decode(llama3, StaticKVCache(config, 1, 256), None)


def test_compiled_generation_is_the_eager_generation(model, monkeypatch):
    from labkit import generate

    made, real = [], generate.static_decoder
    monkeypatch.setattr(generate, "static_decoder", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    params = SamplingParams(max_new_tokens=20, stop_at_eos=False)
    assert list(stream(model, [3, 4, 5], params, compiled=True)) == list(stream(model, [3, 4, 5], params))
    assert [type(step) for _, step in made] == [compiling.CompiledStep]  # compiled: not the eager fallback


def test_without_a_compiler_the_step_runs_eagerly_and_says_why(model, monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    assert "no C++ compiler was found" in compiling.compiler_problem("cpu")
    assert compiling.compiler_problem("meta") is None  # a GPU compiles with Triton, not with a C++ compiler
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        step = compiling.compile_step(model, StaticKVCache(CONFIG, 1, 8))
    assert not isinstance(step, compiling.CompiledStep)
    assert step(torch.tensor([[1]]), torch.tensor([[0]])).shape == (1, 1, 64)


def test_a_static_step_refuses_a_cache_of_its_own(model):
    with pytest.raises(ValueError, match="brings its own static cache"):
        list(stream(model, [1, 2], SamplingParams(max_new_tokens=2), compiled=True, use_cache=False))


def test_buckets_and_padding():
    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(20) == [1, 2, 4, 8, 16, 32]
    assert [bucket_for(n, buckets(40)) for n in (1, 3, 5, 9, 17, 33)] == [1, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError, match="a batch of 9 rows has no bucket"):
        bucket_for(9, [1, 2, 4, 8])
    tokens, positions = pad_to_bucket(torch.tensor([[5], [6], [7]]), torch.tensor([[3], [9], [0]]), 4)
    assert tokens.tolist() == [[5], [6], [7], [0]] and positions.tolist() == [[3], [9], [0], [-1]]
    with pytest.raises(ValueError, match="3 rows do not fit a bucket of 2"):
        pad_to_bucket(tokens[:3], positions[:3], 2)


def test_cuda_graphs_on_a_cpu_say_they_need_cuda(model):
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA GPU"):
        GraphedStep(model, StaticKVCache(CONFIG, 1, 8))
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA GPU"):
        compiling.graphed_compiled_step(model, StaticKVCache(CONFIG, 1, 8))
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA GPU"):
        list(stream(model, [1, 2], SamplingParams(max_new_tokens=2), use_cuda_graphs=True))


def test_repeated_calls_refuse_none_and_a_cpu():
    with pytest.raises(ValueError, match="calls=0: a graph of no calls times nothing"):
        repeated(lambda: None, 0, torch.device("cuda"))
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA GPU"):
        repeated(lambda: None, 3, torch.device("cpu"))


@needs_cuda
def test_repeated_replays_every_call():
    count = torch.zeros(1, device="cuda")
    replay = repeated(lambda: count.add_(1), 5, torch.device("cuda"))
    before = float(count)  # the warm-up runs and the recording
    replay()
    assert float(count) - before == 5


@needs_cuda
def test_a_graphed_step_replays_the_eager_step():
    model = _model("cuda")
    graphed = GraphedStep(model, StaticKVCache(CONFIG, 2, 32, device="cuda"))
    eager = compiling.eager_step(model, StaticKVCache(CONFIG, 2, 32, device="cuda"))
    for p in range(5):
        tokens, positions = torch.tensor([[p + 1], [p + 2]], device="cuda"), torch.tensor([[p], [p]], device="cuda")
        torch.testing.assert_close(graphed(tokens, positions).clone(), eager(tokens, positions), rtol=1e-4, atol=1e-4)


@needs_cuda
def test_a_compiled_step_recorded_by_hand_replays_the_eager_step():
    """It records what TorchDynamo compiled (a graph more), and replays the eager logits, a padding
    row (position -1) among them."""
    from torch._dynamo.utils import counters
    model = _model("cuda")
    before = counters["stats"]["unique_graphs"]
    graphed = compiling.graphed_compiled_step(model, StaticKVCache(CONFIG, 2, 32, device="cuda"))
    assert counters["stats"]["unique_graphs"] == before + 1
    eager = compiling.eager_step(model, StaticKVCache(CONFIG, 2, 32, device="cuda"))
    for p in range(5):
        tokens = torch.tensor([[p + 1], [p + 2]], device="cuda")
        positions = torch.tensor([[p], [p if p < 3 else -1]], device="cuda")
        torch.testing.assert_close(graphed(tokens, positions).clone(), eager(tokens, positions), rtol=1e-4, atol=1e-4)


@needs_cuda
def test_bucketed_graphs_serve_every_batch_size_and_generation_is_unchanged():
    model = _model("cuda")
    graphs = BucketedGraphs(model, max_batch=5, max_len=16)
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    for rows in (1, 3, 5):
        eager = compiling.eager_step(model, StaticKVCache(CONFIG, rows, 16, device="cuda"))
        tokens = torch.arange(1, rows + 1, device="cuda")[:, None]
        positions = torch.zeros(rows, 1, dtype=torch.long, device="cuda")
        torch.testing.assert_close(graphs(tokens, positions).clone(), eager(tokens, positions), rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_new_tokens=20, stop_at_eos=False)
    expected = list(stream(model, [3, 4, 5], params))
    assert list(stream(model, [3, 4, 5], params, use_cuda_graphs=True)) == expected
    assert list(stream(model, [3, 4, 5], params, compiled=True)) == expected  # reduce-overhead: compiled + graphs


def test_a_compiled_draft_drafts_what_the_eager_draft_does(model):
    """The same rounds, drafted token for token, from a draft that agrees with the target often
    but not always (the target with noise added): rounds with some drafts rejected roll the
    draft's static cache back, which the comparison covers."""
    from labkit.speculative import ModelDrafter, SpeculationStats, speculative_stream
    draft = _model()
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    params = SamplingParams(max_new_tokens=40, stop_at_eos=False)
    rounds = {}
    for compiled in (False, True):
        stats, drafter = SpeculationStats(k=4), ModelDrafter(draft, compiled=compiled)
        list(speculative_stream(model, drafter, [3, 4, 5], params, k=4, stats=stats))
        rounds[compiled] = stats.rounds
    assert isinstance(drafter.step, compiling.CompiledStep)  # the second drafter compiled: not the eager fallback
    assert rounds[True] == rounds[False]
    assert any(0 < r.accepted < 4 for r in rounds[True]), "no round rolled back: the test would not cover it"
