"""Dispatch: each token row goes to the ranks owning its experts and lands in the
expert-contiguous row order of docs/design.md ("Dispatched rows"). Two transports, identical rows:
  nccl - pack rows by destination, grouped NCCL send/recv, unpack into expert order;
  ipc  - pack into this rank's symmetric send buffer, then every rank pulls its rows from
         the peers' send buffers through IPC (for ranks sharing a GPU, where NCCL refuses).
The ipc transport synchronizes the host twice per call (packing done everywhere before
anyone pulls; pulling done everywhere before anyone repacks); it is the baseline for
shared-GPU correctness runs, not a fast path."""

from __future__ import annotations

import cupy

from epserve.comm import row_moves
from epserve.comm.nccl import exchange_rows
from epserve.dispatch.device_plan import DevicePlan
from epserve.runtime.kernel_structs import launch_arg, pack_peer_pointers


class Dispatcher:
    def __init__(self, group, hidden: int, send_capacity_rows: int, transport: str, nccl_comm=None, dtype=None):
        if transport not in ("nccl", "ipc"):
            raise ValueError(f"unknown dispatch transport {transport!r}")
        self.group = group
        self.hidden = hidden
        self.transport = transport
        self.nccl = nccl_comm
        self.row_bytes = hidden * 2
        self.send_capacity_rows = send_capacity_rows
        self.dtype = dtype
        # The IPC pull reaches the ranks of one node; across nodes this baseline is refused
        # (EPService._refuse_across_nodes), so its buffer and peer table are made on one node
        # only (the same on every rank: they share the layout).
        if transport == "ipc" and len(group.node_ranks) == group.world:
            self._send_buf = group.allocate(max(1, send_capacity_rows) * self.row_bytes)
            self._peer_bases = launch_arg(pack_peer_pointers(self._send_buf.peer_ptrs))

    def dispatch(self, x: cupy.ndarray, plan: DevicePlan) -> cupy.ndarray:
        """x [T, H] bf16 -> the rows this rank's experts receive, [M, H] in expert order."""
        S, M = plan.num_send_rows, plan.num_recv_rows
        if S > self.send_capacity_rows:
            raise ValueError(f"{S} rows to send exceed the send capacity of {self.send_capacity_rows}")
        a = cupy.empty((M, self.hidden), self.dtype)
        if self.transport == "nccl":
            packed = cupy.empty((S, self.hidden), self.dtype)
            row_moves.copy_rows(packed, x, None, plan.send_token, S, self.row_bytes)
            staging = cupy.empty((M, self.hidden), self.dtype)
            h = plan.host
            exchange_rows(self.nccl, packed, h.send_counts, h.send_displs, staging, h.recv_counts, h.recv_displs,
                          self.row_bytes)
            row_moves.copy_rows(a, staging, None, plan.recv_perm, M, self.row_bytes)
            return a
        packed = self._send_buf.view(self.dtype, (S, self.hidden))
        row_moves.copy_rows(packed, x, None, plan.send_token, S, self.row_bytes)
        self._host_barrier()
        row_moves.gather_rows_from_peers(a, self._peer_bases, plan.recv_src_rank, plan.recv_src_pos, M, self.row_bytes)
        self._host_barrier()
        return a

    def _host_barrier(self) -> None:
        cupy.cuda.get_current_stream().synchronize()
        self.group.comm.Barrier()
