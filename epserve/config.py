"""MoEConfig: the sizes one expert-parallel MoE layer is built for, checked once up front
(against the packing of src_info and the kernels' limits) so that a bad size fails here with
a clear message instead of deep inside a kernel, and check_agreement, which makes sure every
rank built the same one."""

import dataclasses
import math
import numbers

from epserve.dispatch.host_plan import MAX_SLOTS, MAX_TOKENS
from epserve.errors import ConfigError, RankMismatchError
from epserve.runtime.kernel_structs import MAX_EXPERTS, MAX_LOCAL_EXPERTS, MAX_PEERS, MAX_WORLD

# The GEMMs tile the hidden and intermediate dimensions by this many elements.
KERNEL_TILE = 64
# Expert weight formats; FP8 scales blocks of this many elements (128 x 128 for weights,
# 1 x 128 for activations), so its sizes must be multiples of it.
EXPERT_DTYPES = ("bf16", "fp8")
FP8_BLOCK = 128

_INT_FIELDS = ("num_experts", "top_k", "hidden", "intermediate", "max_tokens_per_rank",
               "world_size")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The sizes of one MoE layer served by ``world_size`` ranks; every rank builds the same one.

    num_experts          E, experts in all; rank r owns experts [r * E/W, (r + 1) * E/W).
                         A multiple of world_size, at most 1024, at most 512 per rank.
    top_k                k, experts each token is routed to (1..16, at most num_experts).
    hidden               H, the model dimension (x and the output are [T, H]); a multiple of 64.
    intermediate         I, each expert's FFN width (w13 is [E/W, 2I, H], w2 [E/W, H, I]);
                         a multiple of 64.
    max_tokens_per_rank  the most tokens T one rank passes to one call (up to 2**20); the
                         receive buffers are sized by it when the service starts.
    world_size           W, the number of ranks (1..128: src_info names the source rank in
                         7 bits); it must equal the communicator's size. A node (the ranks
                         that reach each other through CUDA IPC) holds at most 8 of them;
                         the rows for other nodes go by the off-node carrier
                         (docs/design.md, "Across nodes"), so more than 8 ranks need more
                         than one node (checked at setup, epserve/comm/topology.py).
    max_recv_rows        the most expert rows one rank may receive in one call; None means
                         the worst case, max_tokens_per_rank * W * min(k, E/W). A smaller
                         value saves memory; a call whose routing needs more raises
                         ConfigError on every rank before any row moves.
    wait_timeout_s       bound of every device-side wait for a peer, in seconds; a peer that
                         is later raises PeerTimeoutError naming it and the stage.
    expert_dtype         "bf16" (the default) or "fp8": e4m3 experts with 128 x 128 weight
                         scales and 1 x 128 activation scales (epserve.quantize_weights), which
                         need hidden and intermediate to be multiples of 128. EPService then
                         takes the FP8Weights as forward's w13 (w2 None); the dispatch still
                         moves bf16 rows (docs/design.md, "FP8 experts").

    Construction validates every field and raises ConfigError naming the first bad one.
    The config is frozen; ``to_dict()`` gives its fields as plain Python values.
    """

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    max_tokens_per_rank: int
    world_size: int = 1
    max_recv_rows: int | None = None
    wait_timeout_s: float = 30.0
    expert_dtype: str = "bf16"

    def __post_init__(self):
        self.validate()
        # Store plain Python numbers whatever the caller passed (NumPy scalars included), so
        # to_dict pickles small and error messages print values as the user wrote them.
        for name in _INT_FIELDS:
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.max_recv_rows is not None:
            object.__setattr__(self, "max_recv_rows", int(self.max_recv_rows))
        object.__setattr__(self, "wait_timeout_s", float(self.wait_timeout_s))

    @property
    def experts_per_rank(self):
        return self.num_experts // self.world_size

    @property
    def recv_rows_capacity(self):
        """Rows one rank may receive: max_recv_rows, or else the worst case, where every
        token of every rank sends each of its slots here, at most one per local expert."""
        if self.max_recv_rows is not None:
            return self.max_recv_rows
        return (self.max_tokens_per_rank * self.world_size
                * min(self.top_k, self.experts_per_rank))

    def validate(self):
        for name in _INT_FIELDS:
            _require_positive_int(name, getattr(self, name))
        if self.max_recv_rows is not None:
            _require_positive_int("max_recv_rows", self.max_recv_rows)
        _require_at_most("world_size", self.world_size, MAX_WORLD,
                         "src_info names the source rank in 7 bits; a node holds at most "
                         f"{MAX_PEERS} of them")
        _require_at_most("top_k", self.top_k, MAX_SLOTS, "src_info packs the slot in 4 bits")
        _require_at_most("max_tokens_per_rank", self.max_tokens_per_rank, MAX_TOKENS,
                         "src_info packs the token in 20 bits")
        if self.num_experts % self.world_size:
            raise ConfigError(f"MoEConfig.num_experts = {self.num_experts} is not allowed: it "
                              f"must be a multiple of world_size = {self.world_size}, so "
                              f"every rank owns the same number of experts")
        _require_at_most("num_experts", self.num_experts, MAX_EXPERTS,
                         "the dispatch counts every expert in shared memory")
        if self.experts_per_rank > MAX_LOCAL_EXPERTS:
            raise ConfigError(f"MoEConfig.num_experts = {self.num_experts} is not allowed with "
                              f"world_size = {self.world_size}: that is {self.experts_per_rank} "
                              f"experts per rank, and the grouped GEMM schedules at most "
                              f"{MAX_LOCAL_EXPERTS}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"MoEConfig.top_k = {self.top_k} is not allowed: it must be at "
                              f"most num_experts = {self.num_experts}")
        for name in ("hidden", "intermediate"):
            _require_multiple(name, getattr(self, name), KERNEL_TILE, "",
                              f"since the kernels tile it by {KERNEL_TILE}")
        if self.expert_dtype not in EXPERT_DTYPES:
            raise ConfigError(f"MoEConfig.expert_dtype = {self.expert_dtype!r} is not allowed: it "
                              f"must be one of {', '.join(map(repr, EXPERT_DTYPES))}")
        if self.expert_dtype == "fp8":
            for name in ("hidden", "intermediate"):
                _require_multiple(name, getattr(self, name), FP8_BLOCK, " with expert_dtype 'fp8'",
                                  "the FP8 scale block")
        timeout = self.wait_timeout_s
        if (not isinstance(timeout, numbers.Real) or isinstance(timeout, bool)
                or not math.isfinite(timeout) or timeout <= 0):
            raise ConfigError(f"MoEConfig.wait_timeout_s = {timeout!r} is not allowed: it must "
                              f"be a finite number of seconds > 0 (every device-side wait "
                              f"is bounded)")

    def to_dict(self):
        return dataclasses.asdict(self)


def check_agreement(cfg, comm):
    """Raise RankMismatchError, on every rank alike, unless all ranks of the mpi4py
    communicator `comm` hold the same config and its world_size is comm's size.
    Collective: every rank of comm must call it."""
    from epserve.comm.mpi import agree

    agree(comm, "MoEConfig", cfg.to_dict())
    # Checked after agreement, so that every rank sees the same world_size here.
    if cfg.world_size != comm.Get_size():
        raise RankMismatchError(f"MoEConfig.world_size = {cfg.world_size} but the communicator "
                                f"has {comm.Get_size()} ranks; they must be equal")


def _require_positive_int(name, value):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"MoEConfig.{name} = {value!r} is not allowed: it must be a "
                          f"positive integer")


def _require_multiple(name, value, multiple, context, reason):
    if value % multiple:
        raise ConfigError(f"MoEConfig.{name} = {value} is not allowed{context}: it must be a "
                          f"multiple of {multiple}, {reason}")


def _require_at_most(name, value, limit, reason):
    if value > limit:
        raise ConfigError(f"MoEConfig.{name} = {value} is not allowed: it must be at most "
                          f"{limit} ({reason})")
