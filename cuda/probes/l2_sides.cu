// Which half of the L2 each SM sits next to (epserve/runtime/l2_sides.py runs it for the FP8
// GEMMs' tile order, launch/jobs/probe_l2_sides.py to print it; notes/gemm.md, fifteenth session). Hopper's L2 is two partitions joined by a fabric: an SM
// reads through its near partition, which keeps its own copies of lines homed in the far one.
// Block 0 reads every block's region, so each region's lines sit in block 0's near partition;
// then every other block times one pass of a dependent-load chase through its own region.
// A block on block 0's side hits its near partition on every line; a block on the other side
// crosses the fabric for the lines homed on block 0's side, so its loads take longer.
// One block an SM (the launch asks for more shared memory than two blocks could have).
// chase: [blocks][lines][32] words, word 0 of each 128-byte line the next line of a cycle
// through the block's region. smid_out, cycles_out [blocks]; cycles_out[0] stays unset and -1
// marks a block whose wait for block 0 ran out.

extern "C" __global__ void epserve_probe_l2_sides(const unsigned* __restrict__ chase, int lines, int* flag,
                                                  int* smid_out, long long* cycles_out, unsigned* sink) {
  extern __shared__ unsigned char keep_one_block_an_sm[];
  const int b = blockIdx.x;
  int smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  if (threadIdx.x == 0) smid_out[b] = smid;
  if (b == 0) {
    unsigned acc = 0;
    const int total = gridDim.x * lines;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
      unsigned v;
      asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(chase + static_cast<long long>(i) * 32));
      acc += v;
    }
    if (threadIdx.x == 0) keep_one_block_an_sm[0] = 0;
    __syncthreads();  // every line read (each thread's loads returned into acc) before the flag
    if (threadIdx.x == 0) {
      sink[0] = acc;
      __threadfence();
      asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(flag), "r"(1) : "memory");
    }
    return;
  }
  if (threadIdx.x != 0) return;
  const long long give_up = clock64() + 4000000000ll;  // a few seconds: block 0 not resident
  int ready = 0;
  while (!ready && clock64() < give_up)
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(ready) : "l"(flag) : "memory");
  const unsigned* region = chase + static_cast<long long>(b) * lines * 32;
  unsigned line = 0;
  const long long t0 = clock64();
  for (int h = 0; h < lines; ++h)  // one pass: a second would find the lines this block just brought near
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(line) : "l"(region + line * 32) : "memory");
  const long long t1 = clock64();
  cycles_out[b] = ready ? t1 - t0 : -1;
  sink[b] = line;
}
