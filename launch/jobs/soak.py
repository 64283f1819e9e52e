"""Soak: many back-to-back forward calls on one service, run under the launcher:

    python launch/run.py -n 2 [--share-gpu] -- python -m mpi4py launch/jobs/soak.py [--calls 1000] [--seed 5]

A few inputs (each rank its own token count, one rank with none in some) are prepared once.
A warm-up computes each once per path (fused: peer sink and direct dispatch; unfused: null
sink and NCCL dispatch, or the IPC copy where ranks share a GPU); its fused output, checked
against the float64 reference, is the bits every later call on that input must reproduce.
Then --calls calls run in a seeded order of inputs and paths that every rank draws alike,
compared on the device so that nothing but the layer itself waits between calls. Device
memory (free memory from cudaMemGetInfo, bytes in use in CuPy's pool) is sampled after the
warm-up and at the end.

Prints `# soak: N calls, M mismatches, memory before/after: ...` and a `RESULT` line per
rank; exits 1 on any mismatch, a warm-up output off the reference, or memory growth past
the tolerances below. A device error (a wait that ran out) raises and ends the job.
"""

from __future__ import annotations

import argparse
import sys
import time

import cupy
import numpy as np
from job_report import report  # a sibling of this script

from epserve import EPService, MoEConfig
from epserve.check.reference import reference_layer, rel_error
from epserve.check.testing import layer_inputs
from epserve.comm import mpi as ep_comm

HIDDEN, INTERMEDIATE, EXPERTS_PER_RANK, TOP_K = 1024, 512, 4, 4
# Rank r of input j has TOKEN_COUNTS[(j + r) % len] tokens: each input gives the ranks
# different counts, and some give a rank none.
TOKEN_COUNTS = (256, 1, 97, 0, 180)
NUM_INPUTS = 4
PATHS = ({"sink": "peer", "dispatch": "direct"}, {"sink": "null", "dispatch": "nccl"})
CHECK_EVERY = 100  # calls between reads of the device error record (each read synchronizes)
REL_ERROR_LIMIT = 1e-2
MIB = 1 << 20
# Steady state allocates nothing that outlives a call; CuPy's pool may still round or
# split blocks differently as sizes interleave, and the driver's free memory moves with the
# pool's cached blocks (and, on a shared GPU, with the other rank's).
POOL_USED_TOLERANCE = 1 * MIB
FREE_MEMORY_TOLERANCE = 64 * MIB


def tokens_for(j: int, world: int) -> list[int]:
    return [TOKEN_COUNTS[(j + r) % len(TOKEN_COUNTS)] for r in range(world)]


def memory_sample(comm) -> dict:
    """Device memory of this rank once all ranks' work so far is done; the barrier makes the
    ranks sample at the same point, since on a shared GPU each sees the other's memory."""
    cupy.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    free, _ = cupy.cuda.runtime.memGetInfo()
    pool = cupy.get_default_memory_pool()
    return {"free": free, "pool_used": pool.used_bytes(), "pool_total": pool.total_bytes()}


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/soak.py")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--seed", type=int, default=5)
    args = p.parse_args()
    if args.calls < 1:
        p.error("--calls must be >= 1")
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    E = EXPERTS_PER_RANK * world
    cfg = MoEConfig(E, TOP_K, HIDDEN, INTERMEDIATE, max(TOKEN_COUNTS), world_size=world, wait_timeout_s=20.0)
    failures = []
    with EPService(cfg, comm) as svc:
        inputs, expected = [], []
        for j in range(NUM_INPUTS):
            everyone = layer_inputs(args.seed + j, tokens_for(j, world), E, TOP_K, HIDDEN, INTERMEDIATE, unused=0.1)
            me = everyone[rank]
            args_j = tuple(cupy.asarray(a) for a in (me.x, me.topk_idx, me.topk_weights, me.w13, me.w2))
            first = svc.forward(*args_j, **PATHS[0])
            again = svc.forward(*args_j, **PATHS[1])
            svc.check()
            if not cupy.array_equal(first.view(cupy.uint16), again.view(cupy.uint16)):
                failures.append(f"input {j}: warm-up fused != unfused bitwise")
            if me.x.shape[0]:
                ref = reference_layer([i.x for i in everyone], [i.topk_idx for i in everyone],
                                      [i.topk_weights for i in everyone], [i.w13 for i in everyone],
                                      [i.w2 for i in everyone], E)[rank]["out"]
                err = rel_error(cupy.asnumpy(first).astype(np.float64), ref)
                if not err < REL_ERROR_LIMIT:
                    failures.append(f"input {j}: warm-up relative error {err:.3g} vs the float64 reference")
            inputs.append(args_j)
            expected.append(first.view(cupy.uint16))
        del first, again

        order = np.random.default_rng(args.seed).integers(NUM_INPUTS * len(PATHS), size=args.calls)
        differing = cupy.zeros(args.calls, cupy.int64)  # per call: elements off the expected bits
        before = memory_sample(comm)
        start = time.perf_counter()
        for n, choice in enumerate(order):
            j, path = divmod(int(choice), len(PATHS))
            out = svc.forward(*inputs[j], **PATHS[path])
            differing[n] = cupy.count_nonzero(out.view(cupy.uint16) != expected[j])
            if (n + 1) % CHECK_EVERY == 0:
                svc.check()
        svc.check()
        seconds = time.perf_counter() - start
        del out
        after = memory_sample(comm)

    differing = cupy.asnumpy(differing)
    mismatches = int(np.count_nonzero(differing))
    if mismatches:
        first_bad = int(np.flatnonzero(differing)[0])
        failures.append(f"{mismatches} of {args.calls} calls gave other bits (first: call {first_bad}, "
                        f"{int(differing[first_bad])} elements)")
    used_growth = after["pool_used"] - before["pool_used"]
    free_drop = before["free"] - after["free"]
    if used_growth > POOL_USED_TOLERANCE:
        failures.append(f"CuPy pool bytes in use grew by {used_growth / MIB:.2f} MiB")
    if free_drop > FREE_MEMORY_TOLERANCE:
        failures.append(f"free device memory fell by {free_drop / MIB:.2f} MiB")

    record = dict(job="soak", rank=rank, calls=args.calls, mismatches=mismatches, ok=not failures,
                  failures=failures, calls_per_s=round(args.calls / seconds, 1),
                  **{f"{k}_before_mib": round(v / MIB, 2) for k, v in before.items()},
                  **{f"{k}_after_mib": round(v / MIB, 2) for k, v in after.items()})
    report(comm, record)
    per_rank = comm.gather(record, root=0)
    if rank == 0:
        memory = "; ".join(f"rank {r['rank']} free {r['free_before_mib']:.1f}/{r['free_after_mib']:.1f} MiB, "
                           f"pool used {r['pool_used_before_mib']:.2f}/{r['pool_used_after_mib']:.2f} MiB"
                           for r in per_rank)
        total = sum(r["mismatches"] for r in per_rank)
        print(f"# soak: {args.calls} calls, {total} mismatches, memory before/after: {memory}", flush=True)
    return 1 if comm.allreduce(len(failures)) else 0


if __name__ == "__main__":
    sys.exit(main())
