// 1 x 128 row quantization in registers (common/fp8.cuh's convention), shared by the row
// quantizers (ffn/quantize_fp8.cu) and the FP8 dispatch's quantizing send (comm/dispatch.cu
// built with EPSERVE_DISPATCH_QUANTIZE): one set of functions, so one set of bits. A block's
// amax is a max of magnitudes (exact, in any order), so the bits do not depend on how the
// block's 128 values are spread over lanes.
#pragma once
#include "common/fp8.cuh"

namespace epserve {

// The largest v over each group of kLanes neighbouring lanes (a power of two, at most 32),
// in every lane of the group. Every lane of the warp takes part.
template <int kLanes>
__device__ __forceinline__ float lanes_max(float v) {
  static_assert(kLanes > 0 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "a power of two lanes, at most 32");
#pragma unroll
  for (int d = kLanes / 2; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
  return v;
}

// The largest v over the warp, in every lane.
__device__ __forceinline__ float warp_max(float v) { return lanes_max<32>(v); }

// Four bf16 (two words) to four e4m3 in one word, lowest column in the lowest byte.
__device__ __forceinline__ uint32_t quantize_bf16x4(uint2 v, float inv) {
  return static_cast<uint32_t>(quantize_bf16x2(v.x, inv)) | (static_cast<uint32_t>(quantize_bf16x2(v.y, inv)) << 16);
}

// Largest magnitude of eight bf16 (a 16-byte chunk), as fp32.
__device__ __forceinline__ float bf16x8_amax(uint4 v) {
  return fmaxf(fmaxf(bf16x2_amax(v.x), bf16x2_amax(v.y)), fmaxf(bf16x2_amax(v.z), bf16x2_amax(v.w)));
}

// Eight bf16 (a 16-byte chunk) to eight e4m3 (8 bytes), lowest column in the lowest byte.
__device__ __forceinline__ uint2 quantize_bf16x8(uint4 v, float inv) {
  return make_uint2(quantize_bf16x4(make_uint2(v.x, v.y), inv), quantize_bf16x4(make_uint2(v.z, v.w), inv));
}

}  // namespace epserve
