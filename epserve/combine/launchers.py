"""The combine's kernel launches (cuda/comm/combine.cu) as specs, (kernel, grid, block, args,
shared_mem), for the combiner's LaunchSequence: arm the expected arrivals, reduce the k
slots of every token (and release the receive buffer to the peers), or release it alone."""

from __future__ import annotations

import cupy

from epserve.runtime import kernels
from epserve.runtime.kernel_structs import i32, u64
from epserve.runtime.launch import pointer, resident_blocks

COMBINE_ARM_THREADS = 1024  # kCombineArmThreads in cuda/comm/combine.cu
REDUCE_THREADS = 128


def combine_arm_spec(topk_idx, T: int, k: int, experts_per_rank: int, world: int, units_per_slot: int,
                     expected_ptr: int, status=None) -> tuple:
    """expected[s] += units of this call's slots owned by rank s (expected: per-sender array),
    unless the call status says the dispatch verdict stopped the call."""
    fn = kernels.function("combine", "epserve_combine_arm")
    return (fn, (1,), (COMBINE_ARM_THREADS,), (pointer(topk_idx), i32(T), i32(k), i32(experts_per_rank), i32(world),
                               i32(units_per_slot), u64(expected_ptr), pointer(status)), 0)


def combine_reduce_spec(recv, topk_idx, topk_weights, out, T: int, k: int, H: int, world: int, arrive_ptr: int,
                        expected_ptr: int, error_ptr: int, timeout_ns: int, wait: bool, status, peer_ready_table,
                        rank: int, blocks_done) -> tuple:
    """The reduction; a failed call (status, or its own wait running out) poisons out. Its last
    block releases recv to every peer (peer_ready_table), counting blocks in blocks_done (one
    uint32, zero between launches)."""
    # top_k <= 8 (DeepSeek-V3, Mixtral, Qwen3): the build with half the load registers
    fn = kernels.function("combine", "epserve_combine_reduce_k8" if k <= 8 else "epserve_combine_reduce")
    blocks = max(1, min(T, resident_blocks(fn, REDUCE_THREADS, cupy.cuda.runtime.getDevice())))
    args = (pointer(recv), pointer(topk_idx), pointer(topk_weights), pointer(out), i32(T), i32(k), i32(H), i32(world),
            u64(arrive_ptr), u64(expected_ptr), u64(error_ptr), u64(timeout_ns), i32(1 if wait else 0), pointer(status),
            peer_ready_table, i32(rank), pointer(blocks_done))
    return (fn, (blocks,), (REDUCE_THREADS,), args, 0)


def release_recv_spec(peer_ready_table, rank: int) -> tuple:
    """recv is read: every peer of this node may store the next combine's rows (alone: a
    rank's part of a call it has no tokens for; the reduction releases recv itself)."""
    fn = kernels.function("combine", "epserve_release_recv")
    return (fn, (1,), (32,), (peer_ready_table, i32(rank)), 0)
