"""The bench's per-call counts of host waits and MPI calls come from instrumenting CuPy and
the communicator; these check that what is instrumented is seen, and that nothing else is."""

import pytest

cupy = pytest.importorskip("cupy")

from epserve.bench.host_calls import counting, counting_comm  # noqa: E402


class FakeComm:
    """mpi4py's communicator shape, without MPI: importing mpi4py.MPI here would initialise
    MPI in the pytest process, and Open MPI's mpiexec then fails (exit 1, no output) for
    every job a later test launches."""

    def __init__(self, other=None):
        self.messages = other.messages if other is not None else []

    def allgather(self, value):
        self.messages.append("allgather")
        return [value]

    def Barrier(self):
        self.messages.append("Barrier")

    def bcast(self, value, root=0):
        self.messages.append("bcast")
        return value

    def Get_rank(self):
        return 0


def test_mpi_calls_on_the_counting_comm_are_counted():
    plain = FakeComm()
    comm = counting_comm(plain)
    assert isinstance(comm, FakeComm)
    comm.Barrier()  # outside a counting block: made, not counted
    with counting() as counted:
        assert comm.allgather(7) == [7]
        comm.Barrier()
        assert comm.bcast("x", root=0) == "x"
        comm.Get_rank()  # no message: not an MPI call of the kind counted
        plain.Barrier()  # the communicator it was made from: not seen
    assert (counted.host_waits, counted.mpi_calls) == (0, 3)
    assert plain.messages == ["Barrier", "allgather", "Barrier", "bcast", "Barrier"]


def test_host_waits_are_counted_and_the_patches_come_off():
    class Stream:  # stand-ins: no GPU here
        def synchronize(self):
            return "waited"

    class Runtime:
        @staticmethod
        def asnumpy(a):
            return list(a)

    original_sync, original_asnumpy = Stream.synchronize, Runtime.asnumpy
    targets = [(Stream, "synchronize"), (Runtime, "asnumpy")]
    with counting(targets) as outer:
        assert Stream().synchronize() == "waited"
        with counting(targets) as inner:  # nested: both count, the patches are the outer's
            assert Runtime.asnumpy((1, 2)) == [1, 2]
        Stream().synchronize()
    Stream().synchronize()  # after the block: not seen
    assert (outer.host_waits, outer.mpi_calls, inner.host_waits) == (3, 0, 1)
    assert Stream.synchronize is original_sync and Runtime.asnumpy is original_asnumpy


def test_cupy_waits_are_the_default_targets():
    with counting():
        assert cupy.cuda.Stream.synchronize.__name__ == "counted"
        assert cupy.asnumpy.__name__ == "counted"
    assert cupy.asnumpy.__name__ == "asnumpy"
