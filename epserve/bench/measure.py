"""The GPU side of the benchmark: every path at one (preset, routing, tokens per rank) point,
timed with CUDA events on every rank, checked in the same run.

Paths (the unfused one is the baseline every speed-up is taken against):
    gemm1           GEMM 1 with SwiGLU in its epilogue, alone
    gemm2           GEMM 2 alone: the peer sink gated off
    fused           GEMM 2 with the peer sink + the reduction
    unfused         GEMM 2 with the null sink + the transport (NCCL, or the IPC copy where
                    ranks share a GPU) + the reduction
    library         cuBLAS per expert + the same transport + the reduction
    dispatch-direct direct-store dispatch (one row per token and destination)
    dispatch-nccl   the baseline dispatch (one row per slot)
    layer-fused     forward: direct dispatch, GEMM 1 + SwiGLU, fused GEMM 2 + combine
    layer-unfused   forward: NCCL dispatch, GEMM 1 + SwiGLU, GEMM 2 + NCCL combine
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from .. import ops
from ..arrays import BF16
from . import arithmetic
from .cublas import grouped_gemm_per_expert
from .events import samples_ms

PATHS = ("gemm1", "gemm2", "fused", "unfused", "library", "dispatch-direct", "dispatch-nccl", "layer-fused", "layer-unfused")
UNFUSED, LIBRARY = "unfused", "library"


@dataclass
class PathResult:
    path: str
    samples_ms: list       # this rank's per-iteration times
    work: arithmetic.Work
    wrong: int | None      # elements that disagree with the path's reference, None if it has none


def bitwise_wrong(a, b) -> int:
    if a.shape != b.shape:
        return max(a.size, b.size)
    return int((a.view(np.uint16) != b.view(np.uint16)).sum())


def tolerance_wrong(a, b) -> int:
    """Elements of a outside bf16 tolerance of b (for paths that sum in another order)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    scale = float(cupy.sqrt(cupy.mean(b64 * b64))) if b.size else 0.0
    return int((cupy.abs(a64 - b64) > 2e-2 * cupy.abs(b64) + 1e-2 * scale).sum())


def dispatch_work(counts, hidden: int, dedup: bool) -> arithmetic.Work:
    """Read each token once, write each dispatched row once, and the link bytes."""
    hbm = (counts.tokens + counts.rows) * hidden * 2
    return arithmetic.Work(np.zeros(counts.world_size), hbm, arithmetic.dispatch_nvlink_bytes(counts, hidden, dedup))


def measure_point(svc, w13, w2, topk_all, seed: int, warmup: int, iters: int) -> list[PathResult]:
    """Every path at one point; collective (every rank calls it with the same routing)."""
    comm, rank, cfg = svc.comm, svc.rank, svc.config
    H, I, E = cfg.hidden, cfg.intermediate, cfg.num_experts
    counts = arithmetic.count_routing(topk_all, E)
    idx = cupy.asarray(topk_all[rank])
    T = idx.shape[0]
    rs = cupy.random.RandomState(seed + 1000 * rank)
    x = rs.standard_normal((T, H), dtype=np.float32).astype(BF16)
    w = rs.uniform(0.05, 1.0, (T, cfg.top_k), dtype=np.float32)

    direct = svc.dispatch(x, idx, w, "direct")
    baseline = svc.dispatch(x, idx, w, "nccl")
    plan = baseline.plan
    M = direct.num_rows
    act, act_again = cupy.empty((M, I), BF16), cupy.empty((M, I), BF16)
    ops.gemm1_swiglu(direct.rows, w13, act, direct.expert_offsets, w13.shape[0], I, H)
    comb = svc.combiner
    rows_src = svc._send_plan(direct)
    offsets_host = plan.host.expert_offsets
    C, C_lib = cupy.empty((M, H), BF16), cupy.empty((M, H), BF16)
    outs = {name: cupy.empty((T, H), BF16) for name in ("fused", "unfused", "library", "layer-fused", "layer-unfused")}

    def unfused():
        ops.grouped_gemm("null", act, w2, C, direct.expert_offsets, w2.shape[0], H, I)
        comb.unfused(C, plan, idx, w, out=outs["unfused"])

    def library():
        grouped_gemm_per_expert(act, w2, C_lib, offsets_host)
        comb.unfused(C_lib, plan, idx, w, out=outs["library"])

    runs = {
        "gemm1": lambda: ops.gemm1_swiglu(direct.rows, w13, act_again, direct.expert_offsets, w13.shape[0], I, H),
        "gemm2": lambda: comb.gemm_only(act, w2, rows_src, I),
        "fused": lambda: comb.fused(act, w2, rows_src, idx, w, I, out=outs["fused"]),
        "unfused": unfused,
        "library": library,
        "dispatch-direct": lambda: svc.dispatch(x, idx, w, "direct"),
        "dispatch-nccl": lambda: svc.dispatch(x, idx, w, "nccl"),
        "layer-fused": lambda: svc.forward(x, idx, w, w13, w2, "peer", "direct", out=outs["layer-fused"]),
        "layer-unfused": lambda: svc.forward(x, idx, w, w13, w2, "null", "nccl", out=outs["layer-unfused"]),
    }
    samples = {}
    for path in PATHS:
        comm.Barrier()
        samples[path] = samples_ms(runs[path], warmup, iters)
    svc.check()

    wrong = {
        "gemm1": bitwise_wrong(act_again, act),  # reruns give the same bits
        "gemm2": None,
        "fused": bitwise_wrong(outs["fused"], outs["unfused"]),
        "unfused": None,
        "library": tolerance_wrong(outs["library"], outs["unfused"]),
        "dispatch-direct": sum(bitwise_wrong(getattr(direct, f), getattr(baseline, f))
                               for f in ("rows", "expert_offsets", "src_info")),
        "dispatch-nccl": None,
        "layer-fused": bitwise_wrong(outs["layer-fused"], outs["layer-unfused"]),
        "layer-unfused": None,
    }
    work = {
        "gemm1": arithmetic.gemm1_work(counts, H, I),
        "gemm2": arithmetic.gemm2_work(counts, H, I),
        "fused": arithmetic.gemm2_combine_work(counts, H, I),
        "unfused": arithmetic.gemm2_combine_work(counts, H, I),
        "library": arithmetic.gemm2_combine_work(counts, H, I),
        "dispatch-direct": dispatch_work(counts, H, dedup=True),
        "dispatch-nccl": dispatch_work(counts, H, dedup=False),
        "layer-fused": arithmetic.layer_work(counts, H, I, dedup_dispatch=True),
        "layer-unfused": arithmetic.layer_work(counts, H, I, dedup_dispatch=False),
    }
    return [PathResult(p, samples[p], work[p], None if wrong[p] is None else comm.allreduce(wrong[p]))
            for p in PATHS]
