"""Tensor maps (CUtensorMap) for the TMA loads of the wgmma GEMM, made on the host with the
driver API and passed by value: a size-1 NumPy array of 16 uint64, which CuPy hands over by
its data pointer (docs/design.md, "Hopper from CuPy")."""

from __future__ import annotations

import numpy as np

TENSOR_MAP = np.dtype([("opaque", np.uint64, (16,))], align=True)


def bf16_rows_map(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int = 64) -> np.ndarray:
    """A 2-D map over a row-major bf16 matrix [rows, cols], boxes of box_rows x box_cols with
    the 128-byte swizzle the wgmma descriptors expect (box_cols * 2 must be 128)."""
    if box_cols * 2 != 128:
        raise ValueError("the 128-byte swizzle needs 64 bf16 columns per box row")
    return _map_2d("BFLOAT16", 2, ptr, rows, cols, cols * 2, box_rows, box_cols, swizzle_128b=True)


def fp8_rows_map(ptr: int, rows: int, cols: int, box_rows: int, pitch: int | None = None) -> np.ndarray:
    """The same over a row-major 1-byte (e4m3) matrix [rows, cols]: boxes of box_rows x 128
    bytes, 128-byte swizzle (one box row is one 128-wide FP8 k-block). pitch: bytes from one
    row to the next (default cols; a multiple of 16, as TMA takes), for rows that carry more
    than the matrix (the FP8 dispatch's packed rows)."""
    pitch = cols if pitch is None else pitch
    if pitch < cols or pitch % 16:
        raise ValueError(f"an e4m3 map's pitch must be at least its {cols} columns and a multiple of 16, got {pitch}")
    return _map_2d("UINT8", 1, ptr, rows, cols, pitch, box_rows, 128, swizzle_128b=True)


def f32_rows_map(ptr: int, rows: int, cols: int, ld: int, box_cols: int) -> np.ndarray:
    """A map over a row-major fp32 matrix [rows, cols] with a pitch of ld floats (ld * 4 a
    multiple of 16), boxes of one row by box_cols columns (box_cols * 4 a multiple of 16), no
    swizzle: the FP8 GEMM's A scales, one box the scales of a tile's rows for one k-block.
    What no map can promise: the kernel's column coordinate must be a multiple of 4 (a
    16-byte aligned start, see cuda/common/ptx.cuh's tma_load_2d)."""
    if ld % 4 or (box_cols * 4) % 16 or not 0 < box_cols <= 256:
        raise ValueError(f"fp32 map: pitch {ld} floats (a multiple of 4) and box of {box_cols} columns "
                         "(a multiple of 4, at most 256) are what TMA takes")
    return _map_2d("FLOAT32", 4, ptr, rows, cols, ld * 4, 1, box_cols, swizzle_128b=False)


def _map_2d(dtype: str, elem_bytes: int, ptr: int, rows: int, cols: int, pitch_bytes: int, box_rows: int,
            box_cols: int, swizzle_128b: bool) -> np.ndarray:
    from cuda.bindings import driver as cu

    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    swizzle = cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if swizzle_128b else \
        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE
    err, tmap = cu.cuTensorMapEncodeTiled(
        getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{dtype}"), 2, ptr, [u64(cols), u64(rows)],
        [u64(pitch_bytes)], [u32(box_cols), u32(box_rows)], [u32(1), u32(1)],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled({dtype}, {rows} x {cols}, pitch {pitch_bytes} bytes, box "
                           f"{box_rows} x {box_cols}) failed: {err}")
    out = np.zeros(1, TENSOR_MAP)
    out["opaque"][0] = [int(v) for v in tmap.opaque]
    return out
