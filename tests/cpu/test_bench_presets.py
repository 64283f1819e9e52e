"""Presets, their scaled versions for quick runs, and the routings the benchmark draws."""

import numpy as np
import pytest

from epserve.bench import presets as ps
from epserve.errors import ConfigError


def test_preset_shapes():
    assert ps.get_preset("dsv3-prefill") == ps.Preset("dsv3-prefill", 7168, 2048, 256, 8, 4096)
    assert ps.get_preset("dsv3-decode").tokens_per_rank == 128
    assert ps.get_preset("qwen3-moe") == ps.Preset("qwen3-moe", 2048, 768, 128, 8, 8192)
    assert ps.get_preset("mixtral") == ps.Preset("mixtral", 4096, 14336, 8, 2, 4096)


def test_unknown_preset_lists_the_names():
    with pytest.raises(ConfigError) as info:
        ps.get_preset("dsv4")
    for name in ("dsv3-prefill", "dsv3-decode", "qwen3-moe", "mixtral"):
        assert name in str(info.value)


def test_scaled_keeps_the_name_for_a_sweep_point_only():
    base = ps.get_preset("dsv3-prefill")
    point = ps.scaled(base, tokens_per_rank=512)
    assert point.name == "dsv3-prefill" and point.tokens_per_rank == 512 and point.hidden == 7168
    small = ps.scaled(base, tokens_per_rank=16, hidden=256, intermediate=128, num_experts=8, top_k=2)
    assert small == ps.Preset("dsv3-prefill/scaled", 256, 128, 8, 2, 16)
    assert ps.scaled(small, hidden=512).name == "dsv3-prefill/scaled"
    assert ps.scaled(base, hidden=7168).name == "dsv3-prefill"  # same shape: same layer


@pytest.mark.parametrize("changes", [{"hidden": 0}, {"top_k": 300}, {"tokens_per_rank": 1.5}])
def test_preset_rejects_bad_shapes(changes):
    with pytest.raises(ConfigError):
        ps.scaled(ps.get_preset("mixtral"), **changes)


def test_routing_specs():
    assert ps.get_routing("balanced") == ps.Routing("balanced", 0.0)
    assert ps.get_routing("skewed") == ps.Routing("skewed", ps.DEFAULT_ZIPF) == ps.skewed()
    assert ps.get_routing("skewed:2") == ps.Routing("skewed", 2.0)
    assert ps.get_routing("skewed:1.5").label == "skewed(1.5)"
    assert ps.balanced().label == "balanced"
    for bad in ("uniform", "balanced:1", "skewed:x", "skewed:-1", "skewed:0", "skewed:inf"):
        with pytest.raises(ConfigError):
            ps.get_routing(bad)


def test_draw_gives_every_rank_a_top_k_routing_from_one_seed():
    preset = ps.scaled(ps.get_preset("qwen3-moe"), tokens_per_rank=64)
    drawn = ps.balanced().draw(preset, world_size=2, seed=5)
    assert len(drawn) == 2
    for idx in drawn:
        assert idx.shape == (64, 8) and idx.dtype == np.int32
        assert idx.min() >= 0 and idx.max() < 128
        assert all(len(set(row)) == 8 for row in idx.tolist())  # distinct experts per token
    again = ps.balanced().draw(preset, world_size=2, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(drawn, again, strict=True))


def test_skewed_routing_has_hot_experts_spread_over_ranks():
    preset = ps.scaled(ps.get_preset("dsv3-prefill"), tokens_per_rank=512)

    def loads(routing):
        idx = np.concatenate(routing.draw(preset, world_size=2, seed=1)).ravel()
        return np.bincount(idx, minlength=preset.num_experts) / idx.size

    balanced, skewed = loads(ps.balanced()), loads(ps.skewed())
    mean = 1 / preset.num_experts
    assert balanced.max() < 2 * mean
    assert skewed.max() > 10 * mean  # a few experts take most of the rows
    hot = np.argsort(skewed)[-8:]
    assert len(set(hot // (preset.num_experts // 2))) == 2  # not all on one rank


def test_timing_jobs_point_has_the_presets_expert_dtype():
    """launch/jobs/time_dispatch.py and time_off_node.py build their service from
    balanced_point: an -fp8 preset must give FP8 experts (it once gave bf16 silently)."""
    from epserve.bench.presets import balanced_point

    for name, dtype in (("dsv3-prefill", "bf16"), ("dsv3-prefill-fp8", "fp8"), ("dsv3-decode-fp8", "fp8")):
        _, cfg, routing = balanced_point(name, 64, 2, 17)
        assert cfg.expert_dtype == dtype
        assert len(routing) == 2 and routing[0].shape == (64, cfg.top_k)


def test_as_rank_of_gives_one_rank_its_share_of_the_experts():
    """--as-rank-of W: one rank with E / W experts receives T x k rows over them, as a rank of
    W does over its E / W, so the expert GEMMs have that rank's rows per expert."""
    from epserve.bench.__main__ import parse_args, shape_of

    assert parse_args([]).as_rank_of == 1
    dsv3 = ps.get_preset("dsv3-prefill-fp8")
    assert shape_of(dsv3, False) is dsv3
    half = shape_of(dsv3, False, parse_args(["--as-rank-of", "2"]).as_rank_of)
    assert half.name == "dsv3-prefill-fp8/scaled" and half.num_experts == 128 and half.expert_dtype == "fp8"
    assert (half.hidden, half.intermediate, half.top_k, half.tokens_per_rank) == (7168, 2048, 8, 4096)
    # rows per expert: one rank's T x k over its experts; at two ranks, each of the two ranks
    # sends its T x k rows, half of them to rank 0, over rank 0's E / 2 experts
    one_rank = half.tokens_per_rank * half.top_k / half.num_experts
    two_ranks = 2 * (dsv3.tokens_per_rank * dsv3.top_k / 2) / (dsv3.num_experts / 2)
    assert one_rank == two_ranks == 256
    quick = shape_of(dsv3, True, 2)
    assert quick.num_experts == min(32, 128) and quick.name == "dsv3-prefill-fp8/scaled"
    for bad in (3, 0, 64):  # 256 experts: not in 3 ranks, not in 0, and 4 < top-8 in 64
        with pytest.raises(SystemExit, match="--as-rank-of"):
            shape_of(dsv3, False, bad)
