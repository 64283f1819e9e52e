// What the relay's copy kernels share (cuda/comm/off_node_relay.cu, and with
// EPSERVE_OFFNODE_DEDUP=1 cuda/comm/off_node_dedup.cu): the other nodes' order, a warp's copy
// of rows another process or the carrier wrote, the last block's turn to count, and the copy
// of the rail sources' rows into this node's token regions with its counting.
#pragma once
#include "comm/dispatch_config.cuh"
#include "common/errors.cuh"
#include "common/ptx.cuh"

namespace epserve {
namespace {

// Node c's index among the nodes other than node a (the order of the carrier's groups and of
// the relay areas' blocks).
__device__ __forceinline__ int other_node_index(int c, int a) { return c < a ? c : c - 1; }

// One warp copies n16 16-byte chunks that another process or the carrier wrote (loads skip L1).
__device__ __forceinline__ void warp_copy16(uint4* dst, const uint4* src, long long n16, int lane) {
  for (long long c = lane; c < n16; c += 32) st_v4(dst + c, ld_cg_v4(src + c));
}

// Every thread fenced its stores at system scope before; true in the one CTA that counts last
// (the counter is left zero for the next launch).
__device__ bool last_block_done(unsigned* done) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(done, 1u) == gridDim.x - 1;
    if (last) {
      __threadfence_system();
      *done = 0;
    }
  }
  __syncthreads();
  return last;
}

// At the rail peer, after the carrier landed what each other node's rail source s sent for this
// node: each node rank q's routed rows of s (the source's count row's size) and their routing
// into q's token regions at block s (IPC), then relay_arrive[q][s] += 1 in each (the node ranks'
// bounded wait before their off-node expand). Calls the verdict stopped count, copying nothing;
// a call that failed here otherwise neither copies nor counts. Blocks says where the rows lie:
//   const unsigned char* block(int ci, int q)  what s (of other node index ci) sent for q
//   void copy_row(uint4* dst, const unsigned char* block, int q, long long i, long long row_bytes, int lane)
//                                              one warp stores q's row i at dst
//   const int* meta(const unsigned char* block, int q, long long tokens_bytes)  q's routing [n][1 + 2k]
template <class Blocks>
__device__ __forceinline__ void relay_into_token_regions(const DispatchConfig& cfg, const Blocks blocks,
                                                         unsigned long long* const* __restrict__ relay_arrive,
                                                         unsigned* __restrict__ done) {
  const int R = cfg.ranks_per_node, W = cfg.world, N = W / R, me = cfg.rank - cfg.node_first, a = cfg.rank / R;
  const int E = cfg.num_experts, row = E + W + 1, meta_len = 1 + 2 * cfg.top_k;
  const bool copy = !call_failed(cfg.status);  // calls the verdict stopped count, copying nothing
  const bool count = copy || stopped_by_verdict(cfg.status);
  if (copy) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const long long warp = static_cast<long long>(blockIdx.x) * warps + (threadIdx.x >> 5),
                    nwarps = static_cast<long long>(gridDim.x) * warps;
    const long long thread = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x,
                    nthreads = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long row_bytes = 2LL * cfg.hidden, tokens_bytes = cfg.max_tokens * row_bytes;
    const int* table = cfg.count_table[me];
    for (int c = 0; c < N; ++c) {
      if (c == a) continue;
      const int s = c * R + me, ci = other_node_index(c, a);
      for (int q = 0; q < R; ++q) {
        const long long n = min(max(__ldcg(table + s * row + E + cfg.node_first + q), 0), cfg.max_tokens);
        const unsigned char* src = blocks.block(ci, q);
        unsigned char* tokens = reinterpret_cast<unsigned char*>(cfg.tokens[q]) + s * tokens_bytes;
        for (long long i = warp; i < n; i += nwarps)
          blocks.copy_row(reinterpret_cast<uint4*>(tokens + i * row_bytes), src, q, i, row_bytes, lane);
        const int* meta_src = blocks.meta(src, q, tokens_bytes);
        int* meta = cfg.meta[q] + static_cast<long long>(s) * cfg.max_tokens * meta_len;
        for (long long i = thread; i < n * meta_len; i += nthreads) meta[i] = __ldcg(meta_src + i);
      }
    }
  }
  fence_acq_rel_sys();
  if (last_block_done(done) && count)
    for (int i = threadIdx.x; i < N * R; i += blockDim.x) {
      const int c = i / R, q = i % R;
      if (c != a) red_release_sys_add(relay_arrive[q] + c * R + me, 1ull);
    }
}

}  // namespace
}  // namespace epserve
