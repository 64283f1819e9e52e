"""Symmetric device buffers: the same size on every rank, allocated with plain cudaMalloc
(not CuPy's pool, whose IPC handles name the pool chunk's base) and mapped into every peer
through CUDA IPC (docs/design.md, "IPC lifetime").

A PeerGroup owns its buffers and tears them down in the order the design fixes:
synchronize, close the peers' mappings, barrier, free, barrier. Every method that talks to
other ranks is collective: all ranks call it in the same order.
"""

from __future__ import annotations

import cupy
import numpy as np

from epserve.comm.mpi import bounded_barrier, collective_verdict
from epserve.errors import EPServeError, PeerTimeoutError

_LAZY_PEER_ACCESS = getattr(cupy.cuda.runtime, "cudaIpcMemLazyEnablePeerAccess", 1)
_TAG_UNMAPPED, _TAG_FREED = 0x4550, 0x4551  # the bounded teardown's two rounds


class SymmetricBuffer:
    """One buffer of `nbytes` on every rank; `peer_ptr(d)` is rank d's buffer as seen here."""

    def __init__(self, nbytes: int, local_ptr: int, peer_ptrs: list[int], rank: int):
        self.nbytes = nbytes
        self.rank = rank
        self._ptr = local_ptr
        self._peer_ptrs = peer_ptrs
        owner = self  # keeps the allocation reachable while views exist
        mem = cupy.cuda.UnownedMemory(local_ptr, nbytes, owner)
        self._memptr = cupy.cuda.MemoryPointer(mem, 0)

    @property
    def ptr(self) -> int:
        return self._ptr

    def peer_ptr(self, rank: int) -> int:
        return self._peer_ptrs[rank]

    @property
    def peer_ptrs(self) -> list[int]:
        return list(self._peer_ptrs)

    def view(self, dtype, shape, offset: int = 0) -> cupy.ndarray:
        """A CuPy array over this rank's buffer (no copy)."""
        dtype = np.dtype(dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        if offset < 0 or offset + size > self.nbytes:
            raise ValueError(f"view of {size} bytes at {offset} exceeds the {self.nbytes}-byte buffer")
        return cupy.ndarray(shape, dtype, self._memptr + offset)


class PeerGroup:
    """The symmetric buffers of one communicator, and their orderly teardown. With a node
    layout (epserve/comm/topology.py), only the peers of this rank's node are mapped: a
    buffer's peer_ptr is 0 for a rank of another node (CUDA IPC does not cross nodes;
    docs/design.md, "Across nodes"), unless allocate is asked to reach every rank (the IPC
    test carrier alone, where the "nodes" are played on one machine)."""

    def __init__(self, comm, layout=None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world = comm.Get_size()
        self.layout = layout
        self.buffers: list[SymmetricBuffer] = []
        self._opened: list[int] = []  # peers' mappings, closed before anything is freed
        self._closed = False

    @property
    def node_ranks(self) -> range:
        """The ranks of this rank's node (every rank without a layout): those the kernel
        structs' address tables hold, at index d - node_ranks.start (common/nodes.cuh)."""
        if self.layout is None:
            return range(self.world)
        return self.layout.node_ranks(self.layout.node_of(self.rank))

    def node_table(self, addresses) -> list[int]:
        """Addresses by rank (a list of `world`) -> the kernel structs' table: this node's ranks',
        by local index."""
        return [addresses[d] for d in self.node_ranks]

    def reaches(self, d: int) -> bool:
        """Whether this rank maps rank d's buffers (d is on this rank's node)."""
        return self.layout is None or self.layout.same_node(self.rank, d)

    def allocate(self, nbytes: int, every_rank: bool = False) -> SymmetricBuffer:
        """Collective: every rank must ask for the same size. every_rank: map the buffers of
        the ranks of other nodes too (only the IPC test carrier, on one machine)."""
        sizes = self.comm.allgather(int(nbytes))
        if len(set(sizes)) != 1:
            raise EPServeError(f"symmetric buffer sizes differ between ranks: {sizes}")
        rt = cupy.cuda.runtime
        ptr, handle, error = 0, None, None
        try:
            ptr = rt.malloc(nbytes)
            handle = bytes(rt.ipcGetMemHandle(ptr))
        except Exception as exc:  # out of memory on one rank: every rank must hear of it
            error = exc
        try:
            collective_verdict(self.comm, f"allocating a {nbytes}-byte symmetric buffer", error)
        except BaseException:
            if ptr:
                rt.free(ptr)
            raise
        handles = self.comm.allgather(handle)
        peer_ptrs = []
        for d, h in enumerate(handles):
            if d == self.rank:  # never open one's own handle
                peer_ptrs.append(ptr)
                continue
            if not (every_rank or self.reaches(d)):  # another node: no IPC mapping
                peer_ptrs.append(0)
                continue
            mapped = rt.ipcOpenMemHandle(h, _LAZY_PEER_ACCESS)
            self._opened.append(mapped)
            peer_ptrs.append(mapped)
        buf = SymmetricBuffer(nbytes, ptr, peer_ptrs, self.rank)
        self.buffers.append(buf)
        return buf

    def close(self, timeout_s: float | None = None) -> None:
        """Collective teardown; safe to call twice. With timeout_s, each of its two barriers
        gives up after that long and raises PeerTimeoutError naming the ranks that never came;
        when that happens before the free, this rank's buffers stay allocated, since a peer
        that never unmapped them may still write into them."""
        if self._closed:
            return
        self._closed = True
        rt = cupy.cuda.runtime
        rt.deviceSynchronize()  # every kernel's waits are bounded, so this is too
        for mapped in self._opened:
            rt.ipcCloseMemHandle(mapped)
        self._opened.clear()
        self._barrier(timeout_s, _TAG_UNMAPPED, "close-unmap-wait", leak=True)  # nobody frees what a peer maps
        for buf in self.buffers:
            rt.free(buf.ptr)
        self.buffers.clear()
        self._barrier(timeout_s, _TAG_FREED, "close-free-wait", leak=False)

    def _barrier(self, timeout_s, tag, stage, leak):
        if timeout_s is None:
            self.comm.Barrier()
            return
        missing = bounded_barrier(self.comm, timeout_s, tag)
        if not missing:
            return
        if leak:
            self.buffers.clear()
        raise PeerTimeoutError(
            f"rank {self.rank}: stage {stage}: rank(s) {', '.join(map(str, missing))} did not reach the teardown "
            f"within {timeout_s:g} s (dead, stuck, or still busy)"
            + ("; this rank's symmetric buffers were left allocated, since they may still be mapped there"
               if leak else ""))
