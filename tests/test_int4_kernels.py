"""The fused INT4 dequantize-and-multiply kernels against ``F.linear`` with the dequantized weight:
the CPU's C++ operator (through ``int4_linear``, as ``QuantLinear`` calls it) and the Triton kernel
(in the interpreter on a CPU, so on small shapes). The C++ operator is built on first use (about
10 s, then cached on disk)."""
from __future__ import annotations

import collections
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from labkit import kernels, quant
from labkit.kernels.int4_linear import int4_linear, why_not_int4_linear
from labkit.kernels.int4_matmul_cpu import int4_matmul_cpu

if kernels.MISSING is None:  # the Triton kernel's module defines a @triton.jit function
    from labkit.kernels.int4_matmul import int4_matmul
needs_triton = pytest.mark.skipif(kernels.MISSING is not None, reason=str(kernels.MISSING))
DEVICE = "cpu" if kernels.interpreted() else "cuda"


def _layer(out_features, in_features, group_size, symmetric, seed=0):
    """A random layer's packed codes, fp16 scales and zeros (None if symmetric), and its dequantized weight."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    codes, scales, zeros = quant.quantize(weight, quant.Scheme(4, group_size, symmetric))
    return quant.pack_int4(codes), scales, None if symmetric else zeros, quant.dequantize(codes, scales, zeros)


def _inputs(rows, in_features, seed=1):
    """Activations of both signs, a few of them large (as outlier channels are)."""
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[:, ::37] *= 300.0
    return x


def _assert_matches(y, x, weight, tolerance):
    expected = F.linear(x.double(), weight.double())
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("symmetric", [False, True])
def test_cpu_kernel_matches_the_dequantized_reference(symmetric, group_size, rows):
    in_features = 384  # None: one group per row (per-channel)
    packed, scales, zeros, weight = _layer(45, in_features, group_size, symmetric)
    x = _inputs(rows, in_features)
    assert why_not_int4_linear(x, packed, scales, zeros, group_size or in_features) is None
    y = int4_linear(x, packed, scales, zeros, group_size or in_features)
    assert y.shape == (rows, 45) and y.dtype == torch.float32
    _assert_matches(y, x, weight, 2e-6)


@pytest.mark.parametrize("out_features,in_features,group_size,rows", [
    (7, 200, 8, 8),  # the smallest group, eight rows, a row of codes that is not a whole number of 64-byte blocks
    (9, 264, 24, 3),  # groups of 24: the 16 words of a block straddle group boundaries unevenly
    (3, 4096, 64, 1),  # a long row
])
def test_cpu_kernel_on_uneven_shapes(out_features, in_features, group_size, rows):
    packed, scales, zeros, weight = _layer(out_features, in_features, group_size, symmetric=False, seed=in_features)
    x = _inputs(rows, in_features)
    _assert_matches(int4_matmul_cpu(x, packed, scales, zeros, group_size), x, weight, 2e-6)


def test_leading_dimensions_are_rows_and_stay():
    packed, scales, zeros, weight = _layer(33, 256, 64, symmetric=False)
    x = _inputs(6, 256).view(2, 3, 256)
    y = int4_linear(x, packed, scales, zeros, 64)
    assert y.shape == (2, 3, 33)
    _assert_matches(y, x, weight, 2e-6)
    _assert_matches(int4_linear(x[0, 0], packed, scales, zeros, 64), x[0, 0], weight, 2e-6)  # one vector


def test_the_cpu_kernel_reads_what_quantlinear_keeps_and_gives_the_same_bits_on_any_thread_count():
    layer = quant.QuantLinear.from_linear(torch.nn.Linear(256, 77, bias=False), quant.Scheme(4, 64, False))
    x = _inputs(2, 256)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outputs.append(int4_linear(x, layer.packed, layer.scales, layer.zeros, 64))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*outputs)
    _assert_matches(outputs[0], x, layer.dequantized_weight(), 2e-6)


@needs_triton
@pytest.mark.parametrize("form", ["gemv", "dot"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_features,in_features,group_size,symmetric,rows,blocks", [
    (37, 128, 64, False, 1, {}),  # decode: one row; outputs not a multiple of the tile
    # symmetric; groups not a multiple of a step's; on a GPU, the loop's loads pipelined three deep
    (20, 96, 32, True, 3, dict(block_n=32, groups=4, num_stages=3)),
    (9, 144, 24, False, 8, dict(groups=4, split_k=2, num_stages=2)),  # a group of 24 (a padded tile); 2 programs a tile
    (6, 64, 32, False, 2, dict(groups=1, split_k=4)),  # more programs than steps: two of four sum nothing
])
def test_triton_kernel_matches_the_dequantized_reference(dtype, out_features, in_features, group_size, symmetric,
                                                         rows, blocks, form):
    packed, scales, zeros, weight = _layer(out_features, in_features, group_size, symmetric)
    x = _inputs(rows, in_features).to(dtype)
    on_device = [t if t is None else t.to(DEVICE) for t in (x, packed, scales, zeros)]
    y = int4_matmul(*on_device, group_size, form, **blocks)
    assert y.shape == (rows, out_features) and y.dtype == dtype
    # the weights are rounded to x's dtype, as QuantLinear's PyTorch path rounds them; fp32 on a GPU runs in fp32
    _assert_matches(y.cpu(), x, weight, {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype])


@needs_triton
@pytest.mark.skipif(DEVICE != "cpu", reason="the loads are watched in Triton's interpreter")
@pytest.mark.parametrize("form", ["gemv", "dot"])
def test_the_triton_kernel_loads_only_inside_its_tensors(form):
    """Outputs not a multiple of the tile, a padded group, more programs than steps: every load's mask
    keeps it inside the codes, scales, zeros and rows it was given, and no output depends on a lane
    that a mask left out."""
    from labkit.kernels.bounds import watched_loads
    for out_features, in_features, group_size, rows, blocks in [(37, 128, 64, 1, {}), (9, 144, 24, 8, dict(split_k=2)),
                                                                (6, 64, 32, 2, dict(groups=1, split_k=4))]:
        packed, scales, zeros, weight = _layer(out_features, in_features, group_size, symmetric=False)
        x = _inputs(rows, in_features).half()
        with watched_loads(X=x, Packed=packed, Scales=scales, Zeros=zeros) as strays:  # masked lanes without
            y = int4_matmul(x, packed, scales, zeros, group_size, form, **blocks)  # other= are NaN
        assert strays == [], (out_features, in_features, group_size, strays)
        _assert_matches(y, x, weight, 2e-3)


def _bad_inputs():
    """(the call's inputs changed one at a time, what the error must say)"""
    packed, scales, zeros, _ = _layer(45, 384, 64, symmetric=False)
    x = _inputs(1, 384)
    good = dict(x=x, packed=packed, scales=scales, zeros=zeros, group_size=64)
    wide = torch.zeros(45, 2, 6, dtype=torch.float16)
    return [({**good, **change}, message) for change, message in [
        (dict(x=x.double()), r"x is torch.float64; this kernel takes torch.float32"),
        (dict(x=x.half()), r"x is torch.float16; this kernel takes torch.float32"),
        (dict(x=_inputs(9, 384)), r"x has 9 rows; the fused kernel takes 1 to 8"),
        (dict(x=x.clone().requires_grad_()), r"x requires grad"),
        (dict(packed=quant.unpack_int4(packed)), r"packed must be uint8 \[out, in / 2\] = \[45, 192\]"),
        (dict(packed=packed.to(torch.int8)), r"packed must be uint8"),
        (dict(group_size=12), r"group_size=12 must be a multiple of 8 that divides in_features=384"),
        (dict(group_size=256), r"group_size=256 must be a multiple of 8"),
        (dict(scales=scales.float()), r"scales must be float16 \[out, in / group_size\] = \[45, 6\], got "
                                      r"torch.float32"),
        (dict(zeros=zeros[:, :5]), r"zeros must be float16 \[out, in / group_size\] = \[45, 6\]"),
        (dict(x=torch.randn(2, 768)[:, ::2]), r"x must be contiguous"),
        (dict(scales=wide[:, 0]), r"scales must be contiguous"),
        (dict(x=x.to("meta")), r"no fused INT4 kernel for meta"),
        (dict(packed=packed.to("meta")), r"different devices: x on cpu, the weight's on \['cpu', 'meta'\]"),
        (dict(x=torch.ones(())), r"expected x \[\.\.\., in\]"),
    ]]


@pytest.mark.parametrize("inputs,message", _bad_inputs(), ids=lambda v: v[:40] if isinstance(v, str) else "")
def test_bad_inputs_are_refused_by_name(inputs, message):
    assert why_not_int4_linear(**inputs) is not None
    with pytest.raises(ValueError, match=message):
        int4_linear(**inputs)


def test_the_registered_operator_checks_what_it_reads_by_itself():
    """Called directly, past the Python checks, the operator still reads nothing outside the tensors."""
    packed, scales, zeros, _ = _layer(45, 384, 64, symmetric=False)
    x = _inputs(1, 384)
    int4_matmul_cpu(x, packed, scales, zeros, 64)  # builds it
    op = torch.ops.labkit.int4_matmul
    with pytest.raises(RuntimeError, match="expected packed \\[out, in / 2\\]"):
        op(x, packed[:, :100], scales, zeros, 64)
    with pytest.raises(RuntimeError, match="1 to 8 rows, got 9"):
        op(_inputs(9, 384), packed, scales, zeros, 64)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        op(torch.randn(2, 768)[:, ::2], packed, scales, zeros, 64)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


def test_both_cpu_operators_load_in_either_order():
    """Both libraries add operators to the namespace `labkit`: this one as a fragment, so that it
    loads before or after the paged decode operator's."""
    ran = _python("import torch\nfrom labkit.kernels import int4_matmul_cpu, paged_decode_cpu\n"
                  "int4_matmul_cpu.build()\npaged_decode_cpu.build()\n"
                  "print(hasattr(torch.ops.labkit, 'int4_matmul'), hasattr(torch.ops.labkit, 'paged_decode'))")
    assert ran.stdout == "True True\n", ran.stderr[-3000:]


_COMPILE = """
from labkit.kernels.int4_matmul import KERNELS, kernel_constants, kernel_types, launch_parameters
from labkit.kernels.runtime import compile_for_gpu

cases = [(form, 64, capability, dtype, rows, split) for form in KERNELS
         for capability, dtype, rows, split in ((90, "fp16", 1, 1), (80, "bf16", 8, 2))]
cases += [("dot", 64, 90, "bf16", 1, 1), ("dot", 64, 90, "fp32", 1, 1), ("dot", 128, 90, "fp16", 1, 1)]
for form, group, capability, dtype, rows, split in cases:
    _, block_n, groups, _, warps, stages = launch_parameters(group, form, on_gpu=True)
    constexprs = kernel_constants(form, rows, group, block_n, groups, split_k=split, has_zeros=True, num_stages=stages)
    compiled = compile_for_gpu(KERNELS[form], kernel_types(dtype, split), constexprs, capability, num_warps=warps)
    print(form, group, capability, dtype, "cubin" in compiled.asm)
"""


@needs_triton
def test_the_triton_kernel_compiles_for_hopper_and_ampere_gpus():
    """Without a GPU, Triton still compiles the kernel for a named GPU at its GPU launch parameters:
    the path the interpreter never takes (the layouts, the types)."""
    ran = _python(_COMPILE, TRITON_INTERPRET="0")
    assert ran.returncode == 0, ran.stderr[-3000:]
    compiled = [line for line in ran.stdout.split("\n") if line.startswith(("gemv ", "dot "))]
    assert compiled == ["gemv 64 90 fp16 True", "gemv 64 80 bf16 True", "dot 64 90 fp16 True", "dot 64 80 bf16 True",
                        "dot 64 90 bf16 True", "dot 64 90 fp32 True", "dot 128 90 fp16 True"], ran.stdout


@needs_triton
@pytest.mark.parametrize("form,dtype,tolerance", [("gemv", torch.float32, 2e-6), ("dot", torch.float32, 2e-6),
                                                  ("dot", torch.float16, 2e-3)])
def test_zero_points_need_not_be_whole_numbers(form, dtype, tolerance):
    """Zero points are fp16 and may come from elsewhere with fractions: the kernels apply them as the
    dequantized weight does (a first version rounded them to whole numbers); in fp16 the "dot" form
    rounds zero * scale to fp16, no more than the weight itself is rounded."""
    packed, scales, _, _ = _layer(13, 128, 32, symmetric=True)
    zeros = (torch.rand(13, 4, generator=torch.Generator().manual_seed(2)) * 15).half()  # 7.3, 0.6, ...
    weight = (quant.unpack_int4(packed).float() - zeros.float().repeat_interleave(32, dim=1)) * \
        scales.float().repeat_interleave(32, dim=1)
    x = _inputs(2, 128).to(dtype)
    y = int4_matmul(*(t.to(DEVICE) for t in (x, packed, scales, zeros)), 32, form)
    _assert_matches(y.cpu(), x, weight, tolerance)


@needs_triton
@pytest.mark.parametrize("change,message", [
    (dict(split_k=0), r"split_k=0 must be a positive integer"),
    (dict(block_n=3), r"block_n=3 must be a power of two"),
    (dict(groups=0), r"groups=0 must be a positive integer"),
    (dict(num_warps=2.0), r"num_warps=2.0 must be a positive integer"),
    (dict(num_warps=3), r"num_warps=3 must be a power of two"),
    (dict(split_k=1.5), r"split_k=1.5 must be a positive integer"),
    (dict(num_stages=0), r"num_stages=0 must be a positive integer"),
    (dict(num_stages=2.5), r"num_stages=2.5 must be a positive integer"),
    (dict(form="dot", block_n=8), r"block_n=8: tl.dot multiplies tiles of at least 16 features"),
    (dict(form="fused"), r"form='fused': the INT4 kernel comes as 'gemv' or 'dot'"),
])
def test_bad_launch_parameters_are_refused_by_name(change, message):
    packed, scales, zeros, _ = _layer(8, 64, 32, symmetric=False)
    with pytest.raises(ValueError, match=message):
        int4_matmul(*(t.to(DEVICE) for t in (_inputs(1, 64), packed, scales, zeros)), 32, **change)


@needs_triton
def test_a_step_is_never_smaller_than_a_tensor_core_tile():
    """In the tensor-core form, groups of 8 inputs are 4 bytes: the defaults take at least 4 of them
    a step, and fewer are refused."""
    from labkit.kernels.int4_matmul import launch_parameters
    assert launch_parameters(8, "dot", on_gpu=False)[2] == 4 and launch_parameters(8, "dot", on_gpu=True)[2] == 16
    assert launch_parameters(8, "gemv", on_gpu=False)[2] == 2
    with pytest.raises(ValueError, match="a step of 8 bytes: tl.dot needs at least 16; take more groups a step"):
        launch_parameters(8, "dot", groups=2)
    packed, scales, zeros, weight = _layer(16, 64, 8, symmetric=False)
    x = _inputs(1, 64)
    y = int4_matmul(*(t.to(DEVICE) for t in (x, packed, scales, zeros)), 8, "dot")
    _assert_matches(y.cpu(), x, weight, 2e-6)


@needs_triton
def test_steps_too_large_for_registers_go_to_the_matrix_vector_form_and_only_it_splits_by_default(monkeypatch):
    from labkit.kernels import int4_matmul as module
    monkeypatch.setattr(module, "GPU_FORM", "dot")
    assert module.launch_parameters(256, on_gpu=True)[0] == "dot"  # 128 features x 128 bytes over 4 warps: 128 a thread
    assert module.launch_parameters(512, on_gpu=True)[0] == "gemv"  # 256 a thread
    assert module.launch_parameters(64, block_n=256, groups=4, on_gpu=True)[0] == "gemv"
    with pytest.raises(ValueError, match="256 features x 128 bytes a step over 4 warps are 256 bytes of codes a "
                                         "thread; the 'dot' form holds them in registers and takes at most 128"):
        module.launch_parameters(64, "dot", block_n=256, groups=4, num_warps=4)
    assert module.launch_parameters(64, "dot", block_n=256, groups=4, num_warps=8)[0] == "dot"
    assert module.launch_parameters(64, "gemv", on_gpu=True)[3] == 1
    assert module.launch_parameters(64, "dot", on_gpu=True)[3] is None  # default_split_k, at the call
    assert module.launch_parameters(64, "dot", on_gpu=False)[3] == 1
    assert module.launch_parameters(64, "dot", split_k=3)[3] == 3


@needs_triton
def test_the_default_split_puts_two_programs_on_each_multiprocessor(monkeypatch):
    from labkit.kernels import int4_matmul as module
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    module._multiprocessors.cache_clear()
    try:
        gpu = torch.device("cuda", 0)
        assert module.default_split_k(11008, 4096, 64, 128, 2, gpu) == 4  # 86 tiles: 344 programs for 264 slots
        assert module.default_split_k(4096, 11008, 64, 128, 2, gpu) == 9  # 32 tiles of 86 steps
        assert module.default_split_k(4096, 256, 64, 128, 2, gpu) == 2  # no more programs than steps
        assert module.default_split_k(65536, 4096, 64, 128, 2, gpu) == 1  # 512 tiles already
    finally:
        module._multiprocessors.cache_clear()


@needs_triton
@pytest.mark.parametrize("form,least,most", [("gemv", 5, 12), ("dot", 3, 6)])
def test_the_gpu_kernel_issues_few_instructions_per_code(form, least, most):
    """The Triton kernel's loop, compiled for an H100 and its machine code counted (in a subprocess
    where Triton interprets in this one), at the GPU defaults: no conversion instruction per code, and
    under 12 instructions per code in the matrix-vector form (the form timed on an H100, 4a84ebf, took
    26), under 6 in the tensor-core form, which multiplies on the tensor cores (HGMMA), dequantizes
    fp16 weights two at a time (at most one HADD2 or HFMA2 per code) and has no fp32 add, multiply
    or fused multiply-add. With ``num_stages=1`` each step loads its own codes; with 3 the loop copies
    later steps' codes into shared memory (LDGSTS) for at most 15% more instructions a code at the
    defaults' tiles. The defaults are each form's loop as timed on an H100: the matrix-vector form's
    unpipelined, the tensor-core form's pipelined 3 deep (as Triton did by itself before the depth
    was a parameter)."""
    from labkit.kernels.int4_matmul import launch_parameters
    from labkit.kernels.issue import int4_loop, int4_loops
    from labkit.presets import ISSUE_RATES
    timed_pipelined = form == "dot"
    (counts, per_code), (other, other_per_code) = int4_loops(
        [dict(form=form), dict(form=form, num_stages=1 if timed_pipelined else 3)])
    loops = [(counts, per_code), (other, other_per_code)]
    (flat, flat_per_code), (staged, staged_per_code) = loops[::-1] if timed_pipelined else loops
    assert not any(op.startswith("LDGSTS") for op in flat), flat
    assert any(op.startswith("LDGSTS") for op in staged), staged
    assert least < staged_per_code < 1.15 * flat_per_code, (flat, staged)
    _, block_n, groups, _, warps, _ = launch_parameters(64, form, on_gpu=True)
    codes = block_n * groups * 64 / (32 * warps)  # a step's codes over its threads
    assert not any(op.startswith("I2F") for op in counts), counts
    assert least < per_code < most, counts
    assert per_code == sum(counts.values()) / codes
    base = collections.Counter()  # by base opcode: FFMA.FTZ is an FFMA
    for op, n in counts.items():
        base[op.split(".")[0]] += n
    if form == "dot":
        assert base["HGMMA"] > 0 and 0 < base["HADD2"] + base["HFMA2"] <= codes, counts
        assert not base["FFMA"] + base["FADD"] + base["FMUL"], counts  # no fp32 arithmetic
    else:
        # a few wide loads a step (the codes, a scale and a zero point a group, x: 8 at the defaults
        # since session 33), not a scale and a zero point per byte of codes (4a84ebf: 160)
        assert sum(n for op, n in counts.items() if op.startswith("LDG") and op != "LDGDEPBAR") <= 8, counts
    assert ISSUE_RATES["H100-SXM"].floor_s(32 * 528 * 1.98e9) == pytest.approx(1.0)  # 132 SMs x 4 schedulers
    with pytest.raises(ValueError, match="dtype='int8'"):
        int4_loop(dtype="int8")


_LISTING = """
\tcode for sm_90
\t\tFunction : kernel
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                   /* 0x00000a00ff017b82 */
                                                                            /* 0x000fe20000000800 */
        /*0010*/              @!P0 EXIT ;                                   /* 0x000000000000894d */
        /*0020*/                   MOV R2, RZ ;                             /* 0x000000ff00027202 */
        /*fff0*/                   IADD3 R2, R2, 0x1, RZ ;                  /* 0x0000000102027810 */
        /*10000*/                  HFMA2 R3, R3, R4, R5;                    /* 0x0000000403037231 */
        /*10010*/              @P1 BRA 0xfff0 ;                             /* 0x0000000000001947 */
        /*10020*/                  EXIT ;                                   /* 0x000000000000794d */
        /*10030*/                  BRA.U !UP0, 0x20 ;                       /* 0x0000000000007947 */
        /*10040*/                  BRA 0x10040;                             /* 0x0000000000007947 */
\t\tFunction : another
        /*0000*/                   BRA 0x0 ;                                /* 0x0000000000007947 */
"""


def test_the_loop_is_read_from_the_listing_at_any_address():
    """Addresses past 0xffff (where Triton's own disassembler stops), predicates, no space before ';',
    the encodings' comments; the loop is the longest branch back before the kernel's end: an
    out-of-line block after its EXIT that branches back further, and a second function, do not count."""
    from labkit.kernels.issue import loop_counts, parse_sass
    code = parse_sass(_LISTING)
    assert [address for address, _ in code] == [0, 0x10, 0x20, 0xfff0, 0x10000, 0x10010, 0x10020, 0x10030, 0x10040]
    assert code[5] == (0x10010, "@P1 BRA 0xfff0 ;")
    assert loop_counts(code) == collections.Counter({"IADD3": 1, "HFMA2": 1, "BRA": 1})
    with pytest.raises(ValueError, match="no loop"):
        loop_counts(code[:4])
