"""The move kernel's expand blocks spin on the peers' send blocks, so a move grid that does
not fit on the GPU at once can hang the dispatch. The host launches at most one send block
and two expand blocks an SM (epserve/dispatch/direct.py: send_blocks_max = SMs,
expand_blocks = 2 x SMs); here, without a GPU, each build of the move kernel must leave
room for three blocks an SM in Hopper's register file (ptxas's report of the compiled
kernel, rounded as the hardware allocates)."""

import re

import pytest

from epserve.runtime import build, kernels

REGISTERS_PER_SM = 65536
ALLOCATION_UNIT = 256  # registers, per warp
MOVE_THREADS = 256
BLOCKS_PER_SM = 3  # one send + two expand


def move_registers(log: str, kernel: str) -> int:
    per_kernel = re.split(r"Compiling entry function '", log)
    for part in per_kernel:
        if part.startswith(kernel + "'"):
            return int(re.search(r"Used (\d+) registers", part).group(1))
    raise AssertionError(f"{kernel} is not in the ptxas report")


@pytest.mark.parametrize("variant", ["dispatch", "dispatch_quantize"])
def test_move_grid_fits_three_blocks_an_sm(variant, tmp_path, monkeypatch):
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source, defines = kernels.VARIANTS[variant]
    regs = move_registers(build.compile_source(source, defines).log, "epserve_dispatch_move")
    per_warp = -(-regs * 32 // ALLOCATION_UNIT) * ALLOCATION_UNIT
    per_block = per_warp * (MOVE_THREADS // 32)
    assert REGISTERS_PER_SM // per_block >= BLOCKS_PER_SM, (variant, regs)


# Hopper (H100, H200): 227 KB a block at most, 228 KB an SM.
H200_BLOCK_OPTIN, H200_PER_SM = 232448, 233472


def test_own_row_staging_leaves_three_blocks_an_sm():
    from epserve.dispatch.direct import MOVE_BLOCKS_PER_SM, RESERVED_SHARED_PER_BLOCK, own_row_staging_bytes
    from epserve.ffn.fp8 import packed_row_bytes

    static = 1100  # about the move kernel's own (expand_tokens' source tables, the last-block flag)
    dsv3 = packed_row_bytes(7168) // 2
    assert own_row_staging_bytes(dsv3, static, H200_BLOCK_OPTIN, H200_PER_SM) == 8 * packed_row_bytes(7168)
    for cols in (1024, 2048, 4096, 7168, 8192, 16384):
        hidden = packed_row_bytes(cols) // 2
        staging = own_row_staging_bytes(hidden, static, H200_BLOCK_OPTIN, H200_PER_SM)
        assert staging in (0, 8 * packed_row_bytes(cols))
        assert MOVE_BLOCKS_PER_SM * (staging + static + RESERVED_SHARED_PER_BLOCK) <= H200_PER_SM
    # rows too wide for three blocks' staging: none, the warps store them
    assert own_row_staging_bytes(packed_row_bytes(16384) // 2, static, H200_BLOCK_OPTIN, H200_PER_SM) == 0
