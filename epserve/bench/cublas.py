"""bf16 GEMM through cuBLAS (cublasGemmEx via CuPy's bindings), fp32 accumulation: the
library baseline and the dense-GEMM rate of the hardware limits."""

from __future__ import annotations

import cupy
import numpy as np

CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1

_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)


def gemm_nt(A_ptr: int, B_ptr: int, C_ptr: int, M: int, N: int, K: int) -> None:
    """C [M, N] = A [M, K] @ B [N, K]^T, all row-major bf16, on the current stream.

    Row-major C is column-major C^T = B A^T: cuBLAS gets B transposed and A as is."""
    from cupy_backends.cuda.libs import cublas

    if M == 0:
        return
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, N, M, K, _ONE.ctypes.data, B_ptr, CUDA_R_16BF, K,
                  A_ptr, CUDA_R_16BF, K, _ZERO.ctypes.data, C_ptr, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                  CUBLAS_GEMM_DEFAULT)


def grouped_gemm_per_expert(A, B, C, expert_offsets_host) -> None:
    """C[rows of e] = A[rows of e] @ B[e]^T, one cuBLAS call per expert with rows."""
    E, N, K = B.shape
    row_bytes_a, row_bytes_c, expert_bytes = K * 2, N * 2, N * K * 2
    for e in range(E):
        lo, hi = int(expert_offsets_host[e]), int(expert_offsets_host[e + 1])
        if hi > lo:
            gemm_nt(A.data.ptr + lo * row_bytes_a, B.data.ptr + e * expert_bytes, C.data.ptr + lo * row_bytes_c,
                    hi - lo, N, K)
