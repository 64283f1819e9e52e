"""The direct dispatch alone, kernel by kernel, under the launcher (issue 13):

    python launch/run.py -n 2 -- python -m mpi4py launch/jobs/time_dispatch.py [--preset dsv3-prefill]
        [--tokens 4096] [--hidden H] [--iters 20] [--grids 132:264,64:264] [--own-grids 132:264,264:132]

At the preset's shape with the bench's balanced routing (seed 17 + T) and the bench's x, it
times, the slowest rank reported:
  call      EPService.dispatch(x, idx, w, "direct") as the bench's dispatch-direct row does
            (CUDA events around the call, which waits for its verdict and row count)
  gpu       DirectDispatcher.enqueue alone, event pairs on the stream, each timed call right
            behind an untimed one, so the ranks start it together; the time from each
            kernel's launch to the next one's is that kernel's share (a kernel that waits for
            a peer, layout for the count rows, move for the token rows, includes the wait)
and, where the dispatcher has them (send_blocks_max, expand_blocks, fuse_release,
stage_own_rows, own_in_send), the same per kernel for each move grid in --grids (send blocks :
expand blocks), with the release kernel instead of the move kernel's last block, with the
quantizing move's own rows staged for the bulk copy engine and stored by the warps,
and with the send warps storing this rank's own expert rows (own_in_send) for the default grid
and each in --own-grids; then the
move kernel's phases (the default configuration), from a build
with EPSERVE_DISPATCH_STAMPS (global-timer stamps per block): when the sends end, when this
rank's own rows are expanded, when the expansion ends. After every configuration the rows,
expert_offsets and src_info must equal the host plan's (epserve/dispatch/host_plan.py, moved by the
baseline dispatcher) bit for bit, and so must the NCCL dispatch's (#wrong, summed over
ranks). With an -fp8 preset the service has FP8 experts: the move is the quantizing build and the
references move x quantized by the service's own quantize launch. That launch is also timed
alone (what a stack that hands the dispatch quantized tokens, as DeepEP's FP8 dispatch takes
them, runs before it), and so is the dispatch of its packed rows ("tokens packed already":
EPService.quantize_tokens's rows handed to dispatch, which moves them by the plain move).
--hidden sets the token rows' width: a bf16 preset at H = packed_row_bytes(H') / 2 (3712 for
dsv3's 7168) moves rows of an FP8 packed row's bytes through the bf16 service. Prints a table
on rank 0; exits 1 when anything differs."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import cupy
import numpy as np
from mpi4py import MPI

from epserve import EPService
from epserve.arrays import BF16
from epserve.bench import presets
from epserve.bench.events import samples_ms
from epserve.comm import mpi as ep_comm

# (column, attribute path on the dispatcher); a kernel the dispatcher lacks is left out. The
# names before the route merge (route_count, ...) let this job time an older tree too.
KERNELS = (("route_count", "_count"), ("route_publish", "_publish"), ("count+publish", "route.count_publish"),
           ("route_rank", "_rank"), ("layout", "_layout"), ("rank+layout", "route.rank_layout"), ("move", "_move"),
           ("move", "_move_quantize"), ("release", "_release"))


def move_attr(d, x=None) -> str:
    """The dispatcher's move kernel attribute a call with tokens x launches: with FP8 experts
    and bf16 tokens the quantizing build's (the move quantizes them into packed rows); packed
    rows (uint8) take the plain move."""
    if hasattr(d, "quantizes_call") and x is not None:
        return "_move_quantize" if d.quantizes_call(x) else "_move"
    return "_move_quantize" if getattr(d, "quantizes", False) else "_move"


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _set(obj, path: str, value) -> None:
    *owner, last = path.split(".")
    setattr(_get(obj, ".".join(owner)) if owner else obj, last, value)


def present_kernels(d, x=None) -> tuple:
    def has(path):
        try:
            return _get(d, path) is not None
        except AttributeError:
            return False

    moves = {"_move", "_move_quantize"} - {move_attr(d, x)}  # the move kernel this dispatcher does not launch
    return tuple((name, path) for name, path in KERNELS if path not in moves and has(path))


class Stamped:
    """A kernel that records an event on the stream just before each launch."""

    def __init__(self, fn, name: str, stamps: list):
        self.fn, self.name, self.stamps = fn, name, stamps

    def __call__(self, *args, **kwargs):
        ev = cupy.cuda.Event()
        ev.record()
        self.stamps.append((self.name, ev))
        return self.fn(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self.fn, attr)


def kernel_ms(comm, d, x, idx, iters: int) -> dict:
    """Median per-kernel and total GPU milliseconds of `iters` enqueues, the slowest rank."""
    stamps: list = []
    kernels = present_kernels(d, x)
    saved = {attr: _get(d, attr) for _, attr in kernels}
    per = {name: [] for name, _ in kernels}
    per["total"] = []
    d.launches.prepared = False  # each launch through the wrapped kernel, so it can be stamped
    try:
        for _ in range(iters):
            cupy.cuda.runtime.deviceSynchronize()
            comm.Barrier()
            d.enqueue(x, idx)  # untimed: absorbs the ranks' skew
            for name, attr in kernels:
                _set(d, attr, Stamped(saved[attr], name, stamps))
            stamps.clear()
            d.enqueue(x, idx)
            end = cupy.cuda.Event()
            end.record()
            for name, attr in kernels:
                _set(d, attr, saved[attr])
            end.synchronize()
            marks = stamps + [("end", end)]
            for (name, ev), (_, nxt) in zip(marks, marks[1:]):
                per[name].append(cupy.cuda.get_elapsed_time(ev, nxt))
            per["total"].append(cupy.cuda.get_elapsed_time(marks[0][1], end))
    finally:
        for attr, fn in saved.items():
            _set(d, attr, fn)
        d.launches.prepared = True
    med = {name: float(np.median(v)) if v else 0.0 for name, v in per.items()}
    return {name: comm.allreduce(ms, op=MPI.MAX) for name, ms in med.items()}


def move_phases(comm, d, x, idx, T: int, iters: int) -> dict:
    """From a move kernel built with EPSERVE_DISPATCH_STAMPS: microseconds from the first
    block's start to the last send block's end, to the last expand block done with this
    rank's own rows, and to the last expand block's end; medians, the slowest rank."""
    from epserve.runtime.build import load_module

    attr = move_attr(d)
    quantize = {"EPSERVE_DISPATCH_QUANTIZE": 1} if attr == "_move_quantize" else {}
    mod = load_module("comm/dispatch.cu", {"EPSERVE_DISPATCH_STAMPS": 1, **quantize})
    ptr = mod.get_global("epserve_move_stamps")
    stamps = cupy.ndarray((2048, 3), cupy.uint64, memptr=ptr)
    send = max(1, min(d.send_blocks_max, (T + 7) // 8))
    grid = send + d.expand_blocks
    saved = getattr(d, attr)
    stamped = mod.get_function("epserve_dispatch_move")
    if attr == "_move_quantize" and getattr(d, "_staging_bytes", 0):  # where the own rows may be staged
        stamped.max_dynamic_shared_size_bytes = d._staging_bytes
    setattr(d, attr, stamped)
    out = {"send end": [], "own rows done": [], "expand end": [], "median send block end": []}
    try:
        for _ in range(iters):
            cupy.cuda.runtime.deviceSynchronize()
            comm.Barrier()
            d.enqueue(x, idx)
            stamps.fill(0)
            d.enqueue(x, idx)
            cupy.cuda.runtime.deviceSynchronize()
            st = cupy.asnumpy(stamps[:grid]).astype(np.int64)
            t0 = st[:, 0].min()
            out["send end"].append((st[:send, 2].max() - t0) / 1e3)
            out["median send block end"].append((np.median(st[:send, 2]) - t0) / 1e3)
            out["own rows done"].append((st[send:, 1].max() - t0) / 1e3)
            out["expand end"].append((st[send:, 2].max() - t0) / 1e3)
    finally:
        setattr(d, attr, saved)
    return {name: comm.allreduce(float(np.median(v)), op=MPI.MAX) for name, v in out.items()}


def wrong_bits(direct, ref) -> int:
    M = int(ref[1][-1])
    got = (direct.rows[:M], direct.expert_offsets, direct.src_info[:M])
    n = 0
    for a, b in zip(got, ref):
        if a.shape != b.shape:
            return max(1, b.size)
        n += int((a.view(np.uint8) != b.view(np.uint8)).sum())
    return n


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/time_dispatch.py")
    p.add_argument("--preset", default="dsv3-prefill", choices=sorted(presets.PRESETS))
    p.add_argument("--tokens", type=int, help="tokens per rank (default: the preset's)")
    p.add_argument("--hidden", type=int, help="the token rows' width (default: the preset's; see above)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=17, help="the bench's seed (routing seed + T, x seed + 1000 rank)")
    p.add_argument("--grids", default="", help="move grids to try, send:expand blocks, comma-separated")
    p.add_argument("--own-grids", default="", help="move grids to try with own_in_send, besides the default one")
    args = p.parse_args()
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    pre, cfg, topk_all = presets.balanced_point(args.preset, args.tokens, world, args.seed)
    if args.hidden:
        pre, cfg = dataclasses.replace(pre, hidden=args.hidden), dataclasses.replace(cfg, hidden=args.hidden)
    T, H, E, k = pre.tokens_per_rank, pre.hidden, pre.num_experts, pre.top_k
    bad = 0
    with EPService(cfg, comm) as svc:
        idx = cupy.asarray(topk_all[rank])
        rs = cupy.random.RandomState(args.seed + 1000 * rank)
        x = rs.standard_normal((T, H), dtype=np.float32).astype(BF16)
        w = rs.uniform(0.05, 1.0, (T, k), dtype=np.float32)
        # The reference: the host plan (epserve/dispatch/host_plan.py) and its row move, which share no
        # kernel with the direct dispatch; the NCCL dispatch must give it too.
        plan = svc._host_plan(idx)
        # With FP8 experts the rows move as packed FP8 rows: the reference moves x quantized
        # by the service's own quantize launch (what the NCCL and host-planned paths move).
        ref = (svc.baseline.dispatch(svc._rows_to_dispatch(x, "nccl"), plan), plan.expert_offsets, plan.src_info)
        nccl_wrong = comm.allreduce(wrong_bits(svc.dispatch(x, idx, w, "nccl"), ref))
        bad += nccl_wrong
        d = svc.direct
        rows = []

        def check(label):
            nonlocal bad
            svc.check()
            cupy.cuda.runtime.deviceSynchronize()
            wrong = comm.allreduce(wrong_bits(svc.dispatch(x, idx, w, "direct"), ref))
            bad += wrong
            return wrong

        wrong = check("default")
        comm.Barrier()
        call = comm.allreduce(float(np.median(samples_ms(lambda: svc.dispatch(x, idx, w, "direct"), 3, args.iters))),
                              op=MPI.MAX)
        quantize = None
        if svc.fp8:  # the quantize launch alone: x to packed rows, as the NCCL path runs it
            quantize = comm.allreduce(
                float(np.median(samples_ms(lambda: svc._rows_to_dispatch(x, "nccl"), 3, args.iters))), op=MPI.MAX)
        default = (getattr(d, "send_blocks_max", None), getattr(d, "expand_blocks", None))

        def parse(specs):
            return [tuple(int(v) for v in spec.split(":")) for spec in filter(None, specs.split(","))]

        # (label, grid or None for the default, own_in_send, fuse_release, stage_own_rows)
        staged = getattr(d, "stage_own_rows", False)  # the default's
        stageable = getattr(d, "_staging_bytes", 0) > 0  # the quantizing move can stage its own rows
        configs = [("default", None, False, True, staged)]
        if default[0] is not None:
            configs[0] = (f"default {default[0]}:{default[1]}", None, False, True, staged)
            configs += [(f"{s}:{e}", (s, e), False, True, staged) for s, e in parse(args.grids)]
        if hasattr(d, "fuse_release"):
            configs.append(("default, release kernel", None, False, False, staged))
        if stageable:  # the quantizing move's own rows staged for the bulk copy engine, and stored by the warps
            configs.append(("own rows staged", None, False, True, True))
            configs.append(("own rows by the warps", None, False, True, False))
        if hasattr(d, "own_in_send"):
            configs.append((f"own in send {default[0]}:{default[1]}", None, True, True, staged))
            configs += [(f"own in send {s}:{e}", (s, e), True, True, staged) for s, e in parse(args.own_grids)]
        for n, (label, grid, own, fused, stage) in enumerate(configs):
            if n:  # the first is what the dispatcher does already, checked above
                if default[0] is not None:
                    d.send_blocks_max, d.expand_blocks = grid or default
                    d._shapes.clear()
                if hasattr(d, "fuse_release"):
                    d.fuse_release = fused
                if hasattr(d, "own_in_send"):
                    d.own_in_send = own
                if stageable:
                    d.stage_own_rows = stage
                wrong = check(label)
            ms = kernel_ms(comm, d, x, idx, args.iters)
            rows.append((label, ms, wrong))
        if default[0] is not None:
            d.send_blocks_max, d.expand_blocks = default
            d._shapes.clear()
        if hasattr(d, "own_in_send"):
            d.own_in_send = False
        if stageable:
            d.stage_own_rows = staged
        if hasattr(d, "fuse_release"):
            d.fuse_release = True
            check("default again")
        if getattr(d, "quantizes", False):  # tokens that come quantized: the plain move of their packed rows
            packed = svc.quantize_tokens(x)  # as a stack whose tokens come quantized hands them over
            svc.check()
            cupy.cuda.runtime.deviceSynchronize()
            wrong = comm.allreduce(wrong_bits(svc.dispatch(packed, idx, w, "direct"), ref))
            bad += wrong
            ms = kernel_ms(comm, d, packed, idx, args.iters)
            rows.append(("tokens packed already", ms, wrong))
        phases = move_phases(comm, d, x, idx, T, args.iters) if hasattr(d, "send_blocks_max") else None
        # A routing the bench never draws: some tokens name an expert twice (route_rank's
        # token-by-token path), some slots unused.
        odd = idx.copy()
        odd[::5, 1] = odd[::5, 0]
        odd[::3, k - 1] = -1
        plan = svc._host_plan(odd)
        odd_ref = (svc.baseline.dispatch(svc._rows_to_dispatch(x, "nccl"), plan), plan.expert_offsets, plan.src_info)
        odd_wrong = comm.allreduce(wrong_bits(svc.dispatch(x, odd, w, "direct"), odd_ref))
        if hasattr(d, "own_in_send"):  # the same with the send warps storing the own rows
            d.own_in_send = True
            odd_wrong += comm.allreduce(wrong_bits(svc.dispatch(x, odd, w, "direct"), odd_ref))
            d.own_in_send = False
        if stageable:  # and with the own rows staged and not
            d.stage_own_rows = not staged
            odd_wrong += comm.allreduce(wrong_bits(svc.dispatch(x, odd, w, "direct"), odd_ref))
            d.stage_own_rows = staged
        bad += odd_wrong
        svc.check()
        M = int(ref[1][-1])
        tok_pos = getattr(d, "_tok_pos", None)
        if tok_pos is None and hasattr(d, "route"):
            tok_pos = d.route.tok_pos
        sent = int(cupy.count_nonzero(tok_pos[:T] >= 0)) if tok_pos is not None else 0
        sent_all = comm.gather(sent)
        if rank == 0:
            print(f"# time_dispatch: {world} ranks, {args.preset} T={T} H={H} E={E} k={k}, "
                  f"{cfg.expert_dtype} experts{' (the move quantizes)' if getattr(d, 'quantizes', False) else ''}, "
                  f"balanced routing, "
                  f"rows received by rank 0: {M}; token rows (all destinations) by rank: {sent_all}; "
                  f"{args.iters} iterations, median, slowest rank; NCCL dispatch #wrong {nccl_wrong}")
            print(f"call (EPService.dispatch, as the bench's dispatch-direct): {call * 1e3:.1f} us")
            if quantize is not None:
                print(f"quantize alone (x to packed FP8 rows, one launch): {quantize * 1e3:.1f} us")
            names = [n for n, _ in present_kernels(d)] + ["total"]
            print(f"{'move grid':<26}" + "".join(f"{n:>14}" for n in names) + f"{'#wrong':>8}")
            for label, ms, wr in rows:
                print(f"{label:<26}" + "".join(f"{ms.get(n, 0.0) * 1e3:>14.1f}" for n in names) + f"{wr:>8}")
            print("# times in us; each kernel's is from its launch to the next kernel's on the stream")
            print(f"routing with repeated experts and unused slots (own_in_send off and on, own rows staged "
                  f"and not, where they exist): "
                  f"#wrong {odd_wrong}")
            if phases:
                print("move, default grid, from its first block's start (us): "
                      + ", ".join(f"{name} {v:.1f}" for name, v in phases.items()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
