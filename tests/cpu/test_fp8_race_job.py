"""The CPU side of launch/jobs/check_fp8_race.py: the knob it builds the pre-fix FP8 GEMMs
with is one the kernel reads, and it places a differing recv slot's row in GEMM 2's tiles
(tile, split tail or not, consumer warp) as the kernel lays the rows out."""

import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _job():
    sys.path.insert(0, str(ROOT / "launch" / "jobs"))  # the job imports its sibling job_report
    try:
        spec = importlib.util.spec_from_file_location("check_fp8_race", ROOT / "launch" / "jobs" / "check_fp8_race.py")
        job = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(job)
        return job
    finally:
        sys.path.pop(0)


def test_race_knob_is_read_by_the_fp8_gemm():
    job = _job()
    source = (ROOT / "cuda" / "gemm" / "grouped_gemm_fp8.cu").read_text()
    assert f"#ifndef {job.RACE_KNOB}\n" in source
    from epserve.runtime import kernels

    assert set(job.FP8_GEMMS) <= set(kernels.VARIANTS)


def test_rows_are_placed_in_tiles_as_the_dispatch_orders_them():
    """Rows of an expert are ordered by (source rank, token, slot); m-tiles of 128 rows from
    the expert's first row; a tile of at most 64 rows is a split tail; warp = row % 64 // 16."""
    job = _job()
    E, k = 3, 1
    # expert 0: 70 rows (one full tile), expert 1: 40 rows (one split tail), expert 2: 150
    # rows (a full tile and a 22-row split tail); rank 0's tokens first, then rank 1's.
    idx0 = np.array([0] * 35 + [1] * 20 + [2] * 75, np.int32).reshape(-1, k)
    idx1 = np.array([0] * 35 + [1] * 20 + [2] * 75, np.int32).reshape(-1, k)
    topk_all = [idx0, idx1]
    rows, position = job.where_rows_live(topk_all, E)
    assert list(rows) == [70, 40, 150]
    assert position[1][0, 0] == 35  # rank 1's first row of expert 0 follows rank 0's 35
    # rank 1: token 0 (expert 0, row 35), token 40 (expert 1, row 25), token 129 (expert 2, row 149)
    found, kinds = job.describe_units([(0, 0, 0), (40, 0, 5), (129, 0, 111)], topk_all, 1, (rows, position))
    assert [(f["expert"], f["tile"], f["tile_rows"], f["row_in_tile"], f["split_tail"], f["warp"]) for f in found] == [
        (0, 0, 70, 35, False, 2), (1, 0, 40, 25, True, 1), (2, 1, 22, 21, True, 1)]
    assert kinds == {"full tile, warp 2": 1, "split tail, warp 1": 2}
