"""The route both dispatches share (cuda/comm/dispatch_route.cuh): two launches a call.

    count + publish   a warp per 32-token chunk counts rows per expert and tokens per
                      destination; the grid's last CTA scans the chunks into chunk bases and
                      this rank's count row, and publishes the row
    rank + layout     a warp per chunk ranks each slot in its expert and positions each token
                      per destination; the grid's last CTA computes the layout and verdict

Up to MAX_PEERS ranks (one node) the kernels keep a token's destination set in one register;
with more, their *_wide builds (the same source) in several.

The transports differ only in where the count row goes (every rank's table through IPC, or
this rank's row of a local table that an allgather completes) and in what the layout also
writes, so each passes those as extra arguments; the buffers, grids, block sizes, shared
memory and the done counters (each reset by its kernel's last CTA, so no memset) live here.
"""

from __future__ import annotations

import cupy
import numpy as np

from epserve.runtime import kernels
from epserve.runtime.kernel_structs import MAX_LOCAL_EXPERTS, MAX_PEERS

CHUNK = 32  # kChunk in dispatch_common.cuh: tokens per warp-chunk
COUNT_THREADS = 1024  # kCountThreads: the last CTA's scan takes a thread per counter
COUNT_CHUNKS_PER_CTA = COUNT_THREADS // 32  # kCountWarps: a count CTA scans its own warps' chunks
RANK_THREADS = MAX_LOCAL_EXPERTS  # kRankThreads: the last CTA's layout takes a thread per local expert

_KERNELS = {  # transport -> (count + publish, rank + layout)
    "direct": ("epserve_dispatch_route_count_publish", "epserve_dispatch_route_rank_layout"),
    "nccl": ("epserve_nccl_dispatch_count_publish", "epserve_nccl_dispatch_rank_layout"),
}


def count_ctas(chunks: int) -> int:
    """The count kernel's grid for `chunks` chunks: a CTA per COUNT_CHUNKS_PER_CTA, at least one."""
    return max(1, -(-chunks // COUNT_CHUNKS_PER_CTA))


class Route:
    """One rank's route kernels and buffers for `transport` ("direct" or "nccl"). After a
    call's two launches, tok_pos [T, W] holds each token's position in each destination's
    rows (-1: none) and slot_rank [T, k] each slot's rank among its expert's rows from this
    rank (-1: unused)."""

    def __init__(self, transport: str, *, num_experts: int, world: int, top_k: int, max_tokens: int):
        count_name, rank_name = _KERNELS[transport]
        if world > MAX_PEERS:  # a token's destination set in several registers (cuda/comm/dispatch.cu)
            count_name, rank_name = count_name + "_wide", rank_name + "_wide"
        width = num_experts + world  # a chunk's counters: rows per expert, tokens per destination
        self.tok_pos = cupy.empty((max_tokens, world), np.int32)
        self.slot_rank = cupy.empty((max_tokens, top_k), np.int32)
        # A row per chunk (its bases within its count CTA), then a row per count CTA (the CTA's bases)
        chunks = (max_tokens + CHUNK - 1) // CHUNK
        self.chunk_counts = cupy.empty((chunks + count_ctas(chunks), width), np.int32)
        self.bad_slot = cupy.full(1, 0x7FFFFFFF, np.int32)  # the lowest bad (t, j); the scan resets it
        done = cupy.zeros(2, np.uint32)  # finished CTAs of each kernel; its last CTA zeroes it
        self._count_done, self._rank_done = done[0:1], done[1:2]
        mod = kernels.module("dispatch")
        self.count_publish = mod.get_function(count_name)
        self.rank_layout = mod.get_function(rank_name)
        # Per warp, a counter per expert and destination (count) or the masks and bases (rank).
        self.count_smem = COUNT_THREADS // 32 * width * 4
        self.rank_smem = RANK_THREADS // 32 * width * 4
        self.count_publish.max_dynamic_shared_size_bytes = self.count_smem
        self.rank_layout.max_dynamic_shared_size_bytes = self.rank_smem
        self._sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._grids = {}

    def grids(self, T: int) -> tuple:
        """(count grid, rank grid) for T tokens: a warp per chunk, at least one CTA (its last
        CTA publishes and lays out even when T is 0). The count kernel takes exactly a CTA per
        COUNT_CHUNKS_PER_CTA chunks (its CTAs scan their own chunks); the rank kernel's warps
        stride over the chunks."""
        grids = self._grids.get(T)
        if grids is None:
            chunks = (T + CHUNK - 1) // CHUNK
            warps = RANK_THREADS // 32
            rank_ctas = max(1, min(self._sms * 2, (chunks + warps - 1) // warps))
            grids = self._grids[T] = ((count_ctas(chunks),), (rank_ctas,))
        return grids

    def count_publish_spec(self, topk_idx, T: int, t, code, cfg, *publish_args) -> tuple:
        """The count + publish launch (a LaunchSequence spec); t and code are the i32 arguments
        of T and the input's error code, publish_args the transport's own (nccl: its table)."""
        return (self.count_publish, self.grids(T)[0], (COUNT_THREADS,),
                (topk_idx, t, code, cfg, self.chunk_counts, self.bad_slot, self._count_done, *publish_args),
                self.count_smem)

    def rank_layout_spec(self, topk_idx, T: int, t, cfg, *layout_args) -> tuple:
        """The rank + layout launch; layout_args the transport's layout outputs (direct:
        expert_offsets, base; nccl: table, expert_offsets, base, ret_base, home_base)."""
        return (self.rank_layout, self.grids(T)[1], (RANK_THREADS,),
                (topk_idx, t, cfg, self.chunk_counts, self.tok_pos, self.slot_rank, self._rank_done, *layout_args),
                self.rank_smem)
