// PeerSendConfig: the peer sink's run-time state, passed BY VALUE to the GEMM in both sink
// builds so the kernel signature is one. epserve/runtime/kernel_structs.py packs it byte for byte; a
// test compiles static_asserts of those offsets against this definition.
#pragma once
#include "common/nodes.cuh"
#include "common/types.cuh"

struct PeerSendConfig {
  bf16_t* recv[EPSERVE_MAX_PEERS];                // this node's ranks' recv [max_tokens, k, H], as mapped here, by
                                                  // local index (rank - node_first; common/nodes.cuh)
  unsigned long long* arrive[EPSERVE_MAX_PEERS];  // their arrival counters [world] (64-column units, by sender)
  const unsigned long long* ready;                // local [world]: combines rank d of this node has finished reading;
                                                  // ready[rank] is this rank's own count, so it is the epoch too
  const int* src_info;                            // [M] packed row sources of this call (common/src_info.cuh)
  int* error;                                     // local error record (common/errors.cuh)
  int* status;                                    // local call status (common/errors.cuh), or null
  unsigned long long timeout_ns;                  // bound of every wait
  bf16_t* off_recv;                               // across nodes, the combine staging: off-node rank d's copy of its
                                                  // recv at block off_node_block(d) (max_tokens * k * H each);
                                                  // null on one node
  int rank;
  int world;
  int top_k;
  int hidden;
  int max_tokens;                                 // tokens per rank that recv has room for
  int ranks_per_node;                             // R: this node is ranks [node_first, node_first + R)
  int node_first;
  int reserved;
};
