"""How many instructions a GPU kernel issues, counted without a GPU.

Triton compiles a kernel for an NVIDIA GPU that the machine does not have
(``runtime.compile_for_gpu``), down to the GPU's machine code (SASS). The kernel's main loop then
lists what each warp issues per step. An SM issues at most one warp instruction per scheduler per cycle. So a kernel's
instructions set a floor on its time, as its bytes over the memory bandwidth do, and it takes at
least the larger of the two.

Dequantizing kernels are where the second floor bites. A decode step's fp16 matrix-vector product
spends one multiply-add per 2 bytes it reads. An INT4 kernel reads a quarter of those bytes, but
for each 4-bit code it still unpacks, subtracts the zero point, scales and multiplies. If that
costs more instructions than a GPU can issue in the time its memory takes to deliver half a byte,
the kernel is bound by its instructions, not its bytes.

- ``loop_instructions(kernel, constexprs, types, num_warps)``: the loop's instructions by opcode.
- ``int4_loop(...)``: the same for the lab's INT4 kernel (``labkit.kernels.int4_matmul``) at given
  launch parameters.
- ``per_code(counts, ...)``: instructions per 4-bit code.
- ``IssueRate``: a GPU's peak warp-instruction rate (``H100`` from its datasheet).

Where Triton runs in its interpreter (on a CPU: ``triton.jit`` then makes interpreted functions,
which do not compile), ``int4_loop`` counts in a subprocess:
``python -m labkit.kernels.issue BLOCK_N GROUPS WARPS GROUP`` prints the counts as JSON.
The floor assumes that every scheduler issues at every cycle, which no kernel quite does: a
kernel near its floor is bound by its instructions.
"""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from labkit.kernels.runtime import compile_for_gpu, interpreted

INT4_TYPES = {"X": "*fp16", "Packed": "*u8", "Scales": "*fp16", "Zeros": "*fp16", "Out": "*fp16"}


@dataclass(frozen=True)
class IssueRate:
    """A GPU's peak instruction issue: ``sms`` multiprocessors of ``schedulers`` each issuing one
    warp instruction (32 threads) per cycle at ``clock_hz``."""
    name: str
    sms: int
    schedulers: int
    clock_hz: float

    @property
    def warp_instructions_per_s(self) -> float:
        return self.sms * self.schedulers * self.clock_hz

    def floor_s(self, thread_instructions: float) -> float:
        """The least time issuing ``thread_instructions`` (summed over threads) can take: 32 threads a warp."""
        return thread_instructions / 32 / self.warp_instructions_per_s


# NVIDIA H100 Tensor Core GPU datasheet and architecture whitepaper: the SXM5 part has 132 SMs,
# 4 warp schedulers each (one warp instruction a cycle), a boost clock of 1.98 GHz
H100 = IssueRate("H100 SXM", sms=132, schedulers=4, clock_hz=1.98e9)


def loop_instructions(kernel, constexprs: dict, types: dict[str, str], num_warps: int) -> collections.Counter:
    """The machine instructions (SASS) in the loop of ``kernel`` compiled for an H100 (sm_90), by
    opcode: the lines from the loop's label to the branch back to it, each one instruction a warp
    issues per step. Triton's own disassembler reads them from the cubin (it runs ``cuobjdump``,
    which Triton ships). ``types``: as ``compile_for_gpu`` takes them. Needs Triton compiling, not
    interpreting."""
    from triton.tools.disasm import get_sass
    compiled = compile_for_gpu(kernel, types, constexprs, 90, num_warps=num_warps)
    lines = [line.strip() for line in get_sass(compiled.asm["cubin"]).splitlines()]
    labels, code = {}, []  # a label's position in code; code: each instruction's text
    for line in lines:
        if re.fullmatch(r"LBB\d+:", line):
            labels[line[:-1]] = len(code)
        elif ";" in line:
            code.append(line.split("\t")[-1])
    loops = [(labels[m.group(1)], end) for end, text in enumerate(code)
             if (m := re.search(r"\bBRA (LBB\d+);", text)) and labels.get(m.group(1), end + 1) <= end]
    if not loops:
        raise ValueError(f"{kernel.__name__} compiled without a loop")
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for text in code[start:end + 1])


def int4_loop(block_n: int = 4, groups: int = 8, num_warps: int = 4, group_size: int = 64,
              timeout_s: float = 120) -> collections.Counter:
    """The loop instructions of the lab's INT4 kernel at these launch parameters (one row of fp16
    activations, zero points): in this process if Triton compiles here, else in a subprocess."""
    if not interpreted():
        from labkit.kernels.int4_matmul import int4_matmul_kernel
        constexprs = dict(HAS_ZEROS=True, ROWS=1, BLOCK_N=block_n, GROUP=group_size, GROUPS=groups, SPLIT_K=1)
        return loop_instructions(int4_matmul_kernel, constexprs, INT4_TYPES, num_warps)
    args = [str(v) for v in (block_n, groups, num_warps, group_size)]
    ran = subprocess.run([sys.executable, "-m", "labkit.kernels.issue", *args], capture_output=True, text=True,
                         timeout=timeout_s, env={**os.environ, "TRITON_INTERPRET": "0"})
    if ran.returncode != 0:
        raise RuntimeError(f"counting the INT4 kernel's instructions failed: {ran.stderr.strip()[-2000:]}")
    return collections.Counter(json.loads(ran.stdout))


def per_code(counts: collections.Counter, block_n: int = 4, groups: int = 8, num_warps: int = 4,
             group_size: int = 64) -> float:
    """Instructions per 4-bit code: a step's instructions over the codes each thread handles in it."""
    return sum(counts.values()) / (block_n * groups * group_size / (32 * num_warps))


if __name__ == "__main__":
    print(json.dumps(int4_loop(*map(int, sys.argv[1:5]))))
