"""The FP8 presets' paths at one point (issue 16): the service in FP8 mode
(MoEConfig.expert_dtype "fp8"), its weights from epserve.quantize_weights. The rows have the
bf16 presets' path names, so the report and the baselines read them alike:

  gemm1          quantize the received rows 1 x 128 + FP8 GEMM 1 + SwiGLU + act's quantization
  gemm2          FP8 GEMM 2 with the peer sink gated off (the math alone)
  fused          FP8 GEMM 2 with the peer sink + the reduction
  unfused        FP8 GEMM 2 storing C + the transport + the reduction
  dispatch-direct the FP8 direct dispatch: packed rows, quantized inside its move kernel (the
                 public call, its host wait included)
  dispatch-layer the same with no host wait (dispatch(wait=False)), calls queued back to
                 back: the GPU's time (bench/dispatch_paths.py)
  dispatch-packed dispatch-layer handed the tokens quantized already (EPService.quantize_tokens,
                 once, untimed), as DeepEP's FP8 dispatch is: its plain move of packed rows
  layer-fused    forward, direct dispatch, peer sink
  layer-unfused  forward, NCCL dispatch, null sink
  layer-library  the layer composed from libraries with cuBLASLt's block-scaled FP8 GEMM per
                 expert (library_layer.LibraryLayerFP8), where the service has NCCL (one GPU
                 per rank); checked within bf16 tolerance against layer-unfused

Their FLOPs are the bf16 layer's (the same products); the caller rates the GEMMs against an
FP8 dense limit measured in the same run (limits.fp8_gemm_rates). The HBM floors keep bf16's
weight bytes, so for the weight-bound decode they are upper bounds. Checked: fused ==
unfused and layer-fused == layer-unfused bitwise, GEMM 1 reruns bitwise, both direct
dispatches (which quantize in their move) and the dispatch of packed tokens into poisoned
buffers against the NCCL dispatch (quantized in a launch of its own) bitwise. Reported, not
asserted: the FP8 layer's relative error against the bf16 layer on the same tokens and
(unquantized) weights, which is what FP8 costs in accuracy."""

from __future__ import annotations

import cupy
import numpy as np

from epserve.arrays import BF16
from epserve.bench import arithmetic, cublaslt, dispatch_paths
from epserve.bench.library_layer import LibraryLayerFP8
from epserve.bench.measure import (
    PathResult,
    _busiest_rank,
    dispatch_work,
    library_swiglu,
    point_inputs,
    time_paths,
)
from epserve.bench.wrong import bitwise_wrong, tolerance_wrong
from epserve.dispatch.host import Dispatcher
from epserve.ffn import fp8_stage, gemm

PATHS = ("gemm1", "gemm2", "fused", "unfused", "dispatch-direct", "dispatch-layer", "dispatch-packed", "layer-fused",
         "layer-unfused", "layer-library")


def _bf16_dispatcher(svc) -> Dispatcher:
    """A host-planned bf16 dispatcher beside the service's FP8 one, made once per service
    (collective: it allocates symmetric buffers)."""
    d = getattr(svc, "_bench_bf16_dispatcher", None)
    if d is None:
        c = svc.config
        d = svc._bench_bf16_dispatcher = Dispatcher(svc.group, c.hidden, c.max_tokens_per_rank * c.top_k,
                                                    svc.transport, svc.nccl, BF16)
    return d


def measure_point_fp8(svc, w13, w2, fp8w, topk_all, seed: int, warmup: int, iters: int):
    """Every FP8 path at one point; collective. w13, w2: this rank's bf16 weights (for the
    error against the bf16 layer); fp8w: quantize_weights of them. Returns (results, the
    FP8 layer's relative error against the bf16 layer over every rank's tokens)."""
    comm, cfg = svc.comm, svc.config
    H, I, e_loc = cfg.hidden, cfg.intermediate, cfg.experts_per_rank
    counts, idx, x, w = point_inputs(svc, topk_all, seed)
    T = idx.shape[0]

    # The NCCL dispatch (or where ranks share a GPU the host-planned one) quantizes x in a
    # launch of its own: the reference of the direct dispatches, which quantize in their move.
    reference = dispatch_paths.DispatchReference(svc.dispatch(x, idx, w, "nccl"))

    def dispatch_layer():  # the dispatch with no host wait, as forward runs it
        svc.dispatch(x, idx, w, "direct", wait=False)

    # A stack that quantizes its tokens before the dispatch (as DeepEP's callers do) hands
    # packed rows, which the direct dispatch moves as they are.
    packed = svc.quantize_tokens(x)

    def dispatch_packed():
        svc.dispatch(packed, idx, w, "direct", wait=False)

    dispatch_wrong = {"dispatch-direct": reference.wrong(svc.direct, lambda: svc.dispatch(x, idx, w, "direct")),
                      "dispatch-layer": reference.wrong(svc.direct, dispatch_layer),
                      "dispatch-packed": reference.wrong(svc.direct, dispatch_packed)}
    del reference
    direct = svc.dispatch(x, idx, w, "direct")
    M = direct.num_rows
    buffers = fp8_stage.FP8Buffers(max(M, 1), H, I)  # the bench's own act, beside the service's
    act = buffers.act
    gemm1 = fp8_stage.gemm1_specs(buffers, direct.rows, direct.expert_offsets, fp8w, e_loc, I, H)
    gemm.run(gemm1)
    act_first = (act.q.copy(), act.scales.copy())
    comb = svc.combiner
    rows_src = svc._send_plan(direct)
    C = cupy.empty((M, H), BF16)
    outs = {name: cupy.empty((T, H), BF16)
            for name in ("fused", "unfused", "layer-fused", "layer-unfused", "layer-library", "bf16")}
    nccl_path = svc.nccl_path

    host_plan = svc._host_plan(idx)  # once (MPI): the unfused baseline over NCCL and the bf16 rows use it
    plan = rows_src if svc.transport == "ipc" else host_plan

    def unfused():
        gemm.run(fp8_stage.gemm2_specs("null", act, fp8w, C, direct.expert_offsets, e_loc, H, I))
        comb.unfused(C, plan, idx, w, out=outs["unfused"])

    runs = {
        "gemm1": lambda: gemm.run(gemm1),
        "gemm2": lambda: comb.gemm_only(act, fp8w, rows_src, I),
        "fused": lambda: comb.fused(act, fp8w, rows_src, idx, w, I, out=outs["fused"]),
        "unfused": unfused,
        "dispatch-direct": lambda: svc.dispatch(x, idx, w, "direct"),
        "dispatch-layer": dispatch_layer,
        "dispatch-packed": dispatch_packed,
        "layer-fused": lambda: svc.forward(x, idx, w, fp8w, None, "peer", "direct", out=outs["layer-fused"]),
        "layer-unfused": lambda: svc.forward(x, idx, w, fp8w, None, "null", "nccl", out=outs["layer-unfused"]),
    }
    paths = PATHS
    if svc.nccl is None or cublaslt.unavailable() is not None:  # ranks share a GPU, or no cuBLASLt FP8 here
        paths = tuple(p for p in PATHS if p != "layer-library")
    else:
        library = LibraryLayerFP8(svc.nccl, svc.world, cfg.num_experts, H, I, library_swiglu)
        runs["layer-library"] = lambda: library.forward(x, idx, w, fp8w, None, outs["layer-library"])
    samples, calls, clocks = time_paths(comm, runs, paths, warmup, iters)
    svc.check()

    # The bf16 layer on the same routing: the tokens' bf16 rows in the dispatch's order (the
    # service dispatches packed FP8 rows, so a bf16 dispatcher of the bench's own brings them,
    # planned on the host), bf16 GEMM 1 + SwiGLU, bf16 GEMM 2 with the peer sink.
    rows_bf16 = _bf16_dispatcher(svc).dispatch(x, host_plan)
    act_bf16 = cupy.empty((M, I), BF16)
    gemm.gemm1_swiglu(rows_bf16, w13, act_bf16, direct.expert_offsets, e_loc, I, H)
    comb.fused(act_bf16, w2, rows_src, idx, w, I, out=outs["bf16"])
    svc.check()
    diff = outs["layer-fused"].astype(np.float64) - outs["bf16"].astype(np.float64)
    sums = comm.allreduce((float(cupy.sum(diff * diff)), float(cupy.sum(outs["bf16"].astype(np.float64) ** 2))))
    err_vs_bf16 = float(np.sqrt(sums[0] / sums[1])) if sums[1] > 0 else 0.0

    wrong = {
        "gemm1": bitwise_wrong(act.q, act_first[0]) + int((act.scales != act_first[1]).sum()),
        "gemm2": None,
        "fused": bitwise_wrong(outs["fused"], outs["unfused"]),
        "unfused": None,
        **dispatch_wrong,
        "layer-fused": bitwise_wrong(outs["layer-fused"], outs["layer-unfused"]),
        "layer-unfused": None,
        "layer-library": (tolerance_wrong(outs["layer-library"], outs["layer-unfused"], f"layer-library, {T} tokens/rank")
                          if "layer-library" in paths else None),
    }
    packed_rows = dispatch_work(counts, fp8_stage.dispatch_width(H), dedup=True)  # every direct dispatch moves these
    work = {
        "gemm1": arithmetic.gemm1_work(counts, H, I),
        "gemm2": arithmetic.gemm2_work(counts, H, I),
        "fused": arithmetic.gemm2_combine_work(counts, H, I),
        "unfused": arithmetic.gemm2_combine_work(counts, H, I),
        "dispatch-direct": packed_rows,
        "dispatch-layer": packed_rows,
        "dispatch-packed": packed_rows,
        "layer-fused": arithmetic.layer_work(counts, H, I, dedup_dispatch=True),
        "layer-unfused": arithmetic.layer_work(counts, H, I, dedup_dispatch=nccl_path is not None),
        "layer-library": arithmetic.layer_work(counts, H, I, dedup_dispatch=False),
    }
    results = [PathResult(p, samples[p], work[p], None if wrong[p] is None else comm.allreduce(wrong[p]),
                          *_busiest_rank(comm, calls[p]), sm_mhz=clocks[p][0],
                          sm_mhz_during=clocks[p][1])
               for p in paths]
    return results, err_vs_bf16
