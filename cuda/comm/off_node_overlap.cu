// Across nodes, the combine's off-node send under GEMM 2 (docs/design.md, "Across nodes";
// epserve/comm/off_node_overlap.py): the side stream's small kernels around the carrier.
//
//   epserve_off_node_rows_expect   once per combine, before the waits: this call's units for
//                                  each off-node home (the rows GEMM 2's sink will stage for
//                                  it, from the src_info the sink reads, x H / 64), added to
//                                  a cumulative target (local, only this kernel writes it)
//   epserve_off_node_rows_wait     per destination node: wait (bounded) until GEMM 2's
//                                  counting sink has staged every unit for that node's ranks
//                                  (sinks/off_node_rows_done.cuh); then the side stream runs
//                                  that node's carrier group
//
// Both counters only grow, so nothing is reset between calls. A wait that runs out records
// kOffNodeRowsTimeout naming the home and marks the call failed (its output is poisoned); the
// carrier group still runs (its peers make theirs), so the protocol stays in step.
#include "common/errors.cuh"
#include "common/nodes.cuh"
#include "sinks/off_node_rows_done.cuh"

using namespace epserve;

constexpr int kExpectThreads = 256;

// One block. M = expert_offsets[experts_per_rank] dispatched rows; cfg: the GEMM's
// PeerSendConfig (its src_info, rank, world, node, max_tokens, top_k, hidden).
extern "C" __global__ void __launch_bounds__(kExpectThreads)
    epserve_off_node_rows_expect(const int* __restrict__ expert_offsets, int experts_per_rank,
                                 const PeerSendConfig cfg, unsigned long long* __restrict__ expected) {
  __shared__ unsigned int rows[EPSERVE_MAX_WORLD];  // by staging block
  const int blocks = cfg.world - cfg.ranks_per_node;
  for (int b = threadIdx.x; b < blocks; b += kExpectThreads) rows[b] = 0;
  __syncthreads();
  const int M = expert_offsets[experts_per_rank];
  for (int m = threadIdx.x; m < M; m += kExpectThreads) {
    const int home = row_home(cfg.src_info[m], cfg);
    if (home >= 0 && node_index(home, cfg.node_first, cfg.ranks_per_node) < 0)
      atomicAdd(&rows[off_node_block(home, cfg.node_first, cfg.ranks_per_node)], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < blocks; b += kExpectThreads)
    expected[b] += static_cast<unsigned long long>(rows[b]) * (cfg.hidden / 64);
}

// One warp. Blocks [first_block, first_block + n_blocks): one destination node's ranks, whose
// first rank is first_rank. done: the sink's counters; timeout_ns bounds the wait, which
// spans GEMM 2's run.
extern "C" __global__ void __launch_bounds__(32)
    epserve_off_node_rows_wait(const unsigned long long* __restrict__ done,
                               const unsigned long long* __restrict__ expected, int first_block, int n_blocks,
                               int first_rank, unsigned long long timeout_ns, int* __restrict__ error,
                               int* __restrict__ status) {
  for (int i = threadIdx.x; i < n_blocks; i += 32) {
    const int b = first_block + i;
    const unsigned long long want = expected[b];
    if (!wait_at_least(done + b, want, timeout_ns)) {
      record_error(error, kOffNodeRowsTimeout, first_rank + i, static_cast<int>(want - ld_acquire_sys(done + b)));
      mark_call_failed(status);
    }
  }
}
