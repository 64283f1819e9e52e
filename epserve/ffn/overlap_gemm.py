"""GEMM 2's overlap build across nodes (EPSERVE_OFFNODE_OVERLAP=1; docs/design.md, "Across
nodes"): what its launch needs besides the default build's, as pure arithmetic the CPU tests
check against a model of the kernels.

- SMs left free. The default grid is one CTA per SM, each holding the whole register file, so
  no other kernel runs beside it. The overlap build's grid leaves EPSERVE_OFFNODE_OVERLAP_SMS
  SMs (default 8) to the side stream's kernels: the carrier's (NCCL's, or the IPC test
  carrier's) and the small waits around it, as DeepEP reserves SMs for its communication.
- The tile order. A kernel before the GEMM writes a permutation of the tile indices that
  hands out first the tiles of every m-tile holding a row bound off-node, each class in the
  scheduler's own order (cuda/gemm/grouped_gemm_wgmma.cu, epserve_gemm_off_node_first_order).
  Its buffer holds `order_room` ints; a launch with more tiles keeps the default order.

tile_order_model is that kernel in numpy, over a model of the scheduler's walk
(cuda/gemm/tile_scheduler.cuh): the tests hold both to being permutations.
"""

from __future__ import annotations

import os

import numpy as np

from epserve.errors import ConfigError
from epserve.ffn.tiles import TILE_COLS, TILE_ROWS

FREE_SMS_ENV = "EPSERVE_OFFNODE_OVERLAP_SMS"
DEFAULT_FREE_SMS = 8
GROUP_N = 4  # the scheduler's n-tiles per weight-sharing group (EPSERVE_GROUP_N's default)


def free_sms(sm_count: int | None = None) -> int:
    """EPSERVE_OFFNODE_OVERLAP_SMS, DEFAULT_FREE_SMS when unset: SMs GEMM 2's overlap build
    leaves free. At least 1; below sm_count when that is given."""
    text = os.environ.get(FREE_SMS_ENV, "").strip()
    try:
        n = int(text) if text else DEFAULT_FREE_SMS
    except ValueError:
        raise ConfigError(f"{FREE_SMS_ENV}={text!r}: a number of SMs") from None
    if n < 1 or (sm_count is not None and n >= sm_count):
        raise ConfigError(f"{FREE_SMS_ENV}={n}: leave at least 1 SM free and at least 1 to GEMM 2"
                          + (f" (of {sm_count})" if sm_count is not None else ""))
    return n


def overlap_grid(sm_count: int, free: int) -> int:
    """The overlap build's persistent grid: one CTA per SM, `free` SMs fewer (single CTAs)."""
    return max(1, sm_count - free)


def order_room(rows_capacity: int, experts: int, N: int, max_mtiles: int) -> int:
    """The tiles a launch over at most rows_capacity rows of `experts` experts can have (each
    expert's rows make ceil(rows_e / 128) m-tiles: at most rows / 128 + experts in all), capped
    so that the order kernel's m-tile table (max_mtiles) holds them: then every launch whose
    tiles fit the room also fits the table, and the GEMM and the order kernel agree."""
    mtiles = min(-(-rows_capacity // TILE_ROWS) + experts, max_mtiles)
    return mtiles * -(-N // TILE_COLS)


# ---- models of the kernels, for the tests ------------------------------------------------
def scheduler_tiles(expert_offsets, N: int, group_n: int = GROUP_N) -> list[tuple[int, int, int]]:
    """GroupedTileScheduler::tile(i) for every i, as (expert, m_abs, n_abs), in index order."""
    offsets = [int(v) for v in expert_offsets]
    E, n_tiles = len(offsets) - 1, -(-N // TILE_COLS)
    m_tiles = [-(-(offsets[e + 1] - offsets[e]) // TILE_ROWS) for e in range(E)]
    prefix = np.concatenate([[0], np.cumsum(m_tiles)]).astype(int)
    out = []
    for index in range(int(prefix[-1]) * n_tiles):
        mt = index // n_tiles
        e = int(np.searchsorted(prefix[1:], mt, side="right"))  # the last expert whose prefix <= mt
        local = index - prefix[e] * n_tiles
        group = local // (group_n * m_tiles[e])
        in_group = local - group * group_n * m_tiles[e]
        width = min(group_n, n_tiles - group * group_n)
        m = in_group // width
        out.append((e, offsets[e] + m * TILE_ROWS, (group * group_n + in_group - m * width) * TILE_COLS))
    return out


def tile_order_model(expert_offsets, N: int, row_off_node) -> np.ndarray:
    """epserve_gemm_off_node_first_order's permutation: order[p] = the tile the p-th ticket
    runs. row_off_node[m]: whether dispatched row m goes home to another node."""
    tiles = scheduler_tiles(expert_offsets, N)
    flagged = np.array([bool(np.any(row_off_node[m:min(m + TILE_ROWS, int(expert_offsets[e + 1]))]))
                        for e, m, _ in tiles], bool)
    index = np.arange(len(tiles))
    return np.concatenate([index[flagged], index[~flagged]]).astype(np.int32)


def ordered_item(taken: int, total_tiles: int, order: np.ndarray, room: int) -> int:
    """The kernel's ordered_item: ticket `taken` (part-major) as the item it runs."""
    if total_tiles > room:
        return taken
    part, tile = divmod(taken, total_tiles)
    return part * total_tiles + int(order[tile])
