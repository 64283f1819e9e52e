// NullPeerSink: the GEMM stores C locally. Every call site is under `if constexpr
// (Sink::kEnabled)`, so this build contains no peer-send code at all (a test checks the PTX).
#pragma once
#include "sinks/peer_send_config.cuh"
#include "sinks/smem_tile.cuh"

struct SendMailbox;

struct NullPeerSink {
  static constexpr bool kEnabled = false;
  static constexpr int kSendWarps = 0;

  template <int kNumThreads, int kBarrierId = 0>
  __device__ static void send_tile(const SmemTile&, uint32_t, uint32_t, uint32_t, int32_t, const PeerSendConfig&,
                                   int, int) {}
  template <int kOutputThreads>
  __device__ static void hand_over(SendMailbox*, const SmemTile&, int, int, int) {}
  template <int kOutputThreads>
  __device__ static void drain() {}
  template <int kOutputThreads>
  __device__ static void service(const SmemTile&, const SendMailbox*, const PeerSendConfig&, int) {}
  template <int kOutputThreads>
  __device__ static void shutdown(SendMailbox*, bool, int) {}
};
