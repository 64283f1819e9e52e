"""launch/jobs/probe_l2_sides.py on a machine with no GPU: its kernel builds, each block's
region is one cycle through all its lines (a chase that skipped lines would time fewer
loads than it divides by), and the sides split at the widest gap with the reference on
side 0."""

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from epserve.runtime import build

JOB = Path(__file__).resolve().parents[2] / "launch" / "jobs" / "probe_l2_sides.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_l2_sides", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_kernel_compiles(probe, tmp_path, monkeypatch):
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path))
    art = build.compile_source(probe.SOURCE, {})
    assert f".entry {probe.KERNEL}" in art.ptx.read_text()
    assert not re.search(r"[1-9]\d* bytes spill stores", art.log), art.log


def test_each_region_is_one_cycle_through_all_its_lines(probe):
    chase = probe.chase_regions(np.random.default_rng(3), blocks=5, lines=37)
    assert chase.shape == (5, 37, 32) and not chase[:, :, 1:].any()
    for region in chase[:, :, 0]:
        seen, line = [], 0
        for _ in range(37):
            seen.append(line)
            line = int(region[line])
        assert line == 0 and sorted(seen) == list(range(37))


def test_sides_split_at_the_widest_gap_with_the_reference_on_side_0(probe):
    rng = np.random.default_rng(1)
    per_sm = {sm: (300.0 if sm % 3 else 360.0) + rng.uniform(-5, 5) for sm in range(1, 40)}
    sides, gap = probe.sides_of(0, per_sm)
    assert sides[0] == 0 and 40 < gap < 70
    assert all(sides[sm] == (0 if sm % 3 else 1) for sm in per_sm)
