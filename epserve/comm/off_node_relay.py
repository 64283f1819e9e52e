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
(fused == unfused == the one-node run). By default the network carries whole capacity blocks;
with EPSERVE_OFFNODE_SIZES=host (the count rows read on the host once per dispatch) each rail
transfer carries its R blocks' routed rows only (R messages to the one peer; relay_sizes) and
the combine returns compact blocks. The NVLink forwarding moves the routed rows either way.
With EPSERVE_OFFNODE_OVERLAP=1 (epserve/comm/off_node_overlap.py) the combine's relay runs per
destination node on the side stream, each node's rows relayed as soon as GEMM 2 has staged them.
With EPSERVE_OFFNODE_DEDUP=1 (epserve/comm/off_node_dedup.py) the rail transfer carries each token
row once per destination node instead of once per destination rank, and the rail peer fans it
out into the same token regions.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import cupy
import numpy as np

from epserve.comm import signals as sig
from epserve.comm.carriers import Recv, Send
from epserve.comm.off_node_dedup import DedupRows
from epserve.comm.off_node_overlap import groups_by_node
from epserve.comm.off_node_sizes import clamp, count_row
from epserve.comm.off_node_stamps import COMBINE, ROWS
from epserve.comm.settings import agree_across_nodes, env_choice
from epserve.runtime import kernels
from epserve.runtime.kernel_structs import i32, u64

ROUTE_ENV = "EPSERVE_OFFNODE_ROUTE"
ROUTES = ("direct", "relay")
RELAY_THREADS = 256  # cuda/comm/off_node_relay.cu kRelayThreads


def route_name() -> str:
    """EPSERVE_OFFNODE_ROUTE, "direct" when unset or empty."""
    return env_choice(ROUTE_ENV, ROUTES, f"the off-node route is one of {ROUTES}")


def agree_route(comm, nodes: int) -> str | None:
    """Collective, at setup, before any CUDA call: None on one node, else the route
    EPSERVE_OFFNODE_ROUTE names, the same on every rank, or ConfigError on every rank."""
    return agree_across_nodes(comm, nodes, route_name, ROUTE_ENV, "off-node routes")


@dataclass(frozen=True)
class RelaySizes:
    """One call's transfer sizes of one rank on the relay route (EPSERVE_OFFNODE_SIZES=host),
    in rows. Read from this rank's own count row and its rail peers' rows only: those cross by
    the carrier, ordered on the stream before the host's copy, while the other off-node rows
    reach the table through this node's ranks at any time."""

    tokens_to: dict     # off-node rank d -> token rows this rank stages for d
    returns_from: dict  # off-node owner o -> rows o returns to this rank
    relayed_in: dict    # (rail source s, node rank d) -> token rows s sends d through this rank
    relayed_out: dict   # (rail home h, node owner o) -> rows o returns to h through this rank


def relay_sizes(table: np.ndarray, plan: "RelayPlan") -> RelaySizes:
    off = plan.off
    W, E, R = off.world, off.num_experts, plan.R
    e_loc, cap = E // W, off.max_tokens * off.top_k
    mine = count_row(table, off.rank)
    node = range(plan.node * R, (plan.node + 1) * R)
    rails = {plan.rail(c): count_row(table, plan.rail(c)) for c in plan.other_nodes}
    return RelaySizes(
        tokens_to={d: clamp(mine[E + d], off.max_tokens) for d in off.peers},
        returns_from={o: clamp(mine[o * e_loc:(o + 1) * e_loc].clip(0).sum(), cap) for o in off.peers},
        relayed_in={(s, d): clamp(row[E + d], off.max_tokens) for s, row in rails.items() for d in node},
        relayed_out={(h, o): clamp(row[o * e_loc:(o + 1) * e_loc].clip(0).sum(), cap)
                     for h, row in rails.items() for o in node})


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

    def rows_group(self, staging, relay_area: int, sizes: RelaySizes | None = None):
        """To each rail peer, this rank's staging blocks of that node's R ranks (consecutive in
        the staging: one transfer); from each, its blocks for this node's ranks into the relay
        area at (its node's index) * R. With `sizes`: per block, its routed token rows and
        their routing (at the block's start), 2 R messages to the one peer, none of zero bytes."""
        p, R, bb = self.off, self.R, self.block_bytes
        first_rank = self.node * R  # the blocks a rail source holds for this node start at its block of this rank
        sends, recvs = [], []
        for c in self.other_nodes:
            rail, area = self.rail(c), relay_area + self.other_index(c, self.node) * R * bb
            if sizes is None:
                sends.append(Send(rail, staging, p.tokens_offset(p.block(c * R)), R * bb))
                recvs.append(Recv(rail, area, R * bb, staging, p.tokens_offset(p.block_of(rail, first_rank))))
                continue
            tok_row, meta_row = p.hidden * 2, p.meta_len * 4
            for q in range(R):
                d = c * R + q  # this rank's rows for d
                n = sizes.tokens_to[d]
                sends += [Send(rail, staging, p.tokens_offset(p.block(d)), n * tok_row),
                          Send(rail, staging, p.meta_offset(p.block(d)), n * meta_row)]
                d = first_rank + q  # the rail source's rows for this node's rank q
                n, b = sizes.relayed_in[(rail, d)], p.block_of(rail, d)
                recvs += [Recv(rail, area + q * bb, n * tok_row, staging, p.tokens_offset(b)),
                          Recv(rail, area + q * bb + p.tokens_block_bytes, n * meta_row, staging, p.meta_offset(b))]
        return _without_empty(sends, recvs)

    def combine_group(self, relay_staging, landing: int, sizes: RelaySizes | None = None):
        """To each rail home (this rank's rail peer on another node), the R owners' blocks this
        rank relays for it; from the rail peer of each other node, that node's R owners' blocks
        for this rank into their landing blocks (consecutive, in owner order). With `sizes`:
        each block's compact rows (its start), R messages each way per rail, none of zero bytes."""
        p, R, cb = self.off, self.R, self.off.combine_block_bytes
        row = p.combine_hidden * 2
        sends, recvs = [], []
        for c in self.other_nodes:
            rail, mine, theirs = self.rail(c), self.other_index(c, self.node) * R, self.other_index(self.node, c) * R
            if sizes is None:
                sends.append(Send(rail, relay_staging, mine * cb, R * cb))
                recvs.append(Recv(rail, landing + p.block(c * R) * cb, R * cb, relay_staging, theirs * cb))
                continue
            for q in range(R):
                n = sizes.relayed_out[(rail, self.node * R + q)]  # owner q of this node, for the rail home
                sends.append(Send(rail, relay_staging, (mine + q) * cb, n * row))
                o = c * R + q  # owner q of node c, for this rank
                recvs.append(Recv(rail, landing + p.block(o) * cb, sizes.returns_from[o] * row, relay_staging,
                                  (theirs + q) * cb))
        return _without_empty(sends, recvs)


def _without_empty(sends, recvs):
    """A group without its transfers of zero bytes (both ends leave out the same ones)."""
    return [x for x in sends if x.nbytes], [x for x in recvs if x.nbytes]


class Relay:
    """One rank's relay state: the relay areas, the counters the node's ranks count into, and
    the launches around the carrier. Made collectively at setup by OffNode (same order on every
    rank)."""

    dedup = None  # off_node_dedup.DedupRows with EPSERVE_OFFNODE_DEDUP=1

    def __init__(self, off, group, dedup: bool = False):
        # weakly: off holds this Relay, and a cycle would leave off's carrier (the NCCL
        # communicator) to the cyclic garbage collector (tests/cpu/test_off_node_teardown.py)
        self.off, self.plan = weakref.proxy(off), RelayPlan(off.plan)
        W, node = off.world, group.node_ranks
        # with deduplication the rail peers' packed node blocks land in DedupRows' own area instead
        self._dispatch_area = cupy.cuda.alloc(max(16, 0 if dedup else self.plan.dispatch_relay_bytes))
        # the combine relay area: the carrier's send side and written by this node's ranks
        self._combine_area = off.carrier.node_staging(self.plan.combine_relay_bytes)
        # counters u64, by rank: [W] dispatch rows relayed to this rank, by source; [nodes][W]
        # combine rows relayed to this rank, by home node and owner (only these kernels write
        # them; they only grow)
        n = W + W // off.plan.R * W
        self._counters = group.allocate(n * 8)
        self._counters.view(np.uint64, (n,)).fill(0)
        self._dispatch_arrive = cupy.asarray(np.array([self._counters.peer_ptr(d) for d in node], np.uint64))
        self._combine_arrive = cupy.asarray(np.array([self._counters.peer_ptr(d) + W * 8 for d in node], np.uint64))
        self._combine_areas = cupy.asarray(np.array([self._combine_area.peer_ptr(d) for d in node], np.uint64))
        self._epochs = cupy.zeros(2, np.uint64)  # local: relayed dispatches, relayed combines
        self._done = cupy.zeros(2, np.uint32)     # the two copy kernels' last-block counters
        self._area_ok = cupy.zeros(off.plan.R, np.int32)  # the call's verdict on the node ranks' combine areas
        self._relayed = cupy.zeros(2, np.int32)  # the call's verdict on what this rank relays (a call status)
        self._sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._groups = {}
        # EPSERVE_OFFNODE_DEDUP=1: each token row once per destination node (off_node_dedup.py)
        self.dedup = DedupRows(off.carrier, self.plan) if dedup else None
        cupy.cuda.runtime.deviceSynchronize()
        group.comm.Barrier()  # every counter is zero before any rank counts into it

    def _group(self, key, make):
        if key not in self._groups:
            self._groups[key] = make()
        return self._groups[key]

    def rows_group(self, staging, sizes: RelaySizes | None = None):
        """The token blocks' group (also for launch/jobs/time_off_node.py); with deduplication the
        packed node blocks' (capacity sizes only: routed sizes are refused with it at setup)."""
        if self.dedup is not None:
            return self.dedup.rows_group()
        return self.plan.rows_group(staging, int(self._dispatch_area.ptr), sizes)

    def combine_group(self, landing: int, sizes: RelaySizes | None = None):
        """The combine's group (also for launch/jobs/time_off_node.py)."""
        return self.plan.combine_group(self._combine_area, landing, sizes)

    @property
    def rails(self) -> list[int]:
        """This rank's carrier peers: its rail peer on each other node."""
        return [self.plan.rail(c) for c in self.plan.other_nodes]

    @property
    def relayed(self):
        """The call's verdict on the combine rows this rank relays (the combine stamps' valid)."""
        return self._relayed

    def stamped_rows_group(self, staging, sizes: RelaySizes | None = None):
        """rows_group, ending with the stamps (epserve/comm/off_node_stamps.py)."""
        return self.off.stamps.with_stamps(ROWS, *self.rows_group(staging, sizes), self.rails)

    def stamped_combine_group(self, landing: int, sizes: RelaySizes | None = None):
        """combine_group, ending with the stamps."""
        return self.off.stamps.with_stamps(COMBINE, *self.combine_group(landing, sizes), self.rails)

    def exchange_counts(self, staging, count_table: int, cfg) -> None:
        """After count + publish: the count rows along the rails, then into the node's tables."""
        self.off.carrier.exchange(*self._group(("counts", count_table),
                                               lambda: self.plan.count_group(staging, count_table)))
        kernels.function("off_node_relay", "epserve_relay_count_rows")((1,), (RELAY_THREADS,), (cfg,))

    def exchange_rows(self, staging, cfg, status, expert_offsets, experts_per_rank: int,
                      sizes: RelaySizes | None = None) -> None:
        """After the move: the token blocks along the rails (whole, or with `sizes` the routed
        rows; with deduplication the packed node blocks), into the node's token regions, and this
        rank's wait for every other node's rows (before the off-node expand)."""
        area = int(self._dispatch_area.ptr)
        group = self.stamped_rows_group(staging, sizes) if sizes is not None else \
            self._group(("rows", area), lambda: self.stamped_rows_group(staging))
        if self.dedup is not None:  # each token row once per destination node, into the packed blocks
            self.dedup.pack(cfg)
        # a rail source whose rows are not this call's fails the call here: nothing is relayed,
        # and the node ranks waiting for them fail in turn (code 13)
        self.off.stamps.exchange(self.off.carrier, ROWS, *group, status=status, valid=status)
        if self.dedup is not None:
            self.dedup.relay(cfg, self._dispatch_arrive, self._done[0:1])
        else:
            fn = kernels.function("off_node_relay", "epserve_relay_token_blocks")
            fn((self._sms,), (RELAY_THREADS,), (cfg, u64(area), np.int64(self.plan.block_bytes),
                                                self._dispatch_arrive, self._done[0:1]))
        fn = kernels.function("off_node_relay", "epserve_relay_rows_wait")
        fn((1,), (32,), (cfg, u64(self._counters.ptr), self._epochs, expert_offsets, i32(experts_per_rank)))

    def relay_node(self, send_cfg, expert_offsets, experts_per_rank: int, node: int, first: bool, last: bool,
                   status) -> None:
        """The staged rows of node `node`'s homes (-1: every other node's) into their rail peers'
        relay areas, then the wait for this node's owners to have relayed theirs. `first`: the
        call's first such step (it decides, once for the call, which node ranks' areas are free);
        `last`: its last (it moves the relayed combines' count on). expert_offsets None: a rank
        standing in, with no rows."""
        off = self.off
        if first:
            fn = kernels.function("off_node_relay", "epserve_relay_combine_ready")
            fn((1,), (32,), (send_cfg, self._area_ok, self._relayed))
        fn = kernels.function("off_node_relay", "epserve_relay_combine_rows")
        fn((2 * self._sms,), (RELAY_THREADS,), (send_cfg, expert_offsets if expert_offsets is not None else u64(0),
                                                 i32(experts_per_rank), self._combine_areas, self._combine_arrive,
                                                 self._area_ok, self._done[1:2], i32(node)))
        fn = kernels.function("off_node_relay", "epserve_relay_combine_wait")
        fn((1,), (32,), (u64(self._counters.ptr + off.world * 8), self._epochs, i32(off.rank), i32(off.world),
                         i32(off.plan.R), i32(node), i32(1 if last else 0), u64(off.timeout_ns),
                         u64(off.signals.local(sig.ERROR)), status if status is not None else u64(0),
                         self._relayed))

    def exchange_combine(self, send_cfg, expert_offsets, experts_per_rank: int, landing: int, status,
                         sizes: RelaySizes | None = None, by_node: bool = False) -> None:
        """After GEMM 2 (or the IPC push): the staged off-node rows into their rail peers' relay
        areas, the wait for this node's owners, then the relay areas along the rails into the
        landing blocks (whole, or with `sizes` the compact return rows). by_node: one
        destination node after the other, as the send under GEMM 2 makes its groups (a rank
        whose combine is not under GEMM 2 then matches them). expert_offsets None: a rank
        standing in, with no rows."""
        group = self.stamped_combine_group(landing, sizes) if sizes is not None else \
            self._group(("combine", landing), lambda: self.stamped_combine_group(landing))
        stamps, carrier = self.off.stamps, self.off.carrier
        if not by_node:
            self.relay_node(send_cfg, expert_offsets, experts_per_rank, -1, True, True, status)
            stamps.exchange(carrier, COMBINE, *group, status=status, valid=self._relayed)
            return
        groups = groups_by_node(self.off.plan, *group)
        for i, g in enumerate(groups):
            first, last = i == 0, i == len(groups) - 1
            self.relay_node(send_cfg, expert_offsets, experts_per_rank, g.node, first, last, status)
            stamps.exchange(carrier, COMBINE, g.sends, g.recvs, status=status, valid=self._relayed, advance=last)

