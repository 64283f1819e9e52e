"""A tiny layer for compute-sanitizer, which wraps each rank:

    python launch/run.py -n 2 --share-gpu -- compute-sanitizer --tool memcheck --report-api-errors no \\
        --error-exitcode 9 $(command -v python3) -m mpi4py launch/jobs/sanitize_job.py

(--tool memcheck, racecheck, synccheck or initcheck.) Two calls, each forward fused (peer
sink, direct dispatch) and unfused (null sink, NCCL dispatch or the IPC copy), so every
kernel of both sinks runs and the second call reuses the recv slots and counters the first
released. Sizes are the smallest that still give the GEMMs several tiles each way, partial
tiles, masked slots and a rank without tokens, so the job ends in seconds under the
sanitizer's instrumentation. The outputs are checked too (fused == unfused bitwise, within
1e-2 of the float64 reference): the sanitizer changes timing, which must not change results.
Prints `# sanitize_job: ok` or the failures, and a `RESULT` line per rank; exits 1 on a wrong
result (the sanitizer's own findings give its exit code).

What the tools need and said on an H200 (two ranks on one GPU):
- the interpreter by its absolute path: compute-sanitizer looks `python3` up on its own and
  found a system Python without mpi4py;
- --report-api-errors no: driver-symbol probing by the libraries loaded makes 34
  cuGetProcAddress calls per rank that return CUDA_ERROR_INVALID_VALUE, each an error
  otherwise;
- memcheck and synccheck: 0 errors; the job passes;
- racecheck: 0 hazards (the send-warp mailbox is ordered by bar.sync on both sides; with
  bar.arrive on one side racecheck reported 6);
- initcheck: tens of thousands of reads of memory that a peer process initialized through
  CUDA IPC (dispatch count rows, signal counters), which initcheck cannot see.
"""

from __future__ import annotations

import sys

import cupy
import numpy as np
from job_report import report  # a sibling of this script

from epserve import EPService, MoEConfig
from epserve.check.reference import reference_layer, rel_error
from epserve.check.testing import layer_inputs
from epserve.comm import mpi as ep_comm

# Two 128-wide column tiles in each GEMM, and experts of more than one 128-row tile.
E_LOC, TOP_K, HIDDEN, INTERMEDIATE = 2, 2, 256, 128
# Token counts of rank r in call n: CALLS[n][r % 2] + r // 2, so any -n gives each rank its own.
CALLS = ((300, 9), (0, 150))
SEED = 17
# The sanitizer slows kernels by orders of magnitude, and a peer's slowed kernel must not
# read as a dead peer.
WAIT_TIMEOUT_S = 300.0
REL_ERROR_LIMIT = 1e-2


def main():
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    E = E_LOC * world
    tokens = [[call[r % 2] + r // 2 for r in range(world)] for call in CALLS]
    cfg = MoEConfig(E, TOP_K, HIDDEN, INTERMEDIATE, max(max(t) for t in tokens), world_size=world,
                    wait_timeout_s=WAIT_TIMEOUT_S)
    failures = []
    with EPService(cfg, comm) as svc:
        for n, counts in enumerate(tokens):
            everyone = layer_inputs(SEED + n, counts, E, TOP_K, HIDDEN, INTERMEDIATE, unused=0.1)
            me = everyone[rank]
            x, idx, w, w13, w2 = (cupy.asarray(a) for a in (me.x, me.topk_idx, me.topk_weights, me.w13, me.w2))
            fused = cupy.asnumpy(svc.forward(x, idx, w, w13, w2, sink="peer", dispatch="direct"))
            unfused = cupy.asnumpy(svc.forward(x, idx, w, w13, w2, sink="null", dispatch="nccl"))
            svc.check()
            if not np.array_equal(fused.view(np.uint16), unfused.view(np.uint16)):
                failures.append(f"call {n}: fused != unfused bitwise")
            if counts[rank]:
                ref = reference_layer([i.x for i in everyone], [i.topk_idx for i in everyone],
                                      [i.topk_weights for i in everyone], [i.w13 for i in everyone],
                                      [i.w2 for i in everyone], E)[rank]["out"]
                err = rel_error(fused.astype(np.float64), ref)
                if not err < REL_ERROR_LIMIT:
                    failures.append(f"call {n}: relative error {err:.3g} vs the float64 reference")
    report(comm, dict(job="sanitize_job", rank=rank, ok=not failures, failures=failures))
    wrong = comm.allreduce(len(failures))
    if rank == 0:
        print(f"# sanitize_job: {'ok' if not wrong else f'{wrong} failures'}", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
