// Scatter rows to their home ranks' recv slots (docs/design.md: "Layouts", "Signalling and epochs"). Shared by the
// peer sink (rows from the epilogue's shared-memory tile) and the unfused IPC transport
// (rows from C in global memory): the same destinations, the same signalling.
#pragma once
#include "common/errors.cuh"
#include "common/src_info.cuh"
#include "sinks/peer_send_config.cuh"

namespace epserve {

// Before the first store of a combine into rank d's recv: d must have finished reading it
// for the previous combine, that is, as many combines as this rank has (ready[rank], which
// only this rank's stream advances, so the device holds the epoch and a graph replay sees
// the current one). Returns false (error recorded, call marked failed) if d never did.
__device__ __forceinline__ bool wait_peer_ready(const PeerSendConfig& cfg, int d) {
  const unsigned long long done = ld_acquire_sys(cfg.ready + cfg.rank);
  if (wait_at_least(cfg.ready + d, done, cfg.timeout_ns)) return true;
  record_error(cfg.error, kPeerReadyTimeout, d, static_cast<int>(done + 1));
  mark_call_failed(cfg.status);
  return false;
}

// Scatters `rows` rows of `cols` columns (a multiple of 8), row r read from src + r * src_ld,
// into recv[t, j, col0 : col0 + cols] of the row's home rank, where (rank, t, j) decodes
// src_info[m0 + r]. Called by kNumThreads threads together, which synchronize on named
// barrier kBarrierId (0: the whole block). Adds rows * cols / 64 to each destination's
// arrival counter for this rank, after a system-scope release, so a receiver that counts
// 64-column units per sender knows when it has all, and which sender is late if it has not.
template <int kNumThreads, int kMaxRows, int kBarrierId = 0>
__device__ void scatter_rows_to_peers(const bf16_t* src, int src_ld, int rows, int cols, int m0, int col0,
                                      const PeerSendConfig& cfg, int tid) {
  __shared__ long long row_dst[kMaxRows];  // element offset of the row's slot start, or -1
  __shared__ int row_rank[kMaxRows];
  __shared__ unsigned int rank_rows[EPSERVE_MAX_PEERS];
  __shared__ int rank_ok[EPSERVE_MAX_PEERS];

  if (tid < EPSERVE_MAX_PEERS) rank_rows[tid] = 0;
  named_barrier_sync<kBarrierId, kNumThreads>();
  for (int r = tid; r < rows; r += kNumThreads) {
    const int info = cfg.src_info[m0 + r];
    const RowSource s = decode_src_info(info);
    if (s.rank >= cfg.world || s.token >= cfg.max_tokens || s.slot >= cfg.top_k) {
      record_error(cfg.error, kBadSrcInfo, s.rank, info);  // a corrupt plan must not write outside recv
      row_dst[r] = -1;
      continue;
    }
    row_dst[r] = (static_cast<long long>(s.token) * cfg.top_k + s.slot) * cfg.hidden + col0;
    row_rank[r] = s.rank;
    atomicAdd(&rank_rows[s.rank], 1u);
  }
  named_barrier_sync<kBarrierId, kNumThreads>();
  if (tid < cfg.world) rank_ok[tid] = rank_rows[tid] == 0 || wait_peer_ready(cfg, tid);
  named_barrier_sync<kBarrierId, kNumThreads>();

  const int chunks_per_row = cols / 8;
  for (int c = tid; c < rows * chunks_per_row; c += kNumThreads) {
    const int r = c / chunks_per_row;
    const int k8 = (c - r * chunks_per_row) * 8;
    const long long dst = row_dst[r];
    if (dst < 0 || !rank_ok[row_rank[r]]) continue;
    const uint4 v = ld_v4(src + static_cast<long long>(r) * src_ld + k8);
    st_v4(cfg.recv[row_rank[r]] + dst + k8, v);
  }
  fence_acq_rel_sys();
  named_barrier_sync<kBarrierId, kNumThreads>();
  if (tid < cfg.world && rank_rows[tid] > 0 && rank_ok[tid])
    red_release_sys_add(cfg.arrive[tid] + cfg.rank, static_cast<unsigned long long>(rank_rows[tid]) * (cols / 64));
  named_barrier_sync<kBarrierId, kNumThreads>();  // the shared tables are rewritten by the next call
}

}  // namespace epserve
