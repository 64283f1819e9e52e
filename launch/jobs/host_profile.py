"""Host time per layer call, against the GPU's time for the same call, under the launcher:

    python launch/run.py -n 1 -- python -m mpi4py launch/jobs/host_profile.py [--tokens 512] [--calls 50]

At a small layer the GPU finishes before Python has issued the next kernel, so the host's
work per call (argument packing, tensor maps, kernel lookups, synchronizations) sets the
layer's time. For each path this prints the GPU time of one call (CUDA events, the stream
kept busy by a long kernel first, so launch gaps cannot show), the wall time per call of
back-to-back calls, and cProfile's top functions by own time. For the paths that never wait
for the GPU (forward with check=False) it also prints the host's own time per call: the
calls are issued while a long kernel holds the stream, so none of them waits for the GPU."""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import time

import cupy
import numpy as np

from epserve import EPService, MoEConfig
from epserve.check.testing import layer_inputs
from epserve.comm import mpi as ep_comm


def gpu_ms(fn, iters: int) -> float:
    """Median GPU time of fn with the host running ahead: a sleep kernel first holds the
    stream, so every launch of fn is queued before the first one starts. A path that
    synchronizes inside (dispatch reads a count on the host) still shows the host's time
    after that point."""
    stream = cupy.cuda.get_current_stream()
    times = []
    for _ in range(iters):
        cupy.cuda.runtime.deviceSynchronize()
        _spin_gpu(2.0)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


_SPIN = cupy.RawKernel(r"""
extern "C" __global__ void spin(long long ns) {
  long long start; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) { long long now; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); if (now - start > ns) break; }
}""", "spin")


def _spin_gpu(ms: float) -> None:
    _SPIN((1,), (1,), (np.int64(ms * 1e6),))


def host_ms(fn, calls: int) -> float:
    """Host time per call of a path that never waits for the GPU: issued behind a long kernel,
    so the GPU cannot slow the loop down."""
    cupy.cuda.runtime.deviceSynchronize()
    _spin_gpu(50.0)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    took = time.perf_counter() - t0
    cupy.cuda.runtime.deviceSynchronize()
    return took * 1e3 / calls


def host_breakdown(svc, fn, calls: int) -> dict:
    """Host time per call of each stage of an eager forward (issued behind a long kernel, as
    host_ms): the input checks, the dispatch's launches, GEMM 1's, the combine's (GEMM 2 with
    its reduction) and the rest, so the 50 us target can be chased stage by stage. The
    launches are timed inside their stages too; xN is how many times a stage ran per call."""
    from epserve.runtime import launch as launch_mod
    from epserve.runtime import replay as replay_mod

    spent, counts = {}, {}

    def timed(name, method):
        def wrapper(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            t0 = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    patched = [(svc, "_tokens"), (svc, "_weights"), (svc, "_forward_replayed"), (svc.direct, "enqueue"),
               (svc._gemm1, "run"),
               (svc.combiner, "fused"), (launch_mod.PreparedLaunch, "__call__"), (replay_mod.KernelGraph, "launch")]
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name in patched]
    for obj, name in patched:
        label = {launch_mod.PreparedLaunch: "one launch (all)", replay_mod.KernelGraph: "graph update + launch"}
        setattr(obj, name, timed(label.get(obj, name), getattr(obj, name)))
    try:
        total = host_ms(fn, calls) * 1e3
    finally:
        for obj, name, old in saved:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
    out = {f"{k} x{counts[k] / calls:g}": v * 1e6 / calls for k, v in spent.items()}
    out["forward (whole)"] = total
    return out


def launch_floor_us() -> tuple[float, float]:
    """Host time of one bare CuPy launch (one pre-wrapped argument; fourteen), for scale: a
    forward is about a dozen launches."""
    from epserve.runtime.kernel_structs import i32, u64

    one = (u64(0),)
    many = (u64(0),) + (i32(1),) * 13
    out = []
    for kernel, args in ((_NOP1, one), (_NOP14, many)):
        kernel((1,), (1,), args)  # compiled and loaded before the clock starts
        cupy.cuda.runtime.deviceSynchronize()
        _spin_gpu(50.0)
        t0 = time.perf_counter()
        for _ in range(200):
            kernel((1,), (1,), args)
        out.append((time.perf_counter() - t0) * 1e6 / 200)
        cupy.cuda.runtime.deviceSynchronize()
    return out[0], out[1]


_NOP_SRC = r"""
extern "C" __global__ void nop1(long long a) {}
extern "C" __global__ void nop14(long long a, int b, int c, int d, int e, int f, int g, int h, int i, int j, int k,
                                 int l, int m, int n) {}"""
_NOP1, _NOP14 = cupy.RawKernel(_NOP_SRC, "nop1"), cupy.RawKernel(_NOP_SRC, "nop14")


def rebuilt(svc, x, idx, w, w13, w2):
    """forward p+d check=F with its launches built anew, not replayed (runtime/replay.py)."""
    svc.replay_forward = False
    try:
        return svc.forward(x, idx, w, w13, w2, "peer", "direct", check=False)
    finally:
        svc.replay_forward = True


def wall_ms(fn, calls: int) -> float:
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    return (time.perf_counter() - t0) * 1e3 / calls


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/host_profile.py")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    cfg = MoEConfig(args.experts, args.top_k, args.hidden, args.intermediate, args.tokens, world_size=world)
    with EPService(cfg, comm) as svc:
        mine = layer_inputs(3, [args.tokens] * world, args.experts, args.top_k, args.hidden, args.intermediate)[rank]
        x, idx, w, w13, w2 = (cupy.asarray(a) for a in (mine.x, mine.topk_idx, mine.topk_weights, mine.w13, mine.w2))
        d = svc.dispatch(x, idx, w, "direct")
        # the inputs at other addresses every call, as a serving loop hands over new arrays
        rotation = itertools.cycle([(x.copy(), idx.copy(), w.copy()) for _ in range(4)])
        paths = {
            "dispatch direct": lambda: svc.dispatch(x, idx, w, "direct"),
            "dispatch nccl": lambda: svc.dispatch(x, idx, w, "nccl"),
            "expert_ffn peer": lambda: svc.expert_ffn(d, w13, w2, "peer"),
            "forward peer+direct": lambda: svc.forward(x, idx, w, w13, w2, "peer", "direct"),
            "forward p+d check=F": lambda: svc.forward(x, idx, w, w13, w2, "peer", "direct", check=False),
            "forward null+nccl": lambda: svc.forward(x, idx, w, w13, w2, "null", "nccl"),
            "forward p+d check=F rebuilt": lambda: rebuilt(svc, x, idx, w, w13, w2),
            "forward p+d check=F new arrays": lambda: svc.forward(*next(rotation), w13, w2, "peer", "direct",
                                                                  check=False),
        }
        for fn in paths.values():
            fn()
        if rank == 0:
            print(f"# host_profile: {world} rank(s), T={args.tokens} H={args.hidden} I={args.intermediate} "
                  f"E={args.experts} k={args.top_k}; ms per call")
            print(f"{'path':<32}{'GPU ms':>9}{'wall ms':>9}{'host ms':>9}")
        for name, fn in paths.items():
            g = gpu_ms(fn, 5)
            wl = wall_ms(fn, args.calls)
            hs = f"{host_ms(fn, 20):>9.4f}" if "check=F" in name else f"{'-':>9}"
            if rank == 0:
                print(f"{name:<32}{g:>9.3f}{wl:>9.3f}{hs}", flush=True)
        if rank == 0:
            print("# host time of 'forward p+d check=F' by stage, us per call:")
        for stage, us in host_breakdown(svc, paths["forward p+d check=F"], 20).items():
            if rank == 0:
                print(f"#   {stage:<28}{us:>8.1f}")
        one, many = launch_floor_us()
        if rank == 0:
            print(f"# one bare launch: {one:.2f} us of host time (1 argument), {many:.2f} us (14 arguments)")
        for name in ("forward peer+direct", "forward p+d check=F"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                paths[name]()
            cupy.cuda.runtime.deviceSynchronize()
            prof.disable()
            if rank == 0:
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
                print(f"# cProfile of {args.calls} calls of {name!r}, by own time")
                print(out.getvalue())


if __name__ == "__main__":
    main()
