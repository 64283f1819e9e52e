"""Scheduling hints in a compiled cubin: long runs of FFMA made to yield (opt-in build step).

The FP8 GEMM's consumer warpgroups take turns on the tensor cores: while one promotes a
finished k-block part into its fp32 sum (a run of 64 FFMAs, cuda/gemm/block_scaled_mma.cuh),
the other's wgmmas should be running, and its next wgmma issue, wait and barrier wait
compete for the same warp schedulers. ptxas gives every other FFMA of such a run the
operand-reuse flag and, with it, the control bit that keeps the scheduler on the same warp
(the reuse cache only holds within one warp's consecutive instructions). DeepGEMM reports
10%+ on some shapes from clearing both on such FFMAs, so the other warpgroup's instructions
issue sooner; this module applies that to our cubins so we can measure it on ours (a knob:
epserve/ffn/gemm_fp8.py). Only hints change: each instruction still reads its registers;
without the reuse flag it reads them from the register file, so results are bitwise the same.

Hopper (sm_90) encodes an instruction in 16 bytes, two little-endian 64-bit words. In the
low word, bits 0-11 are the opcode (0x223: FFMA with four register operands) and bits
16-23 the destination register; in the high word, bit 45 is the yield control bit (set:
stay on this warp) and bits 58-61 are the reuse flags of the source operand slots. These
positions were read off nvdisasm's listing of our own kernels (tests/cpu/test_sass_yield.py
holds a hand-made instruction stream to them).
"""

from __future__ import annotations

import struct

FFMA_RRR = 0x223
OPCODE_MASK = 0xFFF
YIELD_BIT = 1 << 45
REUSE_BITS = 0xF << 58
MIN_RUN = 8  # FFMAs in a row: the promotion's runs are 62-64 long; short runs are left alone
DEFINE = "EPSERVE_SASS_YIELD_FFMA"  # the build define that asks for this step (runtime/build.py)


def _sections(elf: bytes):
    """(name, offset, size) of every section of a 64-bit little-endian ELF image."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_off = headers[shstrndx][4]
    for name_idx, _type, _flags, _addr, offset, size in headers:
        end = elf.index(b"\0", names_off + name_idx)
        yield elf[names_off + name_idx:end].decode(), offset, size


def _patch_text(code: bytearray) -> int:
    """Patches one .text section in place; returns how many instructions changed."""
    n = len(code) // 16
    words = [struct.unpack_from("<QQ", code, 16 * i) for i in range(n)]
    changed = 0
    i = 0
    while i < n:
        if words[i][0] & OPCODE_MASK != FFMA_RRR:
            i += 1
            continue
        j = i
        while j < n and words[j][0] & OPCODE_MASK == FFMA_RRR:
            j += 1
        if j - i >= MIN_RUN:
            changed += _patch_run(code, words, i, j)
        i = j
    return changed


def _patch_run(code: bytearray, words, begin: int, end: int) -> int:
    # DeepGEMM's rule: an FFMA with a reuse flag loses it, and yields, when its destination
    # is new in the run or repeats the previous (reused) FFMA's; in a promotion every
    # destination is new, so every flagged FFMA of the run yields.
    seen: set[int] = set()
    last_reused, last_dst = False, -1
    changed = 0
    for k in range(begin, end):
        lo, hi = words[k]
        dst = (lo >> 16) & 0xFF
        reused = bool(hi & REUSE_BITS)
        if reused and (dst not in seen or (last_reused and dst == last_dst)):
            hi &= ~(REUSE_BITS | YIELD_BIT)
            struct.pack_into("<Q", code, 16 * k + 8, hi)
            reused = False
            changed += 1
        seen.add(dst)
        last_reused, last_dst = reused, dst
    return changed


def yield_ffma_runs(cubin: bytes) -> tuple[bytes, int]:
    """The cubin with every long FFMA run's reuse-flagged FFMAs made to yield; and how many
    instructions changed (0: nothing matched, which the caller should treat as a failure of
    the encoding assumptions on a new toolkit, not as success)."""
    out = bytearray(cubin)
    changed = 0
    for name, offset, size in list(_sections(cubin)):
        if name.startswith(".text."):
            code = bytearray(out[offset:offset + size])
            changed += _patch_text(code)
            out[offset:offset + size] = code
    return bytes(out), changed
