"""A tiny layer for compute-sanitizer, which wraps each rank:

    python launch/run.py -n 2 --share-gpu -- compute-sanitizer --tool memcheck --report-api-errors no \\
        --error-exitcode 9 $(command -v python3) -m mpi4py launch/jobs/sanitize_job.py [--expert-dtype fp8]
        [--gemm2-split always]

(--tool memcheck, racecheck, synccheck or initcheck.) Two calls, each forward fused (peer
sink, direct dispatch) and unfused (null sink, NCCL dispatch or the IPC copy), so every
kernel of both sinks runs and the second call reuses the recv slots and counters the first
released. Sizes are the smallest that still give the GEMMs several tiles each way, partial
tiles, masked slots and a rank without tokens, so the job ends in seconds under the
sanitizer's instrumentation. The outputs are checked too (fused == unfused bitwise, within
1e-2 of the float64 reference): the sanitizer changes timing, which must not change results.
With --expert-dtype fp8 the same calls run FP8 experts (weights from quantize_weights, the
dispatch quantizing in its send, the block-scaled GEMMs), checked against the float64 FP8
reference on the same quantized weights, at sizes that give each FP8 GEMM two 256-wide column
tiles and several k-blocks. With --gemm2-split always, bf16 GEMM 2 runs its split build (each
tile in two K halves, the first half's accumulators handed to the second through global
memory), which the layer picks by itself only at shapes too large for a sanitizer.
Prints `# sanitize_job: ok` or the failures, and a `RESULT` line per rank; exits 1 on a wrong
result (the sanitizer's own findings give its exit code).

What the tools need and said on an H200, and with FP8 experts on an H100 (two ranks on one GPU):
- the interpreter by its absolute path: compute-sanitizer looks `python3` up on its own and
  found a system Python without mpi4py;
- --report-api-errors no: driver-symbol probing by the libraries loaded makes 34
  cuGetProcAddress calls per rank that return CUDA_ERROR_INVALID_VALUE, each an error
  otherwise;
- memcheck and synccheck: 0 errors; the job passes;
- racecheck, bf16 experts: 0 hazards (the send-warp mailbox is ordered by bar.sync on both
  sides; with bar.arrive on one side racecheck reported 6). Until the thirty-fifth session
  it reported the bf16 wgmma GEMM's stop index racing with the tile index reads (stages freed
  by one thread a warpgroup: fixed);
- racecheck, bf16 experts with --gemm2-split always: 0 hazards since the thirty-sixth session
  (8 before, on the tile mailbox, for the same cause as the FP8 reports below: the first
  halves gathered their stores by a named barrier of each warpgroup, now by mbarriers);
- racecheck, FP8 experts: 0 hazards since the thirty-sixth session. Before, 3-116 a run in
  GEMM 1's split-tail epilogue: the output tile and the tile mailbox against the writer
  warps' reads after the hand-over. The protocol was ordered; racecheck reports any named
  barrier over part of the output threads between the drain and the hand-over
  (launch/jobs/probe_racecheck_handover.py), so the split tails now order their exchange by
  mbarriers (notes/gemm.md, thirty-sixth session);
- initcheck: tens of thousands of reads of memory that a peer process initialized through
  CUDA IPC (dispatch count rows, signal counters), which initcheck cannot see.
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy
import numpy as np
from job_report import report  # a sibling of this script

from epserve import EPService, MoEConfig, quantize_weights
from epserve.check.fp8_layer_reference import quantized_weights, reference_layer_fp8
from epserve.check.reference import reference_layer, rel_error
from epserve.check.testing import layer_inputs
from epserve.comm import mpi as ep_comm
from epserve.ffn import tiles

# Experts of more than one 128-row tile, and two column tiles in each GEMM: the bf16 GEMMs'
# tiles are 128 wide, the FP8 GEMMs' 256 (whose K also comes in 128-wide blocks).
E_LOC, TOP_K = 2, 2
HIDDEN_INTERMEDIATE = {"bf16": (256, 128), "fp8": (512, 256)}
# Token counts of rank r in call n: CALLS[n][r % 2] + r // 2, so any -n gives each rank its own.
CALLS = ((300, 9), (0, 150))
SEED = 17
# The sanitizer slows kernels by orders of magnitude, and a peer's slowed kernel must not
# read as a dead peer.
WAIT_TIMEOUT_S = 300.0
REL_ERROR_LIMIT = 1e-2


def _reference(everyone, E, expert_dtype, rank):
    xs, idxs, ws = ([getattr(i, a) for i in everyone] for a in ("x", "topk_idx", "topk_weights"))
    if expert_dtype == "fp8":
        weights = [quantized_weights(i.w13, i.w2) for i in everyone]
        return reference_layer_fp8(xs, idxs, ws, weights, E)[rank]["out"]
    return reference_layer(xs, idxs, ws, [i.w13 for i in everyone], [i.w2 for i in everyone], E)[rank]["out"]


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/sanitize_job.py")
    p.add_argument("--expert-dtype", choices=sorted(HIDDEN_INTERMEDIATE), default="bf16")
    p.add_argument("--gemm2-split", choices=tiles.SPLIT_MODES, default="auto",
                   help=f"bf16 experts' GEMM 2 split build (${tiles.SPLIT_ENV}): 'always' runs it at these sizes")
    args = p.parse_args()
    dtype = args.expert_dtype
    if args.gemm2_split != "auto":
        if dtype != "bf16":
            p.error("--gemm2-split: only bf16 experts' GEMM 2 has a split build")
        os.environ[tiles.SPLIT_ENV] = args.gemm2_split
    hidden, intermediate = HIDDEN_INTERMEDIATE[dtype]
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    E = E_LOC * world
    tokens = [[call[r % 2] + r // 2 for r in range(world)] for call in CALLS]
    cfg = MoEConfig(E, TOP_K, hidden, intermediate, max(max(t) for t in tokens), world_size=world,
                    wait_timeout_s=WAIT_TIMEOUT_S, expert_dtype=dtype)
    failures = []
    with EPService(cfg, comm) as svc:
        for n, counts in enumerate(tokens):
            everyone = layer_inputs(SEED + n, counts, E, TOP_K, hidden, intermediate, unused=0.1)
            me = everyone[rank]
            x, idx, w, w13, w2 = (cupy.asarray(a) for a in (me.x, me.topk_idx, me.topk_weights, me.w13, me.w2))
            if dtype == "fp8":
                w13, w2 = quantize_weights(w13, w2), None
            fused = cupy.asnumpy(svc.forward(x, idx, w, w13, w2, sink="peer", dispatch="direct"))
            unfused = cupy.asnumpy(svc.forward(x, idx, w, w13, w2, sink="null", dispatch="nccl"))
            svc.check()
            if not np.array_equal(fused.view(np.uint16), unfused.view(np.uint16)):
                failures.append(f"call {n}: fused != unfused bitwise")
            if counts[rank]:
                err = rel_error(fused.astype(np.float64), _reference(everyone, E, dtype, rank))
                if not err < REL_ERROR_LIMIT:
                    failures.append(f"call {n}: relative error {err:.3g} vs the float64 reference")
    report(comm, dict(job="sanitize_job", expert_dtype=dtype, rank=rank, ok=not failures, failures=failures))
    wrong = comm.allreduce(len(failures))
    if rank == 0:
        print(f"# sanitize_job ({dtype} experts): {'ok' if not wrong else f'{wrong} failures'}", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
