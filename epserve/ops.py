"""Launchers of epserve's kernels on the current CuPy stream: arguments in the exact types
the CUDA signatures take, grid sizes, and the shared-memory opt-in. No validation of user
input here (the service does that once, before any data moves); only internal invariants."""

from __future__ import annotations

import functools
import os

import cupy
import numpy as np

from . import kernels, tma
from .kernel_structs import PEER_SEND_CONFIG

NULL = np.uint64(0)


def _ptr(a) -> np.uint64:
    if a is None:
        return NULL
    if isinstance(a, (int, np.integer)):
        return np.uint64(a)
    return np.uint64(a.data.ptr)


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return cupy.cuda.Device(device).attributes["MultiProcessorCount"]


def _module_int(mod, name: str) -> int:
    host = np.zeros(1, np.int32)
    mem = mod.get_global(name)
    mem.copy_to_host(host.ctypes.data, 4)
    return int(host[0])


@functools.lru_cache(maxsize=None)
def _gemm_kernel(sink: str, impl: str, device: int):
    if impl == "mma":
        mod, name = kernels.module(f"gemm_{sink}"), "epserve_grouped_gemm"
    else:
        mod, name = kernels.module(f"gemm_wgmma_{sink}"), "epserve_grouped_gemm_wgmma"
    fn = mod.get_function(name)
    smem = _module_int(mod, "epserve_gemm_smem_bytes")
    threads = _module_int(mod, "epserve_gemm_threads")
    fn.max_dynamic_shared_size_bytes = smem
    return fn, smem, threads


_NO_PEERS = np.zeros(1, PEER_SEND_CONFIG)  # what the null sink is given: it never reads it


GEMM_IMPLS = ("wgmma", "mma")


def gemm_impl() -> str:
    """Which grouped GEMM runs: $EPSERVE_GEMM, "wgmma" (TMA + wgmma, warp-specialized) by
    default, or "mma" (mma.sync + cp.async: about half as fast, kept as the simpler kernel
    the fast one is checked against)."""
    impl = os.environ.get("EPSERVE_GEMM", "wgmma")
    if impl not in GEMM_IMPLS:
        raise ValueError(f"EPSERVE_GEMM must be one of {GEMM_IMPLS}, got {impl!r}")
    return impl


def grouped_gemm(sink: str, A, B, C, expert_offsets, num_experts: int, N: int, K: int, cfg=None, gate: int = 0,
                 impl: str | None = None) -> None:
    """C[m] = A[m] @ B[e]^T per expert; `sink` "null" stores C, "peer" sends to recv (C may be None).
    A [M, K] and B [E, N, K] are CuPy bf16 arrays."""
    if cfg is None:
        assert sink == "null", "the peer sink needs its PeerSendConfig"
        cfg = _NO_PEERS
    assert K % 64 == 0 and N % 64 == 0, (N, K)
    device = cupy.cuda.runtime.getDevice()
    impl = impl or gemm_impl()
    fn, smem, threads = _gemm_kernel(sink, impl, device)
    if impl == "mma":
        args = (_ptr(A), _ptr(B), _ptr(C), _ptr(expert_offsets), np.int32(num_experts), np.int32(N), np.int32(K),
                cfg, np.int32(gate))
    else:
        M = A.shape[0]
        if M == 0:
            return  # no rows, no tiles (and a tensor map cannot have an empty dimension)
        map_a = tma.bf16_rows_map(A.data.ptr, M, K, box_rows=128)
        map_b = tma.bf16_rows_map(B.data.ptr, num_experts * N, K, box_rows=256)
        args = (map_a, map_b, _ptr(C), _ptr(expert_offsets), np.int32(num_experts), np.int32(N), np.int32(K), cfg,
                np.int32(gate))
    fn((_sm_count(device),), (threads,), args, shared_mem=smem)


def swiglu(h, act, M: int, intermediate: int) -> None:
    fn = kernels.function("swiglu", "epserve_swiglu")
    pairs = M * intermediate // 2
    blocks = max(1, min(_sm_count(cupy.cuda.runtime.getDevice()) * 8, (pairs + 255) // 256))
    fn((blocks,), (256,), (_ptr(h), _ptr(act), np.int64(M), np.int32(intermediate)))


def _row_grid(rows: int) -> int:
    return max(1, min(_sm_count(cupy.cuda.runtime.getDevice()) * 16, (rows + 7) // 8))


def copy_rows(dst, src, dst_idx, src_idx, rows: int, row_bytes: int) -> None:
    """dst[dst_idx[i] or i] = src[src_idx[i] or i]; rows of row_bytes (a multiple of 16)."""
    if rows == 0:
        return
    fn = kernels.function("rows", "epserve_copy_rows")
    fn((_row_grid(rows),), (256,), (_ptr(dst), _ptr(src), _ptr(dst_idx), _ptr(src_idx), np.int32(rows),
                                    np.int32(row_bytes)))


def gather_rows_from_peers(dst, peer_bases, src_rank, src_pos, rows: int, row_bytes: int) -> None:
    if rows == 0:
        return
    fn = kernels.function("rows", "epserve_gather_rows_from_peers")
    fn((_row_grid(rows),), (256,), (_ptr(dst), peer_bases, _ptr(src_rank), _ptr(src_pos), np.int32(rows),
                                    np.int32(row_bytes)))


def push_rows_to_peers(C, M: int, H: int, cfg) -> None:
    """The unfused combine over IPC: C's rows into their home ranks' recv slots, signalled."""
    if M == 0:
        return
    fn = kernels.function("rows", "epserve_push_rows_to_peers")
    blocks = max(1, min(_sm_count(cupy.cuda.runtime.getDevice()) * 4, (M + 31) // 32))
    fn((blocks,), (256,), (_ptr(C), np.int32(M), np.int32(H), cfg))


def combine_arm(topk_idx, T: int, k: int, experts_per_rank: int, world: int, units_per_slot: int,
                expected_ptr: int) -> None:
    """expected[s] += units of this call's slots owned by rank s (expected: per-sender array)."""
    fn = kernels.function("combine", "epserve_combine_arm")
    fn((1,), (256,), (_ptr(topk_idx), np.int32(T), np.int32(k), np.int32(experts_per_rank), np.int32(world),
                      np.int32(units_per_slot), np.uint64(expected_ptr)))


def combine_reduce(recv, topk_idx, topk_weights, out, T: int, k: int, H: int, world: int, arrive_ptr: int,
                   expected_ptr: int, error_ptr: int, timeout_ns: int, wait: bool) -> None:
    fn = kernels.function("combine", "epserve_combine_reduce")
    blocks = max(1, min(T, _sm_count(cupy.cuda.runtime.getDevice()) * 8))
    fn((blocks,), (128,), (_ptr(recv), _ptr(topk_idx), _ptr(topk_weights), _ptr(out), np.int32(T), np.int32(k),
                           np.int32(H), np.int32(world), np.uint64(arrive_ptr), np.uint64(expected_ptr),
                           np.uint64(error_ptr), np.uint64(timeout_ns), np.int32(1 if wait else 0)))


def release_recv(peer_ready_table, rank: int, world: int) -> None:
    fn = kernels.function("combine", "epserve_release_recv")
    fn((1,), (32,), (peer_ready_table, np.int32(rank), np.int32(world)))
