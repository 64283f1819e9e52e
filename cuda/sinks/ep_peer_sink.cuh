// EpPeerSink: the EP-combine peer send. Each finished output tile goes straight from shared
// memory into the recv slots of the GPUs that own its rows; the local C store is dead.
//
// Two ways to drive it:
//  * send_tile: the output threads scatter the tile themselves (a kernel with no spare
//    warps, such as the mma.sync GEMM);
//  * send warps (kSendWarps of them): the output warps hand each tile over through a
//    shared-memory mailbox and two named barriers and go back to the math, while the send
//    warps scatter it (the wgmma GEMM). Protocol, per tile:
//        output warps: [drain: bar.sync kDrain]  write tile + mailbox  bar.sync kFull
//        send warps:    bar.sync kFull  scatter  bar.sync kDrain
//    The output warps drain the previous tile after the next tile's mainloop, where the wait
//    hides behind the MMA; the send warps go from kDrain straight to kFull, so the output
//    warps' kFull never waits (a bar.arrive would gain nothing, and full barriers on both
//    sides order the mailbox for every reader, compute-sanitizer's racecheck included).
//    shutdown drains the last tile and posts `done`, so both barriers are matched when the
//    kernel ends.
#pragma once
#include "sinks/row_scatter.cuh"
#include "sinks/smem_tile.cuh"

struct SendMailbox {
  int m_abs, n_abs, rows, cols, done;
};

struct EpPeerSink {
  static constexpr bool kEnabled = true;
  static constexpr int kSendWarps = 3;  // the wgmma GEMM's producer warpgroup: one TMA warp, three send warps
  static constexpr int kSendThreads = kSendWarps * 32;
  static constexpr int kFullBarrier = 2, kDrainBarrier = 3, kSendBarrier = 4;

  // kNumThreads threads call it together, synchronizing on named barrier kBarrierId.
  template <int kNumThreads, int kBarrierId = 0>
  __device__ static void send_tile(const SmemTile& tile, uint32_t m_abs, uint32_t n_abs, uint32_t /*m_end*/,
                                   int32_t /*expert_id*/, const PeerSendConfig& cfg, int gate, int tid) {
    if (gate < 0) return;  // gate is uniform over the block, so the barriers inside stay matched
    epserve::scatter_rows_to_peers<kNumThreads, 128, kBarrierId>(tile.data, tile.ld, tile.rows, tile.cols,
                                                                 static_cast<int>(m_abs), static_cast<int>(n_abs), cfg,
                                                                 tid);
  }

  // Output warps: the tile is in shared memory; tell the send warps where it belongs.
  template <int kOutputThreads>
  __device__ static void hand_over(SendMailbox* box, const SmemTile& tile, int m_abs, int n_abs, int tid) {
    if (tid == 0) *box = SendMailbox{m_abs, n_abs, tile.rows, tile.cols, 0};
    epserve::named_barrier_sync<kFullBarrier, kOutputThreads + kSendThreads>();
  }

  // Output warps: wait until the send warps are done with the previous tile.
  template <int kOutputThreads>
  __device__ static void drain() {
    epserve::named_barrier_sync<kDrainBarrier, kOutputThreads + kSendThreads>();
  }

  // Send warps: scatter every tile handed over until `done`.
  template <int kOutputThreads>
  __device__ static void service(const SmemTile& tile, const SendMailbox* box, const PeerSendConfig& cfg, int send_tid) {
    for (;;) {
      epserve::named_barrier_sync<kFullBarrier, kOutputThreads + kSendThreads>();
      const SendMailbox m = *box;
      if (m.done) return;
      epserve::scatter_rows_to_peers<kSendThreads, 128, kSendBarrier>(tile.data, tile.ld, m.rows, m.cols, m.m_abs,
                                                                      m.n_abs, cfg, send_tid);
      epserve::named_barrier_sync<kDrainBarrier, kOutputThreads + kSendThreads>();
    }
  }

  // Output warps, after their last tile: retire the send warps with every arrival matched.
  template <int kOutputThreads>
  __device__ static void shutdown(SendMailbox* box, bool drain_pending, int tid) {
    if (drain_pending) drain<kOutputThreads>();
    if (tid == 0) box->done = 1;
    epserve::named_barrier_sync<kFullBarrier, kOutputThreads + kSendThreads>();
  }
};
