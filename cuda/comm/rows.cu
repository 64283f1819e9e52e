// Row movers for the dispatch and for the unfused combine's IPC transport. A row is
// row_bytes long (a multiple of 16); one warp moves one row with 16-byte accesses.
#include "common/ptx.cuh"
#include "sinks/row_scatter.cuh"

using namespace epserve;

// dst[dst_idx ? dst_idx[i] : i] = src[src_idx ? src_idx[i] : i] for i < rows.
extern "C" __global__ void epserve_copy_rows(unsigned char* __restrict__ dst, const unsigned char* __restrict__ src,
                                             const int* __restrict__ dst_idx, const int* __restrict__ src_idx,
                                             int rows, int row_bytes) {
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  for (int i = blockIdx.x * warps + (threadIdx.x >> 5); i < rows; i += gridDim.x * warps) {
    const long long d = dst_idx ? dst_idx[i] : i;
    const long long s = src_idx ? src_idx[i] : i;
    const uint4* sp = reinterpret_cast<const uint4*>(src + s * row_bytes);
    uint4* dp = reinterpret_cast<uint4*>(dst + d * row_bytes);
    for (int c = lane; c < row_bytes / 16; c += 32) dp[c] = sp[c];
  }
}

struct PeerBases {
  const unsigned char* base[EPSERVE_MAX_PEERS];
};

// dst[i] = peers[src_rank[i]].base[src_pos[i]]: pulls rows from the peers' send buffers
// through their IPC mappings (the dispatch where NCCL cannot run: ranks sharing a GPU).
extern "C" __global__ void epserve_gather_rows_from_peers(unsigned char* __restrict__ dst, const PeerBases peers,
                                                          const int* __restrict__ src_rank,
                                                          const int* __restrict__ src_pos, int rows, int row_bytes) {
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  for (int i = blockIdx.x * warps + (threadIdx.x >> 5); i < rows; i += gridDim.x * warps) {
    const uint4* sp = reinterpret_cast<const uint4*>(peers.base[src_rank[i]] + static_cast<long long>(src_pos[i]) * row_bytes);
    uint4* dp = reinterpret_cast<uint4*>(dst + static_cast<long long>(i) * row_bytes);
    for (int c = lane; c < row_bytes / 16; c += 32) dp[c] = ld_cg_v4(sp + c);
  }
}

// The unfused combine over IPC: C's rows (already complete in global memory) pushed into
// their home ranks' recv slots with the peer sink's own scatter and signalling.
constexpr int kPushThreads = 256, kPushRows = 32;
extern "C" __global__ void __launch_bounds__(kPushThreads)
    epserve_push_rows_to_peers(const bf16_t* __restrict__ C, int M, int H, const PeerSendConfig cfg) {
  for (int m0 = blockIdx.x * kPushRows; m0 < M; m0 += gridDim.x * kPushRows) {
    scatter_rows_to_peers<kPushThreads, kPushRows>(C + static_cast<long long>(m0) * H, H, min(kPushRows, M - m0), H,
                                                   m0, 0, cfg, threadIdx.x);
  }
}
