"""Tensor maps (CUtensorMap) for the TMA loads of the wgmma GEMM, made on the host with the
driver API and passed by value: a size-1 NumPy array of 16 uint64, which CuPy hands over by
its data pointer (docs/design.md, "Hopper from CuPy")."""

from __future__ import annotations

import numpy as np

TENSOR_MAP = np.dtype([("opaque", np.uint64, (16,))], align=True)


def bf16_rows_map(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int = 64) -> np.ndarray:
    """A 2-D map over a row-major bf16 matrix [rows, cols], boxes of box_rows x box_cols with
    the 128-byte swizzle the wgmma descriptors expect (box_cols * 2 must be 128)."""
    from cuda.bindings import driver as cu

    if box_cols * 2 != 128:
        raise ValueError("the 128-byte swizzle needs 64 bf16 columns per box row")
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    err, tmap = cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, [u64(cols), u64(rows)], [u64(cols * 2)],
        [u32(box_cols), u32(box_rows)], [u32(1), u32(1)], cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B, cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled({rows} x {cols}, box {box_rows} x {box_cols}) failed: {err}")
    out = np.zeros(1, TENSOR_MAP)
    out["opaque"][0] = [int(v) for v in tmap.opaque]
    return out
