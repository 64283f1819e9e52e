// Ranks and nodes (docs/design.md, "Across nodes"). Node n holds ranks [n R, (n + 1) R), with
// R <= EPSERVE_MAX_PEERS: a rank reaches the ranks of its own node through CUDA IPC, and the
// kernel structs' address tables hold those ranks only, at their local index d - first (first:
// the node's first rank). The ranks of other nodes are reached through the off-node staging
// (epserve/comm/off_node.py), where rank d of another node has block off_node_block(d): the
// other nodes' ranks in rank order, so its address is arithmetic, never a table entry.
// Per-destination *counts* (count rows, arrival counters, destination sets) are sized by the
// world, up to EPSERVE_MAX_WORLD ranks: what src_info's 7 rank bits name.
#pragma once

#define EPSERVE_MAX_PEERS 8    // ranks per node: the address tables' size (epserve.kernel_structs.MAX_PEERS)
#define EPSERVE_MAX_WORLD 128  // ranks in all (epserve.kernel_structs.MAX_WORLD)

namespace epserve {

// Rank d's local index on the node whose first rank is `first`, when d is on it; else -1.
__device__ __forceinline__ int node_index(int d, int first, int R) {
  const int p = d - first;
  return static_cast<unsigned>(p) < static_cast<unsigned>(R) ? p : -1;
}

// The staging block of rank d of another node (the other nodes' ranks, ascending).
__device__ __forceinline__ int off_node_block(int d, int first, int R) { return d < first ? d : d - R; }

}  // namespace epserve
