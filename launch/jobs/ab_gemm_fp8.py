"""Builds of the FP8 GEMMs against each other, timed as the bench times its rows, on one GPU:

    python launch/jobs/ab_gemm_fp8.py [--knobs split-unpublished ...] [--build 'noB:EPSERVE_GEMM_FP8_TMA_LOADS=3']
        [--problems gemm2 gemm1 dense8192] [--rounds 4]

The shipped build, each of `--knobs` (epserve.ffn.gemm_fp8.KNOBS) and each `--build
NAME:DEFINE=VALUE,...` (the shipped build with those defines on top: a diagnostic build of
cuda/gemm/grouped_gemm_fp8.cu, or a knob being tried). Problems, on the builds and outputs of
launch/jobs/time_gemm_sustained.py (dsv3-prefill at rank 0 of 2's balanced rows, 32777 rows
over 128 experts; outputs poisoned, #wrong against the shipped build):
- gemm2: GEMM 2 with the null sink (storing C), and its peer build with the sink gated off
  (the bench's `gemm2` row: the k-loops alone, writing nothing: #wrong "-");
- gemm1: GEMM 1 + SwiGLU + act's quantization;
- denseK: one expert of 8192 x 8192 with K = K (the null sink).

That job times builds in long blocks, at the power limit a serving layer runs them at; this one
times them as the bench does (epserve.bench.events.samples_ms after 0.25 s idle: 3 calls, then
10 with a wait after each, the median; the SM clock read during one more call and right after,
epserve.bench.clock), the builds alternated over the rounds (A B .. B A). The power cap holds
even these short rows (1.3-1.6 GHz during them, ~1.98 GHz right after: notes/gemm.md,
twenty-eighth and twenty-ninth sessions), but less deep than a sustained run's, so a gain here
need not survive one, and the other way round. Rows differ by 2-5% from machine to machine:
compare within a run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from time_gemm import rows_per_expert  # launch/jobs/time_gemm.py
from time_gemm_fp8 import DenseFp8  # launch/jobs/time_gemm_fp8.py
from time_gemm_sustained import block_order, fp8_builds, gemm1_runs, gemm2_runs, holding, operands, wrong

SHIPPED = "FP8, shipped"  # time_gemm_sustained's name for the shipped build's row
FP8_GEMM_SOURCE = "gemm/grouped_gemm_fp8.cu"


def parse_build(spec: str) -> tuple[str, dict[str, int]]:
    """'NAME:DEF=V,DEF=V' -> (NAME, {DEF: V})."""
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


def check_defines(defines: dict[str, int]) -> None:
    """Every define is one the FP8 GEMM or a header it includes reads: a misspelt one would time
    the shipped build under another name."""
    from epserve.runtime import build

    if unread := build.unread_defines(FP8_GEMM_SOURCE, defines):
        raise ValueError(f"{' '.join(unread)} is not a define of cuda/{FP8_GEMM_SOURCE} or a header it includes")


def gated_runs(rs, offsets_host, weights, H, I, knobs):
    """GEMM 2's peer build with the sink gated off, per build: (launch, no output, no reference)."""
    from epserve.ffn import gemm_fp8
    from epserve.runtime.kernel_structs import PEER_SEND_CONFIG

    E = weights.w2.shape[0]
    offsets, _, (a_q, a_s) = operands(rs, offsets_host, I)
    gated_off = np.zeros(1, PEER_SEND_CONFIG)
    runs = {}
    for name, variant in fp8_builds("gemm_fp8_peer", knobs):
        specs = gemm_fp8._specs(variant, a_q, a_s, weights.w2, weights.w2_scales, E * H, None, None, offsets, E, H,
                                I, gated_off, -1)
        runs[name] = (holding(gemm_fp8.run, specs, a_q, a_s), None, None)
    return runs


def dense_runs(rs, K: int, knobs):
    """One expert of 8192 x 8192 x K per build: (launch, output, the shipped build's name)."""
    import cupy

    from epserve.arrays import BF16
    from epserve.ffn import gemm_fp8

    d = DenseFp8(rs, 8192, K)
    runs = {}
    for name, variant in fp8_builds("gemm_fp8_null", knobs):
        c = cupy.full((d.n, d.n), np.nan, BF16)
        runs[name] = (holding(gemm_fp8.run, d.build_specs(variant, c), d), (c,), SHIPPED)
    return runs, d.flops


def dsv3_rows_and_weights(rs, need_weights: bool):
    """(H, I, rank 0 of 2's balanced offsets on the host, FP8 weights or None) of dsv3-prefill,
    the weights drawn only where a problem needs them (GEMM 1's are 3.8 GB)."""
    from epserve.arrays import BF16
    from epserve.bench import presets
    from epserve.ffn import fp8

    preset = presets.get_preset("dsv3-prefill")
    H, I, E = preset.hidden, preset.intermediate, preset.num_experts // 2
    offsets_host = np.concatenate([[0], np.cumsum(rows_per_expert("balanced", preset, 2, 1))]).astype(np.int32)
    weights = None
    if need_weights:
        w13 = (rs.standard_normal((E, 2 * I, H), dtype=np.float32) / np.sqrt(H)).astype(BF16)
        w2 = (rs.standard_normal((E, H, I), dtype=np.float32) / np.sqrt(I)).astype(BF16)
        weights = fp8.quantize_weights(w13, w2)
    return H, I, offsets_host, weights


# The kernel variant each problem's rows launch, for the machine-code column.
PROBLEM_BASES = {"gemm2 gated": "gemm_fp8_peer", "gemm2 null": "gemm_fp8_null", "gemm1": "gemm1_fp8_swiglu"}


def code_digest(problem: str, row: str) -> str:
    """A digest of the machine code of the build a row times (epserve.runtime.machine_code):
    two builds with one digest run the same instructions, so their rows differ by noise only."""
    from epserve.runtime import build, kernels, machine_code

    base = PROBLEM_BASES.get(problem, "gemm_fp8_null")  # denseK: the null build
    variant = base if row == SHIPPED else f"{base}+{row.removeprefix('FP8, ')}"
    source, defines = kernels.VARIANTS[variant]
    return machine_code.digest(build.compile_source(source, defines).cubin)


def bench_row(fn, clock) -> tuple[float, float, float]:
    """(median ms, MHz after, MHz during) of fn timed as a bench row: the clock read right
    after the row's calls, and during one more call (from a third of its time, for a third)."""
    from epserve.bench.events import samples_ms

    time.sleep(0.25)
    ms = float(np.median(samples_ms(fn, 3, 10)))
    after = clock.mhz()
    return ms, after, clock.mhz_during_call(fn, ms)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--knobs", nargs="*", default=["split-unpublished"], help="epserve.ffn.gemm_fp8.KNOBS names")
    p.add_argument("--build", action="append", default=[], help="NAME:DEFINE=VALUE,... (the shipped build plus)")
    p.add_argument("--problems", nargs="+", default=["gemm2", "gemm1"], help="gemm2, gemm1, denseK")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()

    import cupy

    from epserve.bench.clock import SmClock
    from epserve.ffn import gemm_fp8

    knobs = list(args.knobs)
    for spec in args.build:
        name, defines = parse_build(spec)
        check_defines(defines)
        gemm_fp8.KNOBS[name] = defines  # on top of each problem's shipped build (GEMM 1's has no take-ahead)
        knobs.append(name)
    unknown = [k for k in knobs if k not in gemm_fp8.KNOBS]
    if unknown:
        p.error(f"unknown builds {unknown}; KNOBS has {sorted(gemm_fp8.KNOBS)}")

    rs = cupy.random.RandomState(5)
    need_weights = any(prob in ("gemm1", "gemm2") for prob in args.problems)
    H, I, offsets_host, weights = dsv3_rows_and_weights(rs, need_weights)
    groups = []  # (problem, runs, flops): runs as time_gemm_sustained makes them
    for prob in args.problems:
        if prob == "gemm2":
            runs, flops = gemm2_runs(rs, offsets_host, weights, H, I, knobs, None, [])
            groups += [("gemm2 gated", gated_runs(rs, offsets_host, weights, H, I, knobs), flops),
                       ("gemm2 null", runs, flops)]
        elif prob == "gemm1":
            groups.append(("gemm1", *gemm1_runs(rs, offsets_host, weights, H, I, knobs, None, [])))
        elif prob.startswith("dense") and prob[len("dense"):].isdigit():
            groups.append((prob, *dense_runs(rs, int(prob[len("dense"):]), knobs)))
        else:
            p.error(f"unknown problem {prob!r}")

    labels = [(g, name) for g, (_, runs, _) in enumerate(groups) for name in runs]
    for g, name in labels:
        groups[g][1][name][0]()
    cupy.cuda.Device().synchronize()
    clock = SmClock()
    times = {label: [] for label in labels}
    clocks = {label: [] for label in labels}
    during = {label: [] for label in labels}
    for rnd in range(args.rounds):
        for g, name in block_order(labels, rnd):
            ms, mhz, mhz_during = bench_row(groups[g][1][name][0], clock)
            times[(g, name)].append(ms)
            clocks[(g, name)].append(mhz)
            during[(g, name)].append(mhz_during)

    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# FP8 GEMM builds on {dev}, each timed as a bench row (0.25 s idle, 3 + 10 calls, median), "
          f"{args.rounds} rounds A B .. B A; #wrong: elements differing in any bit from the shipped build; "
          f"SM clock (MHz, medians) during one more call of the row and right after the row; code: a digest of "
          f"the build's machine code (a row whose code is the shipped build's differs from it by noise alone)")
    width = 7 * args.rounds + 2
    print(f"{'problem':<14}{'build':<28}{'rounds (us)':<{width}}{'us':>8}{'TFLOP/s':>9}{'during':>7}{'after':>6}"
          f"{'vs shipped':>12}{'#wrong':>8}  code")
    for g, name in labels:
        prob, runs, flops = groups[g]
        _, out, ref = runs[name]
        ms = float(np.median(times[(g, name)]))
        shipped = float(np.median(times[(g, SHIPPED)]))
        vs = "" if name == SHIPPED else f"{ms / shipped - 1:+.1%}"
        n_wrong = "-" if ref is None else str(wrong(out, runs[ref][1]))
        rounds = " ".join(f"{t * 1e3:6.0f}" for t in times[(g, name)])
        print(f"{prob:<14}{name:<28}{rounds:<{width}}{ms * 1e3:8.0f}{flops / ms / 1e9:9.0f}"
              f"{np.median(during[(g, name)]):7.0f}{np.median(clocks[(g, name)]):6.0f}{vs:>12}{n_wrong:>8}"
              f"  {code_digest(prob, name)}")


if __name__ == "__main__":
    main()
