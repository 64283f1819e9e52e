// EpPeerSink: the EP-combine peer send. Each finished output tile goes straight from shared
// memory into the recv slots of the GPUs that own its rows; the local C store is dead.
// This first version sends from the output warps (kSendWarps = 0): service, drain and
// shutdown have nothing to hand over.
#pragma once
#include "sinks/row_scatter.cuh"
#include "sinks/smem_tile.cuh"

struct EpPeerSink {
  static constexpr bool kEnabled = true;
  static constexpr int kSendWarps = 0;

  // kNumThreads threads call it together, synchronizing on named barrier kBarrierId.
  template <int kNumThreads, int kBarrierId = 0>
  __device__ static void send_tile(const SmemTile& tile, uint32_t m_abs, uint32_t n_abs, uint32_t /*m_end*/,
                                   int32_t /*expert_id*/, const PeerSendConfig& cfg, int gate, int tid) {
    if (gate < 0) return;  // gate is uniform over the block, so the barriers inside stay matched
    epserve::scatter_rows_to_peers<kNumThreads, 128, kBarrierId>(tile.data, tile.ld, tile.rows, tile.cols,
                                                     static_cast<int>(m_abs), static_cast<int>(n_abs), cfg, tid);
  }
  __device__ static void service(const SmemTile&, int, int, const PeerSendConfig&) {}
  __device__ static void drain(int, const PeerSendConfig&) {}
  __device__ static void shutdown(int, const PeerSendConfig&, bool) {}
};
