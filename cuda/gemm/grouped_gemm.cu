// The grouped GEMM of epserve: C[m, :] = A[m, :] @ B[e]^T for each expert e's rows, with the
// epilogue's output tile handed to a compile-time sink chosen by -DEPSERVE_SINK:
//   NullPeerSink - the tile is stored to C (GEMM 1, and GEMM 2 of the unfused path);
//   EpPeerSink   - the tile goes straight to the recv slots of the ranks owning its rows,
//                  and C is never touched (it may be null).
// Shapes: A [M, K], B [E, N, K], C [M, N], all bf16 and row-major; K a multiple of 64, N a
// multiple of 64 (the last 128-column tile may be half full).
#include "common/bf16.cuh"
#include "common/ptx.cuh"
#include "gemm/mainloop_mma_sync.cuh"
#include "gemm/tile_scheduler.cuh"
#include "sinks/ep_peer_sink.cuh"
#include "sinks/null_peer_sink.cuh"

#ifndef EPSERVE_SINK
#error "build with -DEPSERVE_SINK=NullPeerSink or -DEPSERVE_SINK=EpPeerSink"
#endif

namespace {

using Sink = EPSERVE_SINK;
constexpr int kBM = 128, kBN = 128, kBK = 64, kStages = 4;
using Mainloop = epserve::MmaSyncMainloop<kBM, kBN, kBK, kStages, 2, 4>;
using Scheduler = epserve::GroupedTileScheduler<kBM, kBN>;
constexpr int kThreads = Mainloop::kThreads;
constexpr int kTileLd = kBN + 8;  // 16 bytes of padding per row keep the epilogue's writes conflict-free
constexpr int kSmemBytes = Mainloop::kSmemBytes + kBM * kTileLd * 2;
// This kernel has no spare warps: whatever Sink::kSendWarps asks, it calls send_tile from its
// output warps, which scatter each tile themselves.

}  // namespace

extern "C" __constant__ int epserve_gemm_smem_bytes = kSmemBytes;
extern "C" __constant__ int epserve_gemm_threads = kThreads;

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    epserve_grouped_gemm(const bf16_t* __restrict__ A, const bf16_t* __restrict__ B, bf16_t* __restrict__ C,
                         const int* __restrict__ expert_offsets, int num_experts, int N, int K,
                         const PeerSendConfig cfg, int gate) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ int mtile_prefix[EPSERVE_MAX_LOCAL_EXPERTS + 1];
  bf16_t* ring = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* out_tile = ring + Mainloop::kSmemBytes / 2;
  const int tid = threadIdx.x;

  Scheduler sched;
  sched.init(expert_offsets, num_experts, N, mtile_prefix);
  const int M = __ldg(expert_offsets + num_experts);
  const int k_slices = K / kBK;

  auto operands = [&](const epserve::GroupedTile& t, const bf16_t*& a, int& rows_a, const bf16_t*& b, int& rows_b) {
    a = A + static_cast<long long>(t.m_abs) * K;
    rows_a = M - t.m_abs;  // rows of the next expert compute harmlessly and are masked at the store
    b = B + (static_cast<long long>(t.expert) * N + t.n_abs) * K;
    rows_b = N - t.n_abs;
  };

  int index = blockIdx.x;
  if (index < sched.total_tiles) {
    const bf16_t *a, *b;
    int ra, rb;
    operands(sched.tile(index), a, ra, b, rb);
    Mainloop::prologue(ring, k_slices, a, K, ra, b, K, rb, tid);
  }
  for (; index < sched.total_tiles; index += gridDim.x) {
    const epserve::GroupedTile t = sched.tile(index);
    const bf16_t *a, *b;
    int ra, rb;
    operands(t, a, ra, b, rb);
    typename Mainloop::Accum acc;
    Mainloop::run(acc, ring, k_slices, a, K, ra, b, K, rb, tid);

    // The ring is free: start the next tile's loads so they overlap this epilogue.
    const int next = index + gridDim.x;
    if (next < sched.total_tiles) {
      const bf16_t *na, *nb;
      int nra, nrb;
      operands(sched.tile(next), na, nra, nb, nrb);
      Mainloop::prologue(ring, k_slices, na, K, nra, nb, K, nrb, tid);
    }

    Mainloop::store_to_smem(acc, out_tile, kTileLd, tid);
    __syncthreads();
    const int rows = min(kBM, t.m_end - t.m_abs);
    const int cols = min(kBN, N - t.n_abs);
    if constexpr (Sink::kEnabled) {
      const SmemTile tile{out_tile, kTileLd, rows, cols};
      Sink::template send_tile<kThreads>(tile, t.m_abs, t.n_abs, t.m_end, t.expert, cfg, gate, tid);
    } else {
      const int chunks_per_row = cols / 8;
      for (int c = tid; c < rows * chunks_per_row; c += kThreads) {
        const int r = c / chunks_per_row, k8 = (c - r * chunks_per_row) * 8;
        const uint4 v = epserve::ld_shared_v4(out_tile + r * kTileLd + k8);
        *reinterpret_cast<uint4*>(C + static_cast<long long>(t.m_abs + r) * N + t.n_abs + k8) = v;
      }
    }
    __syncthreads();  // the output tile is rewritten by the next tile's epilogue
  }
}
