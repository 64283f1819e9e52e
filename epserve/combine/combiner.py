"""Combine: GEMM 2's rows back to their home ranks' recv slots, then the fixed-order
weighted reduction (docs/design.md, "The reduction"). The fused path is GEMM 2 itself with the peer sink;
the unfused path is GEMM 2 into C followed by a transport of C's rows:
  nccl - pack C's rows by home rank, grouped NCCL send/recv, scatter into recv slots;
  ipc  - push C's rows into the peers' recv slots with the peer sink's own scatter kernel
         (ranks sharing a GPU, where NCCL refuses).
Both land the same bytes in the same slots, so their outputs are bitwise equal.

Every combine has a number (its epoch, the same on every rank), kept on the device: a
rank's own ready counter counts the combines it has finished. A sender writes into rank d's
recv for combine e only after d has released it for combine e - 1 (release_recv, run after
d's reduction, by its last block), so no call overwrites rows a peer is still reducing.

`status` (the direct dispatch's call status, or None) carries a call's failure from the
dispatch to the combine: a stopped call expects no rows, and a failed call's output is
poisoned (NaN), never plausible."""

from __future__ import annotations

import cupy

from epserve.combine import launchers
from epserve.comm import row_moves
from epserve.comm import signals as sig
from epserve.comm.nccl import exchange_rows
from epserve.dispatch.device_plan import DevicePlan
from epserve.ffn import gemm
from epserve.ffn.fp8_stage import gemm2_specs, overlap_supported
from epserve.runtime.kernel_structs import launch_arg, pack_peer_counters, pack_peer_send_config
from epserve.runtime.launch import LaunchSequence


class Combiner:
    def __init__(self, group, signals, *, num_experts: int, top_k: int, hidden: int, max_tokens: int,
                 wait_timeout_s: float, transport: str, nccl_comm=None, dtype=None, off_node=None):
        if transport not in ("nccl", "ipc"):
            raise ValueError(f"unknown combine transport {transport!r}")
        self.group = group
        self.rank, self.world = group.rank, group.world
        self.top_k, self.hidden, self.max_tokens = top_k, hidden, max_tokens
        self.experts_per_rank = num_experts // self.world
        self.timeout_ns = int(wait_timeout_s * 1e9)
        self.transport = transport
        self.nccl = nccl_comm
        self.dtype = dtype
        self._recv = group.allocate(max_tokens * top_k * hidden * 2)
        # The view of it, made once: a view costs host time (the reduction takes it every call).
        self._recv_view = self._recv.view(dtype, (max_tokens, top_k, hidden)) if dtype is not None else None
        self.signals = signals
        self.off_node = off_node  # epserve/comm/off_node.py: rows for other nodes' ranks go by its carrier
        # The reduction releases recv to this node's ranks; the other nodes' rows come by the
        # carrier, ordered on the stream (docs/design.md, "Across nodes").
        node = group.node_ranks
        self._ready_table = launch_arg(pack_peer_counters(ready=[signals.peer(d, sig.READY) for d in node],
                                                          ranks_per_node=len(node), node_first=node.start))
        self._reduce_blocks_done = cupy.zeros(1, cupy.uint32)  # the reduction's last block releases recv
        self.epoch = 0  # combines begun so far, for reports only: the kernels keep their own
        self._configs = {}
        self._launches = LaunchSequence()  # prepared per (path, wait, T): see runtime/launch.py

    @property
    def recv(self) -> cupy.ndarray:
        """This rank's recv slots [max_tokens, k, H] (bf16)."""
        if self._recv_view is None:
            self._recv_view = self._recv.view(self.dtype, (self.max_tokens, self.top_k, self.hidden))
        return self._recv_view

    def send_config(self, src_info, status=None):
        """The PeerSendConfig for rows whose sources are src_info, as a launch argument
        (kernel_structs.launch_arg); nothing in it changes from call to call, so one is packed
        per (src_info, status) buffer and kept."""
        key = (0 if src_info is None else src_info.data.ptr, 0 if status is None else status.data.ptr)
        cfg = self._configs.get(key)
        if cfg is None:
            if len(self._configs) > 64:  # per-call buffers (the baselines) come and go
                self._configs.clear()
            node = self.group.node_ranks  # the address tables hold this node's ranks (common/nodes.cuh)
            # another node's rows go to its copy of recv in the combine staging (off_node.py)
            off_recv = self.off_node.combine_staging() if self.off_node is not None else 0
            cfg = self._configs[key] = launch_arg(pack_peer_send_config(
                recv=self.group.node_table(self._recv.peer_ptrs), arrive=[self.signals.peer(d, sig.ARRIVE) for d in node],
                ready=self.signals.local(sig.READY), src_info=key[0], error=self.signals.local(sig.ERROR),
                status=key[1], timeout_ns=self.timeout_ns, off_recv=off_recv, rank=self.rank, world=self.world,
                top_k=self.top_k, hidden=self.hidden, max_tokens=self.max_tokens, ranks_per_node=len(node),
                node_first=node.start))
        return cfg

    def gemm_only(self, act, w2, plan: DevicePlan, intermediate: int, rows: int | None = None) -> None:
        """GEMM 2 with the peer sink gated off: the math alone, nothing sent or allocated.
        act and w2: bf16 arrays, or an FP8Act and the FP8Weights (epserve/ffn/fp8_stage.py).
        rows: the rows the call expects (see fused)."""
        cfg = self.send_config(plan.src_info)
        gemm.run(gemm2_specs("peer", act, w2, None, plan.expert_offsets, self.experts_per_rank, self.hidden,
                             intermediate, cfg, -1, rows=rows))

    def _sink_src_info(self, plan, after_direct: bool):
        """What the peer sink and the IPC push read as src_info: the plan's, or across nodes
        with EPSERVE_OFFNODE_SIZES=host after a direct dispatch, the copy in which rows bound
        off-node name their compact return positions (epserve/comm/off_node_sizes.py)."""
        if self.off_node is not None and self.off_node.compact_returns(after_direct):
            return self.off_node.sink_src_info
        return plan.src_info

    def fused(self, act, w2, plan: DevicePlan, topk_idx, topk_weights, intermediate: int, out=None, status=None,
              armed: bool = False, after_direct: bool = False):
        """GEMM 2 whose epilogue writes every row into its home rank's recv; then the reduction.
        act and w2 as for gemm_only: either dtype's GEMM 2 hands the sink the same bf16 tiles.
        armed: the direct dispatch's layout armed this combine already (DirectDispatcher.enqueue's
        arm_combine), so no arm launch here. after_direct: the rows came by the direct
        dispatch of this call (across nodes with sizes "host": compact return blocks)."""
        self.epoch += 1
        cfg = self.send_config(self._sink_src_info(plan, after_direct), status)
        # The rows this rank expects back-of-envelope, what it sent (T x k): the GEMM's build
        # (epserve/ffn/tiles.py) is chosen by them; act is capacity-sized.
        rows = topk_idx.size
        # Across nodes with EPSERVE_OFFNODE_OVERLAP=1: GEMM 2's overlap build, whose off-node rows
        # leave on a side stream while it runs (epserve/comm/off_node_overlap.py).
        under = self.off_node is not None and self.off_node.overlap is not None and overlap_supported(act)
        specs = gemm2_specs("peer", act, w2, None, plan.expert_offsets, self.experts_per_rank, self.hidden,
                            intermediate, cfg, 0, rows=rows,
                            overlap_free_sms=self.off_node.overlap.free_sms if under else None)
        return self._reduce(topk_idx, topk_weights, out, wait=True, status=status, before=specs,
                            key="fused-overlap" if under else "fused", armed=armed, after_direct=after_direct,
                            send_under=(cfg, plan.expert_offsets) if under else None,
                            staged=(cfg, plan.expert_offsets))

    def stand_in(self, status=None, off_node: bool = True, after_direct: bool = False) -> None:
        """This rank's part of a combine it has no tokens for (its input was rejected): the
        epoch moves on with the others'. off_node: the others' combine crosses nodes through
        the off-node carrier (every path but the NCCL combine), so this rank's part does too.
        after_direct: as fused's (the others' combine returns compact blocks, so does this)."""
        self.epoch += 1
        if self.off_node is not None and off_node:  # the carrier's groups are collective: take part with no tokens
            self.off_node.exchange_combine(None, 0, self.top_k, self.hidden, self.experts_per_rank, self.recv, status,
                                           compact=self.off_node.compact_returns(after_direct),
                                           rows=(self.send_config(None, status), None))
        self._launches.run("stand-in", [launchers.release_recv_spec(self._ready_table, self.rank)])

    def unfused(self, C, plan: DevicePlan, topk_idx, topk_weights, out=None, status=None, after_direct: bool = False):
        """C [M, H] (GEMM 2 with the null sink) -> recv slots by the transport -> the reduction.
        after_direct: as fused's."""
        self.epoch += 1
        M, row_bytes = plan.num_recv_rows, self.hidden * 2
        if self.transport == "ipc" or not hasattr(plan, "host"):  # no host plan: C's rows by the IPC push
            cfg = self.send_config(self._sink_src_info(plan, after_direct), status)
            row_moves.push_rows_to_peers(C, M, self.hidden, cfg)
            return self._reduce(topk_idx, topk_weights, out, wait=True, status=status, after_direct=after_direct,
                                staged=(cfg, plan.expert_offsets))
        h = plan.host
        packed = cupy.empty_like(C)
        row_moves.copy_rows(packed, C, None, plan.combine_pack_idx, M, row_bytes)
        staging = cupy.empty((plan.num_send_rows, self.hidden), self.dtype)
        # Rows go back the way they came: what s sent us returns to s, what we sent to r comes back from r.
        exchange_rows(self.nccl, packed, h.recv_counts, h.recv_displs, staging, h.send_counts, h.send_displs,
                      row_bytes)
        row_moves.copy_rows(self.recv, staging, plan.home_slot, None, plan.num_send_rows, row_bytes)
        return self._reduce(topk_idx, topk_weights, out, wait=False, status=status)

    def unfused_nccl(self, C, nccl_path, topk_idx, topk_weights, out=None):
        """C (GEMM 2's null build after nccl_path's dispatch of this call) -> recv slots over
        NCCL, planned on the device (NcclDispatcher.combine) -> the reduction. No host wait."""
        self.epoch += 1
        nccl_path.combine(C, topk_idx.shape[0], self.recv)
        return self._reduce(topk_idx, topk_weights, out, wait=False, status=nccl_path.status)

    def _reduce(self, topk_idx, topk_weights, out, *, wait: bool, status=None, before=(), key="reduce",
                armed: bool = False, after_direct: bool = False, send_under=None, staged=None):
        """The reduction into out (made when None), after the launches in `before`; every
        launch of the call goes through one prepared LaunchSequence entry per (key, T). A
        waiting reduction arms its expected arrivals first, unless the dispatch `armed` them.
        after_direct: as fused's. send_under: (GEMM 2's PeerSendConfig, expert_offsets) when
        `before` holds GEMM 2's overlap build: the off-node send then runs on a side stream
        under it (forked before `before`, joined before the land). staged: (the PeerSendConfig the
        rows bound off-node were staged with, the call's expert_offsets), which the relay route
        walks (epserve/comm/off_node_relay.py)."""
        T = topk_idx.shape[0]
        if out is None:
            out = cupy.empty((T, self.hidden), self.dtype)
        s = self.signals
        specs = list(before)
        if wait and not armed:
            specs.append(launchers.combine_arm_spec(topk_idx, T, self.top_k, self.experts_per_rank, self.world,
                                                    self.hidden // 64, s.local(sig.EXPECTED), status))
        if wait and self.off_node is not None:  # across nodes: the staged rows cross, and land, first
            compact = self.off_node.compact_returns(after_direct)
            if send_under is not None:
                self.off_node.overlap.fork()
            self._launches.run((key, wait, T, armed, "before"), specs)
            if send_under is not None:
                self.off_node.send_combine_under_gemm(*send_under, self.experts_per_rank, status, compact)
                self.off_node.land_combine(topk_idx, T, self.top_k, self.hidden, self.experts_per_rank, self.recv,
                                           status, compact)
            else:
                self.off_node.exchange_combine(topk_idx, T, self.top_k, self.hidden, self.experts_per_rank,
                                               self.recv, status, compact=compact, rows=staged)
            specs = []
        specs.append(launchers.combine_reduce_spec(self.recv, topk_idx, topk_weights, out, T, self.top_k, self.hidden,
                                                   self.world, s.local(sig.ARRIVE), s.local(sig.EXPECTED),
                                                   s.local(sig.ERROR), self.timeout_ns, wait, status,
                                                   self._ready_table, self.rank, self._reduce_blocks_done))
        self._launches.run((key, wait, T, armed), specs)
        return out
