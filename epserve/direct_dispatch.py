"""Direct-store dispatch (cuda/comm/dispatch.cu): each token row crosses to a destination
rank at most once, through that rank's IPC-mapped token regions, and is expanded there into
the expert-contiguous rows of the dispatch order, with counts exchanged on the device.

The host synchronizes once per call, after the count exchange: it needs the number of rows
this rank receives (to size the expert rows), and it turns an overflow or a rejected input on
any rank into the same exception on every rank before any token row moves. Every rank's
count row reaches every rank's table, so every rank reaches the same verdict without an MPI
message. A stopped call still releases the buffers, so the next call finds the protocol in
step.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from . import kernels
from . import signals as sig
from .errors import RankFailedError
from .kernel_structs import MAX_LOCAL_EXPERTS, pack_dispatch_config
from .layout import check_recv_capacity

INPUT_REJECTED = 100  # error code a rank puts in its count row when its own input failed validation

ROUTE_THREADS, ROUTE_WARPS, CHUNK = 1024, 32, 32
LAYOUT_THREADS = MAX_LOCAL_EXPERTS  # kLayoutThreads in dispatch.cu: a thread per local expert


@dataclass
class Dispatched:
    """What dispatch returns: this rank's expert rows and where each came from."""

    rows: cupy.ndarray            # [M, H] bf16, expert-contiguous (dispatch order)
    expert_offsets: cupy.ndarray  # [E_loc + 1] int32
    src_info: cupy.ndarray        # [M] int32, packed (rank << 24) | (token << 4) | slot
    num_rows: int                 # M


class DirectDispatcher:
    def __init__(self, group, signals, *, num_experts: int, top_k: int, hidden: int, max_tokens: int,
                 max_recv_rows: int, wait_timeout_s: float, dtype):
        self.group, self.signals = group, signals
        self.rank, self.world = group.rank, group.world
        self.E, self.k, self.H, self.max_tokens = num_experts, top_k, hidden, max_tokens
        self.max_recv_rows = max_recv_rows
        self.timeout_ns = int(wait_timeout_s * 1e9)
        self.dtype = dtype
        W = self.world
        self.row = self.E + W + 1
        self.meta_len = 1 + 2 * top_k
        self._table = group.allocate(W * self.row * 4)
        self._tokens = group.allocate(W * max_tokens * hidden * 2)
        self._meta = group.allocate(W * max_tokens * self.meta_len * 4)
        self._tok_pos = cupy.empty((max_tokens, W), np.int32)
        self._slot_rank = cupy.empty((max_tokens, top_k), np.int32)
        self._chunk_counts = cupy.empty(((max_tokens + CHUNK - 1) // CHUNK, self.E + W), np.int32)
        self._base = cupy.empty((W, self.E // W), np.int32)
        self._summary = cupy.empty(2 * W + 2, np.int32)
        self._summary_host = cupy.cuda.alloc_pinned_memory(self._summary.nbytes)
        self.epoch = 0
        self._route_smem = (ROUTE_WARPS + 1) * (self.E + W) * 4
        mod = kernels.module("dispatch")
        self._route = mod.get_function("epserve_dispatch_route")
        self._route.max_dynamic_shared_size_bytes = self._route_smem
        self._layout = mod.get_function("epserve_dispatch_layout")
        self._send = mod.get_function("epserve_dispatch_send")
        self._expand = mod.get_function("epserve_dispatch_expand")
        self._release = mod.get_function("epserve_dispatch_release")
        self._sms = cupy.cuda.Device().attributes["MultiProcessorCount"]

    def _config(self) -> np.ndarray:
        s, W = self.signals, self.world
        return pack_dispatch_config(
            count_table=self._table.peer_ptrs, tokens=self._tokens.peer_ptrs, meta=self._meta.peer_ptrs,
            count_arrive=[s.peer(d, sig.COUNT_ARRIVE) for d in range(W)],
            token_arrive=[s.peer(d, sig.TOKEN_ARRIVE) for d in range(W)],
            ready=[s.peer(d, sig.DISPATCH_READY) for d in range(W)],
            my_ready=s.local(sig.DISPATCH_READY), my_count_arrive=s.local(sig.COUNT_ARRIVE),
            my_token_arrive=s.local(sig.TOKEN_ARRIVE), expected_tokens=s.local(sig.EXPECTED_TOKENS),
            error=s.local(sig.ERROR), epoch=self.epoch, timeout_ns=self.timeout_ns, rank=self.rank, world=W,
            num_experts=self.E, top_k=self.k, hidden=self.H, max_tokens=self.max_tokens)

    def dispatch(self, x: cupy.ndarray | None, topk_idx: cupy.ndarray | None, input_error: BaseException | None = None
                 ) -> Dispatched:
        """x [T, H] bf16 and topk_idx [T, k] int32 (already validated on the host), or
        input_error: this rank's own validation failure, which every rank then raises."""
        self.epoch += 1
        cfg = self._config()
        T = 0 if input_error is not None else x.shape[0]
        null = np.uint64(0)
        idx_ptr = null if T == 0 else topk_idx.data.ptr
        self._route((1,), (ROUTE_THREADS,),
                    (idx_ptr, np.int32(T), np.int32(INPUT_REJECTED if input_error is not None else 0), cfg,
                     self._tok_pos, self._slot_rank, self._chunk_counts), shared_mem=self._route_smem)
        expert_offsets = cupy.empty(self.E // self.world + 1, np.int32)
        self._layout((1,), (LAYOUT_THREADS,), (cfg, expert_offsets, self._base, self._summary))
        summary = self._read_summary()
        try:
            self._verdict(summary, input_error)
        except BaseException:
            self._release((1,), (32,), (cfg, np.int32(0)))
            raise
        M = int(summary[self.rank])
        rows = cupy.empty((M, self.H), self.dtype)
        src_info = cupy.empty(M, np.int32)
        if T:
            grid = max(1, min(self._sms * 4, (T + 7) // 8))
            self._send((grid,), (256,), (x, np.int32(T), topk_idx, self._tok_pos, self._slot_rank, cfg))
        arrivals = int(summary[2 * self.world])
        grid = max(1, min(self._sms * 4, (arrivals + 7) // 8))
        self._expand((grid,), (256,), (cfg, self._base, rows, src_info))
        self._release((1,), (32,), (cfg, np.int32(1)))
        return Dispatched(rows, expert_offsets, src_info, M)

    def _read_summary(self) -> np.ndarray:
        host = np.frombuffer(self._summary_host, np.int32, self._summary.size)
        self._summary.get(out=host)  # synchronizes: the one host wait of a dispatch
        return host.copy()

    def _verdict(self, summary: np.ndarray, input_error) -> None:
        """The same decision on every rank, from the count rows every rank has."""
        W = self.world
        if summary[2 * W + 1]:
            self.signals.raise_if_error(self.rank)
        codes = summary[W:2 * W]
        if input_error is not None:
            raise input_error
        rejected = [s for s in range(W) if codes[s] == INPUT_REJECTED]
        if rejected:
            raise RankFailedError(f"dispatch stopped before any row moved: rank(s) {rejected} rejected their input")
        if codes.any():
            bad = [s for s in range(W) if codes[s]]
            if codes[self.rank]:
                self.signals.raise_if_error(self.rank)
            raise RankFailedError(f"dispatch stopped before any row moved: rank(s) {bad} routed to expert ids "
                                  f"outside [-1, {self.E})")
        check_recv_capacity(summary[:W], self.max_recv_rows)
