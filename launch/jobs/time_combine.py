"""First timing of GEMM 2 + combine, fused against unfused, at one large shape (issue 3):

    python launch/run.py -n 2 -- python -m mpi4py launch/jobs/time_combine.py [--tokens 4096]

Random routing (uniform top-k), random activations and weights drawn on the GPU; the
fused and unfused outputs are compared bitwise in the same run (#wrong). CUDA-event times,
median over iterations after warm-up, the slowest rank reported."""

from __future__ import annotations

import argparse
import sys

import cupy
import numpy as np
from mpi4py import MPI

from epserve.bench.events import median_ms
from epserve.check.testing import BF16, routing
from epserve.combine.combiner import Combiner
from epserve.comm import mpi as ep_comm
from epserve.comm.nccl import gpus_shared, make_nccl
from epserve.comm.peers import PeerGroup
from epserve.comm.signals import SignalBlock
from epserve.dispatch.device_plan import DevicePlan
from epserve.dispatch.host_plan import plan_dispatch
from epserve.ffn import gemm


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()

    comm = ep_comm.world()
    ep_comm.select_device(comm)
    rank, world = comm.Get_rank(), comm.Get_size()
    T, H, I, E, k = args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
    shared = gpus_shared(comm)
    transport = "ipc" if shared else "nccl"
    nccl = None if shared else make_nccl(comm)

    rng = np.random.default_rng(args.seed)
    topk_all = [routing(rng, T, E, k) for _ in range(world)]
    plan = DevicePlan.upload(plan_dispatch(rank, topk_all, E, world), k)
    M = plan.num_recv_rows
    idx = cupy.asarray(topk_all[rank])
    w = cupy.asarray(np.random.default_rng(args.seed + rank).random((T, k), np.float32))
    cupy.random.seed(args.seed + 100 * rank)
    act = cupy.random.standard_normal((M, I), dtype=cupy.float32).astype(BF16)
    w2 = (cupy.random.standard_normal((E // world, H, I), dtype=cupy.float32) / np.sqrt(I)).astype(BF16)
    C = cupy.empty((M, H), BF16)

    group = PeerGroup(comm)
    comb = Combiner(group, SignalBlock.create(group), num_experts=E, top_k=k, hidden=H, max_tokens=T,
                    wait_timeout_s=60.0, transport=transport, nccl_comm=nccl, dtype=BF16)
    out_f = cupy.empty((T, H), BF16)
    out_u = cupy.empty((T, H), BF16)

    def gemm_null():
        gemm.grouped_gemm("null", act, w2, C, plan.expert_offsets, E // world, H, I)

    def unfused():
        gemm_null()
        comb.unfused(C, plan, idx, w, out=out_u)

    def fused():
        comb.fused(act, w2, plan, idx, w, I, out=out_f)

    def gate_off():
        comb.gemm_only(act, w2, plan, I)

    results = {}
    for name, fn in (("gemm2 null sink (C stored)", gemm_null), ("gemm2 peer sink gated off", gate_off),
                     ("unfused: gemm2 + " + transport + " + reduce", unfused), ("fused: gemm2 peer sink + reduce", fused)):
        comm.Barrier()
        ms = median_ms(fn, 3, args.iters)
        results[name] = comm.allreduce(ms, op=MPI.MAX)
    comb.signals.raise_if_error(rank)
    cupy.cuda.runtime.deviceSynchronize()
    wrong = int((out_f.view(cupy.uint16) != out_u.view(cupy.uint16)).sum())
    wrong = comm.allreduce(wrong)
    rows = comm.allreduce(M)
    flops = 2.0 * rows * H * I / world  # per rank
    nvlink_bytes = sum(int(c) for d, c in enumerate(plan.host.recv_counts) if d != rank) * H * 2
    if rank == 0:
        print(f"# time_combine: {world} ranks, T={T} H={H} I={I} E={E} k={k}, rows per rank ~{rows // world}, "
              f"unfused transport {transport}; {args.iters} iterations, median, slowest rank")
        print(f"# combine bytes leaving rank 0: {nvlink_bytes / 1e6:.1f} MB")
        print(f"{'path':<44}{'time ms':>10}{'TFLOP/s':>10}{'#wrong':>8}")
        for name, ms in results.items():
            print(f"{name:<44}{ms:>10.3f}{flops / ms / 1e9:>10.1f}{wrong:>8}")
        base = results["unfused: gemm2 + " + transport + " + reduce"]
        print(f"# fused speed-up over unfused: {base / results['fused: gemm2 peer sink + reduce']:.3f}x")
    group.close()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
