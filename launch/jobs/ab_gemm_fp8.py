"""Builds of the FP8 GEMMs against each other, timed as the bench times its rows, on one GPU:

    python launch/jobs/ab_gemm_fp8.py [--builds split,split-unpublished] [--problems gemm2,gemm1]
        [--rounds 4] [--build 'noB:EPSERVE_GEMM_FP8_TMA_LOADS=3' ...]

A build is a name of epserve.ffn.gemm_fp8.KNOBS ("split" is the shipped one), or, with
--build NAME:DEFINE=VALUE,..., the shipped build with those defines on top (diagnostic builds
of cuda/gemm/grouped_gemm_fp8.cu, or a knob being tried). Problems:
- gemm2: dsv3-prefill's GEMM 2 at rank 0 of 2's balanced rows (32777 rows over 128 experts),
  twice: the peer build with its sink gated off (the bench's `gemm2` row: the k-loops alone)
  and the null sink storing C;
- gemm1: GEMM 1 + SwiGLU + act's quantization, same rows;
- denseK: one expert of 8192 x 8192 with K = K (the null sink).

Timing, the bench's way (epserve.bench.measure): after 0.25 s idle, 3 calls, then 10 with a
wait after each, the median; the SM clock read right after (epserve.bench.clock). A round
takes every (problem, build) in turn, the next round in reverse order; the table gives every
round and their median. The bench's rows are shorter than the power controller's reaction, so
they run near the top clock; a build's gain here need not survive a sustained run
(launch/jobs/time_gemm_sustained.py), and the other way round (notes/gemm.md, twenty-second
and twenty-third sessions). Rows differ by 2-5% from machine to machine: compare within a run.

#wrong: elements (bytes of act for GEMM 1) differing from the shipped build's output on the
same inputs; "-" for the gated rows, which write nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHIPPED = "split"


def parse_build(spec: str) -> tuple[str, dict[str, int]]:
    """'NAME:DEF=V,DEF=V' -> (NAME, {DEF: V}); every define must be one the FP8 GEMM reads
    (a misspelt one would time the shipped build under another name)."""
    name, sep, defines = spec.partition(":")
    if not sep or not name or not defines:
        raise ValueError(f"--build {spec!r}: expected NAME:DEFINE=VALUE[,DEFINE=VALUE...]")
    out = {}
    for item in defines.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.startswith("EPSERVE_"):
            raise ValueError(f"--build {spec!r}: {item!r} is not DEFINE=VALUE")
        out[key] = int(value)
    return name, out


def check_defines(defines: dict[str, int], source: str) -> None:
    for key in defines:
        if f"#ifndef {key}\n" not in source:
            raise ValueError(f"{key} is not a define of cuda/gemm/grouped_gemm_fp8.cu")


def problem_operands(prob: str, rs):
    """(M, N, K, experts, offsets, a_q, a_s, b_q, b_s) of a problem (see the top of the file),
    random operands quantized as the layer quantizes them. N is B's rows an expert (2I for
    GEMM 1)."""
    import cupy
    from time_gemm import rows_per_expert  # launch/jobs/time_gemm.py

    from epserve.arrays import BF16
    from epserve.bench import presets
    from epserve.ffn import fp8

    if prob.startswith("dense"):
        K, M, N, experts = int(prob[len("dense"):]), 8192, 8192, 1
        offsets = cupy.asarray(np.array([0, M], np.int32))
    else:
        preset = presets.get_preset("dsv3-prefill")
        H, I = preset.hidden, preset.intermediate
        rows = rows_per_expert("balanced", preset, 2, 1)
        offsets_host = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
        M, experts, offsets = int(offsets_host[-1]), preset.num_experts // 2, cupy.asarray(offsets_host)
        N, K = {"gemm2": (H, I), "gemm1": (2 * I, H)}[prob]
    a_q, a_s = fp8.quantize_rows(rs.standard_normal((M, K), dtype=np.float32).astype(BF16))
    b_q, b_s = fp8.quantize_blocks((rs.standard_normal((experts, N, K), dtype=np.float32) / np.sqrt(K)).astype(BF16))
    return M, N, K, experts, offsets, a_q, a_s, b_q, b_s


def bench_ms(fn, clock) -> tuple[float, float]:
    """(median ms, MHz after) of fn timed as a bench row."""
    from epserve.bench.events import samples_ms

    time.sleep(0.25)
    ms = float(np.median(samples_ms(fn, 3, 10)))
    return ms, clock.mhz()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", default="split,split-unpublished", help="KNOBS names, comma-separated")
    p.add_argument("--build", action="append", default=[], help="NAME:DEFINE=VALUE,... (the shipped build plus)")
    p.add_argument("--problems", default="gemm2,gemm1")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()

    import cupy

    from epserve.arrays import BF16
    from epserve.bench import arithmetic, presets
    from epserve.bench.clock import SmClock
    from epserve.bench.wrong import bitwise_wrong
    from epserve.ffn import gemm_fp8
    from epserve.runtime import build
    from epserve.runtime.kernel_structs import PEER_SEND_CONFIG

    source = (build.find_cuda_root() / "gemm" / "grouped_gemm_fp8.cu").read_text()
    builds = [b for b in args.builds.split(",") if b]
    for spec in args.build:
        name, defines = parse_build(spec)
        check_defines(defines, source)
        gemm_fp8.KNOBS[name] = {**gemm_fp8.KNOBS[SHIPPED], **defines}
        builds.append(name)
    if SHIPPED not in builds:
        builds.insert(0, SHIPPED)
    unknown = [b for b in builds if b not in gemm_fp8.KNOBS]
    if unknown:
        raise SystemExit(f"unknown builds {unknown}; KNOBS has {sorted(gemm_fp8.KNOBS)}")

    def variant(base, knob):
        return gemm_fp8.register_knob(base, knob)

    clock = SmClock()
    rs = cupy.random.RandomState(5)
    preset = presets.get_preset("dsv3-prefill")
    H, I, E = preset.hidden, preset.intermediate, preset.num_experts // 2
    runs, flops = {}, {}  # label -> (fn, output or None, label of the shipped build's row)
    for prob in args.problems.split(","):
        M, N, K, experts, offsets, a_q, a_s, b_q, b_s = problem_operands(prob, rs)
        for knob in builds:
            if prob == "gemm1":
                if not gemm_fp8.knob_applies("gemm1_fp8_swiglu", knob):
                    continue
                out = (cupy.zeros((M, I), np.uint8), cupy.zeros((I // 128, (M + 3) // 4 * 4), np.float32))
                specs = gemm_fp8._specs(variant("gemm1_fp8_swiglu", knob), a_q, a_s, b_q, b_s, E * 2 * I, *out,
                                        offsets, E, I, H, gemm_fp8._NO_PEERS, 0)
                label, f = f"gemm1 {knob}", arithmetic.gemm1_flops(M, H, I)
            else:
                if prob == "gemm2":
                    gated = gemm_fp8._specs(variant("gemm_fp8_peer", knob), a_q, a_s, b_q, b_s, experts * N, None,
                                            None, offsets, experts, N, K, np.zeros(1, PEER_SEND_CONFIG), -1)
                    runs[f"gemm2 gated {knob}"] = (lambda s=gated: gemm_fp8.run(s), None, None)
                    flops[f"gemm2 gated {knob}"] = arithmetic.gemm2_flops(M, H, I)
                out = (cupy.full((M, N), np.nan, BF16),)
                specs = gemm_fp8._specs(variant("gemm_fp8_null", knob), a_q, a_s, b_q, b_s, experts * N, *out, None,
                                        offsets, experts, N, K, gemm_fp8._NO_PEERS, 0)
                label = f"{prob} {'null ' if prob == 'gemm2' else ''}{knob}"
                f = arithmetic.gemm2_flops(M, H, I) if prob == "gemm2" else 2 * M * N * K
            runs[label] = (lambda s=specs: gemm_fp8.run(s), out, label.rsplit(" ", 1)[0] + f" {SHIPPED}")
            flops[label] = f

    for fn, _, _ in runs.values():
        fn()
    cupy.cuda.Device().synchronize()
    wrong = {label: ("-" if out is None else sum(bitwise_wrong(o, r) for o, r in zip(out, runs[ref][1])))
             for label, (fn, out, ref) in runs.items()}
    times = {label: [] for label in runs}
    clocks = {label: [] for label in runs}
    labels = list(runs)
    for rnd in range(args.rounds):
        for label in labels if rnd % 2 == 0 else labels[::-1]:
            ms, mhz = bench_ms(runs[label][0], clock)
            times[label].append(ms)
            clocks[label].append(mhz)
    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# FP8 GEMM builds on {dev}, timed as bench rows, {args.rounds} rounds alternated")
    print(f"{'problem and build':<36}{'rounds (us)':<{7 * args.rounds + 2}}{'median us':>10}{'TFLOP/s':>9}"
          f"{'MHz':>6}{'vs shipped':>11}{'#wrong':>10}")
    for label in labels:
        ms = float(np.median(times[label]))
        ref = label.rsplit(" ", 1)[0] + f" {SHIPPED}"
        vs = f"{ms / float(np.median(times[ref])) - 1:+.1%}" if ref in times and ref != label else ""
        print(f"{label:<36}{' '.join(f'{t * 1e3:6.0f}' for t in times[label]):<{7 * args.rounds + 2}}"
              f"{ms * 1e3:10.0f}{flops[label] / ms / 1e9:9.0f}{np.median(clocks[label]):6.0f}{vs:>11}{wrong[label]!s:>10}")


if __name__ == "__main__":
    main()
