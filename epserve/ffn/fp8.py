"""FP8 expert weights and activations on the GPU (issue 16): e4m3 values with fp32 block
scales, as DeepSeek-V3 is served and DeepGEMM computes.

    from epserve import quantize_weights
    fp8 = quantize_weights(w13, w2)   # once, when the weights are loaded

The convention (cuda/common/fp8.cuh; bit-exact NumPy model in epserve/check/fp8_reference.py):
a block whose largest magnitude is amax stores scale = amax / 448 (fp32) and values
q = e4m3(x * (448 / amax)), rounded to nearest even and saturated at +-448; amax is floored
at 1e-10, so an all-zero block stores zeros. Weights take one scale per 128 x 128 block,
activations one per row and 128-column block.

e4m3 arrays are CuPy uint8 arrays holding the e4m3 bytes (CuPy has no FP8 arithmetic); on the
host, ``cupy.asnumpy(q).view(ml_dtypes.float8_e4m3fn)`` gives their values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cupy
import numpy as np

from epserve.arrays import BF16
from epserve.check.fp8_reference import BLOCK, scale_ld
from epserve.ffn.gemm import run
from epserve.runtime import kernels
from epserve.runtime.kernel_structs import i32, launch_arg
from epserve.runtime.launch import pointer, sm_count


@dataclass(frozen=True)
class FP8Weights:
    """One rank's expert weights in e4m3 with 128 x 128 block scales (float32), as the FP8
    GEMMs take them: each array keeps the layout of the bf16 weight it came from.

    w13          [E, 2I, H] uint8 (e4m3)   gate rows [0, I), up rows [I, 2I)
    w13_scales   [E, 2I / 128, H / 128] float32
    w2           [E, H, I] uint8 (e4m3)
    w2_scales    [E, H / 128, I / 128] float32
    """

    w13: cupy.ndarray
    w13_scales: cupy.ndarray
    w2: cupy.ndarray
    w2_scales: cupy.ndarray

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2]


def quantize_weights(w13, w2) -> FP8Weights:
    """Expert weights w13 [E, 2I, H] and w2 [E, H, I] (CuPy bf16, C-contiguous; H and I
    multiples of 128) to FP8Weights, on the current device and stream. Run once per set of
    weights: the FP8 GEMMs read the result as it is."""
    if w13.ndim != 3 or w2.ndim != 3 or w13.shape[0] != w2.shape[0] or w13.shape[1] != 2 * w2.shape[2] \
            or w13.shape[2] != w2.shape[1]:
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I]; got {w13.shape} and {w2.shape}")
    w13_q, w13_s = quantize_blocks(w13)
    w2_q, w2_s = quantize_blocks(w2)
    return FP8Weights(w13_q, w13_s, w2_q, w2_s)


def quantize_blocks(w):
    """w [..., R, C] bf16 (R, C multiples of 128) -> (q uint8 [..., R, C], scales float32
    [..., R / 128, C / 128]): one scale per 128 x 128 block."""
    *lead, R, C = w.shape
    _require_blocks(R, C)
    _require_bf16(w)
    q = cupy.empty(w.shape, np.uint8)
    scales = cupy.empty((*lead, R // BLOCK, C // BLOCK), np.float32)
    row_blocks = int(np.prod(lead, dtype=np.int64)) * (R // BLOCK)
    blocks = row_blocks * (C // BLOCK)
    if blocks:
        fn = kernels.function("quantize_fp8", "epserve_quantize_blocks_fp8")
        grid = min(blocks, sm_count(cupy.cuda.runtime.getDevice()) * 8)
        fn((grid,), (256,), (w, np.int64(row_blocks), np.int32(C), q, scales))
    return q, scales


def quantize_rows(x, q=None, scales=None, rows: int | None = None):
    """x [M, K] bf16 (K a multiple of 128) -> (q uint8 [M, K], scales float32 [K / 128, ld]):
    one scale per row and 128-column block, stored k-block-major with ld = scale_ld(M) (M
    rounded up to 4), the layout the FP8 GEMMs read A's scales in. q and scales may be given
    (at capacity: ld at least scale_ld(rows)); `rows` quantizes only the first rows."""
    M, K = x.shape
    rows = M if rows is None else rows
    _require_blocks(BLOCK, K)
    _require_bf16(x)
    q = cupy.empty((M, K), np.uint8) if q is None else q
    scales = cupy.zeros((K // BLOCK, scale_ld(M)), np.float32) if scales is None else scales
    if rows:
        run([quantize_rows_spec(x, q, scales, rows)])
    return q, scales


def quantize_rows_spec(x, q, scales, rows: int) -> tuple:
    """quantize_rows' launch as a spec (kernel, grid, block, args, shared_mem) for a
    runtime.launch.LaunchSequence: rows [0, rows) of x."""
    K = x.shape[1]
    _require_blocks(BLOCK, K)
    _require_bf16(x)
    if scales.shape[0] != K // BLOCK or scales.shape[1] < rows or scales.shape[1] % 4:
        raise ValueError(f"scales {scales.shape} cannot hold [{K // BLOCK}, >= {rows}] with a pitch of 4n floats")
    if q.dtype != np.uint8 or q.shape[1] != K or q.shape[0] < rows:
        raise ValueError(f"q must be uint8 [>= {rows}, {K}], got {q.dtype} {q.shape}")
    fn = kernels.function("quantize_fp8", "epserve_quantize_rows_fp8")
    warps = max(1, rows * (K // BLOCK))
    grid = max(1, min((warps + 7) // 8, sm_count(cupy.cuda.runtime.getDevice()) * 16))
    return (fn, (grid,), (256,), (x, _i64(rows), i32(K), q, scales, _i64(scales.shape[1])), 0)


PACKED_ROW_ALIGN = 128  # bytes: a packed row starts on a 128-byte line
UNPACK_TILE = 32  # kUnpackTile in quantize_fp8.cu: rows and k-blocks of one transposed tile


def packed_row_bytes(hidden: int) -> int:
    """Bytes of one packed FP8 row (the FP8 dispatch's unit): hidden e4m3 values, then one
    fp32 scale per 128 of them, then zeros to a multiple of 128 bytes (the kernels that
    quantize rows write them). On whole lines, the dispatch's fan-out of rows into expert rows
    ran 4-7% faster than with rows padded to 16 bytes only (dsv3: 7424 bytes, not 7392;
    notes/dispatch.md). The dispatch moves 16-byte chunks and GEMM 1's tensor map needs a
    pitch of 16n bytes: both hold."""
    _require_blocks(BLOCK, hidden)
    return -(-(hidden + hidden // BLOCK * 4) // PACKED_ROW_ALIGN) * PACKED_ROW_ALIGN


PACKED_GROUP_KB = 8  # k-blocks a warp of the packed quantizer takes (cuda/ffn/quantize_fp8.cu kPackedGroupKB)


def quantize_rows_packed_spec(x, packed, rows: int) -> tuple:
    """x [>= rows, H] bf16 -> packed [>= rows, packed_row_bytes(H)] uint8: each row's e4m3
    values then its scales (the values and scales of quantize_rows, bit for bit), as a spec
    for a runtime.launch.LaunchSequence."""
    K = x.shape[1]
    _require_blocks(BLOCK, K)
    _require_bf16(x)
    row_bytes = packed_row_bytes(K)
    if packed.dtype != np.uint8 or packed.shape[1] != row_bytes or packed.shape[0] < rows \
            or not packed.flags.c_contiguous:
        raise ValueError(f"packed must be C-contiguous uint8 [>= {rows}, {row_bytes}], got {packed.dtype} "
                         f"{packed.shape}")
    if x.data.ptr % 16:
        raise ValueError("x must start on a 16-byte boundary (the quantizer loads 16-byte chunks of it)")
    fn = kernels.function("quantize_fp8", "epserve_quantize_rows_packed_fp8")
    warps = max(1, rows * -(-(K // BLOCK) // PACKED_GROUP_KB))  # a warp per row's group of k-blocks
    grid = max(1, min((warps + 7) // 8, sm_count(cupy.cuda.runtime.getDevice()) * 8))
    return (fn, (grid,), (256,), (x, _i64(rows), i32(K), packed, _i64(row_bytes)), 0)


def unpack_row_scales_spec(packed, hidden: int, scales, rows: int, row_count=None) -> tuple:
    """The scales of packed rows [>= rows, packed_row_bytes(hidden)] (uint8) into scales
    [hidden / 128, ld] (k-block-major, ld >= rows), for the first rows, or only the first
    row_count[0] of them (a device int32, e.g. the last of expert_offsets)."""
    row_bytes = packed_row_bytes(hidden)
    if packed.dtype != np.uint8 or packed.shape[1] != row_bytes or packed.shape[0] < rows:
        raise ValueError(f"packed must be uint8 [>= {rows}, {row_bytes}], got {packed.dtype} {packed.shape}")
    if scales.shape[0] != hidden // BLOCK or scales.shape[1] < rows or scales.shape[1] % 4:
        raise ValueError(f"scales {scales.shape} cannot hold [{hidden // BLOCK}, >= {rows}] with a pitch of 4n floats")
    fn = kernels.function("quantize_fp8", "epserve_unpack_row_scales_fp8")
    tiles = -(-rows // UNPACK_TILE) * -(-(hidden // BLOCK) // UNPACK_TILE)  # kUnpackTile rows x k-blocks each
    grid = max(1, min(tiles, sm_count(cupy.cuda.runtime.getDevice()) * 8))
    return (fn, (grid,), (256,), (packed, _i64(rows), i32(hidden), _i64(row_bytes), scales, _i64(scales.shape[1]),
                                  pointer(row_count)), 0)


@functools.lru_cache(maxsize=1024)
def _i64(value: int):
    return launch_arg(np.full(1, value, np.int64))


def _require_blocks(R: int, C: int) -> None:
    if R % BLOCK or C % BLOCK:
        raise ValueError(f"FP8 blocks are {BLOCK} x {BLOCK}: a [.., {R}, {C}] array is not made of whole blocks")


def _require_bf16(a) -> None:
    if a.dtype != BF16 or not a.flags.c_contiguous:
        raise ValueError(f"expected a C-contiguous bf16 CuPy array, got {a.dtype} (contiguous: {a.flags.c_contiguous})")
