"""The tile chooser (epserve/ffn/tiles.py): the 128-wide GEMM 2 tile only where the 256-wide
tiles make few, badly filled waves (mixtral's measured gap, notes/gemm.md), never for the
shapes whose many waves are full already."""

import pytest

from epserve.bench import presets
from epserve.ffn import tiles

SMS = 132  # an H100 / H200


def choice(preset: str, tokens: int, ranks: int = 2) -> int:
    p = presets.get_preset(preset)
    return tiles.gemm2_n_tile(tokens * p.top_k, p.num_experts // ranks, p.hidden, SMS)


@pytest.mark.parametrize("preset,tokens,want", [
    ("mixtral", 1024, 128), ("mixtral", 2048, 128), ("mixtral", 4096, 256),
    ("dsv3-prefill", 1024, 256), ("dsv3-prefill", 4096, 256), ("dsv3-decode", 128, 256),
    ("qwen3-moe", 2048, 256), ("qwen3-moe", 8192, 256),
])
def test_the_narrow_tile_only_where_the_waves_are_few_and_empty(preset, tokens, want):
    assert choice(preset, tokens) == want


def test_the_estimate_matches_the_bench_routings_tile_counts():
    # notes/gemm.md's table (rank 0 of the bench's balanced routing): 288, 560, 1056 tiles
    for tokens, measured in ((1024, 288), (2048, 560), (4096, 1056)):
        est = tiles.expected_tiles(tokens * 2, 4, 4096, 256)
        assert abs(est - measured) <= 0.05 * measured, (tokens, est, measured)
    assert tiles.busy_share(288, SMS) == pytest.approx(288 / 396)


def test_no_hint_no_rows_keep_the_default():
    assert tiles.gemm2_n_tile(None, 4, 4096, SMS) == tiles.WIDE
    assert tiles.gemm2_n_tile(0, 4, 4096, SMS) == tiles.WIDE
