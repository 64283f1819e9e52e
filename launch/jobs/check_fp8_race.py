"""Back-to-back FP8 fused combines at DeepSeek-V3's sizes, every call held to the unfused
result bit for bit, on two ranks with a GPU each (run under the launcher):

    python launch/run.py -n 2 -- python -m mpi4py launch/jobs/check_fp8_race.py \
        [--tokens 1024] [--routing balanced,skewed] [--calls 48] [--release-by-warpgroup]

Why: on two H200s the bench's FP8 `fused` row (epserve/bench/measure_fp8.py) sometimes
differed from `unfused` in ~1000-1700 elements at 1024 and 2048 tokens per rank, and nothing
else caught it: check_fp8.py runs small shapes and one synchronized forward at a time, and
the bench compares only the last of its calls. Cause (cuda/gemm/grouped_gemm_fp8.cu, the
consumers' `release`): a stage of the GEMM's ring was freed by one arrival per consumer
warpgroup, while the split tails' promotion reads the stage's A scales after the MMA, so the
warpgroup's other warps could read scales that TMA had already overwritten (now every
consumer thread frees the stage after its own reads). Only rows of a
split tail (a tile of at most 64 real rows) in warps 1-3 (tile rows 16-63) can show it.

Per case (routing), at dsv3-prefill-fp8's layer (H 7168, I 2048, E 256, k 8) and the bench's
inputs (epserve/bench: the same seeds, routings and weights):
  - the reference: GEMM 2 with the null sink + the unfused transport + the reduction (the
    bench's `unfused`), twice, equal bit for bit; recv's slots after it kept;
  - `calls` fused calls (GEMM 2 with the peer sink + the reduction, the bench's `fused`) back
    to back with no host wait, each into an output of its own, with recv's slots copied
    after each; every output compared with the reference after the last call;
  - `calls` / 4 FP8 forwards (direct dispatch, peer sink, check off) back to back, the same;
  - `calls` / 4 null-sink GEMM 2 launches back to back, each C compared with the first.
For each differing recv unit (64 columns of one slot) it names the slot's expert, the
expert's rows, the row's tile, whether that tile is a split tail and which consumer warp's
16 rows hold it: the pre-fix race puts them all in split tails, warps 1-3.

--release-by-warpgroup builds the FP8 GEMMs with EPSERVE_GEMM_FP8_RELEASE_BY_WARPGROUP=1,
the pre-fix stage release (a diagnostic build, never shipped), to show that the job catches
the race. Prints `RESULT {json}` lines; exits non-zero if any call of any case differed.
"""

from __future__ import annotations

import argparse
import sys
import time

import cupy
import numpy as np
from job_report import emit, run_cases  # siblings of this script

from epserve.arrays import BF16
from epserve.bench import presets
from epserve.comm import mpi as ep_comm
from epserve.ffn import fp8_stage, gemm
from epserve.runtime import kernels

# every FP8 GEMM the layer may launch: GEMM 2's peer build is $EPSERVE_SINK_STORES's (own-bulk by default)
FP8_GEMMS = ("gemm_fp8_null", "gemm_fp8_peer", "gemm_fp8_peer_ownbulk", "gemm_fp8_peer_bulk", "gemm1_fp8_swiglu")
RACE_KNOB = "EPSERVE_GEMM_FP8_RELEASE_BY_WARPGROUP"
TILE_ROWS, SPLIT_ROWS, WARP_ROWS = 128, 64, 16  # the FP8 GEMM's tile, split tail and warp rows


def bench_inputs(svc, preset, routing, T: int, seed: int):
    """What epserve.bench feeds this point: every rank's routing, this rank's tokens, router
    weights and expert weights (bf16 and FP8), from the bench's seeds."""
    from epserve import quantize_weights
    from epserve.bench.measure import point_inputs

    cfg, rank = svc.config, svc.rank
    at = presets.scaled(preset, tokens_per_rank=T)
    topk_all = routing.draw(at, svc.world, seed + T)
    _, idx, x, w = point_inputs(svc, topk_all, seed)
    rs = cupy.random.RandomState(seed + rank)
    e_loc = cfg.experts_per_rank
    w13 = (rs.standard_normal((e_loc, 2 * cfg.intermediate, cfg.hidden), dtype=np.float32)
           / np.sqrt(cfg.hidden)).astype(BF16)
    w2 = (rs.standard_normal((e_loc, cfg.hidden, cfg.intermediate), dtype=np.float32)
          / np.sqrt(cfg.intermediate)).astype(BF16)
    fp8w = quantize_weights(w13, w2)
    del w13, w2
    return topk_all, idx, x, w, fp8w


def where_rows_live(topk_all, num_experts: int):
    """For every (home rank, token, slot): its expert's rows on the owner and the row's index
    among them (rows are ordered by source rank, token, slot: docs/design.md, "Dispatched rows")."""
    rows = np.zeros(num_experts, np.int64)
    position = []
    for home in range(len(topk_all)):
        idx = np.asarray(topk_all[home])
        pos = np.full(idx.shape, -1, np.int64)
        for t in range(idx.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[t, j])
                if e >= 0:
                    pos[t, j] = rows[e]
                    rows[e] += 1
        position.append(pos)
    return rows, position


def describe_units(diff_units, topk_all, rank: int, rows_live, limit: int = 12):
    """The recv units that differ, with where their rows sat in GEMM 2's tiles (rows_live:
    where_rows_live's answer)."""
    rows, position = rows_live
    idx = np.asarray(topk_all[rank])
    found, by_kind = [], {}
    for t, j, u in diff_units:
        e = int(idx[t, j])
        m = int(position[rank][t, j])
        tile = m // TILE_ROWS
        tile_rows = int(min(TILE_ROWS, rows[e] - tile * TILE_ROWS))
        in_tile = m % TILE_ROWS
        split = tile_rows <= SPLIT_ROWS
        warp = (in_tile % SPLIT_ROWS) // WARP_ROWS
        kind = f"{'split tail' if split else 'full tile'}, warp {warp}"
        by_kind[kind] = by_kind.get(kind, 0) + 1
        if len(found) < limit:
            found.append(dict(token=int(t), slot=int(j), unit=int(u), expert=e, expert_rows=int(rows[e]),
                              tile=tile, tile_rows=tile_rows, row_in_tile=in_tile, split_tail=split, warp=warp))
    return found, by_kind


def differing_units(a, b, H: int):
    """(t, j, unit) of the 64-column units where recv copies a and b [T, k, H] differ."""
    T, k = a.shape[0], a.shape[1]
    bad = (a.view(np.uint16) != b.view(np.uint16)).reshape(T, k, H // 64, 64).any(axis=3)
    return [tuple(int(v) for v in p) for p in cupy.asnumpy(cupy.argwhere(bad))]


def run_case(comm, svc, preset, routing, T: int, calls: int, seed: int) -> dict:
    cfg, rank = svc.config, svc.rank
    H, I, e_loc, E = cfg.hidden, cfg.intermediate, cfg.experts_per_rank, cfg.num_experts
    topk_all, idx, x, w, fp8w = bench_inputs(svc, preset, routing, T, seed)
    record = dict(case=f"{routing.label} T={T}", rank=rank, transport=svc.transport, calls=calls)
    failures = []

    # The bench's set-up (measure_fp8.measure_point_fp8): rows by the direct dispatch, GEMM 1
    # into act buffers of the bench's own, the unfused transport's plan.
    direct = svc.dispatch(x, idx, w, "direct")
    M = direct.num_rows
    buffers = fp8_stage.FP8Buffers(max(M, 1), H, I)
    act = buffers.act
    gemm.run(fp8_stage.gemm1_specs(buffers, direct.rows, direct.expert_offsets, fp8w, e_loc, I, H))
    comb = svc.combiner
    rows_src = svc._send_plan(direct)
    plan = rows_src if svc.transport == "ipc" else svc._host_plan(idx)
    C = cupy.empty((M, H), BF16)
    record["rows"] = int(M)

    def unfused(out):
        gemm.run(fp8_stage.gemm2_specs("null", act, fp8w, C, direct.expert_offsets, e_loc, H, I))
        comb.unfused(C, plan, idx, w, out=out)

    ref, again = cupy.empty((T, H), BF16), cupy.empty((T, H), BF16)
    unfused(ref)
    recv_ref = comb.recv[:T].copy()
    unfused(again)
    svc.check()
    if int(cupy.count_nonzero(ref.view(np.uint16) != again.view(np.uint16))):
        failures.append("two unfused calls differ")

    # Fused, back to back: nothing between the calls but the copies of recv.
    outs = cupy.empty((calls, T, H), BF16)
    snaps = cupy.empty((calls, T, cfg.top_k, H), BF16)
    comm.Barrier()
    start = time.perf_counter()
    for n in range(calls):
        comb.fused(act, fp8w, rows_src, idx, w, I, out=outs[n])
        cupy.copyto(snaps[n], comb.recv[:T])
    svc.check()
    record["fused_s"] = round(time.perf_counter() - start, 3)
    wrong = cupy.asnumpy(cupy.count_nonzero((outs.view(np.uint16) != ref.view(np.uint16)[None]).reshape(calls, -1),
                                            axis=1))
    bad_calls = [n for n in range(calls) if wrong[n]]
    record["fused_wrong"] = {str(n): int(wrong[n]) for n in bad_calls}
    if bad_calls:
        failures.append(f"fused calls {bad_calls[:10]} differ from unfused ({int(wrong.sum())} elements in all)")
    units, kinds, rows_live = [], {}, None
    for n in range(calls):
        diff = differing_units(snaps[n], recv_ref, H)
        if diff:
            rows_live = rows_live or where_rows_live(topk_all, E)
            found, by_kind = describe_units(diff, topk_all, rank, rows_live)
            units.extend(found[:max(0, 12 - len(units))])
            for k, v in by_kind.items():
                kinds[k] = kinds.get(k, 0) + v
    record["recv_units_wrong_by_kind"] = kinds
    record["recv_units_wrong_first"] = units
    if kinds and not bad_calls:
        failures.append("recv slots differ after fused calls (an output did not show it, or a later call's rows came)")
    del outs, snaps

    # Forward (direct dispatch, peer sink), back to back, no host wait.
    n_fwd = max(1, calls // 4)
    fwd = cupy.empty((n_fwd, T, H), BF16)
    for n in range(n_fwd):
        svc.forward(x, idx, w, fp8w, out=fwd[n], check=False)
    svc.check()
    wrong = cupy.asnumpy(cupy.count_nonzero((fwd.view(np.uint16) != ref.view(np.uint16)[None]).reshape(n_fwd, -1),
                                            axis=1))
    record["forward_wrong"] = {str(n): int(v) for n, v in enumerate(wrong) if v}
    if wrong.any():
        failures.append(f"forward calls {[n for n in range(n_fwd) if wrong[n]][:10]} differ from unfused")
    del fwd

    # GEMM 2 with the null sink alone, back to back.
    Cs = cupy.empty((n_fwd, M, H), BF16)
    for n in range(n_fwd):
        gemm.run(fp8_stage.gemm2_specs("null", act, fp8w, Cs[n], direct.expert_offsets, e_loc, H, I))
    wrong = cupy.asnumpy(cupy.count_nonzero((Cs.view(np.uint16) != Cs[:1].view(np.uint16)).reshape(n_fwd, -1),
                                            axis=1))
    record["gemm2_null_wrong"] = {str(n): int(v) for n, v in enumerate(wrong) if v}
    if wrong.any():
        failures.append("null-sink GEMM 2 reruns differ")
    del Cs
    cupy.get_default_memory_pool().free_all_blocks()
    return dict(ok=not failures, failures=failures, **record)


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/check_fp8_race.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1024", help="comma-separated tokens per rank (default: %(default)s)")
    p.add_argument("--routing", default="balanced,skewed", help="comma-separated routings (default: %(default)s)")
    p.add_argument("--calls", type=int, default=48, help="fused calls back to back per case (default: %(default)s)")
    p.add_argument("--seed", type=int, default=17, help="the bench's seed (default: %(default)s)")
    p.add_argument("--release-by-warpgroup", action="store_true",
                   help=f"build the FP8 GEMMs with {RACE_KNOB}=1: the pre-fix stage release, which races")
    args = p.parse_args()
    if args.release_by_warpgroup:  # before any module is loaded: the variants' defines are read at load
        for name in FP8_GEMMS:
            kernels.VARIANTS[name][1][RACE_KNOB] = 1
    from epserve import EPService, MoEConfig

    comm = ep_comm.world()
    preset = presets.get_preset("dsv3-prefill-fp8")
    tokens = [int(t) for t in args.tokens.split(",")]
    routings = [presets.get_routing(r) for r in args.routing.split(",")]
    cfg = MoEConfig(preset.num_experts, preset.top_k, preset.hidden, preset.intermediate, max(tokens),
                    world_size=comm.Get_size(), wait_timeout_s=60.0, expert_dtype="fp8")
    if comm.Get_rank() == 0:
        built = f"with the pre-fix release ({RACE_KNOB}=1)" if args.release_by_warpgroup else "as shipped"
        emit(f"# FP8 GEMMs {built}")
    cases = [(routing, T) for routing in routings for T in tokens]
    with EPService(cfg, comm) as svc:
        return run_cases(comm, "check_fp8_race", cases,
                         lambda case: run_case(comm, svc, preset, case[0], case[1], args.calls, args.seed))


if __name__ == "__main__":
    sys.exit(main())
