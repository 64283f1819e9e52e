"""The combine's arm launch (epserve/combine/launchers.py), without a GPU: its block is the
kernel's own size, and the kernel, compiled, is bounded to that size (a launch with more
threads fails; with fewer, slots go uncounted and the reduction waits for rows that never
come). And the reduction's register array of slot rows holds every top_k a config allows."""

import pathlib
import re

import pytest

pytest.importorskip("cupy")

from epserve.combine import launchers  # noqa: E402
from epserve.runtime import build, kernels  # noqa: E402

SOURCE = pathlib.Path(__file__).resolve().parents[2] / "cuda" / "comm" / "combine.cu"


def test_arm_block_is_the_kernels():
    match = re.search(r"constexpr int kCombineArmThreads = (\d+);", SOURCE.read_text())
    assert match
    assert int(match.group(1)) == launchers.COMBINE_ARM_THREADS


def test_arm_kernel_bounded_to_its_block(tmp_path, monkeypatch):
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path))
    source, defines = kernels.VARIANTS["combine"]
    ptx = build.compile_source(source, defines).ptx.read_text()
    entry = ptx[ptx.index(".entry epserve_combine_arm("):]
    head = entry[:entry.index("{")]
    assert f".maxntid {launchers.COMBINE_ARM_THREADS}, 1, 1" in head


def test_reduction_holds_every_slot_a_config_allows():
    """The reduction keeps a token's slot rows in registers, kMaxTopK of them: every top_k
    MoEConfig accepts must fit, or slots past kMaxTopK would be dropped from the sum."""
    from epserve.config import MAX_SLOTS

    match = re.search(r"constexpr int kMaxTopK = (\d+);", SOURCE.read_text())
    assert match
    assert int(match.group(1)) >= MAX_SLOTS
