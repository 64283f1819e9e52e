"""Where a tile's time goes in the FP8 GEMMs, from the EPSERVE_GEMM_FP8_TRACE build's %clock64
stamps (cuda/gemm/grouped_gemm_fp8.cu says which point each slot marks), on one GPU:

    python launch/jobs/trace_gemm_fp8.py [--problems dense8192 dense2048 gemm2 gemm1] [--no-loads]
                                         [--on split+ahead ...] [--k-blocks]

Problems: denseK is one expert of 8192 x 8192 with K = K; gemm2 and gemm1 are dsv3-prefill at
rank 0 of 2's balanced rows (32777 rows over 128 experts), GEMM 2 with the null sink (storing
C) and GEMM 1 with SwiGLU. Each build is launched as the bench launches it (idle 0.25 s, three
calls, then the traced one), and the last launch's stamps are read back. --no-loads adds the
same build with no TMA load at all (the ring holds whatever it held: the time of the math and
the hand-overs alone). --on adds the trace built over each given knob build
(epserve.ffn.gemm_fp8.KNOBS) instead of the shipped one (GEMM 2's and GEMM 1's differ).
--k-blocks stamps each warpgroup's k-blocks 0-7 too (a build of its own, slower by the stamps:
compare it only with itself): each k-block's cycles on either warpgroup, and how far the second
warpgroup's end of it lies behind the first's (about one wgmma group, +-256 cycles, where the
two take turns in the tensor pipe).
Cycles are the SM's own (%clock64), medians over the traced tiles of whole-tile rows where it
matters (k-blocks 0 and 1).

Each header gives the traced launch's time: the trace costs a few instructions a k-block
(1-2%). notes/gemm.md, twenty-third session, has what it showed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CTAS, TILES, SLOTS = 132, 128, 25  # cuda/gemm/grouped_gemm_fp8.cu: kTraceCtas, kTraceTiles, kTraceSlots
KBLOCKS = 8  # kTracedKBlocks: k-blocks 0 .. 7 of each warpgroup stamped (EPSERVE_GEMM_FP8_TRACE=2)
TRACE = {"EPSERVE_GEMM_FP8_TRACE": 1}
NO_LOADS = {"EPSERVE_GEMM_FP8_TMA_LOADS": 0}


def summarize(stamps: np.ndarray, k_blocks: int) -> dict:
    """Per-tile spans (cycles) from stamps [CTAS, TILES, SLOTS]; a slot never written is 0. A
    tile counts where the first consumer warpgroup stamped its start, its first wait and its
    k-loop's end (the stop entry after a CTA's last tile has no k-loop end). Returns lists of
    cycles by name, and the per-k-block median of the k-loops."""
    s = stamps.astype(np.int64)
    tile = (s[:, :, 0] > 0) & (s[:, :, 1] > 0) & (s[:, :, 2] > 0)
    handed = tile & (s[:, :, 3] > 0)
    out = {
        "first-stage wait": s[:, :, 1][tile] - s[:, :, 0][tile],
        "k-loop": s[:, :, 2][tile] - s[:, :, 1][tile],
        "epilogue + hand-over": s[:, :, 3][handed] - s[:, :, 2][handed],
        "hand-over to next tile": (s[:, 1:, 0] - s[:, :-1, 3])[handed[:, :-1] & tile[:, 1:]],
    }
    whole = tile & (s[:, :, 4] > 0) & (s[:, :, 5] > 0)
    out["k-block 0"] = s[:, :, 4][whole] - s[:, :, 1][whole]
    out["k-block 1"] = s[:, :, 5][whole] - s[:, :, 4][whole]
    before = whole & (s[:, :, 8] > 0)
    out["k-block 0 before its MMA"] = s[:, :, 8][before] - s[:, :, 1][before]
    # each k-block's span on either warpgroup, and how far the second one ends behind the first
    first, second = s[:, :, 9:9 + KBLOCKS], s[:, :, 9 + KBLOCKS:9 + 2 * KBLOCKS]
    for kt in range(1, min(KBLOCKS, k_blocks)):
        both = whole & (first[:, :, kt] > 0) & (second[:, :, kt] > 0) & (second[:, :, kt - 1] > 0)
        out[f"k-block {kt}, first warpgroup"] = (first[:, :, kt] - first[:, :, kt - 1])[both]
        out[f"k-block {kt}, second warpgroup"] = (second[:, :, kt] - second[:, :, kt - 1])[both]
        out[f"k-block {kt}, second ends after the first by"] = (second[:, :, kt] - first[:, :, kt])[both]
    taken = (s[:, :, 6] > 0) & (s[:, :, 7] > 0)
    out["producer: take + decode"] = s[:, :, 7][taken] - s[:, :, 6][taken]
    out["producer's take to consumers' start"] = s[:, :, 1][tile & taken] - s[:, :, 7][tile & taken]
    out["tiles per CTA"] = tile.sum(axis=1)
    # each CTA's span, its first stamp to its last, and how much of it lies inside its tiles
    # (first wait to hand-over): the rest is the gaps between tiles and the CTA's end
    ctas = (s > 0).any(axis=(1, 2))
    masked = np.where(s > 0, s, np.iinfo(np.int64).max)
    span = (s.max(axis=(1, 2)) - masked.min(axis=(1, 2)))[ctas]
    inside = np.where(handed, s[:, :, 3] - s[:, :, 0], 0).sum(axis=1)[ctas]
    out["CTA span"] = span
    out["CTA span inside its tiles, %"] = 100.0 * inside / np.maximum(span, 1)
    out["per k-block"] = float(np.median(out["k-loop"])) / k_blocks if out["k-loop"].size else float("nan")
    return out


def print_summary(label: str, us: float, summary: dict) -> None:
    tiles = summary["tiles per CTA"]
    print(f"## {label}: {us:.0f} us (the traced launch), {tiles.min()}-{tiles.max()} tiles a CTA, k-loop "
          f"{summary['per k-block']:.0f} cycles a k-block (median)")
    span = summary["CTA span"]
    if len(span):  # cycles over the launch's time: the SM clock the launch ran at, on average
        print(f"   SM clock over the launch: {np.median(span) / us:.0f} MHz (median CTA span), "
              f"{np.max(span) / us:.0f} MHz (longest)")
    for name, v in summary.items():
        if name in ("tiles per CTA", "per k-block") or not len(v):
            continue
        p10, p50, p90 = np.percentile(v, [10, 50, 90])
        print(f"   {name:<38} p10 {p10:8.0f}   p50 {p50:8.0f}   p90 {p90:8.0f}")


def traced_launch(variant: str, fn):
    """(us of the last launch, its stamps): idle, three calls, the stamps zeroed, one more."""
    import cupy

    from epserve.runtime import kernels

    mem = kernels.module(variant).get_global("epserve_gemm_trace")
    stamps = cupy.ndarray((CTAS * TILES * SLOTS,), np.int64, memptr=mem)
    time.sleep(0.25)
    for _ in range(3):
        fn()
    stamps[:] = 0
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3, stamps.get().reshape(CTAS, TILES, SLOTS)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", nargs="+", default=["dense8192", "dense2048", "gemm2", "gemm1"])
    p.add_argument("--no-loads", action="store_true", help="also the build without TMA loads")
    p.add_argument("--on", nargs="*", default=[], help="also trace over these epserve.ffn.gemm_fp8.KNOBS builds")
    p.add_argument("--k-blocks", action="store_true",
                   help="stamp k-blocks 0-7 of both warpgroups too (EPSERVE_GEMM_FP8_TRACE=2: ~7%% slower)")
    args = p.parse_args()

    import cupy
    from ab_gemm_fp8 import dense_runs, dsv3_rows_and_weights  # launch/jobs/ab_gemm_fp8.py
    from time_gemm_sustained import gemm1_runs, gemm2_runs  # launch/jobs/time_gemm_sustained.py

    from epserve.ffn import gemm_fp8

    unknown = [k for k in args.on if k not in gemm_fp8.KNOBS]
    if unknown:
        p.error(f"--on: unknown knob builds {unknown}; known: {sorted(gemm_fp8.KNOBS)}")
    rs = cupy.random.RandomState(5)
    need_weights = any(prob in ("gemm1", "gemm2") for prob in args.problems)
    H, I, offsets_host, weights = dsv3_rows_and_weights(rs, need_weights)
    for prob in args.problems:
        if prob in ("gemm2", "gemm1"):
            base, K = ("gemm_fp8_null", I) if prob == "gemm2" else ("gemm1_fp8_swiglu", H)
        elif prob.startswith("dense") and prob[len("dense"):].isdigit():
            base, K = "gemm_fp8_null", int(prob[len("dense"):])
        else:
            p.error(f"unknown problem {prob!r}")
        # the trace over this base's shipped build (GEMM 2's and GEMM 1's differ), registered
        # as <base>+<name> when the runs are built
        shipped = gemm_fp8.SHIPPED[base]
        trace = {"EPSERVE_GEMM_FP8_TRACE": 2} if args.k_blocks else TRACE
        over = {"trace": (shipped, trace),
                **({"trace, no loads": (shipped, {**trace, **NO_LOADS})} if args.no_loads else {}),
                **{f"trace on {k}": (k, trace) for k in args.on}}
        builds = list(over)
        for name, (knob, defines) in over.items():
            gemm_fp8.KNOBS[name] = {**gemm_fp8.KNOBS[knob], **defines}
        # runs as launch/jobs/time_gemm_sustained.py makes them: "FP8, <build>" is variant <base>+<build>
        if prob == "gemm2":
            runs, _ = gemm2_runs(rs, offsets_host, weights, H, I, builds, None, [])
        elif prob == "gemm1":
            runs, _ = gemm1_runs(rs, offsets_host, weights, H, I, builds, None, [])
        else:
            runs, _ = dense_runs(rs, K, builds)
        for build in builds:
            us, stamps = traced_launch(f"{base}+{build}", runs[f"FP8, {build}"][0])
            print_summary(f"{prob}, {build}", us, summarize(stamps, K // 128))


if __name__ == "__main__":
    main()
