"""GEMM 1 (FP8, SwiGLU) reading A's rows gathered from one row per token, against the shipped
build reading expert-contiguous rows, on one GPU:

    python launch/jobs/time_gemm_fp8_gather.py [--rounds 4] [--tokens 8192]

The question it answers (notes/dispatch.md, "What is left for the <= 0.6 target"): the
dispatch writes each token once per expert it routes to (dsv3 at two ranks: ~4 expert rows a
token and rank, 0.24 GB of FP8 rows a rank at 4096 tokens). If GEMM 1 read its A rows from one
copy per token instead, the dispatch would write each token once per rank, as DeepEP's does, and
the expansion's bytes would be gone. What would GEMM 1 pay for gathering its rows?

The problem: dsv3-prefill at rank 0 of 2's balanced rows (32777 rows over 128 experts), each
expert's rows a sorted random subset of `--tokens` token rows (about four experts a token).
Builds of the same kernel (cuda/gemm/grouped_gemm_fp8.cu, EPSERVE_GEMM_FP8_GATHER_A):
- shipped: A = the token rows expanded into expert rows (what the dispatch writes today), by TMA;
- gather: A's rows read from the token rows (packed rows of 7424 bytes, as the dispatch's
  token regions hold them) by the producer warp's cp.async, through a row map;
- gather, expert rows: the same build reading the expanded rows through the identity map (the
  cp.async path alone, with TMA's access pattern).
The gather builds get a poisoned A (0x7F: e4m3 NaN) for their TMA map, so a row read through it
would show. #wrong: act and act's scales differing in any bit from the shipped build's. Times as
ab_gemm_fp8.py's: a bench row each (0.25 s idle, 3 + 10 calls, median), builds alternated.
"""

from __future__ import annotations

import argparse

import cupy
import numpy as np
from ab_gemm_fp8 import bench_row, dsv3_rows_and_weights  # launch/jobs/ab_gemm_fp8.py
from time_gemm_sustained import block_order, holding, wrong  # launch/jobs/time_gemm_sustained.py

from epserve.arrays import BF16
from epserve.bench import arithmetic
from epserve.bench.clock import SmClock
from epserve.ffn import fp8, gemm_fp8
from epserve.runtime import kernels

GATHER = {"EPSERVE_GEMM_FP8_GATHER_A": 1}


def gather_variant(name: str, extra: dict) -> str:
    """GEMM 1's shipped build with GATHER_A (and `extra`, which only keys a module of its own:
    the row map lives in the module's globals)."""
    source, defines = kernels.VARIANTS["gemm1_fp8_swiglu"]
    kernels.VARIANTS[name] = (source, {**defines, **GATHER, **extra})
    return name


def set_gather(variant: str, src, pitch: int, rows) -> None:
    """The module's epserve_gemm_gather_* globals: rows of `src` at `pitch` bytes, by `rows`."""
    mod = kernels.module(variant)
    for name, value in (("epserve_gemm_gather_src", src.data.ptr), ("epserve_gemm_gather_pitch", pitch),
                        ("epserve_gemm_gather_rows", rows.data.ptr)):
        host = np.array([value], np.int64)
        mod.get_global(name).copy_from_host(host.ctypes.data, 8)


def expert_rows_of_tokens(rng, counts, tokens: int) -> np.ndarray:
    """For each expert in turn, a sorted random subset of `tokens` token indices of its size:
    the token of each expert row, in the dispatch's order."""
    return np.concatenate([np.sort(rng.choice(tokens, int(c), replace=False)) for c in counts]).astype(np.int32)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192, help="token rows the expert rows are drawn from")
    args = p.parse_args()

    rs = cupy.random.RandomState(7)
    H, I, offsets_host, weights = dsv3_rows_and_weights(rs, True)
    E, M = weights.w13.shape[0], int(offsets_host[-1])
    counts = np.diff(offsets_host)
    tok_of_row = expert_rows_of_tokens(np.random.default_rng(7), counts, args.tokens)
    offsets = cupy.asarray(offsets_host)

    x = rs.standard_normal((args.tokens, H), dtype=np.float32).astype(BF16)
    q_tok, s_tok = fp8.quantize_rows(x)
    pitch = fp8.packed_row_bytes(H)
    packed = cupy.zeros((args.tokens, pitch), np.uint8)  # the token regions' rows: values, then (here) zeros
    packed[:, :H] = q_tok
    rows = cupy.asarray(tok_of_row)
    a_q = cupy.ascontiguousarray(q_tok[rows])  # what the dispatch writes today
    a_s = cupy.zeros((H // 128, fp8.scale_ld(M)), np.float32)
    a_s[:, :M] = s_tok[:, rows]
    poisoned = cupy.full_like(a_q, 0x7F)
    identity = cupy.arange(M, dtype=np.int32)

    builds = [("shipped (expert rows, TMA)", "gemm1_fp8_swiglu", a_q, None),
              ("gather (token rows)", gather_variant("gemm1_fp8_swiglu+gather", {}), poisoned, (packed, pitch, rows)),
              ("gather (expert rows)", gather_variant("gemm1_fp8_swiglu+gather_identity", {"EPSERVE_GATHER_ID": 1}),
               poisoned, (a_q, H, identity))]
    runs = {}
    for name, variant, a, gather in builds:
        out = (cupy.full((M, I), 0x7F, np.uint8), cupy.full((I // 128, fp8.scale_ld(M)), np.nan, np.float32))
        specs = gemm_fp8._specs(variant, a, a_s, weights.w13, weights.w13_scales, E * 2 * I, *out, offsets, E, I, H,
                                gemm_fp8._NO_PEERS, 0)
        if gather is not None:
            set_gather(variant, *gather)
        runs[name] = (holding(gemm_fp8.run, specs, a, a_s, gather, out), (out[0], out[1][:, :M]))
    names = list(runs)
    for n in names:
        runs[n][0]()
    cupy.cuda.Device().synchronize()
    n_wrong = {n: wrong(runs[n][1], runs[names[0]][1]) for n in names}

    clock = SmClock()
    times = {n: [] for n in names}
    during = {n: [] for n in names}
    for rnd in range(args.rounds):
        for n in block_order(names, rnd):
            ms, _, mhz = bench_row(runs[n][0], clock)
            times[n].append(ms)
            during[n].append(mhz)
    flops = arithmetic.gemm1_flops(M, H, I)
    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    reuse = M / len(np.unique(tok_of_row))
    print(f"# GEMM 1 (FP8 + SwiGLU) on {dev}: {M} expert rows over {E} experts drawn from {args.tokens} token rows "
          f"({reuse:.2f} expert rows a token used); {args.rounds} rounds, builds alternated; #wrong: bits against "
          f"the shipped build")
    width = 7 * args.rounds + 2
    print(f"{'build':<30}{'rounds (us)':<{width}}{'us':>8}{'TFLOP/s':>9}{'MHz':>6}{'vs shipped':>12}{'#wrong':>8}")
    base = float(np.median(times[names[0]]))
    for n in names:
        ms = float(np.median(times[n]))
        vs = "" if n == names[0] else f"{ms / base - 1:+.1%}"
        rounds = " ".join(f"{t * 1e3:6.0f}" for t in times[n])
        print(f"{n:<30}{rounds:<{width}}{ms * 1e3:8.0f}{flops / ms / 1e9:9.0f}{np.median(during[n]):6.0f}{vs:>12}"
              f"{n_wrong[n]:>8}")


if __name__ == "__main__":
    main()
