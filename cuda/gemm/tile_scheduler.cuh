// Tile walk over a grouped problem: expert e owns rows [expert_offsets[e],
// expert_offsets[e+1]) of A and C and the weight matrix B[e]. Each expert's rows are cut
// into kBM-row tiles (the last one partial, masked by m_end), and every m-tile pairs with
// every kBN-column tile of the output.
//
// Tile order: the grouped GEMMs stream far more weights than L2 holds, so each weight tile
// must be read from HBM once, by all of its expert's m-tiles while it is in L2, and each A
// tile by several n-tiles. Tiles are numbered expert by expert; inside an expert, n-tiles
// go in groups of kGroupN, and inside a group every m-tile takes each of the group's
// n-tiles (n fastest). Taken in this order by CTAs that start them close together in time
// (the wgmma GEMM hands tiles out from an atomic counter), a weight tile is reused by all
// m-tiles and an A tile by kGroupN n-tiles within a few microseconds.
//
// A tile knows how many of its rows are real (`rows`): the wgmma GEMM computes only the
// 64-row halves that hold some, so an expert's tail of at most 64 rows costs half a tile.
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

template <int kBM, int kBN, int kGroupN = 4>
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

  __device__ int offset(int e) const { return __ldg(expert_offsets + e); }

  __device__ GroupedTile tile(int index) const {
    const int mt = index / n_tiles;  // an m-tile of the tile's expert (not the tile's own)
    int lo = 0, hi = num_experts - 1;  // last expert whose prefix <= mt (empty experts skipped)
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (mtile_prefix[mid] <= mt) lo = mid; else hi = mid - 1;
    }
    const int m_tiles = mtile_prefix[lo + 1] - mtile_prefix[lo];
    const int local = index - mtile_prefix[lo] * n_tiles;
    const int group = local / (kGroupN * m_tiles);
    const int in_group = local - group * kGroupN * m_tiles;
    const int group_n = min(kGroupN, n_tiles - group * kGroupN);
    const int m = in_group / group_n;
    GroupedTile t;
    t.expert = lo;
    t.m_abs = offset(lo) + m * kBM;
    t.m_end = offset(lo + 1);
    t.n_abs = (group * kGroupN + in_group - m * group_n) * kBN;
    t.rows = min(kBM, t.m_end - t.m_abs);
    return t;
  }
};

// Split K (the wgmma GEMM's EPSERVE_GEMM_SPLIT_K): each tile becomes `parts` work items, part
// p running k-slices [p * (k_slices / parts), (p + 1) * (k_slices / parts)), the last part to
// k_slices (the split points are whole k-slices, rounded down). Items are numbered part-major,
// every tile's part 0 first, then every tile's part 1: a counter handing out items in order
// gives out every first part before any second one, so the part a second part continues was
// handed out total_tiles items (a wave or more) earlier, and a CTA never holds a first part
// behind a second part that waits for it.
// How many parts each tile of a launch runs in: 1 or max_parts (2). Never split when the
// workspace has no room for every tile (room), or K has fewer k-slices than parts. policy 1:
// split wherever that allows (tests). policy 0, the rule: split when there is at least one
// whole wave of tiles (below that a second half would only wait for its first on another
// SM) and the halves fill the CTAs' waves at least 5 points better: with w1 = ceil(T / G)
// waves of whole tiles and w2 = ceil(2T / G) of halves, 2T / (w2 G) >= T / (w1 G) + 0.05.
// epserve/ffn/tiles.py mirrors it (split_k_parts) for the host's tests and benchmarks.
__host__ __device__ __forceinline__ int split_parts(int tiles, int ctas, int k_slices, int max_parts, int room,
                                                    int policy) {
  if (max_parts < 2 || k_slices < max_parts || tiles <= 0 || tiles > room) return 1;
  if (policy == 1) return max_parts;
  if (tiles < ctas) return 1;
  const long long t = tiles, g = ctas;
  const long long w1 = (t + g - 1) / g, w2 = (2 * t + g - 1) / g;
  return 20 * t * (2 * w1 - w2) >= w1 * w2 * g ? max_parts : 1;
}

struct SplitItem {
  int tile;      // the scheduler's tile index
  int part;      // 0 .. parts - 1
  int kt_begin;  // its k-slices: [kt_begin, kt_end)
  int kt_end;
};

__device__ __forceinline__ SplitItem split_item(int index, int total_tiles, int parts, int k_slices) {
  SplitItem s;
  s.part = parts > 1 ? index / total_tiles : 0;
  s.tile = index - s.part * total_tiles;
  const int step = k_slices / parts;
  s.kt_begin = s.part * step;
  s.kt_end = s.part == parts - 1 ? k_slices : s.kt_begin + step;
  return s;
}

}  // namespace epserve
