"""The off-node carrier: what moves staged bytes between ranks of different nodes
(docs/design.md, "Across nodes"). An explicit, small interface, stream-ordered like NCCL's
grouped point-to-point calls:

    buf = carrier.staging(nbytes)              collective: a send-side staging buffer, the same
                                               size on every rank (allocated in the same order)
    carrier.node_staging(nbytes)               collective: the same, also mapped into this node's
                                               ranks (they store into it: the relay, off_node_relay.py)
    carrier.exchange(sends, recvs, status)     one group on the current stream: each Send gives
                                               bytes of this rank's staging to a peer, each Recv
                                               takes a peer's bytes into a local address

Within a group, the sends to one peer and that peer's receives from this rank are matched in
the order they are listed (as NCCL matches them). A Recv also names where the matching send's
bytes lie in the peer's staging (`staging`, `peer_offset`): NCCL ignores that, the IPC test
carrier reads there. Every rank makes the same groups in the same order, each with a fixed
size (the counts stay on the device), and no host waits; or, with EPSERVE_OFFNODE_SIZES=host,
with the sizes both ends computed from the same count rows (epserve/comm/off_node_sizes.py).

Two implementations, chosen by EPSERVE_OFFNODE_CARRIER (the same on every rank):

    nccl  (default, production) ncclSend/ncclRecv inside ncclGroupStart/End on the stream,
          through cupy.cuda.nccl; one GPU per rank (NCCL refuses two ranks on one GPU).
    ipc   a TEST carrier that imitates the network over CUDA IPC, so that one machine, even one
          GPU shared by every rank, runs the whole off-node logic (staging, slots, counts,
          bitwise equality). Its staging is mapped into every rank, across the played "nodes"
          (on a real multi-node job it cannot work, and is refused there: the ranks' hosts
          differ). One kernel per group (cuda/comm/staging.cu): post to each receiver, copy
          from each sender once it has posted, tell each sender its bytes were taken, wait
          until each receiver has taken ours. Every wait is bounded (wait_timeout_s).

EPSERVE_OFFNODE_TRACE=DIR (unset: off; for diagnosing a hang): every carrier logs each group it
makes (epserve/comm/carrier_trace.py), so the ranks' logs can be compared send for receive.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from epserve.comm.carrier_trace import CarrierTrace
from epserve.comm.settings import env_choice
from epserve.errors import ConfigError
from epserve.runtime.kernel_structs import MAX_WORLD

CARRIER_ENV = "EPSERVE_OFFNODE_CARRIER"
CARRIERS = ("nccl", "ipc")


def carrier_name() -> str:
    """EPSERVE_OFFNODE_CARRIER, "nccl" when unset or empty."""
    return env_choice(CARRIER_ENV, CARRIERS, f"the off-node carrier is one of {CARRIERS}")


@dataclass(frozen=True)
class Send:
    peer: int
    staging: object  # this carrier's staging buffer (carrier.staging)
    offset: int      # bytes into it
    nbytes: int


@dataclass(frozen=True)
class Recv:
    peer: int
    dst: int          # a local device address
    nbytes: int
    staging: object   # the staging buffer the peer's matching send reads from (the same on every rank)
    peer_offset: int  # where that send's bytes start in the peer's staging


class LocalStaging:
    """A send-side staging buffer of the NCCL carrier: plain device memory, no peer mapping."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._mem = cupy.cuda.alloc(max(1, nbytes))
        self.ptr = self._mem.ptr


class NcclCarrier:
    """The production carrier: one ncclGroupStart/End of ncclSend/ncclRecv on the stream."""

    name = "nccl"
    trace = None  # CarrierTrace with EPSERVE_OFFNODE_TRACE

    def __init__(self, nccl_comm, group=None):
        self.comm, self.group = nccl_comm, group

    def staging(self, nbytes: int) -> LocalStaging:
        return LocalStaging(nbytes)

    def node_staging(self, nbytes: int):
        """Collective: staging that this node's ranks also store into (CUDA IPC inside the node;
        EPSERVE_OFFNODE_ROUTE=relay's combine relay area)."""
        return self.group.allocate(max(16, nbytes))

    def exchange(self, sends, recvs, status=None) -> None:
        from cupy.cuda import nccl

        if self.trace is not None:
            self.trace.group(sends, recvs)
        stream = cupy.cuda.get_current_stream().ptr
        nccl.groupStart()
        try:
            for s in sends:
                self.comm.send(s.staging.ptr + s.offset, s.nbytes, nccl.NCCL_UINT8, s.peer, stream)
            for r in recvs:
                self.comm.recv(r.dst, r.nbytes, nccl.NCCL_UINT8, r.peer, stream)
        finally:
            nccl.groupEnd()

    def abort(self) -> None:
        """Ends NCCL's kernels that wait for a peer that will never come (close(), bounded)."""
        abort = getattr(self.comm, "abort", None)  # ncclCommAbort
        if abort is not None:
            abort()


CARRIER_RECV = np.dtype([("peer", np.uint64), ("src", np.uint64), ("dst", np.uint64), ("bytes", np.uint64)])
_FLAG_BYTES = 2 * MAX_WORLD * 8  # posted[MAX_WORLD], taken[MAX_WORLD] (cuda/comm/staging.cu)
_IPC_BLOCKS, _IPC_THREADS = 32, 256
_MAX_GROUPS = 64  # device tables of groups kept; a cleared table's memory returns to the stream-ordered pool


class IpcTestCarrier:
    """The TEST carrier: imitates NCCL's grouped send/recv over CUDA IPC (ranks on one
    machine, typically sharing one GPU). Not a transport for real nodes."""

    name = "ipc"
    trace = None  # CarrierTrace with EPSERVE_OFFNODE_TRACE

    def __init__(self, group, error_ptr: int, timeout_ns: int):
        self.group, self.rank = group, group.rank
        self.error_ptr, self.timeout_ns = error_ptr, timeout_ns
        self._flags = group.allocate(_FLAG_BYTES, every_rank=True)
        self._flags.view(np.uint8, (_FLAG_BYTES,)).fill(0)
        self._flag_blocks = cupy.asarray(np.array(self._flags.peer_ptrs, np.uint64))
        self._local = cupy.zeros(2 * MAX_WORLD, np.uint64)  # sent[d], consumed[s]
        self._done = cupy.zeros(1, np.uint32)
        self._groups = {}  # (sends, recvs) -> the device tables of that group
        cupy.cuda.runtime.deviceSynchronize()
        group.comm.Barrier()  # every flag block is zero before anyone posts into it

    def staging(self, nbytes: int):
        """Collective: staging mapped into every rank (the receivers copy from it)."""
        return self.group.allocate(max(16, nbytes), every_rank=True)

    def node_staging(self, nbytes: int):
        """Collective: staging this node's ranks store into too (this carrier's maps every rank)."""
        return self.staging(nbytes)

    def _tables(self, sends, recvs):
        key = (tuple(sends), tuple(recvs))
        tables = self._groups.get(key)
        if tables is None:
            if len(self._groups) >= _MAX_GROUPS:  # sized groups (EPSERVE_OFFNODE_SIZES=host) change every call
                self._groups.clear()
            send_peers = sorted({s.peer for s in sends})
            recv_peers = sorted({r.peer for r in recvs})
            items = np.zeros(max(1, len(recvs)), CARRIER_RECV)
            for i, r in enumerate(recvs):
                items[i] = (r.peer, r.staging.peer_ptr(r.peer) + r.peer_offset, r.dst, r.nbytes)
            tables = self._groups[key] = (
                cupy.asarray(np.array(send_peers or [0], np.int32)), len(send_peers),
                cupy.asarray(np.array(recv_peers or [0], np.int32)), len(recv_peers),
                cupy.asarray(items.view(np.uint64)), len(recvs))
        return tables

    def exchange(self, sends, recvs, status=None) -> None:
        from epserve.runtime import kernels

        if self.trace is not None:
            self.trace.group(sends, recvs)
        send_peers, n_send, recv_peers, n_recv_peers, items, n_recv = self._tables(sends, recvs)
        fn = kernels.function("staging", "epserve_ipc_carrier_exchange")
        fn((_IPC_BLOCKS,), (_IPC_THREADS,),
           (self._flag_blocks, send_peers, np.int32(n_send), recv_peers, np.int32(n_recv_peers), items,
            np.int32(n_recv), self._local, np.int32(self.rank), np.uint64(self.timeout_ns),
            np.uint64(self.error_ptr), status if status is not None else np.uint64(0), self._done))

    def abort(self) -> None:
        """Nothing to end: every wait of this carrier is bounded."""


def make_carrier(name: str, *, group, nccl_comm, shared_gpu: bool, hosts_differ: bool, error_ptr: int,
                 timeout_ns: int):
    """The carrier `name` for this job; raises ConfigError (alike on every rank: its inputs are
    agreed) when it cannot run here."""
    if name == "nccl":
        if shared_gpu or nccl_comm is None:
            raise ConfigError(f"{CARRIER_ENV}=nccl: NCCL cannot run between ranks that share a GPU; on one GPU, "
                              f"{CARRIER_ENV}=ipc is the test carrier that imitates the network over CUDA IPC")
        carrier = NcclCarrier(nccl_comm, group)
    elif hosts_differ:
        raise ConfigError(f"{CARRIER_ENV}=ipc is a test carrier over CUDA IPC: it cannot reach ranks on other "
                          "hosts; use nccl")
    else:
        carrier = IpcTestCarrier(group, error_ptr, timeout_ns)
    carrier.trace = CarrierTrace.open(group, carrier)
    return carrier
