// EpPeerSink: the EP-combine peer send. Each finished output tile goes straight from shared
// memory into the recv slots of the GPUs that own its rows; the local C store is dead.
//
// Two ways to drive it:
//  * send_tile: the output threads scatter the tile themselves (a kernel with no spare
//    warps, such as the mma.sync GEMM);
//  * send warps (kSendWarps of them): the output warps hand each tile over through the
//    shared-memory mailbox of sinks/tile_mailbox.cuh and go back to the math, while the
//    send warps scatter it (the wgmma GEMM).
#pragma once
#include "sinks/row_scatter.cuh"
#include "sinks/smem_tile.cuh"
#include "sinks/tile_mailbox.cuh"

struct EpPeerSink {
  static constexpr bool kEnabled = true;
  static constexpr int kSendWarps = 3;  // the wgmma GEMM's producer warpgroup: one TMA warp, three send warps
  static constexpr int kSendThreads = kSendWarps * 32;
  static constexpr int kSendBarrier = 4;  // the send warps among themselves; 2 and 3 are the mailbox's
  template <int kOutputThreads>
  using Mailbox = TileMailbox<kOutputThreads, kSendThreads>;

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
    Mailbox<kOutputThreads>::hand_over(box, tile, m_abs, n_abs, tid);
  }

  // Output warps: wait until the send warps are done with the previous tile.
  template <int kOutputThreads>
  __device__ static void drain() {
    Mailbox<kOutputThreads>::drain();
  }

  // Send warps: scatter every tile handed over until `done`.
  template <int kOutputThreads>
  __device__ static void service(const SmemTile& tile, const SendMailbox* box, const PeerSendConfig& cfg, int send_tid) {
    Mailbox<kOutputThreads>::serve(box, [&](const SendMailbox& m) {
      epserve::scatter_rows_to_peers<kSendThreads, 128, kSendBarrier>(tile.data, tile.ld, m.rows, m.cols, m.m_abs,
                                                                      m.n_abs, cfg, send_tid);
    });
  }

  // Output warps, after their last tile: retire the send warps with every arrival matched.
  template <int kOutputThreads>
  __device__ static void shutdown(SendMailbox* box, bool drain_pending, int tid) {
    Mailbox<kOutputThreads>::shutdown(box, drain_pending, tid);
  }
};
