"""Block-scaled FP8 GEMM through cuBLASLt (cublasLtMatmul, called with ctypes): the library
baseline of the FP8 presets and their dense limit, as cuBLAS's bf16 GEMM is for bf16.

cuBLASLt 12.9+ on Hopper takes DeepSeek-V3's recipe: e4m3 operands, one fp32 scale per 1 x 128
of the activations (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F) and one per 128 x 128 block of
the weights (BLK128x128_32F). The library comes with the nvidia-cublas wheel that epserve
installs for CuPy's cuBLAS and is found by cuda-pathfinder, so nothing new is installed; CuPy
has no binding of cublasLt, hence ctypes.

Layouts, in epserve's row-major terms, C [M, N] = A [M, K] @ W [N, K]^T:
- A: e4m3 [M, K]; its scales [K / 128, M] float32, k-block-major with a pitch of exactly M
  (epserve.ffn.fp8.quantize_rows writes a pitch of M rounded up to 4, equal when 4 | M);
- W: e4m3 [N, K]; its scales [N / 128, K / 128] float32 (epserve.ffn.fp8.quantize_blocks),
  which is cuBLASLt's layout when 4 | K / 128 (weight_scales pads the k-blocks otherwise);
- C: bf16 [M, N].
cuBLASLt is column-major, so it computes C^T = W A^T: its A is W (transposed), its B is A."""

from __future__ import annotations

import ctypes
import functools

import cupy
import numpy as np

CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 14, 28
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
SCALE_VEC128_32F, SCALE_BLK128x128_32F = 4, 5
PREF_MAX_WORKSPACE_BYTES = 1
MIN_VERSION = 120900  # block scaling on Hopper came with cuBLAS 12.9
WORKSPACE_BYTES = 32 << 20
ROW_ALIGN = 16  # rows per call: cuBLASLt 13.1 has no block-scaled algorithm for 65 or 241 rows, has for 256


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def _library():
    from cuda import pathfinder

    loaded = pathfinder.load_nvidia_dynamic_lib("cublasLt")
    lib = ctypes.CDLL(loaded.abs_path or "libcublasLt.so.13")
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} returned cuBLAS status {status}")


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why the block-scaled FP8 GEMM cannot run here (None where it can): no library, a
    version before 12.9, a GPU other than Hopper, or no algorithm for a small probe shape."""
    try:
        lib = _library()
    except Exception as e:  # noqa: BLE001 - any failure to load means: not reachable
        return f"cuBLASLt not loadable ({e})"
    version = int(lib.cublasLtGetVersion())
    if version < MIN_VERSION:
        return f"cuBLASLt {version} has no block-scaled FP8 (needs {MIN_VERSION})"
    try:
        cc = cupy.cuda.Device().compute_capability
    except cupy.cuda.runtime.CUDARuntimeError as e:
        return f"no GPU ({e})"
    if cc != "90":
        return f"block-scaled FP8 in cuBLASLt needs sm_90 (this GPU: sm_{cc})"
    try:
        _plan(256, 256, 512)
    except CublasLtError as e:
        return str(e)
    return None


def version() -> int:
    return int(_library().cublasLtGetVersion())


@functools.lru_cache(maxsize=None)
def _handle() -> ctypes.c_void_p:
    h = ctypes.c_void_p()
    _check(_library().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return h


@functools.lru_cache(maxsize=None)
def _workspace():
    return cupy.empty(WORKSPACE_BYTES, cupy.uint8)


class _Plan:
    """The descriptors and the chosen algorithm of one (M, N, K), kept for the process."""

    def __init__(self, M: int, N: int, K: int):
        lib = _library()
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        for attr, value in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N),
                            (DESC_A_SCALE_MODE, SCALE_BLK128x128_32F), (DESC_B_SCALE_MODE, SCALE_VEC128_32F)):
            v = ctypes.c_int32(value)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), ctypes.sizeof(v)),
                   f"cublasLtMatmulDescSetAttribute({attr})")
        # Block scaling wants its scale pointers set before the heuristic (it reads their
        # alignment); run() sets the real ones.
        self._set_scales(_workspace().data.ptr, _workspace().data.ptr)
        # cuBLASLt's A is W (K x N column-major, transposed), B is A (K x M), D is C^T (N x M).
        self.a, self.b, self.d = (self._layout(dtype, rows, cols, ld) for dtype, rows, cols, ld in (
            (CUDA_R_8F_E4M3, K, N, K), (CUDA_R_8F_E4M3, K, M, K), (CUDA_R_16BF, N, M, N)))
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                        ctypes.sizeof(ws)), "cublasLtMatmulPreferenceSetAttribute")
        self.heuristic = HeuristicResult()
        found = ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(_handle(), self.desc, self.a, self.b, self.d, self.d, pref, 1,
                                                    ctypes.byref(self.heuristic), ctypes.byref(found))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        _check(status, f"cublasLtMatmulAlgoGetHeuristic (M {M}, N {N}, K {K})")
        if found.value < 1:
            raise CublasLtError(f"cuBLASLt has no block-scaled FP8 algorithm for M {M}, N {N}, K {K}")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _layout(dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(_library().cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, ctypes.c_uint64(rows),
                                                     ctypes.c_uint64(cols), ctypes.c_int64(ld)),
               "cublasLtMatrixLayoutCreate")
        return layout

    def _set_scales(self, w_scales_ptr: int, a_scales_ptr: int) -> None:
        for attr, ptr in ((DESC_A_SCALE_POINTER, w_scales_ptr), (DESC_B_SCALE_POINTER, a_scales_ptr)):
            p = ctypes.c_void_p(ptr)
            _check(_library().cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(p), ctypes.sizeof(p)),
                   "cublasLtMatmulDescSetAttribute(scale pointer)")

    def run(self, a_ptr: int, a_scales_ptr: int, w_ptr: int, w_scales_ptr: int, c_ptr: int) -> None:
        lib = _library()
        self._set_scales(w_scales_ptr, a_scales_ptr)  # they belong to the descriptor: set every call
        ws = _workspace()
        _check(lib.cublasLtMatmul(_handle(), self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w_ptr), self.a,
                                  ctypes.c_void_p(a_ptr), self.b, ctypes.byref(self.beta), ctypes.c_void_p(c_ptr),
                                  self.d, ctypes.c_void_p(c_ptr), self.d, ctypes.byref(self.heuristic.algo),
                                  ctypes.c_void_p(ws.data.ptr), ctypes.c_size_t(ws.nbytes),
                                  ctypes.c_void_p(cupy.cuda.get_current_stream().ptr)), "cublasLtMatmul")


@functools.lru_cache(maxsize=None)
def _plan(M: int, N: int, K: int) -> _Plan:
    return _Plan(M, N, K)


def gemm_fp8_nt(a_ptr: int, a_scales_ptr: int, w_ptr: int, w_scales_ptr: int, c_ptr: int, M: int, N: int,
                K: int) -> None:
    """C [M, N] bf16 = (A [M, K] e4m3, 1 x 128 scales [K / 128, M]) @ (W [N, K] e4m3, 128 x 128
    scales [N / 128, round_up(K / 128, 4)]: weight_scales)^T, on the current stream."""
    if M == 0:
        return
    if K % 128 or N % 128:
        raise ValueError(f"block-scaled FP8 needs N and K multiples of 128; got N {N}, K {K}")
    _plan(M, N, K).run(a_ptr, a_scales_ptr, w_ptr, w_scales_ptr, c_ptr)


def weight_scales(w_scales):
    """Weight scales [..., N / 128, K / 128] in cuBLASLt's 128 x 128 layout: the k-blocks of a
    row of blocks padded to a multiple of 4 ([..., N / 128, round_up(K / 128, 4)]). The same
    array where 4 | K / 128 (DeepSeek-V3's 7168 and 2048), a padded copy otherwise."""
    kb = w_scales.shape[-1]
    if kb % 4 == 0:
        return w_scales
    padded = cupy.zeros((*w_scales.shape[:-1], -(-kb // 4) * 4), np.float32)
    padded[..., :kb] = w_scales
    return padded


# scaled[starts[e] + kb * rows_e + r] = scales[kb, lo_e + r]: row m's expert by binary search.
_BY_EXPERT = """
    const long long kb = i / M, m = i % M;
    int lo = 0, hi = E;  // the expert e with offsets[e] <= m < offsets[e + 1]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (offsets[mid] <= m) lo = mid; else hi = mid;
    }
    const long long first = offsets[lo], rows = offsets[lo + 1] - first;
    scaled[starts[lo] + kb * rows + (m - first)] = scales[kb * ld + m];
"""


@functools.lru_cache(maxsize=None)
def _by_expert_kernel():
    return cupy.ElementwiseKernel("raw float32 scales, int64 ld, raw int32 offsets, raw int64 starts, int32 E, int64 M",
                                  "raw float32 scaled", _BY_EXPERT, "epserve_cublaslt_scales_by_expert")


def padded_offsets(offsets_host) -> np.ndarray:
    """Expert offsets with every expert's rows rounded up to ROW_ALIGN (what cuBLASLt's
    block-scaled GEMM takes per call), as a library user lays its rows out."""
    rows = np.diff(np.asarray(offsets_host, np.int64))
    return np.concatenate([[0], np.cumsum(-(-rows // ROW_ALIGN) * ROW_ALIGN)]).astype(np.int32)


def padded_positions(offsets_host, padded_host) -> np.ndarray:
    """For each row of the unpadded layout, its row in the padded one (int64, host)."""
    offsets_host = np.asarray(offsets_host, np.int64)
    rows = np.diff(offsets_host)
    return np.repeat(np.asarray(padded_host, np.int64)[:-1] - offsets_host[:-1], rows) + np.arange(offsets_host[-1])


def scale_starts(offsets_host, k_blocks: int) -> np.ndarray:
    """Where each expert's activation scales start in the per-expert layout (floats): expert
    e's block [k_blocks, rows_e] is contiguous with a pitch of rows_e (cuBLASLt has no scale
    pitch), 16-byte aligned. One more entry: the floats in all."""
    rows = np.diff(np.asarray(offsets_host, np.int64))
    sizes = -(-(rows * k_blocks) // 4) * 4
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def scales_by_expert(scales, offsets_host, offsets, M: int):
    """epserve's activation scales [K / 128, ld] (rows of all experts, k-block-major) in the
    per-expert layout cuBLASLt reads, one launch: (scaled, starts) for grouped_gemm_fp8."""
    k_blocks = scales.shape[0]
    starts = scale_starts(offsets_host, k_blocks)
    scaled = cupy.empty(max(int(starts[-1]), 1), np.float32)
    if M:
        _by_expert_kernel()(scales, scales.shape[1], offsets, cupy.asarray(starts), len(offsets_host) - 1, M,
                            scaled, size=k_blocks * M)
    return scaled, starts


def grouped_gemm_fp8(a_q, scaled, starts, w, w_scales, C, offsets_host) -> None:
    """C[rows of e] = A[rows of e] @ W[e]^T for every expert with rows, one cublasLtMatmul
    each: a_q [M, K] e4m3 (uint8), (scaled, starts) from scales_by_expert, w [E, N, K] e4m3,
    w_scales [E, N / 128, K / 128], C [M, N] bf16; every expert's rows a multiple of ROW_ALIGN
    (padded_offsets)."""
    E, N, K = w.shape
    if (np.diff(np.asarray(offsets_host)) % ROW_ALIGN).any():
        raise ValueError(f"cuBLASLt's block-scaled GEMM takes rows in multiples of {ROW_ALIGN} per expert "
                         f"(padded_offsets lays them out so)")
    w_scales = weight_scales(w_scales)  # a copy only where 4 does not divide K / 128; callers may pass it done
    w_bytes, ws_floats = N * K, w_scales.shape[-2] * w_scales.shape[-1]
    for e in range(E):
        lo, hi = int(offsets_host[e]), int(offsets_host[e + 1])
        if hi > lo:
            gemm_fp8_nt(a_q.data.ptr + lo * K, scaled.data.ptr + int(starts[e]) * 4, w.data.ptr + e * w_bytes,
                        w_scales.data.ptr + e * ws_floats * 4, C.data.ptr + lo * N * 2, hi - lo, N, K)


def captured(run):
    """`run` (cuBLASLt calls on the current stream) recorded once as a CUDA graph, and a
    function that launches the graph on the current stream: the per-expert loop without its
    host time, as a library user would replay it. `run` runs once first, so every plan
    (heuristic query) is made before the capture."""
    stream = cupy.cuda.Stream(non_blocking=True)
    # A non-blocking stream does not wait for the legacy default stream, where the caller
    # made run's operands (and where earlier cuBLASLt calls may still use the shared
    # workspace): order the capture stream after everything queued so far.
    stream.wait_event(cupy.cuda.get_current_stream().record())
    with stream:
        run()
        stream.synchronize()
        stream.begin_capture()
        try:
            run()
        finally:
            graph = stream.end_capture()
    return lambda: graph.launch(cupy.cuda.get_current_stream())
