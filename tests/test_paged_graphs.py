"""The engine's graphed decode step: the static step gives the eager step's logits (checked
eagerly on any device), and an engine with CUDA graphs gives every request the same tokens."""
from __future__ import annotations

import pytest
import torch

from labkit.engine import Engine, Request, SchedulerConfig
from labkit.generate import SamplingParams
from labkit.model import ModelConfig, Transformer
from labkit.paged import BlockAllocator, PagedKVCache, step_logits
from labkit.paged_attention import paged_attention
from labkit.paged_graphs import PagedGraphs, StaticPagedDecode

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64)


def _model(device: str = "cpu") -> Transformer:
    """float64, logits far apart (std 0.3): greedy choices are never near ties, so two attention
    paths that round differently still pick the same tokens."""
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    model.reset_parameters(std=0.3)
    return model.to(device, torch.float64).eval()


def _prefilled(model: Transformer, prompts: list[list[int]]) -> PagedKVCache:
    cache = PagedKVCache(CONFIG, BlockAllocator(16, 4), model.dtype, model.device, spare_block=True)
    for i, prompt in enumerate(prompts):
        cache.allocator.add_sequence(i, prompt)
        step_logits(model, cache, [(i, 0, len(prompt))], prompt)
        cache.allocator.mark_computed(i, prompt)
        cache.append(i, 1)
    return cache


def test_the_static_step_gives_the_eager_logits_and_padding_writes_the_spare_block():
    model, prompts = _model(), [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
    cache = _prefilled(model, prompts)
    runs, tokens = [(i, len(p), 1) for i, p in enumerate(prompts)], [20, 21, 22]
    before = cache.k.clone()
    static = StaticPagedDecode(model, cache, rows=4)
    static.load(runs, tokens)
    with torch.inference_mode():
        got = static.forward()[:3]
    written = (cache.k != before).flatten(2).any(-1)  # [layers, blocks]: which blocks changed
    assert written[:, -1].all(), "the padding row did not write to the spare block"
    cache.k.copy_(before)
    torch.testing.assert_close(got, step_logits(model, cache, runs, tokens), rtol=1e-5, atol=1e-5)


def test_the_static_step_needs_a_spare_block_and_refuses_what_it_cannot_run():
    model = _model()
    with pytest.raises(ValueError, match="spare_block=True"):
        StaticPagedDecode(model, PagedKVCache(CONFIG, BlockAllocator(4, 4), model.dtype), rows=2)
    static = StaticPagedDecode(model, _prefilled(model, [[1, 2]]), rows=1)
    with pytest.raises(ValueError, match="one token for each of at most 1"):
        static.load([(0, 2, 1), (0, 2, 1)], [3, 4])
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA GPU"):
        PagedGraphs(model, _prefilled(model, [[1, 2]]), 4)
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA GPU"):
        Engine(model, num_blocks=8, block_size=4, use_cuda_graphs=True)
    with pytest.raises(ValueError, match="paged_attention' cannot run in a CUDA graph"):
        Engine(model, num_blocks=8, block_size=4, decode_kernel=paged_attention, use_cuda_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_an_engine_with_cuda_graphs_gives_every_request_its_tokens():
    model = _model("cuda")
    def requests():
        return [Request(i, [1 + i, 2, 3 + i] * (i + 1), SamplingParams(max_new_tokens=12 + i, stop_at_eos=False))
                for i in range(6)]
    config = SchedulerConfig(max_num_seqs=5)
    eager = Engine(model, num_blocks=40, block_size=4, config=config).run(requests())
    graphed = Engine(model, num_blocks=40, block_size=4, config=config, use_cuda_graphs=True).run(requests())
    assert [r.output for r in graphed] == [r.output for r in eager]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graphs_through_the_triton_decode_kernel_give_the_same_tokens():
    from labkit.kernels import paged_decode
    model = _model("cuda").float()  # the kernel takes fp32, bf16 and fp16
    def requests():
        return [Request(i, [5 + i, 6, 7] * (i + 2), SamplingParams(max_new_tokens=10, stop_at_eos=False))
                for i in range(5)]
    config = SchedulerConfig(max_num_seqs=4)
    eager = Engine(model, 40, 4, config, decode_kernel=paged_decode).run(requests())
    graphed = Engine(model, 40, 4, config, decode_kernel=paged_decode, use_cuda_graphs=True).run(requests())
    assert [r.output for r in graphed] == [r.output for r in eager]
