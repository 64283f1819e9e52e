// The grouped GEMM on Hopper's own path: TMA loads into a ring of shared-memory stages,
// wgmma on two consumer warpgroups, a producer warpgroup that runs ahead (its loads of the
// next tile overlap the consumers' epilogue), a persistent grid whose CTAs take tiles from an
// atomic counter in gemm/tile_scheduler.cuh's L2-friendly order. Same contract as
// gemm/grouped_gemm.cu: C[m, :] = A[m, :] @ B[e]^T per expert, the epilogue's tile handed
// to the sink chosen by -DEPSERVE_SINK (NullPeerSink stores C; EpPeerSink sends the rows
// home and C may be null).
//
// -DEPSERVE_GEMM_SWIGLU=1 builds GEMM 1 with SwiGLU in its epilogue: B is w13 [E, 2N, K]
// (gate rows, then up rows) and C is act [M, N]. A tile loads N-tile n's 128 gate rows and
// the matching 128 up rows into one 256-row B stage, so every thread holds gate and up of
// the same columns in its accumulators and writes silu(gate) * up; the [M, 2N] product is
// never stored. Gate and up are rounded to bf16 first, as GEMM 1's output is defined.
//
// Tile 128 x 256 x 64: consumer warpgroup w computes rows 64w..64w+63 of the tile with
// wgmma m64n256k16, and only if the tile has rows there: an expert's tail of at most 64 rows
// costs one warpgroup's MMA, not two. The third warpgroup is the producer: its first warp
// issues the TMA loads, and the other three write each finished tile out while the
// consumers go on with the next tile's mainloop (the hand-over is sinks/tile_mailbox.cuh):
// with EpPeerSink they are its send warps, in the null build they store C (16-byte stores,
// whole rows per warp). Three warpgroups keep the kernel's register cap at 168, which the
// 128 accumulators of m64n256 need; setmaxnreg then moves registers from the producer
// warpgroup to the consumers. A arrives through a 2-D tensor map in 64-row boxes (one per
// warpgroup), B through one over [E * rows per expert, K], both with 128-byte swizzle; rows
// past the end of A read as zeros, rows of the next expert (or the up rows) past N compute
// columns the store masks.
//
// Pipeline depth: the ring has as many stages as shared memory holds beside the output tile
// (4 with SwiGLU's 128-column tile, 3 with a 256-column one). With 4 or more, a consumer
// keeps one k-slice's wgmmas in flight while it issues the next (wgmma.wait_group 1) and
// frees a stage only when its wgmmas are done; with 3 that would leave the producer a single
// stage to fill, so it waits for each slice (depth 0). -DEPSERVE_WGMMA_DEPTH overrides it.
//
// Knobs, off by default because they measured slower here (notes/gemm.md, "Swapped
// tails and CTA pairs"); tests/gpu/test_gemm_swiglu.py holds every build to the default's bits:
// - EPSERVE_GEMM_SWAP_TAILS=1: an expert's last, partial m-tile runs with A and B swapped,
//   the weight rows as the wgmma's M and the tile's rows, rounded up to EPSERVE_GEMM_SWAP_STEP
//   (16), as its N (common/wgmma_m64nN.cuh): 97% of the MMA rows real instead of 89% at
//   balanced routing, but no faster, since the tiles are bound by their operand traffic.
// - EPSERVE_GEMM_CLUSTER=2: CTA pairs (__cluster_dims__) compute neighbouring column tiles of
//   the same rows; the leader's producer feeds both, the A tile once by TMA multicast, so A's
//   L2 reads halve. Barrier operations at cluster scope in the k-loop cost 50%; with them at
//   CTA scope the pairs still ran 2-9% behind single CTAs. With EPSERVE_GEMM_CLUSTER_SHARES_B=1
//   the pair computes neighbouring m-tiles of one expert and shares B (33% less traffic per
//   CTA, but an expert's odd last m-tile leaves the follower idle): 13-23% behind.
// - EPSERVE_GEMM_SPLIT_K=2 (GEMM 2's 128 x 256 tiles on single CTAs; shipped as the
//   gemm_wgmma_*_split variants, chosen by epserve/ffn/tiles.py): a launch whose tiles make few
//   waves runs every tile as two work items, its first and its second half of the k-slices
//   (split at k_slices / 2, whole k-slices, rounded down). Whether a launch splits is decided
//   here, from its exact tile count (gemm/tile_scheduler.cuh, split_parts): by rule, when the
//   halves fill the SMs' last wave better, or always (split_policy 1, for tests); never when
//   the workspace has no room for the tiles or K is one k-slice. The counter hands out every
//   first half before any second half (split_item). A first half stores its fp32
//   accumulators to a workspace (per thread, in the register layout: coalesced, no shared
//   memory) and releases its warpgroup's flag; the second half waits for the flag (bounded,
//   then traps), loads them as its starting accumulators and goes on with wgmma's scale-d = 1:
//   the same sums in the same k order as one unsplit tile, so the same bits as the default
//   build. Flags hold the epoch of the launch that set them; the last CTA advances the epoch,
//   so no memset per launch. Mixtral's GEMM 2 (K 14336) on one H200: 0.419 against 0.450 ms
//   at 1024 tokens/rank (2.2 waves), 0.738 against 0.751 at 2048 (notes/gemm.md).
#include "common/bf16.cuh"
#include "common/ptx.cuh"
#include "common/wgmma_m64nN.cuh"
#include "ffn/swiglu.cuh"
#include "gemm/tile_scheduler.cuh"
#include "sinks/ep_peer_sink.cuh"
#if defined(EPSERVE_SINK_BULK) && EPSERVE_SINK_BULK  // the bulk-copy send warps (EPSERVE_SINK_STORES=bulk)
#include "sinks/ep_peer_sink_bulk.cuh"
#endif
#include "sinks/ep_peer_sink_counting.cuh"
#include "sinks/null_peer_sink.cuh"
#include "sinks/tile_mailbox.cuh"

#ifndef EPSERVE_SINK
#error "build with -DEPSERVE_SINK=NullPeerSink or -DEPSERVE_SINK=EpPeerSink"
#endif
#ifndef EPSERVE_GEMM_SWIGLU
#define EPSERVE_GEMM_SWIGLU 0
#endif
#ifndef EPSERVE_GEMM_SWAP_TAILS
#define EPSERVE_GEMM_SWAP_TAILS 0  // 1: an expert's partial m-tile runs with A and B swapped
#endif
#ifndef EPSERVE_GEMM_CLUSTER
#define EPSERVE_GEMM_CLUSTER 1  // 2: CTA pairs share A tiles by TMA multicast (for A/B timing)
#endif
#ifndef EPSERVE_GEMM_CLUSTER_SHARES_B
#define EPSERVE_GEMM_CLUSTER_SHARES_B 0  // 1: a cluster's CTAs share B (neighbouring m-tiles), not A
#endif
#ifndef EPSERVE_GEMM_SPLIT_K
#define EPSERVE_GEMM_SPLIT_K 1  // 2: every tile runs as two work items, one per half of K
#endif
#ifndef EPSERVE_GEMM_SPLIT_TIMEOUT_NS
#define EPSERVE_GEMM_SPLIT_TIMEOUT_NS 10000000000ull  // a second half's wait for its first half
#endif
#ifndef EPSERVE_GEMM_OFFNODE_FIRST
#define EPSERVE_GEMM_OFFNODE_FIRST 0  // 1: the m-tiles holding rows bound off-node are handed out first
#endif
#ifndef EPSERVE_GEMM_SWAP_STEP
#define EPSERVE_GEMM_SWAP_STEP 16  // a swapped tile's rows are rounded up to this: 16, 32, 64 or 128
#endif

namespace {

using Sink = EPSERVE_SINK;
using namespace epserve;
constexpr bool kSwiGLU = EPSERVE_GEMM_SWIGLU != 0;
constexpr bool kSwapTails = EPSERVE_GEMM_SWAP_TAILS != 0;
constexpr int kSwapStep = EPSERVE_GEMM_SWAP_STEP;
constexpr int kCluster = EPSERVE_GEMM_CLUSTER;
static_assert(kCluster == 1 || kCluster == 2, "clusters of one or two CTAs");
constexpr bool kShareB = EPSERVE_GEMM_CLUSTER_SHARES_B != 0;
static_assert(kSwapStep % 16 == 0 && 128 % kSwapStep == 0, "swapped widths: wgmma_m64nN.cuh has N = 16, 32, .., 128");
static_assert(!(kSwiGLU && Sink::kEnabled), "GEMM 1 keeps act on this GPU: its sink is the null one");
#ifndef EPSERVE_GEMM_BN
#define EPSERVE_GEMM_BN 256  // accumulator columns of a tile: 256, or 128 for shapes with few tiles
#endif
constexpr int kBM = 128, kBN = EPSERVE_GEMM_BN, kBK = 64;  // kBN: accumulator columns of a tile
static_assert(kBN == 256 || kBN == 128, "tiles 128 x 256 or 128 x 128");
// The 128-wide tile is for GEMM 2 where few tiles make few waves (notes/gemm.md, mixtral): the
// swapped tails and the CTA pairs are built around 256 weight rows a stage, SwiGLU around its
// gate and up halves of 128.
static_assert(kBN == 256 || (!kSwapTails && kCluster == 1 && !kSwiGLU), "a 128-wide tile: GEMM 2, no knobs");
// Split K's constants.
struct SplitK {
  static constexpr int kParts = EPSERVE_GEMM_SPLIT_K;
  // The state (uint32): the launch epoch, an error record (code, tile), the parts of the
  // last launch (1 or 2: what split_parts decided, for tests and benchmarks), then a flag per
  // (tile, consumer warpgroup) holding the epoch + 1 of the launch whose first half set it.
  static constexpr int kStateHead = 4;
  static constexpr unsigned kTimedOut = 1;  // state[1]: a second half's wait ran out ([2]: its tile)
  // A first half's stores are gathered for its flag's release by an mbarrier of the
  // warpgroup's 128 threads (one a consumer warpgroup, in shared memory after the ring's),
  // not by a named barrier of the warpgroup: racecheck reports a named barrier over part of
  // the output threads among the tile mailbox's barriers as a race on the mailbox
  // (sinks/tile_mailbox.cuh; launch/jobs/probe_racecheck_handover.py).
  static constexpr int kStoredBarriers = kParts > 1 ? 2 : 0;
};
constexpr int kSplitK = SplitK::kParts;
static_assert(kSplitK == 1 || kSplitK == 2, "split K in one or two parts");
// Across nodes, the overlap builds (gemm_wgmma_peer*_overlap, with EpPeerSinkCountingOffNode):
// a small kernel before the GEMM (epserve_gemm_off_node_first_order, below) writes a
// permutation of the tile indices in which the tiles of m-tiles holding rows bound off-node
// come first, each class in the default order; the producer hands tiles out through it, so
// the off-node rows are staged, counted and sent early while the rest of the GEMM runs.
constexpr bool kOffNodeFirst = EPSERVE_GEMM_OFFNODE_FIRST != 0;
static_assert(!kOffNodeFirst || (Sink::kEnabled && !kSwiGLU && kCluster == 1 && !kShareB),
              "off-node tiles first: GEMM 2 with the peer sink, single CTAs");
// Split K is for GEMM 2's wide tiles when they make few waves: the swapped tails' and SwiGLU's
// accumulator layouts, the CTA pairs' shared stages and the 128-wide tile are not built for it.
static_assert(kSplitK == 1 || (!kSwiGLU && !kSwapTails && kCluster == 1 && kBN == 256),
              "split K: GEMM 2's 128 x 256 tiles on single CTAs (no SwiGLU, swapped tails, CTA pairs or BN=128)");
constexpr int kAcc = kBN / 2;  // fp32 accumulators per consumer thread (m64 x kBN per warpgroup)
constexpr int kOutCols = kSwiGLU ? kBN / 2 : kBN;  // output columns of a tile
constexpr int kConsumers = 2, kConsumerThreads = 128 * kConsumers;
static_assert(SplitK::kStoredBarriers == 0 || SplitK::kStoredBarriers == kConsumers, "one per consumer warpgroup");
constexpr int kThreads = 128 * (kConsumers + 1);
constexpr int kProducerWarpgroup = kConsumers;
constexpr bool kSendWarps = Sink::kSendWarps > 0;
// Whether finished tiles go to writer warps: the sink's send warps, or the null build's C
// store. (A peer sink that sends from the output warps leaves the output warps to write.)
constexpr bool kWriterWarps = kSendWarps || !Sink::kEnabled;
constexpr int kCWriterWarps = 3;
using CMailbox = TileMailbox<kConsumerThreads, kCWriterWarps * 32>;
// 64K registers per SM: the producer warpgroup needs few, the consumers hold 128 fp32
// accumulators each.
constexpr int kLightRegs = 40, kConsumerRegs = 232;
static_assert(kConsumers * 128 * kConsumerRegs + 128 * kLightRegs <= 65536, "registers");
static_assert(Sink::kSendWarps <= 3, "the send warps share the producer warpgroup with the TMA warp");
constexpr int kHalfA = 64 * kBK * 2;  // one warpgroup's 64 rows of an A stage: one TMA box
constexpr int kStageA = kBM * kBK * 2, kStageB = kBN * kBK * 2;  // bytes
constexpr int kBLoads = kSwiGLU ? 2 : 1;  // TMA boxes per B stage: gate and up rows, or one

// The finished tile in shared memory, kBM rows of kOutCols bf16. Padded rows (16 bytes
// each) keep the consumers' 4-byte writes free of bank conflicts, and the peer sink reads
// rows by stride. The SwiGLU build needs those bytes for a fourth stage, so it packs the
// rows and rotates each row's 16-byte chunks by row % 8 instead, which spreads the same
// writes over all 32 banks.
struct OutTile {
  static constexpr bool kSwizzled = kSwiGLU;
  static constexpr int kLd = kSwizzled ? kOutCols : kOutCols + 8;
  static constexpr int kBytes = kBM * kLd * 2;
  // Element offset of (row, col); the 8 columns of a 16-byte chunk stay together.
  __device__ static int offset(int row, int col) {
    if constexpr (kSwizzled) return row * kLd + (((col >> 3) ^ (row & 7)) << 3) + (col & 7);
    return row * kLd + col;
  }
};
static_assert(!(Sink::kEnabled && OutTile::kSwizzled), "the peer sink reads the tile by row stride");

// Shared memory: the ring, the output tile, then the barriers, the mailbox and the
// scheduler's table. The peer build's row scatter keeps its own tables in static shared
// memory, which the dynamic buffer follows at its 1024-byte alignment.
constexpr int kSmemLimit = 227 * 1024;  // the most one block may opt in to on sm_90
constexpr int kStaticSmem = Sink::kEnabled ? 2048 : 0;
constexpr int kMaxStages = 6;
constexpr int kTailBytes = (2 * kMaxStages + SplitK::kStoredBarriers) * 8 + 32 + kMaxStages * 4 +
                           (EPSERVE_MAX_LOCAL_EXPERTS + 1) * 4 + (kSplitK > 1 ? 16 : 0);
constexpr int kFitStages = (kSmemLimit - kStaticSmem - OutTile::kBytes - kTailBytes) / (kStageA + kStageB);
constexpr int kStages = kFitStages < kMaxStages ? kFitStages : kMaxStages;
static_assert(kStages >= 2, "shared memory");
constexpr int kSmemBytes = kStages * (kStageA + kStageB) + OutTile::kBytes + kTailBytes;
#ifdef EPSERVE_WGMMA_DEPTH
constexpr int kWgmmaDepth = EPSERVE_WGMMA_DEPTH;
#else
constexpr int kWgmmaDepth = kStages >= 4 ? 1 : 0;
#endif
static_assert(kWgmmaDepth == 0 || kWgmmaDepth == 1, "wgmma groups in flight");
constexpr int kEpilogueBarrier = 1;  // named barrier of the consumer warpgroups
#ifndef EPSERVE_GROUP_N
#define EPSERVE_GROUP_N 4  // n-tiles of a weight-sharing group (gemm/tile_scheduler.cuh)
#endif
// A scheduled tile spans the cluster's CTAs: side by side in N (CTA r computes output
// columns [n_abs + r * kOutCols, + kOutCols) of the same rows, sharing A), or, sharing B,
// one above the other in M (CTA r computes rows [m_abs + r * kBM, + kBM) of the expert).
using Scheduler = GroupedTileScheduler<kShareB ? kBM * kCluster : kBM, kShareB ? kOutCols : kOutCols * kCluster,
                                       EPSERVE_GROUP_N>;

// CTA r's part of a scheduled tile; rows <= 0 or n_abs >= N: the CTA has none of it.
__device__ __forceinline__ GroupedTile cta_part(GroupedTile t, int r) {
  if constexpr (kShareB) {
    t.m_abs += r * kBM;
    t.rows = min(kBM, t.m_end - t.m_abs);
  } else {
    t.n_abs += r * kOutCols;
    t.rows = min(kBM, t.rows);
  }
  return t;
}

struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

template <int N>
struct SwapWidth {
  static constexpr int value = N;
};

// f(SwapWidth<n>{}) for the runtime width n (a multiple of kSwapStep up to 128): the
// swapped mainloop and epilogue are instantiated once per width.
template <int N = kSwapStep, class F>
__device__ __forceinline__ void with_swap_width(int n, F&& f) {
  if constexpr (N >= 128) {
    f(SwapWidth<128>{});
  } else {
    if (n == N) f(SwapWidth<N>{});
    else with_swap_width<N + kSwapStep>(n, f);
  }
}

// The first B-stage row (weight row of the tile) of consumer warpgroup w's m-block b in a
// swapped tile, and the output column that row becomes. With SwiGLU a warpgroup takes
// matching gate (b = 0) and up (b = 1) rows, so each thread holds both for its columns.
__device__ __forceinline__ int swap_weight_row(int w, int b) { return kSwiGLU ? 128 * b + 64 * w : 128 * w + 64 * b; }
__device__ __forceinline__ int swap_out_col(int w, int b) { return kSwiGLU ? 64 * w : 128 * w + 64 * b; }

// The overlap builds: ticket `taken` of the counter (part-major, as split_item reads it) as
// the item of the same part whose tile is tile_order[ticket's tile]; the default order when
// the launch has more tiles than the permutation has room for (its kernel wrote none then).
__device__ __forceinline__ int ordered_item(int taken, int total_tiles, const int* tile_order, int order_room) {
  if (total_tiles > order_room) return taken;
  const int part = taken / total_tiles, tile = taken - part * total_tiles;
  return part * total_tiles + __ldg(tile_order + tile);
}

}  // namespace

extern "C" __constant__ int epserve_gemm_smem_bytes = kSmemBytes;
extern "C" __constant__ int epserve_gemm_threads = kThreads;
extern "C" __constant__ int epserve_gemm_stages = kStages;
extern "C" __constant__ int epserve_gemm_b_box_rows = kBN / kBLoads;  // the rows of B's TMA box
extern "C" __constant__ int epserve_gemm_cluster = kCluster;  // the grid is a multiple of it
#if EPSERVE_GEMM_SPLIT_K > 1
// What the launcher allocates for split K (epserve/ffn/gemm.py): fp32 accumulators per tile in
// the workspace, and the uint32 words of the state before its flags (two per tile).
extern "C" __constant__ int epserve_gemm_split_tile_floats = kBM * kBN;
extern "C" __constant__ int epserve_gemm_split_state_head = SplitK::kStateHead;
// split_acc: the first halves' accumulators, kBM * kBN floats a tile; split_state: the epoch,
// the error record, the last launch's parts and the flags (zero when allocated; never reset
// after); split_tiles: the tiles both have room for (a launch with more runs unsplit);
// split_policy: 0 split by rule, 1 always (where the room and K allow).
#define EPSERVE_GEMM_SPLIT_PARAMS \
  , float2* __restrict__ split_acc, unsigned* __restrict__ split_state, int split_tiles, int split_policy
#else
#define EPSERVE_GEMM_SPLIT_PARAMS
#endif

#if EPSERVE_GEMM_OFFNODE_FIRST
// tile_order: the permutation epserve_gemm_off_node_first_order wrote for this launch;
// order_room: the tiles it has room for (a launch with more keeps the default order).
#define EPSERVE_GEMM_ORDER_PARAMS , const int* __restrict__ tile_order, int order_room
#else
#define EPSERVE_GEMM_ORDER_PARAMS
#endif

#if EPSERVE_GEMM_CLUSTER > 1
#define EPSERVE_GEMM_CLUSTER_DIMS __cluster_dims__(EPSERVE_GEMM_CLUSTER, 1, 1)
#else
#define EPSERVE_GEMM_CLUSTER_DIMS
#endif

// N: output columns (C is [M, N]). B holds N rows per expert, or 2N with SwiGLU.
// tile_counter: two ints, zero at launch and zero again when the kernel ends (the last CTA
// to finish resets them), so launches on one stream can share them, graph replays too.
extern "C" __global__ void EPSERVE_GEMM_CLUSTER_DIMS __launch_bounds__(kThreads, 1)
    epserve_grouped_gemm_wgmma(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
                               bf16_t* __restrict__ C, const int* __restrict__ expert_offsets, int num_experts, int N,
                               int K, const PeerSendConfig cfg, int gate,
                               int* __restrict__ tile_counter EPSERVE_GEMM_SPLIT_PARAMS EPSERVE_GEMM_ORDER_PARAMS) {
#if EPSERVE_GEMM_SPLIT_K == 1
  float2* const split_acc = nullptr;  // the split-K code below is compiled out (if constexpr)
  unsigned* const split_state = nullptr;
  constexpr int split_tiles = 0, split_policy = 0;
#endif
#if !EPSERVE_GEMM_OFFNODE_FIRST
  const int* const tile_order = nullptr;  // the default order (kOffNodeFirst is false)
  constexpr int order_room = 0;
#endif
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* ring_a = smem;
  unsigned char* ring_b = ring_a + kStages * kStageA;
  bf16_t* out_tile = reinterpret_cast<bf16_t*>(ring_b + kStages * kStageB);
  uint64_t* full = reinterpret_cast<uint64_t*>(reinterpret_cast<unsigned char*>(out_tile) + OutTile::kBytes);
  uint64_t* empty = full + kStages;
  uint64_t* split_stored = full + 2 * kMaxStages;  // [SplitK::kStoredBarriers]
  SendMailbox* mailbox = reinterpret_cast<SendMailbox*>(full + 2 * kMaxStages + SplitK::kStoredBarriers);
  int* stage_tile = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(mailbox) + 32);  // [kMaxStages]
  int* mtile_prefix = stage_tile + kMaxStages;
  unsigned* split_epoch_slot = reinterpret_cast<unsigned*>(mtile_prefix + EPSERVE_MAX_LOCAL_EXPERTS + 1);

  if (threadIdx.x == 0) {
    if (smem_u32(smem) & 1023u) __trap();  // the 128-byte swizzle's pattern is tied to 1024-byte alignment
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kConsumerThreads * kCluster);  // every consumer thread of every CTA: see `release`
    }
    for (int w = 0; w < SplitK::kStoredBarriers; ++w) mbarrier_init(&split_stored[w], 128);
    fence_mbarrier_init();
  }
  // Split K: the launch's epoch, read by the thread that later takes the CTA's done ticket
  // (with release), so the last CTA advances it only after every CTA has read it.
  if constexpr (kSplitK > 1) {
    if (threadIdx.x == kProducerWarpgroup * 128) *split_epoch_slot = *reinterpret_cast<volatile unsigned*>(split_state);
  }
  Scheduler sched;
  sched.init(expert_offsets, num_experts, N, mtile_prefix);  // its __syncthreads publishes the barriers too
  const int k_slices = K / kBK;
  // Work items per tile: every CTA computes the same from the same tile count.
  const int parts =
      kSplitK > 1 ? split_parts(sched.total_tiles, gridDim.x, k_slices, kSplitK, split_tiles, split_policy) : 1;
  unsigned split_epoch = 0;
  if constexpr (kSplitK > 1) {
    split_epoch = *split_epoch_slot;
    if (blockIdx.x == 0 && threadIdx.x == 0) split_state[3] = static_cast<unsigned>(parts);
  }
  // With clusters, the leader CTA's producer feeds both CTAs: the A tile by multicast, each
  // CTA's B tile (its own output columns), each stage's tile index by a remote store, and the
  // peer's full barrier by a remote arrive; both CTAs' consumers free a stage on the
  // leader's empty barrier. So the peer's barriers must exist before the leader starts.
  const uint32_t cta = kCluster > 1 ? cluster_ctarank() : 0;
  if constexpr (kCluster > 1) cluster_sync();
  // Read through a shuffle so the compiler knows it is warp-uniform: the mainloop's stage and
  // descriptor arithmetic then stays in uniform registers, off the wgmma issue path.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  if (warpgroup == kProducerWarpgroup) {
    setmaxnreg_dec<kLightRegs>();
    const int warp = (threadIdx.x % 128) / 32;
    if constexpr (kSendWarps) {
      if (warp >= 1 && warp <= Sink::kSendWarps && gate >= 0)
        Sink::template service<kConsumerThreads>(SmemTile{out_tile, OutTile::kLd, 0, 0}, mailbox, cfg,
                                                 threadIdx.x % 128 - 32);
    } else if constexpr (!Sink::kEnabled) {
      if (warp >= 1 && warp <= kCWriterWarps) {
        const int writer = threadIdx.x % 128 - 32;
        constexpr int kChunks = kOutCols / 8;  // 16-byte chunks per row; N is a multiple of 8
        CMailbox::serve(mailbox, [&](const SendMailbox& m) {
          for (int i = writer; i < m.rows * kChunks; i += kCWriterWarps * 32) {
            const int r = i / kChunks, c = (i % kChunks) * 8;
            if (c < m.cols)
              st_global_v4(C + static_cast<long long>(m.m_abs + r) * N + m.n_abs + c,
                           ld_shared_v4(out_tile + OutTile::offset(r, c)));
          }
        });
      }
    }
    // Producer: one thread (of the cluster's leader) takes tiles from the counter, in the
    // scheduler's order, and keeps the ring full. A tile's first stage carries its index to
    // the consumers (the stage's full barrier publishes it); index -1 in an otherwise empty
    // stage tells them to stop.
    if (threadIdx.x % 128 == 0 && cta == 0) {
      int stage = 0;
      uint32_t phase = 0;
      auto publish = [&](int r, int value) {  // stage_tile[stage] of CTA r
        if (r == 0) stage_tile[stage] = value;
        else st_shared_cluster(&stage_tile[stage], r, value);
      };
      // CTA r's full barrier: one arrival and its bytes. The arrival that follows a publish
      // releases at cluster scope (the follower reads the index after it); the others need not.
      auto expect = [&](int r, uint32_t bytes, bool published) {
        if (r == 0) mbarrier_expect_tx(&full[stage], bytes);
        else if (published) mbarrier_expect_tx_cluster(&full[stage], r, bytes);
        else mbarrier_expect_tx_remote(&full[stage], r, bytes);
      };
      const int items = sched.total_tiles * parts;
      for (;;) {
        const int taken = atomicAdd(tile_counter, 1);
        if (taken >= items) {
          mbarrier_wait(&empty[stage], phase ^ 1);
          for (int r = 0; r < kCluster; ++r) {
            publish(r, -1);
            expect(r, 0, true);
          }
          // The last cluster to stop resets the counter for the next launch on the stream:
          // every cluster has taken its last ticket by then. With split K it also advances the
          // epoch: the tickets' release and acquire order every CTA's read of it before.
          int ticket;
          if constexpr (kSplitK > 1) ticket = atom_add_acq_rel_gpu(tile_counter + 1, 1);
          else ticket = atomicAdd(tile_counter + 1, 1);
          if (ticket == static_cast<int>(gridDim.x) / kCluster - 1) {
            tile_counter[0] = 0;
            tile_counter[1] = 0;
            if constexpr (kSplitK > 1) *reinterpret_cast<volatile unsigned*>(split_state) = split_epoch + 1;
          }
          break;
        }
        // The item the counter's ticket stands for: itself, or in the overlap builds the
        // ticket's tile through the launch's permutation (the same part).
        const int index = kOffNodeFirst ? ordered_item(taken, sched.total_tiles, tile_order, order_room) : taken;
        const SplitItem item = split_item(index, sched.total_tiles, parts, k_slices);
        const GroupedTile t = sched.tile(item.tile);
        for (int kt = item.kt_begin; kt < item.kt_end; ++kt) {
          mbarrier_wait(&empty[stage], phase ^ 1);  // every CTA's consumers are done with the stage
          // Each CTA's full barrier: one arrival and the bytes of its A (its rows, in 64-row
          // boxes) and its B, whoever loads them.
          for (int r = 0; r < kCluster; ++r) {
            const GroupedTile part = cta_part(t, r);
            const bool has_part = part.rows > 0 && part.n_abs < N;
            const uint32_t a_bytes = (kShareB && !has_part) ? 0 : (part.rows > 64 ? 2 : 1) * kHalfA;
            const uint32_t b_bytes = (!kShareB && !has_part) ? 0 : kStageB;
            if (kt == item.kt_begin) publish(r, index);
            expect(r, a_bytes + b_bytes, kt == item.kt_begin);
          }
          // A: one tile for every CTA (multicast), or each CTA its own rows.
          for (int r = 0; r < (kShareB ? kCluster : 1); ++r) {
            const GroupedTile part = cta_part(t, r);
            if (part.rows <= 0) break;
            for (int h = 0; h < (part.rows > 64 ? 2 : 1); ++h) {
              unsigned char* a = ring_a + stage * kStageA + h * kHalfA;
              const int row = part.m_abs + 64 * h;
              if (kCluster > 1 && !kShareB)
                tma_load_2d_multicast(a, &map_a, &full[stage], kt * kBK, row, (1u << kCluster) - 1);
              else if (r == 0)
                tma_load_2d(a, &map_a, &full[stage], kt * kBK, row);
              else
                tma_load_2d_multicast(a, &map_a, &full[stage], kt * kBK, row, static_cast<uint16_t>(1u << r));
            }
          }
          // B: one tile for every CTA (multicast), or each CTA its own columns.
          for (int r = 0; r < (kShareB ? 1 : kCluster); ++r) {
            const GroupedTile part = cta_part(t, r);
            if (part.n_abs >= N) break;  // an odd last column tile: the follower has none
            const int b_row = t.expert * (kSwiGLU ? 2 * N : N) + part.n_abs;
            unsigned char* b = ring_b + stage * kStageB;
            auto load_b = [&](unsigned char* dst, int row) {
              if (kCluster > 1 && kShareB)
                tma_load_2d_multicast(dst, &map_b, &full[stage], kt * kBK, row, (1u << kCluster) - 1);
              else if (r == 0)
                tma_load_2d(dst, &map_b, &full[stage], kt * kBK, row);
              else
                tma_load_2d_multicast(dst, &map_b, &full[stage], kt * kBK, row, static_cast<uint16_t>(1u << r));
            };
            if constexpr (kSwiGLU) {  // gate rows, then the matching up rows
              load_b(b, b_row);
              load_b(b + kStageB / 2, b_row + N);
            } else {
              load_b(b, b_row);
            }
          }
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    const int tid = threadIdx.x;  // 0 .. kConsumerThreads - 1
    const int lane = tid % 32, warp = (tid % 128) / 32;
    // A stage is freed on the leader's empty barrier by every consumer thread, not by one a
    // warpgroup: each thread's arrive (a release) orders its own reads of the stage (the tile
    // index in stage_tile) before the producer's next writes to it, which its wait acquires.
    // With one arrival a warpgroup, a warpgroup that skips the MMA (no rows in its half) could
    // free a tile's stages while its other warps had yet to read the index, and
    // compute-sanitizer's racecheck reported the stop index's store racing with those reads
    // (the FP8 GEMM had the same race on its scales, grouped_gemm_fp8.cu's `release`).
    auto release = [&](int s) {
      if (cta == 0) mbarrier_arrive(&empty[s]);
      else mbarrier_arrive_remote(&empty[s], 0);
    };
    int stage = 0;
    uint32_t phase = 0;
    auto advance = [&] {
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    };
    float acc[kAcc];
    bool tile_pending = false;  // the writer warps still hold the shared output tile
    uint32_t split_stored_phase = 0;  // of split_stored[warpgroup]
    for (;;) {
      // The tile's first stage (the mainloop's wait on it returns at once). The follower's
      // index is the leader's remote store, which the cluster-scope acquire makes visible.
      if (cta == 0) mbarrier_wait(&full[stage], phase);
      else mbarrier_wait_cluster(&full[stage], phase);
      const int index = stage_tile[stage];
      if (index < 0) break;
      const SplitItem item = split_item(index, sched.total_tiles, parts, k_slices);
      const GroupedTile t = cta_part(sched.tile(item.tile), cta);
      // A follower may have no part: an odd last column tile, or an expert's odd last m-tile.
      const bool has_cols = t.rows > 0 && t.n_abs < N;
      // An expert's last, partial m-tile runs with A and B swapped (swap_n > 0): the tile's
      // 256 weight rows are the wgmma's M (two m64 blocks per warpgroup) and its real rows,
      // rounded up to 16, its N; otherwise the rows are M and a warpgroup with no real rows
      // in its 64 skips the MMA.
      const int swap_n =
          kSwapTails && has_cols && t.rows < kBM ? (t.rows + kSwapStep - 1) / kSwapStep * kSwapStep : 0;
      const bool computes = has_cols && (swap_n > 0 || warpgroup * 64 < t.rows);
      // A swapped tile's accumulators: m-block 0 in acc[0, N/2), m-block 1 in acc2. Not in
      // acc + 64: ptxas serializes every wgmma of the kernel when one instruction's
      // accumulators are a sub-range of another's (C7511). acc2 lives in this loop body and
      // a full tile zeroes acc before its MMA, so no path keeps more than 128 of them live
      // (with 192, GEMM 1's SwiGLU epilogue spilled).
      float acc2[64];
      // One tile's k-slices; issue_slice(a, b, kt) issues a stage's wgmmas. Each caller sits in
      // its own branch, with the whole wgmma bracket inside it, so ptxas keeps it asynchronous.
      auto mainloop = [&](auto issue_slice) {
        int in_flight = -1;  // the stage whose wgmmas may still run (depth 1)
        for (int kt = item.kt_begin; kt < item.kt_end; ++kt) {
          mbarrier_wait(&full[stage], phase);
          wgmma_fence();
          issue_slice(ring_a + stage * kStageA, ring_b + stage * kStageB, kt);
          wgmma_commit();
          wgmma_wait<kWgmmaDepth>();
          if constexpr (kWgmmaDepth == 0) {
            release(stage);
          } else {
            if (in_flight >= 0) release(in_flight);
            in_flight = stage;
          }
          advance();
        }
        if constexpr (kWgmmaDepth > 0) {
          wgmma_wait<0>();
          if (in_flight >= 0) release(in_flight);
        }
      };
      auto swapped = [&](auto width) {
        constexpr int N = decltype(width)::value;
        mainloop([&](const unsigned char* a, const unsigned char* b, int kt) {
#pragma unroll
          for (int kk = 0; kk < kBK / 16; ++kk) {
            const uint64_t rows_desc = smem_desc_sw128(a + kk * 32);
            wgmma_m64nNk16<N>(acc, smem_desc_sw128(b + swap_weight_row(warpgroup, 0) * 128 + kk * 32), rows_desc,
                              (kt | kk) != 0);
            wgmma_m64nNk16<N>(acc2, smem_desc_sw128(b + swap_weight_row(warpgroup, 1) * 128 + kk * 32),
                              rows_desc, (kt | kk) != 0);
          }
        });
        fence_operands_prefix<64>(acc);
        fence_operands(acc2);
      };
      // Split K: this warpgroup's slot of the tile in the workspace (pair p of thread i at
      // p * 128 + i: each warp's 8-byte stores and loads cover 256 contiguous bytes) and its
      // flag. Pairs, not 16-byte quads: with 16-byte stores or loads of the accumulators ptxas
      // serializes every wgmma of the kernel (C7514), as it does not with 8-byte ones.
      const long long split_slot =
          (static_cast<long long>(item.tile) * kConsumers + warpgroup) * (kAcc / 2) * 128 + tid % 128;
      unsigned* const split_flag = split_state + SplitK::kStateHead + item.tile * kConsumers + warpgroup;
      if (swap_n == 0 && computes) {
        if (kSplitK > 1 && item.part > 0) {
          // A second half: wait until the first half's warpgroup has stored its accumulators
          // (each thread acquires the flag itself), then start from them. A wait that runs out
          // records (kTimedOut, tile) in the state and traps (no printf: a call in this function
          // makes ptxas serialize its wgmmas, C7510).
          const unsigned want = split_epoch + 1;
          if (ld_acquire_gpu(split_flag) != want) {
            const unsigned long long start = globaltimer_ns();
            while (ld_acquire_gpu(split_flag) != want) {
              if (globaltimer_ns() - start > EPSERVE_GEMM_SPLIT_TIMEOUT_NS) {
                split_state[2] = static_cast<unsigned>(item.tile);
                split_state[1] = SplitK::kTimedOut;
                __threadfence();  // GPU scope: the null build keeps no system-scope code
                __trap();
              }
              __nanosleep(128);
            }
          }
#pragma unroll
          for (int p = 0; p < kAcc / 2; ++p) {
            const float2 v = ld_cg_f32x2(split_acc + split_slot + p * 128);
            acc[2 * p] = v.x;
            acc[2 * p + 1] = v.y;
          }
        } else {
#pragma unroll
          for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;  // ends the previous tile's live range; the MMA overwrites it
        }
        mainloop([&](const unsigned char* a, const unsigned char* b, int kt) {
#pragma unroll
          for (int kk = 0; kk < kBK / 16; ++kk)
            wgmma_m64nNk16<kBN>(acc, smem_desc_sw128(a + warpgroup * kHalfA + kk * 32), smem_desc_sw128(b + kk * 32),
                                (kt | kk) != 0);
        });
        fence_operands(acc);
      } else if (swap_n == 0) {
        for (int kt = item.kt_begin; kt < item.kt_end; ++kt) {
          mbarrier_wait(&full[stage], phase);
          release(stage);
          advance();
        }
      } else if constexpr (kSwapTails) {
        with_swap_width(swap_n, swapped);
      }

      if constexpr (kSplitK > 1) {
        if (item.part < parts - 1) {  // a first half: its accumulators go to the workspace, not the sink
          if (swap_n == 0 && computes) {
#pragma unroll
            for (int p = 0; p < kAcc / 2; ++p)
              st_global_f32x2(split_acc + split_slot + p * 128, acc[2 * p], acc[2 * p + 1]);
            // Every thread of the warpgroup has stored (each arrival a release at CTA scope);
            // its thread 0 acquires them all, then releases the flag at GPU scope. The
            // barrier's next phase cannot complete before this wait: it needs thread 0's
            // next arrival.
            mbarrier_arrive(&split_stored[warpgroup]);
            if (tid % 128 == 0) {
              mbarrier_wait(&split_stored[warpgroup], split_stored_phase);
              st_release_gpu(split_flag, split_epoch + 1);
            }
            split_stored_phase ^= 1;
          }
          continue;
        }
      }
      if (!has_cols) continue;
      if constexpr (Sink::kEnabled) {
        if (gate < 0) continue;  // the peer sink gated off: the math alone
      }
      if (tile_pending) {  // wait until the writer warps are done with the last tile
        if constexpr (kSendWarps) Sink::template drain<kConsumerThreads>();
        else CMailbox::drain();
      }
      // Accumulators -> bf16 -> the shared output tile. n8 block j of this thread: values
      // 4j, 4j+1 at (row g, cols 8j + 2q, +1), 4j+2, 4j+3 at row g + 8.
      const int row = warpgroup * 64 + warp * 16 + lane / 4;
      const int colq = 2 * (lane % 4);
      auto put = [&](int r, int col, uint32_t v) { *reinterpret_cast<uint32_t*>(out_tile + OutTile::offset(r, col)) = v; };
      if (swap_n == 0 && computes) {
        if constexpr (kSwiGLU) {  // block j holds gate columns, block j + kOutCols / 8 the same columns' up
#pragma unroll
          for (int j = 0; j < kOutCols / 8; ++j) {
            const int u = j + kOutCols / 8;
            put(row, 8 * j + colq,
                swiglu_bf16x2(pack_bf16x2(acc[4 * j], acc[4 * j + 1]), pack_bf16x2(acc[4 * u], acc[4 * u + 1])));
            put(row + 8, 8 * j + colq,
                swiglu_bf16x2(pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]), pack_bf16x2(acc[4 * u + 2], acc[4 * u + 3])));
          }
        } else {
#pragma unroll
          for (int j = 0; j < kOutCols / 8; ++j) {
            put(row, 8 * j + colq, pack_bf16x2(acc[4 * j], acc[4 * j + 1]));
            put(row + 8, 8 * j + colq, pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]));
          }
        }
      } else if (swap_n > 0) {
        // Swapped accumulators hold the tile transposed: thread (warp, lane) has, per n8
        // block j, output columns c = 16 * warp + lane / 4 (and c + 8) at rows 8j + 2q and
        // 8j + 2q + 1 (q = lane % 4). Lanes 4 apart hold neighbouring columns, so one shuffle
        // turns two column-pairs into two row-pairs: the even column's lane keeps row 8j + 2q,
        // the odd one's row 8j + 2q + 1, each with a 4-byte (two-column) word to store.
        const bool odd = (lane >> 2) & 1;
        const int col = warp * 16 + (lane / 4 & ~1);
        auto store_swapped = [&](auto width) {
          constexpr int N = decltype(width)::value;
#pragma unroll
          for (int j = 0; j < N / 8; ++j) {
            const int r = 8 * j + colq + odd;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              auto pair = [&](const auto& d) {
                const float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
                const float other = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
                return odd ? pack_bf16x2(other, v1) : pack_bf16x2(v0, other);
              };
              if constexpr (kSwiGLU) {
                const uint32_t gate_pair = pair(acc), up_pair = pair(acc2);
                put(r, swap_out_col(warpgroup, 0) + col + 8 * h, swiglu_bf16x2(gate_pair, up_pair));
              } else {
                put(r, swap_out_col(warpgroup, 0) + col + 8 * h, pair(acc));
                put(r, swap_out_col(warpgroup, 1) + col + 8 * h, pair(acc2));
              }
            }
          }
        };
        if constexpr (kSwapTails) with_swap_width(swap_n, store_swapped);
      }
      const int cols = min(kOutCols, N - t.n_abs);
      if constexpr (kWriterWarps) {  // the hand-over's barrier publishes the tile to the writers
        const SmemTile tile{out_tile, OutTile::kLd, t.rows, cols};
        if constexpr (kSendWarps) Sink::template hand_over<kConsumerThreads>(mailbox, tile, t.m_abs, t.n_abs, tid);
        else CMailbox::hand_over(mailbox, tile, t.m_abs, t.n_abs, tid);
        tile_pending = true;
        continue;  // the writer warps own the tile until the next drain
      } else {  // a peer sink without send warps: the output warps scatter the tile themselves
        named_barrier_sync<kEpilogueBarrier, kConsumerThreads>();
        const SmemTile tile{out_tile, OutTile::kLd, t.rows, cols};
        Sink::template send_tile<kConsumerThreads, kEpilogueBarrier>(tile, t.m_abs, t.n_abs, t.m_end, t.expert, cfg,
                                                                     gate, tid);
        named_barrier_sync<kEpilogueBarrier, kConsumerThreads>();  // the tile is rewritten by the next epilogue
      }
    }
    if constexpr (kSendWarps) {
      if (gate >= 0) Sink::template shutdown<kConsumerThreads>(mailbox, tile_pending, tid);
    } else if constexpr (!Sink::kEnabled) {
      CMailbox::shutdown(mailbox, tile_pending, tid);
    }
  }
  // No CTA of a cluster leaves while the other may still arrive on its barriers or receive
  // its multicast loads.
  if constexpr (kCluster > 1) cluster_sync();
}

#if EPSERVE_GEMM_OFFNODE_FIRST
// The overlap builds' tile order, one block before the GEMM on the same stream, from the
// same expert_offsets, N and src_info (the sink's, in cfg): tile_order[p] is the tile the
// counter's p-th ticket runs. A stable partition of the scheduler's tile indices: first every
// tile of an m-tile that holds a row bound off-node (a home on another node, as the row
// scatter sends it), then the others, each class in the scheduler's order, so the L2 reuse
// of weight tiles inside each class is the default's. A permutation, and a pure function of
// its inputs. Nothing when the launch has more tiles than order_room or more m-tiles than
// kOrderMaxMtiles (the GEMM keeps its default order then; the host caps order_room so that
// both hold whenever the tiles fit).
constexpr int kOrderThreads = 1024, kOrderMaxMtiles = 32 * 1024;
extern "C" __constant__ int epserve_gemm_order_max_mtiles = kOrderMaxMtiles;
extern "C" __global__ void __launch_bounds__(kOrderThreads)
    epserve_gemm_off_node_first_order(const int* __restrict__ expert_offsets, int num_experts, int N,
                                      const PeerSendConfig cfg, int* __restrict__ tile_order, int order_room) {
  __shared__ int mtile_prefix[EPSERVE_MAX_LOCAL_EXPERTS + 1];
  __shared__ unsigned off_mtiles[kOrderMaxMtiles / 32];  // a bit per m-tile holding a row bound off-node
  __shared__ int warp_flagged[kOrderThreads / 32];
  Scheduler sched;
  sched.init(expert_offsets, num_experts, N, mtile_prefix);
  const int mtiles = mtile_prefix[num_experts], total = sched.total_tiles;
  if (total > order_room || mtiles > kOrderMaxMtiles) return;
  for (int w = threadIdx.x; w < (mtiles + 31) / 32; w += kOrderThreads) off_mtiles[w] = 0;
  __syncthreads();
  for (int mt = threadIdx.x; mt < mtiles; mt += kOrderThreads) {
    int lo = 0, hi = num_experts - 1;  // the m-tile's expert: the last whose prefix <= mt
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (mtile_prefix[mid] <= mt) lo = mid; else hi = mid - 1;
    }
    const int m0 = __ldg(expert_offsets + lo) + (mt - mtile_prefix[lo]) * kBM;
    const int m1 = min(m0 + kBM, __ldg(expert_offsets + lo + 1));
    bool off = false;
    for (int m = m0; m < m1 && !off; ++m) {
      const int home = row_home(cfg.src_info[m], cfg);
      off = home >= 0 && node_index(home, cfg.node_first, cfg.ranks_per_node) < 0;
    }
    if (off) atomicOr(&off_mtiles[mt / 32], 1u << (mt % 32));
  }
  __syncthreads();
  auto flagged = [&](int i) {
    if (i >= total) return false;
    const GroupedTile t = sched.tile(i);
    const int mt = mtile_prefix[t.expert] + (t.m_abs - __ldg(expert_offsets + t.expert)) / kBM;
    return ((off_mtiles[mt / 32] >> (mt % 32)) & 1u) != 0;
  };
  int n_flagged = 0;
  for (int c = 0; c < total; c += kOrderThreads) n_flagged += __syncthreads_count(flagged(c + threadIdx.x));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int flagged_before_chunk = 0;
  for (int c = 0; c < total; c += kOrderThreads) {
    const int i = c + threadIdx.x;
    const bool f = flagged(i);
    const unsigned ballot = __ballot_sync(0xffffffffu, f);
    if (lane == 0) warp_flagged[warp] = __popc(ballot);
    __syncthreads();
    int before = flagged_before_chunk + __popc(ballot & ((1u << lane) - 1u)), chunk = 0;
    for (int w = 0; w < kOrderThreads / 32; ++w) {
      if (w < warp) before += warp_flagged[w];
      chunk += warp_flagged[w];
    }
    // `before`: the flagged tiles ahead of tile i; i - before: the others ahead of it
    if (i < total) tile_order[f ? before : n_flagged + (i - before)] = i;
    flagged_before_chunk += chunk;
    __syncthreads();  // warp_flagged is rewritten by the next chunk
  }
}
#endif
