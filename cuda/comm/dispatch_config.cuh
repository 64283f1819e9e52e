// DispatchConfig: the direct-store dispatch's run-time state, passed by value.
// epserve/runtime/kernel_structs.py packs it byte for byte; a CI test checks the offsets with the
// compiler, as for PeerSendConfig. The token rows' arrival counters are per chunk of 32 rows,
// in a buffer of the dispatcher, and reach the move kernel as its own arguments.
#pragma once
#include "sinks/peer_send_config.cuh"

// The address tables hold this node's ranks, by local index (rank - node_first; common/nodes.cuh);
// the other nodes' ranks are reached through the off-node staging (off_*), by arithmetic.
struct DispatchConfig {
  int* count_table[EPSERVE_MAX_PEERS];                  // this node's ranks' [W][E + W + 1] count tables, as mapped here
  bf16_t* tokens[EPSERVE_MAX_PEERS];                    // their token regions [W][max_tokens][H]
  int* meta[EPSERVE_MAX_PEERS];                         // their routing of those rows [W][max_tokens][1 + 2k]
  unsigned long long* count_arrive[EPSERVE_MAX_PEERS];  // their count-row counters [W], by sender
  unsigned long long* ready[EPSERVE_MAX_PEERS];         // their dispatch-ready arrays [W]
  const unsigned long long* my_ready;                   // local [W]: ready[d] = dispatches rank d (of this node) has
                                                        // consumed; my_ready[rank] is this rank's own: the epoch
  const unsigned long long* my_count_arrive;            // local [W], by sender
  int* error;                                           // local error record
  int* status;                                          // local call status [2] (common/errors.cuh)
  unsigned long long timeout_ns;
  int* off_count_row;                                   // across nodes, the dispatch staging: this rank's count row for
                                                        // the other nodes (null on one node), and block
  unsigned char* off_blocks;                            // off_node_block(d) of off-node rank d at off_blocks + block *
  long long off_block_bytes;                            // off_block_bytes: its token rows [max_tokens][H], then their
                                                        // routing [max_tokens][1 + 2k]
  int rank;
  int world;
  int num_experts;
  int top_k;
  int hidden;
  int max_tokens;
  int max_recv_rows;                                    // expert rows a rank may receive in one call
  int ranks_per_node;                                   // node n = ranks [n * R, (n + 1) * R): its peers are
                                                        // reached by IPC, the others' rows by the off-node
                                                        // carrier (epserve/comm/off_node.py); R = world: one node
  int node_first;                                       // this rank's node's first rank
  int reserved;
};

// The code a rank puts in its count row when its own input failed its host checks
// (epserve/dispatch/direct.py INPUT_REJECTED); kDispatchBadExpert when route found a bad id.
#define EPSERVE_INPUT_REJECTED 100

// Experts in all: route's scan keeps a count per expert in shared memory
// (epserve.kernel_structs.MAX_EXPERTS).
#define EPSERVE_MAX_EXPERTS 1024
