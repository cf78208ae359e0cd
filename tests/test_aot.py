"""Decode steps compiled ahead of time (``labkit.aot``): the eager logits from the model's own
weights into its own cache, a package reused or rebuilt, and clear refusals."""
from __future__ import annotations

import shutil

import pytest
import torch

from labkit import aot
from labkit.compile import eager_step
from labkit.model import ModelConfig, Transformer
from labkit.static_cache import StaticKVCache

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=512)
BATCH, LENGTH = 2, 32


def _model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(CONFIG).eval()


def _cache() -> StaticKVCache:
    return StaticKVCache(CONFIG, BATCH, LENGTH)


def _steps():
    """Four decode steps of two rows, the second row padding from its third step on."""
    for p in range(4):
        yield torch.tensor([[p + 1], [p + 7]]), torch.tensor([[p], [p if p < 2 else -1]])


def _padding() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([[3], [5]])
    return tokens, torch.full_like(tokens, -1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("aot")


@pytest.fixture(scope="module")
def built(folder):
    model = _model(0)
    return model, aot.aot_step(model, _cache(), folder)


def test_the_step_gives_the_eager_logits_and_writes_its_own_cache(built):
    model, step = built
    assert isinstance(step, aot.AOTStep) and not step.from_disk and step.build_s > 0
    eager_cache = _cache()
    eager = eager_step(model, eager_cache)
    for tokens, positions in _steps():
        torch.testing.assert_close(step(tokens, positions), eager(tokens, positions), rtol=1e-5, atol=1e-5)
    mine = step.module.layout
    for written, expected in zip(mine.k + mine.v, eager_cache.k + eager_cache.v):
        assert written[:, :, :2].abs().sum() > 0  # slots the steps wrote
        torch.testing.assert_close(written[:, :, :LENGTH], expected[:, :, :LENGTH], rtol=1e-5, atol=1e-5)


def test_a_model_of_the_same_shapes_loads_the_package_and_computes_with_its_own_weights(built, folder):
    other = _model(1)
    step = aot.aot_step(other, _cache(), folder)
    assert step.from_disk and step.path == built[1].path
    eager = eager_step(other, _cache())
    for tokens, positions in _steps():
        torch.testing.assert_close(step(tokens, positions), eager(tokens, positions), rtol=1e-5, atol=1e-5)


def test_a_weight_updated_in_place_is_seen(folder):
    model = _model(2)
    step = aot.aot_step(model, _cache(), folder)
    before = step(*_padding()).clone()
    with torch.no_grad():
        model.norm.weight.mul_(2)
    after = step(*_padding())
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, eager_step(model, _cache())(*_padding()), rtol=1e-5, atol=1e-5)


class Doubled(Transformer):
    """The same modules, config and printout as a Transformer, other logits: a change the package's
    key cannot see."""

    def forward(self, *args, **kwargs):
        return 2 * super().forward(*args, **kwargs)


Doubled.__name__ = "Transformer"


def test_a_package_that_disagrees_with_the_eager_step_is_built_again(built, tmp_path):
    shutil.copy(built[1].path, tmp_path)
    torch.manual_seed(0)
    doubled = Doubled(CONFIG).eval()
    assert aot.package_key(doubled, _cache()) == built[1].path.stem
    step = aot.aot_step(doubled, _cache(), tmp_path)
    assert isinstance(step, aot.AOTStep) and not step.from_disk
    tokens, positions = _padding()
    torch.testing.assert_close(step(tokens, positions), eager_step(doubled, _cache())(tokens, positions),
                               rtol=1e-5, atol=1e-5)
    assert [p.name for p in tmp_path.iterdir()] == [built[1].path.name]  # no partial file left


def test_other_shapes_and_dtypes_are_refused_naming_the_ones_compiled_for(built):
    step = built[1]
    with pytest.raises(ValueError, match=r"compiled for tokens of shape \(2, 1\), int64; got \(1, 1\)"):
        step(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"positions .* got \(2, 1\), torch.int32"):
        step(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.int32))


def test_the_key_holds_what_the_package_depends_on_and_not_the_weights():
    key = aot.package_key(_model(0), _cache())
    assert aot.package_key(_model(1), _cache()) == key
    assert aot.package_key(_model(0), StaticKVCache(CONFIG, 1, LENGTH)) != key
    assert aot.package_key(_model(0), StaticKVCache(CONFIG, BATCH, 2 * LENGTH)) != key
    assert aot.package_key(_model(0).to(torch.float64), StaticKVCache(CONFIG, BATCH, LENGTH, torch.float64)) != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert aot.package_key(_model(0), _cache()) != key  # a library built for one thread has no parallel loops
    finally:
        torch.set_num_threads(threads)


def test_a_gpu_model_is_refused_pointing_to_cuda_graphs():
    with pytest.raises(ValueError, match="compiles for a CPU; on meta use CUDA graphs"):
        aot.aot_step(Transformer(CONFIG).to("meta"), _cache())


def test_without_a_compiler_the_step_runs_eagerly_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(aot, "compiler_problem", lambda device: "no C++ compiler was found")
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        step = aot.aot_step(_model(0), _cache(), tmp_path)
    assert not isinstance(step, aot.AOTStep)
    torch.testing.assert_close(step(*_padding()), eager_step(_model(0), _cache())(*_padding()))


def test_a_failed_build_runs_eagerly_and_says_why(monkeypatch, tmp_path):
    def fail(module, path):
        raise RuntimeError("the linker ran out of disk")
    monkeypatch.setattr(aot, "_export_and_compile", fail)
    with pytest.warns(UserWarning, match="compiling ahead of time failed, so the step runs eagerly: "
                                         "RuntimeError: the linker ran out of disk"):
        step = aot.aot_step(_model(0), _cache(), tmp_path)
    assert not isinstance(step, aot.AOTStep) and not list(tmp_path.iterdir())
