"""The benchmark's SM clock probe (epserve/bench/clock.py) against an independent clock: a
kernel spinning a known number of cycles, timed by CUDA events."""

import cupy
import numpy as np
import pytest

from epserve.bench.clock import SmClock

pytestmark = pytest.mark.gpu

SPIN = r"""
extern "C" __global__ void spin_cycles(long long cycles, long long* took) {
  const long long c0 = clock64();
  long long c = c0;
  while (c - c0 < cycles) c = clock64();
  *took = c - c0;
}
"""


def test_the_probe_agrees_with_cycles_over_event_time():
    spin = cupy.RawKernel(SPIN, "spin_cycles")
    took = cupy.zeros(1, np.int64)
    clock = SmClock()
    for _ in range(2):  # load the modules, wake the GPU
        spin((1,), (1,), (np.int64(1_000_000), took))
        clock.mhz()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    spin((1,), (1,), (np.int64(40_000_000), took))  # ~20-35 ms at 1.1-2 GHz
    stop.record()
    stop.synchronize()
    by_events = int(took.get()[0]) / cupy.cuda.get_elapsed_time(start, stop) / 1e3  # MHz
    probed = clock.mhz()
    assert 200 < probed < 3000, probed  # MHz, not kHz or GHz
    # one idle-ish GPU: the clock holds over the ~30 ms between the two readings
    assert abs(probed - by_events) / by_events < 0.05, (probed, by_events)


def test_the_clock_during_a_kernel_agrees_with_its_own_cycles():
    """mhz_during reads the clock while another kernel runs beside it: against that kernel's
    own cycles over its event time (a spin of one CTA an SM, as long as the probe's window and
    more), within 5%."""
    spin = cupy.RawKernel(SPIN, "spin_cycles")
    took = cupy.zeros(1, np.int64)
    clock = SmClock()
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def run():
        start.record()
        spin((sms,), (384,), (np.int64(40_000_000), took))  # ~20-35 ms
        stop.record()

    run()
    stop.synchronize()
    during = clock.mhz_during(run, 5_000_000, 10_000_000)  # from 5 ms in, for 10 ms
    by_events = int(took.get()[0]) / cupy.cuda.get_elapsed_time(start, stop) / 1e3
    assert 200 < during < 3000, during
    assert abs(during - by_events) / by_events < 0.05, (during, by_events)
