"""epserve/ffn/tiles.py: the one place that chooses the grouped GEMMs' tile configuration. The
host's step (which build GEMM 2 runs) at the shapes it was measured on, and the kernel's
rule (split_parts, mirrored by split_k_parts) on both sides of its line."""

import numpy as np
import pytest

from epserve.ffn import tiles

SMS = 132  # an H200


def balanced_rows(rows: int, experts: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.bincount(rng.integers(0, experts, rows), minlength=experts)


def exact_tiles(rows_per_expert, N: int) -> int:
    return int(sum(-(-int(r) // 128) for r in rows_per_expert)) * -(-N // 256)


@pytest.mark.parametrize("rows,experts", [(2060, 4), (4136, 4), (8220, 4), (32777, 128), (1031, 128), (300, 8)])
def test_expected_tiles_is_close_to_the_exact_count_of_balanced_routing(rows, experts):
    exact = exact_tiles(balanced_rows(rows, experts), 4096)
    assert abs(tiles.expected_tiles(rows, experts, 4096) - exact) <= 0.15 * exact + 16, exact


@pytest.mark.parametrize("rows,experts,N,K,policy", [
    (2060, 4, 4096, 14336, tiles.BY_RULE),    # mixtral GEMM 2, 1024 tokens/rank: 2.2 waves
    (4136, 4, 4096, 14336, tiles.BY_RULE),    # 2048: 4.2 waves
    (8220, 4, 4096, 14336, None),             # 4096: 8 waves, more than the workspace's room
    (32777, 128, 7168, 2048, None),           # dsv3 GEMM 2: K 2048, too short
    (1024, 128, 7168, 2048, None),            # dsv3-decode
    (2060, 4, 4096, 2048, None),              # few waves, but K too short
    (0, 4, 4096, 14336, tiles.BY_RULE),       # no rows: the kernel has no tiles to split anyway
])
def test_gemm2_build_by_shape(rows, experts, N, K, policy, monkeypatch):
    monkeypatch.delenv(tiles.SPLIT_ENV, raising=False)
    assert tiles.gemm2_split_policy(rows, experts, N, K, SMS) == policy


def test_the_override(monkeypatch):
    monkeypatch.setenv(tiles.SPLIT_ENV, "never")
    assert tiles.gemm2_split_policy(2060, 4, 4096, 14336, SMS) is None
    monkeypatch.setenv(tiles.SPLIT_ENV, "always")
    assert tiles.gemm2_split_policy(32777, 128, 7168, 2048, SMS) == tiles.ALWAYS
    assert tiles.gemm2_split_policy(32777, 128, 7168, 64, SMS) is None  # one k-slice: nothing to split
    assert tiles.gemm2_split_policy(2060, 4, 4096, 14336, SMS, mode="never") is None  # the argument wins
    monkeypatch.setenv(tiles.SPLIT_ENV, "sometimes")
    with pytest.raises(ValueError, match="EPSERVE_GEMM2_SPLIT_K must be one of"):
        tiles.gemm2_split_policy(2060, 4, 4096, 14336, SMS)


@pytest.mark.parametrize("tile_count,parts", [
    (288, 2),    # mixtral 1024: 3 waves whole (0.73 full), 5 of halves (0.87)
    (560, 2),    # mixtral 2048: 5 waves (0.85), 9 of halves (0.94)
    (264, 1),    # exactly 2 waves: nothing to fill
    (528, 1),    # exactly 4
    (100, 1),    # under one wave: a second half would only wait for its first
    (160, 2),    # 1.2 waves: 2 -> 1.5
    (661, 1),    # beyond the room
    (0, 1),
])
def test_the_kernels_rule(tile_count, parts):
    room = tiles.room_tiles(SMS)
    assert tiles.split_k_parts(tile_count, SMS, 224, 2, room, tiles.BY_RULE) == parts
    # always: wherever the room and K allow
    assert tiles.split_k_parts(tile_count, SMS, 224, 2, room, tiles.ALWAYS) == (2 if 0 < tile_count <= room else 1)
    assert tiles.split_k_parts(tile_count, SMS, 1, 2, room, tiles.ALWAYS) == 1


def test_the_rule_never_loses_filled_waves():
    """Wherever it splits, the halves fill the waves at least 5 points better."""
    room = tiles.room_tiles(SMS)
    for t in range(1, room + 1):
        if tiles.split_k_parts(t, SMS, 224, 2, room, tiles.BY_RULE) == 2:
            w1, w2 = -(-t // SMS), -(-2 * t // SMS)
            assert 2 * t / (w2 * SMS) >= t / (w1 * SMS) + 0.05 - 1e-12, t


def test_kernel_and_mirror_share_the_formula():
    """The kernel's split_parts is the same integer arithmetic (compared as text: the CPU has
    no GPU to run it)."""
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "cuda" / "gemm" / "tile_scheduler.cuh").read_text()
    assert "return 20 * t * (2 * w1 - w2) >= w1 * w2 * g ? max_parts : 1;" in src
    assert "if (max_parts < 2 || k_slices < max_parts || tiles <= 0 || tiles > room) return 1;" in src
    assert "if (policy == 1) return max_parts;" in src and "if (tiles < ctas) return 1;" in src
