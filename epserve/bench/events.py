"""Timing with CUDA events on the current stream: warm-up first, then one event pair per
iteration, so module loads and first-call allocations stay out of the numbers.

samples_ms waits for each iteration before the next: a call's host time (launches, host
waits) counts as the GPU idles through it, which is what a caller of a synchronous call
meets. queued_samples_ms queues every iteration before it waits: once the host is ahead of
the GPU, each event pair times the GPU's work alone (and, over several ranks, the waits for
the peers), as DeepEP's and nccl-tests' kernel times are taken."""

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


def queued_samples_ms(fn, warmup: int = 3, iters: int = 10) -> list:
    """Per-iteration milliseconds of fn's GPU work with no host wait between iterations:
    fn must not wait for the GPU itself. The warm-up calls are queued ahead of the timed
    ones, so the host is ahead of the GPU from the first timed iteration on."""
    for _ in range(warmup):
        fn()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    events[-1][1].synchronize()
    return [cupy.cuda.get_elapsed_time(start, stop) for start, stop in events]


def median_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    return float(np.median(samples_ms(fn, warmup, iters)))
