"""The machine code a cubin holds, apart from its line tables, PTX copy and other metadata.

Two builds of a kernel can differ in source (fma statements written in another order, an
if constexpr that folds away) and still compile to the same SASS: ptxas schedules
independent instructions its own way. A timing of two such builds measures only noise, so
the experiment jobs compare the builds' code first (notes/gemm.md, thirty-eighth session).
The cubin is an ELF file; its kernels' instructions are the sections named ``.text.<kernel>``,
digested here without any CUDA tool. Reading the instructions themselves takes nvdisasm
(`listing`), which the `nvidia-cuda-nvdisasm` wheel provides on any machine.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


def text_sections(cubin: Path | bytes) -> dict[str, bytes]:
    """{section name: bytes} of every ``.text.*`` section of an ELF64 little-endian cubin."""
    data = cubin if isinstance(cubin, bytes) else Path(cubin).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not an ELF64 little-endian file (a cubin for sm_90a is one)")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]  # sh_offset of the section-name string table
    out = {}
    for name_off, _type, _flags, _addr, offset, size, *_ in headers:
        start = names_at + name_off
        name = data[start:data.index(b"\0", start)].decode()
        if name.startswith(".text."):
            out[name] = data[offset:offset + size]
    return out


def digest(cubin: Path | bytes) -> str:
    """A short hash of every kernel's instructions (names included): equal digests, same SASS."""
    h = hashlib.sha256()
    for name, code in sorted(text_sections(cubin).items()):
        h.update(name.encode() + b"\0" + len(code).to_bytes(8, "little") + code)
    return h.hexdigest()[:12]


# ---- Reading the instructions (with nvdisasm, where there is one) ----
#
# Each Hopper instruction is 128 bits; nvdisasm -hex prints them as two 64-bit words. The
# scheduling controls ptxas sets sit in the high word (bit i of the high word is bit 64 + i of
# the instruction), as the Volta-and-later encoding has them: the cycles the scheduler stalls
# after issuing it, the yield bit, the scoreboard it sets when its result is written or its
# operands read (7: none), the scoreboards it waits on, and the operand reuse flags (bit 0: a,
# bit 1: b, bit 2: c). notes/gemm.md (twenty-ninth and thirty-eighth sessions) reads them.


@dataclass(frozen=True)
class Control:
    stall: int
    yield_bit: int
    write_barrier: int | None
    read_barrier: int | None
    wait_mask: int
    reuse: int


def control(high_word: int) -> Control:
    """The scheduling controls in an instruction's high 64-bit word."""
    wb, rb = (high_word >> 46) & 7, (high_word >> 49) & 7
    return Control(stall=(high_word >> 41) & 0xF, yield_bit=(high_word >> 45) & 1, write_barrier=None if wb == 7 else wb,
                   read_barrier=None if rb == 7 else rb, wait_mask=(high_word >> 52) & 0x3F, reuse=(high_word >> 58) & 0xF)


@dataclass(frozen=True)
class Instruction:
    kernel: str
    address: int
    text: str
    control: Control


_SECTION = re.compile(r"^\s*\.section\s+\.text\.(\w+)")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
_HIGH_WORD = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")


def parse_listing(text: str) -> list[Instruction]:
    """The instructions of `nvdisasm -c -hex` output, with their controls decoded."""
    out, kernel, lines = [], "", text.splitlines()
    for i, line in enumerate(lines):
        if m := _SECTION.match(line):
            kernel = m.group(1)
        elif (m := _INSTRUCTION.match(line)) and i + 1 < len(lines) and (h := _HIGH_WORD.match(lines[i + 1])):
            out.append(Instruction(kernel, int(m.group(1), 16), m.group(2), control(int(h.group(1), 16))))
    return out


def find_nvdisasm() -> str | None:
    """nvdisasm on the PATH, else the one the `nvidia-cuda-nvdisasm` wheel installs (it runs on
    a machine without a GPU or a CUDA toolkit)."""
    tool = shutil.which("nvdisasm")
    if tool:
        return tool
    for base in map(Path, sys.path):
        for cand in sorted(base.glob("nvidia/cu*/bin/nvdisasm")) + sorted(base.glob("nvidia/cuda_nvdisasm/bin/nvdisasm")):
            if os.access(cand, os.X_OK):
                return str(cand)
    return None


def listing(cubin: Path, nvdisasm: str | None = None) -> list[Instruction]:
    """Every instruction of a cubin (nvdisasm -c -hex), controls decoded."""
    tool = nvdisasm or find_nvdisasm()
    if tool is None:
        raise FileNotFoundError("no nvdisasm: put one on the PATH or pip install nvidia-cuda-nvdisasm")
    return parse_listing(subprocess.run([tool, "-c", "-hex", str(cubin)], capture_output=True, text=True,
                                        check=True).stdout)
