// The FP8 GEMM's consumer loop alone, without memory traffic, to see what each part of it
// costs the tensor pipe (launch/jobs/probe_fp8_consumer_loop.py times it; notes/gemm.md,
// twelfth session). One CTA an SM: two consumer warpgroups, each looping over k-blocks of
// two m64n128k32 halves (gemm/block_scaled_mma.cuh: issue, wait, promote into a 128-float
// sum), as grouped_gemm_fp8.cu's whole tiles do; the shared memory holds fixed e4m3 values
// and is never reloaded. -DEPSERVE_PROBE_LEVEL adds the kernel's other work step by step:
//   0  descriptors of one fixed stage, fixed scales: the loop's pattern alone
//   1  descriptors of a 3-stage ring, from one low word and offsets (the shipped kernel)
//   2  + each k-block's A scales from the stage (shared memory) and B scales by __ldg
//   3  + the full / empty mbarriers of the ring, with a producer thread that counts each
//      stage's bytes as arrived (no copy: the diagnostic no-loads build's handshake)
//   4  level 3 with each descriptor rebuilt from a pointer per wgmma (the kernel before the
//      twelfth session)
//   5  level 3 without the consumers' wait on the full barrier (the producer still runs)
//   6  level 2 + the consumers' arrivals on the empty barriers alone (no producer, no wait)
//   9  level 3 with the handshake under the wgmmas (the GEMM build of it, taken out): k-block
//      kt waits for kt + 1's stage with its second group in flight and frees kt - 1's stage
//      after issuing its first
//   10 level 3 with A from registers (the RS wgmma): each k-block's A rows read once by
//      ldmatrix for both halves, instead of by each half's wgmmas from shared memory
// cycles[2 * block + warpgroup]: clock64 cycles of the warpgroup's loop.
#include "common/ptx.cuh"
#include "gemm/block_scaled_mma.cuh"

#ifndef EPSERVE_PROBE_LEVEL
#define EPSERVE_PROBE_LEVEL 1
#endif
#ifndef EPSERVE_PROBE_TILE_KB
#define EPSERVE_PROBE_TILE_KB 16
#endif
// The operands: 0 e4m3 values near 1 (few bits differ between them), 1 random e4m3 codes of
// either sign and any exponent (bit 0 clear, so no NaN), as real rows and weights have.
#ifndef EPSERVE_PROBE_RANDOM_DATA
#define EPSERVE_PROBE_RANDOM_DATA 0
#endif

namespace {

using namespace epserve;
constexpr int kLevel = EPSERVE_PROBE_LEVEL;
static_assert(kLevel >= 0 && kLevel <= 10, "EPSERVE_PROBE_LEVEL: 0 .. 10");
constexpr bool kProducer = kLevel >= 3 && kLevel != 6, kFullWait = kProducer && kLevel != 5;
constexpr bool kTileBarrier = kLevel == 7 || kLevel == 8, kStagger = kLevel == 8, kHidden = kLevel == 9;
constexpr bool kRegisterA = kLevel == 10;
constexpr int kTileKBlocks = EPSERVE_PROBE_TILE_KB;
constexpr int kStages = 3, kStageA = 128 * kFp8BlockK, kStageB = 256 * kFp8BlockK, kStageScales = 640;
constexpr int kScaleBoxBytes = 132 * 4;  // the GEMM's A-scale box: a tile's rows + 4 floats
constexpr int kHalfA = 64 * kFp8BlockK, kHalfB = 128 * kFp8BlockK;
constexpr int kStageBytes = kStageA + kStageB + kStageScales;

}  // namespace

extern "C" __constant__ int epserve_probe_smem_bytes = kStages * kStageBytes + 2 * kStages * 8;

extern "C" __global__ void __launch_bounds__(384, 1)
    epserve_probe_fp8_consumer_loop(int k_blocks, const float* __restrict__ b_scales, long long* __restrict__ cycles,
                                    float* __restrict__ sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* ring_a = smem;
  unsigned char* ring_b = ring_a + kStages * kStageA;
  float* ring_sa = reinterpret_cast<float*>(ring_b + kStages * kStageB);
  uint64_t* full = reinterpret_cast<uint64_t*>(ring_b + kStages * kStageB + kStages * kStageScales);
  uint64_t* empty = full + kStages;
  // e4m3 operands (EPSERVE_PROBE_RANDOM_DATA says which), 1.0f in the scale slots
  const int operand_words = kStages * (kStageA + kStageB) / 4;
  for (int i = threadIdx.x; i < kStages * kStageBytes / 4; i += blockDim.x) {
    uint32_t code = 0x38383838u ^ (i * 2654435761u & 0x07070707u);
    if constexpr (EPSERVE_PROBE_RANDOM_DATA) {
      code = (i + 1) * 2654435761u;
      code ^= code >> 15;
      code *= 2246822519u;
      code = (code ^ code >> 13) & 0xfefefefeu;
    }
    reinterpret_cast<uint32_t*>(smem)[i] = i >= operand_words ? 0x3f800000u : code;
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], 256);  // one arrival per consumer thread, as in the GEMM
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (warpgroup == 2) {
    setmaxnreg_dec<40>();
    if (kProducer && threadIdx.x == 256) {
      int stage = 0;
      uint32_t phase = 0;
      for (int kt = 0; kt < k_blocks; ++kt) {
        mbarrier_wait(&empty[stage], phase ^ 1);
        mbarrier_expect_tx(&full[stage], kStageA + kStageB + kScaleBoxBytes);
        mbarrier_complete_tx(&full[stage], kStageA);
        mbarrier_complete_tx(&full[stage], kScaleBoxBytes);
        mbarrier_complete_tx(&full[stage], kStageB);
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }
  setmaxnreg_inc<232>();
  const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
  const int row = warpgroup * 64 + warp * 16 + lane / 4;
  const uint32_t ring_a_desc = smem_desc_sw128_lo(ring_a), ring_b_desc = smem_desc_sw128_lo(ring_b);
  float sum[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) sum[i] = 0.f;
  float part[64];
  const float fixed_scale = 1.f / (1 + threadIdx.x);
  int stage = 0;
  uint32_t phase = 0;
  const long long t0 = clock64();
  for (int kt = 0; kt < k_blocks; ++kt) {
    const bool tile_start = kTileBarrier && kt % kTileKBlocks == 0;
    if (tile_start) named_barrier_sync<1, 256>();
    float b0 = fixed_scale, b1 = fixed_scale, a_lo = 1.f, a_hi = 1.f;
    if constexpr (kLevel >= 2) {
      b0 = __ldg(b_scales + kt);
      b1 = __ldg(b_scales + k_blocks + kt);
    }
    if (kFullWait && (!kHidden || kt == 0)) mbarrier_wait(&full[stage], phase);
    if constexpr (kLevel >= 2) {
      const float* sa = ring_sa + stage * (kStageScales / 4);
      a_lo = sa[row];
      a_hi = sa[row + 8];
    }
    const int ring_stage = kLevel == 0 ? 0 : stage;
    const uint32_t a = ring_a_desc + (ring_stage * kStageA + warpgroup * kHalfA) / 16;
    const uint32_t b = ring_b_desc + ring_stage * kStageB / 16;
    uint32_t a_frag[16];
    if constexpr (kRegisterA) load_a_k_block(a_frag, ring_a + ring_stage * kStageA + warpgroup * kHalfA, warp, lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (kStagger && h == 0 && tile_start && warpgroup == 1) named_barrier_sync_across_roles<2, 256>();
      if constexpr (kRegisterA)
        k_block_mma_issue_rs(part, a_frag, b + h * kHalfB / 16);
      else if constexpr (kLevel == 4)
        k_block_mma_issue(part, ring_a + ring_stage * kStageA + warpgroup * kHalfA,
                          ring_b + ring_stage * kStageB + h * kHalfB);
      else
        k_block_mma_issue(part, a, b + h * kHalfB / 16);
      if (kHidden && h == 0 && kt > 0) mbarrier_arrive(&empty[stage == 0 ? kStages - 1 : stage - 1]);
      if (kHidden && h == 1 && kt + 1 < k_blocks) {
        const int next = stage + 1 == kStages ? 0 : stage + 1;
        mbarrier_wait(&full[next], next == 0 ? phase ^ 1 : phase);
      }
      k_block_wait<0>(part);
      if (kStagger && h == 0 && tile_start && warpgroup == 0) named_barrier_arrive<2, 256>();
      if (kLevel >= 3 && !kHidden && h == 1) mbarrier_arrive(&empty[stage]);
      const float s = h ? b1 : b0;
      if (h == 0) promote<0>(sum, part, a_lo * s, a_hi * s);
      else promote<64>(sum, part, a_lo * s, a_hi * s);
    }
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  if constexpr (kHidden) mbarrier_arrive(&empty[stage == 0 ? kStages - 1 : stage - 1]);
  const long long t1 = clock64();
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) acc += sum[i];
  if (acc == 12345.f) sink[threadIdx.x] = acc;  // keeps the sums (and so the MMAs) alive
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 2 + warpgroup] = t1 - t0;
}
