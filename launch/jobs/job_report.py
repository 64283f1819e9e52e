"""Result lines of the multi-rank jobs. Ranks' stdout streams merge under mpirun and can cut
into each other's lines, so every rank's record goes to rank 0, which prints them all."""

import json


def report(comm, record: dict) -> None:
    """Collective: rank 0 prints one `RESULT {json}` line per rank's record."""
    records = comm.gather(record, root=0)
    if comm.Get_rank() == 0:
        for r in records:
            print("RESULT " + json.dumps(r), flush=True)
