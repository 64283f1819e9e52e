"""The SM clock each benchmark row ran at. The H200 holds the FP8 GEMMs at its 700 W limit
with the clock pulled from 1.98 GHz down to 1.2-1.5 GHz, by an amount that depends on what ran
before and for how long (notes/gemm.md, sixteenth session): two runs of one build can differ
by 10% in TFLOP/s. A row's clock says which state its time was taken in, so rows of different
runs can be compared per GHz.

The clock is read on the GPU (cuda/probes/sm_clock.cu: cycles over a span of the global timer)
right after a path's timed iterations, so it needs no nvidia-smi and perturbs no timed call."""

from __future__ import annotations

import cupy
import numpy as np

VARIANT = "sm_clock_probe"  # epserve/runtime/kernels.py: cuda/probes/sm_clock.cu
KERNEL = "epserve_sm_clock"
SPAN_NS = 100_000  # long against the global timer's tick (<= 1 us), short against the power cap's changes


class SmClock:
    """Reads the current device's SM clock in MHz; the kernel and its result buffer are made
    once."""

    def __init__(self, span_ns: int = SPAN_NS):
        from epserve.runtime import kernels

        self._kernel = kernels.function(VARIANT, KERNEL)
        self._span = np.uint64(span_ns)
        self._mhz = cupy.zeros(1, np.float32)

    def mhz(self) -> float:
        """The clock now: queued on the current stream (after whatever is queued there), then
        waited for."""
        self._kernel((1,), (1,), (self._span, self._mhz))
        return float(self._mhz.get()[0])
