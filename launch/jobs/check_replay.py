"""forward's replayed launches (issue 13's host time), under the launcher:

    python launch/run.py -n 2 [--share-gpu] -- python -m mpi4py launch/jobs/check_replay.py [--rounds 24] [--fp8]

The default forward records its launches at the first call of a token count, stream and set of
weights, and replays them after that with the per-call arrays' pointers rewritten
(epserve/runtime/replay.py). Each round draws fresh inputs, alternates two layers' weights,
changes the token counts every few rounds, passes `out` on some rounds (poisoned first) and
writes some rounds' inputs into the previous round's arrays (pointers unchanged). Every
round's replayed forward must equal the same call with its launches built anew
(svc.replay_forward = False) bit for bit, and the float64 reference within 1e-2 every sixth
round. The number of replayed calls must be exactly the calls whose key was seen before
(a replay silently refused would show here), and each must have gone out as one CUDA graph
launch. The public direct dispatch replays its launches too (DirectDispatcher.replay_dispatch):
every round its rows, expert_offsets and src_info must equal a dispatch built anew bit for
bit, with the same count of replays and graph launches. In the middle, a round with an expert id out of
range on the last rank must raise on every rank with out poisoned, and the next round must be
right again. --fp8: the same with FP8 experts. Prints `RESULT {json}` lines; exits non-zero if
any check failed on any rank.
"""

from __future__ import annotations

import argparse
import sys

import cupy
import numpy as np
from job_report import report  # a sibling of this script

from epserve import EPService, MoEConfig, quantize_weights
from epserve.check.fp8_layer_reference import quantized_weights, reference_layer_fp8
from epserve.check.reference import reference_layer, rel_error
from epserve.check.testing import bf16_bits, layer_inputs
from epserve.comm import mpi as ep_comm
from epserve.errors import EPServeError

H, I, E, K = 256, 128, 8, 4
TOKEN_PLANS = ((48, 33), (33, 48), (5, 1), (48, 33))  # per rank, changed every 4 rounds
BAD_ROUND = 13


def dispatch_replay_failures(svc, x, idx, w, n: int, bad: bool) -> list:
    """The public direct dispatch, replayed, against the same dispatch built anew: rows,
    expert_offsets and src_info bit for bit; with a bad expert id it must raise (every rank)."""
    got = []
    for replay in (True, False):
        svc.direct.replay_dispatch = replay
        try:
            d = svc.dispatch(x, idx, w, "direct")
            got.append([cupy.asnumpy(a).view(np.uint8) for a in (d.rows, d.expert_offsets, d.src_info)])
        except EPServeError as exc:
            got.append(None if bad else f"{type(exc).__name__}: {exc}")
        finally:
            svc.direct.replay_dispatch = True
    if bad:
        return [f"round {n}: an expert id out of range (dispatch, replayed {r}): nothing raised"
                for r, g in zip((True, False), got) if g is not None]
    if any(isinstance(g, str) for g in got):
        return [f"round {n}: dispatch: {g}" for g in got if isinstance(g, str)]
    return [f"round {n}: the replayed dispatch's {name} differs from the rebuilt one's"
            for name, a, b in zip(("rows", "expert_offsets", "src_info"), *got) if not np.array_equal(a, b)]


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/check_replay.py")
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--fp8", action="store_true", help="FP8 experts (issue 16)")
    args = p.parse_args()
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    plans = [[plan[r % len(plan)] for r in range(world)] for plan in TOKEN_PLANS]
    if rank == 0:
        print("# cases: 1", flush=True)
    cfg = MoEConfig(E, K, H, I, max(max(p) for p in plans), world_size=world, wait_timeout_s=20.0,
                    expert_dtype="fp8" if args.fp8 else "bf16")
    failures, info = [], {"rounds": 0, "expert_dtype": cfg.expert_dtype}
    layers = [layer_inputs(args.seed + 1000 * n, plans[0], E, K, H, I) for n in range(2)]
    seen, expected_replays = set(), 0
    seen_dispatch, expected_dispatch_replays = set(), 0
    with EPService(cfg, comm) as svc:
        info["transport"] = svc.transport
        weights = []
        for layer in layers:  # the service chose this rank's GPU: the weights go there
            w13, w2 = cupy.asarray(layer[rank].w13), cupy.asarray(layer[rank].w2)
            weights.append((quantize_weights(w13, w2), None) if args.fp8 else (w13, w2))
        held = None  # the previous round's input arrays, refilled on some rounds
        for n in range(args.rounds):
            tokens = plans[(n // 4) % len(plans)]
            which = n % 2
            inputs = layer_inputs(args.seed + 1 + n, tokens, E, K, H, I, unused=0.1 * (n % 3), with_weights=False)
            me = inputs[rank]
            if held is not None and n % 4 == 3 and held[0].shape[0] == tokens[rank]:
                for array, value in zip(held, (me.x, me.topk_idx, me.topk_weights)):
                    array[...] = cupy.asarray(value)  # same pointers as the round before
                x, idx, w = held
            else:
                x, idx, w = cupy.asarray(me.x), cupy.asarray(me.topk_idx), cupy.asarray(me.topk_weights)
            held = (x, idx, w)
            bad = n == BAD_ROUND
            if bad:
                idx = idx.copy()
                if rank == world - 1 and idx.shape[0]:
                    idx[0, 0] = E + 3
            out = None
            if n % 3 == 0 or bad:  # a caller's buffer, poisoned: every element must be written
                out = cupy.empty((tokens[rank], H), x.dtype)
                out.fill(np.nan)
            w13, w2 = weights[which]
            key = (tokens[rank], which)
            svc.replay_forward = True
            try:
                replayed = bf16_bits(svc.forward(x, idx, w, w13, w2, out=out))
                if bad:
                    failures.append("an expert id out of range (replayed forward): nothing raised")
            except EPServeError as exc:
                if not bad:
                    failures.append(f"round {n}: {type(exc).__name__}: {exc}")
                elif out is not None and not np.isnan(cupy.asnumpy(out).astype(np.float32)).all():
                    failures.append("the failed replayed call left output that is not poisoned (NaN)")
            expected_replays += key in seen
            seen.add(key)
            failures += dispatch_replay_failures(svc, x, idx, w, n, bad)
            expected_dispatch_replays += tokens[rank] in seen_dispatch
            seen_dispatch.add(tokens[rank])
            if bad:
                continue
            svc.replay_forward = False
            rebuilt = bf16_bits(svc.forward(x, idx, w, w13, w2))
            if not np.array_equal(replayed, rebuilt):
                failures.append(f"round {n}: the replayed forward differs from the rebuilt one in "
                                f"{int((replayed != rebuilt).sum())} elements")
            if n % 6 == 0:
                routing = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
                if args.fp8:
                    ref = reference_layer_fp8(*routing, [quantized_weights(lw.w13, lw.w2) for lw in layers[which]],
                                              E)[rank]
                else:
                    ref = reference_layer(*routing, [lw.w13 for lw in layers[which]], [lw.w2 for lw in layers[which]],
                                          E)[rank]
                err = rel_error(replayed.view(x.dtype).astype(np.float64), ref["out"])
                if not err < 1e-2:
                    failures.append(f"round {n}: relative error {err:.3g} vs the float64 reference")
            info["rounds"] += 1
        info["replayed_calls"], info["expected_replays"] = svc.replayed_calls, expected_replays
        info["graph_replays"] = svc.graph_replays
        if svc.replayed_calls != expected_replays:
            failures.append(f"{svc.replayed_calls} calls replayed, {expected_replays} expected: a recording was "
                            "refused or a key missed")
        if svc.graph_replays != svc.replayed_calls:  # nothing here is captured: every replay is a graph launch
            failures.append(f"{svc.graph_replays} of {svc.replayed_calls} replays went out as a CUDA graph")
        d = svc.direct
        info["dispatch_replays"], info["expected_dispatch_replays"] = d.replayed_calls, expected_dispatch_replays
        if d.replayed_calls != expected_dispatch_replays or d.graph_replays != d.replayed_calls:
            failures.append(f"public dispatch: {d.replayed_calls} calls replayed ({d.graph_replays} as a CUDA graph), "
                            f"{expected_dispatch_replays} expected")
    report(comm, dict(case="replay-fp8" if args.fp8 else "replay", rank=rank, ok=not failures, failures=failures[:10],
                      **info))
    bad_ranks = comm.allreduce(int(bool(failures)))
    if rank == 0:
        print(f"# check_replay: {'all cases passed' if not bad_ranks else f'{bad_ranks} failing ranks'}", flush=True)
    return 1 if bad_ranks else 0


if __name__ == "__main__":
    sys.exit(main())
