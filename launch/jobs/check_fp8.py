"""Multi-rank GPU check of EPService with FP8 experts (issue 16), run under the launcher:

    python launch/run.py -n 2 [--share-gpu] -- python -m mpi4py launch/jobs/check_fp8.py

MoEConfig(expert_dtype="fp8"), weights from epserve.quantize_weights. Per shape, several
calls with different token counts: forward fused (direct dispatch, peer sink) == unfused
(NCCL dispatch, null sink) == unfused after the direct dispatch (null sink, C pushed) ==
fused after the NCCL dispatch, bit for bit; the same recv slots; every output element
written (poisoned out); a rerun gives the same bits; the output within 1e-2 of the float64
FP8 reference of the whole layer (epserve/check/fp8_layer_reference.py: the same quantized
weights, rows quantized as the GPU does). The GPU's quantize_weights equals the NumPy model
bit for bit. Bad FP8 weights on one rank (bf16 weights, a scale array of the wrong shape)
raise on every rank and leave the service usable. Prints `RESULT {json}` lines; exits
non-zero if any check failed on any rank.
"""

from __future__ import annotations

import argparse
import sys

import cupy
import numpy as np
from check_service import expect_error_everywhere, tokens_for  # siblings of this script
from job_report import run_cases

from epserve import EPService, MoEConfig, quantize_weights
from epserve.check.fp8_layer_reference import quantized_weights, reference_layer_fp8
from epserve.check.reference import rel_error
from epserve.check.testing import BF16, bf16_bits, layer_inputs
from epserve.comm import mpi as ep_comm
from epserve.ffn.fp8 import FP8Weights

# name, H, I, E, k, token counts of successive calls (rank 0, rank 1), routing options
SHAPES = [
    ("k2", 256, 128, 8, 2, [[37, 50], [64, 1], [0, 9]], dict(unused=0.1)),
    ("k8-empty-experts", 512, 256, 16, 8, [[200, 133], [17, 260]], dict(unused=0.15, experts=range(0, 16, 2))),
    ("k4-skewed", 384, 384, 8, 4, [[300, 257], [5, 299]], dict(zipf=3.0)),
]


def _same_bits_as_numpy(fp8w: FP8Weights, want) -> bool:
    got = (fp8w.w13, fp8w.w13_scales, fp8w.w2, fp8w.w2_scales)
    return all(np.array_equal(cupy.asnumpy(g).view(np.uint8), np.asarray(w).view(np.uint8)) for g, w in zip(got, want))


def run_shape(comm, name, H, I, E, k, calls, opts, seed):
    rank, world = comm.Get_rank(), comm.Get_size()
    max_tokens = max(max(tokens_for(c, world)) for c in calls)
    cfg = MoEConfig(E, k, H, I, max_tokens, world_size=world, wait_timeout_s=20.0, expert_dtype="fp8")
    failures, info = [], {"calls": 0}
    with EPService(cfg, comm) as svc:
        info["transport"] = svc.transport
        for n, call in enumerate(calls):
            inputs = layer_inputs(seed + n, tokens_for(call, world), E, k, H, I, **opts)
            me = inputs[rank]
            x, idx, w = cupy.asarray(me.x), cupy.asarray(me.topk_idx), cupy.asarray(me.topk_weights)
            fp8w = quantize_weights(cupy.asarray(me.w13), cupy.asarray(me.w2))
            numpy_weights = [quantized_weights(i.w13, i.w2) for i in inputs]
            if not _same_bits_as_numpy(fp8w, numpy_weights[rank]):
                failures.append(f"call {n}: quantize_weights differs from the NumPy model")
            T = x.shape[0]
            used = cupy.asnumpy(idx) >= 0
            out = cupy.full((T, H), np.nan, BF16)  # poisoned: every element must be overwritten
            fused = bf16_bits(svc.forward(x, idx, w, fp8w, out=out))
            recv_fused = bf16_bits(svc.combiner.recv)[:T][used]
            if np.isnan(cupy.asnumpy(out).astype(np.float32)).any():
                failures.append(f"call {n}: fused output has unwritten (poisoned) elements")
            others = {
                "unfused (NCCL dispatch, null sink)": lambda: svc.forward(x, idx, w, fp8w, None, "null", "nccl"),
                "unfused (direct dispatch, null sink)": lambda: svc.forward(x, idx, w, fp8w, None, "null", "direct"),
                "fused after the NCCL dispatch": lambda: svc.forward(x, idx, w, fp8w, None, "peer", "nccl"),
                "fused again": lambda: svc.forward(x, idx, w, fp8w, fp8w),
            }
            for label, run in others.items():
                got = bf16_bits(run())
                if not np.array_equal(got, fused):
                    failures.append(f"call {n}: {label} != fused bitwise ({int((got != fused).sum())} elements)")
                if label.startswith("unfused (NCCL") and not np.array_equal(bf16_bits(svc.combiner.recv)[:T][used],
                                                                            recv_fused):
                    failures.append(f"call {n}: recv slots differ between fused and unfused (NCCL)")
            svc.check()
            ref = reference_layer_fp8([i.x for i in inputs], [i.topk_idx for i in inputs],
                                      [i.topk_weights for i in inputs], numpy_weights, E)[rank]
            if T:
                err = rel_error(fused.view(BF16).astype(np.float64), ref["out"])
                info[f"rel_err_call{n}"] = err
                if not err < 1e-2:
                    failures.append(f"call {n}: relative error {err:.3g} vs the float64 FP8 reference")
            info["calls"] += 1

        # Bad weights on the last rank: every rank raises, and the next call is right again.
        bf16_w13, bf16_w2 = cupy.asarray(me.w13), cupy.asarray(me.w2)
        wrong_scales = FP8Weights(fp8w.w13, fp8w.w13_scales[:, :1], fp8w.w2, fp8w.w2_scales)
        for label, bad in (("bf16 weights in FP8 mode", (bf16_w13, bf16_w2)), ("w13_scales of a wrong shape",
                                                                               (wrong_scales, None))):
            given = bad if rank == world - 1 else (fp8w, None)
            failure, seen = expect_error_everywhere(comm, label, lambda: svc.forward(x, idx, w, *given))
            if failure:
                failures.append(failure)
            elif rank == 0:
                print(f"# {name}, {label}: {seen[:160]}", flush=True)
        if not np.array_equal(bf16_bits(svc.forward(x, idx, w, fp8w)), fused):
            failures.append("after the refused calls, forward gave other bits")
    return dict(case=name, rank=rank, ok=not failures, failures=failures[:10], **info)


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/check_fp8.py")
    p.add_argument("--seed", type=int, default=16)
    args = p.parse_args()
    comm = ep_comm.world()
    return run_cases(comm, "check_fp8", SHAPES, lambda shape: run_shape(comm, *shape, seed=args.seed))


if __name__ == "__main__":
    sys.exit(main())
