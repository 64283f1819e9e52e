"""launch/jobs/trace_gemm_fp8.py's reading of the FP8 GEMM's %clock64 stamps, on stamps made up
here: each span lands under its name, the stop entry after a CTA's last tile and slots never
written are left out."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

JOB = Path(__file__).resolve().parents[2] / "launch" / "jobs" / "trace_gemm_fp8.py"


@pytest.fixture(scope="module")
def job():
    spec = importlib.util.spec_from_file_location("trace_gemm_fp8", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def made_up_stamps(job, tiles_per_cta, k_blocks, wait=100, k_block=1200, epilogue=800, gap=40, take=2000):
    """Stamps of CTAs each running tiles_per_cta[b] tiles back to back with fixed spans, then the
    stop entry (start and first wait stamped, nothing else)."""
    s = np.zeros((job.CTAS, job.TILES, job.SLOTS), np.int64)
    for b, n in enumerate(tiles_per_cta):
        t = 1000 + 17 * b
        for i in range(n):
            s[b, i, 6] = t - take - 300
            s[b, i, 7] = t - 300
            s[b, i, 0] = t
            s[b, i, 1] = t + wait
            s[b, i, 4] = s[b, i, 1] + k_block + 50  # the first k-block is slower
            s[b, i, 5] = s[b, i, 4] + k_block
            s[b, i, 2] = s[b, i, 1] + k_blocks * k_block + 50
            s[b, i, 3] = s[b, i, 2] + epilogue
            t = s[b, i, 3] + gap
        s[b, n, 0], s[b, n, 1] = t, t + wait  # the stop entry
    return s


def test_spans_land_under_their_names(job):
    stamps = made_up_stamps(job, [5, 7, 6], k_blocks=16)
    got = job.summarize(stamps, 16)
    assert list(got["tiles per CTA"][:4]) == [5, 7, 6, 0]
    assert got["k-loop"].size == 18 and set(got["k-loop"]) == {16 * 1200 + 50}
    assert set(got["first-stage wait"]) == {100}
    assert set(got["epilogue + hand-over"]) == {800}
    assert got["hand-over to next tile"].size == 18 - 3 and set(got["hand-over to next tile"]) == {40}
    assert set(got["k-block 0"]) == {1250} and set(got["k-block 1"]) == {1200}
    assert set(got["producer: take + decode"]) == {2000}
    assert set(got["producer's take to consumers' start"]) == {400}
    assert got["per k-block"] == pytest.approx((16 * 1200 + 50) / 16)


def test_unwritten_slots_are_not_spans(job):
    stamps = made_up_stamps(job, [4], k_blocks=8)
    stamps[0, 1, 3] = 0  # a tile whose hand-over was not stamped (the peer sink gated off)
    stamps[0, :, 4:6] = 0  # split tails: no k-block stamps
    got = job.summarize(stamps, 8)
    assert got["k-loop"].size == 4
    assert got["epilogue + hand-over"].size == 3
    assert got["hand-over to next tile"].size == 2
    assert got["k-block 0"].size == 0 and got["k-block 1"].size == 0


def test_k_blocks_of_both_warpgroups(job):
    """EPSERVE_GEMM_FP8_TRACE=2's stamps: each warpgroup's k-blocks 1-7 and the second's lag."""
    stamps = made_up_stamps(job, [3, 2], k_blocks=16)
    first, second = 9, 9 + job.KBLOCKS
    for kt in range(job.KBLOCKS):
        stamps[:, :, first + kt] = np.where(stamps[:, :, 4] > 0, stamps[:, :, 1] + 1300 * (kt + 1), 0)
        stamps[:, :, second + kt] = np.where(stamps[:, :, 4] > 0, stamps[:, :, 1] + 1300 * (kt + 1) + 256, 0)
    stamps[:, :, 8] = np.where(stamps[:, :, 4] > 0, stamps[:, :, 1] + 700, 0)
    got = job.summarize(stamps, 16)
    assert set(got["k-block 0 before its MMA"]) == {700}
    for kt in range(1, job.KBLOCKS):
        assert set(got[f"k-block {kt}, first warpgroup"]) == {1300}
        assert set(got[f"k-block {kt}, second warpgroup"]) == {1300}
        assert set(got[f"k-block {kt}, second ends after the first by"]) == {256}
    plain = job.summarize(made_up_stamps(job, [3, 2], k_blocks=16), 16)  # =1: none of these spans
    assert not plain["k-block 0 before its MMA"].size and not plain["k-block 1, first warpgroup"].size


def test_cta_span_and_the_share_inside_tiles(job):
    """A CTA's span runs from its first stamp (the producer's first take) to its last (the stop
    entry's first wait); the share inside tiles is the tiles' start-to-hand-over sum over it."""
    tiles, k_blocks, wait, k_block, epilogue, gap, take = 4, 8, 100, 1200, 800, 40, 500  # stamps > 0
    stamps = made_up_stamps(job, [tiles], k_blocks=k_blocks, wait=wait, k_block=k_block, epilogue=epilogue, gap=gap,
                            take=take)
    got = job.summarize(stamps, k_blocks)
    tile = wait + k_blocks * k_block + 50 + epilogue
    span = (take + 300) + tiles * (tile + gap) + wait
    assert list(got["CTA span"]) == [span]
    assert got["CTA span inside its tiles, %"][0] == pytest.approx(100.0 * tiles * tile / span)
