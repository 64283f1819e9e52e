"""The FP8 direct dispatch's quantizing send (issue 16), under the launcher:

    python launch/run.py -n 2 [--share-gpu] -- python -m mpi4py launch/jobs/check_quantize_send.py

With FP8 experts the direct dispatch's move kernel (the dispatch_quantize build) reads each
bf16 token row once and quantizes it 1 x 128 into the packed FP8 row it sends and stores.
Per shape (H not a multiple of 512 among them) and per call (fresh random inputs, ragged
token counts, T = 0 on one rank), with the send storing this rank's own rows (own_in_send)
and without (the expand blocks quantize them): the rows, expert_offsets and src_info of the
fused dispatch equal bit for bit those of the unfused one (the packed rows quantized by
their own launch, then moved: direct.quantize_in_send = False), those of the NCCL dispatch
(or, where ranks share a GPU, the host-planned IPC baseline), which quantize in a launch of
their own, and the NumPy model of the quantizer (epserve/check/fp8_reference.py) applied to
the token each row names. forward (direct dispatch, peer sink) gives the same bits both
ways, replayed or built anew, and one launch fewer when fused. Tokens packed already
(svc.quantize_tokens) give the same rows on both transports and the same forward bits, fused,
replayed, unfused, and with one rank's tokens packed and the other's not; packed rows of a
wrong width raise ConfigError on every rank, and the service goes on. Prints `RESULT {json}`
lines; exits non-zero if any check failed on any rank.
"""

from __future__ import annotations

import argparse
import sys

import cupy
import numpy as np
from check_service import tokens_for  # siblings of this script
from job_report import run_cases

from epserve import EPService, MoEConfig, quantize_weights
from epserve.check import fp8_reference as f8
from epserve.check.testing import bf16_bits, layer_inputs
from epserve.comm import mpi as ep_comm
from epserve.errors import ConfigError
from epserve.ffn.fp8 import packed_row_bytes
from epserve.runtime.launch import Recording

# name, H, I, E, k, token counts of successive calls (rank 0, rank 1), routing options
SHAPES = [
    ("H384-k4", 384, 128, 8, 4, [[37, 50], [0, 129], [300, 0]], dict(unused=0.1)),
    ("H640-k8", 640, 128, 16, 8, [[200, 133], [17, 0], [1, 260]], dict(unused=0.15, experts=range(0, 16, 2))),
    ("H1152-k2-skewed", 1152, 256, 8, 2, [[257, 5], [0, 64]], dict(zipf=3.0)),
    ("H7168-k8", 7168, 128, 16, 8, [[129, 0], [96, 200]], dict()),
    ("H128-k2", 128, 128, 8, 2, [[40, 9]], dict()),  # a packed row (256 bytes) as wide as a bf16 token
]


def packed_model(inputs, src_info: np.ndarray, H: int) -> np.ndarray:
    """The packed row each dispatched row should be, from the NumPy quantizer: the token that
    src_info names, its e4m3 values, then its scales, zero-padded to packed_row_bytes(H)."""
    tokens = []  # every rank's tokens as packed rows
    for i in inputs:
        packed = np.zeros((i.x.shape[0], packed_row_bytes(H)), np.uint8)
        if i.x.shape[0]:
            q, s = f8.quantize_rows(i.x)
            packed[:, :H] = q.view(np.uint8)
            scales = np.ascontiguousarray(s[:, :i.x.shape[0]].T.astype(np.float32))  # [T, H / 128]
            packed[:, H:H + 4 * (H // 128)] = scales.view(np.uint8)
        tokens.append(packed)
    info = src_info.astype(np.int64)
    out = np.zeros((len(info), packed_row_bytes(H)), np.uint8)
    for m, (r, t) in enumerate(zip(info >> 24, (info >> 4) & 0xFFFFF)):
        out[m] = tokens[r][t]
    return out


def dispatched(svc, x, idx, w, transport: str) -> tuple:
    d = svc.dispatch(x, idx, w, transport)
    return (cupy.asnumpy(d.rows).view(np.uint8).copy(), cupy.asnumpy(d.expert_offsets).copy(),
            cupy.asnumpy(d.src_info).copy())


def forward_launches(svc, x, idx, w, fp8w) -> tuple:
    """forward's output bits and the launches it made, built anew (no replay)."""
    svc.replay_forward = False
    try:
        with Recording() as rec:
            out = bf16_bits(svc.forward(x, idx, w, fp8w))
    finally:
        svc.replay_forward = True
    return out, len(rec.specs), rec.complete


def run_shape(comm, name, H, I, E, k, calls, opts, seed):
    rank, world = comm.Get_rank(), comm.Get_size()
    max_tokens = max(max(tokens_for(c, world)) for c in calls)
    cfg = MoEConfig(E, k, H, I, max_tokens, world_size=world, wait_timeout_s=20.0, expert_dtype="fp8")
    failures, info = [], {"calls": 0, "rows": 0}
    with EPService(cfg, comm) as svc:
        info["transport"] = svc.transport
        direct = svc.direct
        if not direct.quantizes:
            failures.append("the FP8 service's direct dispatch does not quantize in its move kernel")
        for n, call in enumerate(calls):
            inputs = layer_inputs(seed + n, tokens_for(call, world), E, k, H, I, **opts)
            me = inputs[rank]
            x, idx, w = cupy.asarray(me.x), cupy.asarray(me.topk_idx), cupy.asarray(me.topk_weights)
            fp8w = quantize_weights(cupy.asarray(me.w13), cupy.asarray(me.w2))
            direct.quantize_in_send = False
            unfused = dispatched(svc, x, idx, w, "direct")
            want = packed_model(inputs, unfused[2], H)
            if not np.array_equal(unfused[0], want):
                failures.append(f"call {n}: the unfused rows differ from the NumPy model "
                                f"({int((unfused[0] != want).any(axis=1).sum())} rows)")
            others = {"nccl": dispatched(svc, x, idx, w, "nccl")}
            direct.quantize_in_send = True
            for own in (False, True):
                direct.own_in_send = own
                others[f"fused, own_in_send {own}"] = dispatched(svc, x, idx, w, "direct")
            direct.own_in_send = False
            for label, got in others.items():
                for field, a, b in zip(("rows", "expert_offsets", "src_info"), got, unfused):
                    if a.shape != b.shape or not np.array_equal(a, b):
                        failures.append(f"call {n}: {label}: {field} != the unfused direct dispatch's")
            info["rows"] += len(unfused[2])

            direct.quantize_in_send = False
            out_unfused, launches_unfused, _ = forward_launches(svc, x, idx, w, fp8w)
            direct.quantize_in_send = True
            out_fused, launches_fused, complete = forward_launches(svc, x, idx, w, fp8w)
            replayed = [bf16_bits(svc.forward(x, idx, w, fp8w)) for _ in range(2)]  # recorded, then replayed
            if not complete or launches_fused != launches_unfused - 1:
                failures.append(f"call {n}: forward made {launches_fused} launches fused, {launches_unfused} "
                                f"unfused (complete: {complete}); one fewer expected")
            for label, got in (("fused forward", out_fused), ("recorded", replayed[0]), ("replayed", replayed[1])):
                if not np.array_equal(got, out_unfused):
                    failures.append(f"call {n}: {label} != forward with the unfused dispatch bitwise "
                                    f"({int((got != out_unfused).sum())} elements)")
            info["launches_fused"], info["launches_unfused"] = launches_fused, launches_unfused

            # Tokens that come quantized (svc.quantize_tokens): the same rows and output bits on
            # every path, also with one rank's tokens packed and the other's not.
            packed = svc.quantize_tokens(x)
            for transport in ("direct", "nccl"):
                got = dispatched(svc, packed, idx, w, transport)
                for field, a, b in zip(("rows", "expert_offsets", "src_info"), got, unfused):
                    if a.shape != b.shape or not np.array_equal(a, b):
                        failures.append(f"call {n}: {transport} dispatch of packed tokens: {field} != the unfused "
                                        f"direct dispatch's")
            mixed = packed if rank == 0 else x
            for label, got in (
                    ("forward of packed tokens", bf16_bits(svc.forward(packed, idx, w, fp8w))),
                    ("forward of packed tokens, replayed", bf16_bits(svc.forward(packed, idx, w, fp8w))),
                    ("forward of packed tokens, unfused", bf16_bits(svc.forward(packed, idx, w, fp8w, sink="null",
                                                                                dispatch="nccl"))),
                    ("forward, rank 0's tokens packed, rank 1's not", bf16_bits(svc.forward(mixed, idx, w, fp8w)))):
                if not np.array_equal(got, out_unfused):
                    failures.append(f"call {n}: {label} != forward with the unfused dispatch bitwise "
                                    f"({int((got != out_unfused).sum())} elements)")
            svc.check()
            info["calls"] += 1
        info["replayed_calls"] = svc.replayed_calls
        # Packed rows of the wrong width: a clear error on every rank before anything moves,
        # and the service goes on (the last call again, bitwise).
        try:
            svc.forward(cupy.zeros((4, packed_row_bytes(H) - 16), np.uint8), idx[:4], w[:4], fp8w)
            failures.append("packed rows of the wrong width were taken")
        except ConfigError as exc:
            if "packed FP8 rows" not in str(exc):
                failures.append(f"the wrong width's error does not name packed rows: {exc}")
        try:  # tokens of neither dtype: the error names both inputs FP8 experts take
            svc.forward(cupy.zeros((4, H), np.float32), idx[:4], w[:4], fp8w)
            failures.append("float32 tokens were taken")
        except ConfigError as exc:
            if "must be bf16" not in str(exc) or "packed FP8 rows" not in str(exc):
                failures.append(f"the float32 tokens' error does not name bf16 and packed rows: {exc}")
        if not np.array_equal(bf16_bits(svc.forward(packed, idx, w, fp8w)), out_unfused):
            failures.append("forward of packed tokens after a refused call != before")
    return dict(case=name, rank=rank, ok=not failures, failures=failures[:10], **info)


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/check_quantize_send.py")
    p.add_argument("--seed", type=int, default=161)
    args = p.parse_args()
    comm = ep_comm.world()
    return run_cases(comm, "check_quantize_send", SHAPES, lambda shape: run_shape(comm, *shape, seed=args.seed))


if __name__ == "__main__":
    sys.exit(main())
