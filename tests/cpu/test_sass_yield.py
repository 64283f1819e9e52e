"""epserve.runtime.sass_yield on a hand-made instruction stream: which FFMAs change, and that
nothing else does."""

import struct

from epserve.runtime import sass_yield


def _ins(opcode, dst, reuse):
    lo = opcode | (dst << 16)
    hi = 0x000FC20000000000 | ((sass_yield.YIELD_BIT | (1 << 59)) if reuse else 0)
    return struct.pack("<QQ", lo, hi)


def test_long_ffma_runs_lose_reuse_and_yield_short_ones_and_others_stay():
    run = b"".join(_ins(sass_yield.FFMA_RRR, d, d % 2 == 1) for d in range(10))
    short = b"".join(_ins(sass_yield.FFMA_RRR, d, True) for d in range(3))
    other = _ins(0x7A02, 1, True)
    code = bytearray(run + other + short)
    changed = sass_yield._patch_text(code)
    assert changed == 5
    hints = sass_yield.REUSE_BITS | sass_yield.YIELD_BIT
    for k in range(10):
        lo, hi = struct.unpack_from("<QQ", code, 16 * k)
        lo0, hi0 = struct.unpack_from("<QQ", run, 16 * k)
        assert hi & hints == 0 and (lo, hi) == (lo0, hi0 & ~hints)
    assert bytes(code[160:]) == other + short
