"""The whole layer eager against the same forward replayed from a CUDA graph, under the launcher:

    python launch/run.py -n 2 -- python -m mpi4py launch/jobs/time_graph.py [--preset dsv3-decode]
                                                                              [--tokens 128] [--iters 30]

Each rank captures forward (direct dispatch, peer sink) at the preset's shape with random
weights and the bench's balanced routing, then times, in turn: eager forward with its one
host check (check=True), eager forward without it (check=False, back to back), and graph
replays (back to back). Medians of per-call wall times over iters calls, every rank timing the
same calls; the replayed output must equal the eager one bit for bit. Prints one table row per
path on rank 0."""

from __future__ import annotations

import argparse
import dataclasses
import time

import cupy
import numpy as np

from epserve import EPService, MoEConfig
from epserve.arrays import BF16
from epserve.bench import presets
from epserve.check.testing import bf16_bits
from epserve.comm import mpi as ep_comm


def per_call_ms(comm, fn, iters: int) -> float:
    """Median wall time per call of `iters` back-to-back calls, over 5 rounds; the ranks start
    each round together."""
    rounds = []
    for _ in range(5):
        cupy.cuda.runtime.deviceSynchronize()
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        cupy.cuda.runtime.deviceSynchronize()
        rounds.append((time.perf_counter() - t0) * 1e3 / iters)
    return float(np.median(rounds))


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/time_graph.py")
    p.add_argument("--preset", default="dsv3-decode", choices=sorted(presets.PRESETS))
    p.add_argument("--tokens", type=int, help="tokens per rank (default: the preset's)")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    pre = presets.get_preset(args.preset)
    T = args.tokens or pre.tokens_per_rank
    H, I, E, k = pre.hidden, pre.intermediate, pre.num_experts, pre.top_k
    cfg = MoEConfig(E, k, H, I, T, world_size=world)
    routing = presets.get_routing("balanced").draw(dataclasses.replace(pre, tokens_per_rank=T), world, 17)[rank]
    with EPService(cfg, comm) as svc:
        rs = cupy.random.RandomState(100 + rank)
        e_loc = E // world
        w13 = (rs.standard_normal((e_loc, 2 * I, H), dtype=np.float32) / np.sqrt(H)).astype(BF16)
        w2 = (rs.standard_normal((e_loc, H, I), dtype=np.float32) / np.sqrt(I)).astype(BF16)
        x = rs.standard_normal((T, H), dtype=np.float32).astype(BF16)
        idx = cupy.asarray(routing, np.int32)
        weights = rs.random_sample((T, k), dtype=np.float32)
        graph = svc.capture(T, w13, w2)
        graph.x[...], graph.topk_idx[...], graph.topk_weights[...] = x, idx, weights
        out = cupy.empty((T, H), BF16)
        paths = {
            "eager, checked (one host wait)": lambda: svc.forward(x, idx, weights, w13, w2, out=out, check=True),
            "eager, unchecked": lambda: svc.forward(x, idx, weights, w13, w2, out=out, check=False),
            "graph replay": lambda: graph.replay(check=False),
        }
        for fn in paths.values():  # warm-up
            fn()
        times = {name: per_call_ms(comm, fn, args.iters) for name, fn in paths.items()}
        svc.check()
        svc.forward(x, idx, weights, w13, w2, out=out, check=True)
        same = bool(np.array_equal(bf16_bits(graph.replay(check=True)), bf16_bits(out)))
        all_same = comm.allreduce(int(same)) == world
        from mpi4py import MPI  # initialized by ep_comm.world() already

        worst = {name: comm.allreduce(ms, op=MPI.MAX) for name, ms in times.items()}
    if rank == 0:
        print(f"# {args.preset}, {T} tokens/rank, {world} ranks; per-call wall time, the slowest rank's median")
        print(f"{'path':<34}{'ms/call':>9}")
        for name, ms in worst.items():
            print(f"{name:<34}{ms:>9.3f}")
        print(f"# graph replay == eager, bitwise, every rank: {all_same}")


if __name__ == "__main__":
    main()
