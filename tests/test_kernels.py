"""The Triton kernels against PyTorch's scaled_dot_product_attention and the paged reference,
and the CPU's C++ paged decode operator against the same reference.

On this CPU the Triton kernels run in Triton's interpreter (``labkit.kernels`` sets
TRITON_INTERPRET=1 when torch sees no GPU), so the shapes are small; on a GPU the same tests run
compiled. The C++ operator is built on first use (about 10 s, then cached on disk).
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from labkit import kernels
from labkit.kernels import paged_decode_cpu as paged_decode_cpu_module
from labkit.kernels import tl, triton
from labkit.kernels.bounds import watched_loads
from labkit.kernels.paged_decode_cpu import paged_decode_cpu
from labkit.kernels.tiled import naive_attention
from labkit.model import ModelConfig, Transformer
from labkit.paged import BlockAllocator, PagedKVCache, generate_paged, step_logits
from labkit.paged_attention import paged_attention

DEVICE = "cpu" if kernels.interpreted() else "cuda"
# fp32 matmuls in a compiled kernel run on TF32 tensor cores (10-bit mantissa, like fp16's)
TOLERANCE = {torch.float32: 2e-5 if DEVICE == "cpu" else 2e-3, torch.float16: 2e-3}


def _qkv(batch, heads, kv_heads, n_queries, n_keys, dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n_queries, dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, n_keys, dim, generator=generator) for _ in range(2))
    return (x.to(DEVICE, dtype) for x in (q, k, v))


def _sdpa(q, k, v, causal):
    """PyTorch's attention in float64, each KV head repeated for its query heads; when causal,
    the queries are the last T of the S positions (bottom-right diagonal)."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    n_queries, n_keys = q.shape[2], k.shape[2]
    mask = torch.ones(n_queries, n_keys, dtype=torch.bool, device=q.device).tril(n_keys - n_queries)
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask if causal else None)


SHAPES = [  # batch, heads, kv_heads, T, S, head_dim, causal, dtype, block_m, block_n
    (1, 2, 2, 37, 37, 16, True, torch.float32, 16, 16),  # MHA, neither length a multiple of the tile
    (2, 4, 2, 50, 70, 48, True, torch.float32, 16, 32),  # GQA 2, prefill after a prefix, head dim not 2^k
    (1, 8, 1, 33, 33, 32, False, torch.float32, 32, 16),  # MQA, not causal
    (1, 4, 1, 17, 64, 64, False, torch.float16, 16, 16),  # fp16, T < S without a mask
    (2, 6, 2, 31, 31, 32, True, torch.float16, 32, 32),  # fp16, GQA 3, one row tile
    (1, 2, 1, 1, 23, 16, True, torch.float32, 16, 16),  # a single query: the decode case
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + f"-causal{s[6]}-{s[7]}")
def test_flash_attention_matches_sdpa(shape):
    *dims, causal, dtype, block_m, block_n = shape
    q, k, v = _qkv(*dims, dtype, seed=sum(dims))
    out = kernels.flash_attention(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), _sdpa(q, k, v, causal), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.skipif(DEVICE == "cpu", reason="the GPU's default tiles; the interpreter uses small ones")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
def test_flash_attention_with_the_default_gpu_tiles(dtype, dim):
    for n_queries, n_keys in ((300, 300), (200, 500)):
        q, k, v = _qkv(2, 8, 2, n_queries, n_keys, dim, dtype, seed=n_keys)
        out = kernels.flash_attention(q, k, v, causal=True)
        torch.testing.assert_close(out.double(), _sdpa(q, k, v, True), rtol=1e-2, atol=1e-2)


def test_flash_attention_random_shapes():
    generator = torch.Generator().manual_seed(0)
    for trial in range(3):
        kv_heads, group = (int(torch.randint(1, 3, (1,), generator=generator)) for _ in range(2))
        n_keys = int(torch.randint(1, 60, (1,), generator=generator))
        n_queries = int(torch.randint(1, n_keys + 1, (1,), generator=generator))
        causal = bool(trial % 2)
        q, k, v = _qkv(1, kv_heads * group, kv_heads, n_queries, n_keys, 16, torch.float32, seed=trial)
        out = kernels.flash_attention(q, k, v, causal=causal, block_m=16, block_n=16)
        torch.testing.assert_close(out.double(), _sdpa(q, k, v, causal), rtol=TOLERANCE[torch.float32],
                                   atol=TOLERANCE[torch.float32])


def test_flash_attention_reads_strided_inputs_and_scales():
    q, k, v = _qkv(1, 4, 2, 20, 20, 32, torch.float32, seed=3)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # the model's [B, T, H, d] viewed as [B, H, T, d]
    assert not q_strided.is_contiguous()
    out = kernels.flash_attention(q_strided, k, v, causal=True, scale=0.5, block_m=16, block_n=16)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              is_causal=True, scale=0.5)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[torch.float32], atol=TOLERANCE[torch.float32])


needs_interpreter = pytest.mark.skipif(DEVICE != "cpu", reason="the loads are watched in Triton's interpreter; "
                                                                "on a GPU compute-sanitizer does it")


@triton.jit
def _copy_kernel(X, Y, n, WIDTH: tl.constexpr, PAST: tl.constexpr):
    """Copies n elements, loading PAST more than it should."""
    offsets = tl.arange(0, WIDTH)
    values = tl.load(X + offsets, mask=offsets < n + PAST, other=0.0)
    tl.store(Y + offsets, values, mask=offsets < n)


@needs_interpreter
def test_watched_loads_name_each_load_past_a_tensor_and_where_it_read():
    buffer = torch.arange(16.0)
    x, y = buffer[:10], torch.zeros(10)
    with watched_loads(X=x, Y=y) as strays:
        _copy_kernel[(1,)](x, y, 10, WIDTH=16, PAST=0)
    assert strays == [] and torch.equal(y, x)
    with watched_loads(X=x, Y=y) as strays:  # the element past x lies in the buffer x is a view of
        _copy_kernel[(1,)](x, y, 10, WIDTH=16, PAST=2)
    assert strays == ["2 elements outside the tensors; the first: X[10], outside X's shape [10]"]
    x = torch.arange(10.0)  # an allocation of its own: what lies past it is no watched tensor's
    with watched_loads(X=x) as strays:
        _copy_kernel[(1,)](x, y, 10, WIDTH=16, PAST=1)
    assert strays == ["1 element outside the tensors; the first: memory that no tensor holds, 0 bytes past the "
                      "end of X's"]
    assert torch.equal(y, x)  # the values read past the end were not stored


@triton.jit
def _sum_kernel(X, Y, n, WIDTH: tl.constexpr):
    """Sums n elements, loaded without other=: its masked-off lanes are undefined."""
    offsets = tl.arange(0, WIDTH)
    tl.store(Y, tl.sum(tl.load(X + offsets, mask=offsets < n)))


@needs_interpreter
def test_under_watch_a_load_without_other_gives_nan_in_its_masked_lanes():
    """The interpreter gives them zeros, so the sum comes out right; on a GPU they are undefined."""
    x, total = torch.arange(10.0), torch.zeros(1)
    _sum_kernel[(1,)](x, total, 10, WIDTH=16)
    assert total.item() == 45
    with watched_loads(X=x) as strays:
        _sum_kernel[(1,)](x, total, 10, WIDTH=16)
    assert strays == [] and total.isnan().all()


@needs_interpreter
def test_watched_loads_leave_the_interpreter_as_it_was_also_after_an_error(monkeypatch):
    from triton.runtime.interpreter import interpreter_builder
    with pytest.raises(ZeroDivisionError), watched_loads(X=torch.zeros(4)):
        1 / 0
    with watched_loads(X=torch.zeros(4)) as strays:
        pass
    x, y = torch.arange(10.0), torch.zeros(10)
    _copy_kernel[(1,)](x, y, 10, WIDTH=16, PAST=3)  # watched by no one
    assert strays == [] and interpreter_builder.create_masked_load.__name__ == "create_masked_load"
    with pytest.raises(ValueError, match="needs the tensors a kernel may read"), watched_loads():
        pass
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="compute-sanitizer"), watched_loads(X=x):
        pass


@needs_interpreter
def test_labkits_attention_kernels_load_only_inside_their_tensors():
    """A mask one index too wide reads past a tensor and no output shows it (the values are dropped);
    on a GPU it reads another allocation, or faults. And no output depends on a lane a mask left out."""
    for *dims, causal, dtype, block_m, block_n in SHAPES:
        q, k, v = _qkv(*dims, dtype, seed=sum(dims))
        with watched_loads(Q=q, K=k, V=v) as strays:  # and a lane masked without other= is NaN
            out = kernels.flash_attention(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
        assert strays == [], (dims, strays)
        torch.testing.assert_close(out.double(), _sdpa(q, k, v, causal), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    q, k_pool, v_pool, tables, lengths = _paged_batch(torch.float32, [1, 16, 37, 70], heads=6, kv_heads=2)
    with watched_loads(Q=q, K=k_pool, V=v_pool, Tables=tables, Lengths=lengths) as strays:
        out = kernels.paged_decode(q, k_pool, v_pool, tables, lengths)
    assert strays == []
    torch.testing.assert_close(out.double(), _reference(q, k_pool, v_pool, tables, lengths), rtol=2e-5, atol=2e-5)


def _paged_batch(dtype, lengths, block_size=16, kv_heads=2, heads=8, dim=48, num_blocks=24, seed=0, device=DEVICE):
    generator = torch.Generator().manual_seed(seed)
    pools = [torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator).to(device, dtype)
             for _ in range(2)]
    width = max(math.ceil(n / block_size) for n in lengths)
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:width] for _ in lengths]).to(device)
    q = torch.randn(len(lengths), heads, dim, generator=generator).to(device, dtype)
    return q, *pools, tables, torch.tensor(lengths, device=device)


def _reference(q, k_pool, v_pool, tables, lengths):
    """The paged reference (gather, then SDPA) in float64."""
    return paged_attention(q.double(), k_pool.double(), v_pool.double(), tables, lengths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_paged_decode_matches_the_gather_reference(dtype, heads, kv_heads):
    q, k_pool, v_pool, tables, lengths = _paged_batch(dtype, [1, 16, 37, 70], kv_heads=kv_heads, heads=heads)
    out = kernels.paged_decode(q, k_pool, v_pool, tables, lengths)
    expected = _reference(q, k_pool, v_pool, tables, lengths)
    torch.testing.assert_close(out.double(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def _spoil_unread_slots(k_pool, v_pool, tables, lengths):
    """Noise in every slot past each length, and in the blocks no table names."""
    for pool in (k_pool, v_pool):
        spoiled = tables.new_ones(pool.shape[0], pool.shape[1], dtype=torch.bool)
        for row, length in zip(tables, lengths.tolist()):
            for slot in range(length):
                spoiled[row[slot // pool.shape[1]], slot % pool.shape[1]] = False
        pool[spoiled] = 1e4


def test_paged_decode_never_reads_past_a_length():
    q, k_pool, v_pool, tables, lengths = _paged_batch(torch.float32, [5, 20])
    out = kernels.paged_decode(q, k_pool, v_pool, tables, lengths)
    _spoil_unread_slots(k_pool, v_pool, tables, lengths)
    torch.testing.assert_close(kernels.paged_decode(q, k_pool, v_pool, tables, lengths), out)


def test_paged_decode_on_a_models_paged_cache():
    config = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=128)
    model = Transformer(config).eval()
    cache = PagedKVCache(config, BlockAllocator(num_blocks=16, block_size=8), device=DEVICE)
    prompts = [[1, 2, 3], list(range(5, 25)), list(range(30, 43))]
    for index, prompt in enumerate(prompts):
        cache.allocator.add_sequence(index, prompt)
    step_logits(model.to(DEVICE), cache, [(index, 0, len(p)) for index, p in enumerate(prompts)],
                [t for p in prompts for t in p])
    q = torch.randn(3, config.n_heads, config.head_dim, device=DEVICE)
    lengths = torch.tensor(list(map(len, prompts)), device=DEVICE)
    tables = cache.block_tables(range(3))
    for layer in range(config.n_layers):
        pools = cache.k[layer], cache.v[layer]
        torch.testing.assert_close(kernels.paged_decode(q, *pools, tables, lengths),
                                   paged_attention(q, *pools, tables, lengths), rtol=2e-5, atol=2e-5)


def test_the_paged_cache_attends_through_a_decode_kernel():
    """The engine's cache with the Triton kernel as its decode attention (interpreted here)."""
    config = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=128)
    model = Transformer(config)
    model.reset_parameters(std=0.3)  # logits far apart: no near tie for float rounding to flip
    model.eval().to(DEVICE)
    prompts = [[1, 2, 3], list(range(5, 25)), list(range(30, 43))]
    calls = []

    def kernel(*args):
        calls.append(len(args[0]))
        return kernels.paged_decode(*args)
    outputs = []
    for decode_kernel in (None, kernel):
        cache = PagedKVCache(config, BlockAllocator(num_blocks=16, block_size=8), device=DEVICE,
                             decode_kernel=decode_kernel)
        outputs.append(generate_paged(model, cache, prompts, new_tokens=4)[0])
    assert outputs[0] == outputs[1]
    # the cache tries the kernel once when made, then the three sequences in one call, each layer of 3 steps
    assert calls == [1] + [3] * 3 * config.n_layers


def test_tiled_and_naive_attention_and_online_softmax_match_sdpa():
    q, k, v = _qkv(1, 1, 1, 45, 70, 16, torch.float32, seed=5)
    for causal in (False, True):
        out = kernels.tiled_attention(q[0, 0].cpu(), k[0, 0].cpu(), v[0, 0].cpu(), causal, block_m=16, block_n=32)
        torch.testing.assert_close(out.double(), _sdpa(q, k, v, causal)[0, 0].cpu(), rtol=1e-5, atol=1e-5)
        naive = naive_attention(q, k, v, causal)
        torch.testing.assert_close(naive.double(), _sdpa(q, k, v, causal), rtol=1e-5, atol=1e-5)
    state = (torch.full((3,), -math.inf), torch.zeros(3), torch.zeros(3, 4))
    scores, values = torch.randn(3, 10), torch.randn(10, 4)
    for start in (0, 4, 8):
        state = kernels.online_softmax_update(*state, scores[:, start:start + 4], values[start:start + 4])
    torch.testing.assert_close(state[2] / state[1][:, None], torch.softmax(scores, -1) @ values)


def test_tile_map_skips_the_tiles_above_the_diagonal():
    square = kernels.tile_map(64, 64, 16, 16, causal=True)
    assert (square == 0).sum() == 6 and (square == 1).sum() == 4 and (square == 2).sum() == 6
    assert (kernels.tile_map(40, 50, 16, 16, causal=False) == 2).all()
    prefix = kernels.tile_map(16, 48, 16, 16, causal=True)  # the last 16 of 48 positions see every earlier key
    assert prefix.tolist() == [[2, 2, 1]]


@pytest.mark.parametrize("call,message", [
    (lambda q, k, v: kernels.flash_attention(q, k[:, :1].expand(1, 3, 8, 16), v[:, :1].expand(1, 3, 8, 16)),
     "not a multiple of n_kv_heads"),
    (lambda q, k, v: kernels.flash_attention(q, k[:, :, :4], v[:, :, :4], causal=True), "T=8 > S=4"),
    (lambda q, k, v: kernels.flash_attention(q, k.half(), v), "share one dtype"),
    (lambda q, k, v: kernels.flash_attention(q, k, v, block_m=24), "block_m=24 must be a power of two"),
    (lambda q, k, v: kernels.flash_attention(q, k, v, block_n=512), "block_n=512 must be a power of two"),
    (lambda q, k, v: kernels.flash_attention(q[0], k, v), r"expected q \[B, n_heads, T, d\]"),
])
def test_flash_attention_refuses_bad_input(call, message):
    q, k, v = _qkv(1, 4, 2, 8, 8, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match=message):
        call(q, k, v)


def test_paged_decode_refuses_bad_input():
    q, k_pool, v_pool, tables, lengths = _paged_batch(torch.float32, [5, 20])
    with pytest.raises(ValueError, match="every length must be in"):
        kernels.paged_decode(q, k_pool, v_pool, tables, torch.tensor([0, 20], device=DEVICE))
    with pytest.raises(ValueError, match="every length must be in"):
        kernels.paged_decode(q, k_pool, v_pool, tables, torch.tensor([5, 33], device=DEVICE))
    with pytest.raises(ValueError, match="pools hold blocks 0..23"):
        kernels.paged_decode(q, k_pool, v_pool, tables + 24, lengths)
    with pytest.raises(ValueError, match="block_size=12 must be a power of two"):
        kernels.paged_decode(q, k_pool[:, :12], v_pool[:, :12], tables, lengths)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


@pytest.mark.skipif(DEVICE != "cpu", reason="needs a machine without a GPU")
def test_cpu_tensors_without_the_interpreter_get_a_clear_error():
    ran = _python("import torch; from labkit import kernels; q = torch.zeros(1, 1, 4, 16)\n"
                  "try:\n    kernels.flash_attention(q, q, q)\nexcept ValueError as e:\n    print(e)",
                  TRITON_INTERPRET="0")
    assert "set TRITON_INTERPRET=1" in ran.stdout, ran.stderr


def test_without_triton_the_package_imports_and_says_what_is_missing():
    ran = _python("import sys; sys.modules['triton'] = None\nimport torch\nfrom labkit import kernels\n"
                  "print(kernels.MISSING)\nq = torch.zeros(1, 1, 4, 16)\n"
                  "print(kernels.tiled_attention(q[0, 0], q[0, 0], q[0, 0]).shape)\n"
                  "try:\n    kernels.flash_attention(q, q, q)\nexcept ImportError as e:\n    print('raised', e)")
    assert ran.returncode == 0, ran.stderr
    assert "Triton is not installed" in ran.stdout and "raised Triton is not installed" in ran.stdout
    assert "torch.Size([4, 16])" in ran.stdout


_COMPILE = """
import torch
import triton
from labkit.kernels import flash_attention_kernel, paged_decode_kernel
from labkit.kernels.flash import tiles
from labkit.kernels.paged_decode import decode_tile
from labkit.kernels.runtime import compile_for_gpu

SHARED = {90: 232448, 80: 166912}  # bytes of shared memory a block may use on an H100, an A100

def build(kernel, pointers, constexprs, capability, **options):
    compiled = compile_for_gpu(kernel, {**pointers, "scale_log2e": "fp32"}, constexprs, capability, **options)
    return compiled.asm, compiled.metadata.shared

NAMES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
for capability, dtype, dim, causal in ((90, "fp16", 64, True), (90, "bf16", 128, False), (90, "fp16", 256, True),
                                       (80, "fp16", 48, True), (80, "fp32", 128, False), (80, "fp32", 256, True)):
    block_m, block_n, warps, stages = tiles(dim, NAMES[dtype])
    asm, shared = build(flash_attention_kernel, dict(Q=f"*{dtype}", K=f"*{dtype}", V=f"*{dtype}", Out=f"*{dtype}"),
                        dict(CAUSAL=causal, HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_M=block_m,
                             BLOCK_N=block_n), capability, num_warps=warps, num_stages=stages)
    tensor_cores = "wgmma.mma_async" in asm["ptx"] if capability == 90 else "mma.sync" in asm["ptx"]
    print("flash", capability, dtype, dim, causal, shared, "cubin" in asm, tensor_cores, shared <= SHARED[capability])
for capability, dtype, dim in ((90, "fp16", 128), (90, "bf16", 256), (80, "fp16", 64), (80, "fp32", 128)):
    pools = dict(Q=f"*{dtype}", KPool=f"*{dtype}", VPool=f"*{dtype}", Tables="*i64", Lengths="*i64", Out=f"*{dtype}")
    constexprs = dict(HEAD_DIM=dim, BLOCK_D=dim, ROWS=16, BLOCK_SIZE=16, TILE=decode_tile(16, dim, NAMES[dtype]),
                      PRECISION="ieee" if dtype == "fp32" else "tf32")
    asm, shared = build(paged_decode_kernel, pools, constexprs, capability, num_warps=4, num_stages=2)
    tensor_cores = "mma" in asm["ptx"]  # fp32 takes exact (ieee) products, off the tensor cores
    print("paged", capability, dtype, dim, shared, "cubin" in asm, tensor_cores == (dtype != "fp32"),
          shared <= SHARED[capability])
"""


def test_the_kernels_compile_for_hopper_and_ampere_gpus():
    """Without a GPU, Triton still compiles a kernel down to a cubin for a named GPU: this checks
    the compiled path that the interpreter never takes (tile shapes tl.dot accepts, types), that the
    tiles ``flash.tiles`` and ``decode_tile`` pick fit in shared memory for each dtype and head size,
    and that both kernels' matmuls land on tensor cores (wgmma or mma) except the exact fp32 decode."""
    ran = _python(_COMPILE, TRITON_INTERPRET="0")
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = ran.stdout.split("\n")
    assert sum(line.startswith("flash") for line in lines) == 6 and sum(line.startswith("paged") for line in lines) == 4
    assert all(line.endswith("True True True") for line in lines if line.startswith(("flash", "paged"))), ran.stdout


def test_attention_flops_count_the_visible_pairs():
    from labkit.kernels.speed import attention_flops
    for n_queries, n_keys in ((7, 7), (5, 12)):
        visible = int(torch.ones(n_queries, n_keys).tril(n_keys - n_queries).sum())
        assert attention_flops(2, 3, n_queries, n_keys, 16, causal=True) == 4 * 2 * 3 * 16 * visible
        assert attention_flops(2, 3, n_queries, n_keys, 16, causal=False) == 4 * 2 * 3 * 16 * n_queries * n_keys


@pytest.mark.skipif(DEVICE != "cpu", reason="needs a machine without a GPU")
def test_timings_refuse_the_interpreter():
    from labkit.kernels.speed import forward_speeds
    with pytest.raises(RuntimeError, match="kernel timings need a CUDA GPU"):
        forward_speeds([512], [64], torch.device("cpu"))


# ---------------------------------------------------------------- the CPU's C++ paged decode operator

@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [
    (4, 4, 48, 16),  # MHA, the shipped model's head dimension
    (8, 2, 64, 16),  # GQA 4
    (6, 1, 128, 8),  # MQA
    (6, 3, 20, 12),  # a head dimension without its own compiled loop, and blocks of 12
])
def test_cpu_paged_decode_matches_the_gather_reference(heads, kv_heads, dim, block_size):
    q, k_pool, v_pool, tables, lengths = _paged_batch(torch.float32, [1, 16, 37, 70, 130], block_size, kv_heads,
                                                      heads, dim, device="cpu")
    out = paged_decode_cpu(q, k_pool, v_pool, tables, lengths)
    torch.testing.assert_close(out.double(), _reference(q, k_pool, v_pool, tables, lengths), rtol=1e-5, atol=1e-5)


def test_cpu_paged_decode_rescales_when_a_later_block_scores_higher():
    """Scores that grow by far more than exp can span (about 88 in fp32), block after block, and
    fall again: the online softmax must rescale its running sum and output at every new maximum."""
    q, k_pool, v_pool, tables, lengths = _paged_batch(torch.float32, [64, 50], 16, 2, 4, 48, device="cpu")
    for row in tables:
        for index, block in enumerate(row.tolist()):
            k_pool[block] *= [1.0, 40.0, 90.0, 10.0][index]
    out = paged_decode_cpu(q, k_pool, v_pool, tables, lengths)
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), _reference(q, k_pool, v_pool, tables, lengths), rtol=1e-4, atol=1e-4)


def test_cpu_paged_decode_never_reads_past_a_length_and_reads_strided_inputs():
    q, k_pool, v_pool, tables, lengths = _paged_batch(torch.float32, [5, 20, 33], device="cpu")
    expected = _reference(q, k_pool, v_pool, tables, lengths)
    _spoil_unread_slots(k_pool, v_pool, tables, lengths)
    wide = torch.randn(*k_pool.shape[:3], 2, 64)  # pools whose head rows are not next to each other
    wide[..., 0, :48], wide[..., 1, :48] = k_pool, v_pool
    strided_q = torch.randn(q.shape[1], q.shape[0], 48).transpose(0, 1).copy_(q)
    out = paged_decode_cpu(strided_q, wide[..., 0, :48], wide[..., 1, :48], tables.int(), lengths.int())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_cpu_paged_decode_gives_the_same_bits_on_one_thread_or_two():
    q, k_pool, v_pool, tables, lengths = _paged_batch(torch.float32, [3, 40, 17, 64, 9], device="cpu")
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outputs.append(paged_decode_cpu(q, k_pool, v_pool, tables, lengths))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*outputs)


def test_cpu_paged_decode_refuses_bad_input():
    q, k_pool, v_pool, tables, lengths = _paged_batch(torch.float32, [5, 20], device="cpu")
    with pytest.raises(ValueError, match=r"one dtype of \(torch.float32,\)"):
        paged_decode_cpu(q.half(), k_pool.half(), v_pool.half(), tables, lengths)
    with pytest.raises(ValueError, match=r"\[1, 32\].*sequence 0 has length 0"):
        paged_decode_cpu(q, k_pool, v_pool, tables, torch.tensor([0, 20]))
    with pytest.raises(ValueError, match=r"\[1, 32\].*sequence 1 has length 33"):
        paged_decode_cpu(q, k_pool, v_pool, tables, torch.tensor([5, 33]))
    with pytest.raises(ValueError, match="sequence 0 reads block 38.*0..23"):
        paged_decode_cpu(q, k_pool, v_pool, tables + 24, lengths)
    with pytest.raises(ValueError, match="head dimension 48 but the pools hold 40"):
        paged_decode_cpu(q, k_pool[..., :40], v_pool[..., :40], tables, lengths)


def test_cpu_paged_decode_refuses_what_its_checks_would_miss():
    q, k_pool, v_pool, tables, lengths = _paged_batch(torch.float32, [5, 20], device="cpu")
    with pytest.raises(ValueError, match="integers, got torch.int64 and torch.bool"):
        paged_decode_cpu(q, k_pool, v_pool, tables, lengths > 0)
    with pytest.raises(ValueError, match="no empty dimension"):
        paged_decode_cpu(q[:, :0], k_pool[:, :, :0], v_pool[:, :, :0], tables, lengths)
    with pytest.raises(ValueError, match=r"tensors on \['cpu', 'meta'\]"):
        paged_decode_cpu(q, k_pool, v_pool, tables, lengths.to("meta"))


def test_cpu_paged_decode_ignores_table_entries_past_each_length():
    """A sequence's table entries after its last block are never read, so they may name anything."""
    q, k_pool, v_pool, tables, lengths = _paged_batch(torch.float32, [5, 20], device="cpu")
    padded = tables.clone()
    padded[0, 1] = -1  # sequence 0 (5 tokens) reads only its first block
    wide = torch.cat([padded, torch.full((2, 1), 99)], dim=1)
    expected = paged_attention(q, k_pool, v_pool, tables, lengths)
    torch.testing.assert_close(paged_decode_cpu(q, k_pool, v_pool, wide, lengths), expected)


def test_the_registered_operator_checks_the_ranges_it_reads_by_itself():
    """Called directly, past the wrapper's checks, the operator still reads nothing outside the pools."""
    q, k_pool, v_pool, tables, lengths = _paged_batch(torch.float32, [5, 20], device="cpu")
    paged_decode_cpu(q, k_pool, v_pool, tables, lengths)  # builds it
    op = torch.ops.labkit.paged_decode
    wrong = tables.clone()
    wrong[1, 1] = 40
    with pytest.raises(ValueError, match="sequence 1 reads block 40.*0..23"):
        op(q, k_pool, v_pool, wrong, lengths, 1.0)
    with pytest.raises(ValueError, match="sequence 0 has length 0"):
        op(q, k_pool, v_pool, tables, torch.tensor([0, 20]), 1.0)
    with pytest.raises(RuntimeError, match="expected tables"):
        op(q, k_pool, v_pool, tables[:1], lengths, 1.0)


def test_a_build_killed_midway_leaves_a_lock_that_the_next_build_removes(tmp_path):
    """Torch's lock file, left by a killed build, had made every later build wait for it forever.
    The cached build is copied to a folder of this test's own (its files' times kept, so that it is
    still up to date there): a build by another test running beside it must not find the lock first."""
    paged_decode_cpu_module.build()  # built and cached before the timing below
    cached = paged_decode_cpu_module.build_directory()
    ours = shutil.copytree(cached, tmp_path / cached.name, ignore=shutil.ignore_patterns("lock"))
    (ours / "lock").touch()  # as a build killed a moment ago leaves it
    ran = _python("from labkit.kernels.paged_decode_cpu import build\nbuild()\nprint('built')",
                  TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert ran.stdout == "built\n" and "left by a build that did not finish" in ran.stderr, ran.stderr
    assert not (ours / "lock").exists()



@pytest.mark.parametrize("said, raised", [("ninja: build stopped: interrupted by user.", KeyboardInterrupt),
                                          ("error: omp.h: No such file or directory", RuntimeError)])
def test_a_build_that_fails_or_is_interrupted_is_built_again_next_time(said, raised, tmp_path, monkeypatch):
    """Torch records a build as it starts: one that a notebook's Interrupt stopped (ninja says so; seen by hand,
    SIGINT to a building process's group) was taken for done, and every later load in the kernel looked for a
    library that was never made. It is forgotten now, and an interrupt is said as one, not as a missing compiler."""
    from torch.utils import cpp_extension
    from labkit.kernels import cpp_build

    def load(name, *args, **kwargs):
        cpp_extension.JIT_EXTENSION_VERSIONER.entries[name] = 0  # as torch's loader records it before building
        raise RuntimeError(f"Error building extension '{name}': {said}")
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with pytest.raises(raised, match="interrupted: run the cell again" if raised is KeyboardInterrupt else "omp.h"):
        cpp_build.build_operator("labkit_test_op", tmp_path / "op.cpp", "no_such_op", "a test operator", "nothing")
    assert "labkit_test_op" not in cpp_extension.JIT_EXTENSION_VERSIONER.entries

def test_a_build_waits_for_another_that_is_running():
    import fcntl
    paged_decode_cpu_module.build()
    folder = paged_decode_cpu_module.build_directory()
    with open(folder / "build.lock", "w") as held:  # as another process building holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        waiting = subprocess.Popen([sys.executable, "-c", "from labkit.kernels.paged_decode_cpu import build\n"
                                    "build()\nprint('built')"], stdout=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=5)
    assert waiting.communicate(timeout=120)[0] == "built\n"


def test_cpu_paged_decode_without_a_compiler_says_what_it_needs(tmp_path):
    ran = _python("from labkit.kernels.paged_decode_cpu import build\ntry:\n    build()\n"
                  "except RuntimeError as e:\n    print(e)", CXX=str(tmp_path / "no-compiler"),
                  TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert "needs a C++ compiler with OpenMP" in ran.stdout, ran.stdout + ran.stderr


def test_without_any_compiler_on_the_path_the_build_says_so_at_once(tmp_path):
    """No $CXX, g++, c++ nor clang++ (a laptop without build tools): one line that names the missing
    compiler, not torch's page about an incompatible compiler and a failed ninja build."""
    ran = _python("from labkit.kernels.paged_decode_cpu import build\ntry:\n    build()\n"
                  "except RuntimeError as e:\n    print(e)", PATH=str(tmp_path), TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert "no C++ compiler was found (tried g++, c++, clang++ and $CXX)" in ran.stdout, ran.stdout + ran.stderr
    assert "the engine runs without it (decode_kernel=None)" in ran.stdout and "WARNING" not in ran.stderr


def test_a_changed_source_is_built_again_and_said_to_be(tmp_path):
    """build_operator says "built" when torch's loader compiled the library, also over an earlier build
    whose source has changed since, and "loaded" when it found that build on disk up to date."""
    source = tmp_path / "op.cpp"
    source.write_text(paged_decode_cpu_module.SOURCE.read_text())
    build = ("from pathlib import Path\nfrom labkit.kernels import cpp_build\n"
             f"print(cpp_build.build_operator('labkit_changed_source', Path({str(source)!r}), 'paged_decode', "
             "'a test operator', 'nothing'))")
    runs = []
    for change in ("", "", "\n// changed\n"):
        if change:  # only then: writing the file, even unchanged, makes it newer than the build
            source.write_text(source.read_text() + change)
        ran = _python(build, TORCH_EXTENSIONS_DIR=str(tmp_path / "builds"))
        assert ran.returncode == 0, ran.stderr
        runs.append(ran.stdout.strip())
    assert runs == ["built", "loaded", "built"]


def test_a_cpu_without_vector_extensions_gets_its_own_correct_build(tmp_path):
    """The operator is compiled for the vector instructions torch uses on the CPU, and cached in a
    folder named after them: a machine that has none of them (here, torch told to act as one)
    builds a plain copy of its own, which computes the same attention."""
    ran = _python("import torch\nfrom labkit.kernels.paged_decode_cpu import build, build_directory, paged_decode_cpu\n"
                  "from labkit.paged_attention import paged_attention\ng = torch.Generator().manual_seed(0)\n"
                  "q, k, v = torch.randn(3, 8, 48, generator=g), *torch.randn(2, 20, 16, 2, 48, generator=g)\n"
                  "tables, lengths = torch.randperm(20, generator=g)[:18].view(3, 6), torch.tensor([5, 96, 41])\n"
                  "how = build()\n"
                  "error = (paged_decode_cpu(q, k, v, tables, lengths) - paged_attention(q, k, v, tables, lengths))\n"
                  "print(how, build(), build_directory().name, error.abs().max().item())",
                  ATEN_CPU_CAPABILITY="default", TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert ran.returncode == 0, ran.stderr
    how, again, folder, error = ran.stdout.replace("loaded already", "loaded-already").split()
    assert (how, again) == ("built", "loaded-already"), ran.stdout  # a new folder: built, then in this process
    reloaded = _python("from labkit.kernels.paged_decode_cpu import build\nprint(build())",
                       ATEN_CPU_CAPABILITY="default", TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert reloaded.stdout.split() == ["loaded"], (reloaded.stdout, reloaded.stderr)  # another process: from disk
    assert folder.endswith("-default") and (tmp_path / folder).is_dir(), ran.stdout
    assert "-mavx" not in (tmp_path / folder / "build.ninja").read_text()
    assert float(error) < 1e-5
    paged_decode_cpu_module.build()  # this machine's own build has the flags of its capability
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        assert "-mavx2 -mfma" in (paged_decode_cpu_module.build_directory() / "build.ninja").read_text()


def test_each_copy_of_labkit_builds_its_operators_in_a_folder_of_its_own(monkeypatch):
    """Two copies of labkit on one machine (a student's checkout, an instructor's grading copy) build in folders of
    their own, since a build records its source's path and a build from another path starts again; one copy
    finds its own folder every time."""
    from labkit.kernels import cpp_build
    here = cpp_build.build_directory("labkit_op")
    assert cpp_build.build_directory("labkit_op") == here
    monkeypatch.setattr(cpp_build, "__file__", "/elsewhere/labkit/kernels/cpp_build.py")
    there = cpp_build.build_directory("labkit_op")
    assert there != here and there.parent == here.parent
    assert there.name.rsplit("-", 1)[-1] == here.name.rsplit("-", 1)[-1]  # the same CPU capability
