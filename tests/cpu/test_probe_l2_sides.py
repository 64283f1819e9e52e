"""epserve/runtime/l2_sides.py (and launch/jobs/probe_l2_sides.py, which prints its
measurement) on a machine with no GPU: the probe kernel builds, each block's region is one
cycle through all its lines (a chase that skipped lines would time fewer loads than it
divides by), the sides split at the widest gap with the reference on side 0, and the FP8
GEMM's table is rep 0's sides only where the reps agree and split the SMs in two halves."""

import re

import numpy as np

from epserve.runtime import build, kernels
from epserve.runtime import l2_sides as probe


def test_probe_kernel_compiles(tmp_path, monkeypatch):
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path))
    source, defines = kernels.VARIANTS["l2_sides_probe"]
    assert source == probe.SOURCE
    art = build.compile_source(source, defines)
    assert f".entry {probe.KERNEL}" in art.ptx.read_text()
    assert not re.search(r"[1-9]\d* bytes spill stores", art.log), art.log


def test_each_region_is_one_cycle_through_all_its_lines():
    chase = probe.chase_regions(np.random.default_rng(3), blocks=5, lines=37)
    assert chase.shape == (5, 37, 32) and not chase[:, :, 1:].any()
    for region in chase[:, :, 0]:
        seen, line = [], 0
        for _ in range(37):
            seen.append(line)
            line = int(region[line])
        assert line == 0 and sorted(seen) == list(range(37))


def test_sides_split_at_the_widest_gap_with_the_reference_on_side_0():
    rng = np.random.default_rng(1)
    per_sm = {sm: (300.0 if sm % 3 else 360.0) + rng.uniform(-5, 5) for sm in range(1, 40)}
    sides, gap = probe.sides_of(0, per_sm)
    assert sides[0] == 0 and 40 < gap < 70
    assert all(sides[sm] == (0 if sm % 3 else 1) for sm in per_sm)


SMS = 12
FAR = {1, 2, 5, 6, 9, 10}  # the SMs on the far side of SM 0


def rep(ref: int, rng, swap=()):
    """One_rep's result for a block 0 on SM `ref`: the SMs on ref's side load fast. `swap`: SMs
    put on the wrong side (a noisy rep)."""
    side = {sm: int((sm in FAR) != (ref in FAR)) ^ (sm in swap) for sm in range(SMS)}
    return ref, {sm: (300.0 if side[sm] == 0 else 355.0) + rng.uniform(-3, 3) for sm in range(SMS) if sm != ref}


def test_the_table_is_rep_0s_sides_where_the_reps_agree():
    rng = np.random.default_rng(2)
    got = probe.from_reps([rep(0, rng), rep(5, rng), rep(3, rng)], SMS)  # rep 1's reference is on the far side
    assert got.why_not is None and got.agreement == 1.0 and 45 < got.gap < 65
    assert got.table.shape == (probe.TABLE_ENTRIES,) and got.table.dtype == np.uint8
    assert [int(v) for v in got.table[:SMS]] == [int(sm in FAR) for sm in range(SMS)]
    assert not got.table[SMS:].any() and got.counts == (probe.TABLE_ENTRIES - 6, 6)


def test_reps_that_disagree_or_do_not_split_in_two_give_all_zeros():
    rng = np.random.default_rng(4)
    noisy = probe.from_reps([rep(0, rng), rep(0, rng, swap={3, 4})], SMS)  # 10 of 12 agree: under 95%
    assert not noisy.table.any() and "agree on 83%" in noisy.why_not
    lopsided = {sm: 300.0 + (60.0 if sm == 7 else 0.0) + rng.uniform(-3, 3) for sm in range(1, SMS)}
    one_far = probe.from_reps([(0, lopsided)], SMS)
    assert not one_far.table.any() and "1 of 12 SMs on the far side" in one_far.why_not
