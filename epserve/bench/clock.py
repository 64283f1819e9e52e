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
KERNEL_DURING = "epserve_sm_clock_during"
SPAN_NS = 100_000  # long against the global timer's tick (<= 1 us), short against the power cap's changes


class SmClock:
    """Reads the current device's SM clock in MHz; the kernel and its result buffer are made
    once."""

    def __init__(self, span_ns: int = SPAN_NS):
        from epserve.runtime import kernels

        self._kernel = kernels.function(VARIANT, KERNEL)
        self._span = np.uint64(span_ns)
        self._mhz = cupy.zeros(1, np.float32)
        self._during = self._side = None  # mhz_during's kernel and stream, made at its first call

    def mhz_during(self, fn, delay_ns: int, span_ns: int) -> float:
        """The clock while fn (launches on the current stream) runs: the probe on a stream of
        its own, started with fn, reads the clock from delay_ns to delay_ns + span_ns into it
        (cuda/probes/sm_clock.cu, epserve_sm_clock_during). Meaningful where fn's kernels
        leave an SM room for the probe's one-thread CTA and run longer than delay_ns + span_ns;
        waits for both."""
        from epserve.runtime import kernels

        if self._during is None:
            self._during = kernels.function(VARIANT, KERNEL_DURING)
            self._side = cupy.cuda.Stream(non_blocking=True)
        main = cupy.cuda.get_current_stream()
        started = cupy.cuda.Event()
        started.record(main)
        self._side.wait_event(started)
        with self._side:
            self._during((1,), (1,), (np.uint64(delay_ns), np.uint64(span_ns), self._mhz))
        fn()
        self._side.synchronize()
        main.synchronize()
        return float(self._mhz.get()[0])

    def mhz(self) -> float:
        """The clock now: queued on the current stream (after whatever is queued there), then
        waited for."""
        self._kernel((1,), (1,), (self._span, self._mhz))
        return float(self._mhz.get()[0])
