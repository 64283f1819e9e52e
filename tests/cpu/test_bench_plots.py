"""Plots written as PNG files from synthetic rows (Agg backend, no display)."""

import dataclasses

import pytest

from epserve.bench import presets as ps
from epserve.bench.arithmetic import Floor
from epserve.bench.results import Row, with_baselines
from epserve.bench.timing import Timing

pytest.importorskip("matplotlib", reason="matplotlib is not installed: the plots cannot be drawn")
# Imported after the skip: the tests need it only where matplotlib is there to draw with.
from epserve.bench import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sweep_rows():
    """Two presets (one scaled, whose name holds a '/'), two routings, three paths; the
    library path did not run at the smallest point."""
    rows = []
    for preset in (ps.get_preset("mixtral"), ps.scaled(ps.get_preset("dsv3-decode"), hidden=512)):
        for routing in (ps.balanced(), ps.skewed()):
            for tokens in (64, 256, 1024):
                point = dataclasses.replace(preset, tokens_per_rank=tokens)
                floor = Floor(tokens * 1e-7, "gemm", {"gemm": tokens * 1e-7, "hbm": 0.0, "nvlink": 0.0})
                for path, scale in (("unfused", 3.0), ("fused", 1.5), ("nccl", 4.0)):
                    if path == "nccl" and tokens == 64:
                        rows.append(Row(point, routing, path))
                        continue
                    ms = scale * tokens * 1e-4
                    rows.append(Row(point, routing, path, timing=Timing([ms, ms * 1.1]),
                                    floor=None if path == "nccl" else floor))
    return with_baselines(rows, unfused_path="unfused", library_path="nccl")


def assert_png(path):
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_one_png_per_preset(tmp_path):
    written = plots.plot_presets(sweep_rows(), tmp_path / "plots")
    assert sorted(p.name for p in written) == ["dsv3-decode_scaled.png", "mixtral.png"]
    for path in written:
        assert_png(path)


def test_speedup_summary(tmp_path):
    path = plots.plot_speedups(sweep_rows(), tmp_path / "summary" / "speedups.png")
    assert_png(path)


def test_speedup_summary_without_any_speedup(tmp_path):
    rows = [Row(ps.get_preset("mixtral"), ps.balanced(), "fused", timing=Timing([1.0]))]
    assert_png(plots.plot_speedups(rows, tmp_path / "none.png"))
