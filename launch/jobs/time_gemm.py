"""The grouped GEMM alone on one GPU, against cuBLAS per expert, at the layer's two shapes:

    python launch/jobs/time_gemm.py [--rows 32768] [--experts 128]

GEMM 1 (N = 2I, K = H) and GEMM 2 (N = H, K = I), rows spread evenly over the experts: our
two kernels (the wgmma one also in its peer build, gated off) and cuBLAS; CUDA-event
medians, TFLOP/s, and the largest difference of the wgmma output from cuBLAS's. One process: no communication in the numbers."""

from __future__ import annotations

import argparse

import cupy
import numpy as np

from epserve import ops
from epserve.arrays import BF16
from epserve.bench.cublas import gemm_nt, grouped_gemm_per_expert
from epserve.bench.events import median_ms
from epserve.kernel_structs import PEER_SEND_CONFIG


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    args = p.parse_args()
    M, E, H, I = args.rows, args.experts, args.hidden, args.intermediate
    offsets_host = np.linspace(0, M, E + 1).astype(np.int32)
    offsets = cupy.asarray(offsets_host)
    rs = cupy.random.RandomState(5)
    print(f"# grouped GEMM, {M} rows over {E} experts; {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'GEMM':<8}{'N':>7}{'K':>7}{'path':>22}{'ms':>9}{'TFLOP/s':>10}{'max |diff|':>12}")
    dense(rs, 8192)
    for name, N, K in (("GEMM 1", 2 * I, H), ("GEMM 2", H, I)):
        grouped(rs, name, M, N, K, E, offsets, offsets_host)


def dense(rs, n):
    a = rs.standard_normal((n, n), dtype=np.float32).astype(BF16)
    c = cupy.empty((n, n), BF16)
    ms = median_ms(lambda: gemm_nt(a.data.ptr, a.data.ptr, c.data.ptr, n, n, n))
    print(f"{'dense':<8}{n:>7}{n:>7}{'cuBLAS':>22}{ms:>9.3f}{2 * n**3 / ms / 1e9:>10.1f}{'':>12}")


def grouped(rs, name, M, N, K, E, offsets, offsets_host):
    A = rs.standard_normal((M, K), dtype=np.float32).astype(BF16)
    B = (rs.standard_normal((E, N, K), dtype=np.float32) / np.sqrt(K)).astype(BF16)
    C_ours, C_lib = cupy.empty((M, N), BF16), cupy.empty((M, N), BF16)
    gated_off = np.zeros(1, PEER_SEND_CONFIG)
    flops = 2.0 * M * N * K
    runs = {
        "mma (null sink)": lambda: ops.grouped_gemm("null", A, B, C_ours, offsets, E, N, K, impl="mma"),
        "wgmma (peer, gated)": lambda: ops.grouped_gemm("peer", A, B, None, offsets, E, N, K, gated_off, -1,
                                                        impl="wgmma"),
        "wgmma (null sink)": lambda: ops.grouped_gemm("null", A, B, C_ours, offsets, E, N, K, impl="wgmma"),
        "cuBLAS per expert": lambda: grouped_gemm_per_expert(A, B, C_lib, offsets_host),
    }
    for path, fn in runs.items():
        ms = median_ms(fn)
        diff = ""
        if path == "cuBLAS per expert":
            diff = f"{float(cupy.abs(C_ours.astype(np.float32) - C_lib.astype(np.float32)).max()):.4f}"
        print(f"{name:<8}{N:>7}{K:>7}{path:>22}{ms:>9.3f}{flops / ms / 1e9:>10.1f}{diff:>12}")


if __name__ == "__main__":
    main()
