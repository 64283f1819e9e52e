"""Timing summaries and the choice of the rank a path is reported for."""

import pytest

from epserve.bench.timing import Timing, slowest_rank


def test_timing_stats():
    t = Timing([5.0, 1.0, 4.0, 2.0, 3.0])
    assert t.samples_ms == (5.0, 1.0, 4.0, 2.0, 3.0)  # kept in the order measured
    assert (t.median_ms, t.min_ms, t.max_ms) == (3.0, 1.0, 5.0)
    # Linear interpolation between sorted samples: 10% of the way is 0.4 of a step from 1.
    assert t.p10_ms == pytest.approx(1.4)
    assert t.p90_ms == pytest.approx(4.6)
    assert t.summary() == {"median_ms": 3.0, "min_ms": 1.0, "max_ms": 5.0, "p10_ms": pytest.approx(1.4),
                           "p90_ms": pytest.approx(4.6), "samples_ms": [5.0, 1.0, 4.0, 2.0, 3.0]}


def test_timing_of_one_sample():
    t = Timing([0.25])
    assert t.median_ms == t.p10_ms == t.p90_ms == t.min_ms == t.max_ms == 0.25


@pytest.mark.parametrize("samples, match", [
    ([], "at least one"),
    ([1.0, 0.0], "> 0"),
    ([1.0, float("nan")], "finite"),
    ([-1.0], "> 0"),
])
def test_timing_rejects_bad_samples(samples, match):
    with pytest.raises(ValueError, match=match):
        Timing(samples)


def test_slowest_rank_per_path():
    per_rank = [
        {"fused": [1.0, 1.1, 1.2], "unfused": [3.0, 3.5, 9.0]},
        {"fused": [1.5, 1.4, 1.6], "unfused": [3.1, 3.2, 3.3]},
    ]
    result = slowest_rank(per_rank)
    assert result["fused"].rank == 1 and result["fused"].timing.median_ms == 1.5
    # The median, not the worst iteration, decides: rank 0's 9.0 ms outlier does not.
    assert result["unfused"].rank == 0 and result["unfused"].timing.median_ms == 3.5


def test_slowest_rank_tie_goes_to_the_lowest_rank():
    assert slowest_rank([{"p": [2.0]}, {"p": [2.0]}, {"p": [1.0]}])["p"].rank == 0


def test_slowest_rank_rejects_ranks_that_timed_different_paths():
    with pytest.raises(ValueError, match="rank 1 timed"):
        slowest_rank([{"fused": [1.0], "unfused": [2.0]}, {"fused": [1.0]}])
    with pytest.raises(ValueError, match="at least one rank"):
        slowest_rank([])
