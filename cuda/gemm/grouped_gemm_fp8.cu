// The block-scaled FP8 grouped GEMM (issue 16): A [M, K] and B [E, rows, K] in e4m3, A with
// one fp32 scale per row and 128-wide k-block, B with one per 128 x 128 block (DeepSeek-V3's
// layout, common/fp8.cuh's convention), fp32 accumulation promoted per k-block
// (gemm/block_scaled_mma.cuh). C[m, :] = dequant(A)[m, :] @ dequant(B[e])^T per expert.
//
// The structure is the bf16 kernel's (gemm/grouped_gemm_wgmma.cu, whose comment explains
// each choice), without its experimental knobs: a persistent grid taking 128 x 256 tiles from
// an atomic counter in gemm/tile_scheduler.cuh's order; two consumer warpgroups, 64 rows
// each, skipping the MMA of a half without rows; a producer warpgroup whose first thread
// issues the TMA loads of a ring of stages and whose other three warps write finished tiles
// out (the null build's C store, or the peer sink's send warps) while the consumers go on.
//
// What FP8 changes:
// - A stage is one k-block: 128 e4m3 = 128 bytes a row, one 128-byte swizzle row, so A
//   (16 KB) and B (32 KB) have the bf16 kernel's bytes for twice its MMA work; a third TMA
//   box brings the A scales of the tile's rows (scales stored k-block-major, [K / 128, ld],
//   so they are one contiguous box). That box's first column is the tile's first row rounded
//   down to a multiple of 4, and it is 132 floats wide: a TMA box's start in its innermost
//   dimension must be 16-byte aligned (common/ptx.cuh, tma_load_2d), experts start at any
//   row, and cuTensorMapEncodeTiled cannot check a coordinate. The first version started the
//   box at the tile's first row; its first GPU run died with CUDA_ERROR_ILLEGAL_INSTRUCTION
//   on experts starting at rows 0, 64, 129, 130, ... (notes/gemm.md). B's scales are read by
//   the consumers from global memory (one float a half a k-block, the same for every thread:
//   a broadcast).
// - A consumer keeps a 128 x 256 tile's fp32 sum (128 registers) and computes each k-block
//   into a 64-register part, one 128-column half at a time (sum + two parts would not fit).
// - -DEPSERVE_GEMM_SWIGLU=1 builds GEMM 1: B is w13 [E, 2N, K], a stage holds N-tile n's
//   128 gate rows and the matching up rows, and the epilogue applies SwiGLU and quantizes
//   the tile's 128 act columns (one scale block) to e4m3 with one scale a row
//   (ffn/swiglu_quantize.cuh): C is act_q [M, N] e4m3 and c_scales [N / 128, c_scale_ld]
//   fp32, which is GEMM 2's A and A scales as they are. Without it (GEMM 2) C is bf16 [M, N]
//   and the tile goes to the sink exactly as in the bf16 kernel.
#include "common/bf16.cuh"
#include "common/bulk_copy.cuh"
#include "common/fp8.cuh"
#include "common/ptx.cuh"
#include "ffn/swiglu_quantize.cuh"
#include "gemm/block_scaled_mma.cuh"
#include "gemm/tile_scheduler.cuh"
#include "sinks/ep_peer_sink.cuh"
#if defined(EPSERVE_SINK_BULK) && EPSERVE_SINK_BULK  // the bulk-copy send warps (EPSERVE_SINK_STORES=bulk)
#include "sinks/ep_peer_sink_bulk.cuh"
#endif
#include "sinks/null_peer_sink.cuh"
#include "sinks/tile_mailbox.cuh"

#ifndef EPSERVE_SINK
#error "build with -DEPSERVE_SINK=NullPeerSink or -DEPSERVE_SINK=EpPeerSink"
#endif
#ifndef EPSERVE_GEMM_SWIGLU
#define EPSERVE_GEMM_SWIGLU 0
#endif
#ifndef EPSERVE_GROUP_N
#define EPSERVE_GROUP_N 4  // n-tiles of a weight-sharing group (gemm/tile_scheduler.cuh)
#endif
// Diagnostic builds (tests/gpu/test_gemm_fp8.py's probes, launch/jobs/probe_gemm_fp8.py), none
// of them shipped; each keeps every barrier, arrival and byte count of the default build, so
// a build that runs shows that what it left out was not the fault:
// - EPSERVE_GEMM_FP8_TMA_LOADS: which TMA boxes the producer issues, bit 0 A, bit 1 A's
//   scales, bit 2 B (default 7, all). A box left out is counted as arrived bytes instead
//   (mbarrier.expect_tx of the bytes, then mbarrier.complete_tx of them), so the stage still
//   completes; the consumers then compute on whatever the ring holds.
// - EPSERVE_GEMM_FP8_MMA=0: the consumers issue no wgmma and promote nothing (a scale the
//   ring holds unloaded could be NaN); the output is all zeros.
// - EPSERVE_GEMM_FP8_CHECK_TMA=1: before each TMA load the producer checks what the hardware
//   requires of it and cuTensorMapEncodeTiled cannot see (shared destination aligned to 128
//   bytes, 1024 for the swizzled A and B boxes; innermost start coordinate a multiple of 16
//   bytes) and on a violation prints the load, its coordinates and the tile, then traps.
// - EPSERVE_GEMM_FP8_UNALIGNED_SCALES=1: the A-scale box starts at the tile's first row
//   itself, as the first version did (the same values land in the same places): the build
//   that reproduces the first GPU run's fault if an unaligned start was its cause.
// - EPSERVE_GEMM_FP8_RELEASE_BY_WARPGROUP=1: a stage is freed by one arrival per consumer
//   warpgroup (its thread 0), as before the split tails' scale race was fixed (see `release`
//   in the consumers): the build that reproduces that race (launch/jobs/check_fp8_race.py
//   --release-by-warpgroup), never a shipped one.
// The shipped features, each a define so that the build without it can be timed against the
// shipped one (epserve.ffn.gemm_fp8.KNOBS; launch/jobs/ab_gemm_fp8.py, time_gemm_sustained.py,
// time_gemm_fp8.py --variants) and held to its bits (tests/gpu/test_gemm_fp8.py):
// - EPSERVE_GEMM_FP8_SPLIT_TAILS=1: a tile whose real rows all lie in its first 64 (an
//   expert's tail) is computed by both consumer warpgroups, each on one 128-column half of
//   the same 64 rows, instead of by the first warpgroup alone on both halves while the
//   second idles. The default's lone warpgroup leaves the tensor pipe idle during each of
//   its waits and promotions (nothing else issues wgmmas); split, the two warpgroups fill
//   each other's gaps as they do on whole tiles. At dsv3-prefill, balanced routing, 65 of
//   rank 0's 321 m-tiles are such tails (11% of the MMA work). Same bits: each output
//   element comes from the same wgmma instruction (m64n128k32, same descriptors: the same
//   A rows and B half of the same stage) and the same promotion fma with the same scale
//   product, k-block by k-block in the same order; only which warpgroup's registers hold
//   it changes. GEMM 1 (SwiGLU): the second warpgroup computes the up half and hands its
//   sums to the first through shared memory, rounded to bf16 (the epilogue's first step
//   rounds them to bf16 anyway, and a bf16 value widened to fp32 rounds back to itself),
//   and the first warpgroup runs the unchanged epilogue.
// - EPSERVE_GEMM_FP8_ZERO_PADDING=1 (shipped): an A box that reaches past its expert's last
//   row (a tail tile's) is loaded through a copy of map_a whose row extent ends there, so TMA
//   fills those rows with zeros instead of the next expert's rows. The tile's real rows get
//   the same sums (each output row depends on its own A row only), but multiplying zeros
//   switches less in the tensor cores, and this part's clock is bound by its power: at
//   dsv3-prefill's balanced routing, where padding is 11% of the MMA rows, GEMM 1 runs
//   1.5-1.8% faster and GEMM 2 0.6% (notes/gemm.md, fifteenth session). The copies live in
//   global memory, a set per SM (one CTA an SM), rewritten on the device (tensormap.replace).
// - EPSERVE_GEMM_FP8_L2_SIDES=1 (shipped): tiles handed out by L2 side. Hopper's L2 is two partitions
//   joined by a fabric; an SM reads through its near one, and lines homed in the far one
//   cross the fabric, once for each side whose SMs read them. An expert's weight tiles are
//   read by its 2-3 m-tiles, often on both sides. With this build a CTA on side 0 (by
//   epserve_gemm_sm_side[%smid], measured on the GPU in hand by the host: the side table
//   differs from die to die) takes tiles in the scheduler's order from the front, a CTA on
//   side 1 from the back, so each side works on experts of its own; the two meet where they
//   run out (one 64-bit counter holds both counts, a take fails once they sum to the tile
//   count). Same bits: a tile's work does not depend on which CTA runs it, and any table
//   (epserve/runtime/l2_sides.py writes the measured one, or zeros) gives them. Shipped since
//   the twenty-second session: fabric traffic down a third, time unchanged at the power limit
//   (fifteenth session), and GEMM 1 0.9-2.7%, GEMM 2 0.4-1.7% faster timed as the bench times them.
// - EPSERVE_GEMM_FP8_PUBLISH_TILE=1 (shipped): the producer, which decodes each tile it takes
//   anyway, writes the decoded tile (expert, rows, columns) beside its index in the tile's
//   first stage, and prefetches the lines of the tile's weight scales into the SM's L1; the
//   consumers read the tile from shared memory instead of decoding it again (a binary search
//   over the experts and two global loads on their path into every tile). Same bits: the same
//   tile. Shipped since the twenty-third session: GEMM 2 0.8-2.6% faster (4.6% in one run),
//   GEMM 1 unchanged (-1.3% to +0.3%), timed as the bench times them (notes/gemm.md).
// - EPSERVE_GEMM_FP8_TAKE_AHEAD=1 (shipped for GEMM 2 since the twenty-fourth session, 2-4%
//   faster; GEMM 1 4-7% slower with it, as each CTA claims its next tile a whole long tile
//   early): the producer takes the next tile from the counter during this one's loads (the
//   atomic after its first stage's loads, the answer read after the wait for its second
//   stage) and decodes it into shared memory, instead of between this tile's last load and
//   the next one's first. The stamps put that gap (~3000
//   cycles) on GEMM 2's path into each tile: its ring has 3 stages (its bf16 output tile
//   takes 66 KB), and the next tile's first stage arrived ~2100 cycles after the consumers
//   wanted it. Same bits: the same tiles, each CTA taking one tile ahead of the one it works on.
// Builds measured slower or no faster and taken out (thirtieth session; notes/gemm.md lists each
// with its measurements, and commit 31feff3 holds their code): 128 x 128 tiles, the overlapped
// promotion, the expert offsets in shared memory, the first k-block's promotion starting the
// sums, the mbarrier mailbox, GEMM 1's SwiGLU on the writer warps, stmatrix for the output
// tile, GEMM 2's output tile in the ring, the ring's handshake under the wgmmas, A from
// registers, B from a k-block-major copy of the weights, and the shared-memory padding probe.
// Diagnostic build: EPSERVE_GEMM_FP8_TRACE=1 stamps %clock64 at points of each tile into
// epserve_gemm_trace (below); launch/jobs/trace_gemm_fp8.py reads them.
#ifndef EPSERVE_GEMM_FP8_SPLIT_TAILS
#define EPSERVE_GEMM_FP8_SPLIT_TAILS 0
#endif
#ifndef EPSERVE_GEMM_FP8_L2_SIDES
#define EPSERVE_GEMM_FP8_L2_SIDES 0
#endif
#ifndef EPSERVE_GEMM_FP8_TMA_LOADS
#define EPSERVE_GEMM_FP8_TMA_LOADS 7
#endif
#ifndef EPSERVE_GEMM_FP8_MMA
#define EPSERVE_GEMM_FP8_MMA 1
#endif
#ifndef EPSERVE_GEMM_FP8_CHECK_TMA
#define EPSERVE_GEMM_FP8_CHECK_TMA 0
#endif
#ifndef EPSERVE_GEMM_FP8_UNALIGNED_SCALES
#define EPSERVE_GEMM_FP8_UNALIGNED_SCALES 0
#endif
#ifndef EPSERVE_GEMM_FP8_RELEASE_BY_WARPGROUP
#define EPSERVE_GEMM_FP8_RELEASE_BY_WARPGROUP 0
#endif
#ifndef EPSERVE_GEMM_FP8_ZERO_PADDING
#define EPSERVE_GEMM_FP8_ZERO_PADDING 0
#endif
#ifndef EPSERVE_GEMM_FP8_TRACE
#define EPSERVE_GEMM_FP8_TRACE 0
#endif
#ifndef EPSERVE_GEMM_FP8_PUBLISH_TILE
#define EPSERVE_GEMM_FP8_PUBLISH_TILE 0
#endif
#ifndef EPSERVE_GEMM_FP8_TAKE_AHEAD
#define EPSERVE_GEMM_FP8_TAKE_AHEAD 0
#endif

namespace {

using Sink = EPSERVE_SINK;
using namespace epserve;
constexpr bool kSwiGLU = EPSERVE_GEMM_SWIGLU != 0;
static_assert(!(kSwiGLU && Sink::kEnabled), "GEMM 1 keeps act on this GPU: its sink is the null one");
constexpr int kBM = 128, kBN = 256, kBK = kFp8BlockK;  // kBN: accumulator columns of a tile
constexpr int kHalfN = 128;  // columns of one part, and of one weight scale block
constexpr int kOutCols = kSwiGLU ? kBN / 2 : kBN;
constexpr int kConsumers = 2, kConsumerThreads = 128 * kConsumers;
constexpr bool kReleaseByWarpgroup = EPSERVE_GEMM_FP8_RELEASE_BY_WARPGROUP != 0;
constexpr bool kZeroPadding = EPSERVE_GEMM_FP8_ZERO_PADDING != 0;
constexpr bool kL2Sides = EPSERVE_GEMM_FP8_L2_SIDES != 0;
constexpr bool kPublishTile = EPSERVE_GEMM_FP8_PUBLISH_TILE != 0;
// A tile's first stage carries its index, and with kPublishTile its coordinates as the
// producer decoded them (index, expert, m_abs, m_end, n_abs, rows).
constexpr int kStageTileInts = kPublishTile ? 6 : 1;
// A decoded tile in shared memory after its index (slot[0]): a tile's first stage with
// kPublishTile, the next tile with EPSERVE_GEMM_FP8_TAKE_AHEAD.
__device__ __forceinline__ void store_tile(int* slot, const GroupedTile& t) {
  slot[1] = t.expert;
  slot[2] = t.m_abs;
  slot[3] = t.m_end;
  slot[4] = t.n_abs;
  slot[5] = t.rows;
}
__device__ __forceinline__ GroupedTile load_tile(const int* slot) {
  GroupedTile t;
  t.expert = slot[1];
  t.m_abs = slot[2];
  t.m_end = slot[3];
  t.n_abs = slot[4];
  t.rows = slot[5];
  return t;
}
constexpr bool kTakeAhead = EPSERVE_GEMM_FP8_TAKE_AHEAD != 0;
// The arrivals that free a stage: one per consumer thread (the consumers' `release` says why).
constexpr int kStageReleases = kReleaseByWarpgroup ? kConsumers : kConsumerThreads;
constexpr int kThreads = 128 * (kConsumers + 1);
constexpr int kProducerWarpgroup = kConsumers;
constexpr bool kSendWarps = Sink::kSendWarps > 0;
constexpr bool kWriterWarps = kSendWarps || !Sink::kEnabled;
static_assert(kWriterWarps, "a peer sink without send warps has no place in this kernel");
constexpr int kCWriterWarps = 3;
using CMailbox = TileMailbox<kConsumerThreads, kCWriterWarps * 32>;
constexpr int kMailboxBytes = 32;
constexpr int kLightRegs = 40, kConsumerRegs = 232;
// A CTA holds the registers of its launch (ptxas gives each thread 168 for one 384-thread CTA
// an SM), and setmaxnreg.inc waits until the warps that decreased have released enough: more
// than the launch holds waits forever (the likely cause of the hang of a build that gave the
// producer warpgroup 48: notes/dispatch.md, thirty-second session).
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
static_assert(kConsumers * 128 * kConsumerRegs + 128 * kLightRegs <= kLaunchRegs * kThreads, "registers");
static_assert(Sink::kSendWarps <= 3, "the send warps share the producer warpgroup with the TMA warp");
constexpr int kHalfA = 64 * kBK;  // bytes of one warpgroup's 64 rows of an A stage: one TMA box
// A's scales: a box of kScaleBox floats from the tile's first row rounded down to 4 (see the
// top of the file), in a slot of kStageScales bytes (a TMA destination is 128-byte aligned).
constexpr int kScaleAlign = 4;  // floats: 16 bytes
constexpr int kScaleBox = kBM + kScaleAlign;
constexpr int kScaleBoxBytes = kScaleBox * 4;
static_assert(kScaleBoxBytes % 16 == 0 && kScaleBox <= 256, "a TMA box: whole 16 bytes, at most 256 elements");
constexpr int kStageA = kBM * kBK, kStageB = kBN * kBK, kStageScales = (kScaleBoxBytes + 127) / 128 * 128;
constexpr int kLoads = EPSERVE_GEMM_FP8_TMA_LOADS;
static_assert(kLoads >= 0 && kLoads <= 7, "EPSERVE_GEMM_FP8_TMA_LOADS: bit 0 A, bit 1 A's scales, bit 2 B");
constexpr bool kLoadA = kLoads & 1, kLoadScales = kLoads & 2, kLoadB = kLoads & 4;
constexpr bool kMma = EPSERVE_GEMM_FP8_MMA != 0;
constexpr bool kCheckTma = EPSERVE_GEMM_FP8_CHECK_TMA != 0;
constexpr bool kUnalignedScales = EPSERVE_GEMM_FP8_UNALIGNED_SCALES != 0;
constexpr bool kSplitTails = EPSERVE_GEMM_FP8_SPLIT_TAILS != 0;
// The split tails' GEMM 1 epilogue hands the second warpgroup's up half to the first through
// the output tile's bytes, ordered by two mbarriers of 128 arrivals each: `written` (the
// second warpgroup's words are in place) and `read` (the first warpgroup has read them all,
// so it may write the act rows over them). Named barriers would do the same job; but any
// named barrier over part of the output threads between the drain and the hand-over, even
// one the first warpgroup takes alone, makes compute-sanitizer's racecheck report the tile's
// and the mailbox's writes unordered with the writer warps' reads after the hand-over (a
// standalone kernel with this protocol and nothing else shows it: notes/gemm.md,
// thirty-sixth session); with mbarriers it reports none.
constexpr int kSplitBarriers = kSplitTails && kSwiGLU ? 2 : 0;

// The finished tile in shared memory. GEMM 2: kBM rows of kOutCols bf16, each row padded by
// 16 bytes (bank spread; the peer sink reads rows by stride), as in the bf16 kernel. GEMM 1:
// kBM rows of 128 e4m3 with each row's 16-byte chunks rotated by row % 8 (the consumers'
// 2-byte writes then spread over the banks), followed by the rows' scales.
struct OutTile {
  static constexpr bool kBf16 = !kSwiGLU;
  static constexpr int kCols = kOutCols;  // columns the consumers write
  static constexpr int kLd = kCols + 8;  // bf16 elements between rows
  static constexpr int kRowBytes = kBf16 ? kLd * 2 : kOutCols;
  static constexpr int kBytes = kBM * kRowBytes + (kBf16 ? 0 : kBM * 4);
  __device__ static int byte_offset(int row, int col) {
    if constexpr (!kBf16) return row * kRowBytes + (((col >> 4) ^ (row & 7)) << 4) + (col & 15);
    return row * kRowBytes + col * 2;
  }
};

// Shared memory: the ring (A, B, A scales), the output tile, then the barriers, the mailbox
// and the scheduler's table; the peer build's row scatter keeps its tables in static shared
// memory, which the dynamic buffer follows at its 1024-byte alignment.
constexpr int kSmemLimit = 227 * 1024;
constexpr int kStaticSmem = Sink::kEnabled ? 2048 : 0;
constexpr int kMaxStages = 6;
// EPSERVE_GEMM_FP8_TAKE_AHEAD's next tile (index, expert, m_abs, m_end, n_abs, rows) waits in
// shared memory: the producer thread's registers are few (kLightRegs), and six more live
// across its loads spill.
constexpr int kAheadInts = kTakeAhead ? 6 : 0;
constexpr int kTailBytes = (2 * kMaxStages + kSplitBarriers) * 8 + kMailboxBytes +
                           (kMaxStages * kStageTileInts + kAheadInts) * 4 + (EPSERVE_MAX_LOCAL_EXPERTS + 1) * 4;
constexpr int kStageBytes = kStageA + kStageB + kStageScales;
constexpr int kOutTileBytes = OutTile::kBytes;
constexpr int kFitStages = (kSmemLimit - kStaticSmem - kOutTileBytes - kTailBytes) / kStageBytes;
constexpr int kStages = kFitStages < kMaxStages ? kFitStages : kMaxStages;
static_assert(kStages >= 2, "shared memory");
constexpr int kSmemBytes = kStages * kStageBytes + kOutTileBytes + kTailBytes;
using Scheduler = GroupedTileScheduler<kBM, kOutCols, EPSERVE_GROUP_N>;

struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

// The column where a tile's A-scale box starts: its first row rounded down to 16 bytes.
__device__ __forceinline__ int scale_box_col(int m_abs) {
  return kUnalignedScales ? m_abs : m_abs & ~(kScaleAlign - 1);
}

// GEMM 2's epilogue: sum's first kBlocks n8 blocks to the bf16 output tile. n8 block j:
// values 4j, 4j+1 at (row, col0 + 8j, +1), 4j+2, 4j+3 at row + 8.
template <int kBlocks>
__device__ __forceinline__ void store_bf16_tile_rows(unsigned char* out_tile, const float (&sum)[128], int row,
                                                     int col0) {
#pragma unroll
  for (int j = 0; j < kBlocks; ++j) {
    *reinterpret_cast<uint32_t*>(out_tile + OutTile::byte_offset(row, col0 + 8 * j)) =
        pack_bf16x2(sum[4 * j], sum[4 * j + 1]);
    *reinterpret_cast<uint32_t*>(out_tile + OutTile::byte_offset(row + 8, col0 + 8 * j)) =
        pack_bf16x2(sum[4 * j + 2], sum[4 * j + 3]);
  }
}

// GEMM 1's epilogue: SwiGLU and act's quantization of the thread's rows (row, row + 8) into
// the output tile and their scales. The row goes through an empty asm: otherwise the
// compiler keeps the 32 swizzled store addresses in registers across the tile loop, and
// they spill.
__device__ __forceinline__ void store_act_rows(unsigned char* out_tile, float* out_scales, const float (&sum)[128],
                                               int row, int lane) {
  int erow = row;
  asm volatile("" : "+r"(erow));
  const float2 s = swiglu_quantize(sum, lane, [&](int dr, int col, uint16_t v) {
    *reinterpret_cast<uint16_t*>(out_tile + OutTile::byte_offset(erow + dr, col)) = v;
  });
  if (lane % 4 == 0) {
    out_scales[row] = s.x;
    out_scales[row + 8] = s.y;
  }
}

// tma_load_2d, or (EPSERVE_GEMM_FP8_TMA_LOADS) its bytes counted as arrived without a load;
// with EPSERVE_GEMM_FP8_CHECK_TMA, the hardware's requirements checked first.
template <bool kIssue>
__device__ __forceinline__ void stage_load(const char* what, void* dst, const TensorMap* map, uint64_t* bar, int x,
                                           int y, int elem_bytes, uint32_t dst_align, uint32_t bytes, int tile) {
  if constexpr (kCheckTma) {
    const uint32_t d = smem_u32(dst);
    if ((d & (dst_align - 1)) || ((static_cast<long long>(x) * elem_bytes) & 15)) {
      printf("epserve_grouped_gemm_fp8: block %d, tile %d: TMA load of %s at (x %d, y %d) breaks a rule: shared "
             "destination 0x%x (must be aligned to %u), innermost start %lld bytes (must be a multiple of 16)\n",
             static_cast<int>(blockIdx.x), tile, what, x, y, d, dst_align, static_cast<long long>(x) * elem_bytes);
      __trap();
    }
  }
  if constexpr (kIssue) tma_load_2d(dst, map, bar, x, y);
  else mbarrier_complete_tx(bar, bytes);
}

}  // namespace

// EPSERVE_GEMM_FP8_ZERO_PADDING: per SM, copies of map_a whose row extent is cut at an
// expert's end, so a box reaching past it loads zeros there. A copy is rewritten only after
// every load through it has completed: kMaxStages + 1 copies, used in turn by the tiles that
// need one, each tile at least one load, the rewrite after the tile's first wait for a free
// stage, and the producer never more than the ring's stages ahead of the consumers (who wait
// for each load). A set per SM serves one CTA at a time: the shared memory allows no second.
constexpr int kPaddingMaps = kMaxStages + 1;
static_assert(!kZeroPadding || kSmemBytes > 228 * 1024 / 2, "one CTA an SM: the padding maps are per SM");
extern "C" {
__device__ TensorMap epserve_gemm_padding_maps[kZeroPadding ? 256 : 1][kPaddingMaps];
}

// EPSERVE_GEMM_FP8_L2_SIDES: each SM's L2 side (0 or 1) by %smid, written by the host.
extern "C" {
__device__ unsigned char epserve_gemm_sm_side[256];
}

// EPSERVE_GEMM_FP8_TRACE (a diagnostic build): %clock64 at points of each tile, for the first
// kTraceCtas CTAs and kTraceTiles tiles of each, by predicated stores (no branch in the tile
// loop). Slots: 0-3 the first consumer warpgroup before its tile's first wait, after it, after
// the k-loop, after the hand-over; 4-5 the same warpgroup after its k-blocks 0 and 1 (whole
// 128-row tiles); 6-7 the producer before taking the tile from the counter and after decoding it
// (with EPSERVE_GEMM_FP8_TAKE_AHEAD, 7 only, but for the first tile); 8 the first warpgroup
// before its k-block 0's first MMA (whole tiles). With EPSERVE_GEMM_FP8_TRACE=2 also 9-16 and
// 17-24: the first and the second warpgroup (their threads 0 and 128) after each of their
// k-blocks 0-7 of whole tiles (these stores slow GEMM 1 by ~7%: compare =2 builds with =2).
constexpr bool kTrace = EPSERVE_GEMM_FP8_TRACE != 0;
constexpr bool kTraceKBlocks = EPSERVE_GEMM_FP8_TRACE == 2;
constexpr int kTraceCtas = 132, kTraceTiles = 128, kTraceSlots = 25, kTracedKBlocks = 8;
extern "C" {
__device__ long long epserve_gemm_trace[kTrace ? kTraceCtas * kTraceTiles * kTraceSlots : 1];
}
__device__ __forceinline__ void trace_point(bool on, int seq, int slot) {
  if constexpr (kTrace) {
    long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
    const int i = (min(static_cast<int>(blockIdx.x), kTraceCtas - 1) * kTraceTiles + min(seq, kTraceTiles - 1)) *
                      kTraceSlots + slot;
    const bool p = on && blockIdx.x < kTraceCtas && seq < kTraceTiles;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p st.global.u64 [%1], %2;\n}\n" ::"r"(static_cast<int>(p)),
                 "l"(epserve_gemm_trace + i), "l"(t)
                 : "memory");
  }
}

extern "C" __constant__ int epserve_gemm_smem_bytes = kSmemBytes;
extern "C" __constant__ int epserve_gemm_l2_sides = kL2Sides;
extern "C" __constant__ int epserve_gemm_threads = kThreads;
extern "C" __constant__ int epserve_gemm_stages = kStages;
extern "C" __constant__ int epserve_gemm_b_box_rows = kSwiGLU ? kBN / 2 : kBN;  // the rows of B's TMA box
extern "C" __constant__ int epserve_gemm_scale_box_cols = kScaleBox;  // the columns (floats) of A's scale box

// map_a: A [M, K] e4m3 in 64-row x 128-byte boxes; map_sa: A's scales [K / 128, >= M] fp32
// in 1 x epserve_gemm_scale_box_cols boxes; map_b: B [E * b_rows, K] e4m3 in boxes of
// epserve_gemm_b_box_rows rows; b_scales [E, b_rows / 128, K / 128]. N: output columns (b_rows = N, or 2N with SwiGLU);
// N and K multiples of 128. C: bf16 [M, N] (null sink; may be null with the peer sink), or
// with SwiGLU e4m3 [M, N] and c_scales [N / 128, c_scale_ld]. tile_counter: two ints (three,
// 8-byte aligned, with EPSERVE_GEMM_FP8_L2_SIDES), zero at launch and zero again when the
// kernel ends (the last CTA resets them).
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    epserve_grouped_gemm_fp8(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_sa,
                             const __grid_constant__ TensorMap map_b, const float* __restrict__ b_scales,
                             void* __restrict__ C, float* __restrict__ c_scales, long long c_scale_ld,
                             const int* __restrict__ expert_offsets, int num_experts, int N, int K,
                             const PeerSendConfig cfg, int gate, int* __restrict__ tile_counter) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* ring_a = smem;
  unsigned char* ring_b = ring_a + kStages * kStageA;
  float* ring_sa = reinterpret_cast<float*>(ring_b + kStages * kStageB);
  unsigned char* out_tile = smem + kStages * kStageBytes;
  float* out_scales = reinterpret_cast<float*>(out_tile + kBM * OutTile::kRowBytes);  // GEMM 1 only
  uint64_t* full = reinterpret_cast<uint64_t*>(out_tile + kOutTileBytes);
  uint64_t* empty = full + kStages;
  uint64_t* split_written = full + 2 * kMaxStages;  // [kSplitBarriers]: written, then read
  uint64_t* split_read = split_written + 1;
  SendMailbox* mailbox = reinterpret_cast<SendMailbox*>(full + 2 * kMaxStages + kSplitBarriers);
  // [kMaxStages][kStageTileInts]
  int* stage_tile = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(mailbox) + kMailboxBytes);
  int* ahead = stage_tile + kMaxStages * kStageTileInts;  // [kAheadInts]
  int* mtile_prefix = ahead + kAheadInts;

  if (threadIdx.x == 0) {
    if (smem_u32(smem) & 1023u) __trap();  // the 128-byte swizzle's pattern is tied to 1024-byte alignment
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kStageReleases);  // one arrival per consumer thread: see `release`
    }
    if constexpr (kSplitBarriers > 0) {
      mbarrier_init(split_written, 128);
      mbarrier_init(split_read, 128);
    }
    fence_mbarrier_init();
  }
  Scheduler sched;
  // Its __syncthreads publishes the barriers too.
  sched.init(expert_offsets, num_experts, N, mtile_prefix);
  const int k_blocks = K / kBK;
  const int b_rows = kSwiGLU ? 2 * N : N;  // B rows per expert
  // Read through a shuffle so the compiler knows it is warp-uniform (the bf16 kernel says why).
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  if (warpgroup == kProducerWarpgroup) {
    setmaxnreg_dec<kLightRegs>();
    const int warp = (threadIdx.x % 128) / 32;
    if constexpr (kSendWarps) {
      if (warp >= 1 && warp <= Sink::kSendWarps && gate >= 0)
        Sink::template service<kConsumerThreads>(SmemTile{reinterpret_cast<const bf16_t*>(out_tile), OutTile::kLd, 0, 0},
                                                 mailbox, cfg, threadIdx.x % 128 - 32);
    } else {
      if (warp >= 1 && warp <= kCWriterWarps) {
        const int writer = threadIdx.x % 128 - 32;
        constexpr int kChunks = kOutCols * (kSwiGLU ? 1 : 2) / 16;  // 16-byte chunks of a tile row
        const int row_bytes = N * (kSwiGLU ? 1 : 2);
        // The tile's rows to C, then (GEMM 1) their scales.
        CMailbox::serve(mailbox, [&](const SendMailbox& m) {
          const int elem = kSwiGLU ? 1 : 2;
          for (int i = writer; i < m.rows * kChunks; i += kCWriterWarps * 32) {
            const int r = i / kChunks, c = (i % kChunks) * 16 / elem;  // c: the chunk's first column
            if (c < m.cols)
              st_global_v4(static_cast<unsigned char*>(C) + static_cast<long long>(m.m_abs + r) * row_bytes +
                               static_cast<long long>(m.n_abs + c) * elem,
                           ld_shared_v4(out_tile + OutTile::byte_offset(r, c)));
          }
          if constexpr (kSwiGLU) {
            for (int r = writer; r < m.rows; r += kCWriterWarps * 32)
              c_scales[(m.n_abs / kHalfN) * c_scale_ld + m.m_abs + r] = out_scales[r];
          }
        });
      }
    }
    // Producer: one thread takes tiles from the counter and keeps the ring full. A tile's first
    // stage carries its index to the consumers (the full barrier publishes it); index -1 in
    // an otherwise empty stage tells them to stop.
    if (threadIdx.x % 128 == 0) {
      int stage = 0;
      uint32_t phase = 0;
      TensorMap* padding_maps = nullptr;
      int padding_map = 0;
      if constexpr (kZeroPadding) {
        int smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        padding_maps = epserve_gemm_padding_maps[smid & 255];
        for (int m = 0; m < kPaddingMaps; ++m) padding_maps[m] = map_a;
      }
      int side = 0;
      if constexpr (kL2Sides) {
        int smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        side = epserve_gemm_sm_side[smid & 255];
      }
      // The lines of a tile's weight scales into this SM's L1, where the consumers' __ldg of
      // them at the tile's first k-block will find them (kPublishTile).
      auto prefetch_b_scales = [&](const GroupedTile& t) {
        const float* sb = b_scales + static_cast<long long>(t.expert) * (b_rows / kHalfN) * k_blocks;
        const int nb0 = t.n_abs / kHalfN, nb1 = kSwiGLU ? (N + t.n_abs) / kHalfN : nb0 + 1;
        const bool second = kSwiGLU || (kBN == 256 && t.n_abs + kHalfN < N);
        for (int h = 0; h < (second ? 2 : 1); ++h) {
          const char* p = reinterpret_cast<const char*>(sb + static_cast<long long>(h ? nb1 : nb0) * k_blocks);
          for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{127};
               a < reinterpret_cast<uintptr_t>(p) + 4 * k_blocks; a += 128)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(a));
        }
      };
      int seq = 0;  // tiles so far (EPSERVE_GEMM_FP8_TRACE)
      // A take from the counter in two steps: issue the atomic (its answer is a register the
      // thread waits on only where it reads it), then turn the answer into a tile index.
      auto take_issue = [&]() -> unsigned long long {
        if constexpr (kL2Sides)  // counts taken from the front (low word) and from the back
          return atomicAdd(reinterpret_cast<unsigned long long*>(tile_counter), side ? 1ull << 32 : 1ull);
        else
          return static_cast<unsigned int>(atomicAdd(tile_counter, 1));
      };
      auto take_index = [&](unsigned long long taken) -> int {
        if constexpr (kL2Sides) {
          const int front = static_cast<int>(taken & 0xffffffffu), back = static_cast<int>(taken >> 32);
          return front + back >= sched.total_tiles ? sched.total_tiles
                                                   : (side ? sched.total_tiles - 1 - back : front);
        } else {
          return static_cast<int>(taken);
        }
      };
      // EPSERVE_GEMM_FP8_TAKE_AHEAD: the next tile, taken during this one's loads, decoded
      // into `ahead`.
      auto decode_ahead = [&](int next_index) {
        ahead[0] = next_index;
        if (next_index < sched.total_tiles) {
          const GroupedTile n = sched.tile(next_index);
          store_tile(ahead, n);
          if constexpr (kPublishTile) prefetch_b_scales(n);
        }
      };
      if constexpr (kTakeAhead) {
        trace_point(true, seq, 6);
        decode_ahead(take_index(take_issue()));
        trace_point(true, seq, 7);
      }
      for (;;) {
        int index;
        if constexpr (kTakeAhead) {
          index = ahead[0];
        } else {
          trace_point(true, seq, 6);
          index = take_index(take_issue());
        }
        if (index >= sched.total_tiles) {
          mbarrier_wait(&empty[stage], phase ^ 1);
          stage_tile[stage * kStageTileInts] = -1;
          mbarrier_expect_tx(&full[stage], 0);
          // The last CTA to stop resets the counters for the next launch on the stream (with
          // kL2Sides, words 0 and 1 are the 64-bit tile counter, word 2 counts the stops).
          if (atomicAdd(tile_counter + (kL2Sides ? 2 : 1), 1) == static_cast<int>(gridDim.x) - 1) {
            tile_counter[0] = 0;
            tile_counter[1] = 0;
            if constexpr (kL2Sides) tile_counter[2] = 0;
          }
          break;
        }
        GroupedTile t;
        if constexpr (kTakeAhead) {
          t = load_tile(ahead);
        } else {
          t = sched.tile(index);
          trace_point(true, seq, 7);  // after the tile's coordinates: after the counter's answer
        }
        ++seq;
        if constexpr (kPublishTile && !kTakeAhead) prefetch_b_scales(t);
        const int a_boxes = t.rows > 64 ? 2 : 1;  // a tail of at most 64 rows loads (and computes) one half
        const int b_row = t.expert * b_rows + t.n_abs;
        const TensorMap* a_map = &map_a;
        // One k-block's stage: wait until it is free, then its loads (with the tile in its
        // first stage).
        auto load_k_block = [&](int kt) {
          mbarrier_wait(&empty[stage], phase ^ 1);  // every consumer thread is done with the stage
          if (kt == 0) {
            int* st = stage_tile + stage * kStageTileInts;
            st[0] = index;
            if constexpr (kPublishTile) store_tile(st, t);
          }
          if (kZeroPadding && kt == 0 && t.m_abs + 64 * a_boxes > t.m_end) {
            // Rows past the expert's end (the next expert's) load as zeros: the same sums for
            // the tile's real rows, and zeros switch the tensor cores' multipliers less.
            TensorMap* m = padding_maps + padding_map;
            padding_map = padding_map + 1 == kPaddingMaps ? 0 : padding_map + 1;
            tensor_map_set_extent<1>(m, t.m_end);
            a_map = m;
          }
          mbarrier_expect_tx(&full[stage], a_boxes * kHalfA + kStageB + kScaleBoxBytes);
          for (int h = 0; h < a_boxes; ++h)
            stage_load<kLoadA>("A", ring_a + stage * kStageA + h * kHalfA, a_map, &full[stage], kt * kBK,
                               t.m_abs + 64 * h, 1, 1024, kHalfA, index);
          // The scales of the tile's rows, from a 16-byte aligned column (past the end of A:
          // zeros, never used).
          stage_load<kLoadScales>("A scales", ring_sa + stage * (kStageScales / 4), &map_sa, &full[stage],
                                  scale_box_col(t.m_abs), kt, 4, 128, kScaleBoxBytes, index);
          unsigned char* b = ring_b + stage * kStageB;
          if constexpr (kSwiGLU) {  // gate rows, then the matching up rows
            stage_load<kLoadB>("B gate", b, &map_b, &full[stage], kt * kBK, b_row, 1, 1024, kStageB / 2, index);
            stage_load<kLoadB>("B up", b + kStageB / 2, &map_b, &full[stage], kt * kBK, b_row + N, 1, 1024,
                               kStageB / 2, index);
          } else {
            stage_load<kLoadB>("B", b, &map_b, &full[stage], kt * kBK, b_row, 1, 1024, kStageB, index);
          }
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        };
        if constexpr (kTakeAhead) {
          // The next tile's atomic goes out after this tile's first loads, before the wait for
          // its second stage (the producer's usual wait, about a k-block), and its answer is
          // read after that wait, when it is back: neither the counter's round trip nor the
          // decode then sits between this tile's last load and the next tile's first. (Between
          // two loops: taken inside the k-loop, its registers spilled.)
          load_k_block(0);
          // (no stamp 6 here: one more register live across the take spilled in the trace build)
          const unsigned long long taken = take_issue();
          if (k_blocks > 1) mbarrier_wait(&empty[stage], phase ^ 1);  // load_k_block(1)'s wait then returns at once
          decode_ahead(take_index(taken));
          trace_point(true, seq, 7);
          for (int kt = 1; kt < k_blocks; ++kt) load_k_block(kt);
        } else {
          for (int kt = 0; kt < k_blocks; ++kt) load_k_block(kt);
        }
      }
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    const int tid = threadIdx.x;  // 0 .. kConsumerThreads - 1
    const int lane = tid % 32, warp = (tid % 128) / 32;
    const int row = warpgroup * 64 + warp * 16 + lane / 4;  // this thread's first row in the tile
    // The rings' wgmma descriptors, by their low words: an operand d bytes into a ring is
    // ring_*_desc + d / 16 (common/ptx.cuh, smem_desc_sw128_lo).
    const uint32_t ring_a_desc = smem_desc_sw128_lo(ring_a), ring_b_desc = smem_desc_sw128_lo(ring_b);
    // Frees stage s for the producer's next TMA loads into it. Every thread arrives for
    // itself, after its own reads of the stage: besides the wgmmas (whose wait precedes every
    // release), the consumers read the stage's A scales (ring_sa) with ordinary loads, and the
    // split tails read them after the MMA, just before they free the stage.
    // With one arrival per warpgroup (its thread 0, as this kernel first had), the
    // warpgroup's other three warps could still be about to read their rows' scales when the
    // producer, seeing the stage free, had TMA overwrite them with the next k-block's (or the
    // next tile's): those rows' sums then took one k-block at a wrong scale. Each thread's
    // arrive (a release) orders its own loads before it, and the producer's wait acquires
    // them all. (One arrival per warp after a __syncwarp is as correct, and measured up to
    // 1.5% slower on GEMM 1: the lane branch and the warp sync sit between the wgmma wait and
    // the promotion; notes/gemm.md, thirteenth session.)
    auto release = [&](int s) {
      if constexpr (kReleaseByWarpgroup) {  // the diagnostic build of the race (top of the file)
        if (tid % 128 == 0) mbarrier_arrive(&empty[s]);
      } else {
        mbarrier_arrive(&empty[s]);
      }
    };
    int stage = 0;
    uint32_t phase = 0;
    auto advance = [&] {
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    };
    float sum[128];
    float part[64];
    bool tile_pending = false;  // the writer warps still hold the shared output tile
    uint32_t split_phase = 0;  // of split_written and split_read
    int seq = 0;  // tiles so far (EPSERVE_GEMM_FP8_TRACE)
    for (;;) {
      trace_point(tid == 0, seq, 0);
      mbarrier_wait(&full[stage], phase);  // the tile's first stage (the k-loop's wait returns at once)
      trace_point(tid == 0, seq, 1);
      const int* st = stage_tile + stage * kStageTileInts;
      const int index = st[0];
      if (index < 0) break;
      const GroupedTile t = kPublishTile ? load_tile(st) : sched.tile(index);
      // The weight scale rows of the tile's two halves: the gate block and its up block, or
      // two neighbouring blocks; GEMM 2's last tile may have no second half.
      const bool second_half = kSwiGLU || t.n_abs + kHalfN < N;
      const int nb0 = t.n_abs / kHalfN;
      const int nb1 = kSwiGLU ? (N + t.n_abs) / kHalfN : (second_half ? nb0 + 1 : nb0);
      const float* sb = b_scales + static_cast<long long>(t.expert) * (b_rows / kHalfN) * k_blocks;
      const float* sb0 = sb + static_cast<long long>(nb0) * k_blocks;
      const float* sb1 = sb + static_cast<long long>(nb1) * k_blocks;
      // EPSERVE_GEMM_FP8_SPLIT_TAILS: a tile of at most 64 real rows, computed by both
      // warpgroups, warpgroup h on half h of the first 64 rows (top of the file): its sums go
      // to sum[0, 64), the scales of its rows are those of srow.
      const bool split = kSplitTails && t.rows <= 64;
      const int srow = warp * 16 + lane / 4;
      const bool computes = split ? (warpgroup == 0 || second_half) : warpgroup * 64 < t.rows;
      if (split && computes) {
        const int b_off = warpgroup * kHalfN * kBK;  // the stage's first 64 rows of A are its only box
        const float* sbh = warpgroup == 1 ? sb1 : sb0;
#pragma unroll
        for (int i = 0; i < 64; ++i) sum[i] = 0.f;
        for (int kt = 0; kt < k_blocks; ++kt) {
          const float b_scale = __ldg(sbh + kt);  // in flight during the wait
          mbarrier_wait(&full[stage], phase);
          // The default build's first warpgroup issues these very wgmmas for half h.
          k_block_mma<kMma>(part, ring_a_desc + stage * kStageA / 16, ring_b_desc + (stage * kStageB + b_off) / 16);
          // The A scales of the stage are read after the MMA, just before the stage is freed.
          const float* sa = ring_sa + stage * (kStageScales / 4) + (t.m_abs - scale_box_col(t.m_abs));
          const float a_lo = sa[srow], a_hi = sa[srow + 8];
          release(stage);
          if constexpr (kMma) promote<0>(sum, part, a_lo * b_scale, a_hi * b_scale);
          advance();
        }
      } else if (computes) {
#pragma unroll
        for (int i = 0; i < 128; ++i) sum[i] = 0.f;
        for (int kt = 0; kt < k_blocks; ++kt) {
          const float b_scale0 = __ldg(sb0 + kt), b_scale1 = __ldg(sb1 + kt);  // in flight during the wait
          mbarrier_wait(&full[stage], phase);
          const float* sa = ring_sa + stage * (kStageScales / 4) + (t.m_abs - scale_box_col(t.m_abs));
          const float a_lo = sa[row], a_hi = sa[row + 8];
          const uint32_t a = ring_a_desc + (stage * kStageA + warpgroup * kHalfA) / 16;
          const uint32_t b = ring_b_desc + stage * kStageB / 16;
          if constexpr (kTrace) trace_point(tid == 0 && kt == 0, seq, 8);
          k_block_mma<kMma>(part, a, b);
          if (!second_half) release(stage);
          if constexpr (kMma) promote<0>(sum, part, a_lo * b_scale0, a_hi * b_scale0);  // (a probe: sum stays 0)
          if (second_half) {
            k_block_mma<kMma>(part, a, b + kHalfN * kBK / 16);
            release(stage);
            if constexpr (kMma) promote<64>(sum, part, a_lo * b_scale1, a_hi * b_scale1);
          }
          if constexpr (kTrace) trace_point(tid == 0 && kt < 2, seq, 4 + min(kt, 1));
          if constexpr (kTraceKBlocks)
            trace_point(tid % 128 == 0 && kt < kTracedKBlocks, seq,
                        9 + warpgroup * kTracedKBlocks + min(kt, kTracedKBlocks - 1));
          advance();
        }
      } else {  // no rows in this warpgroup's half: free the stages for the producer
        for (int kt = 0; kt < k_blocks; ++kt) {
          mbarrier_wait(&full[stage], phase);
          release(stage);
          advance();
        }
      }

      trace_point(tid == 0, seq++, 2);
      if constexpr (Sink::kEnabled) {
        if (gate < 0) continue;  // the peer sink gated off: the math alone
      }
      if (tile_pending) {  // wait until the writer warps are done with the last tile
        if constexpr (kSendWarps) Sink::template drain<kConsumerThreads>();
        else CMailbox::drain();
      }
      if (split) {
        if constexpr (kSwiGLU) {
          // The second warpgroup's up half to the first one, as the bf16 pairs the epilogue
          // makes of it first (pack_bf16x2 of a bf16 value widened to fp32 gives it back), in
          // the output tile's bytes (16 KB, free since the drain; word i of thread t at
          // i * 128 + t); the first warpgroup then runs the default epilogue.
          static_assert(kBM * OutTile::kRowBytes >= 32 * 128 * 4, "the split tails' exchange fits the output tile");
          uint32_t* xchg = reinterpret_cast<uint32_t*>(out_tile);
          const int t128 = tid % 128;
          if (warpgroup == 1) {
#pragma unroll
            for (int i = 0; i < 32; ++i) xchg[i * 128 + t128] = pack_bf16x2(sum[2 * i], sum[2 * i + 1]);
            mbarrier_arrive(split_written);  // a release of this thread's words
          } else {
            mbarrier_wait(split_written, split_phase);
#pragma unroll
            for (int i = 0; i < 32; ++i) {
              const uint32_t w = xchg[i * 128 + t128];
              sum[64 + 2 * i] = bf16_lo(w);
              sum[64 + 2 * i + 1] = bf16_hi(w);
            }
            // every word read before the tile is written over it
            mbarrier_arrive(split_read);
            mbarrier_wait(split_read, split_phase);
            store_act_rows(out_tile, out_scales, sum, srow, lane);
          }
          // Both barriers' next phases come after this tile's hand-over: the second warpgroup
          // writes again only after the next drain, which the writer warps reach after this
          // hand-over, which the first warpgroup reaches after both waits.
          split_phase ^= 1;
        } else if (computes) {  // half h's 128 columns of the first 64 rows
          store_bf16_tile_rows<kHalfN / 8>(out_tile, sum, srow, warpgroup * kHalfN + 2 * (lane % 4));
        }
      } else if (computes) {
        if constexpr (!OutTile::kBf16) {
          store_act_rows(out_tile, out_scales, sum, row, lane);
        } else {
          store_bf16_tile_rows<OutTile::kCols / 8>(out_tile, sum, row, 2 * (lane % 4));
        }
      }
      // The hand-over's barrier publishes the tile to the writer warps.
      const SmemTile tile{reinterpret_cast<const bf16_t*>(out_tile), OutTile::kLd, t.rows, min(kOutCols, N - t.n_abs)};
      if constexpr (kSendWarps) Sink::template hand_over<kConsumerThreads>(mailbox, tile, t.m_abs, t.n_abs, tid);
      else CMailbox::hand_over(mailbox, tile, t.m_abs, t.n_abs, tid);
      trace_point(tid == 0, seq - 1, 3);
      tile_pending = true;
    }
    if constexpr (kSendWarps) {
      if (gate >= 0) Sink::template shutdown<kConsumerThreads>(mailbox, tile_pending, tid);
    } else {
      CMailbox::shutdown(mailbox, tile_pending, tid);
    }
  }
}
