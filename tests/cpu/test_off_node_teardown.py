"""When an OffNode's carrier (and so the NCCL communicator it holds) is freed, without a GPU.

ncclCommDestroy, which cupy's NcclCommunicator calls when it is freed, is an intra-node
collective: every rank of the node must call it, or the ones that did wait. A communicator that
only a reference cycle keeps alive is freed by Python's cyclic garbage collector, at whatever
allocation each rank's collector happens to run, which is not the same point of the program on
every rank (rank 0 gathers the reports, a rank standing in allocates otherwise than the rest):
one rank then sits in ncclCommDestroy while its peer waits for it in an NCCL call or an MPI
collective, and neither returns. Freed by reference counting, it goes when the service holding
it goes, at the same point of the program on every rank. So no part of an OffNode may hold the
OffNode itself: the relay (EPSERVE_OFFNODE_ROUTE=relay) and the send under GEMM 2
(EPSERVE_OFFNODE_OVERLAP=1) refer to it weakly."""

import gc
import types
import weakref

import numpy as np
import pytest

from epserve.comm import off_node as off_mod
from epserve.comm import off_node_overlap as overlap_mod
from epserve.comm import off_node_relay as relay_mod
from epserve.comm import off_node_stamps as stamps_mod
from epserve.comm.off_node import OffNode, OffNodePlan
from epserve.comm.topology import NodeLayout

E, K, H, T = 16, 2, 128, 32


class Buffer:
    """A staging or symmetric buffer without a GPU."""

    def __init__(self, nbytes: int):
        self.nbytes, self.ptr = nbytes, 0x10000

    def view(self, dtype, shape, offset: int = 0):
        return np.zeros(shape, dtype)

    def peer_ptr(self, d: int) -> int:
        return self.ptr + (d << 32)


class Comm:
    """Stands for the NCCL communicator: freed when nothing refers to it any more."""


class Carrier:
    name = "nccl"

    def __init__(self):
        self.comm = Comm()

    def staging(self, nbytes: int) -> Buffer:
        return Buffer(nbytes)

    def node_staging(self, nbytes: int) -> Buffer:
        return Buffer(nbytes)


def fake_cupy():
    """What OffNode, CallStamps, Relay and OverlappedSend call of cupy when they are made."""
    cuda = types.SimpleNamespace(
        alloc=Buffer, alloc_pinned_memory=bytearray, Event=lambda **kw: object(), Stream=lambda **kw: object(),
        Device=lambda *a: types.SimpleNamespace(attributes={"MultiProcessorCount": 132}),
        runtime=types.SimpleNamespace(memset=lambda *a: None, deviceSynchronize=lambda: None))
    return types.SimpleNamespace(zeros=np.zeros, asarray=np.asarray, cuda=cuda)


@pytest.fixture
def no_gpu(monkeypatch):
    fake = fake_cupy()
    for mod in (off_mod, stamps_mod, relay_mod, overlap_mod):
        monkeypatch.setattr(mod, "cupy", fake)


def make_off_node(rank: int, world: int, R: int, route: str, overlap: bool, sizes: str):
    layout = NodeLayout(world, R)
    plan = OffNodePlan(layout, rank, E, K, H, H, T)
    first = rank // R * R
    group = types.SimpleNamespace(node_ranks=range(first, first + R), allocate=Buffer,
                                  comm=types.SimpleNamespace(Barrier=lambda: None))
    signals = types.SimpleNamespace(local=lambda a: 0x2000 + a)
    carrier = Carrier()
    off = OffNode(plan, carrier, signals, 20.0, sizes, max_recv_rows=4 * T, overlap_free_sms=8 if overlap else None,
                  route=route, group=group)
    return off, carrier


# (ranks, ranks per node, route, send under GEMM 2, sizes)
CASES = [
    (2, 1, "direct", False, "capacity"),
    (2, 1, "direct", False, "host"),
    (2, 1, "relay", False, "capacity"),
    (2, 1, "relay", False, "host"),  # the job that hung on two H200s
    (2, 1, "direct", True, "capacity"),
    (4, 2, "relay", False, "host"),
    (4, 2, "relay", True, "host"),
]


@pytest.mark.parametrize("world,R,route,overlap,sizes", CASES)
def test_the_carrier_goes_with_the_off_node_not_with_the_garbage_collector(no_gpu, world, R, route, overlap, sizes):
    """With the cyclic collector off, dropping the last reference to an OffNode frees its carrier
    and communicator at once: nothing in it forms a reference cycle."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        off, carrier = make_off_node(world - 1, world, R, route, overlap, sizes)
        assert (off.relay is not None) == (route == "relay") and (off.overlap is not None) == overlap
        comm = weakref.ref(carrier.comm)
        held = weakref.ref(off)
        del carrier, off
        assert held() is None, "the OffNode outlived its last reference: a reference cycle holds it"
        assert comm() is None, "the carrier's communicator outlived the OffNode"
    finally:
        if enabled:
            gc.enable()
        gc.collect()


def test_the_relay_and_the_overlapped_send_still_reach_their_off_node(no_gpu):
    """The weak references work while the OffNode lives (what their launches read of it)."""
    off, _ = make_off_node(3, 4, 2, "relay", True, "host")
    assert off.relay.off.plan is off.plan and off.relay.off.stamps is off.stamps
    assert off.relay.rails == [1]
    assert off.overlap.off_node.plan is off.plan and off.overlap.off_node.relay is off.relay


def test_the_carrier_trace_is_off_by_default_and_logs_groups_and_the_free(monkeypatch, tmp_path):
    """EPSERVE_OFFNODE_TRACE=DIR (a diagnostic): a line per carrier group, peer:bytes in order,
    and one when the carrier is freed; unset, no trace."""
    from epserve.comm.carrier_trace import TRACE_ENV, CarrierTrace
    from epserve.comm.carriers import Recv, Send, make_carrier

    monkeypatch.setattr(CarrierTrace, "_gc_logs", {})
    callbacks = list(gc.callbacks)
    group = types.SimpleNamespace(rank=1)
    monkeypatch.delenv(TRACE_ENV, raising=False)
    carrier = make_carrier("nccl", group=group, nccl_comm=Comm(), shared_gpu=False, hosts_differ=False, error_ptr=0,
                           timeout_ns=1)
    assert carrier.trace is None
    monkeypatch.setenv(TRACE_ENV, str(tmp_path))
    carrier = make_carrier("nccl", group=group, nccl_comm=Comm(), shared_gpu=False, hosts_differ=False, error_ptr=0,
                           timeout_ns=1)
    staging = Buffer(64)
    carrier.trace.group([Send(0, staging, 0, 48), Send(0, staging, 48, 16)], [Recv(0, 0x100, 32, staging, 0)])
    carrier.trace.group([], [Recv(0, 0x200, 16, staging, 16)])
    (log,) = tmp_path.glob("carrier*.rank1.log")
    del carrier
    gc.callbacks[:] = callbacks  # the trace's garbage-collection log
    lines = [line.split(" ", 1)[1] for line in log.read_text().splitlines()]
    assert lines == ["g0 S 0:48 0:16 | R 0:32", "g1 S  | R 0:16", "freed"]


def test_a_lost_service_keeps_no_traceback_of_itself():
    """After a PeerTimeoutError the service keeps the error to refuse later calls; kept with
    its traceback, whose frames hold the service, it would make a cycle and leave the NCCL
    communicator to the cyclic collector (whose destroy is collective inside a node)."""
    from epserve.errors import PeerTimeoutError
    from epserve.layer.service import EPService

    svc = EPService.__new__(EPService)
    svc._lost = None

    def times_out():
        raise PeerTimeoutError("rank 0: stage combine-wait: rank 1 never came")

    with pytest.raises(PeerTimeoutError):
        svc._lose_on_timeout(times_out)
    assert str(svc._lost) == "rank 0: stage combine-wait: rank 1 never came"
    assert svc._lost.__traceback__ is None
    gc.disable()
    try:
        ref = weakref.ref(svc)
        del svc
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()
