"""How often a path waits for the GPU on the host, and how many MPI calls it makes, per call:
counted, not claimed, by running the path once with CuPy's waits and the communicator's
methods instrumented.

What is counted as a host wait: Stream, ExternalStream and Event `synchronize`,
`cupy.cuda.runtime.deviceSynchronize` and `streamSynchronize`, and `cupy.asnumpy` (a copy to
the host, which waits for the stream). An implicit wait that bypasses these (`int()` of a
device array, `ndarray.get()` called directly) is not seen; epserve's own paths use none.
MPI calls are counted on the communicator the service was built with (`CountingComm`), so
every object that reaches MPI through it is seen."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import cupy

# mpi4py's methods that talk to other ranks (lower case: pickled objects; upper case: buffers).
_MPI_METHODS = ("allgather", "Allgather", "allreduce", "Allreduce", "alltoall", "Alltoall", "barrier", "Barrier",
                "bcast", "Bcast", "gather", "Gather", "scatter", "Scatter", "reduce", "Reduce", "send", "Send",
                "recv", "Recv", "isend", "Isend", "irecv", "Irecv", "sendrecv", "Sendrecv", "Ibarrier",
                "Iallgather", "Iallreduce", "Ibcast")


@dataclass
class Counts:
    host_waits: int = 0
    mpi_calls: int = 0


_active: list[Counts] = []  # the counters of the `counting` blocks now open


def _note(field: str) -> None:
    for counts in _active:
        setattr(counts, field, getattr(counts, field) + 1)


def counting_comm(comm):
    """`comm` (an mpi4py Intracomm) as an object of a subclass whose MPI methods count
    themselves while a `counting` block is open; it shares comm's handle (no new MPI
    communicator), so it can be passed wherever comm is."""
    return _counting_class(type(comm))(comm)


@functools.lru_cache(maxsize=None)
def _counting_class(base):
    def wrap(name):
        method = getattr(base, name)

        def counted(self, *args, **kwargs):
            _note("mpi_calls")
            return method(self, *args, **kwargs)

        return counted

    members = {name: wrap(name) for name in _MPI_METHODS if hasattr(base, name)}
    return type(f"Counting{base.__name__}", (base,), members)


def _wait_targets():
    return [(cupy.cuda.Stream, "synchronize"), (cupy.cuda.ExternalStream, "synchronize"),
            (cupy.cuda.Event, "synchronize"), (cupy.cuda.runtime, "deviceSynchronize"),
            (cupy.cuda.runtime, "streamSynchronize"), (cupy, "asnumpy")]


@contextlib.contextmanager
def counting(wait_targets=None):
    """Count host waits (and, on a `counting_comm`, MPI calls) made inside the block.
    wait_targets: the (owner, attribute name) pairs that wait, CuPy's by default."""
    counts = Counts()
    patched = []
    if not _active:  # the first open block instruments them; nested blocks share it
        for owner, name in _wait_targets() if wait_targets is None else wait_targets:
            original = getattr(owner, name)

            def counted(*args, _original=original, **kwargs):
                _note("host_waits")
                return _original(*args, **kwargs)

            setattr(owner, name, counted)
            patched.append((owner, name, original))
    _active.append(counts)
    try:
        yield counts
    finally:
        _active.remove(counts)
        for owner, name, original in patched:
            setattr(owner, name, original)
