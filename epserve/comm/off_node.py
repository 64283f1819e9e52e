"""Rows for ranks of other nodes (docs/design.md, "Across nodes"): a first version in which
each rank sends each off-node rank its own rows, through the off-node carrier
(epserve/comm/carriers.py: NCCL in production, an IPC imitation for tests on one machine).

The idea: the kernels that store into a peer's memory stay as they are. For a rank d of
another node, the peer addresses they are given point into a local *staging* buffer instead,
laid out exactly as the slice of d's buffer this rank would have stored into, so the same
bytes land in the same places; after the kernel, the carrier carries the slice to d, which
lands it where the IPC stores would have put it. Hence the same slots, the same src_info and
the same reduction order as on one node: bitwise the one-node result, fused and unfused.

    dispatch   count + publish      this rank's count row into a staging row (and, over IPC,
                                    into its node's tables)
               carrier              count rows between the nodes' ranks, into the receivers'
                                    count tables at the sender's row; a tiny kernel counts them
                                    as arrived (count_arrive)
               rank + layout, move  unchanged; the move's send stores each off-node
                                    destination's token rows and routing into its staging block
                                    (the receiver's token region block of this rank, moved
                                    here); its expand takes this node's sources only
               carrier              the token and routing blocks, into the receivers' token
                                    regions at the sender's block
               expand (off-node)    the other nodes' rows into the expert rows, no waits
    combine    GEMM 2 / IPC push    rows whose home is on another node go to a staging copy of
                                    that home's recv (same slot (t, j))
               carrier              each staging copy to its home, into a landing block
               land                 each slot of an off-node owner from its landing block into
                                    recv; arrive[owner] counts them; then the usual reduction

The kernel structs' address tables hold the ranks of this rank's node only (at most 8, by
local index); a rank d of another node is reached by arithmetic into the staging (its block
is block(d), the kernels' off_node_block), so nothing grows with the world but counts.
Waits that stand for "the peer released its buffers" (dispatch_ready, ready) and the arrival
counters are kept for this node's ranks only: for the other nodes' ranks stream order does
their work (staging is rewritten only after the carrier's send of it completed, and a
receiver's landing areas only by its own later carrier calls), so the kernels neither wait
for them nor signal them.

Sizes. By default (EPSERVE_OFFNODE_SIZES=capacity) they are fixed (NCCL's are host arguments
and the counts stay on the device), so every block travels whole, as the NCCL transport's do:
per off-node peer and call, max_tokens token rows and their routing, a count row, and for the
combine a whole recv copy, max_tokens * k rows (padding over the real rows: about W for
uniform routing, as the NCCL combine's). With EPSERVE_OFFNODE_SIZES=host the host reads the
count rows once per dispatch (a wait that overlaps the layout and the move on the GPU, and
that no CUDA graph can hold) and the carrier moves the routed rows only; the combine returns
compact blocks (epserve/comm/off_node_sizes.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import cupy
import numpy as np

from epserve.comm import off_node_overlap
from epserve.comm import signals as sig
from epserve.comm.carriers import Recv, Send
from epserve.comm.off_node_relay import Relay, relay_sizes
from epserve.comm.off_node_sizes import OffNodeSizes, sizes_from_count_rows
from epserve.comm.off_node_stamps import COMBINE, ROWS, CallStamps
from epserve.comm.settings import agree_across_nodes
from epserve.comm.topology import NodeLayout
from epserve.errors import PeerTimeoutError
from epserve.runtime import kernels
from epserve.runtime.kernel_structs import i32, u64

U64 = 8


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass(frozen=True)
class OffNodePlan:
    """Which ranks are off-node for `rank`, the staging layout and the proxy addresses: pure
    arithmetic, the same on every rank (tests/cpu/test_off_node.py).

    hidden: the dispatch row's width in bf16 elements (the FP8 packed row's half width with
    FP8 experts); combine_hidden: GEMM 2's output width."""

    layout: NodeLayout
    rank: int
    num_experts: int
    top_k: int
    hidden: int
    combine_hidden: int
    max_tokens: int

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def R(self) -> int:
        return self.layout.ranks_per_node

    @property
    def peers(self) -> list[int]:
        """The ranks of the other nodes, ascending: block p of the staging is peers[p]'s."""
        return [d for d in range(self.world) if not self.layout.same_node(self.rank, d)]

    def block_of(self, sender: int, dest: int) -> int:
        """The block index of off-node rank `dest` in rank `sender`'s staging (also
        cuda/comm/staging.cu off_node_block)."""
        start = sender // self.R * self.R
        assert not self.layout.same_node(sender, dest), (sender, dest)
        return dest if dest < start else dest - self.R

    def block(self, d: int) -> int:
        return self.block_of(self.rank, d)

    # ---- dispatch staging: [count row][tokens block p][meta block p] for each off-node p
    @property
    def count_row_ints(self) -> int:
        return self.num_experts + self.world + 1  # rows per expert, tokens per destination, error code

    @property
    def meta_len(self) -> int:
        return 1 + 2 * self.top_k

    @property
    def tokens_block_bytes(self) -> int:
        return self.max_tokens * self.hidden * 2

    @property
    def meta_block_bytes(self) -> int:
        return self.max_tokens * self.meta_len * 4

    def tokens_offset(self, p: int) -> int:
        return _align16(self.count_row_ints * 4) + p * (self.tokens_block_bytes + _align16(self.meta_block_bytes))

    def meta_offset(self, p: int) -> int:
        return self.tokens_offset(p) + self.tokens_block_bytes

    @property
    def dispatch_staging_bytes(self) -> int:
        return self.tokens_offset(len(self.peers))

    # ---- combine staging and landing: a [max_tokens, k, H] recv copy per off-node peer
    @property
    def combine_block_bytes(self) -> int:
        return self.max_tokens * self.top_k * self.combine_hidden * 2

    @property
    def combine_staging_bytes(self) -> int:
        return len(self.peers) * self.combine_block_bytes

    # ---- what the kernels compute for a rank d of another node (cuda/common/nodes.cuh)
    def dispatch_staging(self, staging: int) -> dict:
        """DispatchConfig's off-node fields for a dispatch staging at `staging`: the count row
        at its start, and off-node rank d's block (its token rows, then their routing) at
        off_blocks + block(d) * off_block_bytes."""
        return dict(off_count_row=staging, off_blocks=staging + self.tokens_offset(0),
                    off_block_bytes=self.tokens_offset(1) - self.tokens_offset(0))

    def token_row_address(self, fields: dict, d: int, pos: int) -> int:
        """Where the move kernel stores this rank's token row at position pos of off-node rank
        d (cuda/comm/dispatch.cu token_dst), given dispatch_staging's fields."""
        return fields["off_blocks"] + self.block(d) * fields["off_block_bytes"] + pos * self.hidden * 2

    def meta_address(self, fields: dict, d: int, pos: int) -> int:
        """... and its routing (meta_dst)."""
        return (fields["off_blocks"] + self.block(d) * fields["off_block_bytes"] + self.max_tokens * self.hidden * 2
                + pos * self.meta_len * 4)

    def combine_slot_address(self, off_recv: int, d: int, t: int, j: int, col0: int = 0) -> int:
        """Where the peer sink stores slot (t, j) of off-node home d (sinks/row_scatter.cuh):
        its copy of d's recv in the combine staging at off_recv."""
        elems = self.max_tokens * self.top_k * self.combine_hidden
        return off_recv + 2 * (self.block(d) * elems + (t * self.top_k + j) * self.combine_hidden + col0)

    # ---- the carrier's groups
    def count_group(self, staging, count_table: int):
        """Sends and receives of the count rows: this rank's to every off-node rank, theirs
        into this rank's count table at their rows."""
        n = self.count_row_ints * 4
        sends = [Send(d, staging, 0, n) for d in self.peers]
        recvs = [Recv(s, count_table + s * n, n, staging, 0) for s in self.peers]
        return sends, recvs

    def rows_group(self, staging, tokens: int, meta: int, sizes: OffNodeSizes | None = None):
        """The token and routing blocks: this rank's staging blocks to their ranks, theirs into
        this rank's token regions and routing at their blocks (tokens, then routing, per peer).
        With `sizes` (EPSERVE_OFFNODE_SIZES=host) only the routed rows at each block's start,
        and no transfer of zero bytes (both ends leave out the same ones)."""
        tok_row, meta_row = self.hidden * 2, self.meta_len * 4
        sends, recvs = [], []
        for d in self.peers:
            p = self.block(d)
            n = self.max_tokens if sizes is None else sizes.tokens_to[d]
            sends += [Send(d, staging, self.tokens_offset(p), n * tok_row),
                      Send(d, staging, self.meta_offset(p), n * meta_row)]
        for s in self.peers:
            q = self.block_of(s, self.rank)  # this rank's block in s's staging
            n = self.max_tokens if sizes is None else sizes.tokens_from[s]
            recvs += [Recv(s, tokens + s * self.tokens_block_bytes, n * tok_row, staging, self.tokens_offset(q)),
                      Recv(s, meta + s * self.meta_block_bytes, n * meta_row, staging, self.meta_offset(q))]
        return _without_empty(sends, recvs, sizes)

    def combine_group(self, staging, landing: int, sizes: OffNodeSizes | None = None):
        """Each off-node home's recv copy to it; each off-node owner's copy of this rank's recv
        into its landing block. With `sizes`: each block's compact return rows only (its
        start), no transfer of zero bytes."""
        n, row = self.combine_block_bytes, self.combine_hidden * 2
        cap = self.max_tokens * self.top_k
        sends = [Send(d, staging, self.block(d) * n, (cap if sizes is None else sizes.returns_to[d]) * row)
                 for d in self.peers]
        recvs = [Recv(s, landing + self.block(s) * n, (cap if sizes is None else sizes.returns_from[s]) * row,
                      staging, self.block_of(s, self.rank) * n)
                 for s in self.peers]
        return _without_empty(sends, recvs, sizes)


def _without_empty(sends, recvs, sizes):
    """A sized group without its transfers of zero bytes (the capacity groups have none)."""
    if sizes is None:
        return sends, recvs
    return [x for x in sends if x.nbytes], [x for x in recvs if x.nbytes]


# The host's wait for a call's count rows (EPSERVE_OFFNODE_SIZES=host), in wait_timeout_s: the
# copy follows count + publish and the count rows' carrier group, each of whose waits is
# bounded by wait_timeout_s on the device (the IPC test carrier's), behind the previous work
# on the stream (the previous call's reduction, bounded too).
HOST_WAIT_TIMEOUTS = 4


class OffNode:
    """One rank's off-node state: the plan, the carrier, the staging and landing buffers, and
    the launches around the carrier. Made collectively at setup (allocations in rank-agreed
    order) when the ranks span more than one node.

    sizes: "capacity" (fixed blocks, no host wait) or "host" (EPSERVE_OFFNODE_SIZES=host: the
    count rows read on the host once per dispatch, then transfers of the routed rows only;
    epserve/comm/off_node_sizes.py)."""

    sizes = "capacity"
    _last = None  # OffNodeSizes of the latest direct dispatch (sizes "host")
    overlap = None  # off_node_overlap.OverlappedSend with EPSERVE_OFFNODE_OVERLAP=1
    relay = None  # off_node_relay.Relay with EPSERVE_OFFNODE_ROUTE=relay

    def __init__(self, plan: OffNodePlan, carrier, signals, wait_timeout_s: float, sizes: str = "capacity",
                 max_recv_rows: int = 0, overlap_free_sms: int | None = None, route: str = "direct", group=None,
                 dedup: bool = False):
        self.plan, self.carrier, self.signals = plan, carrier, signals
        self.rank, self.world = plan.rank, plan.world
        self.timeout_ns = int(wait_timeout_s * 1e9)
        self.wait_timeout_s = wait_timeout_s
        self.sizes = sizes
        self._dispatch_staging = carrier.staging(plan.dispatch_staging_bytes)
        # with the overlap, the staging's blocks are followed by GEMM 2's per-home counters
        self._combine_staging = carrier.staging(plan.combine_staging_bytes + (
            0 if overlap_free_sms is None else off_node_overlap.done_counters_bytes(plan)))
        self._landing = cupy.cuda.alloc(max(16, plan.combine_staging_bytes))
        # every token-row and combine group ends with a stamp per peer (epserve/comm/off_node_stamps.py)
        self.stamps = CallStamps(carrier, self.world, signals)
        self._groups = {}
        if sizes == "host":
            table_bytes = self.world * plan.count_row_ints * 4
            self._counts_pinned = cupy.cuda.alloc_pinned_memory(table_bytes)
            self._counts_host = np.frombuffer(self._counts_pinned, np.int32, self.world * plan.count_row_ints
                                              ).reshape(self.world, plan.count_row_ints)
            self._counts_copied = cupy.cuda.Event(block=False, disable_timing=True)
            # the src_info GEMM 2's sink and the IPC push are given: off-node rows as their
            # compact return positions (epserve_off_node_return_slots)
            self.sink_src_info = cupy.zeros(max(1, max_recv_rows), np.int32)
        self._dispatch = None  # the direct dispatcher's buffers (bind_dispatch)
        # EPSERVE_OFFNODE_OVERLAP=1: the combine's send under GEMM 2 (epserve/comm/off_node_overlap.py)
        self.overlap = None if overlap_free_sms is None else off_node_overlap.OverlappedSend(self, overlap_free_sms)
        # EPSERVE_OFFNODE_ROUTE=relay: along the rails, then over NVLink (epserve/comm/off_node_relay.py)
        self.route = route
        # (EPSERVE_OFFNODE_DEDUP=1, relay only: each token row once per destination node)
        self.relay = Relay(self, group, dedup) if route == "relay" else None

    @property
    def host_sizes(self) -> bool:
        return self.sizes == "host"

    @property
    def dedup(self) -> bool:
        """Whether the relay sends each token row once per destination node (EPSERVE_OFFNODE_DEDUP=1)."""
        return self.relay is not None and self.relay.dedup is not None

    def bind_dispatch(self, count_table: int, tokens: int, meta: int, slot_rank) -> None:
        """The direct dispatcher's count table, token regions and routing (addresses) and
        route's slot_rank, which the sized transfers and the compact land read."""
        self._dispatch = (count_table, tokens, meta, slot_rank)

    # ---- the carrier groups (also for launch/jobs/time_off_node.py) ----------------------
    def count_group(self):
        if self.relay is not None:
            return self.relay.plan.count_group(self._dispatch_staging, self._dispatch[0])
        return self.plan.count_group(self._dispatch_staging, self._dispatch[0])

    def rows_group(self, sizes: OffNodeSizes | None = None):
        if self.relay is not None:
            return self.relay.rows_group(self._dispatch_staging, sizes)
        return self.plan.rows_group(self._dispatch_staging, self._dispatch[1], self._dispatch[2], sizes)

    def combine_group(self, sizes: OffNodeSizes | None = None):
        if self.relay is not None:
            return self.relay.combine_group(int(self._landing.ptr), sizes)
        return self.plan.combine_group(self._combine_staging, int(self._landing.ptr), sizes)

    def stamped_combine_group(self, sizes: OffNodeSizes | None = None):
        """combine_group ending with the stamps to and from its carrier peers (what forward
        sends; off_node_stamps.py)."""
        if self.relay is not None:
            return self.relay.stamped_combine_group(int(self._landing.ptr), sizes)
        return self.stamps.with_stamps(COMBINE, *self.combine_group(sizes), self.plan.peers)

    def combine_valid(self, status):
        """What the combine stamps say: the call's status, or with the relay its verdict on the
        rows it relays."""
        return self.relay.relayed if self.relay is not None else status

    @property
    def last_sizes(self) -> OffNodeSizes | None:
        """The sizes of the latest direct dispatch (sizes "host"), else None."""
        return self._last

    # ---- the staging, for the dispatcher's and the combiner's kernel structs
    def dispatch_staging(self) -> dict:
        """DispatchConfig's off-node fields (off_count_row, off_blocks, off_block_bytes)."""
        return self.plan.dispatch_staging(self._dispatch_staging.ptr)

    def combine_staging(self) -> int:
        """PeerSendConfig.off_recv: the copies of the other nodes' ranks' recv."""
        return self._combine_staging.ptr

    # ---- the dispatch
    def exchange_counts(self, count_table: int, cfg=None) -> None:
        """After count + publish: the count rows cross, then count as arrived. cfg: the direct
        dispatch's DispatchConfig (the relay's launch needs it)."""
        if self.relay is not None:
            self.relay.exchange_counts(self._dispatch_staging, count_table, cfg)
            return
        key = ("counts", count_table)
        if key not in self._groups:
            self._groups[key] = self.plan.count_group(self._dispatch_staging, count_table)
        self.carrier.exchange(*self._groups[key])  # no status: it is the previous call's until the layout
        fn = kernels.function("staging", "epserve_off_node_counts_landed")
        fn((1,), (32,), (u64(self.signals.local(sig.COUNT_ARRIVE)), i32(self.rank), i32(self.world), i32(self.plan.R),
                         u64(self.signals.local(sig.ERROR))))

    def counts_to_host(self, count_table: int) -> None:
        """Sizes "host", after exchange_counts: this rank's count table to the host (one small
        copy, on the stream, and an event); await_sizes waits for it. Only this rank's row and
        the other nodes' rows are read there: both are on this stream, while this node's
        ranks' rows arrive by IPC whenever they come (with the relay, of the other nodes' rows
        only the rail peers': the others come through this node's ranks too)."""
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(self._counts_pinned.ptr, count_table, self._counts_host.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        self._counts_copied.record(stream)

    def await_sizes(self) -> OffNodeSizes:
        """Sizes "host": wait (bounded) for counts_to_host's copy, then this call's sizes. The
        GPU goes on meanwhile with what was queued after the copy (the layout, the move)."""
        deadline = time.monotonic() + HOST_WAIT_TIMEOUTS * self.wait_timeout_s
        spins = 0
        while not self._counts_copied.done:
            if time.monotonic() > deadline:
                raise PeerTimeoutError(
                    f"rank {self.rank}: this call's off-node count rows did not reach the host within "
                    f"{HOST_WAIT_TIMEOUTS * self.wait_timeout_s:g} s (EPSERVE_OFFNODE_SIZES=host): a peer is dead or "
                    "stuck before its count rows, or the carrier never delivered them")
            spins += 1
            if spins > 1000:  # past the first moments, give the CPU back between looks
                time.sleep(50e-6)
        p = self.plan
        if self.relay is not None:  # only this rank's row and its rail peers' (off_node_relay.relay_sizes)
            self._last = relay_sizes(self._counts_host, self.relay.plan)
        else:
            self._last = sizes_from_count_rows(self._counts_host, self.rank, p.peers, p.num_experts, p.max_tokens,
                                               p.top_k)
        return self._last

    def exchange_rows(self, tokens: int, meta: int, status, sizes: OffNodeSizes | None = None, cfg=None,
                      expert_offsets=None, experts_per_rank: int = 0) -> None:
        """After the move kernel: the token and routing blocks cross, whole, or with `sizes`
        (await_sizes) the routed rows only. With the relay (cfg, expert_offsets and
        experts_per_rank: the direct dispatch's), along the rails and on to the node's ranks,
        then this rank's wait for its own."""
        if self.relay is not None:
            self.relay.exchange_rows(self._dispatch_staging, cfg, status, expert_offsets, experts_per_rank, sizes)
            return
        if sizes is not None:
            group = self._stamped_rows_group(tokens, meta, sizes)
        else:
            key = ("rows", tokens, meta)
            if key not in self._groups:
                self._groups[key] = self._stamped_rows_group(tokens, meta)
            group = self._groups[key]
        self.stamps.exchange(self.carrier, ROWS, *group, status=status, valid=status)

    def _stamped_rows_group(self, tokens: int, meta: int, sizes: OffNodeSizes | None = None):
        """The direct route's token-row group, ending with the stamps (off_node_stamps.py)."""
        return self.stamps.with_stamps(ROWS, *self.plan.rows_group(self._dispatch_staging, tokens, meta, sizes),
                                       self.plan.peers)

    def return_slots_spec(self, src_info, expert_offsets, base, count_table: int, status) -> tuple:
        """Sizes "host", after the dispatch: the launch that writes sink_src_info, where each
        row bound off-node names its compact return position (cuda/comm/staging.cu)."""
        p = self.plan
        fn = kernels.function("staging", "epserve_off_node_return_slots")
        blocks = max(1, min(1024, (src_info.shape[0] + 255) // 256))
        return (fn, (blocks,), (256,), (src_info, expert_offsets, base, u64(count_table), i32(p.num_experts),
                                        i32(p.top_k), i32(p.max_tokens), i32(self.rank), i32(self.world), i32(p.R),
                                        self.sink_src_info, status), 0)

    def compact_returns(self, after_direct: bool) -> bool:
        """Whether this combine returns compact blocks: sizes "host" and the call's dispatch was
        the direct one (its count rows reached the host; the NCCL dispatch's never do)."""
        return self.host_sizes and after_direct

    def expand_spec(self, cfg, base, rows, src_info, expert_offsets, blocks: int) -> tuple:
        """The launch that expands the other nodes' rows (cuda/comm/dispatch.cu)."""
        fn = kernels.function("dispatch", "epserve_dispatch_expand_off_node")
        return (fn, (blocks,), (256,), (cfg, base, rows, src_info, expert_offsets), 0)

    # ---- the combine
    def exchange_combine(self, topk_idx, T: int, k: int, H: int, experts_per_rank: int, recv, status,
                         compact: bool = False, rows=None) -> None:
        """After GEMM 2 (or the IPC push): each staged recv copy to its home, then the landing
        of this rank's slots served on other nodes into recv, counted in arrive. compact
        (compact_returns): the return blocks hold the routed rows only, in the sizes of the
        latest direct dispatch, and land by their compact positions. rows: (the PeerSendConfig
        the rows were staged with, the call's expert_offsets or None for a rank standing in),
        which the relay walks."""
        if self.relay is not None:
            if compact and self._last is None:
                raise RuntimeError("a compact combine before any direct dispatch with EPSERVE_OFFNODE_SIZES=host")
            send_cfg, expert_offsets = rows
            self.relay.exchange_combine(send_cfg, expert_offsets, experts_per_rank, int(self._landing.ptr), status,
                                        self._last if compact else None, by_node=self.overlap is not None)
            self.land_combine(topk_idx, T, k, H, experts_per_rank, recv, status, compact)
            return
        if compact:
            if self._last is None:
                raise RuntimeError("a compact combine before any direct dispatch with EPSERVE_OFFNODE_SIZES=host")
            group = self.stamped_combine_group(self._last)
        else:
            key = ("combine", int(self._landing.ptr))
            if key not in self._groups:
                self._groups[key] = self.stamped_combine_group()
            group = self._groups[key]
        if self.overlap is None:
            self.stamps.exchange(self.carrier, COMBINE, *group, status=status, valid=status)
        else:  # the groups of the combine's send under GEMM 2, which the other ranks may be making
            groups = off_node_overlap.groups_by_node(self.plan, *group)
            for i, g in enumerate(groups):
                self.stamps.exchange(self.carrier, COMBINE, g.sends, g.recvs, status=status, valid=status,
                                     advance=i == len(groups) - 1)
        self.land_combine(topk_idx, T, k, H, experts_per_rank, recv, status, compact)

    def send_combine_under_gemm(self, cfg, expert_offsets, experts_per_rank: int, status, compact: bool = False) -> None:
        """EPSERVE_OFFNODE_OVERLAP=1, after overlap.fork() and GEMM 2's overlap build were queued:
        the combine's carrier groups on the side stream as GEMM 2 stages their rows, joined
        back into the current stream (epserve/comm/off_node_overlap.py); then land_combine."""
        if compact and self._last is None:
            raise RuntimeError("a compact combine before any direct dispatch with EPSERVE_OFFNODE_SIZES=host")
        self.overlap.send(cfg, expert_offsets, experts_per_rank, status, compact)

    def land_combine(self, topk_idx, T: int, k: int, H: int, experts_per_rank: int, recv, status,
                     compact: bool = False) -> None:
        """After the combine's carrier group(s): this rank's slots served on other nodes, from
        the landing blocks into recv, counted in arrive."""
        if T == 0:
            return
        blocks = max(1, min(1024, (T * k + 7) // 8))
        p, landing, status = self.plan, u64(int(self._landing.ptr)), status if status is not None else u64(0)
        arrive = u64(self.signals.local(sig.ARRIVE))
        if compact:
            table, _, _, slot_rank = self._dispatch
            fn = kernels.function("staging", "epserve_off_node_combine_land_compact")
            fn((blocks,), (256,), (landing, topk_idx, slot_rank, u64(table + self.rank * p.count_row_ints * 4), i32(T),
                                   i32(k), i32(H), i32(p.num_experts), i32(p.max_tokens), i32(self.rank),
                                   i32(self.world), i32(p.R), recv, arrive, i32(H // 64), status))
            return
        fn = kernels.function("staging", "epserve_off_node_combine_land")
        fn((blocks,), (256,), (landing, topk_idx, i32(T), i32(k), i32(H), i32(experts_per_rank),
                               i32(p.max_tokens), i32(self.rank), i32(self.world), i32(p.R), recv, arrive,
                               i32(H // 64), status))

    def quiesce(self, timeout_s: float) -> bool:
        """close(): wait at most timeout_s for the current stream's work; when it does not end
        (an off-node peer is stuck, and NCCL's waits are not bounded), abort the carrier so
        that NCCL's kernels return. True when the work ended by itself."""
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record()
        deadline = time.monotonic() + timeout_s
        while not event.done:
            if time.monotonic() > deadline:
                self.carrier.abort()
                return False
            time.sleep(0.001)
        return True


def agree_carrier(comm, layout: NodeLayout) -> str | None:
    """Collective, at setup, before any CUDA call: None on one node, else the off-node carrier
    EPSERVE_OFFNODE_CARRIER names, the same on every rank, or ConfigError on every rank."""
    from epserve.comm.carriers import CARRIER_ENV, carrier_name

    return agree_across_nodes(comm, layout.nodes, carrier_name, CARRIER_ENV, "off-node carriers")


def make_off_node(comm, group, signals, layout: NodeLayout, carrier: str | None, *, num_experts: int, top_k: int,
                  hidden: int, combine_hidden: int, max_tokens: int, wait_timeout_s: float, nccl_comm,
                  shared_gpu: bool, sizes: str | None = None, max_recv_rows: int = 0,
                  overlap_free_sms: int | None = None, route: str | None = None, dedup: bool = False):
    """Collective, at setup: None on one node (carrier None), else this rank's OffNode with
    that carrier (agree_carrier), sizes (off_node_sizes.agree_sizes; None: "capacity"),
    overlap (off_node_overlap.agree_overlap: the SMs GEMM 2 leaves free, or None), route
    (off_node_relay.agree_route; None: "direct") and dedup (off_node_dedup.agree_dedup);
    ConfigError on every rank when it cannot run here."""
    import socket

    from epserve.comm.carriers import make_carrier

    if carrier is None:
        return None
    hosts_differ = len(set(comm.allgather(socket.gethostname()))) > 1
    impl = make_carrier(carrier, group=group, nccl_comm=nccl_comm, shared_gpu=shared_gpu, hosts_differ=hosts_differ,
                        error_ptr=signals.local(sig.ERROR), timeout_ns=int(wait_timeout_s * 1e9))
    plan = OffNodePlan(layout, comm.Get_rank(), num_experts, top_k, hidden, combine_hidden, max_tokens)
    return OffNode(plan, impl, signals, wait_timeout_s, sizes or "capacity", max_recv_rows, overlap_free_sms,
                   route or "direct", group, dedup)
