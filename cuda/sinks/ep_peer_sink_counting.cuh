// EpPeerSinkCountingOffNode: EpPeerSink that also counts, per off-node home, the rows it has
// staged (sinks/off_node_rows_done.cuh), for the combine's off-node send under GEMM 2
// (docs/design.md, "Across nodes"). Only the wgmma GEMM's overlap builds use it
// (gemm_wgmma_peer*_overlap), so EpPeerSink and every default build stay as they were.
#pragma once
#include "sinks/ep_peer_sink.cuh"
#include "sinks/off_node_rows_done.cuh"

struct EpPeerSinkCountingOffNode : EpPeerSink {
  // send_tile is EpPeerSink's, uncounted: the mma.sync GEMM has no overlap build.

  // Send warps: scatter every tile handed over, then count its off-node rows as staged.
  template <int kOutputThreads>
  __device__ static void service(const SmemTile& tile, const SendMailbox* box, const PeerSendConfig& cfg, int send_tid) {
    Mailbox<kOutputThreads>::serve(box, [&](const SendMailbox& m) {
      epserve::scatter_rows_to_peers<kSendThreads, 128, kSendBarrier>(tile.data, tile.ld, m.rows, m.cols, m.m_abs,
                                                                      m.n_abs, cfg, send_tid);
      epserve::count_off_node_rows<kSendThreads>(m.m_abs, m.rows, m.cols, cfg, send_tid);
    });
  }
};
