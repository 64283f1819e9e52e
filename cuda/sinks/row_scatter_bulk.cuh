// The peer sink's row scatter with bulk asynchronous copies (EPSERVE_SINK_BULK builds; opt-in
// through EPSERVE_SINK_STORES=bulk, epserve/ffn/gemm.py). The same destinations, slots, ready
// waits and arrival units as scatter_rows_to_peers (sinks/row_scatter.cuh); what differs is
// how the rows travel and when their arrival is published:
//  * each row segment of a tile (cols * 2 bytes) is one cp.async.bulk from the shared tile
//    to its home slot, so the send warps issue a few copies a tile instead of a 16-byte store
//    a lane per chunk;
//  * the tile is handed back to the output warps once the copy engine has READ it
//    (wait_group.read), not once every store has been acknowledged: on NVLink that round
//    trip, taken per tile behind a system-scope fence, held the single output tile, and with
//    FP8 GEMM 2's shorter tiles the output warps waited for it (notes/gemm.md);
//  * a tile's arrival units are released one tile later, after the thread's older copy
//    groups have completed (wait_group 1), a proxy fence and a system-scope fence, and the
//    last tile's at flush_bulk_rows, when the send warps retire. A receiver's wait is bounded
//    as before; it only sees the units later.
// Every copy is 16-byte aligned at both ends, as cp.async.bulk needs: the tile's rows are
// 16-byte padded (sinks/row_scatter.cuh's readers rely on it too), a slot starts at a multiple
// of `hidden` (a multiple of 64) plus col0 (a multiple of 8) elements of a 256-byte aligned
// buffer, and cols is a multiple of 8.
#pragma once
#include "common/bulk_copy.cuh"
#include "sinks/row_scatter.cuh"

namespace epserve {

// Arrival units sent but not yet published, per home on this node (local index); shared by
// the send warps across tiles.
struct BulkPending {
  unsigned long long units[EPSERVE_MAX_PEERS];
};

// Publishes `pending` (after every sending thread's copies but the newest kPending groups are
// complete) and, with `next_units`, makes the current tile's units the pending ones. Called by
// kNumThreads threads together.
template <int kNumThreads, int kPending, int kBarrierId>
__device__ void publish_bulk_rows(BulkPending& pending, const unsigned int* next_units, const PeerSendConfig& cfg,
                                  int tid) {
  bulk_wait<kPending>();
  fence_proxy_async_global();
  fence_acq_rel_sys();
  named_barrier_sync<kBarrierId, kNumThreads>();
  if (tid < cfg.ranks_per_node) {
    if (pending.units[tid]) red_release_sys_add(cfg.arrive[tid] + cfg.rank, pending.units[tid]);
    pending.units[tid] = next_units == nullptr ? 0 : next_units[tid];
  }
  named_barrier_sync<kBarrierId, kNumThreads>();
}

// scatter_rows_to_peers' rows and slots, sent with bulk copies from the shared tile `src`
// (rows of `src_ld` elements); returns once the tile may be rewritten. `pending` starts zeroed
// (zero_bulk_pending) and ends published (flush_bulk_rows).
// kOwnRowsOnly (EPSERVE_SINK_STORES=own-bulk): only the rows whose home is this rank go by
// bulk copies, published a tile later; the other ranks' rows (and another node's) go by the
// threads' 16-byte stores and are published at once, as scatter_rows_to_peers does. The
// engine then writes only to this GPU's memory, and the NVLink path is the default's.
template <int kNumThreads, int kMaxRows, int kBarrierId, bool kOwnRowsOnly = false>
__device__ void scatter_tile_rows_bulk(const bf16_t* src, int src_ld, int rows, int cols, int m0, int col0,
                                       const PeerSendConfig& cfg, BulkPending& pending, int tid) {
  __shared__ bf16_t* row_dst[kMaxRows];
  __shared__ int row_peer[kMaxRows];
  __shared__ unsigned int peer_rows[EPSERVE_MAX_PEERS];
  __shared__ unsigned int peer_units[EPSERVE_MAX_PEERS];
  __shared__ int peer_ok[EPSERVE_MAX_PEERS + 1];
  plan_rows_to_peers<kNumThreads, kBarrierId>(rows, m0, col0, cfg, tid, row_dst, row_peer, peer_rows, peer_ok);
  const int self = cfg.rank - cfg.node_first;  // this rank's local index
  auto by_bulk = [&](int p) { return !kOwnRowsOnly || p == self; };
  if (tid < cfg.ranks_per_node) peer_units[tid] = peer_ok[tid] && by_bulk(tid) ? peer_rows[tid] * (cols / 64) : 0;
  // (publish_bulk_rows' first barrier orders peer_units before its readers)

  const uint32_t bytes = static_cast<uint32_t>(cols) * 2;
  for (int r = tid; r < rows; r += kNumThreads) {
    bf16_t* dst = row_dst[r];
    if (dst == nullptr || !peer_ok[row_peer[r]] || !by_bulk(row_peer[r])) continue;
    bulk_copy_shared_to_global(dst, src + static_cast<long long>(r) * src_ld, bytes);
  }
  bulk_commit();  // one group a tile a thread (maybe empty), so wait_group counts tiles
  // Rows for other homes: another node's (any, where the world spans nodes) or another rank's
  // of this node. Warp-uniform (shared tables, after plan_rows_to_peers' barrier): a tile with
  // none pays no system-scope fence (at one rank, none ever does).
  bool remote = cfg.world > cfg.ranks_per_node;
  for (int p = 0; p < cfg.ranks_per_node; ++p) remote |= p != self && peer_rows[p] > 0;
  if (kOwnRowsOnly && remote)
    store_rows_and_release<kNumThreads, kBarrierId>(src, src_ld, rows, cols, cfg.ranks_per_node, cfg, tid, row_dst,
                                                    row_peer, peer_rows, peer_ok, [&](int p) { return !by_bulk(p); });
  bulk_wait_read<0>();  // the engine has read this thread's rows: the tile may be rewritten
  // The previous tile's units, now that every older group is complete; this tile's wait.
  publish_bulk_rows<kNumThreads, 1, kBarrierId>(pending, peer_units, cfg, tid);
}

template <int kNumThreads, int kBarrierId>
__device__ void zero_bulk_pending(BulkPending& pending, int tid) {
  if (tid < EPSERVE_MAX_PEERS) pending.units[tid] = 0;
  named_barrier_sync<kBarrierId, kNumThreads>();
}

// The send warps' retirement: every copy complete, the last tile's units published.
template <int kNumThreads, int kBarrierId>
__device__ void flush_bulk_rows(BulkPending& pending, const PeerSendConfig& cfg, int tid) {
  publish_bulk_rows<kNumThreads, 0, kBarrierId>(pending, nullptr, cfg, tid);
}

}  // namespace epserve
