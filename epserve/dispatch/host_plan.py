"""The dispatch plan: which rows each rank sends and receives, and in what order.

The plan is a pure function of every rank's routing, so once topk_idx is allgathered each
rank can compute any rank's plan and all ranks agree without further messages, and every
run lays rows out identically (docs/design.md, "Dispatched rows").

src_info packing (int32; fixed, the CUDA side decodes the same bits):

    src_info = (src_rank << 24) | (token << 4) | slot

    bit  31      always 0, so the value is never negative
    bits 30..24  src_rank   < 128
    bits 23..4   token      < 2**20
    bits  3..0   slot       < 16

Three row orders appear below:

    send order     (on the sending rank)   destination rank, then its local expert, then
                                           token, then slot; that is, global expert id,
                                           then (token, slot)
    staging order  (on the receiving rank) source rank, then that source's send order
    dispatch order (on the receiving rank) local expert, then (source rank, token, slot)
"""

import numbers
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from epserve.errors import ConfigError, RankMismatchError

RANK_SHIFT = 24
TOKEN_SHIFT = 4
MAX_RANKS = 1 << 7
MAX_TOKENS = 1 << 20
MAX_SLOTS = 1 << 4


def pack_src_info(rank, token, slot):
    """Pack (source rank, token, slot), scalars or arrays of one shape, into int32 src_info."""
    fields = {"rank": (rank, MAX_RANKS), "token": (token, MAX_TOKENS), "slot": (slot, MAX_SLOTS)}
    packed = []
    for name, (value, limit) in fields.items():
        value = np.asarray(value, dtype=np.int64)
        outside = (value < 0) | (value >= limit)
        if outside.any():
            raise ConfigError(f"src_info cannot pack {name} {value[outside].flat[0]}: "
                              f"it must lie in [0, {limit})")
        packed.append(value)
    rank, token, slot = packed
    return ((rank << RANK_SHIFT) | (token << TOKEN_SHIFT) | slot).astype(np.int32)


def unpack_src_info(src_info):
    """Inverse of pack_src_info: int32 arrays (rank, token, slot)."""
    v = np.asarray(src_info, dtype=np.int32)
    return ((v >> RANK_SHIFT) & (MAX_RANKS - 1),
            (v >> TOKEN_SHIFT) & (MAX_TOKENS - 1),
            v & (MAX_SLOTS - 1))


@dataclass(frozen=True, eq=False)
class DispatchPlan:
    """One rank's share of the dispatch: M rows received, S rows sent, W ranks.

    Receiver side (rows this rank computes, in dispatch order):
      expert_offsets   int32 [E_loc+1]  local expert e owns rows [offsets[e], offsets[e+1])
      src_info         int32 [M]        where each row came from, packed as above
      recv_counts      int64 [W]        rows received from each source rank
      recv_displs      int64 [W]        where each source's block starts in staging order
      recv_perm        int32 [M]        staging index of each dispatched row
      combine_pack_idx int32 [M]        inverse of recv_perm: the dispatched row that goes
                                        to each staging position, to send results home in
                                        the order their inputs arrived
      recv_src_rank    int32 [M]        source rank of each dispatched row
      recv_src_pos     int32 [M]        the row's index in that source's whole send buffer,
                                        for a transport that pulls straight from peers
    Sender side (this rank's own tokens, in send order):
      send_counts      int64 [W]        rows sent to each destination rank, itself included
      send_displs      int64 [W]        exclusive prefix sum of send_counts
      send_token       int32 [S]        token of each sent row
      send_slot        int32 [S]        slot of each sent row
    """

    rank: int
    world_size: int
    experts_per_rank: int
    expert_offsets: np.ndarray
    src_info: np.ndarray
    recv_counts: np.ndarray
    recv_displs: np.ndarray
    recv_perm: np.ndarray
    combine_pack_idx: np.ndarray
    recv_src_rank: np.ndarray
    recv_src_pos: np.ndarray
    send_counts: np.ndarray
    send_displs: np.ndarray
    send_token: np.ndarray
    send_slot: np.ndarray

    @property
    def num_recv_rows(self):
        return int(self.src_info.shape[0])


def plan_dispatch(rank, topk_idx_all, num_experts, world_size):
    """Rank `rank`'s DispatchPlan from every rank's routing.

    topk_idx_all: list of W integer arrays [T_s, k] (T_s may differ, may be 0), global
    expert ids with -1 for an unused slot. Expert e is owned by rank e // (E / W).
    """
    routing = _checked_routing(topk_idx_all, num_experts, world_size)
    _check_rank(rank, world_size)
    experts_per_rank = num_experts // world_size
    orders = [_send_order(idx, experts_per_rank, world_size) for idx in routing]

    own = orders[rank]
    send_counts = np.diff(own.bounds)

    # What source s sends to this rank is one contiguous block of s's send order.
    blocks = [slice(order.bounds[rank], order.bounds[rank + 1]) for order in orders]
    recv_counts = np.array([block.stop - block.start for block in blocks], dtype=np.int64)
    stage_expert = np.concatenate([o.expert[b] for o, b in zip(orders, blocks)])
    stage_token = np.concatenate([o.token[b] for o, b in zip(orders, blocks)])
    stage_slot = np.concatenate([o.slot[b] for o, b in zip(orders, blocks)])
    stage_rank = np.repeat(np.arange(world_size), recv_counts)
    stage_pos = np.concatenate([np.arange(b.start, b.stop) for b in blocks])

    # Staging order is (source, expert, token, slot); a stable sort by expert turns it
    # into dispatch order (expert, source, token, slot).
    recv_perm = np.argsort(stage_expert, kind="stable")
    num_rows = recv_perm.shape[0]
    combine_pack_idx = np.empty_like(recv_perm)
    combine_pack_idx[recv_perm] = np.arange(num_rows)
    local_expert = stage_expert[recv_perm] - rank * experts_per_rank
    rows_per_expert = np.bincount(local_expert, minlength=experts_per_rank)

    return DispatchPlan(
        rank=rank,
        world_size=world_size,
        experts_per_rank=experts_per_rank,
        expert_offsets=_prefix_sums(rows_per_expert).astype(np.int32),
        src_info=pack_src_info(stage_rank[recv_perm], stage_token[recv_perm],
                               stage_slot[recv_perm]),
        recv_counts=recv_counts,
        recv_displs=_prefix_sums(recv_counts)[:-1],
        recv_perm=recv_perm.astype(np.int32),
        combine_pack_idx=combine_pack_idx.astype(np.int32),
        recv_src_rank=stage_rank[recv_perm].astype(np.int32),
        recv_src_pos=stage_pos[recv_perm].astype(np.int32),
        send_counts=send_counts,
        send_displs=own.bounds[:-1].copy(),
        send_token=own.token.astype(np.int32),
        send_slot=own.slot.astype(np.int32),
    )


def count_recv_rows(rank, topk_idx_all, num_experts, world_size):
    """How many rows `rank` receives, without building its plan."""
    routing = _checked_routing(topk_idx_all, num_experts, world_size)
    _check_rank(rank, world_size)
    first = rank * (num_experts // world_size)
    last = first + num_experts // world_size
    return int(sum(np.count_nonzero((idx >= first) & (idx < last)) for idx in routing))


def check_recv_capacity(rows_per_rank, capacity):
    """Raise ConfigError if some rank would receive more than `capacity` rows this call.

    rows_per_rank[d] is what rank d would receive. Every rank passes the same counts (both
    dispatches know every rank's), so every rank raises the same error, before any row moves.
    """
    over = [(d, int(m)) for d, m in enumerate(rows_per_rank) if m > capacity]
    if over:
        detail = ", ".join(f"rank {d} would receive {m} rows" for d, m in over)
        raise ConfigError(f"dispatch stopped before any row moved: {detail}, more than the receive capacity of "
                          f"{capacity} rows per rank (MoEConfig.max_recv_rows)")


class _SendOrder(NamedTuple):
    """One rank's used slots in send order, and each destination's block in it."""

    expert: np.ndarray  # int64 [S] global expert id
    token: np.ndarray   # int64 [S]
    slot: np.ndarray    # int64 [S]
    bounds: np.ndarray  # int64 [W+1]: destination d's block is [bounds[d], bounds[d+1])


def _send_order(topk_idx, experts_per_rank, world_size):
    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1)
    used = np.flatnonzero(flat >= 0)
    # Global expert id orders by (destination, local expert) at once; the stable sort keeps
    # the flat index, hence (token, slot), ascending inside each expert.
    order = used[np.argsort(flat[used], kind="stable")]
    expert = flat[order]
    bounds = np.searchsorted(expert, np.arange(world_size + 1) * experts_per_rank)
    return _SendOrder(expert, order // k, order % k, bounds.astype(np.int64))


def _prefix_sums(counts):
    """[0, c0, c0+c1, ..., total] as int64: n+1 boundaries for n counts."""
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])


def _check_rank(rank, world_size):
    if not isinstance(rank, numbers.Integral) or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank!r} is not a rank of a world of {world_size}: "
                          f"it must be an integer in [0, {world_size})")


def _checked_routing(topk_idx_all, num_experts, world_size):
    """Every rank's topk_idx as int64 arrays, after checking what the packing can hold."""
    if not isinstance(world_size, numbers.Integral) or not 1 <= world_size <= MAX_RANKS:
        raise ConfigError(f"world_size {world_size!r} is not allowed: src_info packs the "
                          f"source rank in 7 bits, so it must be an integer in [1, {MAX_RANKS}]")
    if (not isinstance(num_experts, numbers.Integral) or num_experts < 1
            or num_experts % world_size):
        raise ConfigError(f"num_experts {num_experts!r} is not allowed: it must be a positive "
                          f"multiple of world_size {world_size}")
    if len(topk_idx_all) != world_size:
        raise ConfigError(f"topk_idx_all holds the routing of {len(topk_idx_all)} ranks; "
                          f"expected one per rank, world_size = {world_size}")
    routing = []
    for src, idx in enumerate(topk_idx_all):
        idx = np.asarray(idx)
        if idx.ndim != 2 or idx.dtype.kind not in "iu":
            raise ConfigError(f"rank {src}'s topk_idx must be a 2-D integer array "
                              f"[tokens, top_k]; got shape {idx.shape}, dtype {idx.dtype}")
        num_tokens, top_k = idx.shape
        first_top_k = routing[0].shape[1] if routing else top_k
        if top_k != first_top_k:
            raise RankMismatchError(f"ranks disagree on top_k: rank 0's topk_idx has "
                                    f"{first_top_k} columns, rank {src}'s has {top_k}")
        if not 1 <= top_k <= MAX_SLOTS:
            raise ConfigError(f"top_k {top_k} is not allowed: src_info packs the slot in 4 "
                              f"bits, so it must lie in [1, {MAX_SLOTS}]")
        if num_tokens > MAX_TOKENS:
            raise ConfigError(f"rank {src} routes {num_tokens} tokens: src_info packs the "
                              f"token in 20 bits, so at most {MAX_TOKENS} tokens per rank")
        bad = np.argwhere((idx < -1) | (idx >= num_experts))
        if bad.size:
            t, j = bad[0]
            raise ConfigError(f"rank {src}'s topk_idx[{t}, {j}] = {idx[t, j]} is not an "
                              f"expert id: allowed are 0..{num_experts - 1}, or -1 for an "
                              f"unused slot")
        routing.append(idx.astype(np.int64))
    return routing
