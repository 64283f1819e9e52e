"""The off-node transfers' true sizes (issue 15, step 1; docs/design.md, "Across nodes"): the
opt-in mode EPSERVE_OFFNODE_SIZES=host, in which the host reads the count rows once per
dispatch and the carrier moves only the routed rows, not capacity blocks.

Pure arithmetic, the same on every rank (tests/cpu/test_off_node_sizes.py), from the count
rows a rank holds after the off-node count exchange: its own row and the rows of the other
nodes' ranks (both on its stream; the rows of its own node's ranks arrive by IPC at any time
and are not read here). A count row (cuda/comm/dispatch_route.cuh) holds E rows per expert,
W token rows per destination rank, then an error code; a row with an error code counts as
empty. Every size comes from one rank's row, which the sender and the receiver hold alike,
so both ends of every transfer agree, whatever the call's verdict.

Dispatch: this rank's token rows for an off-node rank d already lie dense at the start of
d's staging block (positions tok_pos, in token order), so only their number changes: the
count row's entry E + d. The routing beside them likewise.

Combine, the compact return block from owner o to home h: the rows o served for h, in o's
row order (expert-major, then h's (token, slot) order), so row (e, r) of h's rows for local
expert e (r: the slot's rank among them, route's slot_rank) is at

    q = sum over e' < e of count_h[o * E_loc + e'] + r

Both ends compute it from h's count row: the owner from h's row in its table (ret_base,
a segmented exclusive scan), the home from its own row (home_base) and its slot_rank.
The owner's peer sink is handed src_info with q written as a slot (q // k, q % k) for the
rows bound off-node (return_src_info), so it stores each at row q of the home's block with
no change to the sink; the home's land kernel reads row q of the owner's landing block into
recv slot (t, j). Kernels: epserve_off_node_return_slots, epserve_off_node_combine_land_compact
(cuda/comm/staging.cu).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from epserve.comm.settings import agree_across_nodes, env_choice

SIZES_ENV = "EPSERVE_OFFNODE_SIZES"
SIZES = ("capacity", "host")  # capacity: fixed blocks, no host wait (the default); host: the true sizes


def sizes_name() -> str:
    """EPSERVE_OFFNODE_SIZES, "capacity" when unset or empty."""
    return env_choice(SIZES_ENV, SIZES, f"the off-node sizes are one of {SIZES} (capacity: fixed blocks, "
                      "capturable; host: the routed rows only, one host wait per dispatch)")


def agree_sizes(comm, nodes: int) -> str | None:
    """Collective, at setup, before any CUDA call: None on one node, else the sizes mode
    EPSERVE_OFFNODE_SIZES names, the same on every rank, or ConfigError on every rank."""
    return agree_across_nodes(comm, nodes, sizes_name, SIZES_ENV, "off-node sizes")


@dataclass(frozen=True)
class OffNodeSizes:
    """One call's off-node row counts of one rank, by off-node peer rank."""

    tokens_to: dict    # token rows (and routing entries) the dispatch sends to off-node rank d
    tokens_from: dict  # ... receives from off-node rank s
    returns_to: dict   # combine rows this rank, as expert owner, sends home to off-node rank h
    returns_from: dict  # combine rows this rank, as home, receives from off-node owner o


def count_row(table: np.ndarray, s: int) -> np.ndarray:
    """Count row s, all zeros when it carries an error code (the kernels publish zeros then)."""
    row = table[s]
    return np.zeros_like(row) if row[-1] != 0 else row


def clamp(v, hi: int) -> int:
    """A count from a row, within [0, hi]: both ends of a transfer clamp alike."""
    return int(min(max(int(v), 0), hi))


def sizes_from_count_rows(table: np.ndarray, rank: int, peers, num_experts: int, max_tokens: int,
                          top_k: int) -> OffNodeSizes:
    """The sizes from this rank's count table [W][E + W + 1] (only its own row and the rows
    of `peers`, the off-node ranks, are read). Clamped to the blocks' capacity, so that even
    a corrupt row cannot make a transfer overrun a block; both ends clamp alike."""
    W = table.shape[0]
    E, e_loc = num_experts, num_experts // W
    if table.shape != (W, E + W + 1):
        raise ValueError(f"count table of shape {table.shape}, expected {(W, E + W + 1)}")
    mine = count_row(table, rank)
    rows = {s: count_row(table, s) for s in peers}
    cap = max_tokens * top_k
    return OffNodeSizes(
        tokens_to={d: clamp(mine[E + d], max_tokens) for d in peers},
        tokens_from={s: clamp(rows[s][E + rank], max_tokens) for s in peers},
        returns_to={h: clamp(rows[h][rank * e_loc:(rank + 1) * e_loc].clip(0).sum(), cap) for h in peers},
        returns_from={o: clamp(mine[o * e_loc:(o + 1) * e_loc].clip(0).sum(), cap) for o in peers})


# ---- the positions the kernels compute (reference for the tests; cuda/comm/staging.cu) -------
def segment_exclusive_scan(values: np.ndarray, segment: int) -> np.ndarray:
    """The exclusive prefix sums of `values` within consecutive segments of `segment` entries
    (segment_exclusive_scan in staging.cu)."""
    v = np.asarray(values, np.int64).reshape(-1, segment)
    return (np.cumsum(v, axis=1) - v).reshape(-1)


def owner_ret_base(table: np.ndarray, owner: int, num_experts: int) -> np.ndarray:
    """ret_base[s * E_loc + e]: where home s's rows for the owner's local expert e start in
    its return block (from s's count row)."""
    W = table.shape[0]
    e_loc = num_experts // W
    cols = np.stack([table[s, owner * e_loc:(owner + 1) * e_loc] for s in range(W)]).reshape(-1)
    return segment_exclusive_scan(cols, e_loc)


def home_base(my_row: np.ndarray, world: int, num_experts: int) -> np.ndarray:
    """home_base[e] (e a global expert id): where this rank's rows for expert e start in the
    return block of e's owner (from this rank's own count row)."""
    return segment_exclusive_scan(my_row[:num_experts], num_experts // world)


def return_src_info(source: int, q: int, top_k: int) -> int:
    """The src_info the owner's sink is given for a row bound off-node: the row's position q
    in its home's compact block, written as a slot (q // k, q % k)."""
    return (source << 24) | ((q // top_k) << 4) | (q % top_k)
