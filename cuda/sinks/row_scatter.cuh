// Scatter rows to their home ranks' recv slots (docs/design.md: "Layouts", "Signalling and epochs"). Shared by the
// peer sink (rows from the epilogue's shared-memory tile) and the unfused IPC transport
// (rows from C in global memory): the same destinations, the same signalling.
#pragma once
#include "common/errors.cuh"
#include "common/src_info.cuh"
#include "sinks/peer_send_config.cuh"

namespace epserve {

// Before the first store of a combine into rank d's recv (d on this node): d must have finished reading it
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

// Where each of `rows` rows goes (row_dst; null for a row the scatter refuses) and through
// whom (row_peer: its home's local index, or EPSERVE_MAX_PEERS for another node), how many go
// to each home of this node (peer_rows), and whether each home took the previous combine's
// rows in time (peer_ok, waited for here). Every array is the caller's shared memory; called
// by kNumThreads threads together, it ends with a barrier, so all may read the tables after.
template <int kNumThreads, int kBarrierId>
__device__ __forceinline__ void plan_rows_to_peers(int rows, int m0, int col0, const PeerSendConfig& cfg, int tid,
                                                   bf16_t** row_dst, int* row_peer, unsigned int* peer_rows,
                                                   int* peer_ok) {
  constexpr int kOffNode = EPSERVE_MAX_PEERS;  // row_peer of a row whose home is on another node
  static_assert(kNumThreads > kOffNode, "a thread per local index, and one for the other nodes");
  const int R = cfg.ranks_per_node, first = cfg.node_first;
  if (tid < EPSERVE_MAX_PEERS) peer_rows[tid] = 0;
  named_barrier_sync<kBarrierId, kNumThreads>();
  for (int r = tid; r < rows; r += kNumThreads) {
    const int info = cfg.src_info[m0 + r];
    const RowSource s = decode_src_info(info);
    if (s.rank >= cfg.world || s.token >= cfg.max_tokens || s.slot >= cfg.top_k) {
      record_error(cfg.error, kBadSrcInfo, s.rank, info);  // a corrupt plan must not write outside recv
      row_dst[r] = nullptr;
      continue;
    }
    const long long slot = (static_cast<long long>(s.token) * cfg.top_k + s.slot) * cfg.hidden + col0;
    const int p = node_index(s.rank, first, R);
    if (p >= 0) {
      row_dst[r] = cfg.recv[p] + slot;
      row_peer[r] = p;
      atomicAdd(&peer_rows[p], 1u);
    } else {
      const long long block = off_node_block(s.rank, first, R);
      row_dst[r] = cfg.off_recv + block * cfg.max_tokens * cfg.top_k * cfg.hidden + slot;
      row_peer[r] = kOffNode;
    }
  }
  named_barrier_sync<kBarrierId, kNumThreads>();
  if (tid < R) peer_ok[tid] = peer_rows[tid] == 0 || wait_peer_ready(cfg, first + tid);
  if (tid == kOffNode) peer_ok[tid] = 1;
  named_barrier_sync<kBarrierId, kNumThreads>();
}

// The rows of plan_rows_to_peers' tables whose home local index p has stores(p), each stored by
// the threads' 16-byte stores (16-byte padded rows of src_ld elements), then a system-scope
// release of their arrival units to each such home of the R on this node (rows * cols / 64, as
// the receivers count). Called by kNumThreads threads together; the tables may be rewritten
// after one more barrier. R is cfg.ranks_per_node as the caller read it: read here instead, it
// moved scatter_rows_to_peers' loads and changed its code.
template <int kNumThreads, int kBarrierId, typename Stores>
__device__ __forceinline__ void store_rows_and_release(const bf16_t* src, int src_ld, int rows, int cols, int R,
                                                       const PeerSendConfig& cfg, int tid, bf16_t* const* row_dst,
                                                       const int* row_peer, const unsigned int* peer_rows,
                                                       const int* peer_ok, Stores stores) {
  const int chunks_per_row = cols / 8;
  for (int c = tid; c < rows * chunks_per_row; c += kNumThreads) {
    const int r = c / chunks_per_row;
    const int k8 = (c - r * chunks_per_row) * 8;
    bf16_t* dst = row_dst[r];
    if (dst == nullptr || !peer_ok[row_peer[r]] || !stores(row_peer[r])) continue;
    const uint4 v = ld_v4(src + static_cast<long long>(r) * src_ld + k8);
    st_v4(dst + k8, v);
  }
  fence_acq_rel_sys();
  named_barrier_sync<kBarrierId, kNumThreads>();
  if (tid < R && stores(tid) && peer_rows[tid] > 0 && peer_ok[tid])
    red_release_sys_add(cfg.arrive[tid] + cfg.rank, static_cast<unsigned long long>(peer_rows[tid]) * (cols / 64));
}

// Scatters `rows` rows of `cols` columns (a multiple of 8), row r read from src + r * src_ld,
// into recv[t, j, col0 : col0 + cols] of the row's home rank, where (rank, t, j) decodes
// src_info[m0 + r]. Called by kNumThreads threads together, which synchronize on named
// barrier kBarrierId (0: the whole block). A home on this node (local index p) gets the row in
// its recv over IPC, and rows * cols / 64 added to its arrival counter for this rank, after a
// system-scope release, so a receiver that counts 64-column units per sender knows when it has
// all, and which sender is late if it has not. A home on another node gets it at the same slot
// of its copy of recv in the combine staging (off_recv), which the off-node carrier moves after
// the kernel: no wait and no counter, stream order covers both (docs/design.md, "Across nodes").
template <int kNumThreads, int kMaxRows, int kBarrierId = 0>
__device__ void scatter_rows_to_peers(const bf16_t* src, int src_ld, int rows, int cols, int m0, int col0,
                                      const PeerSendConfig& cfg, int tid) {
  __shared__ bf16_t* row_dst[kMaxRows];        // where the row's columns go, or null (refused)
  __shared__ int row_peer[kMaxRows];           // its home's local index, or kOffNode
  __shared__ unsigned int peer_rows[EPSERVE_MAX_PEERS];
  __shared__ int peer_ok[EPSERVE_MAX_PEERS + 1];
  const int R = cfg.ranks_per_node;
  plan_rows_to_peers<kNumThreads, kBarrierId>(rows, m0, col0, cfg, tid, row_dst, row_peer, peer_rows, peer_ok);
  store_rows_and_release<kNumThreads, kBarrierId>(src, src_ld, rows, cols, R, cfg, tid, row_dst, row_peer, peer_rows,
                                                  peer_ok, [](int) { return true; });
  named_barrier_sync<kBarrierId, kNumThreads>();  // the shared tables are rewritten by the next call
}

}  // namespace epserve
