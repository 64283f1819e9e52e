"""The GPU side of the benchmark: every path at one (preset, routing, tokens per rank) point,
timed with CUDA events on every rank, checked in the same run.

Paths, in three families; each row's speed-ups are taken against its own family's unfused
and library rows (BASELINES):
    gemm1           GEMM 1 with SwiGLU in its epilogue, alone
    gemm2           GEMM 2 alone: the peer sink gated off
    fused           GEMM 2 with the peer sink + the reduction
    unfused         GEMM 2 with the null sink + the transport (NCCL, or the IPC copy where
                    ranks share a GPU) + the reduction
    library         cuBLAS per expert + the same transport + the reduction
    dispatch-direct direct-store dispatch (one row per token and destination): the public
                    call, its one host wait included
    dispatch-layer  the same dispatch with no host wait (dispatch(wait=False)), calls queued back
                    to back: the GPU's time (bench/dispatch_paths.py)
    dispatch-packed (the -fp8 presets only) dispatch-layer handed tokens quantized already
    dispatch-nccl   the NCCL dispatch: planned on the device, one row per token and
                    destination in fixed-size blocks, one grouped send/recv (where ranks share
                    a GPU: planned on the host, one row per slot, pulled over IPC)
    alltoall        NCCL grouped send/recv of one row per slot, nothing else (only
                    where every rank has its own GPU): the library floor of a dispatch. Its
                    NVLink GB/s is nccl-tests' bus bandwidth (bytes to other ranks / time)
    layer-fused     forward: direct dispatch, GEMM 1 + SwiGLU, fused GEMM 2 + combine
    layer-unfused   forward: NCCL dispatch, GEMM 1 + SwiGLU, GEMM 2 + NCCL combine (both
                    planned on the device where every rank has its own GPU)
    layer-library   the layer as a torch-free user composes it from libraries
                    (library_layer.py): CuPy sort and counts, an NCCL all-to-all of the
                    counts and one host wait, NCCL send/recv of one row per slot, cuBLAS per
                    expert for both GEMMs with a CuPy elementwise SwiGLU between them, NCCL
                    back and a CuPy weighted sum (where ranks share a GPU: the host plan
                    and the IPC pull stand in for NCCL)
    layer-torch     the same composition with torch._grouped_mm for both GEMMs, only where
                    torch happens to be importable (it is never a dependency) and every rank
                    has its own GPU

Each path also runs once more, untimed, with its host waits and MPI calls counted
(host_calls.py): the table's "host waits" and "MPI calls" columns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cupy
import numpy as np

from epserve.arrays import BF16
from epserve.bench import arithmetic, dispatch_paths
from epserve.bench.clock import SmClock
from epserve.bench.cublas import grouped_gemm_per_expert
from epserve.bench.events import queued_samples_ms, samples_ms
from epserve.bench.host_calls import counting
from epserve.bench.library_layer import LibraryLayer, torch_grouped_mm
from epserve.bench.wrong import bitwise_wrong, tolerance_wrong
from epserve.comm.nccl import exchange_rows
from epserve.ffn import gemm

PATHS = ("gemm1", "gemm2", "fused", "unfused", "library", "dispatch-direct", "dispatch-layer", "dispatch-nccl",
         "alltoall", "layer-fused", "layer-unfused", "layer-library", "layer-torch")
# path -> (its unfused baseline, its library baseline): a family compares with itself.
_GEMM2 = ("unfused", "library")
_DISPATCH = ("dispatch-nccl", "alltoall")
_LAYER = ("layer-unfused", "layer-library")
BASELINES = {"gemm1": (None, None), "gemm2": _GEMM2, "fused": _GEMM2, "unfused": _GEMM2, "library": _GEMM2,
             "dispatch-direct": _DISPATCH, "dispatch-layer": _DISPATCH, "dispatch-packed": _DISPATCH,
             "dispatch-nccl": _DISPATCH,
             "alltoall": _DISPATCH, "layer-fused": _LAYER, "layer-unfused": _LAYER, "layer-library": _LAYER,
             "layer-torch": _LAYER}
UNFUSED = {path: pair[0] for path, pair in BASELINES.items()}
LIBRARY = {path: pair[1] for path, pair in BASELINES.items()}

# SwiGLU as a CuPy user writes it: bf16 in, fp32 math, bf16 out (round to nearest even).
_LIBRARY_SWIGLU = """
    const float gf = __uint_as_float(((unsigned int)g) << 16);
    const float uf = __uint_as_float(((unsigned int)u) << 16);
    const unsigned int bits = __float_as_uint(gf / (1.0f + expf(-gf)) * uf);
    a = (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
"""


@functools.lru_cache(maxsize=None)
def _library_swiglu_kernel():
    return cupy.ElementwiseKernel("uint16 g, uint16 u", "uint16 a", _LIBRARY_SWIGLU, "epserve_library_swiglu")


def library_swiglu(h, act, intermediate: int) -> None:
    """act [M, I] = silu(h[:, :I]) * h[:, I:], one CuPy elementwise kernel over bf16 bits
    (made once, as a user would keep it, so the timed path holds no per-call setup)."""
    bits = h.view(np.uint16)
    _library_swiglu_kernel()(bits[:, :intermediate], bits[:, intermediate:], act.view(np.uint16))


@dataclass
class PathResult:
    path: str
    samples_ms: list       # this rank's per-iteration times
    work: arithmetic.Work
    wrong: int | None      # elements that disagree with the path's reference, None if it has none
    host_waits: int | None = None  # per call, counted (host_calls.py)
    mpi_calls: int | None = None
    sm_mhz: float | None = None  # this rank's SM clock right after the timed iterations (clock.py)
    sm_mhz_during: float | None = None  # ... and during one more call, where the power cap holds it (clock.py)


def dispatch_work(counts, hidden: int, dedup: bool) -> arithmetic.Work:
    """Read each token once, write each dispatched row once, and the link bytes."""
    hbm = (counts.tokens + counts.rows) * hidden * 2
    return arithmetic.Work(np.zeros(counts.world_size), hbm, arithmetic.dispatch_nvlink_bytes(counts, hidden, dedup))


def point_inputs(svc, topk_all, seed: int):
    """A point's inputs on this rank, the same for every preset's paths (bf16 and FP8): the
    routing's counts, this rank's topk_idx, tokens x and router weights, drawn from `seed`."""
    cfg, rank = svc.config, svc.rank
    idx = cupy.asarray(topk_all[rank])
    T = idx.shape[0]
    rs = cupy.random.RandomState(seed + 1000 * rank)
    x = rs.standard_normal((T, cfg.hidden), dtype=np.float32).astype(BF16)
    w = rs.uniform(0.05, 1.0, (T, cfg.top_k), dtype=np.float32)
    return arithmetic.count_routing(topk_all, cfg.num_experts), idx, x, w


def measure_point(svc, w13, w2, topk_all, seed: int, warmup: int, iters: int) -> list[PathResult]:
    """Every path at one point; collective (every rank calls it with the same routing)."""
    comm, rank, cfg = svc.comm, svc.rank, svc.config
    H, I, E = cfg.hidden, cfg.intermediate, cfg.num_experts
    counts, idx, x, w = point_inputs(svc, topk_all, seed)
    T = idx.shape[0]

    direct = svc.dispatch(x, idx, w, "direct")
    baseline = svc.dispatch(x, idx, w, "nccl")
    plan = baseline.plan or svc._host_plan(idx)  # the host plan: the library rows compose with it

    def dispatch_layer():  # the dispatch with no host wait, as forward runs it
        svc.dispatch(x, idx, w, "direct", wait=False)

    reference = dispatch_paths.DispatchReference(baseline)
    dispatch_wrong = {"dispatch-direct": reference.wrong(svc.direct, lambda: svc.dispatch(x, idx, w, "direct")),
                      "dispatch-layer": reference.wrong(svc.direct, dispatch_layer)}
    del reference
    nccl_path = svc.nccl_path  # the NCCL path planned on the device, None where ranks share a GPU
    M = direct.num_rows
    act, act_again = cupy.empty((M, I), BF16), cupy.empty((M, I), BF16)
    gemm.gemm1_swiglu(direct.rows, w13, act, direct.expert_offsets, w13.shape[0], I, H)
    comb = svc.combiner
    rows_src = svc._send_plan(direct)
    offsets_host = plan.host.expert_offsets
    C, C_lib = cupy.empty((M, H), BF16), cupy.empty((M, H), BF16)
    h_lib, act_lib = cupy.empty((M, 2 * I), BF16), cupy.empty((M, I), BF16)
    outs = {name: cupy.empty((T, H), BF16)
            for name in ("fused", "unfused", "library", "layer-fused", "layer-unfused", "layer-library", "layer-torch")}

    def unfused():
        gemm.grouped_gemm("null", act, w2, C, direct.expert_offsets, w2.shape[0], H, I, rows=idx.size)
        if nccl_path is not None:  # its plan is the last NCCL dispatch's: these same inputs
            comb.unfused_nccl(C, nccl_path, idx, w, out=outs["unfused"])
        else:
            comb.unfused(C, plan, idx, w, out=outs["unfused"])

    def library():
        grouped_gemm_per_expert(act, w2, C_lib, offsets_host)
        comb.unfused(C_lib, plan, idx, w, out=outs["library"])

    library_layer = None if svc.nccl is None else LibraryLayer(svc.nccl, svc.world, E, H, I, library_swiglu)
    torch_layer = (LibraryLayer(svc.nccl, svc.world, E, H, I, library_swiglu, use_torch=True)
                   if svc.nccl is not None and torch_grouped_mm() is not None else None)

    def layer_library():
        if library_layer is not None:
            library_layer.forward(x, idx, w, w13, w2, outs["layer-library"])
            return
        p = svc._host_plan(idx)  # no NCCL where ranks share a GPU: gather the routing, plan on the host
        rows = svc.baseline.dispatch(x, p)
        grouped_gemm_per_expert(rows, w13, h_lib, offsets_host)
        library_swiglu(h_lib, act_lib, I)
        grouped_gemm_per_expert(act_lib, w2, C_lib, offsets_host)
        comb.unfused(C_lib, p, idx, w, out=outs["layer-library"])

    runs = {
        "gemm1": lambda: gemm.gemm1_swiglu(direct.rows, w13, act_again, direct.expert_offsets, w13.shape[0], I, H),
        # GEMM 2's build is chosen by the rows a call expects, T x k in forward: the same here
        "gemm2": lambda: comb.gemm_only(act, w2, rows_src, I, rows=idx.size),
        "fused": lambda: comb.fused(act, w2, rows_src, idx, w, I, out=outs["fused"]),
        "unfused": unfused,
        "library": library,
        "dispatch-direct": lambda: svc.dispatch(x, idx, w, "direct"),
        "dispatch-layer": dispatch_layer,
        "dispatch-nccl": lambda: svc.dispatch(x, idx, w, "nccl"),
        "layer-fused": lambda: svc.forward(x, idx, w, w13, w2, "peer", "direct", out=outs["layer-fused"]),
        "layer-unfused": lambda: svc.forward(x, idx, w, w13, w2, "null", "nccl", out=outs["layer-unfused"]),
        "layer-library": layer_library,
    }
    if svc.nccl is not None:
        runs["alltoall"] = _alltoall(svc.nccl, counts, rank, H)
    if torch_layer is not None:
        runs["layer-torch"] = lambda: torch_layer.forward(x, idx, w, w13, w2, outs["layer-torch"])
    paths = [p for p in PATHS if p in runs]
    samples, calls, clocks = time_paths(comm, runs, paths, warmup, iters)
    svc.check()

    wrong = {
        "gemm1": bitwise_wrong(act_again, act),  # reruns give the same bits
        "gemm2": None,
        "fused": bitwise_wrong(outs["fused"], outs["unfused"]),
        "unfused": None,
        "library": tolerance_wrong(outs["library"], outs["unfused"], f"library, {T} tokens/rank"),
        **dispatch_wrong,
        "dispatch-nccl": None,
        "alltoall": None,
        "layer-fused": bitwise_wrong(outs["layer-fused"], outs["layer-unfused"]),
        "layer-unfused": None,
        "layer-library": tolerance_wrong(outs["layer-library"], outs["layer-unfused"],
                                         f"layer-library, {T} tokens/rank"),
        "layer-torch": (tolerance_wrong(outs["layer-torch"], outs["layer-unfused"], f"layer-torch, {T} tokens/rank")
                        if torch_layer else None),
    }
    work = {
        "gemm1": arithmetic.gemm1_work(counts, H, I),
        "gemm2": arithmetic.gemm2_work(counts, H, I),
        "fused": arithmetic.gemm2_combine_work(counts, H, I),
        "unfused": arithmetic.gemm2_combine_work(counts, H, I),
        "library": arithmetic.gemm2_combine_work(counts, H, I),
        "dispatch-direct": dispatch_work(counts, H, dedup=True),
        "dispatch-layer": dispatch_work(counts, H, dedup=True),
        "dispatch-nccl": dispatch_work(counts, H, dedup=nccl_path is not None),
        "alltoall": dispatch_work(counts, H, dedup=False),
        "layer-fused": arithmetic.layer_work(counts, H, I, dedup_dispatch=True),
        "layer-unfused": arithmetic.layer_work(counts, H, I, dedup_dispatch=nccl_path is not None),
        "layer-library": arithmetic.layer_work(counts, H, I, dedup_dispatch=False),
        "layer-torch": arithmetic.layer_work(counts, H, I, dedup_dispatch=False),
    }
    return [PathResult(p, samples[p], work[p], None if wrong[p] is None else comm.allreduce(wrong[p]),
                       *_busiest_rank(comm, calls[p]), sm_mhz=clocks[p][0],
                       sm_mhz_during=clocks[p][1])
            for p in paths]


# Paths timed with their calls queued back to back (events.queued_samples_ms): no host wait of
# their own, so each event pair is the GPU's time.
QUEUED = ("dispatch-layer", "dispatch-packed")


def time_paths(comm, runs, paths, warmup: int, iters: int) -> tuple[dict, dict, dict]:
    """Each path's samples (every rank starting together), the host waits and MPI calls of
    one more call, and the SM clock: right after the samples, and during a call after that,
    from a third of the way through it for a third of its median time (the clock after a row is
    back near the top while the power cap held the row itself lower: notes/gemm.md,
    twenty-eighth session). (samples, counts, clocks as (after, during) in MHz), each by
    path."""
    samples, clocks, calls = {}, {}, {}
    clock = SmClock()
    for path in paths:
        comm.Barrier()
        timer = queued_samples_ms if path in QUEUED else samples_ms
        samples[path] = timer(runs[path], warmup, iters)
        after = clock.mhz()
        comm.Barrier()
        with counting() as counted:
            runs[path]()
        calls[path] = counted
        comm.Barrier()
        clocks[path] = (after, clock.mhz_during_call(runs[path], float(np.median(samples[path]))))
    return samples, calls, clocks


def _busiest_rank(comm, counted) -> tuple:
    """The most host waits and MPI calls any rank made in its counted call."""
    every = comm.allgather((counted.host_waits, counted.mpi_calls))
    return max(w for w, _ in every), max(m for _, m in every)


def _alltoall(nccl_comm, counts, rank: int, hidden: int):
    """NCCL grouped send/recv of the rows dispatch-nccl moves (one per slot), between
    buffers made once: what a library dispatch costs before any planning or packing."""
    send_counts, recv_counts = counts.slots[rank], counts.slots[:, rank]
    send = cupy.empty((max(1, int(send_counts.sum())), hidden), BF16)
    recv = cupy.empty((max(1, int(recv_counts.sum())), hidden), BF16)
    send_displs = np.concatenate([[0], np.cumsum(send_counts)[:-1]])
    recv_displs = np.concatenate([[0], np.cumsum(recv_counts)[:-1]])
    return lambda: exchange_rows(nccl_comm, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                                 hidden * 2)
