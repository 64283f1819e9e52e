// SwiGLU on a pair of bf16 gate values and the matching pair of up values: silu(g) * u in
// fp32, rounded once to bf16. The inputs are bf16 because GEMM 1's output is defined as bf16
// (as a library composition stores it); GEMM 1's fused epilogue rounds its fp32 accumulators
// to bf16 first and calls this same function, so the fused and the two-kernel GEMM 1 agree
// bit for bit. __fdividef (2 ulp) keeps the arithmetic short: the consumers run it between
// two tiles' MMAs. A very negative g gives 1 + exp(-g) = inf and silu(g) = -0.
#pragma once
#include "common/bf16.cuh"

namespace epserve {

__device__ __forceinline__ uint32_t swiglu_bf16x2(uint32_t gate, uint32_t up) {
  const float g0 = bf16_lo(gate), g1 = bf16_hi(gate);
  const float a0 = __fdividef(g0, 1.f + __expf(-g0)) * bf16_lo(up);
  const float a1 = __fdividef(g1, 1.f + __expf(-g1)) * bf16_hi(up);
  return pack_bf16x2(a0, a1);
}

}  // namespace epserve
