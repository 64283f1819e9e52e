"""The per-rank signal block (one symmetric buffer) and the device error record.

Layout: six arrays of S = max(8, world) slots of 8 bytes each (at most 128 ranks: 6 KiB);
the per-rank arrays are indexed by rank, so a wait that runs out can name the rank it was
waiting for:
    0 S    arrive           u64[S]    64-column units of combine rows that reached this rank's recv, by sender
    1 S    count_arrive     u64[S]    dispatch count rows that reached this rank's table, by sender
    2 S    ready            u64[S]    ready[d]: combines rank d (of this node) has finished reading (d writes it)
    3 S    dispatch_ready   u64[S]    dispatch_ready[d]: dispatches rank d (of this node) has consumed
    4 S    expected         u64[S]    local: combine units promised so far, by sender
    5 S    error            int32[4]  local: code, peer, detail (cuda/common/errors.cuh), in 64 bytes
Up to 8 ranks that is the layout of one node as it always was (offsets 0, 64, ..., 320; 384
bytes). The constants below name the arrays; local() and peer() give their addresses.
The direct dispatch's token rows are counted per chunk, in a buffer of the dispatcher
(epserve/dispatch/direct.py), not here. Counters only grow (docs/design.md, "Signalling and
epochs"): nothing is reset between calls, so nothing races with a reset.
"""

from __future__ import annotations

import cupy
import numpy as np

from epserve.errors import ConfigError, EPServeError, PeerTimeoutError, RankFailedError
from epserve.runtime.kernel_structs import MAX_PEERS, MAX_WORLD

ARRIVE, COUNT_ARRIVE, READY, DISPATCH_READY, EXPECTED, ERROR = range(6)  # the arrays, in layout order
_ERROR_BYTES = 64


def slots(world: int) -> int:
    """Slots of each per-rank array: one per rank, never fewer than one node's."""
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"a signal block serves 1 to {MAX_WORLD} ranks, not {world}")
    return max(MAX_PEERS, world)


def offset(array: int, world: int) -> int:
    """Byte offset of `array` (ARRIVE ... ERROR) in the signal block of a `world`-rank job."""
    return array * slots(world) * 8


def size(world: int) -> int:
    """Bytes of the signal block of a `world`-rank job."""
    return offset(ERROR, world) + _ERROR_BYTES


SIZE = size(1)  # one node's block (up to 8 ranks)

_CODES = {
    1: ("combine-wait", PeerTimeoutError,
        "the combine waited for rows from rank {peer} that never arrived ({detail} 64-column units missing): rank "
        "{peer} is dead, stuck or slower than wait_timeout_s"),
    2: ("peer-ready-wait", PeerTimeoutError,
        "a sender waited for rank {peer} to release its recv buffer for combine #{detail}, in vain: rank {peer} is "
        "dead, stuck or slower than wait_timeout_s"),
    3: ("peer-send", ConfigError,
        "a dispatched row's src_info ({detail:#x}) names a rank, token or slot out of range; the row was not sent"),
    4: ("dispatch-route", ConfigError, "topk_idx of token {peer} holds expert id {detail}, outside [-1, num_experts)"),
    5: ("dispatch-ready-wait", PeerTimeoutError,
        "waited for rank {peer} to release its dispatch buffers for dispatch #{detail}, in vain: rank {peer} is "
        "dead, stuck or slower than wait_timeout_s"),
    6: ("dispatch-count-wait", PeerTimeoutError,
        "the dispatch count row of rank {peer} never arrived (dispatch #{detail}): rank {peer} is dead, stuck or "
        "slower than wait_timeout_s"),
    7: ("dispatch-token-wait", PeerTimeoutError,
        "token rows promised by rank {peer} never arrived (dispatch #{detail}): rank {peer} is dead, stuck or "
        "slower than wait_timeout_s"),
    # The dispatch verdict (cuda/comm/dispatch.cu), the same on every rank; no row moved.
    8: ("dispatch-verdict", RankFailedError,
        "rank {peer} rejected its input (its own error says why); the call was stopped before any row moved"),
    9: ("dispatch-verdict", RankFailedError,
        "rank {peer} routed to expert ids outside [-1, num_experts); the call was stopped before any row moved"),
    10: ("dispatch-verdict", ConfigError,
         "rank {peer} would receive {detail} expert rows, more than MoEConfig.max_recv_rows allows; the call was "
         "stopped before any row moved"),
    11: ("off-node-carrier", PeerTimeoutError,
         "the off-node test carrier (EPSERVE_OFFNODE_CARRIER=ipc) waited for rank {peer} to "
         "{detail_text}, in vain: rank {peer} is dead, stuck or slower than wait_timeout_s"),
    # EPSERVE_OFFNODE_OVERLAP=1 (cuda/comm/off_node_overlap.cu): the side stream's wait for GEMM 2
    12: ("off-node-send", PeerTimeoutError,
         "the off-node send waited for GEMM 2 to stage its rows for rank {peer}, in vain ({detail} 64-column "
         "units missing): GEMM 2 is stuck, or slower than twice wait_timeout_s"),
    # EPSERVE_OFFNODE_ROUTE=relay (cuda/comm/off_node_relay.cu): rows forwarded by a node's rank
    13: ("off-node-relay", PeerTimeoutError,
         "waited for {detail_text} of rank {peer}, in vain: rank {peer}, or the rank of this node that relays "
         "for it, is dead, stuck or slower than wait_timeout_s"),
    # Across nodes, the stamp that ends each carrier transfer (cuda/comm/staging.cu, epserve/comm/off_node_stamps.py)
    # A sender fails before it sends only when one of its waits ran out, after which no service
    # can go on (PeerTimeoutError: the service is lost, as the sender's is).
    14: ("off-node-stale", PeerTimeoutError,
         "the {detail_text} rank {peer} sent across nodes in this call are not valid: one of rank {peer}'s waits "
         "ran out in this call before it sent them (its own error names the rank it waited for), or it is a "
         "call behind"),
}
_DETAIL_TEXT = {11: ("post its rows", "take the rows posted to it"),
                13: ("the dispatch rows (relayed by this node's rank of its local index)",
                     "the combine rows to relay"),
                14: ("token rows", "combine rows")}


class SignalBlock:
    """Views of one rank's signal block, and the peers' addresses of theirs."""

    @classmethod
    def create(cls, group) -> "SignalBlock":
        """Collective: allocates and zeroes every rank's block; returns once all are zeroed,
        so nobody signals into a block that is still being cleared."""
        block = cls(group.allocate(size(group.world)), group.world)
        cupy.cuda.runtime.deviceSynchronize()
        group.comm.Barrier()
        return block

    def __init__(self, buffer, world: int):
        self.buffer, self.world = buffer, world
        self.buffer.view(np.uint8, (size(world),)).fill(0)
        self.error = buffer.view(np.int32, (4,), offset(ERROR, world))
        self._error_ptr = self.error.data.ptr
        self._pinned = None  # pinned host memory for raise_pending's copy, and its int32 view
        self._host = None

    def peer(self, d: int, array: int) -> int:
        """Rank d's `array` (one of the layout constants), as mapped here (d on this node)."""
        return self.buffer.peer_ptr(d) + offset(array, self.world)

    def local(self, array: int) -> int:
        """This rank's `array`."""
        return self.buffer.ptr + offset(array, self.world)

    def raise_if_error(self, rank: int) -> None:
        """Synchronizes the device, then turns a device error record into an exception."""
        cupy.cuda.runtime.deviceSynchronize()
        self._raise(rank, cupy.asnumpy(self.error))

    def raise_pending(self, rank: int) -> None:
        """The same for the work queued so far on the current stream, with one host wait: the
        record is copied behind that work into pinned memory, and the stream is awaited."""
        if self._pinned is None:
            self._pinned = cupy.cuda.alloc_pinned_memory(16)
            self._host = np.frombuffer(self._pinned, np.int32, 4)
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(self._pinned.ptr, self._error_ptr, 16, cupy.cuda.runtime.memcpyDeviceToHost,
                                      stream.ptr)
        stream.synchronize()
        if self._host[0] != 0:
            self._raise(rank, self._host.copy())

    def raise_pending_or(self, rank: int, own_error: BaseException | None) -> None:
        """raise_pending for a call this rank took part in with its own input rejected
        (own_error) or not: the rank's own error wins over the call's record (which then only
        says that this rank rejected its input); without one, the record is raised."""
        try:
            self.raise_pending(rank)
        except EPServeError:
            if own_error is None:
                raise
        if own_error is not None:
            raise own_error

    def _raise(self, rank: int, record) -> None:
        code, peer, detail, _ = (int(v) for v in record)
        if code == 0:
            return
        self.error.fill(0)  # reported once; a bad input leaves the service usable
        raise error_from_record(rank, code, peer, detail)


def error_from_record(rank: int, code: int, peer: int, detail: int) -> EPServeError:
    """The exception a device error record (code, peer, detail) stands for, naming the stage."""
    stage, cls, text = _CODES.get(code, ("unknown", EPServeError, "device error code {code}"))
    words = _DETAIL_TEXT.get(code, ())
    detail_text = words[detail] if 0 <= detail < len(words) else str(detail)
    message = text.format(peer=peer, detail=detail, code=code, detail_text=detail_text)
    exc = cls(f"rank {rank}: stage {stage}: " + message)
    if cls is RankFailedError:
        exc.stage, exc.failures = stage, {peer: message}
    return exc
