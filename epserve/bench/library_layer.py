"""The whole MoE layer as a torch-free user composes it from libraries, planned on the device
the way an all-to-all token dispatcher does it (Megatron's, for one): the bench's
`layer-library` row, and `layer-torch` where torch happens to be importable.

    1. sort the k slots of every token by expert (CuPy argsort); count rows per expert;
    2. NCCL all-to-all of the counts; one host wait to read them (the GEMMs' group sizes and
       the NCCL sizes are host arguments);
    3. NCCL grouped send/recv of one row per slot (no deduplication: a library has none);
    4. a CuPy scatter from (source rank, expert) blocks into expert-contiguous rows;
    5. GEMM 1, a CuPy elementwise SwiGLU, GEMM 2: cuBLAS per expert (CuPy 14 has no binding
       of cublasGemmGroupedBatchedEx), or torch._grouped_mm (each expert's rows padded to
       a multiple of 16, as torch asks);
    6. the inverse gather, NCCL send/recv back, a CuPy scatter into the slots, and the
       weighted sum over the k slots in fp32, j ascending, rounded once (a CuPy kernel).

No MPI call per layer. Its GEMMs sum in another order than epserve's, so it is checked
within bf16 tolerance. Unused slots (expert id -1) move nothing and weigh nothing."""

from __future__ import annotations

import functools
import importlib

import cupy
import cupyx
import numpy as np

from epserve.arrays import BF16
from epserve.bench.cublas import grouped_gemm_per_expert
from epserve.comm.nccl import exchange_rows

TORCH_ROW_ALIGN = 16  # torch._grouped_mm's group sizes (its TMA boxes)

# out[t, h] = bf16(sum over used j, ascending, of w[t, j] * slots[t, j, h]), in fp32.
_WEIGHTED_SUM = """
    const long long t = i / H, h = i % H;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
        if (idx[t * k + j] < 0) continue;
        const float v = __uint_as_float(((unsigned int)slots[(t * k + j) * H + h]) << 16);
        acc += w[t * k + j] * v;
    }
    const unsigned int bits = __float_as_uint(acc);
    out = (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
"""


@functools.lru_cache(maxsize=None)
def _weighted_sum_kernel():
    return cupy.ElementwiseKernel("raw uint16 slots, raw float32 w, raw int32 idx, int32 k, int64 H", "uint16 out",
                                  _WEIGHTED_SUM, "epserve_library_weighted_sum")


@functools.lru_cache(maxsize=None)
def optional_torch():
    """The torch module where it happens to be importable, else None. epserve never needs it:
    only the bench's layer-torch row uses it, so it is looked up by name, not imported."""
    try:
        return importlib.import_module("torch")
    except Exception:  # noqa: BLE001 - any failure to import means: no torch rows
        return None


def torch_grouped_mm():
    """torch._grouped_mm where torch is importable and has it, else None."""
    return getattr(optional_torch(), "_grouped_mm", None)


class LibraryLayer:
    def __init__(self, nccl_comm, world: int, num_experts: int, hidden: int, intermediate: int, swiglu,
                 use_torch: bool = False):
        self.nccl, self.world = nccl_comm, world
        self.E, self.H, self.I = num_experts, hidden, intermediate
        self.e_loc = num_experts // world
        self.swiglu = swiglu  # (h [M, 2I], act [M, I], I) -> None: the CuPy elementwise SwiGLU
        self.use_torch = use_torch
        self.align = TORCH_ROW_ALIGN if use_torch else 1
        self._ones = np.ones(world, np.int64)
        self._steps = np.arange(world, dtype=np.int64)

    def forward(self, x, topk_idx, topk_weights, w13, w2, out) -> None:
        W, E, e_loc, H = self.world, self.E, self.e_loc, self.H
        T, k = topk_idx.shape
        key = cupy.where(topk_idx < 0, E, topk_idx).ravel()
        order = cupy.argsort(key)  # slots grouped by expert, so by destination rank
        counts = cupy.zeros(E + 1, np.int32)
        cupyx.scatter_add(counts, key, 1)  # (cupy.bincount would wait for the host twice)

        # 2. counts of my experts from every rank (a [W, e_loc] matrix), then one host wait.
        recv_counts = cupy.empty((W, e_loc), np.int32)
        exchange_rows(self.nccl, counts, self._ones, self._steps, recv_counts, self._ones, self._steps, e_loc * 4)
        both = cupy.asnumpy(cupy.concatenate([counts[:E], recv_counts.ravel()]))
        sent = both[:E].reshape(W, e_loc).sum(axis=1)
        got_by_block = both[E:].reshape(W, e_loc)
        got = got_by_block.sum(axis=1)
        n_send, n_recv = int(sent.sum()), int(got.sum())
        send_displs = np.concatenate([[0], np.cumsum(sent)[:-1]])
        recv_displs = np.concatenate([[0], np.cumsum(got)[:-1]])
        per_expert = got_by_block.sum(axis=0)
        padded = -(-per_expert // self.align) * self.align
        expert_offsets = np.concatenate([[0], np.cumsum(padded)])
        M = int(expert_offsets[-1])

        # 3. one row per used slot, sorted by expert.
        send_rows = cupy.take(x, order[:n_send] // k, axis=0)
        recv_rows = cupy.empty((n_recv, H), BF16)
        exchange_rows(self.nccl, send_rows, sent, send_displs, recv_rows, got, recv_displs, H * 2)

        # 4. received row r of block (s, e) goes to expert e's rows, after sources s' < s.
        target = self._expert_major_positions(recv_counts, cupy.asarray(expert_offsets[:-1]), n_recv)
        rows = cupy.zeros((M, H), BF16) if M > n_recv else cupy.empty((M, H), BF16)
        rows[target] = recv_rows

        # 5. the experts.
        y = self._experts(rows, w13, w2, expert_offsets)

        # 6. back to the sources, into their slots, weighted and summed.
        back = cupy.empty((n_send, H), BF16)
        exchange_rows(self.nccl, cupy.take(y, target, axis=0), got, recv_displs, back, sent, send_displs, H * 2)
        slots = cupy.empty((T * k, H), np.uint16)
        slots[order[:n_send]] = back.view(np.uint16)
        _weighted_sum_kernel()(slots, topk_weights, topk_idx, k, H, out.view(np.uint16))

    def _experts(self, rows, w13, w2, expert_offsets):
        """y [M, H] of the expert-contiguous rows [M, H]: GEMM 1, SwiGLU, GEMM 2."""
        h = self._gemm(rows, w13, expert_offsets)
        act = cupy.empty((rows.shape[0], self.I), BF16)
        self.swiglu(h, act, self.I)
        return self._gemm(act, w2, expert_offsets)

    def _gemm(self, A, B, expert_offsets):
        """C [M, N] with C[rows of e] = A[rows of e] @ B[e]^T for every expert e."""
        M, N = A.shape[0], B.shape[1]
        if not self.use_torch or M == 0:
            C = cupy.empty((M, N), BF16)
            grouped_gemm_per_expert(A, B, C, expert_offsets)
            return C
        torch = optional_torch()
        ends = torch.from_dlpack(cupy.asarray(expert_offsets[1:], dtype=np.int32))
        a, b = torch.from_dlpack(A), torch.from_dlpack(B)
        return cupy.from_dlpack(torch._grouped_mm(a, b.transpose(-2, -1), offs=ends))

    def _expert_major_positions(self, recv_counts, expert_starts, n_recv: int):
        """For each received row (blocks by source rank, then expert), its row in the
        expert-contiguous order (blocks by expert, then source rank, from expert_starts); on
        the device."""
        c = recv_counts.astype(np.int64)                          # [W, e_loc]
        recv_base = cupy.cumsum(c.ravel()) - c.ravel()            # block starts, source-major
        before = cupy.cumsum(c, axis=0) - c                       # rows of expert e from sources s' < s
        target_base = (expert_starts.astype(np.int64)[None, :] + before).ravel()
        r = cupy.arange(n_recv, dtype=np.int64)
        # Empty blocks share their start with the next one; "right" lands on the last block
        # starting at or before r, which is the non-empty one holding r.
        block = cupy.searchsorted(recv_base, r, side="right") - 1
        return target_base[block] + r - recv_base[block]


class LibraryLayerFP8(LibraryLayer):
    """The same composition for FP8 experts (the -fp8 presets' `layer-library` row), as
    DeepSeek-V3's recipe runs on cuBLASLt: each expert's rows padded to 16 (what cuBLASLt's
    block-scaled GEMM takes), quantized 1 x 128 (epserve's row quantizer standing in for the
    user's: a CuPy one would be slower), cuBLASLt's block-scaled FP8 GEMM per expert
    (cuBLAS 13.1 has no grouped layout; 13.2 brings one), the CuPy SwiGLU, the act quantized,
    GEMM 2 the same way. The rows cross the link in bf16: NCCL moves what it is given, and
    this composition quantizes after the exchange. forward takes epserve.FP8Weights as w13
    (w2 unused)."""

    def __init__(self, nccl_comm, world: int, num_experts: int, hidden: int, intermediate: int, swiglu):
        super().__init__(nccl_comm, world, num_experts, hidden, intermediate, swiglu)
        from epserve.bench import cublaslt

        self.align = cublaslt.ROW_ALIGN
        self._weights = None  # (FP8Weights, w13 scales, w2 scales in cuBLASLt's layout)

    def _experts(self, rows, fp8w, _unused, expert_offsets):
        from epserve.bench import cublaslt
        from epserve.ffn import fp8

        M, H, I = rows.shape[0], self.H, self.I
        y = cupy.empty((M, H), BF16)
        if M == 0:
            return y
        if self._weights is None or self._weights[0] is not fp8w:
            self._weights = (fp8w, cublaslt.weight_scales(fp8w.w13_scales), cublaslt.weight_scales(fp8w.w2_scales))
        _, s13, s2 = self._weights
        offsets = cupy.asarray(expert_offsets.astype(np.int32))
        a_q, a_s = fp8.quantize_rows(rows)
        scaled, starts = cublaslt.scales_by_expert(a_s, expert_offsets, offsets, M)
        h = cupy.empty((M, 2 * I), BF16)
        cublaslt.grouped_gemm_fp8(a_q, scaled, starts, fp8w.w13, s13, h, expert_offsets)
        act = cupy.empty((M, I), BF16)
        self.swiglu(h, act, I)
        act_q, act_s = fp8.quantize_rows(act)
        scaled, starts = cublaslt.scales_by_expert(act_s, expert_offsets, offsets, M)
        cublaslt.grouped_gemm_fp8(act_q, scaled, starts, fp8w.w2, s2, y, expert_offsets)
        return y
