// The grouped GEMM on Hopper's own path: TMA loads into a ring of shared-memory stages,
// wgmma on two consumer warpgroups, a producer warpgroup that runs ahead (its loads of the
// next tile overlap the consumers' epilogue), a persistent grid. Same contract as
// gemm/grouped_gemm.cu: C[m, :] = A[m, :] @ B[e]^T per expert, the epilogue's tile handed
// to the sink chosen by -DEPSERVE_SINK (NullPeerSink stores C; EpPeerSink sends the rows
// home and C may be null).
//
// Tile 128 x 256 x 64: consumer warpgroup w computes rows 64w..64w+63 of the tile with
// wgmma m64n256k16. The third warpgroup is the producer: its first warp issues the TMA
// loads, and with a sink that asks for send warps (EpPeerSink: 3) the other three scatter
// each finished tile while the consumers go on with the next tile's mainloop (the hand-over
// protocol is in sinks/ep_peer_sink.cuh). Three warpgroups keep the kernel's register cap at
// 168, which the 128 accumulators of m64n256 need; setmaxnreg then moves registers from
// the producer warpgroup to the consumers. A and B arrive through 2-D tensor maps (box 64 x 128 over A [M, K],
// 64 x 256 over B viewed as [E * N, K]) with 128-byte swizzle; rows past the end of A read
// as zeros, rows of the next expert's weights past N compute columns the store masks.
//
// The epilogue never stalls the math on global stores: the consumers write the tile to
// shared memory and hand it to three writer warps of the producer warpgroup through the
// mailbox of sinks/tile_mailbox.cuh. With EpPeerSink they are its send warps; in the null
// build they store C (row by row, a warp per row, 512-byte coalesced stores).
#include "common/bf16.cuh"
#include "common/ptx.cuh"
#include "common/wgmma_m64n256.cuh"
#include "gemm/tile_scheduler.cuh"
#include "sinks/ep_peer_sink.cuh"
#include "sinks/null_peer_sink.cuh"
#include "sinks/tile_mailbox.cuh"

#ifndef EPSERVE_SINK
#error "build with -DEPSERVE_SINK=NullPeerSink or -DEPSERVE_SINK=EpPeerSink"
#endif

namespace {

using Sink = EPSERVE_SINK;
using namespace epserve;
constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 3;
constexpr int kConsumers = 2, kConsumerThreads = 128 * kConsumers;
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
constexpr int kStageA = kBM * kBK * 2, kStageB = kBN * kBK * 2;  // bytes
constexpr int kTileLd = kBN + 8;  // 16 bytes of padding per row keep the epilogue's writes conflict-free
constexpr int kTileBytes = kBM * kTileLd * 2;
constexpr int kSmemBytes = 1024 /* alignment slack */ + kStages * (kStageA + kStageB) + kTileBytes + 2 * kStages * 8;
constexpr int kEpilogueBarrier = 1;  // named barrier of the consumer warpgroups
using Scheduler = GroupedTileScheduler<kBM, kBN>;

struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

}  // namespace

extern "C" __constant__ int epserve_gemm_smem_bytes = kSmemBytes;
extern "C" __constant__ int epserve_gemm_threads = kThreads;

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    epserve_grouped_gemm_wgmma(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
                               bf16_t* __restrict__ C, const int* __restrict__ expert_offsets, int num_experts, int N,
                               int K, const PeerSendConfig cfg, int gate) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ int mtile_prefix[EPSERVE_MAX_LOCAL_EXPERTS + 1];
  __shared__ int offsets[EPSERVE_MAX_LOCAL_EXPERTS + 1];
  __shared__ SendMailbox mailbox;
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* ring_a = smem;
  unsigned char* ring_b = ring_a + kStages * kStageA;
  bf16_t* out_tile = reinterpret_cast<bf16_t*>(ring_b + kStages * kStageB);
  uint64_t* full = reinterpret_cast<uint64_t*>(reinterpret_cast<unsigned char*>(out_tile) + kTileBytes);
  uint64_t* empty = full + kStages;

  Scheduler sched;
  sched.init(expert_offsets, num_experts, N, mtile_prefix, offsets);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kConsumers);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  const int k_slices = K / kBK;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == kProducerWarpgroup) {
    setmaxnreg_dec<kLightRegs>();
    const int warp = (threadIdx.x % 128) / 32;
    if constexpr (kSendWarps) {
      if (warp >= 1 && warp <= Sink::kSendWarps && gate >= 0)
        Sink::template service<kConsumerThreads>(SmemTile{out_tile, kTileLd, 0, 0}, &mailbox, cfg,
                                                 threadIdx.x % 128 - 32);
    } else if constexpr (!Sink::kEnabled) {
      if (warp >= 1 && warp <= kCWriterWarps) {
        const int lane = threadIdx.x % 32;
        CMailbox::serve(&mailbox, [&](const SendMailbox& m) {
          if (lane * 8 < m.cols) {  // N is a multiple of 64: whole 16-byte chunks
            for (int r = warp - 1; r < m.rows; r += kCWriterWarps)
              st_global_v4(C + static_cast<long long>(m.m_abs + r) * N + m.n_abs + lane * 8,
                           ld_shared_v4(out_tile + r * kTileLd + lane * 8));
          }
        });
      }
    }
    // Producer: one thread keeps the ring full, tile after tile.
    if (threadIdx.x % 128 == 0) {
      int stage = 0;
      uint32_t phase = 0;
      for (int index = blockIdx.x; index < sched.total_tiles; index += gridDim.x) {
        const GroupedTile t = sched.tile(index);
        for (int kt = 0; kt < k_slices; ++kt) {
          mbarrier_wait(&empty[stage], phase ^ 1);
          mbarrier_expect_tx(&full[stage], kStageA + kStageB);
          tma_load_2d(ring_a + stage * kStageA, &map_a, &full[stage], kt * kBK, t.m_abs);
          tma_load_2d(ring_b + stage * kStageB, &map_b, &full[stage], kt * kBK, t.expert * N + t.n_abs);
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
    int stage = 0;
    uint32_t phase = 0;
    float acc[128];
    bool tile_pending = false;  // the writer warps still hold the shared output tile
    for (int index = blockIdx.x; index < sched.total_tiles; index += gridDim.x) {
      const GroupedTile t = sched.tile(index);
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.f;
      fence_operands(acc);
      for (int kt = 0; kt < k_slices; ++kt) {
        mbarrier_wait(&full[stage], phase);
        const unsigned char* a = ring_a + stage * kStageA + warpgroup * (64 * kBK * 2);
        const unsigned char* b = ring_b + stage * kStageB;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk)
          wgmma_m64n256k16(acc, smem_desc_sw128(a + kk * 32), smem_desc_sw128(b + kk * 32));
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(acc);
        if (tid % 128 == 0) mbarrier_arrive(&empty[stage]);
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }

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
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) {
        *reinterpret_cast<uint32_t*>(out_tile + row * kTileLd + 8 * j + colq) = pack_bf16x2(acc[4 * j], acc[4 * j + 1]);
        *reinterpret_cast<uint32_t*>(out_tile + (row + 8) * kTileLd + 8 * j + colq) =
            pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]);
      }
      const int rows = min(kBM, t.m_end - t.m_abs);
      const int cols = min(kBN, N - t.n_abs);
      if constexpr (kWriterWarps) {  // the hand-over's barrier publishes the tile to the writers
        const SmemTile tile{out_tile, kTileLd, rows, cols};
        if constexpr (kSendWarps) Sink::template hand_over<kConsumerThreads>(&mailbox, tile, t.m_abs, t.n_abs, tid);
        else CMailbox::hand_over(&mailbox, tile, t.m_abs, t.n_abs, tid);
        tile_pending = true;
        continue;  // the writer warps own the tile until the next drain
      } else {  // a peer sink without send warps: the output warps scatter the tile themselves
        named_barrier_sync<kEpilogueBarrier, kConsumerThreads>();
        const SmemTile tile{out_tile, kTileLd, rows, cols};
        Sink::template send_tile<kConsumerThreads, kEpilogueBarrier>(tile, t.m_abs, t.n_abs, t.m_end, t.expert, cfg,
                                                                     gate, tid);
        named_barrier_sync<kEpilogueBarrier, kConsumerThreads>();  // the tile is rewritten by the next epilogue
      }
    }
    if constexpr (kSendWarps) {
      if (gate >= 0) Sink::template shutdown<kConsumerThreads>(&mailbox, tile_pending, tid);
    } else if constexpr (!Sink::kEnabled) {
      CMailbox::shutdown(&mailbox, tile_pending, tid);
    }
  }
}
