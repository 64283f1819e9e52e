"""EPService.dispatch(wait=False), the dispatch with no host wait, under the launcher:

    python launch/run.py -n 2 [--share-gpu] -- python -m mpi4py launch/jobs/check_dispatch_queued.py

Per shape, bf16 and FP8 experts, and per call (fresh random inputs, ragged token counts, T = 0
on one rank): with the dispatcher's rows, expert_offsets and src_info poisoned first, the
direct dispatch with wait=False returns them capacity-sized with num_rows None, and they equal
the waiting dispatch's bit for bit (expert_offsets[-1] is its row count); the same for the
NCCL dispatch where every rank has its own GPU (where ranks share one it is refused with
ConfigError on every rank); expert_ffn on the unwaited result, with the peer sink and with
the null sink, equals forward bit for bit, into poisoned outputs; captured in a CUDA graph and
replayed into poisoned buffers, it gives the same bits. Failures: an expert id out
of range on one rank raises nothing at the call; expert_ffn then poisons every output element
on every rank, and check() raises ConfigError on that rank and RankFailedError on the others;
a rank whose x has the wrong dtype raises ConfigError at the call, the others' check() raises
RankFailedError and its own check() nothing. After each failure a good call gives the same bits
as before. Prints `RESULT {json}` lines; exits non-zero if any check failed on any rank.
"""

from __future__ import annotations

import argparse
import sys

import cupy
import numpy as np
from check_service import tokens_for  # siblings of this script
from job_report import run_cases

from epserve import EPService, MoEConfig, quantize_weights
from epserve.check.testing import BF16, bf16_bits, layer_inputs, poison
from epserve.comm import mpi as ep_comm
from epserve.errors import ConfigError, EPServeError, RankFailedError

# name, dtype, H, I, E, k, token counts of successive calls (rank 0, rank 1), routing options
SHAPES = [
    ("bf16-k4", "bf16", 256, 128, 8, 4, [[37, 50], [0, 129]], dict(unused=0.1)),
    ("bf16-k8-empty-experts", "bf16", 512, 256, 16, 8, [[200, 133], [17, 0]], dict(experts=range(0, 16, 2))),
    ("fp8-k4", "fp8", 384, 128, 8, 4, [[64, 90], [129, 3]], dict(unused=0.1)),
    ("fp8-k8", "fp8", 640, 256, 16, 8, [[100, 0], [33, 200]], dict()),
]


def poison_dispatcher(d) -> None:
    """Every element of a dispatcher's rows, expert_offsets and src_info to all ones."""
    poison(d.rows, d.expert_offsets, d.src_info)


def host_copy(result, rows: int) -> tuple:
    return (cupy.asnumpy(result.rows[:rows]).view(np.uint8), cupy.asnumpy(result.expert_offsets),
            cupy.asnumpy(result.src_info[:rows]))


def queued_equals_waited(svc, dispatcher, transport: str, x, idx, w, label: str) -> tuple[list, object]:
    """The unwaited dispatch of `transport` against the waiting one: (failures, its result)."""
    failures = []
    waited = svc.dispatch(x, idx, w, transport)
    want = host_copy(waited, waited.num_rows)
    poison_dispatcher(dispatcher)
    got = svc.dispatch(x, idx, w, transport, wait=False)
    if got.num_rows is not None:
        failures.append(f"{label}: num_rows is {got.num_rows}, not None")
    if got.rows.shape[0] != svc.config.recv_rows_capacity or got.src_info.shape[0] != svc.config.recv_rows_capacity:
        failures.append(f"{label}: rows {got.rows.shape}, src_info {got.src_info.shape} are not capacity-sized")
    count = int(cupy.asnumpy(got.expert_offsets[-1:])[0])
    if count != waited.num_rows:
        failures.append(f"{label}: expert_offsets[-1] is {count}, the waiting dispatch's row count {waited.num_rows}")
    for field, a, b in zip(("rows", "expert_offsets", "src_info"), host_copy(got, waited.num_rows), want):
        if a.shape != b.shape or not np.array_equal(a, b):
            failures.append(f"{label}: {field} != the waiting dispatch's bitwise")
    return failures, got


def captured(svc, x, idx, w) -> list:
    """dispatch(wait=False) captured in a CUDA graph on a stream of its own (after one eager
    call there), replayed into poisoned buffers: the waiting dispatch's bits."""
    waited = svc.dispatch(x, idx, w, "direct")
    want = host_copy(waited, waited.num_rows)
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())
    with stream:
        svc.dispatch(x, idx, w, "direct", wait=False)
        poison_dispatcher(svc.direct)
        stream.begin_capture()
        try:
            got = svc.dispatch(x, idx, w, "direct", wait=False)
        finally:
            graph = stream.end_capture()
        graph.launch(stream=stream)
        stream.synchronize()
    failures = []
    for field, a, b in zip(("rows", "expert_offsets", "src_info"), host_copy(got, waited.num_rows), want):
        if a.shape != b.shape or not np.array_equal(a, b):
            failures.append(f"captured: {field} != the waiting dispatch's bitwise")
    return failures


def poisoned_out(T: int, H: int):
    return cupy.full((T, H), np.nan, BF16)


def run_shape(comm, name, dtype, H, I, E, k, calls, opts, seed):
    rank, world = comm.Get_rank(), comm.Get_size()
    max_tokens = max(max(tokens_for(c, world)) for c in calls)
    cfg = MoEConfig(E, k, H, I, max_tokens, world_size=world, wait_timeout_s=20.0, expert_dtype=dtype)
    failures, info = [], {"calls": 0}
    with EPService(cfg, comm) as svc:
        info["transport"] = svc.transport
        for n, call in enumerate(calls):
            inputs = layer_inputs(seed + n, tokens_for(call, world), E, k, H, I, **opts)
            x, idx, w, w13, w2 = inputs[rank].on_device()
            if dtype == "fp8":
                w13, w2 = quantize_weights(w13, w2), None
            T = x.shape[0]
            want = bf16_bits(svc.forward(x, idx, w, w13, w2))
            svc.check()
            bad, got = queued_equals_waited(svc, svc.direct, "direct", x, idx, w, f"call {n}, direct")
            failures += bad
            for sink in ("peer", "null"):
                out = svc.expert_ffn(got, w13, w2, sink=sink, out=poisoned_out(T, H))
                if not np.array_equal(bf16_bits(out), want):
                    failures.append(f"call {n}: expert_ffn ({sink} sink) on the unwaited dispatch != forward bitwise "
                                    f"({int((bf16_bits(out) != want).sum())} elements)")
                got = svc.dispatch(x, idx, w, "direct", wait=False)  # expert_ffn's combine ran: dispatch again
            if svc.nccl_path is not None:
                bad, got = queued_equals_waited(svc, svc.nccl_path, "nccl", x, idx, w, f"call {n}, nccl")
                failures += bad
                out = svc.expert_ffn(got, w13, w2, sink="peer", out=poisoned_out(T, H))
                if not np.array_equal(bf16_bits(out), want):
                    failures.append(f"call {n}: expert_ffn on the unwaited NCCL dispatch != forward bitwise")
            else:
                try:
                    svc.dispatch(x, idx, w, "nccl", wait=False)
                    failures.append(f"call {n}: the NCCL dispatch with wait=False ran where ranks share a GPU")
                except ConfigError:
                    pass
            if n == 0:
                failures += captured(svc, x, idx, w)
            svc.check()
            info["calls"] += 1
        failures += failure_cases(comm, svc, inputs, dtype, want)
    return dict(case=name, rank=rank, ok=not failures, failures=failures[:10], **info)


def failure_cases(comm, svc, inputs, dtype, good_bits) -> list:
    """A bad expert id (found on the device) and a bad x dtype (on its host), each on the last
    rank with tokens in `inputs` (every rank's good inputs of the last call) and each followed
    by a good call that must give good_bits."""
    rank, failures = comm.Get_rank(), []
    bad_rank = max(r for r, i in enumerate(inputs) if i.x.shape[0])
    x, idx, w, w13, w2 = inputs[rank].on_device()
    if dtype == "fp8":
        w13, w2 = quantize_weights(w13, w2), None
    T, H = x.shape[0], svc.config.hidden

    def good_call(label):
        got = svc.dispatch(x, idx, w, "direct", wait=False)
        out = svc.expert_ffn(got, w13, w2, sink="peer")
        try:
            svc.check()
        except EPServeError as exc:
            failures.append(f"{label}: the good call after it raised {type(exc).__name__}: {exc}")
        if not np.array_equal(bf16_bits(out), good_bits):
            failures.append(f"{label}: the good call after it gave other bits")

    bad_idx = idx.copy()
    if rank == bad_rank:
        bad_idx[0, 0] = svc.config.num_experts  # out of range: found by the route on the device
    got = svc.dispatch(x, bad_idx, w, "direct", wait=False)
    out = svc.expert_ffn(got, w13, w2, sink="peer", out=cupy.zeros((T, H), BF16))
    if T and not np.isnan(cupy.asnumpy(out).astype(np.float32)).all():
        failures.append("bad expert id: expert_ffn's output is not poisoned everywhere")
    expected = ConfigError if rank == bad_rank else RankFailedError
    try:
        svc.check()
        failures.append(f"bad expert id: check() raised nothing on rank {rank}")
    except EPServeError as exc:
        if type(exc) is not expected:
            failures.append(f"bad expert id: check() raised {type(exc).__name__}, not {expected.__name__}: {exc}")
    good_call("bad expert id")

    try:
        svc.dispatch(x.astype(np.float32) if rank == bad_rank else x, idx, w, "direct", wait=False)
        if rank == bad_rank:
            failures.append("bad x dtype: no ConfigError at the call on the rank that holds it")
    except ConfigError:
        if rank != bad_rank:
            failures.append("bad x dtype: ConfigError at the call on a rank whose input is good")
    try:
        svc.check()
        if rank != bad_rank:
            failures.append("bad x dtype: check() raised nothing on the other rank")
    except RankFailedError as exc:
        if rank == bad_rank:
            failures.append(f"bad x dtype: check() raised the call's record again on the failing rank: {exc}")
    good_call("bad x dtype")
    return failures


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/check_dispatch_queued.py")
    p.add_argument("--seed", type=int, default=313)
    args = p.parse_args()
    comm = ep_comm.world()
    return run_cases(comm, "check_dispatch_queued", SHAPES, lambda shape: run_shape(comm, *shape, seed=args.seed))


if __name__ == "__main__":
    sys.exit(main())
