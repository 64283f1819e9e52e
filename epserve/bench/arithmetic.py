"""What one MoE layer must compute and move, and so the fastest it could possibly run.

Everything is per rank r of W ranks, from every rank's routing (count_routing). Symbols:

    T_r      tokens of rank r
    M_r      rows rank r receives (dispatched rows): used slots routed to its experts
    E_r      local experts of rank r that receive at least one row
    H, I     hidden and expert intermediate sizes; k slots per token
    S[s, d]  used slots of rank s's tokens whose expert rank d owns  (M_d = sum_s S[s, d])
    D[s, d]  tokens of rank s with at least one slot on rank d

Elements are bf16, 2 bytes. Units are FLOPs, bytes and seconds. Rates come in as arguments,
measured in the same run on the same machine; the DESIGN_* constants below are the numbers
docs/design.md ("Numbers to design against") lists, for documentation and tests, never a
measurement.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from epserve.errors import ConfigError

BF16_BYTES = 2

# docs/design.md, "Numbers to design against": 2 x H200, NVLink 18 links, measured 2026-11-29.
DESIGN_DENSE_GEMM_FLOP_S = 780e12      # cuBLAS bf16 GEMM 8192^3: 770-790 TFLOP/s
DESIGN_GROUPED_GEMM_FLOP_S = 466e12    # cuBLAS-class grouped down projection, M = 32k rows
DESIGN_COPY_BYTES_S = 4.0e12           # local device copy, read + write: 3.8-4.3 TB/s
DESIGN_PEER_STORE_BYTES_S = 370e9      # peer stores over NVLink from a copy kernel, per direction
DESIGN_MEMCPY_PEER_BYTES_S = 395e9     # cudaMemcpyPeer

BINDING_TERMS = ("gemm", "hbm", "nvlink")


@dataclasses.dataclass(frozen=True)
class Rates:
    """One GPU's limits, measured in the run they are used in: bf16 GEMM FLOP/s, local HBM
    copy bytes/s (reads and writes both counted) and peer-store bytes/s in one direction."""

    gemm_flop_s: float
    copy_bytes_s: float
    peer_bytes_s: float

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if (not isinstance(value, numbers.Real) or isinstance(value, bool)
                    or not math.isfinite(value) or value <= 0):
                raise ConfigError(f"Rates.{field.name} = {value!r} must be a finite rate > 0")


@dataclasses.dataclass(frozen=True, eq=False)
class RoutingCounts:
    """The counts every formula here needs (symbols as in the module docstring)."""

    top_k: int
    experts_per_rank: int
    tokens: np.ndarray             # int64 [W]     T_r
    slots: np.ndarray              # int64 [W, W]  S[s, d]
    token_dests: np.ndarray        # int64 [W, W]  D[s, d]
    experts_with_rows: np.ndarray  # int64 [W]     E_r

    @property
    def world_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def rows(self) -> np.ndarray:
        """M_r = sum_s S[s, r]."""
        return self.slots.sum(axis=0)

    @property
    def used_slots(self) -> np.ndarray:
        """Used slots of rank r's tokens: sum_d S[r, d]."""
        return self.slots.sum(axis=1)


def count_routing(topk_idx_all, num_experts: int) -> RoutingCounts:
    """RoutingCounts from every rank's topk_idx (a list of W integer arrays [T_r, k], global
    expert ids, -1 for an unused slot); rank d owns experts [d * E / W, (d + 1) * E / W)."""
    world = len(topk_idx_all)
    if world < 1 or num_experts % world:
        raise ConfigError(f"{num_experts} experts cannot be split evenly over {world} ranks")
    per_rank = num_experts // world
    routings = [np.asarray(idx) for idx in topk_idx_all]
    top_k = {idx.shape[1] for idx in routings if idx.ndim == 2}
    if any(idx.ndim != 2 for idx in routings) or len(top_k) != 1:
        raise ConfigError(f"every rank's topk_idx must be [T, k] with one k, got shapes "
                          f"{[idx.shape for idx in routings]}")
    slots = np.zeros((world, world), np.int64)
    token_dests = np.zeros((world, world), np.int64)
    rows_per_expert = np.zeros(num_experts, np.int64)
    for s, idx in enumerate(routings):
        if idx.size and (idx.min() < -1 or idx.max() >= num_experts):
            raise ConfigError(f"rank {s}'s topk_idx holds an expert id outside [-1, {num_experts})")
        token, _ = np.nonzero(idx >= 0)
        expert = idx[idx >= 0].astype(np.int64)
        dest = expert // per_rank
        slots[s] = np.bincount(dest, minlength=world)
        hit = np.zeros((idx.shape[0], world), bool)
        hit[token, dest] = True
        token_dests[s] = hit.sum(axis=0)
        rows_per_expert += np.bincount(expert, minlength=num_experts)
    return RoutingCounts(
        top_k=top_k.pop(),
        experts_per_rank=per_rank,
        tokens=np.array([idx.shape[0] for idx in routings], np.int64),
        slots=slots,
        token_dests=token_dests,
        experts_with_rows=(rows_per_expert.reshape(world, per_rank) > 0).sum(axis=1),
    )


def gemm1_flops(rows, hidden, intermediate):
    """GEMM 1 (gate and up projections): 2 * M * H * 2I."""
    return 2 * rows * hidden * 2 * intermediate


def gemm2_flops(rows, hidden, intermediate):
    """GEMM 2 (down projection): 2 * M * I * H."""
    return 2 * rows * intermediate * hidden


def expert_ffn_flops(rows, hidden, intermediate):
    """The expert FFN, GEMM 1 + GEMM 2: 6 * M * H * I. The SwiGLU's few FLOPs per element of
    [M, I] are left out: under 0.1% of the total for H >= 1024."""
    return gemm1_flops(rows, hidden, intermediate) + gemm2_flops(rows, hidden, intermediate)


def gemm1_hbm_bytes(rows, experts_with_rows, hidden, intermediate):
    """Bytes GEMM 1 with SwiGLU fused must move through HBM at least once:
    2 * (E_r*2I*H + M*H + M*I), that is w13 of the experts that have rows, the dispatched
    rows read and the activations written ([M, 2I] is never stored)."""
    return BF16_BYTES * (experts_with_rows * 2 * intermediate * hidden + rows * hidden + rows * intermediate)


def gemm2_hbm_bytes(rows, experts_with_rows, hidden, intermediate):
    """Bytes GEMM 2 must move through HBM at least once: 2 * (E_r*H*I + M*I + M*H), that is
    the weights of the experts that have rows (an expert with none is never read), the
    activations read and the outputs written."""
    return BF16_BYTES * (experts_with_rows * hidden * intermediate + rows * intermediate + rows * hidden)


def layer_hbm_bytes(tokens, rows, experts_with_rows, hidden, intermediate):
    """Bytes the whole layer must move through HBM at least once, each array counted once:
    2 * (T*H + M*H + E_r*3*H*I + M*I + M*H + T*H), that is the tokens read for the dispatch,
    the dispatched rows, w13 and w2 of the experts that have rows, the activations, GEMM 2's
    outputs (landing in the recv slots) and the reduced output. GEMM 1's [M, 2I] result is
    taken as fused with the activation, never stored."""
    return BF16_BYTES * (2 * tokens * hidden + 2 * rows * hidden + rows * intermediate
                         + experts_with_rows * 3 * hidden * intermediate)


@dataclasses.dataclass(frozen=True, eq=False)
class LinkBytes:
    """NVLink bytes each rank sends and receives (int64 [W] each). A rank's link carries both
    directions at once, so the busier direction is what takes time."""

    sent: np.ndarray
    received: np.ndarray

    @property
    def per_rank(self) -> np.ndarray:
        """Bytes on rank r's busier direction: max(sent_r, received_r)."""
        return np.maximum(self.sent, self.received)

    @property
    def busiest(self) -> int:
        """Bytes on the busiest direction of any rank's link: what bounds the time."""
        return int(self.per_rank.max())

    @property
    def total(self) -> int:
        """Bytes crossing NVLink over all ranks."""
        return int(self.sent.sum())

    def __add__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.sent + other.sent, self.received + other.received)


def _link_bytes(matrix, hidden) -> LinkBytes:
    """matrix[s, d] rows from rank s to rank d, rows of H bf16 elements; rows that stay on
    their own rank (the diagonal) never touch NVLink."""
    remote = matrix - np.diag(np.diag(matrix))
    return LinkBytes(sent=remote.sum(axis=1) * hidden * BF16_BYTES,
                     received=remote.sum(axis=0) * hidden * BF16_BYTES)


def combine_nvlink_bytes(counts: RoutingCounts, hidden) -> LinkBytes:
    """The per-slot combine: every row computed on rank d for a token of rank s != d goes
    home once, so rank d sends sum_{s != d} S[s, d] * H * 2 bytes."""
    return _link_bytes(counts.slots.T, hidden)


def dispatch_nvlink_bytes(counts: RoutingCounts, hidden, dedup: bool = True) -> LinkBytes:
    """The dispatch. Deduplicated (dedup=True): rank s sends a token to rank d != s once,
    however many of its slots d owns: sum_{d != s} D[s, d] * H * 2 bytes. Per slot
    (dedup=False, the NCCL all-to-all baseline): sum_{d != s} S[s, d] * H * 2 bytes."""
    return _link_bytes(counts.token_dests if dedup else counts.slots, hidden)


@dataclasses.dataclass(frozen=True)
class Floor:
    """The fastest a path could run: its slowest term, `binding`; `terms` holds every
    term's seconds on its slowest rank."""

    seconds: float
    binding: str
    terms: dict


def floor(flops, hbm_bytes, nvlink_bytes, rates: Rates) -> Floor:
    """max(FLOPs / gemm_flop_s, HBM bytes / copy_bytes_s, NVLink bytes / peer_bytes_s).
    Each argument is a number or a per-rank array (NVLink bytes on each rank's busier
    direction); a per-rank term takes its slowest rank, since the layer waits for it."""
    terms = {
        "gemm": float(np.max(flops)) / rates.gemm_flop_s,
        "hbm": float(np.max(hbm_bytes)) / rates.copy_bytes_s,
        "nvlink": float(np.max(nvlink_bytes)) / rates.peer_bytes_s,
    }
    binding = max(BINDING_TERMS, key=terms.__getitem__)
    return Floor(terms[binding], binding, terms)


@dataclasses.dataclass(frozen=True, eq=False)
class Work:
    """What a path must do on each rank (int64 [W] each, nvlink as LinkBytes)."""

    flops: np.ndarray
    hbm_bytes: np.ndarray
    nvlink: LinkBytes

    @property
    def flops_per_gpu(self) -> float:
        """The layer's FLOPs spread over its GPUs: what TFLOP/s per GPU is counted from, so
        that a skewed routing's idle ranks show as lost throughput."""
        return float(self.flops.mean())

    def floor(self, rates: Rates) -> Floor:
        return floor(self.flops, self.hbm_bytes, self.nvlink.per_rank, rates)


def gemm1_work(counts: RoutingCounts, hidden, intermediate) -> Work:
    """GEMM 1 with SwiGLU in its epilogue, on this GPU alone."""
    world = counts.world_size
    return Work(gemm1_flops(counts.rows, hidden, intermediate),
                gemm1_hbm_bytes(counts.rows, counts.experts_with_rows, hidden, intermediate),
                LinkBytes(np.zeros(world, np.int64), np.zeros(world, np.int64)))


def gemm2_work(counts: RoutingCounts, hidden, intermediate) -> Work:
    """GEMM 2 alone, storing its outputs locally (the null sink)."""
    world = counts.world_size
    return Work(gemm2_flops(counts.rows, hidden, intermediate),
                gemm2_hbm_bytes(counts.rows, counts.experts_with_rows, hidden, intermediate),
                LinkBytes(np.zeros(world, np.int64), np.zeros(world, np.int64)))


def gemm2_combine_work(counts: RoutingCounts, hidden, intermediate) -> Work:
    """GEMM 2 and the per-slot combine, as the fused and unfused paths do it."""
    return dataclasses.replace(gemm2_work(counts, hidden, intermediate),
                               nvlink=combine_nvlink_bytes(counts, hidden))


def layer_work(counts: RoutingCounts, hidden, intermediate, dedup_dispatch: bool = True) -> Work:
    """The whole layer: dispatch, expert FFN, per-slot combine, reduction."""
    return Work(expert_ffn_flops(counts.rows, hidden, intermediate),
                layer_hbm_bytes(counts.tokens, counts.rows, counts.experts_with_rows, hidden, intermediate),
                dispatch_nvlink_bytes(counts, hidden, dedup_dispatch) + combine_nvlink_bytes(counts, hidden))


def mma_row_fraction(rows_per_expert, tile_rows: int = 128, tail_step: int = 16) -> float:
    """The share of the grouped GEMM's MMA rows that are real rows: each expert's rows go in
    tile_rows-row tiles, and its last, partial tile costs its rows rounded up to tail_step
    (the wgmma GEMM swaps A and B for it, so its rows are the wgmma's N, in steps of 16;
    tail_step = tile_rows counts whole tiles). 1.0 when no expert has rows."""
    rows = np.asarray(rows_per_expert, np.int64)
    tail = rows % tile_rows
    tail_cost = -(-tail // tail_step) * tail_step
    cost = (rows - tail) + tail_cost
    return float(rows.sum() / cost.sum()) if cost.sum() else 1.0


def x_floor(path_seconds, floor_seconds):
    """How many times the floor a path took: path time / floor (1.0 is perfect)."""
    return path_seconds / floor_seconds


def speedup(baseline_seconds, path_seconds):
    """baseline time / path time (above 1: the path is faster)."""
    return baseline_seconds / path_seconds


def tflop_per_s(flops, seconds):
    return flops / seconds / 1e12


def gb_per_s(nbytes, seconds):
    return nbytes / seconds / 1e9
