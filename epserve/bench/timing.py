"""Summaries of per-iteration times, and the rank a multi-rank result is reported for.

A layer call finishes when its slowest rank does, so each path is reported for the rank
with the largest median, as nccl-tests reports the slowest rank's time."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-iteration milliseconds, in the order measured, and their spread. The median is
    the headline number: one slow iteration (a clock change, another process) moves it
    least; p10-p90 shows how much runs vary without the extremes' noise."""

    samples_ms: tuple

    def __post_init__(self):
        samples = tuple(float(ms) for ms in self.samples_ms)
        if not samples:
            raise ValueError("a Timing needs at least one iteration's time")
        # A GPU event pair around real work never reads 0: a 0 means the events were not
        # recorded around the work, and would divide every rate by zero.
        bad = [ms for ms in samples if not (math.isfinite(ms) and ms > 0)]
        if bad:
            raise ValueError(f"iteration times must be finite and > 0 ms, got {bad[0]!r}")
        object.__setattr__(self, "samples_ms", samples)

    @property
    def median_ms(self) -> float:
        return float(np.median(self.samples_ms))

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def p10_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 10))

    @property
    def p90_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 90))

    def summary(self) -> dict:
        """Every statistic and the samples, as JSON-ready numbers."""
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms,
                "p10_ms": self.p10_ms, "p90_ms": self.p90_ms, "samples_ms": list(self.samples_ms)}


@dataclasses.dataclass(frozen=True)
class RankTiming:
    rank: int
    timing: Timing


def slowest_rank(per_rank_timings: list[dict[str, list[float]]]) -> dict[str, RankTiming]:
    """For each path, the rank whose median is largest (the lowest such rank on a tie).
    per_rank_timings[r] maps path -> per-iteration ms on rank r; every rank must report the
    same paths, since a path missing on one rank means the run went wrong there."""
    if not per_rank_timings:
        raise ValueError("slowest_rank needs the timings of at least one rank")
    paths = list(per_rank_timings[0])
    for rank, timings in enumerate(per_rank_timings):
        if set(timings) != set(paths):
            raise ValueError(f"rank {rank} timed paths {sorted(timings)}, rank 0 timed {sorted(paths)}")
    result = {}
    for path in paths:
        timings = [Timing(tuple(per_rank[path])) for per_rank in per_rank_timings]
        rank = max(range(len(timings)), key=lambda r: (timings[r].median_ms, -r))
        result[path] = RankTiming(rank, timings[rank])
    return result
