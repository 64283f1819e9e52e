"""The grouped GEMMs alone on one GPU, at a preset's two shapes and the bench's routings:

    python launch/jobs/time_gemm.py [--preset dsv3-prefill] [--ranks 2] [--routing balanced ...]
                                    [--variants]

Rows per expert are those rank 0 receives when `--ranks` ranks each route the preset's
tokens per rank with the bench's routing (same seeds); `uniform` spreads them evenly
instead. For each routing: GEMM 1 + SwiGLU fused, the same GEMM storing [M, 2I] followed
by the SwiGLU kernel, and cuBLAS per expert (+ the SwiGLU kernel); GEMM 2 with the null
sink, in its peer build gated off, and cuBLAS per expert. CUDA-event medians, TFLOP/s,
the weights' streaming rate (what bounds decode), the share of MMA rows that are real
rows, and the largest difference from cuBLAS. `--variants` adds builds that differ in one
compile-time knob (listed in VARIANTS below), to measure a knob before it is made the
default; `--baseline-cuda DIR` adds both wgmma GEMMs built from another kernel tree whose
kernels take the same arguments (for example `git archive <rev> cuda | tar -x -C DIR`), an
A/B in one run. With `--warmup 1
--iters 1` every kernel runs twice, for a profiler. One process: no communication in the
numbers."""

from __future__ import annotations

import argparse
from pathlib import Path

import cupy
import numpy as np

from epserve.arrays import BF16
from epserve.bench import arithmetic, presets
from epserve.bench.cublas import gemm_nt, grouped_gemm_per_expert
from epserve.bench.events import median_ms, samples_ms
from epserve.ffn import gemm, tiles
from epserve.runtime import build, kernels
from epserve.runtime.kernel_structs import PEER_SEND_CONFIG

# Experimental builds of the wgmma GEMM (null sink): name -> extra defines.
VARIANTS = {
    "gemm_wgmma_null+cluster2": ("gemm_wgmma_null", {"EPSERVE_GEMM_CLUSTER": 2}),
    "gemm_wgmma_null+cluster2B": ("gemm_wgmma_null", {"EPSERVE_GEMM_CLUSTER": 2, "EPSERVE_GEMM_CLUSTER_SHARES_B": 1}),
    "gemm_wgmma_null+swap": ("gemm_wgmma_null", {"EPSERVE_GEMM_SWAP_TAILS": 1}),
    "gemm_wgmma_null+n128": ("gemm_wgmma_null", {"EPSERVE_GEMM_BN": 128}),
    "gemm1_wgmma_swiglu+cluster2": ("gemm1_wgmma_swiglu", {"EPSERVE_GEMM_CLUSTER": 2}),
    "gemm1_wgmma_swiglu+cluster2B": ("gemm1_wgmma_swiglu", {"EPSERVE_GEMM_CLUSTER": 2,
                                                            "EPSERVE_GEMM_CLUSTER_SHARES_B": 1}),
    "gemm1_wgmma_swiglu+swap": ("gemm1_wgmma_swiglu", {"EPSERVE_GEMM_SWAP_TAILS": 1}),
}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dsv3-prefill", choices=sorted(presets.PRESETS))
    p.add_argument("--ranks", type=int, default=2, help="ranks the preset's experts are spread over (default 2)")
    p.add_argument("--tokens", type=int, help="tokens per rank (default: the preset's)")
    p.add_argument("--routing", nargs="+", default=["uniform", "balanced", "skewed"],
                   help="uniform, balanced, skewed or skewed:<exponent> (default: all three)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--variants", action="store_true", help="also time the experimental builds in VARIANTS")
    p.add_argument("--skip-cublas", action="store_true")
    p.add_argument("--baseline-cuda", help="also time the wgmma GEMM of this kernel tree (its cuda/ folder)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=15)
    args = p.parse_args()
    preset = presets.scaled(presets.get_preset(args.preset), tokens_per_rank=args.tokens)
    H, I, E = preset.hidden, preset.intermediate, preset.num_experts // args.ranks
    for name, (base, defines) in VARIANTS.items():
        source, base_defines = kernels.VARIANTS[base]
        kernels.VARIANTS[name] = (source, {**base_defines, **defines})
    args.baseline = baseline_variants(args.baseline_cuda) if args.baseline_cuda else None
    rs = cupy.random.RandomState(5)
    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# grouped GEMMs on one GPU ({dev}): {preset.name}, H {H}, I {I}, {E} local experts of "
          f"{preset.num_experts} over {args.ranks} ranks, {preset.tokens_per_rank} tokens/rank, top-{preset.top_k}")
    print(f"{'routing':<12}{'GEMM':<8}{'path':>34}{'ms':>9}{'TFLOP/s':>9}{'weights GB/s':>13}{'max |diff|':>11}")
    if not args.skip_cublas:
        dense(rs, 8192)
    weights = {"w13": (rs.standard_normal((E, 2 * I, H), dtype=np.float32) / np.sqrt(H)).astype(BF16),
               "w2": (rs.standard_normal((E, H, I), dtype=np.float32) / np.sqrt(I)).astype(BF16)}
    for spec in args.routing:
        rows = rows_per_expert(spec, preset, args.ranks, args.seed)
        print(f"# {spec}: {rows.sum()} rows, per expert min {rows.min()} mean {rows.mean():.1f} max {rows.max()}; "
              f"real share of MMA rows: {arithmetic.mma_row_fraction(rows, 128, 128):.3f} with 128-row tiles, "
              f"{arithmetic.mma_row_fraction(rows, 128, 64):.3f} with 64-row tails, "
              f"{arithmetic.mma_row_fraction(rows):.3f} with swapped tails (16-row steps)")
        offsets_host = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
        gemm1(rs, spec, offsets_host, weights["w13"], H, I, args)
        gemm2(rs, spec, offsets_host, weights["w2"], H, I, args)


def baseline_variants(cuda_dir):
    """GEMM 1 + SwiGLU and the null-sink GEMM 2 compiled from another cuda/ tree, under the
    names "baseline-gemm1" and "baseline-gemm2"; they are launched as this tree's are, so
    that tree's kernels must take the same arguments."""
    device = cupy.cuda.runtime.getDevice()
    names = {"baseline-gemm1": "gemm1_wgmma_swiglu", "baseline-gemm2": "gemm_wgmma_null"}
    root = build.CUDA_ROOT
    build.CUDA_ROOT = Path(cuda_dir).resolve()
    try:
        for name, like in names.items():
            kernels.VARIANTS[name] = kernels.VARIANTS[like]
            # Everything ops caches per variant, made now, while the other tree is the root.
            gemm._wgmma_kernel(name, device)
    finally:
        build.CUDA_ROOT = root
    return tuple(names)


def rows_per_expert(spec, preset, ranks, seed):
    E = preset.num_experts // ranks
    total = preset.tokens_per_rank * ranks * preset.top_k // ranks
    if spec == "uniform":
        return np.diff(np.linspace(0, total, E + 1).astype(np.int64))
    routings = presets.get_routing(spec).draw(preset, ranks, seed)
    counts = sum(np.bincount(r[r >= 0], minlength=preset.num_experts) for r in routings)
    return counts[:E].astype(np.int64)  # rank 0's experts


def row(spec, name, path, ms, flops, weight_bytes, diff=""):
    print(f"{spec:<12}{name:<8}{path:>34}{ms:>9.3f}{flops / ms / 1e9:>9.1f}{weight_bytes / ms / 1e6:>13.0f}{diff:>11}")


def dense(rs, n):
    a = rs.standard_normal((n, n), dtype=np.float32).astype(BF16)
    c = cupy.empty((n, n), BF16)
    ms = median_ms(lambda: gemm_nt(a.data.ptr, a.data.ptr, c.data.ptr, n, n, n))
    row("-", "dense", f"cuBLAS {n}^3", ms, 2 * n**3, 0)


def max_diff(a, b):
    return f"{float(cupy.abs(a.astype(np.float32) - b.astype(np.float32)).max()):.4f}"


def interleaved_ms(runs: dict, warmup: int, iters: int) -> dict:
    """Median CUDA-event time of each run, the runs taken in turn (A B C A B C ...), so a
    clock or temperature drift during the job spreads over all of them alike."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in runs}
    for _ in range(iters):
        for name, fn in runs.items():
            samples[name] += samples_ms(fn, 0, 1)
    return {name: float(np.median(v)) for name, v in samples.items()}


def gemm1(rs, spec, offsets_host, w13_host, H, I, args):
    E, M = w13_host.shape[0], int(offsets_host[-1])
    offsets, w13 = cupy.asarray(offsets_host), cupy.asarray(w13_host)
    A = rs.standard_normal((M, H), dtype=np.float32).astype(BF16)
    act, h, act2 = cupy.empty((M, I), BF16), cupy.empty((M, 2 * I), BF16), cupy.empty((M, I), BF16)
    flops = arithmetic.gemm1_flops(M, H, I)
    wbytes = int((np.diff(offsets_host) > 0).sum()) * 2 * I * H * 2

    def two_kernels():
        gemm.grouped_gemm("null", A, w13, h, offsets, E, 2 * I, H)
        gemm.swiglu(h, act2, M, I)

    runs = {"wgmma + SwiGLU epilogue": lambda: gemm.gemm1_swiglu(A, w13, act, offsets, E, I, H),
            "wgmma [M, 2I] + SwiGLU kernel": two_kernels,
            "wgmma [M, 2I] alone": lambda: gemm.grouped_gemm("null", A, w13, h, offsets, E, 2 * I, H)}
    if args.variants:
        for name, (base, _) in VARIANTS.items():
            if base == "gemm1_wgmma_swiglu":
                runs[name] = lambda name=name: gemm._wgmma_gemm(name, A, w13, E * 2 * I, act2, offsets, E, I, H,
                                                               gemm._NO_PEERS, 0)
    if args.baseline:
        runs["baseline + SwiGLU epilogue"] = lambda: gemm._wgmma_gemm("baseline-gemm1", A, w13, E * 2 * I, act2, offsets,
                                                                     E, I, H, gemm._NO_PEERS, 0)
    if not args.skip_cublas:
        runs["cuBLAS per expert [M, 2I]"] = lambda: grouped_gemm_per_expert(A, w13, h, offsets_host)
    times = interleaved_ms(runs, args.warmup, args.iters)
    gemm.gemm1_swiglu(A, w13, act, offsets, E, I, H)
    two_kernels()
    same = "bitwise" if bool((act.view(np.uint16) == act2.view(np.uint16)).all()) else "DIFFER"
    for path, ms in times.items():
        row(spec, "GEMM 1", path, ms, flops, wbytes, same if path == "wgmma [M, 2I] + SwiGLU kernel" else "")


def gemm2(rs, spec, offsets_host, w2_host, H, I, args):
    E, M = w2_host.shape[0], int(offsets_host[-1])
    offsets, w2 = cupy.asarray(offsets_host), cupy.asarray(w2_host)
    A = rs.standard_normal((M, I), dtype=np.float32).astype(BF16)
    C, C_lib = cupy.empty((M, H), BF16), cupy.empty((M, H), BF16)
    flops = arithmetic.gemm2_flops(M, H, I)
    wbytes = int((np.diff(offsets_host) > 0).sum()) * H * I * 2
    gated_off = np.zeros(1, PEER_SEND_CONFIG)
    runs = {"wgmma (null sink)": lambda: gemm.grouped_gemm("null", A, w2, C, offsets, E, H, I),
            "wgmma (peer build, gated off)": lambda: gemm.grouped_gemm("peer", A, w2, None, offsets, E, H, I, gated_off, -1)}
    # The build epserve/ffn/tiles.py chooses, and the other two choices beside it
    chosen = tiles.gemm2_split_policy(M, E, H, I, gemm.sm_count(cupy.cuda.runtime.getDevice()))
    splits = {"never": "wgmma (null sink), never split K", "always": "wgmma (null sink), split K always"}
    if args.variants or chosen is not None:
        for mode, path in splits.items():
            runs[path] = lambda mode=mode: gemm.grouped_gemm("null", A, w2, C, offsets, E, H, I, split=mode)
    if args.variants:
        for name, (base, _) in VARIANTS.items():
            if base == "gemm_wgmma_null":
                runs[name] = lambda name=name: gemm._wgmma_gemm(name, A, w2, E * H, C, offsets, E, H, I, gemm._NO_PEERS, 0)
    if args.baseline:
        runs["baseline (null sink)"] = lambda: gemm._wgmma_gemm("baseline-gemm2", A, w2, E * H, C, offsets, E, H, I,
                                                               gemm._NO_PEERS, 0)
    if not args.skip_cublas:
        runs["cuBLAS per expert"] = lambda: grouped_gemm_per_expert(A, w2, C_lib, offsets_host)
    times = interleaved_ms(runs, args.warmup, args.iters)
    diffs = {}
    gemm.grouped_gemm("null", A, w2, C, offsets, E, H, I)
    record = gemm.split_k_record() if chosen is not None else None
    print(f"# {spec}: GEMM 2's build: " + ("default (not split)" if chosen is None else
          f"split K, by rule; the kernel ran {record['parts']} part(s) a tile"), flush=True)
    if not args.skip_cublas:
        grouped_gemm_per_expert(A, w2, C_lib, offsets_host)
        diffs["cuBLAS per expert"] = max_diff(C, C_lib)
    for mode, path in splits.items():  # each choice against the chosen build's bits
        if path in runs:
            C_lib.fill(np.nan)
            gemm.grouped_gemm("null", A, w2, C_lib, offsets, E, H, I, split=mode)
            diffs[path] = "bitwise" if bool((C.view(np.uint16) == C_lib.view(np.uint16)).all()) else "DIFFER"
    if args.variants:  # each variant against the default build's bits
        for name, (base, _) in VARIANTS.items():
            if base == "gemm_wgmma_null":
                C_lib.fill(np.nan)
                gemm._wgmma_gemm(name, A, w2, E * H, C_lib, offsets, E, H, I, gemm._NO_PEERS, 0)
                diffs[name] = "bitwise" if bool((C.view(np.uint16) == C_lib.view(np.uint16)).all()) else "DIFFER"
    for path, ms in times.items():
        row(spec, "GEMM 2", path, ms, flops, wbytes, diffs.get(path, ""))


if __name__ == "__main__":
    main()
