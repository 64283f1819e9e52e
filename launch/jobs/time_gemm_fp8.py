"""The FP8 expert GEMMs alone on one GPU (issue 16), at a preset's shapes and the bench's
routings, beside the bf16 wgmma GEMMs on the same rows:

    python launch/jobs/time_gemm_fp8.py [--preset dsv3-prefill] [--ranks 2] [--routing balanced ...]

Rows per expert are those rank 0 receives when `--ranks` ranks route the preset's tokens
(launch/jobs/time_gemm.py's rows_per_expert: same seeds, same routings). Per routing:
GEMM 1 FP8 with SwiGLU and act quantization in its epilogue, the same FP8 GEMM storing
[M, 2I] in bf16, and bf16 GEMM 1 + SwiGLU; GEMM 2 FP8 with the null sink, in its peer build
gated off, and bf16 GEMM 2; cuBLASLt's block-scaled FP8 GEMM per expert beside each (the
library a user without epserve calls, where it is reachable: epserve.bench.cublaslt; each
expert's rows padded to 16, which it needs; TFLOP/s of the real rows as for ours; once
called from Python, once replayed as a CUDA graph, without the host's time per call). A
dense FP8 GEMM (8192^3: ours and cuBLASLt's) and the dense bf16 cuBLAS GEMM give the
machine's rates in the same run. CUDA-event medians, paths
interleaved; TFLOP/s count real rows only. The issue's target: each FP8 GEMM >= 1100 TFLOP/s
at dsv3-prefill, balanced routing.

`--variants` adds the FP8 GEMM's other builds (epserve.ffn.gemm_fp8.KNOBS: the shipped
features one at a time, and none of them), timed
interleaved with the shipped build on the same inputs, each row checked bit for bit against
the shipped build's output.

Checks printed with the times: fused GEMM 1 against the unfused FP8 path (bitwise), and the
relative difference of the FP8 GEMM 2 from the bf16 one on the same unquantized inputs (the
cost of quantization: reported, not asserted). One process: no communication in the numbers.
"""

from __future__ import annotations

import argparse

import cupy
import numpy as np
from time_gemm import dense, interleaved_ms, row, rows_per_expert  # launch/jobs/time_gemm.py

from epserve.arrays import BF16
from epserve.bench import arithmetic, cublaslt, presets
from epserve.check.fp8_reference import scale_ld
from epserve.ffn import fp8, gemm, gemm_fp8
from epserve.runtime.kernel_structs import PEER_SEND_CONFIG

TARGET_TFLOPS = 1100


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dsv3-prefill", choices=sorted(presets.PRESETS))
    p.add_argument("--ranks", type=int, default=2, help="ranks the preset's experts are spread over (default 2)")
    p.add_argument("--routing", nargs="+", default=["balanced", "uniform"],
                   help="uniform, balanced, skewed or skewed:<exponent> (default: balanced uniform)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skip-bf16", action="store_true", help="time the FP8 GEMMs only")
    p.add_argument("--variants", action="store_true",
                   help="also time the experimental builds of epserve.ffn.gemm_fp8.KNOBS")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=15)
    args = p.parse_args()
    preset = presets.get_preset(args.preset)
    H, I, E = preset.hidden, preset.intermediate, preset.num_experts // args.ranks
    rs = cupy.random.RandomState(5)
    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# FP8 grouped GEMMs on one GPU ({dev}): {preset.name}, H {H}, I {I}, {E} local experts of "
          f"{preset.num_experts} over {args.ranks} ranks, {preset.tokens_per_rank} tokens/rank, top-{preset.top_k}")
    print(f"{'routing':<12}{'GEMM':<8}{'path':>34}{'ms':>9}{'TFLOP/s':>9}{'weights GB/s':>13}{'check':>11}")
    dense(rs, 8192)
    dense_fp8(rs, 8192, args)
    w13 = (rs.standard_normal((E, 2 * I, H), dtype=np.float32) / np.sqrt(H)).astype(BF16)
    w2 = (rs.standard_normal((E, H, I), dtype=np.float32) / np.sqrt(I)).astype(BF16)
    weights = fp8.quantize_weights(w13, w2)
    for spec in args.routing:
        rows = rows_per_expert(spec, preset, args.ranks, args.seed)
        print(f"# {spec}: {rows.sum()} rows, per expert min {rows.min()} mean {rows.mean():.1f} max {rows.max()}; "
              f"real share of MMA rows: {arithmetic.mma_row_fraction(rows, 128, 64):.3f} (64-row tails)")
        offsets_host = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
        gemm1(rs, spec, offsets_host, w13, weights, H, I, args)
        gemm2(rs, spec, offsets_host, w2, weights, H, I, args)


class DenseFp8:
    """A dense FP8 GEMM of n x n x k (k = n unless given; random operands, 1 x 128 and 128 x 128
    scales) and its launches: ours as a single expert of n rows into c, and cuBLASLt's
    block-scaled FP8 GEMM on the same operands into c_lt (`lt` is None, and `why_not` says why,
    where cuBLASLt is not reachable). Outputs start as NaN."""

    def __init__(self, rs, n: int, k: int | None = None):
        self.n, self.k = n, k or n
        self.a_q, self.a_s = fp8.quantize_rows(rs.standard_normal((n, self.k), dtype=np.float32).astype(BF16))
        self.b_q, self.b_s = fp8.quantize_blocks(
            (rs.standard_normal((1, n, self.k), dtype=np.float32) / np.sqrt(self.k)).astype(BF16))
        self.c, self.c_lt = cupy.full((n, n), np.nan, BF16), cupy.full((n, n), np.nan, BF16)
        self.offsets = cupy.asarray(np.array([0, n], np.int32))
        self.why_not = cublaslt.unavailable()
        self.lt = None if self.why_not is not None else self._lt

    @property
    def flops(self) -> float:
        return 2.0 * self.n * self.n * self.k

    def ours(self):
        gemm_fp8.grouped_gemm_fp8("null", self.a_q, self.a_s, self.b_q, self.b_s, self.c, self.offsets, 1, self.n,
                                  self.k)

    def build_specs(self, variant: str, c):
        """The launch of FP8 GEMM build `variant` (kernels.VARIANTS) on these operands into c."""
        return gemm_fp8._specs(variant, self.a_q, self.a_s, self.b_q, self.b_s, self.n, c, None, self.offsets, 1,
                               self.n, self.k, gemm_fp8._NO_PEERS, 0)

    def _lt(self):
        cublaslt.gemm_fp8_nt(self.a_q.data.ptr, self.a_s.data.ptr, self.b_q.data.ptr, self.b_s.data.ptr,
                             self.c_lt.data.ptr, self.n, self.n, self.k)


def dense_fp8(rs, n, args):
    """Our FP8 GEMM as a dense one (a single expert of n rows, n x n weights), its knob builds
    with --variants (each checked bit for bit against it), and cuBLASLt's block-scaled FP8
    GEMM on the same operands where it is reachable (checked against ours)."""
    d = DenseFp8(rs, n)
    runs = {"fp8": d.ours}
    knob_out = {}
    for knob, name in knob_builds("gemm_fp8_null", args):
        out = knob_out[knob] = cupy.empty((n, n), BF16)
        runs[knob] = lambda specs=d.build_specs(name, out): gemm_fp8.run(specs)
    if d.lt is not None:
        runs["cublaslt"] = d.lt
    times = interleaved_ms(runs, 2, 10)
    row("-", "dense", f"FP8 GEMM (ours) {n}^3", times["fp8"], 2 * n**3, 0)
    for knob, out in knob_out.items():
        same = bool((out.view(np.uint16) == d.c.view(np.uint16)).all())
        row("-", "dense", f"ours, {knob}", times[knob], 2 * n**3, 0, "bitwise" if same else "DIFFER")
    if d.lt is not None:
        row("-", "dense", f"cuBLASLt FP8 {n}^3", times["cublaslt"], 2 * n**3, 0, rel_diff(d.c_lt, d.c))
    else:
        print(f"# no cuBLASLt FP8 rows: {d.why_not}")


def rel_diff(c, ref) -> str:
    """Relative Frobenius difference, as text: for outputs summed in another order (cuBLASLt),
    or from other inputs (bf16 against FP8), where bits cannot match."""
    c, ref = c.astype(np.float32), ref.astype(np.float32)
    return f"rel {float(cupy.linalg.norm(c - ref) / cupy.linalg.norm(ref)):.4f}"


def cublaslt_per_expert(A, w, w_scales, N, offsets_host):
    """cuBLASLt's block-scaled FP8 GEMM, one call per expert, as a library user runs it:
    each expert's rows padded to cublaslt.ROW_ALIGN (zero rows), quantized by our row
    quantizer, the scales put in its per-expert layout; all outside the timing. Returns
    (run, C of the real rows) for interleaved_ms, or (None, None) where unreachable."""
    if cublaslt.unavailable() is not None:
        return None, None
    M, K = A.shape
    padded = cublaslt.padded_offsets(offsets_host)
    at = cupy.asarray(cublaslt.padded_positions(offsets_host, padded))
    A_pad = cupy.zeros((int(padded[-1]), K), BF16)
    A_pad[at] = A
    a_q, a_s = fp8.quantize_rows(A_pad)
    scaled, starts = cublaslt.scales_by_expert(a_s, padded, cupy.asarray(padded), int(padded[-1]))
    C = cupy.empty((int(padded[-1]), N), BF16)
    return (lambda: cublaslt.grouped_gemm_fp8(a_q, scaled, starts, w, w_scales, C, padded)), (lambda: C[at])


def verdict(ms, flops):
    return "target met" if flops / ms / 1e9 >= TARGET_TFLOPS else f"< {TARGET_TFLOPS}"


def gemm1(rs, spec, offsets_host, w13_host, weights, H, I, args):
    E, M = w13_host.shape[0], int(offsets_host[-1])
    offsets = cupy.asarray(offsets_host)
    A = rs.standard_normal((M, H), dtype=np.float32).astype(BF16)
    a_q, a_s = fp8.quantize_rows(A)
    act, act2 = cupy.empty((M, I), np.uint8), cupy.empty((M, I), np.uint8)
    act_s, act_s2 = (cupy.zeros((I // 128, scale_ld(M)), np.float32) for _ in range(2))
    h, act_bf16 = cupy.empty((M, 2 * I), BF16), cupy.empty((M, I), BF16)
    flops = arithmetic.gemm1_flops(M, H, I)
    wbytes = int((np.diff(offsets_host) > 0).sum()) * 2 * I * H

    def fused():
        gemm_fp8.gemm1_swiglu_fp8(a_q, a_s, weights.w13, weights.w13_scales, act, act_s, offsets, E, I, H)

    def unfused():
        gemm_fp8.grouped_gemm_fp8("null", a_q, a_s, weights.w13, weights.w13_scales, h, offsets, E, 2 * I, H)
        gemm.swiglu(h, act_bf16, M, I)
        fp8.quantize_rows(act_bf16, act2, act_s2)

    runs = {"fp8 + SwiGLU + quantize epilogue": fused, "fp8 [M, 2I] + SwiGLU + quantize": unfused,
            "fp8 [M, 2I] alone": lambda: gemm_fp8.grouped_gemm_fp8("null", a_q, a_s, weights.w13, weights.w13_scales,
                                                                   h, offsets, E, 2 * I, H)}
    lt, h_lt = cublaslt_per_expert(A, weights.w13, weights.w13_scales, 2 * I, offsets_host)
    if lt is not None:
        runs["cuBLASLt per expert [M, 2I]"] = lt
        runs["cuBLASLt per expert, graph [M, 2I]"] = cublaslt.captured(lt)
    knob_out = {}  # path -> (act, act_s) of that build
    for knob, name in knob_builds("gemm1_fp8_swiglu", args):
        out = knob_out[f"fp8 + SwiGLU epilogue, {knob}"] = (cupy.empty((M, I), np.uint8),
                                                           cupy.zeros((I // 128, scale_ld(M)), np.float32))
        specs = gemm_fp8._specs(name, a_q, a_s, weights.w13, weights.w13_scales, E * 2 * I, *out, offsets, E, I, H,
                                gemm_fp8._NO_PEERS, 0)
        runs[f"fp8 + SwiGLU epilogue, {knob}"] = lambda specs=specs: gemm_fp8.run(specs)
    if not args.skip_bf16:
        w13 = cupy.asarray(w13_host)
        act_b = cupy.empty((M, I), BF16)
        runs["bf16 wgmma + SwiGLU epilogue"] = lambda: gemm.gemm1_swiglu(A, w13, act_b, offsets, E, I, H)
    times = interleaved_ms(runs, args.warmup, args.iters)
    fused()
    unfused()
    same = bool((act == act2).all()) and bool((act_s[:, :M] == act_s2[:, :M]).all())
    for path, ms in times.items():
        check = ("bitwise" if same else "DIFFER") if path.startswith("fp8 [M, 2I] +") else ""
        if path.startswith("fp8 + SwiGLU"):
            check = verdict(ms, flops)
        if path.startswith("cuBLASLt"):  # against our [M, 2I] on the same operands
            gemm_fp8.grouped_gemm_fp8("null", a_q, a_s, weights.w13, weights.w13_scales, h, offsets, E, 2 * I, H)
            lt()
            check = rel_diff(h_lt(), h)
        if path in knob_out:  # the knob build's own output, against the default's
            k_act, k_s = knob_out[path]
            check = "bitwise" if bool((k_act == act).all()) and bool((k_s[:, :M] == act_s[:, :M]).all()) else "DIFFER"
        row(spec, "GEMM 1", path, ms, flops, wbytes * (2 if path.startswith("bf16") else 1), check)


def gemm2(rs, spec, offsets_host, w2_host, weights, H, I, args):
    E, M = w2_host.shape[0], int(offsets_host[-1])
    offsets = cupy.asarray(offsets_host)
    A = rs.standard_normal((M, I), dtype=np.float32).astype(BF16)
    a_q, a_s = fp8.quantize_rows(A)
    C, C_bf16 = cupy.empty((M, H), BF16), cupy.empty((M, H), BF16)
    flops = arithmetic.gemm2_flops(M, H, I)
    wbytes = int((np.diff(offsets_host) > 0).sum()) * H * I
    gated_off = np.zeros(1, PEER_SEND_CONFIG)
    w = (weights.w2, weights.w2_scales)
    runs = {"fp8 (null sink)": lambda: gemm_fp8.grouped_gemm_fp8("null", a_q, a_s, *w, C, offsets, E, H, I),
            "fp8 (peer build, gated off)": lambda: gemm_fp8.grouped_gemm_fp8("peer", a_q, a_s, *w, None, offsets, E,
                                                                           H, I, gated_off, -1)}
    lt, C_lt = cublaslt_per_expert(A, *w, H, offsets_host)
    if lt is not None:
        runs["cuBLASLt per expert"] = lt
        runs["cuBLASLt per expert, CUDA graph"] = cublaslt.captured(lt)
    knob_out = {}  # path -> that build's C
    for knob, name in knob_builds("gemm_fp8_null", args):
        out = knob_out[f"fp8 (null sink), {knob}"] = cupy.empty((M, H), BF16)
        specs = gemm_fp8._specs(name, a_q, a_s, *w, E * H, out, None, offsets, E, H, I, gemm_fp8._NO_PEERS, 0)
        runs[f"fp8 (null sink), {knob}"] = lambda specs=specs: gemm_fp8.run(specs)
    w2 = cupy.asarray(w2_host)
    if not args.skip_bf16:
        runs["bf16 wgmma (null sink)"] = lambda: gemm.grouped_gemm("null", A, w2, C_bf16, offsets, E, H, I)
    times = interleaved_ms(runs, args.warmup, args.iters)
    gemm_fp8.grouped_gemm_fp8("null", a_q, a_s, *w, C, offsets, E, H, I)
    gemm.grouped_gemm("null", A, w2, C_bf16, offsets, E, H, I)
    if lt is not None:
        lt()
    vs_bf16 = rel_diff(C, C_bf16)
    for path, ms in times.items():
        check = verdict(ms, flops) if path == "fp8 (null sink)" else (vs_bf16 if path.startswith("bf16") else "")
        if path.startswith("cuBLASLt"):
            check = rel_diff(C_lt(), C)
        if path in knob_out:  # the knob build's own output, against the default's
            check = "bitwise" if bool((knob_out[path].view(np.uint16) == C.view(np.uint16)).all()) else "DIFFER"
        row(spec, "GEMM 2", path, ms, flops, wbytes * (2 if path.startswith("bf16") else 1), check)


def knob_builds(base, args):
    """(knob, variant name) of each experimental build of `base` that --variants times,
    registered in kernels.VARIANTS."""
    if not args.variants:
        return []
    return [(knob, gemm_fp8.register_knob(base, knob)) for knob in gemm_fp8.KNOBS]


if __name__ == "__main__":
    main()
