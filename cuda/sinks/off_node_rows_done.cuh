// Across nodes, the combine's off-node send under GEMM 2 (docs/design.md, "Across nodes"; issue
// 15, step 2): GEMM 2's overlap build counts, per off-node home, the rows it has finished
// staging, so that a side stream can start that home's carrier group while the GEMM goes on.
//
// The counters are u64, one per staging block (off-node rank, ascending), right after the
// combine staging's blocks: off_recv + (world - R) * max_tokens * k * H bf16, so the
// PeerSendConfig needs no new field and the default builds' code stays as it was. They count
// 64-column units, as the arrival counters do, and only grow: the side stream's expect kernel
// adds each call's units to a cumulative target (cuda/comm/off_node_overlap.cu), so nothing
// is reset between calls.
#pragma once
#include "common/errors.cuh"
#include "common/src_info.cuh"
#include "sinks/peer_send_config.cuh"

namespace epserve {

// The counters of the combine staging's blocks (see above).
__device__ __forceinline__ unsigned long long* off_node_rows_done(const PeerSendConfig& cfg) {
  const long long staged = static_cast<long long>(cfg.world - cfg.ranks_per_node) * cfg.max_tokens * cfg.top_k *
                           cfg.hidden;
  return reinterpret_cast<unsigned long long*>(cfg.off_recv + staged);
}

// The rank a row of src_info goes home to, or -1 when the row scatter refuses it (the same
// test as scatter_rows_to_peers', which stores nothing for such a row).
__device__ __forceinline__ int row_home(int info, const PeerSendConfig& cfg) {
  const RowSource s = decode_src_info(info);
  return s.rank >= cfg.world || s.token >= cfg.max_tokens || s.slot >= cfg.top_k ? -1 : s.rank;
}

// After scatter_rows_to_peers of rows [m0, m0 + rows), columns [.., + cols) has returned (every
// storing thread fenced its stores at system scope and the threads met at a barrier): add the
// units staged for each off-node home. Rows are expert-major and source-minor, so one m-tile's
// rows for a home form runs: the first row of each run adds the whole run, a handful of
// atomics a tile. Called by kNumThreads threads together (no barrier inside).
template <int kNumThreads>
__device__ void count_off_node_rows(int m0, int rows, int cols, const PeerSendConfig& cfg, int tid) {
  const int first = cfg.node_first, R = cfg.ranks_per_node;
  unsigned long long* done = off_node_rows_done(cfg);
  for (int r = tid; r < rows; r += kNumThreads) {
    const int home = row_home(cfg.src_info[m0 + r], cfg);
    if (home < 0 || node_index(home, first, R) >= 0) continue;  // refused, or on this node
    if (r > 0 && row_home(cfg.src_info[m0 + r - 1], cfg) == home) continue;  // not the first of its run
    int run = 1;
    while (r + run < rows && row_home(cfg.src_info[m0 + r + run], cfg) == home) ++run;
    red_release_sys_add(done + off_node_block(home, first, R), static_cast<unsigned long long>(run) * (cols / 64));
  }
}

}  // namespace epserve
