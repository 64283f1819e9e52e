// Persistent tile walk over a grouped problem: expert e owns rows
// [expert_offsets[e], expert_offsets[e+1]) of A and C and the weight matrix B[e] (N x K).
// Each expert's rows are cut into kBM-row tiles (the last one partial, masked by m_end), and
// every m-tile pairs with every kBN-column tile; the n index runs fastest so CTAs working
// at the same time share A's rows and one expert's weights in L2.
#pragma once
#include "common/types.cuh"


namespace epserve {

struct GroupedTile {
  int expert;
  int m_abs;   // first row of the tile
  int m_end;   // end of the expert's rows (exclusive)
  int n_abs;   // first column
};

template <int kBM, int kBN>
struct GroupedTileScheduler {
  int* mtile_prefix;  // shared [E+1]: m-tiles of experts before e
  int* offsets;       // shared [E+1]: copy of expert_offsets
  int num_experts;
  int n_tiles;
  int total_tiles;

  // All threads call; contains one __syncthreads.
  __device__ void init(const int* expert_offsets, int experts, int N, int* smem_prefix, int* smem_offsets) {
    mtile_prefix = smem_prefix;
    offsets = smem_offsets;
    num_experts = experts;
    n_tiles = (N + kBN - 1) / kBN;
    for (int e = threadIdx.x; e <= experts; e += blockDim.x) offsets[e] = expert_offsets[e];
    __syncthreads();
    if (threadIdx.x == 0) {
      int acc = 0;
      for (int e = 0; e < experts; ++e) {
        mtile_prefix[e] = acc;
        acc += (offsets[e + 1] - offsets[e] + kBM - 1) / kBM;
      }
      mtile_prefix[experts] = acc;
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
    t.m_abs = offsets[lo] + (mt - mtile_prefix[lo]) * kBM;
    t.m_end = offsets[lo + 1];
    t.n_abs = nt * kBN;
    return t;
  }
};

}  // namespace epserve
