"""The machine code a cubin holds, apart from its line tables, PTX copy and other metadata.

Two builds of a kernel can differ in source (fma statements written in another order, an
if constexpr that folds away) and still compile to the same SASS: ptxas schedules
independent instructions its own way. A timing of two such builds measures only noise, so
the experiment jobs compare the builds' code first (notes/gemm.md, thirty-eighth session).
The cubin is an ELF file; its kernels' instructions are the sections named ``.text.<kernel>``.
Read here without nvdisasm, which the machines without a GPU do not have.
"""

from __future__ import annotations

import hashlib
import struct
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
