"""How many instructions a GPU kernel issues, counted without a GPU.

Triton compiles a kernel for an NVIDIA GPU that the machine does not have
(``runtime.compile_for_gpu``), down to the GPU's machine code (SASS), and NVIDIA's ``cuobjdump``
(which Triton ships) lists it: the instructions in the kernel's main loop are what each warp
issues per step. A multiprocessor issues at most one warp instruction per scheduler per cycle
(``labkit.hardware.IssueRate``; ``labkit.presets.ISSUE_RATES`` has an H100's). So a kernel's
instructions set a floor on its time, as its bytes over the memory bandwidth do, and it takes at
least the larger of the two.

Dequantizing kernels are where the second floor bites. A decode step's fp16 matrix-vector product
spends about one multiply-add per 2 bytes it reads. An INT4 kernel reads a quarter of those bytes,
but for each 4-bit code it still unpacks, multiplies and accumulates. If that costs more
instructions than a GPU can issue in the time its memory takes to deliver half a byte, the kernel
is bound by its instructions, not its bytes.

- ``machine_code(cubin)``: a compiled kernel's instructions and their addresses (``parse_sass``).
- ``loop_counts(code)``: the instructions of the longest loop in them, by opcode;
  ``loop_instructions(kernel, constexprs, types, num_warps)``: a kernel's, compiled for an H100.
- ``int4_loop(...)``: the lab's INT4 kernel (``labkit.kernels.int4_matmul``, either form) at
  given launch parameters (its GPU defaults unless told): the loop by opcode, and instructions per
  4-bit code; ``int4_loops`` for several at once.

Where Triton runs in its interpreter (on a CPU: ``triton.jit`` then makes interpreted functions,
which do not compile), ``int4_loop`` counts in a subprocess:
``python -m labkit.kernels.issue '[[FORM, BLOCK_N, GROUPS, WARPS, STAGES, GROUP, DTYPE], ...]'`` prints the
counts as JSON (``int4_loops`` counts several configurations in one such process).

The count is the loop's body once. A loop that the compiler unrolls holds several steps' work in
one body; the lab's INT4 loop has a step count known only at run time, and is not unrolled. A
pipelined loop (``num_stages`` of 2 or more) is counted by its steady state: the loop that starts
one step's copies and computes another's, without the steps before and after it that fill and drain
the pipeline.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

from labkit.kernels.runtime import compile_for_gpu, interpreted
from labkit.validate import is_int

DTYPES = ("fp16", "bf16", "fp32")


BRANCH = re.compile(r"\b(?:BRA|JMP)(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?(0x[0-9a-f]+)")  # its target's address


def machine_code(cubin: bytes) -> list[tuple[int, str]]:
    """The machine instructions (SASS) of a compiled kernel, as (address, text), listed by
    ``cuobjdump -sass`` (``parse_sass``). (Triton's own disassembler, ``triton.tools.disasm``,
    stops at address 0xffff: the end of a kernel of more than 4,096 instructions is lost.)"""
    from triton import knobs
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        listing = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", file.name], capture_output=True, text=True,
                                 check=True).stdout
    return parse_sass(listing)


def parse_sass(listing: str) -> list[tuple[int, str]]:
    """The instructions of the first function in a ``cuobjdump -sass`` listing, as (address, text):
    a line ``/*10a0*/  @!P0 BRA 0x23a0 ;  /* 0x... */`` gives ``(0x10a0, "@!P0 BRA 0x23a0 ;")``."""
    sections = listing.split("Function :")
    body = sections[1] if len(sections) > 1 else listing
    return [(int(address, 16), text.strip()) for address, text in
            re.findall(r"^\s*/\*([0-9a-f]+)\*/\s*([^;\n]*;)", body, re.MULTILINE)]


def loop_counts(code: list[tuple[int, str]]) -> collections.Counter:
    """The instructions of the longest loop in ``code`` (as ``parse_sass`` gives it), by opcode:
    from the target of a branch back to that branch, each one instruction that a warp issues per
    step. Only branches before the first unconditional ``EXIT`` count (after it come out-of-line
    blocks, which may branch back into a loop). ValueError if there is no loop."""
    end_of_kernel = next((address for address, text in code if re.match(r"EXIT\b", text)), float("inf"))
    loops = [(int(m.group(1), 16), address) for address, text in code  # a branch back over at least one instruction
             if address < end_of_kernel and (m := BRANCH.search(text)) and int(m.group(1), 16) < address]
    if not loops:
        raise ValueError("no loop in the machine code")
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].rstrip(";")
                               for address, text in code if start <= address <= end)


def loop_instructions(kernel, constexprs: dict, types: dict[str, str], num_warps: int) -> collections.Counter:
    """The machine instructions (SASS) in the loop of ``kernel`` compiled for an H100 (sm_90), by
    opcode (``loop_counts``; the longest loop, if there are several). ``types``: as
    ``compile_for_gpu`` takes them. ValueError if the kernel has no loop. Needs Triton compiling,
    not interpreting."""
    code = machine_code(compile_for_gpu(kernel, types, constexprs, 90, num_warps=num_warps).asm["cubin"])
    try:
        return loop_counts(code)
    except ValueError:
        raise ValueError(f"{kernel.__name__} compiled without a loop") from None


def int4_loop(form: str | None = None, block_n: int | None = None, groups: int | None = None,
              num_warps: int | None = None, num_stages: int | None = None, group_size: int = 64,
              dtype: str = "fp16", timeout_s: float = 120) -> tuple[collections.Counter, float]:
    """The loop of the lab's INT4 kernel in ``form`` ("gemv" or "dot") compiled for an H100 at these
    launch parameters (the GPU defaults of ``int4_matmul.launch_parameters`` where None), for one
    row of ``dtype`` activations with zero points: its instructions by opcode, and per 4-bit code
    (a step's instructions over the real codes each thread handles in it, padding left out). In this
    process if Triton compiles here, else in a subprocess. ValueError for a group size the kernel
    does not take."""
    return int4_loops([dict(form=form, block_n=block_n, groups=groups, num_warps=num_warps, num_stages=num_stages,
                            group_size=group_size, dtype=dtype)], timeout_s)[0]


def int4_loops(configs: list[dict], timeout_s: float = 120) -> list[tuple[collections.Counter, float]]:
    """``int4_loop`` for each of ``configs`` (dicts of its arguments but ``timeout_s``), all compiled in
    one process: where Triton interprets, one subprocess for all, stopped after ``timeout_s``."""
    resolved = [_launch(**config) for config in configs]
    if interpreted():
        counts = _count_in_subprocess(resolved, timeout_s)
    else:
        from labkit.kernels.int4_matmul import KERNELS, kernel_constants, kernel_types
        counts = [loop_instructions(KERNELS[form], kernel_constants(form, 1, group, block_n, groups, 1, True, stages),
                                    kernel_types(dtype), warps)
                  for form, block_n, groups, warps, stages, group, dtype in resolved]
    return [(c, sum(c.values()) / (block_n * groups * group / (32 * warps)))
            for c, (_, block_n, groups, warps, _, group, _) in zip(counts, resolved)]


def _launch(form: str | None = None, block_n: int | None = None, groups: int | None = None,
            num_warps: int | None = None, num_stages: int | None = None, group_size: int = 64,
            dtype: str = "fp16") -> list:
    """``[form, block_n, groups, num_warps, num_stages, group_size, dtype]`` checked, with the GPU
    defaults filled in."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: the kernel takes {', '.join(DTYPES)}")
    if not is_int(group_size) or group_size < 8 or group_size % 8:
        raise ValueError(f"group_size={group_size!r} must be a positive multiple of 8")
    from labkit.kernels.int4_matmul import launch_parameters
    launch = launch_parameters(group_size, form, block_n, groups, 1, num_warps, num_stages, on_gpu=True)
    return [launch.form, launch.block_n, launch.groups, launch.num_warps, launch.num_stages, int(group_size), dtype]


def _count_in_subprocess(configs: list[list], timeout_s: float) -> list[collections.Counter]:
    """``int4_loops``'s counts from a fresh Python whose Triton compiles; it and the compiler and
    disassembler it starts are stopped if it outlasts ``timeout_s``."""
    child = subprocess.Popen([sys.executable, "-m", "labkit.kernels.issue", json.dumps(configs)], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                             env={**os.environ, "TRITON_INTERPRET": "0"})
    try:
        out, err = child.communicate(timeout=timeout_s)
    except BaseException as stopped:  # the time limit, or Ctrl-C: the child's own session would outlive it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        if isinstance(stopped, subprocess.TimeoutExpired):
            raise RuntimeError(f"counting the INT4 kernel's instructions took over {timeout_s:g} s; stopped") from None
        raise
    if child.returncode != 0:
        raise RuntimeError(f"counting the INT4 kernel's instructions failed: {err.strip()[-2000:]}")
    return [collections.Counter(counts) for counts in json.loads(out)]


if __name__ == "__main__":
    keys = ("form", "block_n", "groups", "num_warps", "num_stages", "group_size", "dtype")
    loops = int4_loops([dict(zip(keys, config)) for config in json.loads(sys.argv[1])])
    print(json.dumps([counts for counts, _ in loops]))
