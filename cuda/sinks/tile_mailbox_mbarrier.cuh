// TileMailbox's hand-over (sinks/tile_mailbox.cuh) by two mbarriers instead of two named
// barriers, so that the output warpgroups never wait for each other: with named barriers every
// output thread's hand-over and drain waits for all of them, and the two consumer warpgroups of
// the FP8 GEMM leave each tile in step, both out of the MMA at once for the epilogue and both
// back into it at once. Here each output thread arrives on `full` when its own writes of the
// tile are done and goes on, and waits on `free` only for the workers:
//     output threads: [drain: wait free(j - 1)]  write tile j (+ mailbox)  arrive full
//     workers:         arrive full, wait full(j)  write the tile out  arrive free
// The phases are counted per thread: `handed` is how many tiles this output thread has handed
// over. The workers cannot fall two tiles behind, nor an output warpgroup run two tiles ahead
// of the other: tile j + 1's writes wait for free(j), which waits for every output thread's
// arrival on full(j). The barriers sit right after the mailbox (`barriers(box)`); init is called
// by one thread before the block's first __syncthreads.
#pragma once
#include "common/ptx.cuh"
#include "sinks/smem_tile.cuh"
#include "sinks/tile_mailbox.cuh"

struct MailboxBarriers {
  uint64_t full, free;
};

template <int kOutputThreads, int kWorkerThreads>
struct TileMailboxMbarrier {
  // bytes of the mailbox and its barriers, from the mailbox's (8-byte aligned) address
  static constexpr int kBytes = 24 + static_cast<int>(sizeof(MailboxBarriers));
  __device__ static MailboxBarriers* barriers(const SendMailbox* box) {
    return reinterpret_cast<MailboxBarriers*>(reinterpret_cast<uintptr_t>(box) + 24);
  }
  __device__ static void init(SendMailbox* box) {
    epserve::mbarrier_init(&barriers(box)->full, kOutputThreads + kWorkerThreads);
    epserve::mbarrier_init(&barriers(box)->free, kWorkerThreads);
  }
  // Output threads: this thread's part of the tile is in shared memory (tid 0 posts the
  // mailbox: post_mailbox); the arrive releases it.
  __device__ static void hand_over(SendMailbox* box, const SmemTile& tile, int m_abs, int n_abs, int tid) {
    post_mailbox(box, tile, m_abs, n_abs, tid);
    epserve::mbarrier_arrive(&barriers(box)->full);
  }
  // Output threads, before writing tile `handed`: the workers are done with tile handed - 1.
  __device__ static void drain(const SendMailbox* box, int handed) {
    epserve::mbarrier_wait(&barriers(box)->free, static_cast<uint32_t>(handed - 1) & 1u);
  }
  // Workers: write_out(mailbox) for every tile handed over, until `done`.
  // Each worker arrives on `full` too, and waits for the phase it arrived in: no phase count
  // held across the loop (the send warps' registers are few: one more spilled).
  template <class WriteOut>
  __device__ static void serve(const SendMailbox* box, WriteOut&& write_out) {
    for (;;) {
      const uint32_t full = epserve::smem_u32(&barriers(box)->full);
      asm volatile(
          "{\n.reg .pred done;\n.reg .b64 state;\n"
          "mbarrier.arrive.shared::cta.b64 state, [%0];\nWAIT_%=:\n"
          "mbarrier.try_wait.shared::cta.b64 done, [%0], state;\n"
          "@!done bra WAIT_%=;\n}\n" ::"r"(full)
          : "memory");
      const SendMailbox m = *box;
      if (m.done) return;
      write_out(m);
      epserve::mbarrier_arrive(&barriers(box)->free);  // this thread's reads of the tile are done
    }
  }
  // Output threads, after their last tile (`handed` tiles handed over): retire the workers.
  __device__ static void shutdown(SendMailbox* box, bool drain_pending, int handed, int tid) {
    if (drain_pending) drain(box, handed);
    if (tid == 0) box->done = 1;
    epserve::mbarrier_arrive(&barriers(box)->full);
  }
};
