"""Launchers of the row-moving kernels (cuda/comm/rows.cu) the baseline transports use: a
local gather/scatter copy, a pull from peers' IPC-mapped buffers, and the unfused combine's
push into home ranks' receive slots."""

from __future__ import annotations

import cupy
import numpy as np

from epserve.runtime import kernels
from epserve.runtime.launch import pointer, sm_count


def _row_grid(rows: int) -> int:
    return max(1, min(sm_count(cupy.cuda.runtime.getDevice()) * 16, (rows + 7) // 8))


def copy_rows(dst, src, dst_idx, src_idx, rows: int, row_bytes: int) -> None:
    """dst[dst_idx[i] or i] = src[src_idx[i] or i]; rows of row_bytes (a multiple of 16)."""
    if rows == 0:
        return
    fn = kernels.function("rows", "epserve_copy_rows")
    fn((_row_grid(rows),), (256,), (pointer(dst), pointer(src), pointer(dst_idx), pointer(src_idx), np.int32(rows),
                                    np.int32(row_bytes)))


def gather_rows_from_peers(dst, peer_bases, src_rank, src_pos, rows: int, row_bytes: int) -> None:
    if rows == 0:
        return
    fn = kernels.function("rows", "epserve_gather_rows_from_peers")
    fn((_row_grid(rows),), (256,), (pointer(dst), peer_bases, pointer(src_rank), pointer(src_pos), np.int32(rows),
                                    np.int32(row_bytes)))


def push_rows_to_peers(C, M: int, H: int, cfg) -> None:
    """The unfused combine over IPC: C's rows into their home ranks' recv slots, signalled."""
    if M == 0:
        return
    fn = kernels.function("rows", "epserve_push_rows_to_peers")
    blocks = max(1, min(sm_count(cupy.cuda.runtime.getDevice()) * 4, (M + 31) // 32))
    fn((blocks,), (256,), (pointer(C), np.int32(M), np.int32(H), cfg))
