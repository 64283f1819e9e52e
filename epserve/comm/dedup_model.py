"""The relay's deduplication in NumPy (EPSERVE_OFFNODE_DEDUP=1; epserve/comm/off_node_dedup.py,
cuda/comm/off_node_dedup.cu): what each staging block holds for a routing, the packing
arithmetic the kernels do (bit sets per node rank, their union's popcount bases, the first node
rank that takes a token stores its row), and the network bytes the rail transfers carry with and
without it. No GPU: the CPU tests check the packing against a plain model, and the check job
prints the bytes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def staged_tokens(topk_idx: np.ndarray, num_experts: int, world: int) -> list[np.ndarray]:
    """For each destination rank d, the tokens of this routing [T, k] the move kernel stages for d,
    in position order: every token with a slot on one of d's experts, ascending (the route's
    tok_pos numbers them in token order)."""
    idx = np.asarray(topk_idx)
    owner = np.where(idx >= 0, idx // (num_experts // world), -1)
    return [np.flatnonzero((owner == d).any(axis=1)).astype(np.int32) for d in range(world)]


@dataclass(frozen=True)
class PackedNode:
    """One other node's packed block as the kernels lay it out."""

    index: list     # per node rank q: [n_q] int32, the packed row of position pos of q's block
    sources: list   # per packed row p: (q, pos), the position whose row epserve_dedup_pack stores there
    rows: int       # packed rows: the distinct tokens the node's ranks take


def pack_node(tokens_of: list, max_tokens: int) -> PackedNode:
    """The arithmetic of epserve_dedup_mark and epserve_dedup_pack for one other node whose rank q
    takes tokens_of[q] (its staging block's token numbers, by position): a 32-token word bit set
    per rank, their union, the union's exclusive popcount before each word (base), then for
    (q, pos) with token t the packed index base[t / 32] + popcount(union[t / 32] below bit t % 32),
    and the row stored by the lowest q that takes t."""
    words = (max_tokens + 31) // 32
    masks = np.zeros((len(tokens_of), words), np.uint64)  # u32 values; u64 keeps the shifts plain
    for q, tokens in enumerate(tokens_of):
        for t in map(int, tokens):
            masks[q, t >> 5] |= np.uint64(1 << (t & 31))
    union = np.bitwise_or.reduce(masks, axis=0) if len(tokens_of) else np.zeros(words, np.uint64)
    popcount = np.array([bin(int(u)).count("1") for u in union], np.int64)
    base = np.concatenate([[0], np.cumsum(popcount)[:-1]]) if words else popcount
    index, sources = [], {}
    for q, tokens in enumerate(tokens_of):
        mine = np.zeros(len(tokens), np.int32)
        for pos, t in enumerate(map(int, tokens)):
            w, bit = t >> 5, 1 << (t & 31)
            p = int(base[w]) + bin(int(union[w]) & (bit - 1)).count("1")
            mine[pos] = p
            if not any(int(masks[e, w]) & bit for e in range(q)):
                assert p not in sources, (p, q, pos)  # each packed row stored once
                sources[p] = (q, pos)
        index.append(mine)
    return PackedNode(index, [sources[p] for p in range(len(sources))], int(popcount.sum()))


@dataclass(frozen=True)
class NetworkBytes:
    """What the rail transfers of one dispatch carry, all senders together, with one row per
    destination rank (the relay) and one per destination node (deduplication): the routed rows
    (rows, routing, and with deduplication the index) and the capacity blocks that cross today."""

    per_rank_routed: int
    packed_routed: int
    per_rank_capacity: int
    packed_capacity: int

    def saved(self, routed: bool) -> float:
        """The fraction of the bytes deduplication saves (routed rows, or capacity blocks)."""
        a, b = (self.per_rank_routed, self.packed_routed) if routed else (self.per_rank_capacity,
                                                                          self.packed_capacity)
        return 1.0 - b / a if a else 0.0

    def line(self) -> str:
        return (f"routed rows {self.per_rank_routed} B per rank -> {self.packed_routed} B per node "
                f"({100 * self.saved(True):.1f}% saved); capacity blocks {self.per_rank_capacity} B -> "
                f"{self.packed_capacity} B ({100 * self.saved(False):.1f}% saved)")


def network_bytes(routing: list, layout, num_experts: int, top_k: int, hidden: int, max_tokens: int) -> NetworkBytes:
    """The rail transfers' bytes for `routing` (every rank's topk_idx [T_r, k]) on `layout` (a
    NodeLayout), rows of `hidden` 2-byte units (the dispatch row's width)."""
    from epserve.comm.off_node import OffNodePlan
    from epserve.comm.off_node_dedup import DedupPlan
    from epserve.comm.off_node_relay import RelayPlan

    W, R = layout.world, layout.ranks_per_node
    row, meta = hidden * 2, (1 + 2 * top_k) * 4
    per_rank = packed = per_rank_cap = packed_cap = 0
    for s, idx in enumerate(routing):
        relay = RelayPlan(OffNodePlan(layout, s, num_experts, top_k, hidden, hidden, max_tokens))
        staged = staged_tokens(idx, num_experts, W)
        for c in relay.other_nodes:
            node = staged[c * R:(c + 1) * R]
            n = sum(len(t) for t in node)
            distinct = len(np.unique(np.concatenate(node))) if n else 0
            per_rank += n * (row + meta)
            packed += distinct * row + n * (meta + 4)
        per_rank_cap += len(relay.other_nodes) * R * relay.block_bytes
        packed_cap += DedupPlan(relay).blocks_bytes
    return NetworkBytes(per_rank, packed, per_rank_cap, packed_cap)
