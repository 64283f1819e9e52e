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
    """Collective: rank 0 prints one `RESULT {json}` line per rank's record."""
    records = comm.gather(record, root=0)
    if comm.Get_rank() == 0:
        for r in records:
            print("RESULT " + json.dumps(r), flush=True)
