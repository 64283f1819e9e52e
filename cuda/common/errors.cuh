// Device-side error records and the bounded spin-wait. A wait that runs out records
// (code, peer) once and returns false; the host turns the record into PeerTimeoutError or
// EPServeError naming the rank and the stage (epserve/errors.py, epserve/comm/signals.py).
#pragma once
#include "common/ptx.cuh"

namespace epserve {

enum ErrorCode : int {
  kOk = 0,
  kCombineWaitTimeout = 1,   // combine reduction waited for rows that never arrived
  kPeerReadyTimeout = 2,     // a sender waited for a peer to release its recv buffer
  kBadSrcInfo = 3,           // a row's src_info names a rank, token or slot out of range
  kDispatchBadExpert = 4,    // topk_idx holds an id outside [-1, num_experts)
  kDispatchReadyTimeout = 5, // a sender waited for a peer to release its dispatch buffers
  kDispatchCountTimeout = 6, // the count rows of some rank never arrived
  kDispatchTokenTimeout = 7, // token rows promised by the counts never arrived
  kPeerRejectedInput = 8,    // verdict: rank `peer` rejected its own input on the host
  kPeerBadExpert = 9,        // verdict: rank `peer`'s topk_idx holds an id outside [-1, num_experts)
  kRecvOverflow = 10,        // verdict: rank `peer` would receive `detail` rows, over max_recv_rows
  kOffNodeCarrierTimeout = 11,  // the IPC test carrier waited for rank `peer` to post (detail 0) or take (1) a group
  kOffNodeRowsTimeout = 12,     // across nodes, overlap: GEMM 2 never staged `detail` units more for home `peer`
  kOffNodeRelayTimeout = 13,    // across nodes, relay: rank `peer`'s rows never reached this rank (detail 0: its
                                // dispatch rows, relayed; 1: its combine rows, to relay on)
  kOffNodeStale = 14,           // across nodes: what rank `peer` sent this call over the carrier is not valid (its
                                // stamp says it failed, or is another call's; detail 0: token rows, 1: combine rows)
};

// A call's status on this rank (int[2], local), written fresh by the dispatch layout kernel
// of every call and read by every later kernel of that call, so no host needs to look:
//   [kCallFailed]   nonzero when this call failed here: its output is poisoned
//   [kCallStopped]  nonzero when the call stopped before any row moved here: kStoppedByVerdict
//                   when the verdict stopped it (every rank reaches the same verdict from the
//                   same count rows, so no rank sends, and nobody expects rows), or
//                   kStoppedByTimeout when this rank's layout ran out of time waiting for a
//                   count row (only this rank stopped: the others go on and wait for it)
enum CallStatus : int { kCallFailed = 0, kCallStopped = 1 };
enum StopReason : int { kStoppedByVerdict = 1, kStoppedByTimeout = 2 };

__device__ __forceinline__ void mark_call_failed(int* status) {
  if (status) atomicExch(status + kCallFailed, 1);
}
__device__ __forceinline__ bool call_failed(const int* status) {
  return status && *(volatile const int*)(status + kCallFailed);
}
__device__ __forceinline__ bool call_stopped(const int* status) {
  return status && *(volatile const int*)(status + kCallStopped);
}
// Stopped on every rank alike: the ranks that count calls (the relay) count this one too.
__device__ __forceinline__ bool stopped_by_verdict(const int* status) {
  return status && *(volatile const int*)(status + kCallStopped) == kStoppedByVerdict;
}

// error[0] = code, error[1] = peer rank (or -1), error[2] = detail (e.g. the bad value)
__device__ __forceinline__ void record_error(int* error, int code, int peer, int detail) {
  if (atomicCAS(error, 0, code) == 0) {
    error[1] = peer;
    error[2] = detail;
    __threadfence();
  }
}

// Spin until *counter >= target, at most timeout_ns; true when reached.
__device__ __forceinline__ bool wait_at_least(const unsigned long long* counter, unsigned long long target,
                                              unsigned long long timeout_ns) {
  if (ld_acquire_sys(counter) >= target) return true;
  const unsigned long long start = globaltimer_ns();
  while (ld_acquire_sys(counter) < target) {
    if (globaltimer_ns() - start > timeout_ns) return false;
    __nanosleep(64);
  }
  return true;
}

}  // namespace epserve
