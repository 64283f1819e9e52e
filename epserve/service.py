"""EPService: one object per rank that owns the communicators, the symmetric buffers and the
compiled modules, and serves MoE layer calls (DESIGN section 1).

    with EPService(MoEConfig(...)) as svc:
        out = svc.forward(x, topk_idx, topk_weights, w13, w2)          # fused (peer sink)

Work is enqueued on the caller's current CuPy stream. The host waits on the GPU once per
dispatch: after the device-side count exchange, to learn how many rows this rank receives
(the size of GEMM 1's output) and to stop every rank, before any row moves, when some rank's
routing would overflow a capacity or some rank's input is bad. Nothing else synchronizes,
except the baselines: NCCL dispatch and the unfused NCCL combine gather the routing on the
host, and the IPC copy transports (ranks sharing a GPU) wait for every rank between steps.

Each call is collective: every rank calls the same methods in the same order. A bad input
raises the same kind of error on every rank (the rank that holds it gets the detailed
message) and leaves the service usable.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy

from . import comm as ep_comm
from . import ops
from .arrays import BF16, checked_array
from .combine import Combiner
from .config import MoEConfig, check_agreement
from .device_plan import DevicePlan
from .direct_dispatch import DirectDispatcher, Dispatched
from .dispatch import Dispatcher
from .errors import ConfigError
from .layout import check_recv_capacity, count_recv_rows, plan_dispatch
from .nccl_transport import gpus_shared, make_nccl
from .peers import PeerGroup
from .signals import SignalBlock

SINKS = ("peer", "null")
DISPATCHES = ("direct", "nccl")


@dataclass
class DispatchResult(Dispatched):
    """Dispatched rows plus what the combine needs to bring them home."""

    topk_idx: cupy.ndarray = None
    topk_weights: cupy.ndarray = None
    plan: DevicePlan | None = None  # the host-side plan, when the baseline dispatch made one

    @property
    def num_tokens(self) -> int:
        return self.topk_idx.shape[0]


class EPService:
    def __init__(self, config: MoEConfig, comm=None, device=None):
        self.config = config
        self.comm = ep_comm.world(comm)
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        check_agreement(config, self.comm)  # needs no GPU: a mismatch is reported before any CUDA call
        self.device = ep_comm.select_device(self.comm, device)
        self._closed = False
        self.group = PeerGroup(self.comm)
        with ep_comm.checked(self.comm, "EPService setup"):
            self.shared_gpu = gpus_shared(self.comm)
            self.transport = "ipc" if self.shared_gpu else "nccl"
        self.nccl = None if self.shared_gpu else make_nccl(self.comm)
        c = config
        self.signals = SignalBlock.create(self.group)
        self.direct = DirectDispatcher(self.group, self.signals, num_experts=c.num_experts, top_k=c.top_k,
                                       hidden=c.hidden, max_tokens=c.max_tokens_per_rank,
                                       max_recv_rows=c.recv_rows_capacity, wait_timeout_s=c.wait_timeout_s, dtype=BF16)
        self.baseline = Dispatcher(self.group, c.hidden, c.max_tokens_per_rank * c.top_k, self.transport, self.nccl,
                                   BF16)
        self.combiner = Combiner(self.group, self.signals, num_experts=c.num_experts, top_k=c.top_k, hidden=c.hidden,
                                 max_tokens=c.max_tokens_per_rank, wait_timeout_s=c.wait_timeout_s,
                                 transport=self.transport, nccl_comm=self.nccl, dtype=BF16)
        cupy.cuda.runtime.deviceSynchronize()
        self.comm.Barrier()

    # ---- validation ---------------------------------------------------------------------
    def _tokens(self, x, topk_idx, topk_weights):
        c = self.config
        x = checked_array(x, "x", "bf16", (None, c.hidden))
        T = x.shape[0]
        if T > c.max_tokens_per_rank:
            raise ConfigError(f"x has {T} tokens, more than max_tokens_per_rank = {c.max_tokens_per_rank}")
        topk_idx = checked_array(topk_idx, "topk_idx", "int32", (T, c.top_k))
        topk_weights = checked_array(topk_weights, "topk_weights", "float32", (T, c.top_k))
        return x, topk_idx, topk_weights

    def _weights(self, w13, w2):
        c = self.config
        w13 = checked_array(w13, "w13", "bf16", (c.experts_per_rank, 2 * c.intermediate, c.hidden))
        w2 = checked_array(w2, "w2", "bf16", (c.experts_per_rank, c.hidden, c.intermediate))
        return w13, w2

    @staticmethod
    def _check_sink(sink):
        if sink not in SINKS:
            raise ConfigError(f"sink must be one of {SINKS}, got {sink!r}")

    # ---- the layer ----------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights, transport: str = "direct") -> DispatchResult:
        """Token rows to the ranks owning their experts, expert-contiguous there.

        transport "direct": each row crosses to a rank at most once, by IPC stores, expanded on
        arrival (one host wait, see the module docstring). "nccl": the baseline, planned on the
        host from the gathered routing; the IPC pull stands in where ranks share a GPU.
        Both give bitwise identical rows, offsets and src_info."""
        if transport not in DISPATCHES:
            raise ConfigError(f"dispatch transport must be one of {DISPATCHES}, got {transport!r}")
        error = None
        try:
            x, topk_idx, topk_weights = self._tokens(x, topk_idx, topk_weights)
        except ConfigError as exc:
            error = exc
        if transport == "direct":
            d = self.direct.dispatch(x, topk_idx, error)
            return DispatchResult(d.rows, d.expert_offsets, d.src_info, d.num_rows, topk_idx, topk_weights)
        ep_comm.collective_verdict(self.comm, "dispatch input", error)
        plan = self._host_plan(topk_idx)
        rows = self.baseline.dispatch(x, plan)
        return DispatchResult(rows, plan.expert_offsets, plan.src_info, plan.num_recv_rows, topk_idx, topk_weights,
                              plan)

    def _host_plan(self, topk_idx) -> DevicePlan:
        c = self.config
        routing = self.comm.allgather(cupy.asnumpy(topk_idx))
        # Every rank has every routing, so every rank reaches the same verdict.
        check_recv_capacity([count_recv_rows(d, routing, c.num_experts, self.world) for d in range(self.world)],
                            c.recv_rows_capacity)
        return DevicePlan.upload(plan_dispatch(self.rank, routing, c.num_experts, self.world), c.top_k)

    def expert_ffn(self, dispatched: DispatchResult, w13, w2, sink: str = "peer", out=None, gate: int = 0):
        """GEMM 1, SwiGLU and GEMM 2 over the dispatched rows; GEMM 2's epilogue hands its tiles
        to `sink`: "peer" writes them into their home ranks' recv (no C exists), "null" stores
        C and the baseline transport moves it. Returns the combined [T, H] output of this
        rank's tokens. gate < 0 runs GEMM 2 with the peer sink silenced and returns None
        (the math alone, for measurement)."""
        w13, w2, out = self._checked_ffn_inputs(sink, w13, w2, out, dispatched.num_tokens, "expert_ffn input")
        return self._expert_ffn(dispatched, w13, w2, sink, out, gate)

    def _checked_ffn_inputs(self, sink, w13, w2, out, tokens, stage):
        """Collective: every rank raises if any rank's weights, sink or out are bad."""
        error = None
        try:
            self._check_sink(sink)
            w13, w2 = self._weights(w13, w2)
            if out is not None:
                out = checked_array(out, "out", "bf16", (tokens, self.config.hidden))
        except ConfigError as exc:
            error = exc
        ep_comm.collective_verdict(self.comm, stage, error)
        return w13, w2, out

    def _expert_ffn(self, d: DispatchResult, w13, w2, sink, out, gate):
        c = self.config
        M, I, H, e_loc = d.num_rows, c.intermediate, c.hidden, c.experts_per_rank
        act = cupy.empty((M, I), BF16)
        ops.gemm1_swiglu(d.rows, w13, act, d.expert_offsets, e_loc, I, H)
        comb = self.combiner
        if gate < 0:
            comb.gemm_only(act, w2, self._send_plan(d), I)
            return None
        if sink == "peer":
            out = comb.fused(act, w2, self._send_plan(d), d.topk_idx, d.topk_weights, I, out=out)
        else:
            C = cupy.empty((M, H), BF16)
            ops.grouped_gemm("null", act, w2, C, d.expert_offsets, e_loc, H, I)
            plan = self._send_plan(d) if self.transport == "ipc" else (d.plan or self._host_plan(d.topk_idx))
            out = comb.unfused(C, plan, d.topk_idx, d.topk_weights, out=out)
        return out

    @staticmethod
    def _send_plan(d: DispatchResult):
        """What the peer sink and the IPC push read: expert_offsets and src_info."""
        return d.plan if d.plan is not None else _RowSources(d.expert_offsets, d.src_info, d.num_rows)

    def forward(self, x, topk_idx, topk_weights, w13, w2, sink: str = "peer", dispatch: str = "direct", out=None):
        """The whole layer: dispatch, expert FFN with the chosen sink, combine. [T, H] bf16.
        Weights are checked on every rank before the dispatch moves anything."""
        tokens = getattr(x, "shape", (0,))[0]
        w13, w2, out = self._checked_ffn_inputs(sink, w13, w2, out, tokens, "forward input")
        return self._expert_ffn(self.dispatch(x, topk_idx, topk_weights, dispatch), w13, w2, sink, out, 0)

    def check(self) -> None:
        """Synchronize and raise if any device-side wait ran out or any row was refused."""
        self.signals.raise_if_error(self.rank)

    # ---- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Collective teardown in DESIGN section 5's order; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.group.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass(frozen=True)
class _RowSources:
    expert_offsets: cupy.ndarray
    src_info: cupy.ndarray
    num_recv_rows: int

