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


WIDE = r"""
extern "C" __global__ void spin_wide(long long cycles, unsigned long long* spans) {
  extern __shared__ unsigned char smem[];  // all an SM has: no other CTA fits beside this one
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long c0 = clock64();
  while (clock64() - c0 < cycles) {
  }
  smem[threadIdx.x] = 1;
  unsigned long long t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  spans[2 * blockIdx.x] = t0;
  spans[2 * blockIdx.x + 1] = t1;
}
"""


def test_the_clock_is_read_during_a_kernel_that_fills_every_sm():
    """A kernel whose CTAs take all of an SM's shared memory, one an SM, could be placed
    before the probe and leave it to run after: mhz_during starts the probe first, so its
    window lies inside the kernel's (from its first CTA's start to its last CTA's end)."""
    dev = cupy.cuda.runtime.getDeviceProperties(0)
    sms, smem = dev["multiProcessorCount"], dev["sharedMemPerBlockOptin"]
    spin = cupy.RawKernel(WIDE, "spin_wide")
    spin.max_dynamic_shared_size_bytes = smem
    spans = cupy.zeros(2 * sms, np.uint64)
    clock = SmClock()

    def run():
        spin((sms,), (128,), (np.int64(40_000_000), spans), shared_mem=smem)  # ~20-35 ms

    run()
    cupy.cuda.Device().synchronize()
    for _ in range(3):
        during = clock.mhz_during(run, 5_000_000, 5_000_000)  # from 5 ms in, for 5 ms
        first, last = clock.window_ns
        starts, ends = spans.get().reshape(sms, 2).T
        assert 200 < during < 3000, during
        assert int(starts.min()) <= first < last <= int(ends.max()), (first, last, starts.min(), ends.max())
