"""Fuzz the layer over random cases (epserve/check/fuzz.py), run under the launcher:

    python launch/run.py -n 2 [--share-gpu] -- python -m mpi4py launch/jobs/fuzz.py \\
        --seed S --start I --count N [--share-gpu-ok]
    python launch/jobs/fuzz.py --list --seed S --start I --count N [--world-size W]

Every rank builds case i from (S, i) alone, so all ranks agree on it without a message. Per
case: forward fused (peer sink, direct dispatch) and unfused (null sink, NCCL dispatch) into
NaN-poisoned outputs; they must be bitwise equal, fully written, and within 1e-2 of the
float64 reference (FP8: every rank's act codes, as GEMM 1 computes them on the reference's
rows, inside the float64 chain's intervals, and the output within 1e-2 of the chain finished
from those codes; fp8_reference_failures says why). A failing case prints
`FAIL case I: <what> -- replay: <command>` (rank 0) and the run goes on, except after an
error from outside epserve (a CUDA fault), which may leave the GPU unusable and ends the run.
Ends with `# fuzz: N cases, K wrong` and a `RESULT` line per rank; exits 1 if K > 0 or the
run ended early, 2 on a refused setting.

Ranks sharing a GPU run the unfused baseline over the IPC copy, since NCCL refuses two ranks
on one device; the job stops unless --share-gpu-ok says that baseline is what is wanted.
`--list` prints the cases and their replay commands, touching neither GPU nor MPI (epserve
must be importable: installed by `make install`, or PYTHONPATH=.).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import OrderedDict

import cupy
import numpy as np
from job_report import report  # a sibling of this script

from epserve import EPService, quantize_weights
from epserve.check import fp8_bounds
from epserve.check.fp8_layer_reference import finish_from_act, quantized_weights, reference_layer_fp8
from epserve.check.fp8_reference import E4M3, scale_ld
from epserve.check.fuzz import WAIT_TIMEOUT_S, generate
from epserve.check.reference import reference_layer, rel_error
from epserve.check.testing import BF16, bf16_bits
from epserve.comm import mpi as ep_comm
from epserve.comm.nccl import gpus_shared
from epserve.errors import EPServeError
from epserve.ffn import gemm_fp8

# Services kept open for reuse by later cases of the same config; each holds symmetric
# buffers of up to tens of MiB, so the least recently used one is closed past this count.
MAX_OPEN_SERVICES = 8
REL_ERROR_LIMIT = 1e-2
# A case takes well under a second and every device wait ends within WAIT_TIMEOUT_S, so a
# case still running after this is hung: say which before the launcher's timeout kills it.
HUNG_CASE_S = 3 * WAIT_TIMEOUT_S


def parse_args(argv):
    p = argparse.ArgumentParser(prog="launch/jobs/fuzz.py", description="Fuzz the layer over the random cases "
                                "of epserve/check/fuzz.py.")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--start", type=int, default=0, help="index of the first case")
    p.add_argument("--count", type=int, required=True, help="number of cases")
    p.add_argument("--share-gpu-ok", action="store_true",
                   help="run even where ranks share a GPU (the unfused baseline is then the IPC copy, not NCCL)")
    p.add_argument("--list", action="store_true", help="print the cases and their replay commands; no GPU, no MPI")
    p.add_argument("--world-size", type=int, default=2, help="ranks to generate the cases for, with --list")
    args = p.parse_args(argv)
    if args.seed < 0 or args.start < 0 or args.count < 0:
        p.error("--seed, --start and --count must be >= 0")
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    return args


def list_cases(args) -> int:
    for i in range(args.start, args.start + args.count):
        case = generate(args.seed, i, args.world_size)
        print(f"case {i}: {case.describe()}")
        print(f"  replay: {case.replay_command()}")
    return 0



def run_case(svc, case, rank) -> list[str]:
    """This rank's failures on one case (empty when it passed)."""
    inputs = case.inputs()
    me = inputs[rank]
    x, idx, w, w13, w2 = me.on_device()
    if case.expert_dtype == "fp8":  # one FP8Weights holds both projections (w2 None)
        w13, w2 = quantize_weights(w13, w2), None
    T, H = me.x.shape
    # Poisoned, so an element the layer fails to write shows as NaN.
    fused_out = cupy.full((T, H), np.nan, BF16)
    unfused_out = cupy.full((T, H), np.nan, BF16)
    fused = svc.forward(x, idx, w, w13, w2, sink="peer", dispatch="direct", out=fused_out)
    unfused = svc.forward(x, idx, w, w13, w2, sink="null", dispatch="nccl", out=unfused_out)
    svc.check()
    failures = []
    for label, got in (("fused", fused), ("unfused", unfused)):
        if np.isnan(cupy.asnumpy(got).astype(np.float32)).any():
            failures.append(f"{label} output has unwritten (poisoned) elements")
    differ = int((bf16_bits(fused) != bf16_bits(unfused)).sum())
    if differ:
        failures.append(f"fused != unfused bitwise ({differ} of {T * H} elements)")
    if T:
        routing = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
        got = cupy.asnumpy(fused).astype(np.float64)
        if case.expert_dtype == "fp8":
            failures += fp8_reference_failures(case, routing, [quantized_weights(i.w13, i.w2) for i in inputs], got,
                                               rank)
        else:
            ref = reference_layer(*routing, [i.w13 for i in inputs], [i.w2 for i in inputs], case.num_experts)[rank]
            err = rel_error(got, ref["out"])
            if not err < REL_ERROR_LIMIT:
                failures.append(f"relative error {err:.3g} vs the float64 reference (limit {REL_ERROR_LIMIT:g})")
    return failures


def gemm1_act(layer, weights, num_experts: int, intermediate: int):
    """GEMM 1 + SwiGLU + act's quantization on the GPU, on the float64 chain's own quantized
    rows of one rank (bit for bit the rows its dispatch moves) and weights: act (e4m3 [M, I]) and
    act_scales as NumPy arrays, what that rank's forward fed GEMM 2."""
    w13_q, w13_s = weights[:2]
    M, H = layer["a_q"].shape
    act = cupy.full((M, intermediate), 0x7F, np.uint8)  # e4m3 NaN: a code the kernel fails to write shows
    act_s = cupy.full((intermediate // 128, scale_ld(M)), np.nan, np.float32)
    gemm_fp8.gemm1_swiglu_fp8(cupy.asarray(layer["a_q"].view(np.uint8)), cupy.asarray(layer["a_scales"]),
                              cupy.asarray(w13_q.view(np.uint8)), cupy.asarray(w13_s), act, act_s,
                              cupy.asarray(np.asarray(layer["expert_offsets"]).astype(np.int32)), num_experts,
                              intermediate, H)
    return cupy.asnumpy(act).view(E4M3), cupy.asnumpy(act_s)


def fp8_reference_failures(case, routing, weights, got, rank) -> list[str]:
    """The FP8 layer's oracle in two parts (epserve/check/fp8_layer_reference.py,
    finish_from_act, says why not the whole float64 chain at 1e-2 alone): every rank's act
    codes and scales, as GEMM 1 computes them from the chain's rows, inside the intervals of
    the float64 chain (fp8_bounds.act_outside_chain); then this rank's output within 1e-2 of
    the chain finished from those codes. The whole chain's error is named beside a failure."""
    chain = reference_layer_fp8(*routing, weights, case.num_experts)
    e_loc, I = case.num_experts // case.world_size, case.intermediate
    failures, acts = [], []
    for owner, (layer, w) in enumerate(zip(chain, weights)):
        if layer["a_q"].shape[0] == 0:
            acts.append((np.zeros((0, I), E4M3), np.zeros((I // 128, 4), np.float32)))
            continue
        act_q, act_s = gemm1_act(layer, w, e_loc, I)
        outside = fp8_bounds.act_outside_chain(layer["a_q"], layer["a_scales"], layer["expert_offsets"], *w[:2],
                                               act_q, act_s)
        if outside["codes"] or outside["scales"]:
            failures.append(f"rank {owner}'s act outside the float64 chain's intervals: {outside}")
        acts.append((act_q, act_s))
    whole = rel_error(got, chain[rank]["out"])
    err = rel_error(got, finish_from_act(chain, acts, weights, *routing)[rank]["out"])
    if not err < REL_ERROR_LIMIT:
        failures.append(f"relative error {err:.3g} vs the float64 chain from GEMM 1's act codes (limit "
                        f"{REL_ERROR_LIMIT:g}; {whole:.3g} vs the whole chain)")
    return failures


class Services:
    """EPServices by config, the least recently used closed past MAX_OPEN_SERVICES. Every
    rank sees the same cases in the same order, so every rank opens and closes the same
    service at the same point, as the collective constructor and close() need."""

    def __init__(self, comm):
        self.comm = comm
        self._open = OrderedDict()

    def get(self, config):
        if config in self._open:
            self._open.move_to_end(config)
            return self._open[config]
        if len(self._open) >= MAX_OPEN_SERVICES:
            self._open.popitem(last=False)[1].close()
        svc = self._open[config] = EPService(config, self.comm)
        return svc

    def discard(self, config) -> None:
        """Close a service a failed call may have left out of step with its peers."""
        svc = self._open.pop(config, None)
        if svc is not None:
            svc.close()

    def close(self) -> None:
        while self._open:
            self._open.popitem(last=False)[1].close()


def start_watchdog(index: int, replay: str) -> threading.Timer:
    """Names the case if it is still running after HUNG_CASE_S; cancel it when the case ends."""
    timer = threading.Timer(HUNG_CASE_S, print, [f"# case {index} still running after {HUNG_CASE_S:g} s -- "
                                                 f"replay: {replay}"], {"flush": True})
    timer.daemon = True
    timer.start()
    return timer


def fuzz(args) -> int:
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    ep_comm.select_device(comm)
    shared = gpus_shared(comm)
    if shared and not args.share_gpu_ok:
        if rank == 0:
            print("fuzz: ranks share a GPU, so the unfused baseline would move rows by the IPC copy, not NCCL; "
                  "pass --share-gpu-ok to run anyway", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        print(f"# cases: {args.count}", flush=True)
    services = Services(comm)
    wrong, ran, fatal = 0, 0, None
    start = time.monotonic()
    for i in range(args.start, args.start + args.count):
        case = generate(args.seed, i, world)
        replay = case.replay_command(share_gpu=shared)
        watchdog = start_watchdog(i, replay) if rank == 0 else None
        error = None
        try:
            failures = run_case(services.get(case.config()), case, rank)
        except Exception as exc:  # noqa: BLE001 - any failure of a case is reported, not fatal to the run
            error = exc
            failures = [f"{type(exc).__name__}: {exc}"]
        if watchdog is not None:
            watchdog.cancel()
        ran += 1
        # Every rank learns every rank's outcome, so all take the same next step together.
        outcomes = comm.allgather({"failures": failures, "raised": error is not None,
                                   "foreign": error is not None and not isinstance(error, EPServeError)})
        if not all(isinstance(o, dict) and "failures" in o for o in outcomes):
            # Another rank answered a different collective (it left the case's calls at
            # another point): the ranks are out of step, and every later case would be too.
            wrong += 1
            fatal = f"case {i}: the ranks fell out of step (replay: {replay}); stopped after {ran} cases"
            print(f"# fuzz: rank {rank}: {fatal}", file=sys.stderr, flush=True)  # the report below may not finish
            break
        if any(o["failures"] for o in outcomes):
            wrong += 1
            if rank == 0:
                what = "; ".join(f"rank {r}: {m}" for r, o in enumerate(outcomes) for m in o["failures"])
                print(f"FAIL case {i}: {what} -- replay: {replay}", flush=True)
        if any(o["foreign"] for o in outcomes):
            # Not epserve's own error (a CUDA fault, say): the GPU context may be unusable,
            # so later cases would only repeat it.
            fatal = f"case {i} raised an error outside epserve; stopped after {ran} of {args.count} cases"
            break
        if any(o["raised"] for o in outcomes):
            services.discard(case.config())
    if fatal is None:
        services.close()
    elif rank == 0:
        print(f"# fuzz: {fatal}", flush=True)
    seconds = time.monotonic() - start
    report(comm, dict(job="fuzz", rank=rank, seed=args.seed, start=args.start, cases=ran, wrong=wrong,
                      shared_gpu=shared, seconds=round(seconds, 2)))
    if rank == 0:
        print(f"# fuzz: {ran} cases, {wrong} wrong", flush=True)
    return 1 if wrong or fatal else 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        return list_cases(args)
    return fuzz(args)


if __name__ == "__main__":
    sys.exit(main())
