"""Output of the multi-rank jobs. Ranks' stdout streams merge under mpirun and can cut into
each other's lines: every rank's record goes to rank 0, which prints them all, and a line a
rank prints itself goes out in one write."""

import json
import sys


def emit(line: str) -> None:
    """Print `line` in one write: print() writes the text and the newline separately, and
    another rank's output could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def report(comm, record: dict) -> None:
    """Collective: rank 0 prints one `RESULT {json}` line per rank's record, each with the
    GEMM 2 peer builds its rank launched (epserve/ffn/gemm.py peer_variant), so a test can
    tell which one a job ran."""
    from epserve.ffn.gemm import PEER_BUILDS_USED

    records = comm.gather({**record, "peer_builds": sorted(PEER_BUILDS_USED)}, root=0)
    if comm.Get_rank() == 0:
        for r in records:
            print("RESULT " + json.dumps(r), flush=True)


def run_cases(comm, job: str, cases, run) -> int:
    """Collective: `# cases: N`, then run(case) for each case (a record with "ok"), reported
    as it ends, and a last line naming the failing (case, rank) pairs. Returns the exit
    status: 1 if any case failed on any rank."""
    rank = comm.Get_rank()
    if rank == 0:
        emit(f"# cases: {len(cases)}")
    bad = 0
    for case in cases:
        result = run(case)
        report(comm, result)
        bad += comm.allreduce(int(not result["ok"]))
    if rank == 0:
        emit(f"# {job}: {'all cases passed' if not bad else f'{bad} failing (case, rank) pairs'}")
    return 1 if bad else 0
