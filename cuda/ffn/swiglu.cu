// act[m, i] = silu(h[m, i]) * h[m, I + i] with h = [gate | up] from GEMM 1; fp32 math, bf16 out.
// The layer's GEMM 1 applies SwiGLU in its epilogue (gemm/grouped_gemm_wgmma.cu); this
// kernel serves the mma.sync GEMM and is the two-kernel reference the fused one is checked
// against.
#include "ffn/swiglu.cuh"

using namespace epserve;

extern "C" __global__ void epserve_swiglu(const bf16_t* __restrict__ h, bf16_t* __restrict__ act, long long M, int I) {
  const long long pairs = M * I / 2;  // I is a multiple of 64, so pairs never straddle rows
  for (long long p = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long m = (2 * p) / I;
    const int i = static_cast<int>(2 * p - m * I);
    const uint32_t g = *reinterpret_cast<const uint32_t*>(h + m * 2 * I + i);
    const uint32_t u = *reinterpret_cast<const uint32_t*>(h + m * 2 * I + I + i);
    *reinterpret_cast<uint32_t*>(act + 2 * p) = swiglu_bf16x2(g, u);
  }
}
