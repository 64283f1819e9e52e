"""The SM clock each benchmark row ran at. The H200 holds the FP8 GEMMs at its 700 W limit
with the clock pulled from 1.98 GHz down to 1.2-1.5 GHz, by an amount that depends on what ran
before and for how long (notes/gemm.md, sixteenth session): two runs of one build can differ
by 10% in TFLOP/s. A row's clock says which state its time was taken in, so rows of different
runs can be compared per GHz.

The clock is read on the GPU (cuda/probes/sm_clock.cu: cycles over a span of the global timer),
so it needs no nvidia-smi and perturbs no timed call: right after a path's timed iterations,
and during one more call of it (mhz_during). The two differ: the power cap holds the FP8
GEMMs at 1.4-1.6 GHz even in the bench's short rows, and the clock is back near 1.98 GHz by
the time the row has ended (notes/gemm.md, twenty-eighth and twenty-ninth sessions)."""

from __future__ import annotations

import time

import cupy
import numpy as np

VARIANT = "sm_clock_probe"  # epserve/runtime/kernels.py: cuda/probes/sm_clock.cu
KERNEL = "epserve_sm_clock"
KERNEL_DURING = "epserve_sm_clock_during"
SPAN_NS = 100_000  # long against the global timer's tick (<= 1 us), short against the power cap's changes
START_TIMEOUT_S = 2.0  # mhz_during's bound on the probe's start (an idle GPU starts it in microseconds)


class SmClock:
    """Reads the current device's SM clock in MHz; the kernel and its result buffer are made
    once."""

    def __init__(self, span_ns: int = SPAN_NS):
        from epserve.runtime import kernels

        self._kernel = kernels.function(VARIANT, KERNEL)
        self._span = np.uint64(span_ns)
        self._mhz = cupy.zeros(1, np.float32)
        self._during = self._side = None  # mhz_during's kernel and stream, made at its first call
        self.window_ns = None  # mhz_during's span on the global timer: (first, last) ns

    def mhz_during(self, fn, delay_ns: int, span_ns: int) -> float:
        """The clock while fn (launches on the current stream) runs: the probe on a stream of
        its own, started once the current stream's work is done and before fn is called, reads
        the clock from delay_ns to delay_ns + span_ns into it (cuda/probes/sm_clock.cu,
        epserve_sm_clock_during); self.window_ns is then that span on the global timer.
        Meaningful where fn runs longer than delay_ns + span_ns (a CTA of fn's that cannot
        share the probe's SM starts when the probe ends). Waits for both."""
        from epserve.runtime import kernels

        if self._during is None:
            self._during = kernels.function(VARIANT, KERNEL_DURING)
            self._side = cupy.cuda.Stream(non_blocking=True)
            self._window = cupy.zeros(2, np.uint64)
            self._started_mem = cupy.cuda.alloc_pinned_memory(4)  # mapped into the device's addresses (UVA)
            self._started = np.frombuffer(self._started_mem, np.int32, 1)
        main = cupy.cuda.get_current_stream()
        self._started[0] = 0
        ready = cupy.cuda.Event()
        ready.record(main)
        self._side.wait_event(ready)
        with self._side:
            self._during((1,), (1,), (np.uint64(delay_ns), np.uint64(span_ns), self._mhz, self._window,
                                     np.uint64(self._started_mem.ptr)))
        deadline = time.monotonic() + START_TIMEOUT_S
        while self._started[0] == 0 and time.monotonic() < deadline:
            pass
        fn()
        self._side.synchronize()
        main.synchronize()
        self.window_ns = tuple(int(t) for t in self._window.get())
        return float(self._mhz.get()[0])

    def mhz_during_call(self, fn, call_ms: float) -> float:
        """mhz_during over the middle third of a call of fn that takes about call_ms: past the
        clock fn starts at, well before it ends."""
        third_ns = int(call_ms * 1e6 / 3)
        return self.mhz_during(fn, third_ns, third_ns)

    def mhz(self) -> float:
        """The clock now: queued on the current stream (after whatever is queued there), then
        waited for."""
        self._kernel((1,), (1,), (self._span, self._mhz))
        return float(self._mhz.get()[0])
