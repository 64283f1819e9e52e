"""Random layer cases for the fuzz job (launch/jobs/fuzz.py), on the CPU.

A case is a pure function of (seed, index) and the world size, so every rank of a job builds
the same one with no message, and a failing case replays alone from the three numbers its
replay command carries. Sizes lean small (log-uniform, under a work budget) so that a case
costs well under a second, inputs and float64 reference included; the edges the kernels must
survive still come up: k from 1 to 8, a rank with no tokens, masked slots, experts that get
nothing, a whole rank that receives nothing, skewed routing; and FP8 experts
(MoEConfig.expert_dtype "fp8", hidden and intermediate then rounded up to 128), drawn last
so that every bf16 case of a seed keeps the sizes and data it had before FP8 existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from epserve.check.testing import LayerInputs, layer_inputs
from epserve.config import FP8_BLOCK, KERNEL_TILE, MoEConfig

MAX_TOP_K = 8
HIDDEN_CAP = 7168  # DeepSeek-V3's hidden size
INTERMEDIATE_CAP = 4096
MAX_TOKENS = 512  # per rank
# The smallest per-case bound on a rank's tokens: counts of 0..16 stay common, and most cases
# still give the GEMM's experts more than one row tile.
MIN_TOKEN_CAP = 16
MAX_EXPERTS_PER_RANK = 16
# Every expert's weights together, in elements (E * 3 * H * I): what each rank draws for all
# ranks and the reference holds in float64 (64 MiB at this bound).
WEIGHT_BUDGET = 1 << 23
# Routed rows times H * I: the float64 reference's GEMM work is 6 times this in flops.
ROW_WORK_BUDGET = 1 << 31
# A case that hangs must fail in seconds, not stall the whole run.
WAIT_TIMEOUT_S = 10.0

# How often each edge comes up, per case.
P_ZIPF = 0.5
P_MASKED = 0.5
P_ALL_MASKED = 0.05  # of the masked cases
P_EXPERT_SUBSET = 0.25
P_IDLE_RANK = 0.2
P_EMPTY_RANK = 0.15
P_SPARE_CAPACITY = 0.5
P_FP8 = 0.3


@dataclass(frozen=True)
class FuzzCase:
    seed: int
    index: int
    world_size: int
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    tokens: tuple[int, ...]  # per rank; 0 is allowed
    max_tokens_per_rank: int  # >= max(tokens): the service may have room to spare
    zipf: float  # 0: uniform routing; else the exponent of a Zipf law over the experts
    unused: float  # fraction of slots masked with -1
    experts: tuple[int, ...] | None  # the only experts routed to; None: all of them
    data_seed: int  # the seed of the inputs' values
    expert_dtype: str = "bf16"

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def idle_ranks(self) -> tuple[int, ...]:
        """Ranks owning none of the experts routed to: they receive no row at all."""
        if self.experts is None:
            return ()
        owners = {e // self.experts_per_rank for e in self.experts}
        return tuple(r for r in range(self.world_size) if r not in owners)

    def config(self) -> MoEConfig:
        return MoEConfig(self.num_experts, self.top_k, self.hidden, self.intermediate, self.max_tokens_per_rank,
                         world_size=self.world_size, wait_timeout_s=WAIT_TIMEOUT_S, expert_dtype=self.expert_dtype)

    def inputs(self) -> list[LayerInputs]:
        """Every rank's inputs, on the host."""
        return layer_inputs(self.data_seed, list(self.tokens), self.num_experts, self.top_k, self.hidden,
                            self.intermediate, zipf=self.zipf, unused=self.unused, experts=self.experts)

    def describe(self) -> str:
        routing = f"zipf {self.zipf:.2f}" if self.zipf else "uniform"
        experts = "all experts" if self.experts is None else f"{len(self.experts)} of {self.num_experts} experts"
        idle = f", idle ranks {list(self.idle_ranks)}" if self.idle_ranks else ""
        return (f"W={self.world_size} E={self.num_experts} k={self.top_k} H={self.hidden} I={self.intermediate} "
                f"tokens={list(self.tokens)} max_tokens={self.max_tokens_per_rank} {routing} "
                f"masked {self.unused:.2f} {experts}{idle} {self.expert_dtype}")

    def replay_command(self, share_gpu: bool = False) -> str:
        """The one line that runs this case alone, the way it ran (ranks on one GPU or not)."""
        launch = f"python launch/run.py -n {self.world_size}" + (" --share-gpu" if share_gpu else "")
        job = f"python -m mpi4py launch/jobs/fuzz.py --seed {self.seed} --start {self.index} --count 1"
        return f"{launch} -- {job}" + (" --share-gpu-ok" if share_gpu else "")


def generate(seed: int, index: int, world_size: int) -> FuzzCase:
    """Case `index` of the sequence `seed`, for `world_size` ranks."""
    rng = np.random.default_rng([seed, index])
    W = world_size
    top_k = int(rng.integers(1, MAX_TOP_K + 1))
    idle_rank = int(rng.integers(W)) if W > 1 and rng.random() < P_IDLE_RANK else None
    subset = rng.random() < P_EXPERT_SUBSET
    # Enough experts that k distinct ones can be drawn from the pool, and, with a subset,
    # that the pool can leave at least one out.
    owning_ranks = W - (idle_rank is not None)
    e_loc_min = math.ceil((top_k + subset) / owning_ranks)
    hidden, intermediate, e_loc = _sizes(rng, W, e_loc_min)
    E = W * e_loc

    pool = [e for e in range(E) if idle_rank is None or e // e_loc != idle_rank]
    if subset:
        size = int(rng.integers(top_k, len(pool)))  # at least one expert of the pool left out
        pool = sorted(int(e) for e in rng.choice(pool, size, replace=False))
    experts = None if len(pool) == E else tuple(pool)

    tokens = _token_counts(rng, W, top_k, hidden, intermediate)
    spare = int(rng.integers(1, 65)) if rng.random() < P_SPARE_CAPACITY else 0
    zipf = float(rng.uniform(0.5, 2.5)) if rng.random() < P_ZIPF else 0.0
    unused = 0.0
    if rng.random() < P_MASKED:
        unused = 1.0 if rng.random() < P_ALL_MASKED else float(rng.uniform(0.02, 0.5))
    data_seed = int(rng.integers(2**63))
    expert_dtype = "bf16"
    if rng.random() < P_FP8:  # last, see the module docstring; past the budget it stays bf16
        up = (-(-hidden // FP8_BLOCK) * FP8_BLOCK, -(-intermediate // FP8_BLOCK) * FP8_BLOCK)
        if W * e_loc * 3 * up[0] * up[1] <= WEIGHT_BUDGET:
            (hidden, intermediate), expert_dtype = up, "fp8"
    return FuzzCase(seed=seed, index=index, world_size=W, num_experts=E, top_k=top_k, hidden=hidden,
                    intermediate=intermediate, tokens=tokens, max_tokens_per_rank=max(1, max(tokens)) + spare,
                    zipf=zipf, unused=unused, experts=experts, data_seed=data_seed, expert_dtype=expert_dtype)


def _log_uniform_int(rng, low: int, high: int) -> int:
    """An integer in [low, high], its logarithm uniform: small values as likely per octave."""
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def _sizes(rng, world_size: int, e_loc_min: int) -> tuple[int, int, int]:
    """(hidden, intermediate, experts per rank) within WEIGHT_BUDGET, by rejection, so the
    sizes that fit keep their log-uniform odds. The smallest draw always fits, so it ends."""
    while True:
        hidden = KERNEL_TILE * _log_uniform_int(rng, 1, HIDDEN_CAP // KERNEL_TILE)
        intermediate = KERNEL_TILE * _log_uniform_int(rng, 1, INTERMEDIATE_CAP // KERNEL_TILE)
        e_loc = _log_uniform_int(rng, e_loc_min, max(e_loc_min, MAX_EXPERTS_PER_RANK))
        if world_size * e_loc * 3 * hidden * intermediate <= WEIGHT_BUDGET:
            return hidden, intermediate, e_loc


def _token_counts(rng, world_size: int, top_k: int, hidden: int, intermediate: int) -> tuple[int, ...]:
    """Per rank 0..cap tokens (cap log-uniform), each rank its own count, sometimes one rank
    with none; halved until the routed rows fit ROW_WORK_BUDGET."""
    cap = _log_uniform_int(rng, MIN_TOKEN_CAP, MAX_TOKENS)
    tokens = rng.integers(0, cap + 1, size=world_size)
    if rng.random() < P_EMPTY_RANK:
        tokens[rng.integers(world_size)] = 0
    while int(tokens.sum()) * top_k * hidden * intermediate > ROW_WORK_BUDGET:
        tokens //= 2
    return tuple(int(t) for t in tokens)
