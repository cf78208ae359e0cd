"""Decode steps compiled ahead of time (``labkit.aot``): the eager logits from the model's own
weights into its own cache, a package reused or rebuilt, and clear refusals."""
from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from labkit import aot
from labkit.compile import eager_step
from labkit.model import ModelConfig, Transformer
from labkit.static_cache import StaticKVCache

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=512,
                     tie_embeddings=True)  # as the lab's models: one tensor under two names
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


def _library_step(model: Transformer, cache: StaticKVCache, folder=None):
    """A step whose matrix products are the library's: it reads the model's own weights."""
    return aot.aot_step(model, cache, folder, products="library")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("aot")


@pytest.fixture(scope="module")
def built(folder):
    model = _model(0)
    return model, _library_step(model, _cache(), folder)


def test_the_step_gives_the_eager_logits_and_writes_its_own_cache(built):
    model, step = built
    assert isinstance(step, aot.AOTStep) and not step.from_disk and step.build_s > 0
    eager_cache = _cache()
    eager = eager_step(model, eager_cache)
    for tokens, positions in _steps():
        torch.testing.assert_close(step(tokens, positions), eager(tokens, positions), rtol=1e-5, atol=1e-5)
    mine = step.module.cache
    for written, expected in zip(mine.k + mine.v, eager_cache.k + eager_cache.v):
        assert written[:, :, :2].abs().sum() > 0  # slots the steps wrote
        torch.testing.assert_close(written[:, :, :LENGTH], expected[:, :, :LENGTH], rtol=1e-5, atol=1e-5)


def test_a_build_leaves_a_filled_cache_as_it_was_and_decodes_after_an_eager_prefill(built, folder):
    """What benchmarks/compile.py does: prefill eagerly into the static cache, then decode compiled
    ahead of time; the build's check must not disturb what the prefill wrote."""
    model = built[0]
    cache, reference = _cache(), _cache()
    prompt = torch.tensor([[5, 9, 2], [7, 1, 3]])
    for c in (cache, reference):
        forward = model(prompt, plan=c.plan(torch.arange(3).expand(2, 3)))
    before = [t.clone() for t in cache.k + cache.v]
    step = _library_step(model, cache, folder)
    assert step.from_disk and all(torch.equal(a, b) for a, b in zip(cache.k + cache.v, before))
    eager = eager_step(model, reference)
    tokens = forward[:, -1:].argmax(-1)
    for position in range(3, 7):
        positions = torch.full_like(tokens, position)
        logits = step(tokens, positions)
        torch.testing.assert_close(logits, eager(tokens, positions), rtol=1e-5, atol=1e-5)
        tokens = logits[:, -1:].argmax(-1)
    assert model.rope is built[0].rope and model.rope.dtype == torch.float32  # put back after the export


_KILLED_AFTER_LOADING = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from labkit import aot
from test_aot import _cache, _model
step = aot.aot_step(_model(0), _cache(), {folder!r}, products="library")
assert step.from_disk, "built again"
print(sorted(os.listdir(os.environ["TMPDIR"])), flush=True)  # what the load left
os.kill(os.getpid(), signal.SIGKILL)  # as a notebook's kernel is stopped: no destructor runs
"""


def test_loading_leaves_no_unpacked_package_behind_even_in_a_process_killed_after(built, folder, tmp_path):
    """torch's loader unpacks a package into a temporary folder that it removes only with its runner;
    a process killed while holding a step (a notebook's kernel, stopped) used to leave it behind."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    code = _KILLED_AFTER_LOADING.format(tests=os.path.dirname(__file__), folder=str(folder))
    ran = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(temporary)},
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == -9, ran.stderr[-2000:]
    left = [name for name in os.listdir(temporary) if name.startswith(("aotinductor_", "labkit_aot_"))]
    assert ran.stdout.startswith("[") and left == [], (ran.stdout, left)


def test_tied_embeddings_are_read_under_both_names(folder):
    model = _model(4)
    step = _library_step(model, _cache(), folder)
    assert step.from_disk and model.lm_head.weight is model.embed.weight
    with torch.no_grad():
        model.embed.weight.mul_(3)  # the LM head too: one tensor
    torch.testing.assert_close(step(*_padding()), eager_step(model, _cache())(*_padding()), rtol=1e-5, atol=1e-5)


def test_a_model_of_the_same_shapes_loads_the_package_and_computes_with_its_own_weights(built, folder):
    other = _model(1)
    step = _library_step(other, _cache(), folder)
    assert step.from_disk and step.path == built[1].path
    eager = eager_step(other, _cache())
    for tokens, positions in _steps():
        torch.testing.assert_close(step(tokens, positions), eager(tokens, positions), rtol=1e-5, atol=1e-5)


def test_a_weight_updated_in_place_is_seen(folder):
    model = _model(2)
    step = _library_step(model, _cache(), folder)
    before = step(*_padding()).clone()
    with torch.no_grad():
        model.norm.weight.mul_(2)
    after = step(*_padding())
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, eager_step(model, _cache())(*_padding()), rtol=1e-5, atol=1e-5)


def _no_builds(monkeypatch):
    def fail(module, path):
        raise RuntimeError("no build in this test")
    monkeypatch.setattr(aot, "_export_and_compile", fail)


def test_a_package_whose_attention_disagrees_with_the_eager_step_is_removed(built, tmp_path, monkeypatch):
    """Code the key cannot see changed attention alone: the build's check must run attention on
    keys and values that are not zeros to notice."""
    shutil.copy(built[1].path, tmp_path)
    from labkit import static_cache
    attention = static_cache.attention
    monkeypatch.setattr(static_cache, "attention", lambda *args: 2 * attention(*args))
    _no_builds(monkeypatch)
    with pytest.warns(UserWarning, match="no build in this test"):
        step = _library_step(_model(0), _cache(), tmp_path)
    assert not isinstance(step, aot.AOTStep) and not list(tmp_path.iterdir())


def test_a_corrupt_package_is_removed_not_loaded(tmp_path, monkeypatch):
    path = tmp_path / f"{aot.package_key(aot.DecodeModule(_model(0), _cache()))}.pt2"
    path.write_bytes(b"PK\x03\x04 cut short")
    _no_builds(monkeypatch)
    with pytest.warns(UserWarning, match="no build in this test"):
        _library_step(_model(0), _cache(), tmp_path)
    assert not path.exists()


def test_a_weight_given_new_memory_makes_the_step_refuse(folder):
    model = _model(3)
    step = _library_step(model, _cache(), folder)
    step(*_padding())
    model.norm.weight.data = model.norm.weight.data.clone()
    with pytest.raises(RuntimeError, match="new memory since it was built .* build the step again"):
        step(*_padding())
    model = _model(3)
    step = _library_step(model, _cache(), folder)
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match="new memory"):
        step(*_padding())


def test_inputs_that_are_not_contiguous_give_the_right_logits(built):
    model, step = built
    sequence = torch.tensor([[1, 2, 3], [4, 5, 6]])
    tokens, positions = sequence[:, -1:], torch.tensor([[0, 0, 0], [0, 0, 0]])[:, :1]
    assert not tokens.is_contiguous()
    eager = eager_step(model, _cache())(tokens.contiguous(), positions.contiguous())
    torch.testing.assert_close(step(tokens, positions), eager, rtol=1e-5, atol=1e-5)


def test_other_shapes_and_dtypes_are_refused_naming_the_ones_compiled_for(built):
    step = built[1]
    with pytest.raises(ValueError, match=r"compiled for tokens of shape \(2, 1\), int64, on the CPU; got \(1, 1\)"):
        step(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"positions .* got \(2, 1\), torch.int32"):
        step(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.int32))


def _key(model: Transformer, cache: StaticKVCache, products: str = "library") -> str:
    return aot.package_key(aot.DecodeModule(model, cache, products))


def test_the_key_holds_what_the_package_depends_on_and_not_the_weights():
    key = _key(_model(0), _cache())
    assert _key(_model(1), _cache()) == key
    assert _key(_model(0), StaticKVCache(CONFIG, 1, LENGTH)) != key
    assert _key(_model(0), StaticKVCache(CONFIG, BATCH, 2 * LENGTH)) != key
    assert _key(_model(0).to(torch.float64), StaticKVCache(CONFIG, BATCH, LENGTH, torch.float64)) != key
    assert _key(_model(0), StaticKVCache(CONFIG, BATCH, LENGTH, torch.bfloat16)) != key  # the cache's dtype
    transposed = _model(0)
    weight = transposed.blocks[0].attn.wqkv.weight
    flipped = weight.data.contiguous() if not weight.is_contiguous() else weight.data.t().contiguous().t()
    weight.data = flipped  # the same values in the other memory order: other strides
    assert _key(transposed, _cache()) != key
    one_row = StaticKVCache(CONFIG, 1, LENGTH)
    assert _key(_model(0), one_row, "generated") != _key(_model(0), one_row)  # and the products
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert _key(_model(0), _cache()) != key  # a library built for one thread has no parallel loops
    finally:
        torch.set_num_threads(threads)


def test_a_gpu_model_is_refused_pointing_to_cuda_graphs():
    with pytest.raises(ValueError, match="compiles for a CPU; on meta use CUDA graphs"):
        aot.aot_step(Transformer(CONFIG).to("meta"), _cache())


def test_without_a_compiler_the_step_runs_eagerly_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(aot, "compiler_problem", lambda device: "no C++ compiler was found")
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        step = _library_step(_model(0), _cache(), tmp_path)
    assert not isinstance(step, aot.AOTStep)
    torch.testing.assert_close(step(*_padding()), eager_step(_model(0), _cache())(*_padding()))


def test_a_failed_build_runs_eagerly_and_says_why(monkeypatch, tmp_path):
    def fail(module, path):
        path.write_bytes(b"half a package")
        raise RuntimeError("the linker ran out of disk")
    monkeypatch.setattr(aot, "_export_and_compile", fail)
    with pytest.warns(UserWarning, match="compiling ahead of time failed, so the step runs eagerly: "
                                         "RuntimeError: the linker ran out of disk"):
        step = _library_step(_model(0), _cache(), tmp_path)
    assert not isinstance(step, aot.AOTStep) and not list(tmp_path.iterdir())


def test_the_folder_keeps_the_packages_used_last(tmp_path, monkeypatch):
    for age, name in enumerate(["new", "old", "older"]):
        (tmp_path / f"{name}.pt2").write_bytes(b"")
        os.utime(tmp_path / f"{name}.pt2", (1e9 - age, 1e9 - age))
    (tmp_path / "x.123.partial.pt2").write_bytes(b"")  # another process's build in progress
    monkeypatch.setattr(aot, "KEEP", 2)
    aot._prune(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.pt2", "old.pt2", "x.123.partial.pt2"]


def test_a_draft_compiled_ahead_of_time_drafts_what_the_eager_draft_does():
    """The same rounds, token for token, from a draft that agrees with the target often but not
    always, and one build for two generations (the drafter keeps its cache and step)."""
    from labkit.generate import SamplingParams
    from labkit.speculative import ModelDrafter, SpeculationStats, speculative_stream
    untied = dataclasses.replace(CONFIG, tie_embeddings=False)  # tied, this tiny model's drafts all pass or all fail
    torch.manual_seed(0)
    target = Transformer(untied).eval()
    draft = copy.deepcopy(target)  # the target's weights, then noise
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    params = SamplingParams(max_new_tokens=30, stop_at_eos=False)
    drafters = {"eager": ModelDrafter(draft), "ahead of time": ModelDrafter(draft, ahead_of_time=True)}
    rounds = {}
    for label, drafter in drafters.items():
        stats = SpeculationStats(k=4)
        for prompt in ([3, 4, 5], [9, 8]):
            list(speculative_stream(target, drafter, prompt, params, k=4, stats=stats))
        rounds[label] = stats.rounds
    step = drafters["ahead of time"].step
    assert isinstance(step, aot.AOTStep) and rounds["ahead of time"] == rounds["eager"]
    assert any(0 < r.accepted < 4 for r in rounds["eager"]), "no round rolled back: the test would not cover it"


def _one_row() -> StaticKVCache:
    return StaticKVCache(CONFIG, 1, LENGTH)


def _library_products(path) -> int:
    """How many calls into the library's matrix product the package's C++ makes."""
    with zipfile.ZipFile(path) as package:
        return sum(package.read(name).decode().count("aoti_torch_cpu_mm_out")
                   for name in package.namelist() if name.endswith(".cpp"))


@pytest.fixture(scope="module")
def one_row(folder):
    """A model's one-row step with generated products, then the default's choice (which loads that
    package and builds the library's)."""
    model = _model(0)
    return model, aot.aot_step(model, _one_row(), folder, products="generated"), aot.aot_step(model, _one_row(), folder)


def test_generated_products_replace_every_library_product_and_give_the_eager_logits(one_row, folder):
    model, step, _ = one_row
    assert isinstance(step, aot.AOTStep) and step.products == "generated"
    eager = eager_step(model, _one_row())
    for p in range(4):
        tokens, positions = torch.tensor([[p + 1]]), torch.tensor([[p]])
        torch.testing.assert_close(step(tokens, positions), eager(tokens, positions), rtol=1e-5, atol=1e-5)
    library = folder / f"{aot.package_key(aot.DecodeModule(model, _one_row()))}.pt2"
    assert _library_products(step.path) == 0 and _library_products(library) == CONFIG.n_layers * 4 + 1
    wqkv = model.blocks[0].attn.wqkv.weight
    copy = getattr(step.module, step.module.by_rows["blocks.0.attn.wqkv.weight"])
    assert wqkv.stride() != copy.stride() == (wqkv.shape[1], 1) and torch.equal(copy, wqkv)


def test_faster_times_both_kinds_on_one_row_and_keeps_the_library_on_several(one_row, folder):
    model, _, step = one_row
    assert isinstance(step, aot.AOTStep) and set(step.timings) == set(aot.PRODUCTS) and step.build_s > 0
    torch.testing.assert_close(step(torch.tensor([[3]]), torch.tensor([[0]])),
                               eager_step(model, _one_row())(torch.tensor([[3]]), torch.tensor([[0]])),
                               rtol=1e-5, atol=1e-5)
    several = aot.aot_step(model, _cache(), folder)
    assert several.products == "library" and not several.timings


def test_a_generated_step_refuses_once_a_weight_it_copied_has_changed(one_row, folder):
    for change in ("in place", "new memory"):
        model = _model(5)
        step = aot.aot_step(model, _one_row(), folder, products="generated")
        assert step.from_disk  # the shapes of one_row's: its package
        step(torch.tensor([[3]]), torch.tensor([[0]]))
        weight = model.blocks[1].mlp.down.weight
        with torch.no_grad():
            if change == "in place":
                weight.mul_(2)
            else:
                weight.data = weight.data.clone()
        with pytest.raises(RuntimeError, match="holds a copy of .* updated in place or given new memory"):
            step(torch.tensor([[3]]), torch.tensor([[0]]))


def test_faster_keeps_the_kind_that_builds_and_says_why_the_other_did_not(one_row, folder, tmp_path, monkeypatch):
    model = one_row[0]
    shutil.copy(folder / f"{aot.package_key(aot.DecodeModule(model, _one_row()))}.pt2", tmp_path)  # the library's
    def fail(module, path):
        raise RuntimeError("the generated loop did not compile")
    monkeypatch.setattr(aot, "_export_and_compile", fail)
    with pytest.warns(UserWarning, match=r"failed with one kind of products, so the step keeps the library products: "
                                         r"RuntimeError: the generated loop did not compile \(generated products\)"):
        step = aot.aot_step(model, _one_row(), tmp_path)
    assert isinstance(step, aot.AOTStep) and step.products == "library" and not step.timings


def test_unknown_products_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"products='fast': choose one of \('library', 'generated', 'faster'\)"):
        aot.aot_step(_model(0), _cache(), products="fast")
    with pytest.raises(ValueError, match=r"products='faster': choose one of \('library', 'generated'\)"):
        aot.DecodeModule(_model(0), _cache(), "faster")
    with pytest.raises(ValueError, match="generated products rewrite products of one row; this cache has 2 rows"):
        aot.aot_step(_model(0), _cache(), products="generated")


def test_faster_keeps_the_generated_step_only_when_it_is_faster_beyond_noise(monkeypatch):
    """_faster's choice, on made-up timings: quartiles apart, overlapping, and the other way."""
    from labkit.bench import Timing

    class Step:  # what _faster reads of a step: its kind, and a call it hands to alternate
        def __init__(self, products: str) -> None:
            self.products, self.timings = products, {}

        def __call__(self, *args) -> None:
            return None

    spread = lambda centre: tuple(centre * (1 + d) for d in (-0.02, -0.01, 0.0, 0.01, 0.02))
    for library_s, generated_s, kept in ((1.0, 0.5, "generated"), (1.0, 0.99, "library"), (0.5, 1.0, "library")):
        steps = [Step(kind) for kind in aot.PRODUCTS]
        fake = {"library": Timing("library", "cpu", spread(library_s)),
                "generated": Timing("generated", "cpu", spread(generated_s))}
        monkeypatch.setattr(aot, "alternate", lambda fns, **kwargs: fake)
        best = aot._faster(*steps)
        assert best.products == kept and best.timings == {"library": library_s, "generated": generated_s}
