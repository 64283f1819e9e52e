// PeerCounters: the ranks the combine's reduction releases recv to (cuda/comm/combine.cu),
// passed by value; epserve/runtime/kernel_structs.py PEER_COUNTERS packs it byte for byte.
// This node's ranks only: the other nodes' ranks need no release, since their rows come
// through the off-node carrier, ordered on the stream (docs/design.md, "Across nodes").
#pragma once
#include "common/nodes.cuh"

struct PeerCounters {
  unsigned long long* ready[EPSERVE_MAX_PEERS];  // this node's ranks' ready arrays [world], as mapped here, by local index
  int ranks_per_node;                            // R: the node is ranks [node_first, node_first + R)
  int node_first;
};
