"""Benchmark output as nccl-tests prints it: `#` lines saying what ran where, then a table
with a units row, one line per measurement, so a log file is both readable and greppable;
and the same run, every number of it, as a versioned JSON file."""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import shlex
import sys

import numpy as np

import epserve
from epserve.bench.arithmetic import Rates
from epserve.bench.results import Run, row_from_dict, row_to_dict

SCHEMA = 1

NOT_RECORDED = "not recorded"
NOT_APPLICABLE = "n/a"   # the path did not run at this shape
NO_VALUE = "-"           # the path ran, but this column has no meaning for it

# Keys of `info` that preamble formats itself; any other key gets a "# key: value" line.
_VERSIONS = (("epserve", "epserve"), ("cupy", "CuPy"), ("nccl", "NCCL"), ("cuda", "CUDA"),
             ("driver", "driver"))
_KNOWN_KEYS = {"date", "command", "world_size", "gpus", "limits", "link", "fp8_dense"} | {key for key, _ in _VERSIONS}


def base_info(rates: Rates | None = None, argv=None) -> dict:
    """The facts about a run that need no GPU; the job adds gpus, driver, cuda, nccl and
    cupy, and the world_size. rates are the limits measured in this run."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv if argv is None else argv),
        "epserve": epserve.__version__,
        "host": platform.node(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    if rates is not None:
        info["limits"] = dataclasses.asdict(rates)
    return info


def preamble(info: dict) -> list[str]:
    """`#` lines: date, command, versions, ranks, GPUs, the measured limits, then any other
    key of info. The keys this formats: date, command, epserve, cupy, nccl, cuda, driver,
    world_size, gpus (a list of names, by device index) and limits (Rates as a dict)."""
    lines = [f"# epserve benchmark, {info.get('date', NOT_RECORDED)}",
             f"# command: {info.get('command', NOT_RECORDED)}",
             "# versions: " + ", ".join(f"{label} {info.get(key, NOT_RECORDED)}" for key, label in _VERSIONS),
             f"# ranks: {info.get('world_size', NOT_RECORDED)}"]
    gpus = info.get("gpus")
    if gpus:
        lines += [f"# GPU {index}: {name}" for index, name in enumerate(gpus)]
    else:
        lines.append(f"# GPUs: {NOT_RECORDED}")
    limits = info.get("limits")
    if limits:
        rates = Rates(**limits)
        lines.append(f"# measured limits per GPU: GEMM {rates.gemm_flop_s / 1e12:.1f} TFLOP/s, "
                     f"HBM copy {rates.copy_bytes_s / 1e9:.0f} GB/s, "
                     + (f"NVLink peer store {rates.peer_bytes_s / 1e9:.1f} GB/s per direction"
                        if info.get("link", True) else
                        "no link (one rank, ranks sharing a GPU, or nodes of one rank): the peer rate is taken to be the copy "
                        "rate"))
    else:
        lines.append(f"# measured limits: {NOT_RECORDED} (floor and x floor cannot be computed)")
    if info.get("fp8_dense"):
        lines.append("# FP8 dense GEMM limit, 8192^3 with 1 x 128 and 128 x 128 scales, slowest rank: "
                     + fp8_dense_text(info["fp8_dense"]))
    lines += [f"# {key}: {value}" for key, value in info.items() if key not in _KNOWN_KEYS]
    return lines


def fp8_dense_text(dense: dict) -> str:
    """info["fp8_dense"] ({name: {"tflop_s", "sm_mhz": [by rank]}}) as one phrase: each GEMM's
    rate and the SM clock each rank read right after timing it."""
    def clocks(mhz):
        known = [f"{m:.0f}" for m in mhz if m is not None]
        return f" at {'/'.join(known)} MHz" if known else ""

    return ", ".join(f"{name} {d['tflop_s']:.1f} TFLOP/s{clocks(d.get('sm_mhz') or [])}" for name, d in dense.items())


def _number(value: float) -> str:
    """Four significant digits (whole numbers from 1000 up), for us, GB, GB/s and TFLOP/s."""
    return f"{value:.0f}" if value >= 1000 else f"{value:#.4g}"


def _or_dash(value, fmt) -> str:
    return NO_VALUE if value is None else fmt(value)


@dataclasses.dataclass(frozen=True)
class _Column:
    name: str
    unit: str
    text: bool          # left-aligned text, else a right-aligned number
    cell: object        # Row -> str, asked only of rows whose path ran
    shape: bool = False  # describes the shape, so it is printed for rows that did not run too


_COLUMNS = (
    _Column("preset", "", True, lambda r: r.preset.name, shape=True),
    _Column("routing", "", True, lambda r: r.routing.label, shape=True),
    _Column("tokens/rank", "", False, lambda r: str(r.preset.tokens_per_rank), shape=True),
    _Column("path", "", True, lambda r: r.path, shape=True),
    _Column("time", "(us, median)", False, lambda r: _number(r.timing.median_ms * 1e3)),
    _Column("spread", "(p10-p90 us)", False,
            lambda r: f"{_number(r.timing.p10_ms * 1e3)}-{_number(r.timing.p90_ms * 1e3)}"),
    _Column("TFLOP/s", "(per GPU)", False, lambda r: _or_dash(r.tflop_s, _number)),
    _Column("SM clock", "(MHz, during)", False, lambda r: _or_dash(r.sm_mhz_during, lambda m: f"{m:.0f}")),
    _Column("SM clock", "(MHz, after)", False, lambda r: _or_dash(r.sm_mhz, lambda m: f"{m:.0f}")),
    _Column("NVLink", "(GB)", False, lambda r: _or_dash(r.nvlink_bytes, lambda b: _number(b / 1e9))),
    _Column("NVLink", "(GB/s)", False, lambda r: _or_dash(r.nvlink_gb_s, _number)),
    _Column("floor", "(us)", False, lambda r: _or_dash(r.floor, lambda f: _number(f.seconds * 1e6))),
    _Column("x floor", "(time/floor)", False, lambda r: _or_dash(r.x_floor, lambda x: f"{x:.2f}")),
    _Column("speed-up", "(vs unfused)", False, lambda r: _or_dash(r.speedup_vs_unfused, lambda x: f"{x:.2f}")),
    _Column("speed-up", "(vs library)", False, lambda r: _or_dash(r.speedup_vs_library, lambda x: f"{x:.2f}")),
    _Column("host", "(waits/call)", False, lambda r: _or_dash(r.host_waits, str)),
    _Column("MPI", "(calls/call)", False, lambda r: _or_dash(r.mpi_calls, str)),
    _Column("#wrong", "", False, lambda r: _or_dash(r.wrong, str)),
)


def table(rows) -> list[str]:
    """The rows under two `#` header lines (names, then units), columns as wide as their
    widest cell. NVLink bytes are the busiest direction of any rank's link, TFLOP/s the
    layer's FLOPs per GPU over the slowest rank's median, time, spread and SM clock that
    rank's (the clock read right after its timed iterations: bench/clock.py)."""
    cells = [[column.cell(row) if row.timing is not None or column.shape else NOT_APPLICABLE
              for column in _COLUMNS] for row in rows]
    widths = [max([len(column.name), len(column.unit)] + [len(line[i]) for line in cells])
              for i, column in enumerate(_COLUMNS)]

    def line(prefix, values):
        return prefix + "  ".join(value.ljust(width) if column.text else value.rjust(width)
                                  for value, width, column in zip(values, widths, _COLUMNS)).rstrip()

    return ([line("# ", [column.name for column in _COLUMNS]),
             line("# ", [column.unit for column in _COLUMNS])]
            + [line("  ", values) for values in cells])


def write_json(path, run: Run) -> None:
    document = {"schema": SCHEMA, "info": run.info, "rows": [row_to_dict(row) for row in run.rows]}
    # Encoded before the file is opened, so a value JSON cannot hold (NaN, an object) leaves
    # no half-written file behind.
    text = json.dumps(document, indent=1, allow_nan=False)
    with open(path, "w") as f:
        f.write(text + "\n")


def read_json(path) -> Run:
    with open(path) as f:
        document = json.load(f)
    schema = document.get("schema") if isinstance(document, dict) else None
    if schema != SCHEMA:
        raise ValueError(f"{path}: JSON schema {schema!r}, this epserve reads schema {SCHEMA}")
    return Run(document["info"], [row_from_dict(row) for row in document["rows"]])
