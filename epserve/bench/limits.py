"""The hardware's limits, measured in the run that uses them: dense bf16 GEMM rate (cuBLAS),
local device copy bandwidth (bytes read + written), and peer-store bandwidth over NVLink
(a copy kernel storing into the next rank's IPC-mapped buffer, every rank at once)."""

from __future__ import annotations

import cupy
import numpy as np

from epserve.arrays import BF16
from epserve.bench.arithmetic import Rates
from epserve.bench.cublas import gemm_nt
from epserve.bench.events import median_ms
from epserve.comm import row_moves


def gemm_rate(n: int = 8192) -> float:
    a = cupy.random.standard_normal((n, n), dtype=np.float32).astype(BF16)
    b = cupy.random.standard_normal((n, n), dtype=np.float32).astype(BF16)
    c = cupy.empty((n, n), BF16)
    ms = median_ms(lambda: gemm_nt(a.data.ptr, b.data.ptr, c.data.ptr, n, n, n))
    return 2.0 * n**3 / (ms / 1e3)


def fp8_gemm_rates(n: int = 8192) -> dict[str, tuple[float, float]]:
    """Dense FP8 GEMM rates on one n^3 problem with DeepSeek-V3's scales (1 x 128 for A, 128 x
    128 for B), by name: "ours" (the block-scaled e4m3 wgmma kernel GEMM 2 runs) and
    "cuBLASLt" (its block-scaled FP8 GEMM, where reachable: epserve.bench.cublaslt), each as
    (FLOP/s, the SM clock in MHz right after its timing: bench/clock.py). The faster is the FP8
    limit the FP8 rows are rated against, as cuBLAS's bf16 GEMM is for bf16."""
    from epserve.bench import cublaslt
    from epserve.bench.clock import SmClock
    from epserve.ffn import fp8, gemm_fp8

    a = cupy.random.standard_normal((n, n), dtype=np.float32).astype(BF16)
    b = (cupy.random.standard_normal((1, n, n), dtype=np.float32) / np.sqrt(n)).astype(BF16)
    a_q, a_s = fp8.quantize_rows(a)
    b_q, b_s = fp8.quantize_blocks(b)
    c = cupy.empty((n, n), BF16)
    offsets = cupy.asarray(np.array([0, n], np.int32))
    runs = {"ours": lambda: gemm_fp8.grouped_gemm_fp8("null", a_q, a_s, b_q, b_s, c, offsets, 1, n, n)}
    if cublaslt.unavailable() is None:
        runs["cuBLASLt"] = lambda: cublaslt.gemm_fp8_nt(a_q.data.ptr, a_s.data.ptr, b_q.data.ptr, b_s.data.ptr,
                                                        c.data.ptr, n, n, n)
    clock, rates = SmClock(), {}
    for name, run in runs.items():
        flop_s = 2.0 * n**3 / (median_ms(run) / 1e3)
        rates[name] = (flop_s, clock.mhz())
    return rates


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    a = cupy.empty(nbytes, np.uint8)
    b = cupy.empty(nbytes, np.uint8)
    a.fill(1)
    ms = median_ms(lambda: b.__setitem__(Ellipsis, a))
    return 2.0 * nbytes / (ms / 1e3)


def peer_store_bandwidth(comm, peer_buffer, nbytes: int, ranks_per_node: int | None = None) -> float | None:
    """Every rank stores `nbytes` into the `peer_buffer` (a SymmetricBuffer) of the next rank of
    its node, all at once; bytes per second in one direction. None with one rank in a node
    (the buffer is mapped inside a node only: across forced nodes of one rank there is no
    peer to store into)."""
    world, rank = comm.Get_size(), comm.Get_rank()
    R = ranks_per_node or world
    if R == 1:
        return None
    nbytes = min(nbytes, peer_buffer.nbytes) // 4096 * 4096
    src = cupy.empty(nbytes, np.uint8)
    src.fill(3)
    first = rank // R * R
    dst = peer_buffer.peer_ptr(first + (rank - first + 1) % R)
    rows = nbytes // 4096
    comm.Barrier()
    ms = median_ms(lambda: row_moves.copy_rows(dst, src, None, None, rows, 4096))
    cupy.cuda.runtime.deviceSynchronize()
    comm.Barrier()  # nobody leaves while a peer still stores into its buffer
    return nbytes / (ms / 1e3)


def measure(comm, peer_buffer, shared_gpu: bool, ranks_per_node: int | None = None) -> Rates:
    """All three limits, the slowest rank's. Where ranks share a GPU (or a node holds one rank)
    there is no link: the peer rate is then the device copy rate, and the preamble says so."""
    from mpi4py import MPI

    copy = copy_bandwidth()
    gemm = gemm_rate()
    peer = None if shared_gpu else peer_store_bandwidth(comm, peer_buffer, 512 << 20, ranks_per_node)
    gemm, copy, peer = (comm.allreduce(v, op=MPI.MIN) for v in (gemm, copy, peer or copy))
    return Rates(gemm_flop_s=gemm, copy_bytes_s=copy, peer_bytes_s=peer)
