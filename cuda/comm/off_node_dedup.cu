// The relay route with each token row sent once per destination node (EPSERVE_OFFNODE_DEDUP=1;
// docs/design.md, "Across nodes", its relay and deduplication parts; epserve/comm/off_node_dedup.py).
// Without it the rail transfer carries R staging blocks per node, one per destination rank, so a
// token bound for several ranks of one node crosses the network once per rank. With it, as
// DeepEP's internode dispatch does, each such token crosses once and the rail peer fans it out.
//
// The move kernel is unchanged: it still writes a staging block per off-node rank d (token row
// and routing at position pos = the token's rank among this rank's tokens bound for d, so each
// block lists its tokens in ascending order). After it, per other node c:
//
//   epserve_dedup_mark     one block per other node: which tokens each of c's ranks q takes (a bit
//                          per token, from the routing's token numbers), their union, and the
//                          union's exclusive popcount per 32-token word: the packed index of
//                          token t is base[t / 32] + popc(union[t / 32] below bit t % 32), i.e.
//                          the number of distinct tokens below t bound for node c
//   epserve_dedup_pack     any grid: for every (q, pos) of node c, index[q][pos] = the packed index
//                          of its token, the routing copied beside it, and the row copied into the
//                          packed rows once, from the lowest q that takes the token
//   (carrier)              to each rail peer its node's packed block, one transfer, stamped
//   epserve_relay_packed_rows  at the rail peer: for node rank q, position pos of source s's
//                          block, the packed row index[q][pos] into q's token region (IPC), the
//                          routing likewise; counted in q's relay counters as
//                          epserve_relay_token_blocks counts (off_node_relay.cu)
//
// A packed node block: rows [max_tokens][hidden] bf16, then index [R][max_tokens] int, then
// routing [R][max_tokens][1 + 2k] int; the offsets come from the host (DedupPlan), so one formula
// lays it out. The token regions end as the per-rank relay leaves them: bitwise the same rows.
// A call that failed (or the verdict stopped) packs nothing: its stamp says so, as before.
#include "comm/dispatch_common.cuh"  // block_exclusive_scan, kLayoutThreads
#include "comm/dispatch_config.cuh"
#include "comm/relay_copy.cuh"
#include "common/errors.cuh"
#include "common/nodes.cuh"
#include "common/ptx.cuh"

using namespace epserve;

namespace {

constexpr int kMarkThreads = kLayoutThreads;  // the layout's block scan
constexpr int kPackThreads = 256;

// One other node's bit sets in the scratch (epserve/comm/off_node_dedup.py DedupPlan.scratch_bytes):
// mask[q] [words] the tokens node rank q takes, any [words] their union, base [words] the union's
// exclusive popcount before each word.
struct NodeMasks {
  unsigned* mask;
  unsigned* any;
  unsigned* base;
  int words;
};

__device__ __forceinline__ NodeMasks node_masks(unsigned* scratch, int ci, int R, int max_tokens) {
  const int words = (max_tokens + 31) / 32;
  unsigned* m = scratch + static_cast<long long>(ci) * (R + 2) * words;
  return {m, m + static_cast<long long>(R) * words, m + static_cast<long long>(R + 1) * words, words};
}

// This rank's staging block for off-node rank d, as the move kernel's token_dst and meta_dst fill
// it (cuda/comm/dispatch.cu): token rows [max_tokens][hidden], then their routing.
__device__ __forceinline__ const unsigned char* staged_rows(const DispatchConfig& cfg, int d) {
  return cfg.off_blocks + off_node_block(d, cfg.node_first, cfg.ranks_per_node) * cfg.off_block_bytes;
}
__device__ __forceinline__ const int* staged_meta(const DispatchConfig& cfg, int d) {
  return reinterpret_cast<const int*>(staged_rows(cfg, d) + static_cast<long long>(cfg.max_tokens) * cfg.hidden * 2);
}
// The rows staged for d this call: this rank's count row (the copy count + publish left in the
// staging), clamped to the block.
__device__ __forceinline__ int staged_count(const DispatchConfig& cfg, int d) {
  return min(max(cfg.off_count_row[cfg.num_experts + d], 0), cfg.max_tokens);
}

// The relay area with deduplication: block ci is other node ci's rail source's packed node block;
// node rank q's row i is its packed row index[q][i].
struct PackedBlocks {
  const unsigned char* relay;
  long long block_bytes, index_offset, meta_offset;
  int max_tokens, meta_len;
  __device__ __forceinline__ const unsigned char* block(int ci, int) const { return relay + ci * block_bytes; }
  __device__ __forceinline__ void copy_row(uint4* dst, const unsigned char* block, int q, long long i,
                                           long long row_bytes, int lane) const {
    const int p = __ldcg(reinterpret_cast<const int*>(block + index_offset) + static_cast<long long>(q) * max_tokens + i);
    if (p < 0 || p >= max_tokens) return;  // never for a valid call: the packer names every row
    warp_copy16(dst, reinterpret_cast<const uint4*>(block + p * row_bytes), row_bytes / 16, lane);
  }
  __device__ __forceinline__ const int* meta(const unsigned char* block, int q, long long) const {
    return reinterpret_cast<const int*>(block + meta_offset) + static_cast<long long>(q) * max_tokens * meta_len;
  }
};

}  // namespace

// Grid: one block of kMarkThreads per other node (block ci: node other_node_index^-1(ci)).
// scratch: DedupPlan.scratch_bytes, rewritten whole each call (nothing carries over).
extern "C" __global__ void __launch_bounds__(kMarkThreads)
    epserve_dedup_mark(const DispatchConfig cfg, unsigned* __restrict__ scratch) {
  if (call_failed(cfg.status)) return;
  const int R = cfg.ranks_per_node, a = cfg.rank / R, ci = blockIdx.x, c = ci < a ? ci : ci + 1;
  const int meta_len = 1 + 2 * cfg.top_k;
  const NodeMasks m = node_masks(scratch, ci, R, cfg.max_tokens);
  for (long long i = threadIdx.x; i < static_cast<long long>(R + 1) * m.words; i += blockDim.x) m.mask[i] = 0;
  __syncthreads();
  for (int q = 0; q < R; ++q) {
    const int d = c * R + q, n = staged_count(cfg, d);
    const int* meta = staged_meta(cfg, d);
    for (int pos = threadIdx.x; pos < n; pos += blockDim.x) {
      const int t = meta[static_cast<long long>(pos) * meta_len];  // the routing's token number
      if (t >= 0 && t < cfg.max_tokens)
        atomicOr(m.mask + static_cast<long long>(q) * m.words + (t >> 5), 1u << (t & 31));
    }
  }
  __syncthreads();
  // Thread i takes the words [i per, (i + 1) per): their union and popcount, then the block's
  // exclusive sum gives each word's base. The masks were built by atomics (in L2): read past L1.
  const int per = (m.words + blockDim.x - 1) / blockDim.x;
  const int w0 = min(static_cast<int>(threadIdx.x) * per, m.words), w1 = min(w0 + per, m.words);
  int count = 0;
  for (int w = w0; w < w1; ++w) {
    unsigned u = 0;
    for (int q = 0; q < R; ++q) u |= __ldcg(m.mask + static_cast<long long>(q) * m.words + w);
    m.any[w] = u;
    count += __popc(u);
  }
  __shared__ int warp_sums[32], total;
  int base = block_exclusive_scan(count, warp_sums, &total);
  for (int w = w0; w < w1; ++w) {
    m.base[w] = base;
    base += __popc(m.any[w]);
  }
}

// Any grid of kPackThreads, after epserve_dedup_mark. packed: the node blocks (DedupPlan), block ci
// for other node ci, block_bytes apart, its index at index_offset and routing at meta_offset.
extern "C" __global__ void __launch_bounds__(kPackThreads)
    epserve_dedup_pack(const DispatchConfig cfg, unsigned* __restrict__ scratch,
                       unsigned char* __restrict__ packed, long long block_bytes, long long index_offset,
                       long long meta_offset) {
  if (call_failed(cfg.status)) return;
  const int R = cfg.ranks_per_node, a = cfg.rank / R, N = cfg.world / R, meta_len = 1 + 2 * cfg.top_k;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const long long warp = static_cast<long long>(blockIdx.x) * warps + (threadIdx.x >> 5),
                  nwarps = static_cast<long long>(gridDim.x) * warps;
  const long long row_bytes = 2LL * cfg.hidden;
  for (int ci = 0; ci < N - 1; ++ci) {
    const int c = ci < a ? ci : ci + 1;
    const NodeMasks m = node_masks(scratch, ci, R, cfg.max_tokens);
    unsigned char* block = packed + ci * block_bytes;
    for (int q = 0; q < R; ++q) {
      const int d = c * R + q, n = staged_count(cfg, d);
      const int* meta = staged_meta(cfg, d);
      const unsigned char* rows = staged_rows(cfg, d);
      int* index = reinterpret_cast<int*>(block + index_offset) + static_cast<long long>(q) * cfg.max_tokens;
      int* meta_out = reinterpret_cast<int*>(block + meta_offset) + static_cast<long long>(q) * cfg.max_tokens * meta_len;
      for (long long pos = warp; pos < n; pos += nwarps) {
        const int* routing = meta + pos * meta_len;
        const int t = routing[0];
        int p = -1;
        bool first = false;
        if (t >= 0 && t < cfg.max_tokens) {
          const int w = t >> 5;
          const unsigned bit = 1u << (t & 31);
          p = static_cast<int>(m.base[w]) + __popc(m.any[w] & (bit - 1));
          first = true;  // no lower node rank takes the token: this (q, pos) stores its row
          for (int e = 0; e < q; ++e) first = first && !(m.mask[static_cast<long long>(e) * m.words + w] & bit);
        }
        if (lane == 0) index[pos] = p;
        for (int i = lane; i < meta_len; i += 32) meta_out[pos * meta_len + i] = routing[i];
        if (first)
          warp_copy16(reinterpret_cast<uint4*>(block + p * row_bytes),
                      reinterpret_cast<const uint4*>(rows + pos * row_bytes), row_bytes / 16, lane);
      }
    }
  }
}

// Any grid of kPackThreads, at the rail peer, after the carrier landed each other node's packed
// block for this node in the relay area (block other_node_index(c), block_bytes apart; layout as
// above). Node rank q's token region at source s = c R + (this rank's local index), position pos:
// the packed row index[q][pos]; its routing from the block's copy. Sizes, the counting and the
// failed calls as epserve_relay_token_blocks (comm/relay_copy.cuh relay_into_token_regions).
// relay_arrive[q]: node rank q's relay counters [W].
// (minBlocks 1: without it ptxas chose 48 registers and spilled.)
extern "C" __global__ void __launch_bounds__(kPackThreads, 1)
    epserve_relay_packed_rows(const DispatchConfig cfg, const unsigned char* __restrict__ relay,
                              long long block_bytes, long long index_offset, long long meta_offset,
                              unsigned long long* const* __restrict__ relay_arrive, unsigned* __restrict__ done) {
  relay_into_token_regions(cfg, PackedBlocks{relay, block_bytes, index_offset, meta_offset, cfg.max_tokens,
                                             1 + 2 * cfg.top_k},
                           relay_arrive, done);
}
