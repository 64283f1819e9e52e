"""NumPy models of the FP8 kernels' arithmetic, for the CPU tests of the FP8 oracles
(tests/cpu/test_fp8_bounds.py): Hopper's FP8 wgmma
accumulation as published (terms of one k32 instruction aligned to the largest exponent,
`bits` fraction bits kept, truncated; None: exact fp32 sums), the kernel's promotion per
k-block, and GEMM 1's epilogue with its rounding points."""

from __future__ import annotations

import numpy as np

from epserve.check import fp8_reference as f8
from epserve.check.testing import BF16


def aligned_sum(terms, bits):
    """Hopper's FP8 accumulation as modelled: terms [..., n] aligned to the largest exponent
    among them, truncated to `bits` fraction bits below it, summed exactly, held in fp32."""
    largest = np.abs(terms).max(-1)
    unit = 2.0 ** (np.floor(np.log2(np.where(largest > 0, largest, 1.0))) - bits)
    return (np.trunc(terms / unit[..., None]) * unit[..., None]).sum(-1).astype(np.float32).astype(np.float64)


def kernel_h(a_q, a_s, w_q, w_s, offsets, bits):
    """GEMM 1's fp32 h as the kernel computes it: per k-block, four k32 instructions into a
    fresh part (exact fp32 sums when bits is None), then sum = fma(part, sa * sb, sum)."""
    a, w = a_q.astype(np.float64), w_q.astype(np.float64)
    M, K = a.shape
    E, N, _ = w.shape
    h = np.zeros((M, N), np.float32)
    for e in range(E):
        r0, r1 = offsets[e], offsets[e + 1]
        s = np.zeros((r1 - r0, N), np.float32)
        for kb in range(K // 128):
            ab, wb = a[r0:r1, kb * 128:(kb + 1) * 128], w[e, :, kb * 128:(kb + 1) * 128]
            if bits is None:
                part = (ab @ wb.T).astype(np.float32).astype(np.float64)
            else:
                part = np.zeros((r1 - r0, N))
                for j in range(4):
                    prods = ab[:, None, j * 32:(j + 1) * 32] * wb[None, :, j * 32:(j + 1) * 32]
                    part = aligned_sum(np.concatenate([prods, part[..., None]], -1), bits)
            scale = a_s[kb, r0:r1].astype(np.float32)[:, None] * np.repeat(w_s[e, :, kb], 128)[None, :]
            s = (part * scale.astype(np.float64) + s).astype(np.float32)  # one fma (double rounding: rare)
        h[r0:r1] = s
    return h


def kernel_act(h32, I):
    """The epilogue: gate and up to bf16, silu(g) * u in fp32 to bf16, quantized 1 x 128."""
    g = h32[:, :I].astype(BF16).astype(np.float32)
    u = h32[:, I:].astype(BF16).astype(np.float32)
    act = ((g / (np.float32(1) + np.exp(-g))) * u).astype(BF16)
    return f8.quantize_rows(act)
