"""The one place that chooses the grouped GEMMs' tile configuration per launch (issue 12).

What there is to choose, measured on one H200 (notes/gemm.md):
- 128 x 256 tiles on single CTAs everywhere. The narrower 128 x 128 tile, CTA pairs and
  swapped tails all measured slower on these L2-bound GEMMs, so they stay knobs.
- GEMM 2 in two K halves (the wgmma GEMM's split build). When the tiles make few waves
  over the SMs, the last wave leaves SMs idle; halves fill it (mixtral's GEMM 2, K 14336:
  0.419 against 0.450 ms at 1024 tokens/rank, 2.2 waves; 0.738 against 0.751 at 2048).
  With many waves the halves' stored accumulators cost more than the fuller last wave gives
  (1.49 against 1.42 ms at 8 waves), and with a short K they cost more still (dsv3's GEMM 2,
  K 2048: 36% slower with every tile split).

The choice is made in two steps, because the tile count is known exactly only on the device
(the rows per expert stay there):
1. here, on the host, from the rows a launch expects: the split build when K is long enough
   and the expected tiles fit the workspace's room (a few waves);
2. in the kernel, from the exact tile count (cuda/gemm/tile_scheduler.cuh, split_parts,
   mirrored by split_k_parts below): split when the halves fill the last wave better.
Either way the result is the same bits: a second half continues from its first half's
accumulators in the same k order.

$EPSERVE_GEMM2_SPLIT_K overrides step 1: "auto" (the default), "never", or "always" (the
split build, splitting wherever the room and K allow: for tests)."""

from __future__ import annotations

import os

from epserve.errors import ConfigError

SPLIT_ENV = "EPSERVE_GEMM2_SPLIT_K"
SPLIT_MODES = ("auto", "never", "always")
TILE_ROWS, TILE_COLS, K_SLICE = 128, 256, 64
SPLIT_PARTS = 2
# The split build's workspace holds this many waves of tiles (128 KB of fp32 accumulators a
# tile: 86 MB at 132 SMs); a launch with more tiles runs unsplit, which is also where
# splitting stops paying.
ROOM_WAVES = 5
# Below this K the halves' accumulators (stored and loaded once per tile) cost more than a
# fuller last wave gives.
MIN_SPLIT_K = 4096
# split_policy, the kernel argument
BY_RULE, ALWAYS = 0, 1


def split_mode(override: str | None = None) -> str:
    mode = override or os.environ.get(SPLIT_ENV, "auto")
    if mode not in SPLIT_MODES:
        raise ConfigError(f"{SPLIT_ENV} must be one of {SPLIT_MODES}, got {mode!r}")
    return mode


def room_tiles(ctas: int) -> int:
    """The tiles the split build's workspace holds."""
    return ROOM_WAVES * ctas


def expected_tiles(rows: int, experts: int, N: int) -> float:
    """The 128 x 256 tiles a grouped GEMM of `rows` rows spread evenly over `experts` experts
    is expected to have: an expert's rows make ceil(rows_e / 128) m-tiles, on average half a
    tile more than rows_e / 128 when they vary, at least one when it has rows."""
    if rows <= 0 or experts <= 0:
        return 0.0
    per_expert = rows / experts
    m_tiles = max(1.0, per_expert / TILE_ROWS + 0.5) if per_expert >= 1 else per_expert
    return experts * m_tiles * -(-N // TILE_COLS)


def gemm2_split_policy(rows: int, experts: int, N: int, K: int, ctas: int, mode: str | None = None) -> int | None:
    """Step 1: None for GEMM 2's default build, else the split build's split_policy (BY_RULE or
    ALWAYS). rows: the rows the launch expects (a capacity-sized buffer holds more)."""
    mode = split_mode(mode)
    if mode == "never" or K < SPLIT_PARTS * K_SLICE:
        return None
    if mode == "always":
        return ALWAYS
    if K < MIN_SPLIT_K or expected_tiles(rows, experts, N) > room_tiles(ctas):
        return None
    return BY_RULE


def split_k_parts(tiles: int, ctas: int, k_slices: int, max_parts: int, room: int, policy: int) -> int:
    """Step 2, the kernel's split_parts (cuda/gemm/tile_scheduler.cuh) in Python, the same
    integer arithmetic: 1 or max_parts."""
    if max_parts < 2 or k_slices < max_parts or tiles <= 0 or tiles > room:
        return 1
    if policy == ALWAYS:
        return max_parts
    if tiles < ctas:
        return 1
    w1, w2 = -(-tiles // ctas), -(-2 * tiles // ctas)
    return max_parts if 20 * tiles * (2 * w1 - w2) >= w1 * w2 * ctas else 1
