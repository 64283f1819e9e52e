"""A benchmark's results: one Row per (preset, routing, tokens per rank, path), and the Run
that holds them with the facts about the machine. Tables, JSON files and plots read these."""

from __future__ import annotations

import dataclasses

from epserve.bench import arithmetic
from epserve.bench.arithmetic import Floor, Rates, Work
from epserve.bench.presets import Preset, Routing
from epserve.bench.timing import RankTiming, Timing


@dataclasses.dataclass(frozen=True)
class Row:
    """One path at one shape. timing is None where the path does not apply (or could not
    run) here; every other measured field is then None too."""

    preset: Preset                  # tokens_per_rank is this row's point of the sweep
    routing: Routing
    path: str
    timing: Timing | None = None    # the slowest rank's per-iteration times
    rank: int | None = None         # which rank that is
    per_rank_ms: tuple | None = None  # every rank's per-iteration times, by rank
    flops_per_gpu: float | None = None
    nvlink_bytes: int | None = None   # on the busiest direction of any rank's link
    floor: Floor | None = None
    unfused_ms: float | None = None   # the unfused path's median at this shape
    library_ms: float | None = None   # the library baseline's median at this shape
    wrong: int | None = None          # elements that differ bitwise from the unfused output
    host_waits: int | None = None     # host waits for the GPU per call (the most of any rank)
    mpi_calls: int | None = None      # MPI calls per call (the most of any rank)
    sm_mhz: float | None = None       # that rank's SM clock right after its timed iterations (bench/clock.py)
    sm_mhz_during: float | None = None  # ... and during one more call of the path (the clock the row ran at)

    @property
    def key(self) -> tuple:
        """The shape this row measures: rows with one key are paths racing each other."""
        return (self.preset, self.routing)

    @property
    def median_s(self) -> float | None:
        return None if self.timing is None else self.timing.median_ms / 1e3

    @property
    def tflop_s(self) -> float | None:
        if self.timing is None or not self.flops_per_gpu:
            return None
        return arithmetic.tflop_per_s(self.flops_per_gpu, self.median_s)

    @property
    def nvlink_gb_s(self) -> float | None:
        if self.timing is None or not self.nvlink_bytes:
            return None
        return arithmetic.gb_per_s(self.nvlink_bytes, self.median_s)

    @property
    def x_floor(self) -> float | None:
        if self.timing is None or self.floor is None:
            return None
        return arithmetic.x_floor(self.median_s, self.floor.seconds)

    @property
    def speedup_vs_unfused(self) -> float | None:
        if self.timing is None or self.unfused_ms is None:
            return None
        return arithmetic.speedup(self.unfused_ms, self.timing.median_ms)

    @property
    def speedup_vs_library(self) -> float | None:
        if self.timing is None or self.library_ms is None:
            return None
        return arithmetic.speedup(self.library_ms, self.timing.median_ms)


def measured_row(preset: Preset, routing: Routing, path: str, slowest: RankTiming, work: Work,
                 rates: Rates, *, per_rank_ms=None, wrong: int | None = None, host_waits: int | None = None,
                 mpi_calls: int | None = None, per_rank_mhz=None, per_rank_mhz_during=None) -> Row:
    """The Row of a path that ran: `slowest` from timing.slowest_rank, `work` what the path
    must do (arithmetic.gemm2_combine_work and friends), `rates` measured in this run.
    per_rank_mhz, per_rank_mhz_during: each rank's SM clock after its iterations and during
    one more call, by rank (None where not read); the row keeps the slowest rank's."""
    mhz = None if per_rank_mhz is None else per_rank_mhz[slowest.rank]
    during = None if per_rank_mhz_during is None else per_rank_mhz_during[slowest.rank]
    return Row(preset=preset, routing=routing, path=path, timing=slowest.timing, rank=slowest.rank,
               per_rank_ms=None if per_rank_ms is None else tuple(tuple(ms) for ms in per_rank_ms),
               flops_per_gpu=work.flops_per_gpu, nvlink_bytes=work.nvlink.busiest,
               floor=work.floor(rates), wrong=wrong, host_waits=host_waits, mpi_calls=mpi_calls,
               sm_mhz=None if mhz is None else float(mhz), sm_mhz_during=None if during is None else float(during))


def with_baselines(rows, unfused_path, library_path=None) -> list[Row]:
    """The rows with unfused_ms and library_ms set from the medians of the baseline paths at
    the same shape (left None where that path did not run). Each baseline is one path name
    for every row, or a mapping from a row's path to its baseline's (measure.BASELINES: a
    family of paths compares with its own unfused and library rows)."""
    medians = {(row.key, row.path): row.timing.median_ms for row in rows if row.timing is not None}

    def baseline(spec, path):
        return spec if spec is None or isinstance(spec, str) else spec.get(path)

    return [dataclasses.replace(row, unfused_ms=medians.get((row.key, baseline(unfused_path, row.path))),
                                library_ms=medians.get((row.key, baseline(library_path, row.path))))
            for row in rows]


@dataclasses.dataclass(frozen=True)
class Run:
    """A whole benchmark run: `info` as report.preamble prints it, and the rows."""

    info: dict
    rows: tuple

    def __post_init__(self):
        object.__setattr__(self, "rows", tuple(self.rows))


def row_to_dict(row: Row) -> dict:
    """Every number of the row, the derived ones included (under "derived") so that a reader
    of the file needs no epserve to use it; row_from_dict ignores them."""
    return {
        "preset": dataclasses.asdict(row.preset),
        "routing": dataclasses.asdict(row.routing),
        "path": row.path,
        "timing": None if row.timing is None else row.timing.summary(),
        "rank": row.rank,
        "per_rank_ms": None if row.per_rank_ms is None else [list(ms) for ms in row.per_rank_ms],
        "flops_per_gpu": row.flops_per_gpu,
        "nvlink_bytes": row.nvlink_bytes,
        "floor": None if row.floor is None else dataclasses.asdict(row.floor),
        "unfused_ms": row.unfused_ms,
        "library_ms": row.library_ms,
        "wrong": row.wrong,
        "host_waits": row.host_waits,
        "mpi_calls": row.mpi_calls,
        "sm_mhz": row.sm_mhz,
        "sm_mhz_during": row.sm_mhz_during,
        "derived": {
            "tflop_s_per_gpu": row.tflop_s,
            "nvlink_gb_s": row.nvlink_gb_s,
            "x_floor": row.x_floor,
            "speedup_vs_unfused": row.speedup_vs_unfused,
            "speedup_vs_library": row.speedup_vs_library,
        },
    }


def row_from_dict(d: dict) -> Row:
    timing, floor, per_rank = d["timing"], d["floor"], d["per_rank_ms"]
    return Row(
        preset=Preset(**d["preset"]),
        routing=Routing(**d["routing"]),
        path=d["path"],
        timing=None if timing is None else Timing(tuple(timing["samples_ms"])),
        rank=d["rank"],
        per_rank_ms=None if per_rank is None else tuple(tuple(ms) for ms in per_rank),
        flops_per_gpu=d["flops_per_gpu"],
        nvlink_bytes=d["nvlink_bytes"],
        floor=None if floor is None else Floor(**floor),
        unfused_ms=d["unfused_ms"],
        library_ms=d["library_ms"],
        wrong=d["wrong"],
        host_waits=d.get("host_waits"),  # absent from files written before they were counted
        mpi_calls=d.get("mpi_calls"),
        sm_mhz=d.get("sm_mhz"),  # absent from files written before the clock was read
        sm_mhz_during=d.get("sm_mhz_during"),
    )
