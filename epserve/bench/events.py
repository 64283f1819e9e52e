"""Timing with CUDA events on the current stream: warm-up first, then one event pair per
iteration, so module loads and first-call allocations stay out of the numbers."""

from __future__ import annotations

import cupy
import numpy as np


def samples_ms(fn, warmup: int = 3, iters: int = 10) -> list:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop))
    return samples


def median_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    return float(np.median(samples_ms(fn, warmup, iters)))
