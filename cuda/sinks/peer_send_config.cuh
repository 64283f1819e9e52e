// PeerSendConfig: the peer sink's run-time state, passed BY VALUE to the GEMM in both sink
// builds so the kernel signature is one. epserve/runtime/kernel_structs.py packs it byte for byte; a
// test compiles static_asserts of those offsets against this definition.
#pragma once
#include "common/types.cuh"

#define EPSERVE_MAX_PEERS 8

struct PeerSendConfig {
  bf16_t* recv[EPSERVE_MAX_PEERS];                // each rank's recv [max_tokens, k, H], as mapped in this process
  unsigned long long* arrive[EPSERVE_MAX_PEERS];  // each rank's arrival counters [EPSERVE_MAX_PEERS] (64-column units, by sender)
  const unsigned long long* ready;                // local [EPSERVE_MAX_PEERS]: combines rank d has finished reading;
                                                  // ready[rank] is this rank's own count, so it is the epoch too
  const int* src_info;                            // [M] packed row sources of this call (common/src_info.cuh)
  int* error;                                     // local error record (common/errors.cuh)
  int* status;                                    // local call status (common/errors.cuh), or null
  unsigned long long timeout_ns;                  // bound of every wait
  int rank;
  int world;
  int top_k;
  int hidden;
  int max_tokens;                                 // tokens per rank that recv has room for
  int reserved;
};
