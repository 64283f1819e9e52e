"""The one place that chooses the grouped GEMMs' tile configuration per shape (issue 12).

The wgmma GEMM runs 128 x 256 tiles, handed to one persistent CTA per SM from an atomic
counter. Tiles of one GEMM take about the same time, so when they make few waves over the SMs
the last wave leaves most of them idle: mixtral's GEMM 2 at 1024 tokens per rank has 288
tiles, 2.18 waves, 73% of the SMs busy over them, and measured 0.78 x cuBLAS per expert
(notes/gemm.md). 128-wide tiles (`-DEPSERVE_GEMM_BN=128`) double the tiles and fill the waves
better, at the cost of more operand bytes per FLOP, which the GEMMs with many waves
(dsv3, qwen3: L2-bound) cannot afford. So GEMM 2 takes the 128-wide tile only when it
makes the waves clearly fuller.

The row count is on the device (the dispatch leaves it there), so the choice is made from the
host's estimate: `rows_hint` rows (this rank's tokens times top_k: what a rank receives on
average) spread evenly over the local experts, each with a partial last m-tile."""

from __future__ import annotations

import math

M_TILE = 128
WIDE, NARROW = 256, 128
# The narrow tile must raise the share of SMs busy over the waves by this much: it moves 4/3
# the operand bytes per FLOP.
MIN_GAIN = 0.05


def expected_tiles(rows_hint: int, experts: int, N: int, n_tile: int) -> int:
    """Tiles of a grouped GEMM with rows_hint rows spread evenly over `experts`: each expert's
    rows / 128 m-tiles plus half a partial one, times N / n_tile column tiles."""
    per_expert = rows_hint / max(1, experts)
    m_tiles = max(1.0, per_expert / M_TILE + 0.5) if per_expert > 0 else 0.0
    return math.ceil(experts * m_tiles) * math.ceil(N / n_tile)


def busy_share(tiles: int, sms: int) -> float:
    """The share of SM time that works over the waves tiles of equal length make."""
    if tiles <= 0:
        return 1.0
    return tiles / (math.ceil(tiles / sms) * sms)


def gemm2_n_tile(rows_hint: int | None, experts: int, N: int, sms: int) -> int:
    """GEMM 2's tile width: 128 when that makes the waves at least MIN_GAIN fuller, else 256
    (also when there is no hint)."""
    if not rows_hint:
        return WIDE
    wide = busy_share(expected_tiles(rows_hint, experts, N, WIDE), sms)
    narrow = busy_share(expected_tiles(rows_hint, experts, N, NARROW), sms)
    return NARROW if narrow >= wide + MIN_GAIN else WIDE
