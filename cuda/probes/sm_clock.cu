// The SM clock a GPU runs at now, for the benchmark's rows (epserve/bench/clock.py).
//
// One thread counts its SM's cycles (%clock64) over a span of the global timer. The span
// starts and ends on a tick of the global timer (which moves in steps of up to a
// microsecond), so the reading is within a few cycles' worth of the true clock, not a tick's.
// Launched right after a benchmark's timed iterations, it reads the clock those ran at: the
// software power cap moves the clock over milliseconds (notes/gemm.md, fifteenth and
// sixteenth sessions), and the probe takes 100 us.

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

extern "C" __global__ void epserve_sm_clock(unsigned long long span_ns, float* mhz) {
  const unsigned long long first = global_ns();
  unsigned long long t0 = first;
  while (t0 == first) t0 = global_ns();  // the next tick
  const long long c0 = clock64();
  unsigned long long t1 = t0;
  while (t1 - t0 < span_ns) t1 = global_ns();  // the first tick at or past the span
  const long long c1 = clock64();
  *mhz = static_cast<float>(static_cast<double>(c1 - c0) * 1e3 / static_cast<double>(t1 - t0));
}
