"""Multi-rank GPU check of EPService (issue 4), run under the launcher:

    python launch/run.py -n 2 [--share-gpu] -- python -m mpi4py launch/jobs/check_service.py

Per service shape, several calls with different token counts: forward fused (direct dispatch,
peer sink) == forward unfused (NCCL dispatch, null sink) bitwise, both within 1e-2 of the
float64 reference, every output element written (poisoned `out`), the same recv slots, and the
peer sink after the NCCL dispatch gives the same bits; direct dispatch == NCCL dispatch bitwise
(rows, expert_offsets, src_info), the NCCL path planned on the device where every rank has a
GPU (bad inputs on it too); inputs passed as foreign
__cuda_array_interface__ objects (bf16 as <V2) and through DLPack give the same bits; every
bad input raises on every rank and leaves the service usable. Prints `RESULT {json}` lines;
exits non-zero if any check failed on any rank.
"""

from __future__ import annotations

import argparse
import sys

import cupy
import numpy as np
from job_report import run_cases  # a sibling of this script

from epserve import EPService, MoEConfig
from epserve.check.reference import reference_layer, rel_error
from epserve.check.testing import BF16, bf16_bits, layer_inputs
from epserve.comm import mpi as ep_comm
from epserve.dispatch.host_plan import count_recv_rows
from epserve.errors import EPServeError

# name, H, I, E, k, token counts of successive calls (rank 0, rank 1), routing options
SHAPES = [
    ("k2", 256, 128, 8, 2, [[37, 50], [64, 1], [0, 9]], dict(unused=0.1)),
    ("k8-empty-experts", 512, 256, 16, 8, [[200, 133], [17, 260]], dict(unused=0.15, experts=range(0, 16, 2))),
    ("k4-skewed", 384, 192, 8, 4, [[300, 257], [5, 299]], dict(zipf=3.0)),
    ("k1", 192, 64, 4, 1, [[129, 64]], dict()),
]


class ForeignCAI:
    """Another framework's array, seen only through __cuda_array_interface__ (bf16 as <V2)."""

    def __init__(self, a):
        self._a = a
        cai = dict(a.__cuda_array_interface__)
        if a.dtype == BF16:
            cai["typestr"] = "<V2"
        self.__cuda_array_interface__ = cai


class ForeignDLPack:
    """Another framework's array, seen only through DLPack."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()



def experts_for(E, world):
    """A shape's expert count, rounded up to a multiple of the ranks (every rank owns the same
    number), so every shape runs at 4 and 8 ranks too."""
    return -(-E // world) * world


def tokens_for(call, world):
    return [call[r % len(call)] + 2 * (r // len(call)) for r in range(world)]


def expect_error_everywhere(comm, label, fn):
    """fn must raise an EPServeError on this rank; returns a failure text or None."""
    try:
        fn()
    except EPServeError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - any other class is a failure of the contract
        return f"{label}: raised {type(exc).__name__} instead of an EPServeError: {exc}", None
    return f"{label}: no error raised on rank {comm.Get_rank()}", None


def run_shape(comm, name, H, I, E, k, calls, opts, seed):
    rank, world = comm.Get_rank(), comm.Get_size()
    E = experts_for(E, world)
    max_tokens = max(max(tokens_for(c, world)) for c in calls)
    cfg = MoEConfig(E, k, H, I, max_tokens, world_size=world, wait_timeout_s=20.0)
    failures, info = [], {"calls": 0}
    with EPService(cfg, comm) as svc:
        info["transport"] = svc.transport
        first_out = None
        for n, call in enumerate(calls):
            inputs = layer_inputs(seed + n, tokens_for(call, world), E, k, H, I, **opts)
            me = inputs[rank]
            x, idx, w, w13, w2 = me.on_device()
            T = x.shape[0]
            out = cupy.full((T, H), np.nan, BF16)  # poisoned: every element must be overwritten
            fused = svc.forward(x, idx, w, w13, w2, sink="peer", dispatch="direct", out=out)
            used = cupy.asnumpy(idx) >= 0
            recv_fused = bf16_bits(svc.combiner.recv)[:T][used]
            unfused = svc.forward(x, idx, w, w13, w2, sink="null", dispatch="nccl")
            svc.check()
            if not np.array_equal(bf16_bits(svc.combiner.recv)[:T][used], recv_fused):
                failures.append(f"call {n}: recv slots differ between fused and unfused (NCCL)")
            fused_nccl = svc.forward(x, idx, w, w13, w2, sink="peer", dispatch="nccl")
            if not np.array_equal(bf16_bits(fused_nccl), bf16_bits(fused)):
                failures.append(f"call {n}: the peer sink after the NCCL dispatch gave other bits")
            if fused is not out:
                failures.append(f"call {n}: forward did not return the given out buffer")
            if np.isnan(cupy.asnumpy(fused).astype(np.float32)).any():
                failures.append(f"call {n}: fused output has unwritten (poisoned) elements")
            if not np.array_equal(bf16_bits(fused), bf16_bits(unfused)):
                failures.append(f"call {n}: fused != unfused bitwise ({int((bf16_bits(fused) != bf16_bits(unfused)).sum())} "
                                "elements)")
            ref = reference_layer([i.x for i in inputs], [i.topk_idx for i in inputs],
                                  [i.topk_weights for i in inputs], [i.w13 for i in inputs], [i.w2 for i in inputs],
                                  E)[rank]
            if T:
                err = rel_error(cupy.asnumpy(fused).astype(np.float64), ref["out"])
                info[f"rel_err_call{n}"] = err
                if not err < 1e-2:
                    failures.append(f"call {n}: relative error {err:.3g} vs the float64 reference")
            direct = svc.dispatch(x, idx, w, transport="direct")
            nccl = svc.dispatch(x, idx, w, transport="nccl")
            for field in ("rows", "expert_offsets", "src_info"):
                a, b = getattr(direct, field), getattr(nccl, field)
                if a.shape != b.shape or not np.array_equal(cupy.asnumpy(a).view(np.uint8),
                                                            cupy.asnumpy(b).view(np.uint8)):
                    failures.append(f"call {n}: direct and NCCL dispatch differ in {field}")
            if not np.array_equal(cupy.asnumpy(direct.expert_offsets), ref["expert_offsets"]) or \
                    not np.array_equal(cupy.asnumpy(direct.src_info), ref["src_info"]):
                failures.append(f"call {n}: dispatch layout differs from the reference plan")
            for label, wrap in (("__cuda_array_interface__", ForeignCAI), ("DLPack", ForeignDLPack)):
                other = svc.forward(wrap(x), wrap(idx), wrap(w), wrap(w13), wrap(w2))
                if not np.array_equal(bf16_bits(other), bf16_bits(fused)):
                    failures.append(f"call {n}: inputs through {label} gave other bits")
            if n == 0:
                first_out = bf16_bits(fused)
                first_inputs = (x, idx, w, w13, w2)
            info["calls"] += 1

        failures += bad_inputs(comm, svc, cfg, first_inputs, first_out)
    return failures, info


def bad_inputs(comm, svc, cfg, good, good_bits):
    """Each bad input: an EPServeError on every rank, then the service still gives good_bits."""
    rank, world = comm.Get_rank(), comm.Get_size()
    x, idx, w, w13, w2 = good
    culprit = world - 1
    T = x.shape[0]

    def on_culprit(bad, fine):
        return bad if rank == culprit else fine

    wide = cupy.zeros((T, 2 * cfg.hidden), BF16)
    bad_id = idx.copy()
    if T:
        bad_id[0, 0] = cfg.num_experts + 5
    cases = {
        "x float32": lambda: svc.forward(on_culprit(x.astype(np.float32), x), idx, w, w13, w2),
        "x of another hidden size": lambda: svc.forward(on_culprit(cupy.zeros((T, cfg.hidden + 64), BF16), x), idx,
                                                        w, w13, w2),
        "x not contiguous": lambda: svc.forward(on_culprit(wide[:, ::2], x), idx, w, w13, w2),
        "too many tokens": lambda: svc.forward(on_culprit(cupy.zeros((cfg.max_tokens_per_rank + 1, cfg.hidden), BF16),
                                                          x), idx, w, w13, w2),
        "topk_idx int64": lambda: svc.forward(x, on_culprit(idx.astype(np.int64), idx), w, w13, w2),
        "w2 of the wrong shape": lambda: svc.forward(x, idx, w, w13, on_culprit(
            cupy.zeros((w2.shape[0], cfg.hidden, cfg.intermediate + 64), BF16), w2)),
        "unknown sink": lambda: svc.forward(x, idx, w, w13, w2, sink=on_culprit("bogus", "peer")),
        "unknown dispatch": lambda: svc.forward(x, idx, w, w13, w2, dispatch=on_culprit("bogus", "direct")),
        "expert id out of range (found on the device)": lambda: svc.forward(x, on_culprit(bad_id, idx), w, w13, w2),
    }
    # The NCCL path (where every rank has a GPU): the same verdicts, reached on the device; the
    # culprit still makes its share of every NCCL call, so nobody hangs.
    nccl_cases = {}
    if not svc.shared_gpu:
        unfused = dict(sink="null", dispatch="nccl")
        nccl_cases = {
            "x float32 (nccl)": lambda: svc.forward(on_culprit(x.astype(np.float32), x), idx, w, w13, w2, **unfused),
            "too many tokens (nccl)": lambda: svc.forward(on_culprit(
                cupy.zeros((cfg.max_tokens_per_rank + 1, cfg.hidden), BF16), x), idx, w, w13, w2, **unfused),
            "w2 of the wrong shape (nccl)": lambda: svc.forward(x, idx, w, w13, on_culprit(
                cupy.zeros((w2.shape[0], cfg.hidden, cfg.intermediate + 64), BF16), w2), **unfused),
            "expert id out of range (nccl)": lambda: svc.forward(x, on_culprit(bad_id, idx), w, w13, w2, **unfused),
            "expert id out of range (nccl, peer sink)": lambda: svc.forward(x, on_culprit(bad_id, idx), w, w13, w2,
                                                                            dispatch="nccl"),
        }
    cases.update(nccl_cases)
    if cupy.cuda.runtime.getDeviceCount() > 1 and not svc.shared_gpu:
        other = (svc.device + 1) % cupy.cuda.runtime.getDeviceCount()
        with cupy.cuda.Device(other):
            x_elsewhere = cupy.asarray(x)
        cupy.cuda.Device(svc.device).use()
        cases["x on another GPU"] = lambda: svc.forward(on_culprit(x_elsewhere, x), idx, w, w13, w2)

    failures = []
    for label, fn in cases.items():
        failure, message = expect_error_everywhere(comm, label, fn)
        if failure:
            failures.append(failure)
        else:
            print(f"# rank {rank} {label}: {message[:200]}", flush=True)
        after = svc.forward(x, idx, w, w13, w2)
        svc.check()
        if not np.array_equal(bf16_bits(after), good_bits):
            failures.append(f"after '{label}' the service gave other bits")
        if label in nccl_cases:
            again = svc.forward(x, idx, w, w13, w2, sink="null", dispatch="nccl")
            if not np.array_equal(bf16_bits(again), good_bits):
                failures.append(f"after '{label}' the NCCL path gave other bits")
    failures += overflow_case(comm, cfg, good)
    return failures


def overflow_case(comm, cfg, good):
    """A service whose receive capacity is too small for a call's routing: every rank raises
    before any row moves, and the next call (routing that fits) works."""
    rank, world = comm.Get_rank(), comm.Get_size()
    x, idx, w, w13, w2 = good
    T = x.shape[0]
    crowd = cupy.zeros((T, cfg.top_k), np.int32) + cupy.arange(cfg.top_k, dtype=np.int32)  # all to rank 0
    needed = comm.allreduce(T * cfg.top_k)  # rows rank 0 would receive
    routing = comm.allgather(cupy.asnumpy(idx))
    fits = max(count_recv_rows(d, routing, cfg.num_experts, world) for d in range(world))
    if needed <= fits:
        return []
    small = MoEConfig(cfg.num_experts, cfg.top_k, cfg.hidden, cfg.intermediate, cfg.max_tokens_per_rank,
                      world_size=world, max_recv_rows=fits, wait_timeout_s=cfg.wait_timeout_s)
    failures = []
    with EPService(small, comm) as svc:
        for transport in ("direct", "nccl"):
            failure, message = expect_error_everywhere(comm, f"receive capacity overflow ({transport})",
                                                       lambda: svc.dispatch(x, crowd, w, transport=transport))
            if failure:
                failures.append(failure)
            elif rank == 0:
                print(f"# rank {rank} overflow ({transport}): {message[:200]}", flush=True)
        ok = svc.forward(x, idx, w, w13, w2)
        svc.check()
        if ok.shape != (T, cfg.hidden):
            failures.append("the service did not serve the call after an overflow")
    return failures


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=99)
    args = p.parse_args()
    comm = ep_comm.world()
    return run_cases(comm, "check_service", list(enumerate(SHAPES)), lambda case: record(comm, case[1][0], *run_shape(
        comm, *case[1], args.seed + 10 * case[0])))


def record(comm, name: str, failures, info) -> dict:
    """One rank's record of shape `name`, as run_cases reports it."""
    return dict(case=name, rank=comm.Get_rank(), ok=not failures, failures=failures, **info)


if __name__ == "__main__":
    sys.exit(main())
