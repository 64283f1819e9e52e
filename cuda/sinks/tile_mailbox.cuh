// Hand-over of the epilogue's finished shared-memory tile from the output warps (the MMA
// warps) to a few worker warps that write it out while the output warps go on with the next
// tile's mainloop. The peer sink's send warps use it to scatter rows to their home ranks;
// the wgmma GEMM's null build uses it to store C. Protocol, per tile:
//     output warps: [drain: bar.sync kDrain]  write tile + mailbox  bar.sync kFull
//     workers:       bar.sync kFull  write the tile out  bar.sync kDrain
// The output warps drain the previous tile after the next tile's mainloop, where the wait
// hides behind the MMA; the workers go from kDrain straight to kFull, so the output warps'
// kFull never waits (a bar.arrive would gain nothing, and full barriers on both sides order
// the mailbox for every reader, compute-sanitizer's racecheck included). shutdown drains
// the last tile and posts `done`, so both barriers are matched when the kernel ends. The
// two sides reach each barrier from different code, so they are unaligned barriers.
// Inside their tile loop the output threads may order work among themselves by mbarriers,
// not by a named barrier over part of them: with one, compute-sanitizer's racecheck reports
// the tile's and the mailbox's writes unordered with the workers' reads though they are
// ordered (launch/jobs/probe_racecheck_handover.py).
#pragma once
#include "common/ptx.cuh"
#include "sinks/smem_tile.cuh"

struct SendMailbox {
  int m_abs, n_abs, rows, cols, done;
};
static_assert(sizeof(SendMailbox) == 5 * sizeof(int), "hand_over posts the mailbox as five 32-bit words in this order");

// Thread 0 of the output threads posts where the tile belongs (done = 0). By predicated stores,
// not `if (tid == 0)`: that branch made ptxas keep the FP8 GEMM's whole tile loop, its stage
// index and every wgmma descriptor, out of the uniform registers, with 2-4 R2UR ahead of each
// wgmma; without it the FP8 GEMMs ran 4-5% faster (notes/gemm.md, twelfth and thirteenth
// sessions).
__device__ __forceinline__ void post_mailbox(SendMailbox* box, const SmemTile& tile, int m_abs, int n_abs, int tid) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.eq.s32 p, %0, 0;\n"
      "@p st.shared.b32 [%1], %2;\n@p st.shared.b32 [%1+4], %3;\n@p st.shared.b32 [%1+8], %4;\n"
      "@p st.shared.b32 [%1+12], %5;\n@p st.shared.b32 [%1+16], %6;\n}\n" ::"r"(tid),
      "r"(epserve::smem_u32(box)), "r"(m_abs), "r"(n_abs), "r"(tile.rows), "r"(tile.cols), "r"(0)
      : "memory");
}

template <int kOutputThreads, int kWorkerThreads, int kFullBarrier = 2, int kDrainBarrier = 3>
struct TileMailbox {
  static constexpr int kParties = kOutputThreads + kWorkerThreads;

  // Output warps: the tile is in shared memory; tell the workers where it belongs. The
  // barrier also makes every output thread's tile writes visible to the workers.
  __device__ static void hand_over(SendMailbox* box, const SmemTile& tile, int m_abs, int n_abs, int tid) {
    post_mailbox(box, tile, m_abs, n_abs, tid);
    epserve::named_barrier_sync_across_roles<kFullBarrier, kParties>();
  }

  // Output warps: wait until the workers are done with the previous tile.
  __device__ static void drain() { epserve::named_barrier_sync_across_roles<kDrainBarrier, kParties>(); }

  // Workers: write_out(mailbox) for every tile handed over, until `done`.
  template <class WriteOut>
  __device__ static void serve(const SendMailbox* box, WriteOut&& write_out) {
    for (;;) {
      epserve::named_barrier_sync_across_roles<kFullBarrier, kParties>();
      const SendMailbox m = *box;
      if (m.done) return;
      write_out(m);
      __syncwarp();  // the warp's lanes arrive at the drain together
      epserve::named_barrier_sync_across_roles<kDrainBarrier, kParties>();
    }
  }

  // Output warps, after their last tile: retire the workers with every arrival matched.
  __device__ static void shutdown(SendMailbox* box, bool drain_pending, int tid) {
    if (drain_pending) drain();
    if (tid == 0) box->done = 1;
    epserve::named_barrier_sync_across_roles<kFullBarrier, kParties>();
  }
};
