"""One forward of the layer, launch by launch, under the launcher:

    python launch/run.py -n 1 -- python launch/jobs/profile_layer.py [--preset dsv3-prefill-fp8]
        [--tokens 4096] [--as-rank-of 2] [--iters 10]

Each rank builds the service at the preset's shape (with --as-rank-of R, one rank standing in
for a rank of R: the preset's experts / R on it, as `python -m epserve.bench --as-rank-of`
does), random weights (quantized for an FP8 preset) and the bench's balanced routing, then
times forward (direct dispatch, peer sink, its launches built each call rather than replayed)
as the bench times a row: 0.25 s idle, 3 calls, then `iters` calls with a wait after each. A
CUDA event is recorded on the stream before every prepared launch and after the call: a
launch's time runs from its event to the next one, so it holds the launch and anything queued
between it and the next (CuPy's own kernels, memsets). Prints, per launch in call order, the
kernel and its median time, then the call's; the events cost a few microseconds a launch."""

from __future__ import annotations

import argparse
import time

import cupy
import numpy as np

from epserve import EPService, MoEConfig
from epserve.arrays import BF16
from epserve.bench import presets
from epserve.bench.__main__ import shape_of
from epserve.comm import mpi as ep_comm
from epserve.ffn.fp8 import quantize_weights
from epserve.runtime import launch


class LaunchEvents:
    """Records a CUDA event before each prepared launch while active."""

    def __init__(self):
        self.marks = []  # (kernel name, event)
        self._call = launch.PreparedLaunch.__call__

    def __enter__(self):
        call, marks = self._call, self.marks

        def recorded(prepared, stream):
            event = cupy.cuda.Event()
            event.record(cupy.cuda.ExternalStream(stream))
            marks.append((prepared.kernel.name, event))
            return call(prepared, stream)

        launch.PreparedLaunch.__call__ = recorded
        return self

    def __exit__(self, *exc):
        launch.PreparedLaunch.__call__ = self._call


def profile_call(fn) -> tuple[list[str], list[float], float]:
    """(kernel names, ms from each launch to the next mark, ms of the whole call) of one call."""
    stream = cupy.cuda.get_current_stream()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    with LaunchEvents() as rec:
        start.record(stream)
        fn()
        end.record(stream)
    end.synchronize()
    names = [name for name, _ in rec.marks]
    events = [e for _, e in rec.marks] + [end]
    spans = [cupy.cuda.get_elapsed_time(a, b) for a, b in zip(events, events[1:])]
    return names, spans, cupy.cuda.get_elapsed_time(start, end)


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/profile_layer.py")
    p.add_argument("--preset", default="dsv3-prefill-fp8", choices=sorted(presets.PRESETS))
    p.add_argument("--tokens", type=int, help="tokens per rank (default: the preset's)")
    p.add_argument("--as-rank-of", type=int, default=1)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    pre = shape_of(presets.get_preset(args.preset), quick=False, as_rank_of=args.as_rank_of)
    pre = presets.scaled(pre, tokens_per_rank=args.tokens or pre.tokens_per_rank)
    T, H, I, E, k = pre.tokens_per_rank, pre.hidden, pre.intermediate, pre.num_experts, pre.top_k
    cfg = MoEConfig(E, k, H, I, T, world_size=world, expert_dtype=pre.expert_dtype)
    topk = presets.get_routing("balanced").draw(pre, world, 17)[rank]
    with EPService(cfg, comm) as svc:
        svc.replay_forward = False  # every launch through a prepared launch this job can see
        rs = cupy.random.RandomState(100 + rank)
        e_loc = E // world
        w13 = (rs.standard_normal((e_loc, 2 * I, H), dtype=np.float32) / np.sqrt(H)).astype(BF16)
        w2 = (rs.standard_normal((e_loc, H, I), dtype=np.float32) / np.sqrt(I)).astype(BF16)
        weights = (quantize_weights(w13, w2), None) if pre.expert_dtype == "fp8" else (w13, w2)
        x = rs.standard_normal((T, H), dtype=np.float32).astype(BF16)
        idx = cupy.asarray(topk, np.int32)
        router = rs.uniform(0.05, 1.0, (T, k), dtype=np.float32)
        out = cupy.empty((T, H), BF16)

        def forward():
            svc.forward(x, idx, router, *weights, "peer", "direct", out=out)

        time.sleep(0.25)
        for _ in range(3):
            forward()
        runs = []
        for _ in range(args.iters):
            runs.append(profile_call(forward))
        svc.check()
    names = runs[0][0]
    if any(r[0] != names for r in runs):
        raise SystemExit("the calls made different launches")
    spans = np.median(np.array([r[1] for r in runs]), axis=0)
    calls = np.array([r[2] for r in runs])
    if rank == 0:
        print(f"# {pre.name}, {T} tokens/rank, {E} experts, {world} rank(s); median of {args.iters} calls, "
              f"each after a wait (us)")
        print(f"{'#':>3}  {'kernel':<44}{'us':>10}")
        for n, (name, us) in enumerate(zip(names, spans * 1e3)):
            print(f"{n:>3}  {name:<44}{us:>10.1f}")
        print(f"     {'sum of the launches':<44}{spans.sum() * 1e3:>10.1f}")
        print(f"     {'the call (start to end event)':<44}{np.median(calls) * 1e3:>10.1f}")


if __name__ == "__main__":
    main()
