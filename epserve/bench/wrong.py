"""#wrong, the bench's check of a path's output against its reference: bitwise, or within
bf16 tolerance for paths whose GEMMs sum in another order."""

from __future__ import annotations

import sys

import cupy
import numpy as np


def bitwise_wrong(a, b) -> int:
    """Elements of a that differ from b's in any bit (bf16 rows, e4m3 codes, fp32 scales)."""
    if a.shape != b.shape or a.dtype.itemsize != b.dtype.itemsize:
        return max(a.size, b.size)
    kind = f"u{a.dtype.itemsize}"
    return int((a.view(kind) != b.view(kind)).sum())


def tolerance_wrong(a, b, label: str = "") -> int:
    """Elements of a in rows whose relative error against b exceeds 1e-2 (the bf16 oracle:
    ||a_t - b_t|| <= 1e-2 ||b_t||, with a floor of 1e-3 of the output's rms for rows near
    zero), for paths whose GEMMs sum in another order. A misrouted token, a wrong expert or
    weight puts its whole row near relative error 1; rounding in another order stays near
    2^-8. Compared element by element instead, a library's GEMMs put a few of millions of
    elements past any fixed elementwise bound. The worst row goes to stderr when any fails."""
    if a.shape != b.shape:
        return max(a.size, b.size)
    if b.size == 0:
        return 0
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    H = b.shape[-1]
    rms = float(cupy.sqrt(cupy.mean(b64 * b64)))
    err = cupy.sqrt(cupy.sum((a64 - b64) ** 2, axis=-1))
    ref = cupy.sqrt(cupy.sum(b64 * b64, axis=-1))
    rel = err / cupy.maximum(ref, 1e-3 * rms * np.sqrt(H) + 1e-30)
    bad = int((rel > 1e-2).sum())
    if bad:
        t = int(cupy.argmax(rel))
        print(f"# {label}: {bad} row(s) past relative error 1e-2; worst row {t}: {float(rel[t]):.3g}",
              file=sys.stderr, flush=True)
    return bad * H
