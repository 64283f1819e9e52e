// e4m3 (float8_e4m3fn: no infinities, 448 its largest finite value) and the block scale
// convention the FP8 path shares with DeepSeek-V3 and DeepGEMM: a block whose largest
// magnitude is amax is stored as q = e4m3(x * (448 / amax)) with scale = amax / 448, so that
// x ~ q * scale. amax is floored at kFp8MinAmax, so an all-zero block gets zeros and a finite
// scale, never NaN. Both divisions are IEEE (NVRTC rounds '/' on floats correctly unless
// told otherwise) and the product is one rounded multiply, so epserve/check/fp8_reference.py
// reproduces every bit in NumPy float32.
#pragma once
#include "common/types.cuh"

// e4m3 travels as its byte.
typedef unsigned char fp8_t;

namespace epserve {

constexpr float kE4m3Max = 448.f;
constexpr float kFp8MinAmax = 1e-10f;

// What a block with largest magnitude `amax` stores as its scale.
__device__ __forceinline__ float fp8_scale(float amax) { return fmaxf(amax, kFp8MinAmax) / kE4m3Max; }
// What its values are multiplied by before rounding to e4m3.
__device__ __forceinline__ float fp8_inv_scale(float amax) { return kE4m3Max / fmaxf(amax, kFp8MinAmax); }

// Two floats to two e4m3 (lo in the low byte): round to nearest even, saturating at +-448
// (a product a hair over 448 from the rounded inverse scale must not become NaN).
__device__ __forceinline__ uint16_t pack_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// Largest magnitude of the two bf16 halves of a word, as fp32 (exact: bf16 widens exactly).
__device__ __forceinline__ float bf16x2_amax(uint32_t pair) {
  return fmaxf(fabsf(__uint_as_float(pair << 16)), fabsf(__uint_as_float(pair & 0xffff0000u)));
}

// A bf16 pair times the inverse scale, to e4m3x2.
__device__ __forceinline__ uint16_t quantize_bf16x2(uint32_t pair, float inv) {
  return pack_e4m3x2(__uint_as_float(pair << 16) * inv, __uint_as_float(pair & 0xffff0000u) * inv);
}

}  // namespace epserve
