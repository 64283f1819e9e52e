"""The main job (`make run`): a realistic MoE layer on every rank, run fused and unfused,
checked, timed, and summarised in a short table.

    python launch/run.py -n 2 -- python -m mpi4py -m epserve.main [--tokens 4096] ...

Defaults are DeepSeek-V3-like: hidden 7168, intermediate 2048, 256 experts, top-8, 4096 tokens
per rank. Weights are random but reproducible per expert (a seed per global expert id), so any
rank can rebuild any expert to check its own tokens against a float64 reference on the GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import cupy
import numpy as np

from epserve.arrays import BF16
from epserve.bench.events import median_ms
from epserve.bench.wrong import bitwise_wrong
from epserve.check.testing import routing
from epserve.comm import mpi as ep_comm
from epserve.config import MoEConfig


def say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def expert_weights(seed: int, expert: int, hidden: int, intermediate: int):
    """Expert `expert`'s (w13 [2I, H], w2 [H, I]) in bf16, the same on every rank."""
    rs = cupy.random.RandomState(seed * 100003 + expert)
    w13 = (rs.standard_normal((2 * intermediate, hidden), dtype=np.float32) / np.sqrt(hidden)).astype(BF16)
    w2 = (rs.standard_normal((hidden, intermediate), dtype=np.float32) / np.sqrt(intermediate)).astype(BF16)
    return w13, w2


def reference_tokens(tokens, x, topk_idx, topk_weights, seed, hidden, intermediate):
    """float64 outputs of the sampled tokens, computed on the GPU from rebuilt experts."""
    out = cupy.zeros((len(tokens), hidden), np.float64)
    idx, w = cupy.asnumpy(topk_idx), cupy.asnumpy(topk_weights)
    for n, t in enumerate(tokens):
        xt = x[t].astype(np.float64)
        for j in range(idx.shape[1]):
            if idx[t, j] < 0:
                continue
            w13, w2 = expert_weights(seed, int(idx[t, j]), hidden, intermediate)
            h = w13.astype(np.float64) @ xt
            g, u = h[:intermediate], h[intermediate:]
            out[n] += float(w[t, j]) * (w2.astype(np.float64) @ (g / (1 + cupy.exp(-g)) * u))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--check-tokens", type=int, default=4, help="tokens per rank checked against float64")
    p.add_argument("--seed", type=int, default=2026)
    args = p.parse_args(argv)

    from epserve.layer.service import EPService  # after argument parsing: --help needs no GPU
    from epserve.runtime.gpu_probe import stopped_without_gpu

    if stopped_without_gpu("python -m epserve.main"):
        return 1
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    T, H, I, E, k = args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
    cfg = MoEConfig(E, k, H, I, T, world_size=world)
    say(rank, f"# epserve main: {world} ranks, hidden {H}, intermediate {I}, {E} experts, top-{k}, {T} tokens/rank")
    t0 = time.perf_counter()
    say(rank, "# compiling kernels and allocating symmetric buffers ...")
    svc = EPService(cfg, comm)
    say(rank, f"# service ready in {time.perf_counter() - t0:.1f} s (unfused transport: {svc.transport}, "
              f"GPU {'shared by the ranks' if svc.shared_gpu else 'per rank'})")

    say(rank, "# drawing weights and routing ...")
    e_loc = cfg.experts_per_rank
    w13 = cupy.empty((e_loc, 2 * I, H), BF16)
    w2 = cupy.empty((e_loc, H, I), BF16)
    for e in range(e_loc):
        w13[e], w2[e] = expert_weights(args.seed, rank * e_loc + e, H, I)
    rng = np.random.default_rng(args.seed + 7919 * rank)
    x = cupy.asarray(rng.standard_normal((T, H), np.float32).astype(BF16))
    idx = cupy.asarray(routing(rng, T, E, k))
    w = cupy.asarray(rng.dirichlet(np.ones(k), T).astype(np.float32))

    say(rank, "# running the layer fused and unfused (warm-up compiles the rest) ...")

    def fused():
        return svc.forward(x, idx, w, w13, w2, sink="peer", dispatch="direct")

    def unfused():
        return svc.forward(x, idx, w, w13, w2, sink="null", dispatch="nccl")

    out_f, out_u = fused(), unfused()
    svc.check()
    wrong = comm.allreduce(bitwise_wrong(out_f, out_u))
    sample = rng.choice(T, size=min(args.check_tokens, T), replace=False)
    ref = reference_tokens(sample, x, idx, w, args.seed, H, I)
    got = out_f[cupy.asarray(sample)].astype(np.float64)
    rel = float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref))
    worst_rel = comm.allreduce(rel, op=_mpi_max())

    times = {}
    for name, fn in (("fused (direct dispatch + peer sink)", fused), ("unfused (NCCL dispatch + null sink + NCCL)",
                                                                      unfused)):
        comm.Barrier()
        times[name] = comm.allreduce(median_ms(fn, 2, args.iters), op=_mpi_max())
    svc.check()

    rows = comm.allreduce(int(svc.dispatch(x, idx, w).num_rows))
    flops = 2.0 * rows * H * (2 * I) + 2.0 * rows * I * H
    link = _link_bytes(comm, cupy.asnumpy(idx), E, world, H)
    say(rank, f"# checked: fused vs unfused #wrong = {wrong}; fused vs float64 on {len(sample)} tokens/rank: "
              f"worst relative error {worst_rel:.2e}")
    say(rank, f"{'path':<46}{'ms/layer':>10}{'TFLOP/s':>10}{'speed-up':>10}")
    base = times["unfused (NCCL dispatch + null sink + NCCL)"]
    for name, ms in times.items():
        say(rank, f"{name:<46}{ms:>10.3f}{flops / world / ms / 1e9:>10.1f}{base / ms:>9.2f}x")
    say(rank, f"# NVLink bytes per layer (busiest rank, one direction): dispatch {link['dispatch'] / 1e6:.1f} MB "
              f"(one row per token and destination), combine {link['combine'] / 1e6:.1f} MB (one row per slot)")
    svc.close()
    ok = wrong == 0 and worst_rel < 1e-2
    say(rank, "# main: OK" if ok else "# main: FAILED")
    return 0 if ok else 1


def _mpi_max():
    from mpi4py import MPI

    return MPI.MAX


def _link_bytes(comm, idx, E, world, H):
    from epserve.bench.arithmetic import combine_nvlink_bytes, count_routing, dispatch_nvlink_bytes

    counts = count_routing(comm.allgather(idx), E)
    return {"dispatch": dispatch_nvlink_bytes(counts, H).busiest, "combine": combine_nvlink_bytes(counts, H).busiest}


if __name__ == "__main__":
    sys.exit(main())
