// Persistent tile walk over a grouped problem: expert e owns rows
// [expert_offsets[e], expert_offsets[e+1]) of A and C and the weight matrix B[e]. Each
// expert's rows are cut into kBM-row tiles (the last one partial, masked by m_end), and
// every m-tile pairs with every kBN-column tile of the output; the n index runs fastest, so
// the CTAs working at the same time share A's rows and one expert's weights in L2.
//
// A tile knows how many of its rows are real (`rows`): the GEMM computes only the 64-row
// halves that hold some, so an expert's tail of at most 64 rows costs half a tile.
#pragma once
#include "common/types.cuh"

namespace epserve {

struct GroupedTile {
  int expert;
  int m_abs;  // first row of the tile
  int m_end;  // end of the expert's rows (exclusive)
  int n_abs;  // first output column
  int rows;   // real rows in the tile: min(kBM, m_end - m_abs), at least 1
};

template <int kBM, int kBN>
struct GroupedTileScheduler {
  const int* expert_offsets;  // global [E+1]
  int* mtile_prefix;          // shared [E+1]: m-tiles of the experts before e
  int num_experts;
  int n_tiles;
  int total_tiles;

  // Every thread of the block calls it; contains one __syncthreads. Warp 0 scans the
  // per-expert tile counts, 32 experts at a time.
  __device__ void init(const int* offsets, int experts, int N, int* smem_prefix) {
    expert_offsets = offsets;
    mtile_prefix = smem_prefix;
    num_experts = experts;
    n_tiles = (N + kBN - 1) / kBN;
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      int carry = 0;
      for (int base = 0; base < experts; base += 32) {
        const int e = base + lane;
        const int tiles = e < experts ? (__ldg(offsets + e + 1) - __ldg(offsets + e) + kBM - 1) / kBM : 0;
        int sum = tiles;  // inclusive scan over the warp
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, sum, d);
          if (lane >= d) sum += v;
        }
        if (e < experts) mtile_prefix[e] = carry + sum - tiles;
        carry += __shfl_sync(0xffffffffu, sum, 31);
      }
      if (lane == 0) mtile_prefix[experts] = carry;
    }
    __syncthreads();
    total_tiles = mtile_prefix[experts] * n_tiles;
  }

  __device__ GroupedTile tile(int index) const {
    const int mt = index / n_tiles;
    const int nt = index - mt * n_tiles;
    int lo = 0, hi = num_experts - 1;  // last expert whose prefix <= mt (empty experts skipped)
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (mtile_prefix[mid] <= mt) lo = mid; else hi = mid - 1;
    }
    GroupedTile t;
    t.expert = lo;
    t.m_abs = __ldg(expert_offsets + lo) + (mt - mtile_prefix[lo]) * kBM;
    t.m_end = __ldg(expert_offsets + lo + 1);
    t.n_abs = nt * kBN;
    t.rows = min(kBM, t.m_end - t.m_abs);
    return t;
  }
};

}  // namespace epserve
