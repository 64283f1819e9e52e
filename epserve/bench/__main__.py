"""epserve's benchmark, run under the launcher on W ranks (`make bench`):

    python launch/run.py -n 2 -- python -m mpi4py -m epserve.bench [--presets ...] [--out results/x]

For each preset and routing, a sweep of tokens per rank; at each point every path of
epserve.bench.measure, timed side by side in one run, checked (#wrong), with the hardware
limits measured in the same run and the floor they give. Prints a preamble and a table like
nccl-tests, and writes JSON and PNG plots to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy
import numpy as np

from .. import comm as ep_comm
from ..arrays import BF16
from ..config import MoEConfig
from . import limits, measure, plots, presets, report
from .progress import progress
from .results import Run, measured_row, with_baselines
from .timing import slowest_rank


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m epserve.bench", description=__doc__.splitlines()[0])
    p.add_argument("--presets", default=",".join(presets.PRESETS), help="comma-separated preset names")
    p.add_argument("--routing", default="balanced,skewed", help="balanced, skewed or skewed:<zipf>, comma-separated")
    p.add_argument("--tokens", default=None,
                   help="comma-separated tokens per rank for every preset (default: 1/4, 1/2 and 1 x the preset's)")
    p.add_argument("--quick", action="store_true",
                   help="small shapes of every preset (hidden 512, intermediate 256, 32 experts, 64 tokens): a check "
                        "that every path runs, not a measurement")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--out", default=None, help="directory for bench.json and the plots")
    return p.parse_args(argv)


def sweep(preset, tokens_arg):
    if tokens_arg:
        return [int(t) for t in tokens_arg.split(",")]
    T = preset.tokens_per_rank
    return sorted({max(1, T // 4), max(1, T // 2), T})


def shape_of(preset, quick: bool):
    if not quick:
        return preset
    return presets.scaled(preset, tokens_per_rank=64, hidden=512, intermediate=256,
                          num_experts=min(32, preset.num_experts), top_k=min(preset.top_k, 4))


def machine_info(comm, svc, rates):
    info = report.base_info(rates)
    props = cupy.cuda.runtime.getDeviceProperties(svc.device)
    names = comm.allgather(props["name"].decode())
    info.update(
        world_size=comm.Get_size(), gpus=names, link=comm.Get_size() > 1 and not svc.shared_gpu,
        driver=cupy.cuda.runtime.driverGetVersion(), cuda=cupy.cuda.runtime.runtimeGetVersion(),
        cupy=cupy.__version__, nccl=_nccl_version(),
        transport=f"{svc.transport} ({'ranks share one GPU: no NVLink, times are not performance' if svc.shared_gpu else 'one GPU per rank'})",
    )
    return info


def _nccl_version():
    try:
        from cupy.cuda import nccl

        return nccl.get_version()
    except Exception as exc:  # noqa: BLE001 - a missing NCCL is recorded, not fatal
        return f"unavailable ({exc})"


def main(argv=None) -> int:
    from ..service import EPService

    args = parse_args(argv)
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    chosen = [shape_of(presets.get_preset(name), args.quick) for name in args.presets.split(",")]
    routings = [presets.get_routing(spec) for spec in args.routing.split(",")]
    rows, info = [], None
    for preset in chosen:
        points = sweep(preset, args.tokens)
        cfg = MoEConfig(preset.num_experts, preset.top_k, preset.hidden, preset.intermediate, max(points),
                        world_size=world, wait_timeout_s=60.0)
        svc = EPService(cfg, comm)
        if info is None:  # the limits, once, on the first service's buffers
            rates = limits.measure(comm, svc.combiner._recv, svc.shared_gpu)
            info = machine_info(comm, svc, rates)
            if rank == 0:
                print("\n".join(report.preamble(info)), flush=True)
        e_loc = cfg.experts_per_rank
        rs = cupy.random.RandomState(args.seed + rank)
        w13 = (rs.standard_normal((e_loc, 2 * cfg.intermediate, cfg.hidden), dtype=np.float32)
               / np.sqrt(cfg.hidden)).astype(BF16)
        w2 = (rs.standard_normal((e_loc, cfg.hidden, cfg.intermediate), dtype=np.float32)
              / np.sqrt(cfg.intermediate)).astype(BF16)
        jobs = [(routing, T) for routing in routings for T in points]
        for routing, T in progress(jobs, rank=rank, label=lambda j: f"{preset.name} {j[0].label} T={j[1]}"):
            at = presets.scaled(preset, tokens_per_rank=T)
            topk_all = routing.draw(at, world, args.seed + T)
            results = measure.measure_point(svc, w13, w2, topk_all, args.seed, args.warmup, args.iters)
            gathered = comm.gather([r.samples_ms for r in results], root=0)
            if rank == 0:
                slowest = slowest_rank([{r.path: ms for r, ms in zip(results, g)} for g in gathered])
                for n, r in enumerate(results):
                    rows.append(measured_row(at, routing, r.path, slowest[r.path], r.work, rates,
                                             per_rank_ms=[g[n] for g in gathered], wrong=r.wrong))
        del w13, w2
        svc.close()
    if rank != 0:
        return 0
    rows = with_baselines(rows, measure.UNFUSED, measure.LIBRARY)
    print("\n".join(report.table(rows)), flush=True)
    wrong = sum(r.wrong or 0 for r in rows)
    print(f"# total #wrong: {wrong}", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report.write_json(out / "bench.json", Run(info, rows))
        made = plots.plot_presets(rows, out) + [plots.plot_speedups(rows, out / "speedups.png")]
        print(f"# wrote {out / 'bench.json'} and {len(made)} plots", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
