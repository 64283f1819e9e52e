"""forward as a CUDA graph (issue 13), under the launcher:

    python launch/run.py -n 2 [--share-gpu] -- python -m mpi4py launch/jobs/check_graph.py [--replays 100] [--fp8]

Captures forward (direct dispatch, peer sink) at a fixed token count per rank, then replays
it with fresh inputs copied into the captured buffers each time: each replay must equal the
eager forward of the same inputs bit for bit (and the float64 reference within 1e-2, every
tenth replay). Then, under the graph: a replay whose routing holds an expert id out of range
must poison out and make check() raise on every rank, and the next replay must be right
again. --fp8: the same with FP8 experts (MoEConfig.expert_dtype "fp8", weights from
epserve.quantize_weights, the float64 FP8 reference of epserve/check/fp8_layer_reference.py).
Prints `RESULT {json}` lines; exits non-zero if any check failed on any rank.
"""

from __future__ import annotations

import argparse
import sys

import cupy
import numpy as np
from job_report import report  # a sibling of this script

from epserve import EPService, MoEConfig, quantize_weights
from epserve.check.fp8_layer_reference import quantized_weights, reference_layer_fp8
from epserve.check.reference import reference_layer, rel_error
from epserve.check.testing import bf16_bits, layer_inputs
from epserve.comm import mpi as ep_comm
from epserve.errors import EPServeError

H, I, E, K = 256, 128, 8, 4
TOKENS = (48, 33)  # per rank: ranks differ, as in serving


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/check_graph.py")
    p.add_argument("--replays", type=int, default=100)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--fp8", action="store_true", help="FP8 experts (issue 16)")
    args = p.parse_args()
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    tokens = [TOKENS[r % len(TOKENS)] for r in range(world)]
    if rank == 0:
        print("# cases: 1", flush=True)
    cfg = MoEConfig(E, K, H, I, max(tokens), world_size=world, wait_timeout_s=20.0,
                    expert_dtype="fp8" if args.fp8 else "bf16")
    failures, info = [], {"replays": 0, "expert_dtype": cfg.expert_dtype}
    weights = layer_inputs(args.seed, tokens, E, K, H, I)
    with EPService(cfg, comm) as svc:
        # The service chose this rank's GPU: the weights go there.
        w13, w2 = cupy.asarray(weights[rank].w13), cupy.asarray(weights[rank].w2)
        if args.fp8:  # one FP8Weights holds both projections: forward(x, idx, w, fp8w, None)
            w13, w2 = quantize_weights(w13, w2), None
            fp8_weights = [quantized_weights(wt.w13, wt.w2) for wt in weights]
        info["transport"] = svc.transport
        # across nodes (EPSERVE_RANKS_PER_NODE, tests/gpu/test_across_nodes.py): the off-node route
        info.update(nodes=svc.nodes.nodes, route=svc.off_node and svc.off_node.route,
                    dedup=bool(svc.off_node and svc.off_node.dedup))
        graph = svc.capture(tokens[rank], w13, w2)
        for n in range(args.replays):
            inputs = layer_inputs(args.seed + 1 + n, tokens, E, K, H, I, unused=0.1 * (n % 3), with_weights=False)
            me = inputs[rank]
            x, idx, w = cupy.asarray(me.x), cupy.asarray(me.topk_idx), cupy.asarray(me.topk_weights)
            graph.x[...] = x
            graph.topk_idx[...] = idx
            graph.topk_weights[...] = w
            replayed = bf16_bits(graph.replay())
            eager = bf16_bits(svc.forward(x, idx, w, w13, w2))
            if not np.array_equal(replayed, eager):
                failures.append(f"replay {n}: differs from eager forward in {int((replayed != eager).sum())} elements")
            if n % 10 == 0:
                routing = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
                if args.fp8:
                    ref = reference_layer_fp8(*routing, fp8_weights, E)[rank]
                else:
                    ref = reference_layer(*routing, [wt.w13 for wt in weights], [wt.w2 for wt in weights], E)[rank]
                err = rel_error(cupy.asnumpy(graph.out).astype(np.float64), ref["out"])
                if not err < 1e-2:
                    failures.append(f"replay {n}: relative error {err:.3g} vs the float64 reference")
            info["replays"] += 1
        good_bits = replayed

        # A bad expert id on the last rank, under the graph: nothing raises at replay time
        # (check=False), out is poisoned, check() raises on every rank; then all is well.
        bad = idx.copy()
        if rank == world - 1:
            bad[0, 0] = E + 3
        graph.topk_idx[...] = bad
        poisoned = cupy.asnumpy(graph.replay(check=False)).astype(np.float32)
        try:
            svc.check()
            failures.append("a bad expert id under the graph: check() raised nothing")
        except EPServeError as exc:
            print(f"# rank {rank} bad id under the graph: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        if not np.isnan(poisoned).all():
            failures.append("a failed replay left output that is not poisoned (NaN)")
        graph.topk_idx[...] = idx
        if not np.array_equal(bf16_bits(graph.replay()), good_bits):
            failures.append("after the failed replay, the graph gave other bits")
    report(comm, dict(case="graph-fp8" if args.fp8 else "graph", rank=rank, ok=not failures, failures=failures[:10], **info))
    bad_ranks = comm.allreduce(int(bool(failures)))
    if rank == 0:
        print(f"# check_graph: {'all cases passed' if not bad_ranks else f'{bad_ranks} failing ranks'}", flush=True)
    return 1 if bad_ranks else 0


if __name__ == "__main__":
    sys.exit(main())
