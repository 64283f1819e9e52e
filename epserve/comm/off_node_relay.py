"""Across nodes through the rail peer (issue 15's hierarchical transfer; docs/design.md, "Across
nodes", "Relay through the rail peer"), opt-in with EPSERVE_OFFNODE_ROUTE=relay (agreed at setup
like the carrier; ignored on one node).

The first version (route "direct") sends each off-node rank its rows: W - R carrier peers per
rank and a transfer per pair of ranks. The relay, as DeepEP's internode kernels do, pairs the
ranks of the same local index on two nodes (a *rail*): rank r = a R + l talks over the network
only to the ranks b R + l, one transfer per node pair and rail, and the node's NVLink does the
rest.

    dispatch  count + publish     unchanged (the count row into the staging row too)
              carrier             this rank's count row to its rail peer on every other node;
                                  theirs into this rank's count table at their rows
              relay count rows    each rail source's row into every node rank's table (IPC),
                                  counted in their count_arrive, as an on-node publish is
              rank + layout, move unchanged
              carrier             to each rail peer, this rank's R staging blocks for that
                                  node's ranks (consecutive: one transfer); theirs for this
                                  node into the relay area
              relay token blocks  each block's routed rows (the count row's size) and routing
                                  into its rank's token regions at the source's block (IPC),
                                  counted in its relay counters
              wait, expand        every other node's source relayed to this rank (bounded),
                                  then the off-node expand as before
    combine   GEMM 2 / IPC push   unchanged: rows of off-node homes into the combine staging
              relay combine rows  each such row into the combine relay area of its home's rail
                                  peer on this node (IPC), block (home's node, this owner),
                                  the same slot; counted there
              wait, carrier       the node's owners have relayed (bounded); then to each rail
                                  home, its R owners' blocks (one transfer), and from each rail
                                  peer of another node, that node's R blocks for this rank
                                  into the landing blocks of their owners (consecutive)
              land, reduction     unchanged

The same bytes in the same slots of the same buffers as the direct route, so the same bits
(fused == unfused == the one-node run). The network still carries whole capacity blocks
(EPSERVE_OFFNODE_SIZES=host and EPSERVE_OFFNODE_OVERLAP=1 are refused with the relay in this
version); the NVLink forwarding moves the routed rows only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import cupy
import numpy as np

from epserve.comm import signals as sig
from epserve.comm.carriers import Recv, Send
from epserve.errors import ConfigError
from epserve.runtime import kernels
from epserve.runtime.kernel_structs import i32, u64

ROUTE_ENV = "EPSERVE_OFFNODE_ROUTE"
ROUTES = ("direct", "relay")
RELAY_THREADS = 256  # cuda/comm/off_node_relay.cu kRelayThreads


def route_name() -> str:
    """EPSERVE_OFFNODE_ROUTE, "direct" when unset or empty."""
    name = os.environ.get(ROUTE_ENV, "").strip().lower() or "direct"
    if name not in ROUTES:
        raise ConfigError(f"{ROUTE_ENV}={name!r}: the off-node route is one of {ROUTES}")
    return name


def agree_route(comm, nodes: int, sizes: str | None, overlap: int | None) -> str | None:
    """Collective, at setup, before any CUDA call: None on one node, else the route
    EPSERVE_OFFNODE_ROUTE names, the same on every rank, or ConfigError on every rank (also
    when the relay meets a setting it does not serve yet; those settings are agreed already,
    so every rank refuses alike)."""
    from epserve.comm.mpi import agree_choice

    if nodes == 1:
        return None
    route = agree_choice(comm, route_name, ROUTE_ENV, "off-node routes")
    if route == "relay" and (sizes == "host" or overlap is not None):
        raise ConfigError(f"{ROUTE_ENV}=relay serves the capacity blocks with the send after GEMM 2 only, so far: "
                          "unset EPSERVE_OFFNODE_SIZES and EPSERVE_OFFNODE_OVERLAP, or use the direct route")
    return route


@dataclass(frozen=True)
class RelayPlan:
    """The rails, the relay areas and the carrier's groups of one rank: pure arithmetic on an
    OffNodePlan, the same on every rank (tests/cpu/test_off_node_relay.py)."""

    off: object  # epserve.comm.off_node.OffNodePlan

    @property
    def R(self) -> int:
        return self.off.R

    @property
    def node(self) -> int:
        return self.off.rank // self.R

    @property
    def local(self) -> int:
        return self.off.rank % self.R

    @property
    def other_nodes(self) -> list[int]:
        return [c for c in range(self.off.world // self.R) if c != self.node]

    @staticmethod
    def other_index(c: int, a: int) -> int:
        """Node c's index among the nodes other than node a (off_node_relay.cu other_node_index)."""
        return c if c < a else c - 1

    def rail(self, c: int) -> int:
        """This rank's rail peer on node c: the rank of its local index there."""
        return c * self.R + self.local

    @property
    def block_bytes(self) -> int:
        """One dispatch staging block: token rows, then their routing (OffNodePlan's stride)."""
        return self.off.tokens_offset(1) - self.off.tokens_offset(0)

    @property
    def dispatch_relay_bytes(self) -> int:
        """The relay area: R blocks from the rail source of each other node."""
        return len(self.other_nodes) * self.R * self.block_bytes

    @property
    def combine_relay_bytes(self) -> int:
        """The combine relay area: for each other node's rail home, R owners' recv copies."""
        return len(self.other_nodes) * self.R * self.off.combine_block_bytes

    def count_group(self, staging, count_table: int):
        """This rank's count row to its rail peer on every other node; theirs into the count
        table at their rows."""
        n = self.off.count_row_ints * 4
        sends = [Send(self.rail(c), staging, 0, n) for c in self.other_nodes]
        recvs = [Recv(self.rail(c), count_table + self.rail(c) * n, n, staging, 0) for c in self.other_nodes]
        return sends, recvs

    def rows_group(self, staging, relay_area: int):
        """To each rail peer, this rank's staging blocks of that node's R ranks (consecutive in
        the staging: one transfer); from each, its blocks for this node's ranks into the relay
        area at (its node's index) * R."""
        p, nbytes = self.off, self.R * self.block_bytes
        first_rank = self.node * self.R  # the blocks a rail source holds for this node start at its block of this rank
        sends = [Send(self.rail(c), staging, p.tokens_offset(p.block(c * self.R)), nbytes) for c in self.other_nodes]
        recvs = [Recv(self.rail(c), relay_area + self.other_index(c, self.node) * nbytes, nbytes, staging,
                      p.tokens_offset(p.block_of(self.rail(c), first_rank)))
                 for c in self.other_nodes]
        return sends, recvs

    def combine_group(self, relay_staging, landing: int):
        """To each rail home (this rank's rail peer on another node), the R owners' blocks this
        rank relays for it; from the rail peer of each other node, that node's R owners' blocks
        for this rank into their landing blocks (consecutive, in owner order)."""
        p, nbytes = self.off, self.R * self.off.combine_block_bytes
        sends = [Send(self.rail(c), relay_staging, self.other_index(c, self.node) * nbytes, nbytes)
                 for c in self.other_nodes]
        recvs = [Recv(self.rail(c), landing + p.block(c * self.R) * p.combine_block_bytes, nbytes, relay_staging,
                      self.other_index(self.node, c) * nbytes)
                 for c in self.other_nodes]
        return sends, recvs


class Relay:
    """One rank's relay state: the relay areas, the counters the node's ranks count into, and
    the launches around the carrier. Made collectively at setup by OffNode (same order on every
    rank)."""

    def __init__(self, off, group):
        self.off, self.plan = off, RelayPlan(off.plan)
        W, node = off.world, group.node_ranks
        self._dispatch_area = cupy.cuda.alloc(max(16, self.plan.dispatch_relay_bytes))
        # the combine relay area: the carrier's send side and written by this node's ranks
        self._combine_area = off.carrier.node_staging(self.plan.combine_relay_bytes)
        # counters [2][W] u64, by rank: dispatch rows relayed to this rank by source; combine
        # rows relayed to this rank by owner (only these kernels write them; they only grow)
        self._counters = group.allocate(2 * W * 8)
        self._counters.view(np.uint64, (2 * W,)).fill(0)
        self._dispatch_arrive = cupy.asarray(np.array([self._counters.peer_ptr(d) for d in node], np.uint64))
        self._combine_arrive = cupy.asarray(np.array([self._counters.peer_ptr(d) + W * 8 for d in node], np.uint64))
        self._combine_areas = cupy.asarray(np.array([self._combine_area.peer_ptr(d) for d in node], np.uint64))
        self._epochs = cupy.zeros(2, np.uint64)  # local: relayed dispatches, relayed combines
        self._done = cupy.zeros(2, np.uint32)     # the two copy kernels' last-block counters
        self._sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._groups = {}
        cupy.cuda.runtime.deviceSynchronize()
        group.comm.Barrier()  # every counter is zero before any rank counts into it

    def _group(self, key, make):
        if key not in self._groups:
            self._groups[key] = make()
        return self._groups[key]

    def exchange_counts(self, staging, count_table: int, cfg) -> None:
        """After count + publish: the count rows along the rails, then into the node's tables."""
        self.off.carrier.exchange(*self._group(("counts", count_table),
                                               lambda: self.plan.count_group(staging, count_table)))
        kernels.function("off_node_relay", "epserve_relay_count_rows")((1,), (RELAY_THREADS,), (cfg,))

    def exchange_rows(self, staging, cfg, status, expert_offsets, experts_per_rank: int) -> None:
        """After the move: the token blocks along the rails, into the node's token regions, and
        this rank's wait for every other node's rows (before the off-node expand)."""
        area = int(self._dispatch_area.ptr)
        self.off.carrier.exchange(*self._group(("rows", area), lambda: self.plan.rows_group(staging, area)),
                                  status=status)
        fn = kernels.function("off_node_relay", "epserve_relay_token_blocks")
        fn((self._sms,), (RELAY_THREADS,), (cfg, u64(area), np.int64(self.plan.block_bytes), self._dispatch_arrive,
                                            self._done[0:1]))
        fn = kernels.function("off_node_relay", "epserve_relay_rows_wait")
        fn((1,), (32,), (cfg, u64(self._counters.ptr), self._epochs, expert_offsets, i32(experts_per_rank)))

    def exchange_combine(self, send_cfg, expert_offsets, experts_per_rank: int, landing: int, status) -> None:
        """After GEMM 2 (or the IPC push): the staged off-node rows into their rail peers' relay
        areas, the wait for this node's owners, then the relay areas along the rails into the
        landing blocks. expert_offsets None: a rank standing in, with no rows."""
        off = self.off
        fn = kernels.function("off_node_relay", "epserve_relay_combine_rows")
        fn((2 * self._sms,), (RELAY_THREADS,), (send_cfg, expert_offsets if expert_offsets is not None else u64(0),
                                                 i32(experts_per_rank), self._combine_areas, self._combine_arrive,
                                                 self._done[1:2]))
        fn = kernels.function("off_node_relay", "epserve_relay_combine_wait")
        fn((1,), (32,), (u64(self._counters.ptr + off.world * 8), self._epochs, i32(off.plan.layout.node_of(
            off.rank) * off.plan.R), i32(off.plan.R), u64(off.timeout_ns), u64(off.signals.local(sig.ERROR)),
            status if status is not None else u64(0)))
        off.carrier.exchange(*self._group(("combine", landing),
                                          lambda: self.plan.combine_group(self._combine_area, landing)),
                             status=status)

