// Tile walk for CTA pairs (a 2-CTA cluster) that share one operand by TMA multicast: the
// FP8 GEMM's EPSERVE_GEMM_FP8_PAIRS build (gemm/grouped_gemm_fp8.cu says why). Both CTAs of a
// pair take the same sequence of items, and an item gives each of them one tile of
// gemm/tile_scheduler.cuh's shape:
// - an m-pair item: m-tiles 2p and 2p + 1 of an expert at the same n-tile; the pair shares
//   the weight tile (B), each CTA loading half of it into both;
// - a lone item, for the last m-tile of an expert with an odd count: that m-tile at n-tiles
//   2q and 2q + 1; the pair shares the A tile. Where the expert has an odd number of
//   n-tiles, the last lone item's second tile does not exist: that CTA receives its half of A
//   and computes nothing (`idle`).
// Items are numbered expert by expert; an expert's m-pair items go in groups of kGroupN
// n-tiles (every m-pair takes each n-tile of the group, n fastest), as the single-CTA
// scheduler orders its tiles, then its lone items. The items are handed out statically
// (cluster c takes items c, c + clusters, ...): both CTAs know the sequence without talking.
#pragma once
#include "gemm/tile_scheduler.cuh"

namespace epserve {

struct PairTile {
  GroupedTile t;  // this CTA's tile (for an idle CTA: its partner's, never computed)
  int m_rows;     // real rows of the pair's m-tile in a lone item (what both CTAs receive of A)
  bool shares_b;  // an m-pair item; otherwise a lone item (A shared)
  bool idle;      // a lone item without a second n-tile, on its second CTA
};

template <int kBM, int kBN, int kGroupN = 4>
struct PairTileScheduler {
  const int* expert_offsets;
  int* item_prefix;  // shared [E+1]: items of the experts before e
  int num_experts;
  int n_tiles;
  int total_items;

  __device__ static int items_of(int m_tiles, int n_tiles) {
    return (m_tiles >> 1) * n_tiles + (m_tiles & 1) * ((n_tiles + 1) >> 1);
  }

  // Every thread of the block calls it; contains one __syncthreads.
  __device__ void init(const int* offsets, int experts, int N, int* smem_prefix) {
    expert_offsets = offsets;
    item_prefix = smem_prefix;
    num_experts = experts;
    n_tiles = (N + kBN - 1) / kBN;
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      int carry = 0;
      for (int base = 0; base < experts; base += 32) {
        const int e = base + lane;
        const int items =
            e < experts ? items_of((__ldg(offsets + e + 1) - __ldg(offsets + e) + kBM - 1) / kBM, n_tiles) : 0;
        int sum = items;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, sum, d);
          if (lane >= d) sum += v;
        }
        if (e < experts) item_prefix[e] = carry + sum - items;
        carry += __shfl_sync(0xffffffffu, sum, 31);
      }
      if (lane == 0) item_prefix[experts] = carry;
    }
    __syncthreads();
    total_items = item_prefix[experts];
  }

  __device__ PairTile tile(int index, int rank) const {
    int lo = 0, hi = num_experts - 1;  // last expert whose prefix <= index (empty experts skipped)
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (item_prefix[mid] <= index) lo = mid; else hi = mid - 1;
    }
    const int m_begin = __ldg(expert_offsets + lo), m_end = __ldg(expert_offsets + lo + 1);
    const int m_tiles = (m_end - m_begin + kBM - 1) / kBM;
    const int pairs = m_tiles >> 1;
    const int local = index - item_prefix[lo];
    PairTile p;
    int m, n;
    if (local < pairs * n_tiles) {
      const int group = local / (kGroupN * pairs);
      const int in_group = local - group * kGroupN * pairs;
      const int group_n = min(kGroupN, n_tiles - group * kGroupN);
      const int pair = in_group / group_n;
      m = 2 * pair + rank;
      n = group * kGroupN + in_group - pair * group_n;
      p.shares_b = true;
      p.idle = false;
    } else {
      m = m_tiles - 1;
      n = 2 * (local - pairs * n_tiles) + rank;
      p.shares_b = false;
      p.idle = n >= n_tiles;
      if (p.idle) n -= 1;
    }
    p.t.expert = lo;
    p.t.m_abs = m_begin + m * kBM;
    p.t.m_end = m_end;
    p.t.n_abs = n * kBN;
    p.t.rows = min(kBM, m_end - p.t.m_abs);
    p.m_rows = p.t.rows;
    return p;
  }
};

}  // namespace epserve
