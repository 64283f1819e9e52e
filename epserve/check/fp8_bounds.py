"""Interval oracle of FP8 GEMM 1's output (issue 16): which e4m3 codes and scales of act a
correct kernel may produce, given the float64 chain and a stated bound on the FP8 tensor
cores' accumulation error.

Why an interval and not a share of differing codes: Hopper's FP8 wgmma does not accumulate
in fp32. It aligns the products of one instruction (k = 32) and the accumulator to the
largest exponent among them and keeps a limited number of fraction bits (DeepSeek-V3's report:
"around 14 bits"; public measurements of H100: an e8m13 accumulator, truncated). The kernel
promotes every k-block of 128 into an fp32 sum (gemm/block_scaled_mma.cuh), which bounds the
loss but leaves h a few units of 2^-13 of its largest term away from the exact product.
GEMM 1 then rounds h to bf16 (8 bits), act to bf16 and act to e4m3 with a row scale taken
from the block's amax, so a small difference in h flips a bf16 rounding now and then, and a
flipped act or amax moves e4m3 codes, whole steps, sometimes across zero (act near 0 is
silu(g) * u with u near 0, whose error is absolute, set by the sum's largest term). A NumPy
model of that accumulator (tests/cpu/test_fp8_bounds.py) reproduces the first GPU run's
1.10% of differing codes on the same inputs (1.11%), against 0.00% for an fp32 accumulator.
The share depends on the data and on the hardware's rounding, so no fixed threshold on it is
an oracle. Instead every step below is monotone or bounded, and the bounds carry through:

    h      exact h +- wgmma_error_bound (the model's worst case: every one of an instruction's
           33 terms truncated by a whole unit of 2^(e_max - ACC_FRACTION_BITS), plus fp32
           roundings of the promotion)
    bf16   rounding to nearest is monotone: bf16(lo) <= bf16(h) <= bf16(hi)
    silu   decreasing below SILU_ARGMIN, increasing above; the kernel's __expf and __fdividef
           add a relative error below SILU_SLACK
    act    bf16 of silu * u over the corners of the two intervals
    amax   [max of each element's least magnitude, max of its largest]
    code   e4m3(act * inv) with inv = 448 / amax in [inv(amax_hi), inv(amax_lo)]: monotone in
           act for a fixed inv, and the corners cover inv

With the error bound at 0 and h the kernel's own bf16 h, the same function is a tight oracle
of the fused epilogue alone (a code may differ only where __expf's error crosses a rounding).
"""

from __future__ import annotations

import numpy as np

from epserve.check import fp8_reference as f8
from epserve.check.fp8_reference import BLOCK, E4M3, E4M3_MAX, MIN_AMAX, round_bf16, scale_ld
from epserve.check.reference import silu

# The accumulator model: fraction bits kept after aligning an instruction's terms (e8m13).
ACC_FRACTION_BITS = 13
WGMMA_K = 32  # products one e4m3 wgmma adds (m64nNk32)
SILU_ARGMIN = -1.2784645427610738  # silu's minimum (x = -1 - W(1/e))
SILU_SLACK = 2.0**-16  # relative error of the kernel's fp32 silu * u: __expf (2 ulp and the
# argument's rounding, |g| * 2^-24 up to |g| = 88, where exp underflows), __fdividef (2 ulp), one multiply
SILU_ABS = 1e-30  # silu of g < -88: the kernel's -0 against g * e^g


def wgmma_error_bound(a_q, a_scales, expert_offsets, b_q, b_scales, acc_bits: int = ACC_FRACTION_BITS):
    """Bound on |kernel's fp32 C - exact C| for C = dequant(a) @ dequant(b[e])^T per expert, C
    [M, N] float64. a_q [M, K] e4m3 with a_scales [K / 128, ld]; b_q [E, N, K] with [E, N / 128,
    K / 128] scales. Per k-block and instruction of WGMMA_K products, 33 terms (the products
    and the running part) each lose less than 2^(e_max - acc_bits) <= 2^-acc_bits * their
    largest magnitude; the largest product is bounded by max|a| * max|b| over the
    instruction, the running part by its exact value plus the bound so far. Then the part's
    conversion, the scale product's rounding and the fma into the fp32 sum, 2^-24 each."""
    offsets = np.asarray(expert_offsets).astype(np.int64)
    a = np.asarray(a_q).astype(np.float64)
    b = np.asarray(b_q).astype(np.float64)
    sa = np.asarray(a_scales).astype(np.float64)
    sb = np.asarray(b_scales).astype(np.float64)
    M, K = a.shape
    E, N, _ = b.shape
    unit, f32 = 2.0**-acc_bits, 2.0**-24
    bound = np.zeros((M, N))
    for e in range(E):
        r0, r1 = offsets[e], offsets[e + 1]
        if r0 == r1:
            continue
        total = np.zeros((r1 - r0, N))  # |running fp32 sum| bound
        for kb in range(K // BLOCK):
            ab = a[r0:r1, kb * BLOCK:(kb + 1) * BLOCK]
            bb = b[e, :, kb * BLOCK:(kb + 1) * BLOCK]
            part, err = np.zeros((r1 - r0, N)), np.zeros((r1 - r0, N))
            for j in range(BLOCK // WGMMA_K):
                cols = slice(j * WGMMA_K, (j + 1) * WGMMA_K)
                largest = np.maximum(np.outer(np.abs(ab[:, cols]).max(1), np.abs(bb[:, cols]).max(1)),
                                     np.abs(part) + err)
                err += (WGMMA_K + 1) * unit * largest
                part += ab[:, cols] @ bb[:, cols].T
            err += f32 * (np.abs(part) + err)  # the part, an fp32 register
            s = sa[kb, r0:r1][:, None] * np.repeat(sb[e, :, kb], BLOCK)[None, :]
            contrib = s * (np.abs(part) + err)
            bound[r0:r1] += s * err + f32 * contrib  # the part's error, the scale product's rounding
            total += contrib
            bound[r0:r1] += f32 * (total + bound[r0:r1])  # the fma's rounding
    return bound


def _silu_range(lo, hi):
    f_lo, f_hi = silu(lo), silu(hi)
    smin = np.where((lo <= SILU_ARGMIN) & (SILU_ARGMIN <= hi), silu(SILU_ARGMIN), np.minimum(f_lo, f_hi))
    return smin, np.maximum(f_lo, f_hi)


def _least_magnitude(lo, hi):
    return np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(np.abs(lo), np.abs(hi)))


def _scale(amax):
    return np.maximum(amax.astype(np.float32), MIN_AMAX) / E4M3_MAX


def _inverse(amax):
    return E4M3_MAX / np.maximum(amax.astype(np.float32), MIN_AMAX)


def _e4m3(x32):
    return np.clip(x32, -E4M3_MAX, E4M3_MAX).astype(E4M3).astype(np.float32)


def act_bounds(h_lo, h_hi) -> dict:
    """The act codes and scales a correct GEMM 1 epilogue may produce from any h in [h_lo,
    h_hi] (float64 [M, 2I], before the bf16 rounding; gate columns [0, I), up [I, 2I)).
    Returns float32 arrays: act_q_lo, act_q_hi [M, I] (e4m3 values: a kernel's code c must
    satisfy lo <= float(c) <= hi), scale_lo, scale_hi [I / 128, scale_ld(M)] (zeros past M)."""
    h_lo, h_hi = round_bf16(h_lo), round_bf16(h_hi)
    M, two_i = h_lo.shape
    I = two_i // 2
    s_lo, s_hi = _silu_range(h_lo[:, :I], h_hi[:, :I])
    u_lo, u_hi = h_lo[:, I:], h_hi[:, I:]
    corners = np.stack([s_lo * u_lo, s_lo * u_hi, s_hi * u_lo, s_hi * u_hi])
    lo, hi = corners.min(0), corners.max(0)
    lo = round_bf16(lo - SILU_SLACK * np.abs(lo) - SILU_ABS)
    hi = round_bf16(hi + SILU_SLACK * np.abs(hi) + SILU_ABS)
    blocks = (M, I // BLOCK, BLOCK)
    amax_lo = _least_magnitude(lo, hi).reshape(blocks).max(-1)  # [M, I / 128]
    amax_hi = np.maximum(np.abs(lo), np.abs(hi)).reshape(blocks).max(-1)
    inv_small, inv_large = _inverse(amax_hi), _inverse(amax_lo)  # float32, as the kernel computes them
    lo32, hi32 = lo.astype(np.float32).reshape(blocks), hi.astype(np.float32).reshape(blocks)
    q_lo = np.minimum(lo32 * inv_small[..., None], lo32 * inv_large[..., None]).reshape(M, I)
    q_hi = np.maximum(hi32 * inv_small[..., None], hi32 * inv_large[..., None]).reshape(M, I)
    scale_lo = np.zeros((I // BLOCK, scale_ld(M)), np.float32)
    scale_hi = scale_lo.copy()
    scale_lo[:, :M], scale_hi[:, :M] = _scale(amax_lo).T, _scale(amax_hi).T
    return {"act_q_lo": _e4m3(q_lo), "act_q_hi": _e4m3(q_hi), "scale_lo": scale_lo, "scale_hi": scale_hi}


def outside_act_bounds(bounds: dict, act_q, act_scales) -> dict:
    """Where a kernel's act (e4m3 [M, I]) and act_scales ([I / 128, >= M]) leave `bounds`:
    counts of codes and scales outside, the share of codes whose interval holds more than one
    value (an upper bound on how many may differ from the float64 chain), and the first
    offending code's place, for the assertion's message."""
    q = np.asarray(act_q).astype(np.float32)  # e4m3 values (NaN stays NaN, and is outside)
    M = q.shape[0]
    s = np.asarray(act_scales)[:, :M]
    bad = ~((q >= bounds["act_q_lo"]) & (q <= bounds["act_q_hi"]))
    bad_s = ~((s >= bounds["scale_lo"][:, :M]) & (s <= bounds["scale_hi"][:, :M]))
    where = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.any() else None
    return {"codes": int(bad.sum()), "scales": int(bad_s.sum()), "first": where,
            "ambiguous": float((bounds["act_q_lo"] != bounds["act_q_hi"]).mean()) if q.size else 0.0}


def act_outside_chain(a_q, a_scales, expert_offsets, w13_q, w13_scales, act_q, act_scales) -> dict:
    """outside_act_bounds of a kernel's act (e4m3 [M, I], scales [I / 128, >= M]) against the
    intervals from exact h +- the accumulator's bound (wgmma_error_bound), for GEMM 1 + SwiGLU
    on a_q [M, H] with w13 [E, 2I, H] and their scales: the rigorous check of act's codes."""
    h = f8.grouped_matmul(f8.dequantize_rows(a_q, a_scales), expert_offsets,
                          f8.dequantize_blocks(w13_q, w13_scales))
    eps = wgmma_error_bound(a_q, a_scales, expert_offsets, w13_q, w13_scales)
    return outside_act_bounds(act_bounds(h - eps, h + eps), act_q, act_scales)
