"""The relay route with each token row sent once per destination node (issue 15; docs/design.md,
"Across nodes", its relay and deduplication parts), opt-in with EPSERVE_OFFNODE_DEDUP=1 (agreed at
setup like the other EPSERVE_OFFNODE_* settings; ignored on one node).

The relay (epserve/comm/off_node_relay.py) sends each rail peer this rank's R staging blocks for
that peer's node, one per destination rank, so a token bound for several ranks of one node
crosses the network once per rank. With deduplication, as DeepEP's internode dispatch does, it
crosses once per node and the rail peer fans it out (cuda/comm/off_node_dedup.cu):

    move                 unchanged: a staging block per off-node rank (rows and routing)
    dedup mark, pack     per other node: each token the node's ranks take once, in token order,
                         into a packed node block (rows [max_tokens][H]), and for each node rank
                         q and position pos of its staging block the packed row's index, with the
                         routing copied beside it
    carrier              to each rail peer its node's packed block, one transfer (stamped)
    relay packed rows    at the rail peer: node rank q's token region at the source's block,
                         position pos, from packed row index[q][pos] (IPC); counted as the
                         relay counts, so the wait and the off-node expand are unchanged

The token regions end bitwise as the per-rank relay leaves them. A packed node block holds
max_tokens rows (a sender has at most max_tokens tokens), not R * max_tokens: at capacity sizes
the rows' network bytes fall R-fold, at the cost of an index and the routing per rank.
epserve/comm/dedup_model.py models the packing and counts the bytes for a routing.

Served so far: the capacity blocks with the combine's send after GEMM 2. Routed sizes
(EPSERVE_OFFNODE_SIZES=host) and the send under GEMM 2 (EPSERVE_OFFNODE_OVERLAP=1) are refused
at setup on every rank, as is the direct route (nothing to deduplicate there: a transfer per
pair of ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from epserve.comm.carriers import Recv, Send
from epserve.comm.settings import agree_across_nodes, env_choice
from epserve.errors import ConfigError
from epserve.runtime import kernels
from epserve.runtime.kernel_structs import MAX_LOCAL_EXPERTS, u64

DEDUP_ENV = "EPSERVE_OFFNODE_DEDUP"
MARK_THREADS = MAX_LOCAL_EXPERTS  # cuda/comm/off_node_dedup.cu kMarkThreads (the layout's block scan)
PACK_THREADS = 256  # kPackThreads


def dedup_setting() -> str:
    """EPSERVE_OFFNODE_DEDUP: "0" (unset or empty: a row per destination rank) or "1" (once per node)."""
    return env_choice(DEDUP_ENV, ("0", "1"), "0 (the relay sends a token once per destination rank) or 1 (once "
                                             "per destination node, fanned out by the rail peer)")


def agree_dedup(comm, nodes: int, route: str | None, sizes: str | None, overlap: int | None) -> bool:
    """Collective, at setup, before any CUDA call: whether the relay deduplicates, the same on
    every rank, or ConfigError on every rank (a value that differs or is unknown, or
    deduplication where it does not apply: the settings it is checked against are agreed
    already, so every rank refuses alike). False on one node."""
    setting = agree_across_nodes(comm, nodes, dedup_setting, DEDUP_ENV, "off-node deduplication settings")
    if setting != "1":
        return False
    if route != "relay":
        raise ConfigError(f"{DEDUP_ENV}=1 deduplicates the relay's rows per destination node: it needs "
                          "EPSERVE_OFFNODE_ROUTE=relay (the direct route makes a transfer per pair of ranks)")
    if sizes == "host" or overlap is not None:
        raise ConfigError(f"{DEDUP_ENV}=1 serves the capacity blocks with the send after GEMM 2 only, so far: "
                          "unset EPSERVE_OFFNODE_SIZES and EPSERVE_OFFNODE_OVERLAP, or unset " + DEDUP_ENV)
    return True


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass(frozen=True)
class DedupPlan:
    """The packed node blocks, the mark kernel's scratch and the carrier's group of one rank:
    pure arithmetic on a RelayPlan, the same on every rank (tests/cpu/test_off_node_dedup.py).

    A packed node block: rows [max_tokens][hidden] (2-byte units), then index [R][max_tokens]
    int32, then routing [R][max_tokens][1 + 2k] int32, each part 16-byte aligned. The kernels take
    its offsets from here (one formula)."""

    relay: object  # epserve.comm.off_node_relay.RelayPlan

    @property
    def off(self):
        return self.relay.off

    @property
    def R(self) -> int:
        return self.relay.R

    @property
    def index_offset(self) -> int:
        return _align16(self.off.max_tokens * self.off.hidden * 2)

    @property
    def meta_offset(self) -> int:
        return self.index_offset + _align16(self.R * self.off.max_tokens * 4)

    @property
    def block_bytes(self) -> int:
        return self.meta_offset + _align16(self.R * self.off.max_tokens * self.off.meta_len * 4)

    @property
    def blocks_bytes(self) -> int:
        """The packed staging (and the relay area): a block per other node, in node order."""
        return len(self.relay.other_nodes) * self.block_bytes

    @property
    def words(self) -> int:
        """32-token words of a bit set over max_tokens tokens."""
        return (self.off.max_tokens + 31) // 32

    @property
    def scratch_bytes(self) -> int:
        """epserve_dedup_mark's bit sets: per other node, R masks, their union and its bases."""
        return len(self.relay.other_nodes) * (self.R + 2) * self.words * 4

    def rows_group(self, packed_staging, relay_area: int):
        """To each rail peer, this rank's packed block for that node (one transfer); from each,
        its packed block for this node into the relay area at (its node's index among the
        others). Whole blocks (capacity sizes)."""
        rel, bb = self.relay, self.block_bytes
        sends, recvs = [], []
        for c in rel.other_nodes:
            rail = rel.rail(c)
            sends.append(Send(rail, packed_staging, rel.other_index(c, rel.node) * bb, bb))
            recvs.append(Recv(rail, relay_area + rel.other_index(c, rel.node) * bb, bb, packed_staging,
                              rel.other_index(rel.node, c) * bb))
        return sends, recvs


class DedupRows:
    """One rank's deduplication state: the packed staging (the carrier's send side), the relay
    area the rail peers' packed blocks land in, the mark kernel's scratch, and the launches.
    Made collectively by the Relay at setup (same order on every rank). It holds no reference
    to the OffNode or the Relay (a cycle would leave the carrier's NCCL communicator to the
    garbage collector): the relay passes what the call needs."""

    def __init__(self, carrier, relay_plan):
        self.plan = DedupPlan(relay_plan)
        self._staging = carrier.staging(self.plan.blocks_bytes)  # collective
        self._area = cupy.cuda.alloc(max(16, self.plan.blocks_bytes))
        self._scratch = cupy.cuda.alloc(max(16, self.plan.scratch_bytes))
        self._sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        p = self.plan
        self._offsets = (np.int64(p.block_bytes), np.int64(p.index_offset), np.int64(p.meta_offset))

    @property
    def staging_ptr(self) -> int:
        """The packed node blocks this rank sends (launch/jobs/dedup_checks.py reads them back)."""
        return int(self._staging.ptr)

    def rows_group(self):
        """The packed blocks' carrier group (without the stamps)."""
        return self.plan.rows_group(self._staging, int(self._area.ptr))

    def pack(self, cfg) -> None:
        """After the move: this call's packed node blocks (nothing when the call failed or stopped)."""
        nodes = len(self.plan.relay.other_nodes)
        kernels.function("off_node_dedup", "epserve_dedup_mark")((nodes,), (MARK_THREADS,),
                                                                 (cfg, u64(int(self._scratch.ptr))))
        kernels.function("off_node_dedup", "epserve_dedup_pack")((self._sms,), (PACK_THREADS,),
                                                                 (cfg, u64(int(self._scratch.ptr)),
                                                                  u64(int(self._staging.ptr)), *self._offsets))

    def relay(self, cfg, relay_arrive, done) -> None:
        """After the carrier group: the rail sources' packed rows into this node's token regions,
        counted in relay_arrive (the Relay's counters; done: its copy kernel's counter)."""
        kernels.function("off_node_dedup", "epserve_relay_packed_rows")(
            (self._sms,), (PACK_THREADS,), (cfg, u64(int(self._area.ptr)), *self._offsets, relay_arrive, done))

