// EpPeerSinkBulk: EpPeerSink whose send warps move each tile's rows with bulk asynchronous
// copies and publish their arrival one tile later (sinks/row_scatter_bulk.cuh says why), all
// rows (EPSERVE_SINK_BULK=1: the *_peer_bulk builds, EPSERVE_SINK_STORES=bulk) or only this
// rank's own (EPSERVE_SINK_BULK=2: *_peer_ownbulk, EPSERVE_SINK_STORES=own-bulk). The same bytes in
// the same slots, so the results are EpPeerSink's bit for bit.
#pragma once
#include "sinks/ep_peer_sink.cuh"
#include "sinks/row_scatter_bulk.cuh"

struct EpPeerSinkBulk : EpPeerSink {
  // EPSERVE_SINK_BULK=2 (EPSERVE_SINK_STORES=own-bulk): only this rank's own rows by bulk
  // copies, the other ranks' by the send warps' stores (sinks/row_scatter_bulk.cuh).
  static constexpr bool kOwnRowsOnly = EPSERVE_SINK_BULK == 2;

  // send_tile (no send warps: the mma.sync GEMM) is EpPeerSink's.

  // Output warps: their tile writes (generic proxy) ordered before the copy engine's reads.
  template <int kOutputThreads>
  __device__ static void hand_over(SendMailbox* box, const SmemTile& tile, int m_abs, int n_abs, int tid) {
    epserve::fence_proxy_async_shared();
    Mailbox<kOutputThreads>::hand_over(box, tile, m_abs, n_abs, tid);
  }

  // Send warps: every tile handed over until `done`, then the last tile's arrival.
  template <int kOutputThreads, int kMbarrierMailbox = 0>
  __device__ static void service(const SmemTile& tile, const SendMailbox* box, const PeerSendConfig& cfg, int send_tid) {
    static_assert(!kMbarrierMailbox, "the bulk send warps' hand-over fences: only through TileMailbox");
    __shared__ epserve::BulkPending pending;
    epserve::zero_bulk_pending<kSendThreads, kSendBarrier>(pending, send_tid);
    Mailbox<kOutputThreads>::serve(box, [&](const SendMailbox& m) {
      epserve::scatter_tile_rows_bulk<kSendThreads, 128, kSendBarrier, kOwnRowsOnly>(
          tile.data, tile.ld, m.rows, m.cols, m.m_abs, m.n_abs, cfg, pending, send_tid);
    });
    epserve::flush_bulk_rows<kSendThreads, kSendBarrier>(pending, cfg, send_tid);
  }
};
