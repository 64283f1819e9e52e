"""Which part of the FP8 GEMM faults, if one does: its diagnostic builds one by one, each in
a process of its own (a fault such as CUDA_ERROR_ILLEGAL_INSTRUCTION spoils the process's CUDA
context, so nothing after it in the same process would say anything):

    python launch/jobs/probe_gemm_fp8.py               # every probe; a table and a verdict
    python launch/jobs/probe_gemm_fp8.py --one tma:2   # one probe, here: one JSON line

The builds are cuda/gemm/grouped_gemm_fp8.cu's "Diagnostic builds" (none shipped). Each
probe runs GEMM 2 (null sink; probe name ending ":2") and GEMM 1 with SwiGLU (":1") on the
first GPU test's rows, which start experts at rows 0, 64, 129, 130, 130, 257, ... (N = 256,
K = 256; GEMM 1: I = 128, H = 256):

    plumbing           no TMA load, no wgmma: scheduler, barriers, writer warps; output zeros
    tma                every TMA load, each one's arguments checked first, no wgmma; zeros
    tma-a, tma-scales, tma-b   one kind of TMA box only (checked), no wgmma; zeros
    mma                every wgmma, no TMA load (the ring holds garbage); must not fault
    checked            the default build with every TMA load's arguments checked; as default
    default            the shipped build: within 1e-2 of the float64 oracle
    unaligned-scales   the A-scale box starting at the tile's first row, as the first version
                       did (same values, same places): faults if that start was the cause

Exit status: 0 when every probe but unaligned-scales passed, else 1. The first GPU run's
fault was CUDA_ERROR_ILLEGAL_INSTRUCTION at the first GEMM launch (notes/gemm.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROWS = [64, 65, 1, 0, 127, 128, 129, 192, 63, 300]  # tests/gpu/test_gemm_fp8.py's RAGGED
N2, K2 = 256, 256  # GEMM 2
I1, H1 = 128, 256  # GEMM 1
CHECK = {"EPSERVE_GEMM_FP8_CHECK_TMA": 1}
# probe -> (knobs, what its output must be: "zeros", "oracle" or "runs")
PROBES = {
    "plumbing": ({"EPSERVE_GEMM_FP8_TMA_LOADS": 0, "EPSERVE_GEMM_FP8_MMA": 0}, "zeros"),
    "tma": ({"EPSERVE_GEMM_FP8_MMA": 0, **CHECK}, "zeros"),
    "tma-a": ({"EPSERVE_GEMM_FP8_TMA_LOADS": 1, "EPSERVE_GEMM_FP8_MMA": 0, **CHECK}, "zeros"),
    "tma-scales": ({"EPSERVE_GEMM_FP8_TMA_LOADS": 2, "EPSERVE_GEMM_FP8_MMA": 0, **CHECK}, "zeros"),
    "tma-b": ({"EPSERVE_GEMM_FP8_TMA_LOADS": 4, "EPSERVE_GEMM_FP8_MMA": 0, **CHECK}, "zeros"),
    "mma": ({"EPSERVE_GEMM_FP8_TMA_LOADS": 0}, "runs"),
    "checked": (CHECK, "oracle"),
    "default": ({}, "oracle"),
    "unaligned-scales": ({"EPSERVE_GEMM_FP8_UNALIGNED_SCALES": 1}, "oracle"),
}
EXPERIMENT = "unaligned-scales"  # expected to fault if the diagnosis is right: not a failure
GEMMS = ("2", "1")
TIMEOUT_S = 600  # a probe that hangs (a barrier that never completes) is reported as such


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", help="run one probe here, NAME:GEMM (e.g. tma:2), and print its JSON line")
    p.add_argument("--probes", nargs="+", default=list(PROBES), choices=list(PROBES))
    args = p.parse_args()
    if args.one:
        name, gemm = args.one.split(":")
        record = run_one(name, gemm)
        print(json.dumps(record), flush=True)
        sys.exit(0 if record["ok"] else 1)
    results = {}
    print(f"# FP8 GEMM probes, each in its own process ({sys.executable})")
    print(f"{'probe':<18}{'GEMM':<6}{'result':<8}{'s':>7}  detail")
    for name in args.probes:
        for gemm in GEMMS:
            r = spawn(name, gemm)
            results[(name, gemm)] = r
            print(f"{name:<18}{gemm:<6}{r['result']:<8}{r['seconds']:>7.1f}  {r['detail']}", flush=True)
    print(verdict(results))
    failed = [k for k, r in results.items() if r["result"] != "ok" and k[0] != EXPERIMENT]
    sys.exit(1 if failed else 0)


def spawn(name: str, gemm: str) -> dict:
    t0 = time.time()
    try:
        cp = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", f"{name}:{gemm}"],
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"result": "hang", "seconds": time.time() - t0, "detail": f"no end within {TIMEOUT_S} s"}
    seconds = time.time() - t0
    lines = [ln for ln in cp.stdout.splitlines() if ln.startswith("{")]
    if lines:
        rec = json.loads(lines[-1])
        device_print = [ln for ln in cp.stdout.splitlines() if "epserve_grouped_gemm_fp8:" in ln][:3]
        detail = rec["detail"] + ("" if not device_print else " | device: " + " / ".join(device_print))
        return {"result": "ok" if rec["ok"] else rec.get("kind", "wrong"), "seconds": seconds, "detail": detail}
    tail = (cp.stdout + cp.stderr).strip().splitlines()[-3:]
    return {"result": "died", "seconds": seconds, "detail": f"exit {cp.returncode}: " + " / ".join(tail)}


def verdict(results: dict) -> str:
    def ok(name):
        return all(results.get((name, g), {}).get("result") == "ok" for g in GEMMS if (name, g) in results)

    lines = ["# verdict:"]
    if (EXPERIMENT, "2") in results:
        if not ok(EXPERIMENT) and ok("default"):
            lines.append(f"#  {EXPERIMENT} faults and default runs: the unaligned A-scale box start was the "
                         "first run's fault (and is fixed)")
        elif ok(EXPERIMENT):
            lines.append(f"#  {EXPERIMENT} runs: an unaligned innermost TMA start does not fault here; the first "
                         "run's fault was something else (see the rows above)")
    if ("plumbing", "2") in results and not ok("plumbing"):
        lines.append("#  plumbing fails: neither TMA nor wgmma (setmaxnreg, mbarrier, scheduler, writer warps)")
    elif ("tma", "2") in results and not ok("tma"):
        lines.append("#  tma fails and plumbing runs: a TMA load; tma-a / tma-scales / tma-b say which box")
    elif ("mma", "2") in results and not ok("mma"):
        lines.append("#  mma fails and tma runs: the wgmma path (QGMMA operands, descriptors, fences)")
    elif ("default", "2") in results and not ok("default"):
        lines.append("#  each part runs alone but default fails: their interplay (e.g. a stage freed too early)")
    if len(lines) == 1:
        lines.append("#  every probe ran" if all(r["result"] == "ok" for k, r in results.items() if k[0] != EXPERIMENT)
                     else "#  see the rows above")
    return "\n".join(lines)


def run_one(name: str, gemm: str) -> dict:
    """One probe in this process: the build, one launch, a sync, the check of its output."""
    import cupy

    from epserve.arrays import BF16
    from epserve.check import fp8_reference as f8
    from epserve.check.reference import rel_error, silu
    from epserve.ffn import fp8, gemm_fp8
    from epserve.ffn.gemm import run as run_specs
    from epserve.runtime import kernels

    knobs, expect = PROBES[name]
    base = "gemm_fp8_null" if gemm == "2" else "gemm1_fp8_swiglu"
    source, defines = kernels.VARIANTS[base]
    variant = base if not knobs else f"{base}+" + "+".join(f"{k}={v}" for k, v in knobs.items())
    kernels.VARIANTS[variant] = (source, {**defines, **knobs})
    rng = np.random.default_rng(11)
    E, M = len(ROWS), sum(ROWS)
    off = np.concatenate([[0], np.cumsum(ROWS)]).astype(np.int32)
    N, K = (N2, K2) if gemm == "2" else (I1, H1)
    b_rows = N if gemm == "2" else 2 * N
    record = {"probe": name, "gemm": gemm, "variant": variant, "ok": False, "kind": "wrong"}
    try:
        a_q, a_s = fp8.quantize_rows(cupy.asarray(rng.standard_normal((M, K), np.float32).astype(BF16)))
        b = (rng.standard_normal((E, b_rows, K), np.float32) / np.sqrt(K)).astype(BF16)
        b_q, b_s = fp8.quantize_blocks(cupy.asarray(b))
        offsets = cupy.asarray(off)
        cupy.cuda.Device().synchronize()
        if gemm == "2":
            out = cupy.full((M + 7, N), np.nan, BF16)
            run_specs(gemm_fp8._specs(variant, a_q, a_s, b_q, b_s, E * b_rows, out, None, offsets, E, N, K,
                                      gemm_fp8._NO_PEERS, 0))
            out_s = None
        else:
            out = cupy.full((M + 5, N), 0x7F, np.uint8)  # e4m3 NaN
            out_s = cupy.full((N // 128, f8.scale_ld(M + 5)), np.nan, np.float32)
            run_specs(gemm_fp8._specs(variant, a_q, a_s, b_q, b_s, E * b_rows, out, out_s, offsets, E, N, K,
                                      gemm_fp8._NO_PEERS, 0))
        cupy.cuda.Device().synchronize()
    except Exception as e:  # a CUDA error: the kernel faulted (or did not build)
        record.update(kind="fault", detail=f"{type(e).__name__}: {e}")
        return record

    if gemm == "2":
        got = cupy.asnumpy(out).astype(np.float64)
        past_m_ok = np.isnan(got[M:]).all()
        body = got[:M]
    else:
        q = cupy.asnumpy(out).view(f8.E4M3)
        s = cupy.asnumpy(out_s)
        past_m_ok = (cupy.asnumpy(out)[M:] == 0x7F).all() and np.isnan(s[:, M:]).all()
        body = f8.dequantize_rows(q[:M], s[:, :M]) if not np.isnan(s[:, :M]).any() else np.full((M, N), np.nan)
    if not past_m_ok:
        record["detail"] = "wrote past row M"
        return record
    if expect == "runs":
        record.update(ok=True, detail="ran (values not checked: the ring held garbage)")
        return record
    if np.isnan(body).any():
        record["detail"] = f"{int(np.isnan(body).sum())} output values never written (or NaN)"
        return record
    if expect == "zeros":
        ok = not np.any(body)
        record.update(ok=bool(ok), detail="all zeros" if ok else f"max |value| {np.abs(body).max():.3g}, wanted zeros")
        return record
    a = f8.dequantize_rows(cupy.asnumpy(a_q).view(f8.E4M3), cupy.asnumpy(a_s))
    w = f8.dequantize_blocks(cupy.asnumpy(b_q).view(f8.E4M3), cupy.asnumpy(b_s))
    ref = np.concatenate([a[off[e]:off[e + 1]] @ w[e].T for e in range(E)])
    if gemm == "1":  # act as the oracle rounds and quantizes it (the test's comparison)
        h = f8.round_bf16(ref)
        ref_q, ref_s = f8.quantize_rows(f8.round_bf16(silu(h[:, :N]) * h[:, N:]))
        ref = f8.dequantize_rows(ref_q, ref_s)
    err = rel_error(body, ref)
    record.update(ok=bool(err < 1e-2), detail=f"relative error {err:.2e} against float64 (limit 1e-2)")
    return record


if __name__ == "__main__":
    main()
