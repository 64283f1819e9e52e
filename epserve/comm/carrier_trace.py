"""EPSERVE_OFFNODE_TRACE=DIR: a log of every off-node carrier group per rank, for diagnosing a
hang across nodes (off when unset: it costs host time). epserve/comm/carriers.py opens one per
carrier it makes."""

from __future__ import annotations

import gc
import itertools
import os
import time
import weakref

TRACE_ENV = "EPSERVE_OFFNODE_TRACE"


class CarrierTrace:
    """EPSERVE_OFFNODE_TRACE=DIR, off when unset (a diagnostic: it costs host time). The k-th
    carrier this process makes (the services make theirs in the same order on every rank) writes
    DIR/carrier<k>.rank<r>.log, a line per group as it is queued: the time, g<n>, then its sends
    and its receives as peer:bytes in the order given to the carrier (NCCL matches the i-th send
    from a to b with b's i-th receive from a, so the ranks' lines must agree send for receive),
    and a line when the carrier is freed. DIR/gc.rank<r>.log: every garbage collection that freed
    objects in reference cycles, with the time (a carrier held by a cycle is freed there, and
    with it the NCCL communicator, whose destruction is collective inside a node)."""

    _count = itertools.count()
    _gc_logs = {}

    def __init__(self, directory: str, rank: int, carrier):
        os.makedirs(directory, exist_ok=True)
        self._file = open(os.path.join(directory, f"carrier{next(CarrierTrace._count)}.rank{rank}.log"), "a",
                          buffering=1)
        self._groups = 0
        weakref.finalize(carrier, _trace_line, self._file, "freed")
        if rank not in CarrierTrace._gc_logs:
            log = CarrierTrace._gc_logs[rank] = open(os.path.join(directory, f"gc.rank{rank}.log"), "a", buffering=1)
            gc.callbacks.append(lambda phase, info: phase == "stop" and info["collected"] and _trace_line(
                log, f"gen{info['generation']} collected {info['collected']}"))

    @classmethod
    def open(cls, group, carrier):
        """The trace of `carrier` (of group.rank), or None when EPSERVE_OFFNODE_TRACE is unset."""
        directory = os.environ.get(TRACE_ENV, "").strip()
        return cls(directory, group.rank, carrier) if directory else None

    def group(self, sends, recvs) -> None:
        _trace_line(self._file, f"g{self._groups} S " + " ".join(f"{x.peer}:{x.nbytes}" for x in sends) + " | R "
                    + " ".join(f"{x.peer}:{x.nbytes}" for x in recvs))
        self._groups += 1


def _trace_line(file, text: str) -> None:
    if not file.closed:
        file.write(f"{time.time():.6f} {text}\n")
