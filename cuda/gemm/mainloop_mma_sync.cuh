// Mainloop of the grouped GEMM: C_tile (kBM x kBN) = A_rows (kBM x K) @ B_e^T, both operands
// K-contiguous bf16, fp32 accumulation in registers through mma.sync m16n8k16 on the tensor
// cores. A kStages-deep cp.async ring of kBK-wide k-slices; each 128-byte row of a slice is
// stored with its 16-byte chunks XOR-swizzled by (row & 7) so ldmatrix reads hit 8 distinct
// bank groups.
#pragma once
#include "common/ptx.cuh"

namespace epserve {

template <int kBM, int kBN, int kBK, int kStages, int kWarpsM, int kWarpsN>
struct MmaSyncMainloop {
  static_assert(kBK == 64, "the swizzle assumes 128-byte rows");
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kWarpM = kBM / kWarpsM;  // rows per warp
  static constexpr int kWarpN = kBN / kWarpsN;  // columns per warp
  static constexpr int kMI = kWarpM / 16;       // m16 tiles per warp
  static constexpr int kNJ = kWarpN / 8;        // n8 tiles per warp
  static_assert(kNJ % 2 == 0, "B fragments load two n8 tiles per ldmatrix.x4");
  static constexpr int kStageElemsA = kBM * kBK;
  static constexpr int kStageElemsB = kBN * kBK;
  static constexpr int kSmemBytes = kStages * (kStageElemsA + kStageElemsB) * 2;

  struct Accum {
    float v[kMI][kNJ][4];
  };

  __device__ static int swz(int row, int chunk) { return row * kBK + ((chunk ^ (row & 7)) << 3); }

  // Issues the cp.async copies of k-slice kt into `stage`. Rows at or past `rows_a` / `rows_b`
  // zero-fill (their address is clamped to row 0 so it stays inside the allocation).
  __device__ static void load_slice(bf16_t* smem, int stage, int kt, const bf16_t* A, int lda, int rows_a,
                                    const bf16_t* B, int ldb, int rows_b, int tid) {
    bf16_t* sa = smem + stage * (kStageElemsA + kStageElemsB);
    bf16_t* sb = sa + kStageElemsA;
    const int k0 = kt * kBK;
#pragma unroll
    for (int i = 0; i < kStageElemsA / 8 / kThreads; ++i) {
      const int c = tid + i * kThreads, row = c >> 3, chunk = c & 7;
      const bool ok = row < rows_a;
      cp_async_16(sa + swz(row, chunk), A + static_cast<long long>(ok ? row : 0) * lda + k0 + chunk * 8, ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < kStageElemsB / 8 / kThreads; ++i) {
      const int c = tid + i * kThreads, row = c >> 3, chunk = c & 7;
      const bool ok = row < rows_b;
      cp_async_16(sb + swz(row, chunk), B + static_cast<long long>(ok ? row : 0) * ldb + k0 + chunk * 8, ok ? 16 : 0);
    }
  }

  __device__ static void prologue(bf16_t* smem, int k_slices, const bf16_t* A, int lda, int rows_a, const bf16_t* B,
                                  int ldb, int rows_b, int tid) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_slices) load_slice(smem, s, s, A, lda, rows_a, B, ldb, rows_b, tid);
      cp_async_commit();
    }
  }

  // Runs after prologue(); leaves no copy in flight and ends with a barrier, so the ring
  // can take the next tile's prologue at once.
  __device__ static void run(Accum& acc, bf16_t* smem, int k_slices, const bf16_t* A, int lda, int rows_a,
                             const bf16_t* B, int ldb, int rows_b, int tid) {
    const int warp = tid >> 5, lane = tid & 31;
    const int wm = warp / kWarpsN, wn = warp % kWarpsN;
#pragma unroll
    for (int i = 0; i < kMI; ++i)
#pragma unroll
      for (int j = 0; j < kNJ; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc.v[i][j][q] = 0.f;

    for (int kt = 0; kt < k_slices; ++kt) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // slice kt landed for all threads; slice kt-1's stage is free
      const int next = kt + kStages - 1;
      if (next < k_slices) load_slice(smem, next % kStages, next, A, lda, rows_a, B, ldb, rows_b, tid);
      cp_async_commit();

      const bf16_t* sa = smem + (kt % kStages) * (kStageElemsA + kStageElemsB);
      const bf16_t* sb = sa + kStageElemsA;
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        uint32_t a[kMI][4];
        uint32_t b[kNJ / 2][4];
#pragma unroll
        for (int i = 0; i < kMI; ++i) {
          const int row = wm * kWarpM + i * 16 + (lane & 15);
          ldmatrix_x4(a[i], sa + swz(row, kk * 2 + (lane >> 4)));
        }
#pragma unroll
        for (int j = 0; j < kNJ / 2; ++j) {
          const int row = wn * kWarpN + j * 16 + (lane & 7) + ((lane >> 4) << 3);
          ldmatrix_x4(b[j], sb + swz(row, kk * 2 + ((lane >> 3) & 1)));
        }
#pragma unroll
        for (int i = 0; i < kMI; ++i)
#pragma unroll
          for (int j = 0; j < kNJ; ++j)
            mma_bf16_16816(acc.v[i][j], a[i], b[j / 2][(j & 1) * 2], b[j / 2][(j & 1) * 2 + 1]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();
  }

  // Accumulators -> bf16 -> the shared output tile (row-major, ld elements per row).
  __device__ static void store_to_smem(const Accum& acc, bf16_t* tile, int ld, int tid) {
    const int warp = tid >> 5, lane = tid & 31;
    const int wm = warp / kWarpsN, wn = warp % kWarpsN;
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int i = 0; i < kMI; ++i)
#pragma unroll
      for (int j = 0; j < kNJ; ++j) {
        const int row = wm * kWarpM + i * 16 + g;
        const int col = wn * kWarpN + j * 8 + q * 2;
        *reinterpret_cast<uint32_t*>(tile + row * ld + col) = pack_bf16x2(acc.v[i][j][0], acc.v[i][j][1]);
        *reinterpret_cast<uint32_t*>(tile + (row + 8) * ld + col) = pack_bf16x2(acc.v[i][j][2], acc.v[i][j][3]);
      }
  }
};

}  // namespace epserve
