// One consumer warpgroup's step of the block-scaled FP8 GEMM (DeepSeek-V3's recipe, as
// DeepGEMM runs it on Hopper): the tensor cores accumulate one 128-wide k-block of e4m3
// products into a fresh fp32 `part`, and the warpgroup then adds part * (scale of A's row
// for this k-block * scale of B's 128 x 128 block) into its running fp32 sum. Two reasons
// to leave the tensor core's accumulator after every k-block: the scales change with the
// k-block, and Hopper's FP8 MMA accumulates with fewer mantissa bits than fp32, which over
// a long K loses precision that a sum of 128-term partials in CUDA-core fp32 keeps.
//
// `part` covers 64 rows x 128 columns (one wgmma m64n128k32 four times along k): the
// 128 x 256 tile's sum (128 floats a thread) plus one part (64) fit a consumer's registers,
// a second part would not, so a tile's two 128-column halves take turns.
#pragma once
#include "common/ptx.cuh"
#include "common/wgmma_fp8.cuh"

namespace epserve {

constexpr int kFp8BlockK = 128;  // k-block of the scales: one 128-byte row of a stage

// part = a[64 rows, k-block] . b[128 rows, k-block]^T, both 128-byte swizzled K-major tiles
// of one stage, in two steps: k_block_mma_issue issues the four wgmmas as one group;
// k_block_wait<n> returns when at most n groups are pending, and fences `part` (the group
// that wrote it must be the older one). A caller that keeps one k-block's wgmmas in flight
// while it promotes the previous one (an overlapped loop, as the GEMM once had: notes/gemm.md)
// calls them apart, with the same bracket and waits on every path (ptxas serializes every wgmma of a kernel where a
// wait sits on a path of its own, or a bracket straddles a branch).
// The operands can also be given as their descriptors' low words (common/ptx.cuh,
// smem_desc_sw128_lo): a k32 step is 32 bytes further, 2 more.
__device__ __forceinline__ void k_block_mma_issue(float (&part)[64], uint32_t a_lo, uint32_t b_lo) {
  fence_operands(part);  // the last promotion's reads of part stay before the fence
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kFp8BlockK / 32; ++kk)
    wgmma_m64n128k32_e4m3(part, smem_desc_sw128_from_lo(a_lo + 2 * kk), smem_desc_sw128_from_lo(b_lo + 2 * kk),
                          kk != 0);
  wgmma_commit();
}
__device__ __forceinline__ void k_block_mma_issue(float (&part)[64], const unsigned char* a, const unsigned char* b) {
  k_block_mma_issue(part, smem_desc_sw128_lo(a), smem_desc_sw128_lo(b));
}
// The RS form (A from registers, common/wgmma_fp8.cuh): load_a_k_block reads this warp's 16
// rows of a warpgroup's 64-row A block (a_rows: its first row in a 128-byte swizzled stage,
// 1024-byte aligned) for the four k32 steps of a k-block, by one ldmatrix.x4 a step;
// k_block_mma_issue_rs then issues the four wgmmas from them, and a k-block's two halves share
// one load. (The consumer-loop probe's level 10; the GEMM's build of it was measured slower and
// taken out, notes/gemm.md.)
__device__ __forceinline__ void load_a_k_block(uint32_t (&a)[16], const unsigned char* a_rows, int warp, int lane) {
  const int r = warp * 16 + lane % 16;
#pragma unroll
  for (int kk = 0; kk < kFp8BlockK / 32; ++kk) {
    const int chunk = 2 * kk + lane / 16;
    ldmatrix_x4(*reinterpret_cast<uint32_t(*)[4]>(a + 4 * kk), a_rows + r * 128 + ((chunk ^ (r % 8)) * 16));
  }
}
__device__ __forceinline__ void k_block_mma_issue_rs(float (&part)[64], const uint32_t (&a)[16], uint32_t b_lo) {
  fence_operands(part);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kFp8BlockK / 32; ++kk)
    wgmma_m64n128k32_e4m3_rs(part, *reinterpret_cast<const uint32_t(*)[4]>(a + 4 * kk),
                             smem_desc_sw128_from_lo(b_lo + 2 * kk), kk != 0);
  wgmma_commit();
}
template <int kPending>
__device__ __forceinline__ void k_block_wait(float (&part)[64]) {
  wgmma_wait<kPending>();
  fence_operands(part);  // the promotion's reads of part after the wait
}

// Both steps: returns when the tensor cores are done with the stage's bytes and `part`.
// kIssue = false (a diagnostic build, EPSERVE_GEMM_FP8_MMA=0): no wgmma at all, part = 0.
// (Operand: a stage pointer, or a descriptor's low word, as for k_block_mma_issue.)
template <bool kIssue = true, class Operand>
__device__ __forceinline__ void k_block_mma(float (&part)[64], Operand a, Operand b) {
  if constexpr (!kIssue) {
#pragma unroll
    for (int i = 0; i < 64; ++i) part[i] = 0.f;
  } else {
    k_block_mma_issue(part, a, b);
    k_block_wait<0>(part);
  }
}

// sum[kOffset + i] += part[i] * scale of part[i]'s row: s_lo for this thread's row
// (part[4j], part[4j+1]), s_hi for the row 8 below (part[4j+2], part[4j+3]). One rounded
// fma per value, written out so every build (fused SwiGLU or not) rounds alike.
template <int kOffset>
__device__ __forceinline__ void promote(float (&sum)[128], const float (&part)[64], float s_lo, float s_hi) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    sum[kOffset + 4 * j] = __fmaf_rn(part[4 * j], s_lo, sum[kOffset + 4 * j]);
    sum[kOffset + 4 * j + 1] = __fmaf_rn(part[4 * j + 1], s_lo, sum[kOffset + 4 * j + 1]);
    sum[kOffset + 4 * j + 2] = __fmaf_rn(part[4 * j + 2], s_hi, sum[kOffset + 4 * j + 2]);
    sum[kOffset + 4 * j + 3] = __fmaf_rn(part[4 * j + 3], s_hi, sum[kOffset + 4 * j + 3]);
  }
}

}  // namespace epserve
