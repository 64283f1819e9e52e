"""The float64 oracle of the FP8 expert FFN (issue 16), and bit-exact NumPy models of its
quantizers, on the CPU.

Quantization (common/fp8.cuh, DeepSeek-V3's convention): a block whose largest magnitude is
amax (floored at 1e-10) stores scale = amax / 448 and q = e4m3(x * (448 / amax)), rounded to
nearest even and saturated at +-448. Both divisions and the product are one IEEE float32
operation each on the GPU and here, and ml_dtypes rounds float32 to float8_e4m3fn to nearest
even, so quantize_blocks and quantize_rows give the GPU quantizers' bits.

Layouts: weights w [..., R, C] get scales [..., R / 128, C / 128] (one per 128 x 128 block);
activations x [M, K] get scales [K / 128, ld] (one per row and 128-column block, stored
k-block-major with ld >= M, a multiple of 4, as the FP8 GEMM's TMA box reads them).

reference_ffn_fp8 is the layer's expert FFN on quantized inputs: dequantize, GEMM 1, SwiGLU,
re-quantize act 1 x 128, GEMM 2, in float64. It rounds where the GPU path rounds before a
quantization (gate and up to bf16 as GEMM 1's output is defined, act to bf16 as the SwiGLU
kernel stores it): quantization turns a small difference in its input into a whole e4m3
step (6-12%) on the elements it flips, so an oracle that quantized unrounded values would
differ from the kernels by about 1% at GEMM 2's output, the size of the tolerance. With the
same rounding points only the rare elements that fp32 accumulation moves across a rounding
boundary differ.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from epserve.check.reference import silu

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
BLOCK = 128
E4M3_MAX = np.float32(448.0)
MIN_AMAX = np.float32(1e-10)


def scale_ld(rows: int) -> int:
    """The row pitch of activation scales for `rows` rows: rows rounded up to 4 floats (16
    bytes, which a TMA tensor map's row pitch must be a multiple of), at least 4."""
    return max(4, -(-rows // 4) * 4)


def _scale_and_inverse(amax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.maximum(amax.astype(np.float32), MIN_AMAX)
    return a / E4M3_MAX, E4M3_MAX / a


def _to_e4m3(x32: np.ndarray, inverse: np.ndarray) -> np.ndarray:
    # clip is cvt.satfinite: ml_dtypes would round values past 464 to NaN
    return np.clip(x32 * inverse, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def _float32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def _check_multiple(name: str, value: int) -> None:
    if value % BLOCK:
        raise ValueError(f"{name} = {value} must be a multiple of {BLOCK} (the FP8 scale block)")


def quantize_blocks(w) -> tuple[np.ndarray, np.ndarray]:
    """w [..., R, C] (bf16 or any float; R, C multiples of 128) -> (q [..., R, C] float8_e4m3fn,
    scales [..., R / 128, C / 128] float32), one scale per 128 x 128 block."""
    x = _float32(w)
    *lead, R, C = x.shape
    _check_multiple("rows", R)
    _check_multiple("columns", C)
    blocks = x.reshape(*lead, R // BLOCK, BLOCK, C // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=(-3, -1))
    scale, inverse = _scale_and_inverse(amax)
    q = _to_e4m3(blocks, inverse[..., :, None, :, None]).reshape(x.shape)
    return q, scale


def quantize_rows(x, ld: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] (K a multiple of 128) -> (q [M, K] float8_e4m3fn, scales [K / 128, ld] float32),
    one scale per row and 128-column block; ld defaults to scale_ld(M), columns past M hold 0."""
    x32 = _float32(x)
    M, K = x32.shape
    _check_multiple("columns", K)
    ld = scale_ld(M) if ld is None else ld
    blocks = x32.reshape(M, K // BLOCK, BLOCK)
    scale, inverse = _scale_and_inverse(np.abs(blocks).max(axis=-1))  # [M, K / 128]
    q = _to_e4m3(blocks, inverse[..., None]).reshape(M, K)
    scales = np.zeros((K // BLOCK, ld), np.float32)
    scales[:, :M] = scale.T
    return q, scales


def dequantize_blocks(q, scales) -> np.ndarray:
    """q [..., R, C] e4m3 and scales [..., R / 128, C / 128] -> float64 [..., R, C]."""
    q64 = np.asarray(q).astype(np.float64)
    s = np.asarray(scales).astype(np.float64)
    return q64 * np.repeat(np.repeat(s, BLOCK, axis=-2), BLOCK, axis=-1)


def dequantize_rows(q, scales) -> np.ndarray:
    """q [M, K] e4m3 and scales [K / 128, ld] -> float64 [M, K]."""
    q64 = np.asarray(q).astype(np.float64)
    M = q64.shape[0]
    s = np.asarray(scales).astype(np.float64)[:, :M].T  # [M, K / 128]
    return q64 * np.repeat(s, BLOCK, axis=1)


def round_bf16(x) -> np.ndarray:
    """x rounded to bf16 (to nearest even), back in float64."""
    return np.asarray(x, np.float64).astype(np.float32).astype(BF16).astype(np.float64)


def grouped_matmul(x, expert_offsets, w) -> np.ndarray:
    """Rows [offsets[e], offsets[e + 1]) of x [M, K] times w[e]^T ([E, N, K]), per expert, in
    float64: the chain's grouped GEMM on dequantized operands."""
    offsets = np.asarray(expert_offsets).astype(np.int64)
    out = np.zeros((x.shape[0], w.shape[1]))
    for e in range(len(offsets) - 1):
        out[offsets[e]:offsets[e + 1]] = x[offsets[e]:offsets[e + 1]] @ w[e].T
    return out


def reference_ffn_fp8(a_q, a_scales, expert_offsets, w13_q, w13_scales, w2_q, w2_scales) -> dict:
    """The expert FFN of one rank on quantized inputs, in float64. M rows, expert-contiguous
    by expert_offsets [E + 1]; a_q [M, H] with a_scales [H / 128, ld]; w13_q [E, 2I, H], w2_q
    [E, H, I] with their 128 x 128 block scales. Returns float64 arrays unless said:

    h           [M, 2I]   dequant(a) @ dequant(w13[e])^T, rounded to bf16
    act         [M, I]    silu(gate) * up, rounded to bf16
    act_q       [M, I]    act quantized 1 x 128 (float8_e4m3fn), act_scales [I / 128, ld] float32
    y           [M, H]    dequant(act_q) @ dequant(w2[e])^T (not rounded)
    """
    offsets = np.asarray(expert_offsets).astype(np.int64)
    a = dequantize_rows(a_q, a_scales)
    w13 = dequantize_blocks(w13_q, w13_scales)
    w2 = dequantize_blocks(w2_q, w2_scales)
    E, two_i, _ = w13.shape
    I = two_i // 2
    M = a.shape[0]
    if offsets.shape != (E + 1,) or offsets[0] != 0 or offsets[-1] != M or (np.diff(offsets) < 0).any():
        raise ValueError(f"expert_offsets must rise from 0 to M = {M} over {E} experts; got {offsets}")
    h = round_bf16(grouped_matmul(a, offsets, w13))
    act = round_bf16(silu(h[:, :I]) * h[:, I:])
    act_q, act_scales = quantize_rows(act, ld=scale_ld(M))
    act_deq = dequantize_rows(act_q, act_scales)
    y = grouped_matmul(act_deq, offsets, w2)
    return {"h": h, "act": act, "act_q": act_q, "act_scales": act_scales, "y": y}
