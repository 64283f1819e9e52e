"""The combine's off-node send under GEMM 2 (issue 15, step 2; docs/design.md, "Across nodes"),
opt-in with EPSERVE_OFFNODE_OVERLAP=1 (agreed at setup like the carrier; ignored on one node).

By default the carrier sends GEMM 2's staged off-node rows after GEMM 2 has finished. With
the overlap, for the fused combine with the bf16 wgmma GEMM 2:

    main stream   fork ─ order ─ GEMM 2 (overlap build) ─ arm ········ join ─ land ─ reduction
    side stream        └ expect ─ wait(node a) ─ carrier(node a) ─ wait(node b) ─ carrier(node b) ┘

- GEMM 2's overlap build (epserve/ffn/overlap_gemm.py) leaves EPSERVE_OFFNODE_OVERLAP_SMS SMs
  free for the side stream's kernels, hands out first the tiles of m-tiles that hold rows
  bound off-node, and its sink counts the 64-column units it has staged per off-node home
  (cuda/sinks/off_node_rows_done.cuh: u64 counters after the combine staging's blocks).
- expect (cuda/comm/off_node_overlap.cu) adds this call's units per home, from the src_info
  the sink reads, to a cumulative target; both counters only grow, nothing is reset.
- Per destination node, in node order (the same on every rank, so NCCL's groups cannot
  deadlock: the lowest pending pair of nodes always finds both ends at their group), a wait
  kernel (bounded by twice wait_timeout_s, since it spans GEMM 2, whose own waits are
  bounded by wait_timeout_s; on timeout code 12 names the home and the call is marked
  failed) and that node's carrier group: this rank's staged blocks for the node's ranks, and
  their blocks for this rank into its landing blocks.
- The main stream waits for the side stream, then lands and reduces as before.

The same bytes in the same slots, landed and reduced in the same order as without the
overlap: bitwise the same output (fused == unfused == the one-node run). Both sizes modes
work: with EPSERVE_OFFNODE_SIZES=host the groups carry the compact return blocks (their sizes
from the latest direct dispatch). The FP8 GEMM 2, the mma.sync GEMM and the unfused push keep
the send after the kernel. A forward with the overlap cannot be captured (capture() refuses).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import cupy
import numpy as np

from epserve.comm import signals as sig
from epserve.comm.off_node_stamps import COMBINE
from epserve.errors import ConfigError
from epserve.ffn.overlap_gemm import FREE_SMS_ENV, free_sms
from epserve.runtime import kernels
from epserve.runtime.kernel_structs import i32, u64

OVERLAP_ENV = "EPSERVE_OFFNODE_OVERLAP"
WAIT_TIMEOUTS = 2  # the wait spans GEMM 2, whose own waits are bounded by wait_timeout_s


def overlap_setting() -> str:
    """EPSERVE_OFFNODE_OVERLAP (unset, empty or 0: the send after GEMM 2; 1: under it) and, when
    on, the SMs GEMM 2 leaves free (EPSERVE_OFFNODE_OVERLAP_SMS): "off" or that number."""
    name = os.environ.get(OVERLAP_ENV, "").strip() or "0"
    if name not in ("0", "1"):
        raise ConfigError(f"{OVERLAP_ENV}={name!r}: 0 (the off-node send after GEMM 2) or 1 (under GEMM 2)")
    return "off" if name == "0" else str(free_sms())


def agree_overlap(comm, nodes: int) -> int | None:
    """Collective, at setup, before any CUDA call: None on one node or without
    EPSERVE_OFFNODE_OVERLAP=1, else the SMs GEMM 2 leaves free; the same on every rank, or
    ConfigError on every rank."""
    from epserve.comm.mpi import agree_choice

    if nodes == 1:
        return None
    setting = agree_choice(comm, overlap_setting, f"{OVERLAP_ENV}, {FREE_SMS_ENV}", "off-node overlap settings")
    return None if setting == "off" else int(setting)


@dataclass(frozen=True)
class NodeGroup:
    """One destination node's share of the combine's carrier group."""

    node: int
    first_rank: int
    first_block: int  # the node's first rank's staging block (its ranks' blocks are consecutive)
    ranks: int
    sends: list
    recvs: list


def groups_by_node(plan, sends, recvs) -> list[NodeGroup]:
    """The combine group (OffNodePlan.combine_group) split by destination node, in node order,
    each send and receive in its place: together exactly the whole group's transfers."""
    R, mine = plan.R, plan.rank // plan.R
    out = []
    for node in range(plan.world // R):
        if node == mine:
            continue
        first = node * R
        ranks = range(first, first + R)
        out.append(NodeGroup(node, first, plan.block(first), R, [s for s in sends if s.peer in ranks],
                             [r for r in recvs if r.peer in ranks]))
    return out


def done_counters_offset(plan) -> int:
    """Bytes into the combine staging of the sink's counters (after every block; the kernels'
    off_node_rows_done)."""
    return plan.combine_staging_bytes


def done_counters_bytes(plan) -> int:
    return 8 * len(plan.peers)


class OverlappedSend:
    """One rank's side stream, events and counters for the off-node send under GEMM 2."""

    def __init__(self, off_node, free_sms: int):
        # weakly: off_node holds this, and a cycle would leave its carrier (the NCCL communicator)
        # to the cyclic garbage collector (tests/cpu/test_off_node_teardown.py)
        self.off_node, self.free_sms = weakref.proxy(off_node), free_sms
        plan = off_node.plan
        self._done = off_node.combine_staging() + done_counters_offset(plan)
        cupy.cuda.runtime.memset(self._done, 0, done_counters_bytes(plan))
        cupy.cuda.runtime.deviceSynchronize()  # zero before any GEMM 2, on whatever stream, counts into them
        self._expected = cupy.zeros(max(1, len(plan.peers)), np.uint64)
        self._side = cupy.cuda.Stream(non_blocking=True)
        self._fork = cupy.cuda.Event(block=False, disable_timing=True)
        self._join = cupy.cuda.Event(block=False, disable_timing=True)
        self._groups = {}
        self.sends = 0  # combines sent under GEMM 2 so far (for tests)

    def fork(self) -> None:
        """On the main stream, before GEMM 2: the side stream starts from here."""
        self._fork.record(cupy.cuda.get_current_stream())
        self._side.wait_event(self._fork)

    def send(self, cfg, expert_offsets, experts_per_rank: int, status, compact: bool) -> None:
        """After GEMM 2 is queued on the main stream: the side stream's expect, then per
        destination node its wait and its carrier group; the main stream then waits for it.
        cfg: GEMM 2's PeerSendConfig (launch argument); status: the call's, or None."""
        off = self.off_node
        self.sends += 1
        status_arg = status if status is not None else u64(0)
        main = cupy.cuda.get_current_stream()
        with self._side:
            expect = kernels.function("off_node_overlap", "epserve_off_node_rows_expect")
            expect((1,), (256,), (expert_offsets, i32(experts_per_rank), cfg, self._expected))
            wait = kernels.function("off_node_overlap", "epserve_off_node_rows_wait")
            timeout_ns = u64(WAIT_TIMEOUTS * off.timeout_ns)
            error = u64(off.signals.local(sig.ERROR))
            groups = self._node_groups(compact)
            for i, g in enumerate(groups):
                first, last = i == 0, i == len(groups) - 1
                wait((1,), (32,), (u64(self._done), self._expected, i32(g.first_block), i32(g.ranks),
                                   i32(g.first_rank), timeout_ns, error, status_arg))
                if off.relay is not None:  # through the rail peers (off_node_relay.py): this node's homes' rows
                    off.relay.relay_node(cfg, expert_offsets, experts_per_rank, g.node, first, last, status)
                # each group ends with its stamps (off_node_stamps.py): a wait above that ran out
                # fails the homes' calls too, rather than hand them the rows staged so far
                off.stamps.exchange(off.carrier, COMBINE, g.sends, g.recvs, status=status,
                                    valid=off.combine_valid(status), advance=last)
            self._join.record(self._side)
        main.wait_event(self._join)

    def _node_groups(self, compact: bool) -> list[NodeGroup]:
        off = self.off_node
        if compact:  # the sizes of the latest direct dispatch: groups of this call
            return groups_by_node(off.plan, *off.stamped_combine_group(off.last_sizes))
        if "capacity" not in self._groups:
            self._groups["capacity"] = groups_by_node(off.plan, *off.stamped_combine_group())
        return self._groups["capacity"]
