"""Multi-rank GPU check of the peer sink (issue 3), run under the launcher:

    python launch/run.py -n 2 [--share-gpu] -- python -m mpi4py launch/jobs/check_combine.py [--quick]

For each case every rank draws every rank's inputs from one seed, runs dispatch, GEMM 1,
SwiGLU and then GEMM 2 + combine both fused (peer sink) and unfused (null sink + transport),
and checks: fused == unfused bitwise (output and every recv slot); both within 1e-2 of the
float64 reference; recv poisoned before every call, every used slot written and every
unused one untouched; three fused calls back to back bitwise equal; gate < 0 writes nothing
and does not hang; the peer build runs with no C at all (a null pointer). Prints one
`RESULT {json}` line per case and rank, and exits non-zero if any check failed anywhere.
"""

from __future__ import annotations

import argparse
import sys
import time

import cupy
import numpy as np
from job_report import report  # a sibling of this script

from epserve.check.reference import reference_layer, rel_error
from epserve.check.testing import BF16, bf16_bits, layer_inputs
from epserve.combine.combiner import Combiner
from epserve.comm import mpi as ep_comm
from epserve.comm.nccl import gpus_shared, make_nccl
from epserve.comm.peers import PeerGroup
from epserve.comm.signals import SignalBlock
from epserve.dispatch.device_plan import DevicePlan
from epserve.dispatch.host import Dispatcher
from epserve.dispatch.host_plan import plan_dispatch
from epserve.ffn import gemm

POISON = 0xFFFF  # a bf16 NaN: no finite GEMM result has these bits

# name, tokens per rank (for 2 ranks; scaled for others), H, I, E, k, routing options
CASES = [
    ("k2-small", [37, 50], 256, 128, 8, 2, dict(unused=0.1)),
    ("k1-half-tile", [129, 64], 192, 64, 4, 1, dict()),
    ("k8-empty-experts", [200, 133], 512, 256, 16, 8, dict(unused=0.15, experts=range(0, 16, 2))),
    ("k4-skewed", [300, 257], 384, 192, 8, 4, dict(zipf=3.0)),
    ("rank-without-tokens", [0, 70], 256, 64, 4, 2, dict()),
    ("k8-larger", [1000, 777], 1024, 512, 32, 8, dict(unused=0.05, zipf=1.0)),
    # the largest top_k MoEConfig accepts: every slot row the reduction keeps in registers
    ("k16-max", [90, 61], 256, 128, 32, 16, dict(unused=0.1)),
]
QUICK = {"k2-small", "k1-half-tile", "k8-empty-experts"}


def to_device(a):
    return cupy.asarray(a)



class Case:
    def __init__(self, comm, transport, nccl, name, tokens, H, I, E, k, opts, seed):
        self.comm, self.rank, self.world = comm, comm.Get_rank(), comm.Get_size()
        self.name, self.H, self.I, self.E, self.k = name, H, I, E, k
        tokens = [tokens[r % len(tokens)] + 3 * (r // len(tokens)) for r in range(self.world)]
        self.inputs = layer_inputs(seed, tokens, E, k, H, I, **opts)
        me = self.inputs[self.rank]
        self.T = me.x.shape[0]
        self.max_tokens = max(tokens) + 5  # room the routing does not use: its slots must stay untouched
        self.plan = DevicePlan.upload(plan_dispatch(self.rank, [i.topk_idx for i in self.inputs], E, self.world), k)
        self.group = PeerGroup(comm)
        send_cap = max(sum(int((i.topk_idx >= 0).sum()) for i in self.inputs), 1)
        self.dispatcher = Dispatcher(self.group, H, send_cap, transport, nccl, BF16)
        self.combiner = Combiner(self.group, SignalBlock.create(self.group), num_experts=E, top_k=k, hidden=H,
                                 max_tokens=self.max_tokens, wait_timeout_s=20.0,
                                 transport=transport, nccl_comm=nccl, dtype=BF16)
        self.x, self.idx = to_device(me.x), to_device(me.topk_idx)
        self.w, self.w13, self.w2 = to_device(me.topk_weights), to_device(me.w13), to_device(me.w2)
        used = np.zeros((self.max_tokens, k), bool)
        used[: self.T] = me.topk_idx >= 0
        self.used = used

    def sync_barrier(self):
        cupy.cuda.runtime.deviceSynchronize()
        self.comm.Barrier()

    def poison(self):
        self.sync_barrier()  # nobody is still sending into recv
        self.combiner.recv.view(np.uint16).fill(POISON)
        self.sync_barrier()  # everybody's recv is poisoned before anybody sends

    def expert_inputs(self):
        M = self.plan.num_recv_rows
        a = self.dispatcher.dispatch(self.x, self.plan)
        act = cupy.empty((M, self.I), BF16)
        gemm.gemm1_swiglu(a, self.w13, act, self.plan.expert_offsets, self.w13.shape[0], self.I, self.H)
        return a, act

    def recv_problems(self, label):
        """Poison left in a used slot, or anything written into an unused one."""
        r = bf16_bits(self.combiner.recv)
        poisoned = (r == POISON).all(axis=2)
        untouched_used = int((poisoned & self.used).sum())
        written_unused = int((~poisoned & ~self.used).sum())
        partly = int(((r == POISON).any(axis=2) & ~poisoned).sum())
        out = []
        if untouched_used:
            out.append(f"{label}: {untouched_used} used slots never written")
        if written_unused:
            out.append(f"{label}: {written_unused} unused slots written")
        if partly:
            out.append(f"{label}: {partly} slots partly written")
        return out

    def run(self):
        failures, info = [], {}
        a, act = self.expert_inputs()
        M = self.plan.num_recv_rows

        # Unfused: GEMM 2 into C, transport, reduce.
        self.poison()
        C = cupy.empty((M, self.H), BF16)
        gemm.grouped_gemm("null", act, self.w2, C, self.plan.expert_offsets, self.w2.shape[0], self.H, self.I)
        out_unfused = self.combiner.unfused(C, self.plan, self.idx, self.w)
        self.combiner.signals.raise_if_error(self.rank)
        self.sync_barrier()
        failures += self.recv_problems("unfused")
        recv_unfused = bf16_bits(self.combiner.recv)

        # Fused: GEMM 2 with the peer sink; C is never allocated.
        del C
        self.poison()
        out_fused = self.combiner.fused(act, self.w2, self.plan, self.idx, self.w, self.I)
        self.combiner.signals.raise_if_error(self.rank)
        self.sync_barrier()
        failures += self.recv_problems("fused")
        recv_fused = bf16_bits(self.combiner.recv)

        if not np.array_equal(recv_fused[self.used], recv_unfused[self.used]):
            failures.append("recv slots differ between fused and unfused")
        fb, ub = bf16_bits(out_fused), bf16_bits(out_unfused)
        if not np.array_equal(fb, ub):
            failures.append(f"fused != unfused bitwise in {int((fb != ub).sum())} of {fb.size} elements")

        ref = reference_layer([i.x for i in self.inputs], [i.topk_idx for i in self.inputs],
                              [i.topk_weights for i in self.inputs], [i.w13 for i in self.inputs],
                              [i.w2 for i in self.inputs], self.E)[self.rank]
        for label, out in (("fused", out_fused), ("unfused", out_unfused)):
            err = rel_error(cupy.asnumpy(out).astype(np.float64), ref["out"]) if self.T else 0.0
            info[f"rel_err_{label}"] = err
            if not err < 1e-2:
                failures.append(f"{label} relative error {err:.3g} vs the float64 reference")
        if not np.array_equal(cupy.asnumpy(self.plan.expert_offsets), ref["expert_offsets"]):
            failures.append("expert_offsets differ from the reference plan")
        a_err = rel_error(cupy.asnumpy(a).astype(np.float64), ref["a"]) if M else 0.0
        if a_err != 0.0:
            failures.append(f"dispatched rows differ from the reference ({a_err:.3g})")

        # Three fused calls back to back, no host barrier between them: the epoch handshake
        # alone keeps a fast rank from overwriting a slow rank's recv.
        outs = [self.combiner.fused(act, self.w2, self.plan, self.idx, self.w, self.I) for _ in range(3)]
        self.combiner.signals.raise_if_error(self.rank)
        for n, o in enumerate(outs):
            if not np.array_equal(bf16_bits(o), fb):
                failures.append(f"repeated fused call {n + 1} differs from the first")

        # Gate off: the GEMM runs, nothing is sent, nothing hangs.
        self.poison()
        t0 = time.perf_counter()
        self.combiner.gemm_only(act, self.w2, self.plan, self.I)
        self.combiner.signals.raise_if_error(self.rank)
        self.sync_barrier()
        info["gate_off_s"] = round(time.perf_counter() - t0, 4)
        if (bf16_bits(self.combiner.recv) != POISON).any():
            failures.append("gate < 0 wrote into recv")

        info.update(T=self.T, M=M, epochs=self.combiner.epoch)
        return failures, info

    def close(self):
        self.group.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="only the small cases")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    comm = ep_comm.world()
    device = ep_comm.select_device(comm)
    rank = comm.Get_rank()
    shared = gpus_shared(comm)
    transport = "ipc" if shared else "nccl"
    nccl = None if shared else make_nccl(comm)
    if rank == 0:
        print(f"# check_combine: {comm.Get_size()} ranks, {'one shared GPU' if shared else 'one GPU each'}, "
              f"unfused transport {transport}, device {cupy.cuda.runtime.getDeviceProperties(device)['name'].decode()}",
              flush=True)
    selected = [c for c in CASES if not args.quick or c[0] in QUICK]
    if rank == 0:
        print(f"# cases: {len(selected)}", flush=True)
    bad = 0
    for n, (name, tokens, H, I, E, k, opts) in enumerate(CASES):
        if args.quick and name not in QUICK:
            continue
        case = Case(comm, transport, nccl, name, tokens, H, I, E, k, opts, args.seed + n)
        try:
            failures, info = case.run()
        finally:
            case.close()
        bad += bool(failures)
        report(comm, dict(case=name, rank=rank, transport=transport, ok=not failures, failures=failures, **info))
    total_bad = comm.allreduce(bad)
    if rank == 0:
        print(f"# check_combine: {'all cases passed' if total_bad == 0 else f'{total_bad} failing case-ranks'}",
              flush=True)
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
