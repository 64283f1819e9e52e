"""epserve's benchmark: the fused layer against the unfused one and a cuBLAS + NCCL library
baseline, on every rank of an MPI job, with the hardware's limits measured in the same run.

Run it under the launcher on W ranks (`make bench NP=W BENCH_ARGS="..."` does this):

    python launch/run.py -n 2 -- python -m mpi4py -m epserve.bench [options]

For each preset and routing it sweeps tokens per rank; at each point it times every path
side by side (CUDA-event medians, the slowest rank's), checks each path that has a reference
(#wrong: elements that differ from the unfused output, bitwise; for the library paths, the
elements of rows whose relative error exceeds 1e-2), and relates each time to the floor the measured limits give. It prints a
preamble (machine, limits) and a table, and with --out writes bench.json and PNG plots there.
The exit status is 1 when any path got a wrong element. It needs NVIDIA Hopper GPUs; where
ranks share one GPU the times are not performance (no link is crossed).

The -fp8 presets (dsv3-prefill-fp8, dsv3-decode-fp8) run the service with FP8 experts
(epserve/bench/measure_fp8.py): their GEMM shares are of an FP8 dense limit measured in the
same run (the faster of our FP8 GEMM and cuBLASLt's block-scaled one at 8192^3, both printed in
a line of their own); their library baseline is `layer-library` on cuBLASLt's block-scaled
FP8 GEMM per expert (epserve/bench/cublaslt.py, where ranks have NCCL); and a line per point
reports the FP8 layer's relative error against the bf16 layer (not asserted).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import cupy
import numpy as np

from epserve.arrays import BF16
from epserve.bench import cublaslt, limits, measure, plots, presets, report
from epserve.bench.host_calls import counting_comm
from epserve.bench.measure_fp8 import measure_point_fp8
from epserve.bench.progress import progress
from epserve.bench.results import Run, measured_row, with_baselines
from epserve.bench.timing import slowest_rank
from epserve.comm import mpi as ep_comm
from epserve.config import MoEConfig
from epserve.ffn.fp8 import quantize_weights
from epserve.runtime.gpu_probe import stopped_without_gpu

# --quick: every preset at this small shape (num_experts and top_k capped), to check that every
# path runs, not to measure.
QUICK_SHAPE = dict(tokens_per_rank=64, hidden=512, intermediate=256)
QUICK_MAX_EXPERTS, QUICK_MAX_TOP_K = 32, 4


def _epilog() -> str:
    rows = [f"  {p.name:<14} hidden {p.hidden:>5}, intermediate {p.intermediate:>5}, {p.num_experts:>3} experts, "
            f"top-{p.top_k}, {p.tokens_per_rank} tokens per rank" for p in presets.PRESETS.values()]
    # measure's docstring describes each path after "Paths ...:"; the names alone if it ever does not
    described = (measure.__doc__ or "").partition("Paths")[2].partition(":\n")[2].rstrip()
    paths = described or "    " + ", ".join(measure.PATHS)
    return "presets (real models' MoE layers):\n" + "\n".join(rows) + "\n\npaths timed at every point:\n" + paths


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m epserve.bench", description=__doc__, epilog=_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default=",".join(presets.PRESETS),
                   help="comma-separated preset names, listed below (default: all, %(default)s)")
    p.add_argument("--routing", default="balanced,skewed",
                   help="comma-separated routings: balanced (every expert equally likely), skewed (Zipf law over "
                        f"the experts, exponent {presets.DEFAULT_ZIPF}) or skewed:<exponent> (default: %(default)s)")
    p.add_argument("--tokens", default=None,
                   help="comma-separated tokens per rank, for every preset (default: 1/4, 1/2 and 1 x the preset's)")
    p.add_argument("--quick", action="store_true",
                   help=f"every preset shrunk to hidden {QUICK_SHAPE['hidden']}, intermediate "
                        f"{QUICK_SHAPE['intermediate']}, at most {QUICK_MAX_EXPERTS} experts and top-{QUICK_MAX_TOP_K}, "
                        f"{QUICK_SHAPE['tokens_per_rank']} tokens: a check that every path runs, not a measurement")
    p.add_argument("--as-rank-of", type=int, default=1, metavar="W",
                   help="one GPU standing in for one rank of W: every preset with 1/W of its experts, so the "
                        "expert GEMMs get one rank's shape at W ranks (the same rows per expert; nothing crosses a "
                        "link, and the preset's name gets /scaled) (default: %(default)s, the presets as they are)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per path and point (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed iterations before them (default: %(default)s)")
    p.add_argument("--seed", type=int, default=17, help="seed of the weights, inputs and routings (default: %(default)s)")
    p.add_argument("--out", default=None,
                   help="directory for bench.json and the plots (default: none, the table only; make bench uses "
                        "results/h200x<NP>)")
    return p.parse_args(argv)


def sweep(preset, tokens_arg):
    if tokens_arg:
        return [int(t) for t in tokens_arg.split(",")]
    T = preset.tokens_per_rank
    return sorted({max(1, T // 4), max(1, T // 2), T})


def shape_of(preset, quick: bool, as_rank_of: int = 1):
    """The preset as the run measures it: shrunk by --quick, and with 1 / as_rank_of of its
    experts (--as-rank-of): one rank of W receives T x k rows over E / W experts, which is
    what one rank with E / W experts receives, so the expert GEMMs have that rank's shape."""
    if as_rank_of != 1:
        if as_rank_of < 1 or preset.num_experts % as_rank_of or preset.num_experts // as_rank_of < preset.top_k:
            raise SystemExit(f"--as-rank-of {as_rank_of}: {preset.name}'s {preset.num_experts} experts do not split "
                             f"into {as_rank_of} ranks of at least top-{preset.top_k} experts each")
        preset = presets.scaled(preset, num_experts=preset.num_experts // as_rank_of)
    if not quick:
        return preset
    return presets.scaled(preset, **QUICK_SHAPE, num_experts=min(QUICK_MAX_EXPERTS, preset.num_experts),
                          top_k=min(preset.top_k, QUICK_MAX_TOP_K))


def machine_info(comm, svc, rates):
    info = report.base_info(rates)
    props = cupy.cuda.runtime.getDeviceProperties(svc.device)
    names = comm.allgather(props["name"].decode())
    info.update(
        world_size=comm.Get_size(), gpus=names,
        link=comm.Get_size() > 1 and not svc.shared_gpu and svc.nodes.ranks_per_node > 1,
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
    from epserve.layer.service import EPService

    args = parse_args(argv)
    if stopped_without_gpu("python -m epserve.bench"):
        return 1
    comm = counting_comm(ep_comm.world())  # the same communicator, its MPI calls counted per path
    rank, world = comm.Get_rank(), comm.Get_size()
    chosen = [shape_of(presets.get_preset(name), args.quick, args.as_rank_of) for name in args.presets.split(",")]
    routings = [presets.get_routing(spec) for spec in args.routing.split(",")]
    rows, info, fp8_rates = [], None, None
    for preset in chosen:
        points = sweep(preset, args.tokens)
        cfg = MoEConfig(preset.num_experts, preset.top_k, preset.hidden, preset.intermediate, max(points),
                        world_size=world, wait_timeout_s=60.0, expert_dtype=preset.expert_dtype)
        svc = EPService(cfg, comm)
        if info is None:  # the limits, once, on the first service's buffers
            rates = limits.measure(comm, svc.combiner._recv, svc.shared_gpu, svc.nodes.ranks_per_node)
            info = machine_info(comm, svc, rates)
            if rank == 0:
                print("\n".join(report.preamble(info)), flush=True)
        e_loc = cfg.experts_per_rank
        rs = cupy.random.RandomState(args.seed + rank)
        w13 = (rs.standard_normal((e_loc, 2 * cfg.intermediate, cfg.hidden), dtype=np.float32)
               / np.sqrt(cfg.hidden)).astype(BF16)
        w2 = (rs.standard_normal((e_loc, cfg.hidden, cfg.intermediate), dtype=np.float32)
              / np.sqrt(cfg.intermediate)).astype(BF16)
        fp8w, point_rates = None, rates
        if preset.expert_dtype == "fp8":  # rated against the faster dense FP8 GEMM, measured here
            fp8w = quantize_weights(w13, w2)
            if fp8_rates is None:
                from mpi4py import MPI

                mine = limits.fp8_gemm_rates()  # the same names on every rank, absent where unreachable
                dense = {name: comm.allreduce(mine.get(name, (0.0, None))[0], op=MPI.MIN)
                         for name in ("ours", "cuBLASLt")}
                dense = {name: r for name, r in dense.items() if r > 0}
                clocks = comm.allgather({name: mhz for name, (_, mhz) in mine.items()})  # by rank
                best = max(dense, key=dense.get)
                fp8_rates = dataclasses.replace(rates, gemm_flop_s=dense[best])
                info["fp8_dense"] = {name: {"tflop_s": r / 1e12, "sm_mhz": [c.get(name) for c in clocks]}
                                     for name, r in dense.items()}
                if rank == 0:
                    print(f"# FP8 dense GEMM limit, 8192^3 with 1 x 128 and 128 x 128 scales, slowest rank: "
                          f"{report.fp8_dense_text(info['fp8_dense'])}; the -fp8 presets' GEMM shares use the faster "
                          f"({best})" + ("" if "cuBLASLt" in dense else f"; cuBLASLt: {cublaslt.unavailable()}"),
                          flush=True)
            point_rates = fp8_rates
        jobs = [(routing, T) for routing in routings for T in points]
        for routing, T in progress(jobs, rank=rank, label=lambda j: f"{preset.name} {j[0].label} T={j[1]}"):
            at = presets.scaled(preset, tokens_per_rank=T)
            topk_all = routing.draw(at, world, args.seed + T)
            if fp8w is None:
                results = measure.measure_point(svc, w13, w2, topk_all, args.seed, args.warmup, args.iters)
            else:
                results, err = measure_point_fp8(svc, w13, w2, fp8w, topk_all, args.seed, args.warmup, args.iters)
                if rank == 0:  # reported, not asserted: what FP8 costs against the bf16 layer
                    print(f"# {at.name} {routing.label} T={T}: FP8 layer vs bf16 layer, relative error {err:.4f}",
                          flush=True)
            gathered = comm.gather([(r.samples_ms, r.sm_mhz, r.sm_mhz_during) for r in results], root=0)
            if rank == 0:
                slowest = slowest_rank([{r.path: ms for r, (ms, _, _) in zip(results, g)} for g in gathered])
                for n, r in enumerate(results):
                    rows.append(measured_row(at, routing, r.path, slowest[r.path], r.work, point_rates,
                                             per_rank_ms=[g[n][0] for g in gathered], wrong=r.wrong,
                                             host_waits=r.host_waits, mpi_calls=r.mpi_calls,
                                             per_rank_mhz=[g[n][1] for g in gathered],
                                             per_rank_mhz_during=[g[n][2] for g in gathered]))
        del w13, w2, fp8w
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
