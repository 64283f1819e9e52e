// GEMM 1's FP8 epilogue on one consumer thread's sums: SwiGLU, then the 1 x 128 quantization
// GEMM 2's A takes. The tile's 128 act columns are exactly one scale block, and a row's
// columns live in the 4 lanes that share lane / 4, so a row's amax is a local max and two
// shuffles. Rounding follows the unfused path step for step (GEMM 1 stores gate and up as
// bf16, ffn/swiglu.cuh makes bf16 act, ffn/quantize_fp8.cu quantizes it), so fused and
// unfused give the same bits.
#pragma once
#include "common/bf16.cuh"
#include "common/fp8.cuh"
#include "ffn/swiglu.cuh"

namespace epserve {

// sum holds, per n8 block j < 16, gate at sum[4j..4j+3] and the same columns' up at
// sum[4(j + 16)..] (rows: this thread's row for +0, +1 and the row 8 below for +2, +3;
// columns 8j + 2 * (lane % 4), +1). put(dr, col, e4m3x2) stores a pair of row + dr;
// the returned scales are those of the thread's two rows (lo: its row; hi: 8 below).
template <class Put>
__device__ __forceinline__ float2 swiglu_quantize(const float (&sum)[128], int lane, Put&& put) {
  uint32_t act_lo[16], act_hi[16];
  float amax_lo = 0.f, amax_hi = 0.f;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int u = j + 16;
    act_lo[j] = swiglu_bf16x2(pack_bf16x2(sum[4 * j], sum[4 * j + 1]), pack_bf16x2(sum[4 * u], sum[4 * u + 1]));
    act_hi[j] = swiglu_bf16x2(pack_bf16x2(sum[4 * j + 2], sum[4 * j + 3]), pack_bf16x2(sum[4 * u + 2], sum[4 * u + 3]));
    amax_lo = fmaxf(amax_lo, bf16x2_amax(act_lo[j]));
    amax_hi = fmaxf(amax_hi, bf16x2_amax(act_hi[j]));
  }
#pragma unroll
  for (int d = 1; d < 4; d <<= 1) {  // the row's other three lanes
    amax_lo = fmaxf(amax_lo, __shfl_xor_sync(0xffffffffu, amax_lo, d));
    amax_hi = fmaxf(amax_hi, __shfl_xor_sync(0xffffffffu, amax_hi, d));
  }
  const float inv_lo = fp8_inv_scale(amax_lo), inv_hi = fp8_inv_scale(amax_hi);
  const int colq = 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    put(0, 8 * j + colq, quantize_bf16x2(act_lo[j], inv_lo));
    put(8, 8 * j + colq, quantize_bf16x2(act_hi[j], inv_hi));
  }
  return make_float2(fp8_scale(amax_lo), fp8_scale(amax_hi));
}

}  // namespace epserve
