"""A dead peer: rank 0 must get a clear error within wait_timeout_s, never hang. Run under the
launcher on two ranks:

    python launch/run.py -n 2 [--share-gpu] --timeout 120 -- python -m mpi4py launch/jobs/dead_peer.py {killed|stuck}

Both ranks warm up with one full forward (so kernel loading and first-call costs stay out of
the timing) and meet at a barrier. Then rank 1 stops and never calls forward again:
  killed  rank 1 exits at once with os._exit(3)
  stuck   rank 1 sleeps forever (a process in a debugger, or in a long exception handler)
while rank 0 calls the public forward, which makes no MPI call: its dispatch waits on the
device for rank 1's count row, which never comes. Rank 0 prints
`rank 0: <ExceptionClass>: <message>` and
`# dead_peer: mode M, peer 1, <ExceptionClass> after S s (wait_timeout_s T)`, then calls the
public close(), whose barriers give up after wait_timeout_s, and prints
`# dead_peer: close <returned|raised X> after S s (wait_timeout_s T)`. It exits 1, which
makes `python -m mpi4py` abort the job. The job exits non-zero in every mode: it lost a
rank. Rank 1 prints `# rank 1: stopping (mode M) at monotonic S` as it stops
(CLOCK_MONOTONIC is one clock for the whole host, so a test can time the rest of the job
from it).

Killed mode and the MPI launcher: Hydra and Open MPI end the whole job as soon as one rank
exits without MPI_Finalize (on an H200 host, Open MPI 4.1.6 ended it, status 3, within 3 s
of start), so under them the launcher, not rank 0's device wait, ends this mode. To let rank
0 meet a peer whose process is gone, turn that cleanup off: `mpiexec -disable-auto-cleanup`
(Hydra) or `mpirun --mca orte_abort_on_non_zero_status 0` (Open MPI 4); rank 0 then raised
PeerTimeoutError after 5.00 s there (tests/gpu/test_reliability.py runs it so). Stuck mode
is the one that only the device-side bound can catch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import cupy
from job_report import emit  # a sibling of this script

from epserve import EPService, MoEConfig
from epserve.check.testing import layer_inputs
from epserve.comm import mpi as ep_comm
from epserve.dispatch.host_plan import count_recv_rows

MODES = ("killed", "stuck")
DEAD_RANK = 1
WAIT_TIMEOUT_S = 5.0
KILLED_EXIT = 3
E_LOC, TOP_K, HIDDEN, INTERMEDIATE, TOKENS = 4, 2, 256, 128, 64
SEED = 61


def stop(mode: str) -> None:
    emit(f"# rank {DEAD_RANK}: stopping (mode {mode}) at monotonic {time.monotonic():.3f}")
    if mode == "killed":
        os._exit(KILLED_EXIT)
    while True:
        time.sleep(3600)


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/dead_peer.py")
    p.add_argument("mode", choices=MODES)
    mode = p.parse_args().mode
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    if world != 2:
        if rank == 0:
            emit(f"dead_peer: needs exactly 2 ranks, got {world}")
        return 2
    E = E_LOC * world
    everyone = layer_inputs(SEED, [TOKENS] * world, E, TOP_K, HIDDEN, INTERMEDIATE)
    owed = count_recv_rows(DEAD_RANK, [everyone[0].topk_idx, everyone[1].topk_idx[:0]], E, world)
    if owed == 0:
        raise RuntimeError(f"rank 0 routes nothing to rank {DEAD_RANK}'s experts, so nothing would wait for it; "
                           f"pick another SEED")
    cfg = MoEConfig(E, TOP_K, HIDDEN, INTERMEDIATE, TOKENS, world_size=world, wait_timeout_s=WAIT_TIMEOUT_S)
    svc = EPService(cfg, comm)
    me = everyone[rank]
    x, idx, w, w13, w2 = (cupy.asarray(a) for a in (me.x, me.topk_idx, me.topk_weights, me.w13, me.w2))
    svc.forward(x, idx, w, w13, w2)
    svc.check()
    cupy.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    if rank == DEAD_RANK:
        stop(mode)
    emit(f"# rank 0: rank {DEAD_RANK} owes {owed} rows; calling forward without it")
    start = time.monotonic()
    try:
        svc.forward(x, idx, w, w13, w2)
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is the outcome this job reports
        seconds = time.monotonic() - start
        emit(f"rank 0: {type(exc).__name__}: {exc}")
        emit(f"# dead_peer: mode {mode}, peer {DEAD_RANK}, {type(exc).__name__} after {seconds:.2f} s "
             f"(wait_timeout_s {WAIT_TIMEOUT_S:g})")
        close(svc)
        return 1
    emit(f"rank 0: WRONG: forward returned although rank {DEAD_RANK} never called it "
         f"({time.monotonic() - start:.2f} s)")
    return 1


def close(svc) -> None:
    start = time.monotonic()
    outcome = "returned"
    try:
        svc.close()
    except Exception as exc:  # noqa: BLE001 - a PeerTimeoutError naming rank 1 is the expected end
        outcome = f"raised {type(exc).__name__}"
        emit(f"# rank 0: close: {type(exc).__name__}: {exc}")
    emit(f"# dead_peer: close {outcome} after {time.monotonic() - start:.2f} s (wait_timeout_s {WAIT_TIMEOUT_S:g})")


if __name__ == "__main__":
    sys.exit(main())
