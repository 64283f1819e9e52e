"""The NCCL transport, planned on the device: dispatch and the unfused combine over NCCL with
no MPI call and no host wait (docs/design.md, "Dispatch", "Synchronisation").

Dispatch, per call, all on the current stream:
  count + publish        the direct dispatch's route (epserve/dispatch/route.py); the count row
                         (rows per expert, tokens per destination, an error code) goes into this
                         rank's row of a local table [W][E + W + 1]
  ncclAllGather          in place: every rank's count row into every rank's table
  rank + layout          each slot's rank in its expert, each token's position per destination;
                         then the direct dispatch's layout and verdict, from that table, plus the
                         combine's return positions
  pack                   each token row once per destination rank (deduplicated), into that
                         destination's block of max_tokens rows, its routing beside it
  grouped send/recv      every block to its rank, sizes fixed when the service starts
  expand                 arrived rows into the dispatch order, src_info and the combine's
                         send index of each row: bitwise the direct dispatch's rows
The unfused combine: GEMM 2's null build stores C; combine_pack puts each row into its home
rank's return block (combine_cap rows per rank, at the position the home rank computes from
the same count rows), one grouped send/recv, combine_unpack puts the arrived rows into the
recv slots [T, k, H] the peer sink writes, and the same reduction follows.

NCCL's sizes are host arguments, so every block has a fixed capacity (padding_factors says
what that costs); since the counts never reach the host, the path can be captured in a CUDA
graph. A call the verdict stopped still makes every NCCL call (the ranks cannot know it on
the host), but pack and expand move nothing and the reduction poisons the output."""

from __future__ import annotations

from math import comb

import cupy
import numpy as np

from epserve.comm import signals as sig
from epserve.dispatch import result
from epserve.dispatch.direct import INPUT_REJECTED, MOVE_THREADS
from epserve.dispatch.result import Dispatched, RowCount
from epserve.dispatch.route import Route
from epserve.runtime import kernels
from epserve.runtime.kernel_structs import i32, launch_arg, pack_dispatch_config, u64
from epserve.runtime.launch import LaunchSequence

_NULL = u64(0)


def combine_capacity(max_tokens: int, top_k: int, experts_per_rank: int, max_recv_rows: int) -> int:
    """Rows one rank can return to one home rank in one call: the home rank sent at most
    max_tokens tokens, each feeding at most min(k, E_loc) of this rank's experts, and this
    rank received at most max_recv_rows rows in all (the verdict stops a call that would)."""
    return max(1, min(max_tokens * min(top_k, experts_per_rank), max_recv_rows))


def block_positions(counts_by_rank: np.ndarray, experts_per_rank: int) -> np.ndarray:
    """What the layout kernel's return scans compute, in NumPy: counts_by_rank [W, E] (rank s's
    rows per global expert, its count row) -> ret_base [W, E]: for source s and expert e of
    rank d, where s's rows for e start in the block that d returns to s (exclusive prefix over
    d's experts). The sender d reads it as ret_base[s][d * E_loc + e], the home rank s as
    home_base[d * E_loc + e]: the same number."""
    W, E = counts_by_rank.shape
    c = counts_by_rank.reshape(W, E // experts_per_rank, experts_per_rank)
    return (np.cumsum(c, axis=2) - c).reshape(W, E)


def expected_dedup_fraction(num_experts: int, top_k: int, world: int) -> float:
    """Probability that a token routed uniformly to top_k distinct experts sends its row to a
    given rank: 1 - C(E - E_loc, k) / C(E, k)."""
    e_loc = num_experts // world
    return 1.0 - comb(num_experts - e_loc, top_k) / comb(num_experts, top_k)


def padding_factors(num_experts: int, top_k: int, world: int, max_tokens: int, tokens: int | None = None,
                    max_recv_rows: int | None = None) -> tuple[float, float]:
    """Bytes the fixed blocks carry over the bytes of the real rows, for uniform routing with
    T = tokens (default max_tokens) per rank: (dispatch, combine)."""
    T = max_tokens if tokens is None else tokens
    e_loc = num_experts // world
    recv = max_recv_rows if max_recv_rows is not None else max_tokens * world * min(top_k, e_loc)
    real_tokens = T * expected_dedup_fraction(num_experts, top_k, world)
    real_rows = T * top_k / world
    return max_tokens / real_tokens, combine_capacity(max_tokens, top_k, e_loc, recv) / real_rows


class NcclDispatcher:
    """One rank's NCCL dispatch and combine. After enqueue, `rows`, `expert_offsets` and
    `src_info` hold this call's rows (capacity-sized; expert_offsets[-1] rows are valid) and
    `status` its call status, as DirectDispatcher's; combine() brings GEMM 2's rows home.
    Buffers are made on first use (fused-only services never pay for them)."""

    def __init__(self, nccl_comm, signals, *, rank: int, world: int, num_experts: int, top_k: int, hidden: int,
                 max_tokens: int, max_recv_rows: int, dtype, combine_hidden: int | None = None):
        """hidden: the width of the rows the dispatch moves (bf16 elements); combine_hidden:
        that of GEMM 2's rows the combine brings home (default hidden; FP8 experts dispatch
        packed rows of another width)."""
        self.nccl, self.signals = nccl_comm, signals
        self.rank, self.world = rank, world
        self.E, self.k, self.H, self.max_tokens = num_experts, top_k, hidden, max_tokens
        self.combine_H = hidden if combine_hidden is None else combine_hidden
        self.e_loc = num_experts // world
        self.max_recv_rows = max_recv_rows
        self.dtype = dtype
        self.row = num_experts + world + 1
        self.meta_len = 1 + 2 * top_k
        self.combine_cap = combine_capacity(max_tokens, top_k, self.e_loc, max_recv_rows)
        self._ready = False
        self._combine_ready = False

    # ---- buffers and kernels, made once --------------------------------------------------
    def _setup(self) -> None:
        if self._ready:
            return
        W, T, H, k, E = self.world, self.max_tokens, self.H, self.k, self.E
        self._table = cupy.zeros(W * self.row, np.int32)
        self._send_tok = cupy.empty((max(1, W - 1) * T, H), self.dtype)
        self._send_meta = cupy.zeros(max(1, W - 1) * T * self.meta_len, np.int32)
        self._recv_tok = cupy.empty((W * T, H), self.dtype)
        self._recv_meta = cupy.zeros(W * T * self.meta_len, np.int32)
        self.route = Route("nccl", num_experts=E, world=W, top_k=k, max_tokens=T)
        self._base = cupy.empty((W, self.e_loc), np.int32)
        self._ret_base = cupy.empty((W, self.e_loc), np.int32)
        self._home_base = cupy.empty(E, np.int32)
        self.home_idx = cupy.full(T * k, -1, np.int32)
        self.ret_idx = cupy.full(self.max_recv_rows, -1, np.int32)
        self.status = cupy.zeros(2, np.int32)
        self.expert_offsets = cupy.zeros(self.e_loc + 1, np.int32)
        self.rows = cupy.zeros((self.max_recv_rows, H), self.dtype)
        self.src_info = cupy.zeros(self.max_recv_rows, np.int32)
        mod = kernels.module("dispatch")
        self._pack = mod.get_function("epserve_nccl_dispatch_pack")
        self._expand = mod.get_function("epserve_nccl_dispatch_expand")
        self._sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        # Only the scalars, error and status are read from it: the NCCL kernels get their
        # buffers as arguments, and NCCL reaches every rank itself (no IPC tables: a "node" of
        # this rank alone). Packed and wrapped once.
        none = [0]
        self._cfg = launch_arg(pack_dispatch_config(
            count_table=none, tokens=none, meta=none, count_arrive=none, ready=none, my_ready=0, my_count_arrive=0,
            error=self.signals.local(sig.ERROR), status=self.status.data.ptr, timeout_ns=0, off_count_row=0,
            off_blocks=0, off_block_bytes=0, rank=self.rank, world=W, num_experts=E, top_k=k, hidden=H,
            max_tokens=T, max_recv_rows=self.max_recv_rows, ranks_per_node=1, node_first=self.rank))
        self._expand_grid = (max(1, min(self._sms * 4, (W * T + 7) // 8)),)
        self.row_count = RowCount(self.expert_offsets)
        self._shapes = {}
        # The dispatch's launches, prepared once per (T, rejected), in three runs around the two
        # NCCL calls: a call rewrites only x and topk_idx.
        self.launches = LaunchSequence()
        self._ready = True

    def _setup_combine(self) -> None:
        if self._combine_ready:
            return
        self._setup()
        rows = max(1, self.world - 1) * self.combine_cap
        self._send_c = cupy.empty((rows, self.combine_H), self.dtype)
        self._recv_c = cupy.empty((rows, self.combine_H), self.dtype)
        mod = kernels.module("dispatch")
        self._cpack = mod.get_function("epserve_nccl_combine_pack")
        self._cunpack = mod.get_function("epserve_nccl_combine_unpack")
        self._cpack_grid = (max(1, min(self._sms * 4, (self.max_recv_rows + 7) // 8)),)
        self._combine_ready = True

    def _launch_shape(self, T: int, rejected: bool) -> tuple:
        key = (T, rejected)
        shape = self._shapes.get(key)
        if shape is None:
            pack_grid = (max(1, min(self._sms * 2, (T + 7) // 8)),)
            shape = self._shapes[key] = (i32(T), i32(INPUT_REJECTED if rejected else 0), pack_grid)
        return shape

    def _exchange(self, pairs) -> None:
        """One grouped NCCL call: for each peer p, each (send, recv, bytes_per_block) pair sends
        block peer_block(p) of `send` to p and receives p's into block p of `recv`, or block
        peer_block(p) with recv_by_rank False. pairs: (send, recv, block_bytes, recv_by_rank)."""
        from cupy.cuda import nccl

        stream = cupy.cuda.get_current_stream().ptr
        nccl.groupStart()
        try:
            for p in range(self.world):
                if p == self.rank:
                    continue
                b = p - (p > self.rank)
                for send, recv, nbytes, recv_by_rank in pairs:
                    self.nccl.send(send.data.ptr + b * nbytes, nbytes, nccl.NCCL_UINT8, p, stream)
                    self.nccl.recv(recv.data.ptr + (p if recv_by_rank else b) * nbytes, nbytes, nccl.NCCL_UINT8, p,
                                   stream)
        finally:
            nccl.groupEnd()

    # ---- dispatch ------------------------------------------------------------------------
    def enqueue(self, x: cupy.ndarray | None, topk_idx: cupy.ndarray | None, rejected: bool = False) -> None:
        """Queue one dispatch on the current stream; no host wait, no MPI. Collective: every
        rank makes the same NCCL calls, rejected (x and topk_idx None: this rank's input failed
        its host checks, and its count row stops the call everywhere) or not."""
        from cupy.cuda import nccl

        self._setup()
        cfg, W = self._cfg, self.world
        T = 0 if rejected else x.shape[0]
        t, code, pack_grid = self._launch_shape(T, rejected)
        if T == 0:
            x = topk_idx = _NULL
        stream = cupy.cuda.get_current_stream().ptr
        route, key = self.route, (T, rejected)
        self.launches.run(("route",) + key, [route.count_publish_spec(topk_idx, T, t, code, cfg, self._table)], stream)
        row_bytes = self.row * 4
        if W > 1:
            self.nccl.allGather(self._table.data.ptr + self.rank * row_bytes, self._table.data.ptr, row_bytes,
                                nccl.NCCL_UINT8, stream)
        self.launches.run(("plan",) + key, [
            route.rank_layout_spec(topk_idx, T, t, cfg, self._table, self.expert_offsets, self._base, self._ret_base,
                                   self._home_base),
            (self._pack, pack_grid, (MOVE_THREADS,), (x, t, topk_idx, route.tok_pos, route.slot_rank, cfg,
                                                      self._send_tok, self._send_meta, self._recv_tok, self._recv_meta,
                                                      self._home_base, self.home_idx, i32(self.combine_cap)), 0),
        ], stream)
        if W > 1:
            T_max = self.max_tokens
            self._exchange(((self._send_tok, self._recv_tok, T_max * self.H * 2, True),
                            (self._send_meta, self._recv_meta, T_max * self.meta_len * 4, True)))
        self.launches.run(("expand",), [
            (self._expand, self._expand_grid, (MOVE_THREADS,), (cfg, self._table, self._recv_tok, self._recv_meta,
                                                                self._base, self._ret_base, self.rows, self.src_info,
                                                                self.ret_idx, i32(self.combine_cap)), 0),
        ], stream)

    def rows_received(self) -> int:
        """This call's row count, read on the host (waits for the stream): for the public
        dispatch only, never for forward."""
        return self.row_count.wait()

    def dispatch(self, x, topk_idx, input_error: BaseException | None = None) -> Dispatched:
        """Dispatch and wait for it, raising as DirectDispatcher.dispatch does."""
        self.enqueue(x, topk_idx, rejected=input_error is not None)
        return result.take(self, self.rank, input_error, cupy.cuda.get_current_stream().ptr)

    # ---- combine -------------------------------------------------------------------------
    def combine(self, C: cupy.ndarray | None, T: int, recv: cupy.ndarray) -> None:
        """Rows of C (GEMM 2's null build, dispatch order, this call's dispatch) into their
        home ranks' recv slots, and this rank's slots [T, k, H] filled from its peers; no host
        wait. C None: this rank takes part with nothing (its input was rejected, so the call
        is stopped everywhere)."""
        self._setup_combine()
        status = self.status
        if C is not None:
            self._cpack(self._cpack_grid, (MOVE_THREADS,), (C, self.expert_offsets, i32(self.e_loc), self.src_info,
                                                            self.ret_idx, self._send_c, recv, i32(self.combine_H),
                                                            i32(self.k),
                                                            i32(self.rank), status))
        if self.world > 1:
            self._exchange(((self._send_c, self._recv_c, self.combine_cap * self.combine_H * 2, False),))
        slots = T * self.k
        if C is not None and slots:
            grid = (max(1, min(self._sms * 4, (slots + 7) // 8)),)
            self._cunpack(grid, (MOVE_THREADS,), (self._recv_c, self.home_idx, i32(slots), i32(self.combine_H), recv,
                                                  status))
