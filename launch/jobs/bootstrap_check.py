"""Multi-process checks of epserve's bootstrap and failure handling; needs MPI, not a GPU.

    python launch/run.py -n 2 -- python -m mpi4py launch/jobs/bootstrap_check.py MODE

Modes (tests/mpi/test_launcher.py runs each and reads the output):
  ok        bootstrap, local rank, MoEConfig agreement; every rank prints one line per step
  mismatch  rank 1 builds a different hidden size; every rank catches RankMismatchError,
            prints `rank R: RankMismatchError: <message>` and exits 0
  verdict   rank 1 fails inside a checked stage; every rank prints the RankFailedError that
            names rank 1 and exits 0
  crash     rank 1 raises an uncaught exception while rank 0 waits in a barrier; under
            `python -m mpi4py` the job must end at once with a non-zero status
  hang      rank 1 sleeps forever (rank 0 in a barrier); only the launcher's timeout ends it

Every rank first prints `rank R of W pid P: mode MODE`, so a test can check afterwards that
no rank process outlived the job. Exit status 1 means a check here found a wrong outcome.
"""

import os
import sys
import time

from job_report import emit  # a sibling of this script

from epserve.comm.mpi import checked, local_rank, world
from epserve.config import MoEConfig, check_agreement
from epserve.errors import RankFailedError, RankMismatchError

FAILING_RANK = 1
STAGE = "load weights"


def small_config(world_size, hidden=256):
    # Four experts per rank so any -n works; sizes are multiples of the kernel tile (64).
    return MoEConfig(
        num_experts=4 * world_size,
        top_k=2,
        hidden=hidden,
        intermediate=512,
        max_tokens_per_rank=64,
        world_size=world_size,
    )


def say(comm, text):
    emit(f"rank {comm.Get_rank()}: {text}")


def mode_ok(comm):
    say(comm, f"local_rank {local_rank(comm)}")
    check_agreement(small_config(comm.Get_size()), comm)
    say(comm, "config agreed")
    return 0


def mode_mismatch(comm):
    hidden = 512 if comm.Get_rank() == FAILING_RANK else 256
    try:
        check_agreement(small_config(comm.Get_size(), hidden=hidden), comm)
    except RankMismatchError as exc:
        say(comm, f"RankMismatchError: {exc}")
        return 0
    say(comm, "WRONG: no RankMismatchError although rank 1 has another hidden size")
    return 1


def mode_verdict(comm):
    try:
        with checked(comm, STAGE):
            if comm.Get_rank() == FAILING_RANK:
                raise ValueError(f"simulated failure on rank {FAILING_RANK}")
    except RankFailedError as exc:
        say(comm, f"RankFailedError: {exc}")
        return 0 if f"rank {FAILING_RANK}:" in str(exc) else 1
    say(comm, "WRONG: no RankFailedError although rank 1 failed")
    return 1


def mode_crash(comm):
    if comm.Get_rank() == FAILING_RANK:
        raise RuntimeError(f"deliberate uncaught exception on rank {FAILING_RANK}")
    say(comm, "waiting in a barrier for a rank that crashed")
    comm.Barrier()
    say(comm, "WRONG: barrier completed")
    return 1


def mode_hang(comm):
    if comm.Get_rank() == FAILING_RANK:
        say(comm, "sleeping forever")
        while True:
            time.sleep(3600)
    say(comm, "waiting in a barrier for a rank that hangs")
    comm.Barrier()
    say(comm, "WRONG: barrier completed")
    return 1


MODES = {
    "ok": mode_ok,
    "mismatch": mode_mismatch,
    "verdict": mode_verdict,
    "crash": mode_crash,
    "hang": mode_hang,
}


def main(argv):
    if len(argv) != 1 or argv[0] not in MODES:
        print(f"usage: bootstrap_check.py {{{'|'.join(MODES)}}}", file=sys.stderr)
        return 2
    comm = world()
    emit(f"rank {comm.Get_rank()} of {comm.Get_size()} pid {os.getpid()}: mode {argv[0]}")
    status = MODES[argv[0]](comm)
    say(comm, f"mode {argv[0]} done, status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
