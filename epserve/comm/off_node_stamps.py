"""Stamps on the off-node transfers (docs/design.md, "Across nodes", "What a failed sender
sends"): the carrier moves bytes and says nothing about them. A rank whose call failed before
it staged its rows (one of its waits ran out) still makes its carrier groups, since its peers
are making theirs, and would send them an earlier call's rows, which they would use without
an error. So each token-row group and each combine group ends, for every peer, with a
16-byte stamp: {this call's number of that kind, 1 if what the sender sends is valid}. After
the group, a check fails the receiver's call (code 14, `off-node-stale`, naming the sender)
when a peer's stamp is not this call's or says its rows are not valid.

    kind      sender's "valid"                         checked where
    ROWS      its call did not fail before the send    after the token-row group (both routes;
                                                       the relay's rank then relays nothing)
    COMBINE   its call did not fail before the send;   after each combine group, before the land
              with the relay, every owner of its node
              relayed its rows in time

The calls are counted per kind, by each rank on its own, one per call and kind (stopped calls
included): every rank makes the same groups in the same order, so the counts agree. A call
the verdict stopped checks nothing (nothing that came is read).
"""

from __future__ import annotations

import cupy
import numpy as np

from epserve.comm import signals as sig
from epserve.comm.carriers import Recv, Send
from epserve.runtime import kernels
from epserve.runtime.kernel_structs import i32, u64

ROWS, COMBINE = 0, 1
KINDS = 2
STAMP_BYTES = 16


class CallStamps:
    """One rank's stamps: what it sends (in carrier staging), what lands (by kind and sender),
    and the count of calls of each kind."""

    def __init__(self, carrier, world: int, signals):
        self.world, self.signals = world, signals
        self.out = carrier.staging(KINDS * STAMP_BYTES)
        self._landed = cupy.zeros((KINDS, world, 2), np.uint64)
        self._calls = cupy.zeros(KINDS, np.uint64)
        # the per-kind views the launches take, made once (not per call)
        self._landed_of = [self._landed[k] for k in range(KINDS)]
        self._calls_of = [self._calls[k:k + 1] for k in range(KINDS)]
        self._peer_lists = {}

    def transfers(self, kind: int, peers) -> tuple[list, list]:
        """The stamp's sends to and receives from `peers` (to end a group with: listed after the
        group's other transfers, so they are the last of each pair of ranks on both ends)."""
        off = kind * STAMP_BYTES
        landed = int(self._landed.data.ptr) + kind * self.world * STAMP_BYTES
        return ([Send(d, self.out, off, STAMP_BYTES) for d in peers],
                [Recv(s, landed + s * STAMP_BYTES, STAMP_BYTES, self.out, off) for s in peers])

    def with_stamps(self, kind: int, sends, recvs, peers) -> tuple[list, list]:
        """A group (sends, recvs) ending with the stamps to and from `peers`."""
        s, r = self.transfers(kind, peers)
        return list(sends) + s, list(recvs) + r

    def senders(self, recvs) -> list[int]:
        """The peers whose stamps a group (with_stamps') receives."""
        return [r.peer for r in recvs if r.staging is self.out]

    def stamp(self, kind: int, valid) -> None:
        """Before the group: this rank's stamp of this call (valid: an int[2] call status, or
        None for always valid)."""
        fn = kernels.function("staging", "epserve_off_node_stamp")
        fn((1,), (1,), (u64(int(self.out.ptr) + kind * STAMP_BYTES), self._calls_of[kind],
                        valid if valid is not None else u64(0)))

    def check(self, kind: int, recvs, status, advance: bool) -> None:
        """After the group: each sender's stamp is this call's and valid, else this call fails
        (status None: a rank standing in; the error record is still written). advance: the
        call's last group of this kind."""
        peers = tuple(self.senders(recvs))
        fn = kernels.function("staging", "epserve_off_node_stamps_check")
        fn((1,), (32,), (self._landed_of[kind], self._peer_array(peers), i32(len(peers)), self._calls_of[kind],
                         i32(1 if advance else 0), i32(kind), u64(self.signals.local(sig.ERROR)),
                         status if status is not None else u64(0)))

    def _peer_array(self, peers: tuple):
        """The peers as a device int32 array, made once per list."""
        if peers not in self._peer_lists:
            self._peer_lists[peers] = cupy.asarray(np.array(peers or (0,), np.int32))
        return self._peer_lists[peers]

    def exchange(self, carrier, kind: int, sends, recvs, status, valid, advance: bool = True) -> None:
        """stamp, the group (made with with_stamps) on the carrier, check."""
        self.stamp(kind, valid)
        carrier.exchange(sends, recvs, status=status)
        self.check(kind, recvs, status, advance)
