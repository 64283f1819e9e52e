"""The FP8 expert FFN as the service runs it (MoEConfig.expert_dtype "fp8", issue 16): each
rank's tokens are quantized to e4m3 with 1 x 128 scales into packed rows (the values, then
the scales: fp8.packed_row_bytes(H) bytes), which the dispatch moves as it moves bf16 rows,
at about half the bytes. The direct dispatch quantizes inside its move kernel (the
"dispatch_quantize" build, epserve/dispatch/direct.py); the NCCL and host-planned dispatches
take rows quantized before them (quantize_tokens_spec, into FP8Buffers.x_packed): the same
bytes. On the receiving side the scales are unpacked into
the layout the GEMM reads, GEMM 1 reads the values in place (a tensor map with the packed
pitch), runs on FP8 with SwiGLU and act's quantization in its epilogue, and GEMM 2 on FP8
hands bf16 rows to the sink, exactly as the bf16 GEMM 2 does, so the combine is unchanged.

Every buffer is made once, at capacity (MoEConfig.recv_rows_capacity rows), and the row
count stays on the device: the scale unpacking reads it from expert_offsets[E_loc], the GEMMs from
expert_offsets as always. So a forward allocates nothing, its tensor maps are made once per
buffer (epserve.ffn.gemm_fp8's caches) and it can be captured in a CUDA graph.

The weights are the output of epserve.quantize_weights(w13, w2) (FP8Weights), checked here
against the config the way the bf16 weights are (shapes, dtypes, device, contiguity).
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from epserve.arrays import BF16, checked_array
from epserve.check.fp8_reference import BLOCK, scale_ld
from epserve.errors import ConfigError
from epserve.ffn import fp8, gemm, gemm_fp8
from epserve.ffn.fp8 import FP8Weights


@dataclass(frozen=True)
class FP8Act:
    """GEMM 2's A in FP8: q [rows, I] e4m3 (uint8) and scales [I / 128, scale_ld(rows)] float32."""

    q: cupy.ndarray
    scales: cupy.ndarray


class FP8Buffers:
    """The FP8 FFN's operands at capacity: this rank's tokens quantized into packed rows (for
    the dispatches that do not quantize in their own kernels), the received rows' scales unpacked, and GEMM 1's quantized act and its
    scales."""

    def __init__(self, capacity: int, hidden: int, intermediate: int, max_tokens: int = 0):
        ld = scale_ld(capacity)
        self.hidden = hidden
        self.x_packed = cupy.zeros((max_tokens, fp8.packed_row_bytes(hidden)), np.uint8)
        self.rows_scales = cupy.zeros((hidden // BLOCK, ld), np.float32)
        self.act = FP8Act(cupy.zeros((capacity, intermediate), np.uint8),
                          cupy.zeros((intermediate // BLOCK, ld), np.float32))


def dispatch_width(hidden: int) -> int:
    """The width, in bf16 elements, of the rows the FP8 dispatch moves: a packed row's bytes / 2
    (the dispatchers move rows as 16-byte chunks, whatever they hold)."""
    return fp8.packed_row_bytes(hidden) // 2


def packed_rows(rows) -> cupy.ndarray:
    """Dispatched rows (bf16-typed [M, dispatch_width(H)]) as the bytes they hold: uint8 [M, packed_row_bytes(H)]."""
    return rows.view(np.uint8)


def quantize_tokens_spec(buffers: FP8Buffers, x) -> tuple:
    """This rank's tokens x [T, H] bf16 into buffers.x_packed[:T] (one launch)."""
    return fp8.quantize_rows_packed_spec(x, buffers.x_packed, x.shape[0])


def tokens_to_dispatch(buffers: FP8Buffers, x) -> cupy.ndarray:
    """The packed rows of x, as the dispatchers take rows (bf16-typed [T, dispatch_width(H)])."""
    return buffers.x_packed[:x.shape[0]].view(BF16)


def checked_weights(weights, w2, experts: int, hidden: int, intermediate: int) -> FP8Weights:
    """The FP8Weights a forward was given (as w13; w2 None or the same object), each array
    checked like a bf16 weight; ConfigError otherwise."""
    if not isinstance(weights, FP8Weights):
        raise ConfigError(f"with expert_dtype 'fp8', pass epserve.quantize_weights(w13, w2) (an FP8Weights) as w13, "
                          f"got {type(weights).__name__}")
    if w2 is not None and w2 is not weights:
        raise ConfigError("with expert_dtype 'fp8', w2 must be None (the FP8Weights passed as w13 holds both "
                          "projections)")
    E, H, I = experts, hidden, intermediate
    return FP8Weights(checked_array(weights.w13, "w13 (e4m3)", "uint8", (E, 2 * I, H)),
                      checked_array(weights.w13_scales, "w13_scales", "float32", (E, 2 * I // BLOCK, H // BLOCK)),
                      checked_array(weights.w2, "w2 (e4m3)", "uint8", (E, H, I)),
                      checked_array(weights.w2_scales, "w2_scales", "float32", (E, H // BLOCK, I // BLOCK)))


def gemm1_specs(buffers: FP8Buffers, rows, expert_offsets, weights: FP8Weights, experts: int, intermediate: int,
                hidden: int) -> list:
    """The received packed rows (bf16-typed [M, dispatch_width(H)], M at most the capacity):
    their scales unpacked, then GEMM 1 + SwiGLU + act's quantization into buffers.act, reading
    the e4m3 values in place: two launches. The unpacking stops at the call's row count, read
    on the device (expert_offsets[experts]), so rows may be the dispatch's whole
    capacity-sized buffer."""
    b = buffers
    count = expert_offsets[experts:]  # a view: the kernel reads its first int
    packed = packed_rows(rows)
    values = packed[:, :hidden]  # the e4m3 values, at the packed rows' pitch
    return ([fp8.unpack_row_scales_spec(packed, hidden, b.rows_scales, rows.shape[0], count)]
            + gemm_fp8.gemm1_swiglu_fp8_specs(values, b.rows_scales, weights.w13, weights.w13_scales, b.act.q,
                                              b.act.scales, expert_offsets, experts, intermediate, hidden))


def gemm2_specs(sink: str, act, w2, C, expert_offsets, experts: int, N: int, K: int, cfg=None, gate: int = 0,
                rows: int | None = None, overlap_free_sms: int | None = None) -> list:
    """GEMM 2 for either dtype: act an FP8Act with w2 the FP8Weights, or bf16 act and w2.
    rows: the rows the call expects (act is capacity-sized), for the bf16 GEMM's choice of
    build (epserve/ffn/tiles.py). overlap_free_sms: the bf16 wgmma GEMM's overlap build across
    nodes (gemm.grouped_gemm_specs); the FP8 GEMM has none (overlap_supported)."""
    if isinstance(act, FP8Act):
        assert overlap_free_sms is None, "the FP8 GEMM 2 has no overlap build"
        return gemm_fp8.grouped_gemm_fp8_specs(sink, act.q, act.scales, w2.w2, w2.w2_scales, C, expert_offsets,
                                               experts, N, K, cfg, gate)
    return gemm.grouped_gemm_specs(sink, act, w2, C, expert_offsets, experts, N, K, cfg, gate, rows=rows,
                                   overlap_free_sms=overlap_free_sms)


def overlap_supported(act) -> bool:
    """Whether GEMM 2 of `act` has an overlap build (the combine's off-node send under GEMM 2,
    EPSERVE_OFFNODE_OVERLAP=1): the bf16 wgmma GEMM's; the FP8 GEMM and the mma.sync one keep
    the send after GEMM 2."""
    return not isinstance(act, FP8Act) and gemm.gemm_impl() == "wgmma"
