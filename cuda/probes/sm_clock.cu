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

// window (where not null): the span's first and last global-timer readings
__device__ __forceinline__ void measure_clock(unsigned long long span_ns, float* mhz,
                                              unsigned long long* window = nullptr) {
  const unsigned long long first = global_ns();
  unsigned long long t0 = first;
  while (t0 == first) t0 = global_ns();  // the next tick
  const long long c0 = clock64();
  unsigned long long t1 = t0;
  while (t1 - t0 < span_ns) t1 = global_ns();  // the first tick at or past the span
  const long long c1 = clock64();
  *mhz = static_cast<float>(static_cast<double>(c1 - c0) * 1e3 / static_cast<double>(t1 - t0));
  if (window != nullptr) {
    window[0] = t0;
    window[1] = t1;
  }
}

extern "C" __global__ void epserve_sm_clock(unsigned long long span_ns, float* mhz) { measure_clock(span_ns, mhz); }

// The clock while another kernel runs (epserve/bench/clock.py, SmClock.mhz_during): launched on
// a stream of its own beside it, one thread in a CTA of its own, which fits beside a CTA of
// the FP8 GEMMs on an SM (their 384 threads leave room, as do their registers and shared
// memory), so it runs during it. The SMs share one clock. A kernel whose CTA cannot share an
// SM with it (GEMM 2's, with all the shared memory a CTA may have) could otherwise take every
// SM first and leave the probe to run after it: so the probe tells the host it runs (`started`,
// page-locked host memory), and the host launches the other kernel only then; that kernel's CTA
// on the probe's SM then starts when the probe ends. It waits delay_ns first, to read the clock
// the power cap has settled to inside the other kernel rather than the one it starts at.
extern "C" __global__ void epserve_sm_clock_during(unsigned long long delay_ns, unsigned long long span_ns,
                                                   float* mhz, unsigned long long* window, volatile int* started) {
  *started = 1;
  __threadfence_system();
  const unsigned long long t0 = global_ns();
  while (global_ns() - t0 < delay_ns) {
  }
  measure_clock(span_ns, mhz, window);
}
