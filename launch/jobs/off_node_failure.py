"""A rank that fails in the middle of a call across nodes: every rank that depends on what it
sends must raise, none may return rows of another call, none may hang (docs/design.md,
"Across nodes", "What a failed sender sends"). Run under the launcher, 4 ranks as 2 nodes of 2
on the IPC test carrier (ranks may share one GPU):

    EPSERVE_OFFNODE_CARRIER=ipc [EPSERVE_OFFNODE_ROUTE=relay [EPSERVE_OFFNODE_DEDUP=1]] python launch/run.py -n 4 \\
        --share-gpu --timeout 240 -- python -m mpi4py launch/jobs/off_node_failure.py {dispatch|combine}

Every rank warms up with two fused forwards on other inputs. Then, in one fused forward
(check=True), rank 1 (node 0) fails as a timed-out wait would leave it:
  dispatch  after its move kernel, before its token rows cross: its call status says failed
            and stopped by its layout's timeout, its expert_offsets are zero and its error
            record says dispatch-count-wait (so it stages nothing more, expands nothing, and
            relays nothing on: a layout that ran out of time)
  combine   after GEMM 2, before its combine rows cross: its call status says failed and its
            error record says peer-ready-wait
What must follow: rank 1 raises its own error; ranks 2 and 3 (the other node, which read what
rank 1 sent, directly or relayed) raise PeerTimeoutError within 10 x wait_timeout_s, naming
the stage; in the dispatch case rank 0 raises too (with the relay it waits for rows rank 1
should have relayed; directly, its combine rows come from ranks that failed). Each rank then
closes the service (bounded). Prints `RESULT {json}` per rank; exits 1 if any expectation
failed.
"""

from __future__ import annotations

import argparse
import sys
import time

import cupy
import numpy as np
from job_report import report  # a sibling of this script

from epserve import EPService, MoEConfig
from epserve.check.testing import layer_inputs
from epserve.comm import mpi as ep_comm
from epserve.errors import EPServeError, PeerTimeoutError

STAGES = ("dispatch", "combine")
FAILING = 1
WAIT_TIMEOUT_S = 2.0
BOUND_TIMEOUTS = 10
E_LOC, TOP_K, HIDDEN, INTERMEDIATE, TOKENS = 4, 4, 256, 128, 64
SEED = 83
# what may name the cause on the other node: the stamp (14), a relayed row that never came (13),
# or the IPC test carrier's own bound, where the sender posts late because one of its waits ran
# out first (11; NCCL has no bound: there the stamp speaks)
OTHER_NODE_STAGES = ("off-node-stale", "off-node-relay", "off-node-carrier")


def fail_like_a_timeout(svc, stage: str) -> None:
    """On the stream, now: this call's status and error record as a wait that ran out leaves them."""
    d = svc.direct
    if stage == "dispatch":
        d.status[...] = cupy.asarray(np.array([1, 2], np.int32))  # failed, stopped by a layout timeout
        d.expert_offsets.fill(0)
        record = [6, 0, 1, 0]  # dispatch-count-wait, naming rank 0
    else:
        d.status[0] = 1
        record = [2, 0, 1, 0]  # peer-ready-wait, naming rank 0
    svc.signals.error[...] = cupy.asarray(np.array(record, np.int32))


def inject(svc, stage: str) -> list:
    """Wraps the off-node step the failure comes before (once); the list records that it ran."""
    off, ran = svc.off_node, []
    name = "exchange_rows" if stage == "dispatch" else "exchange_combine"
    original = getattr(off, name)

    def failing(*args, **kwargs):
        if not ran:
            fail_like_a_timeout(svc, stage)
            ran.append(name)
        return original(*args, **kwargs)

    setattr(off, name, failing)
    return ran


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/off_node_failure.py")
    p.add_argument("stage", choices=STAGES)
    stage = p.parse_args().stage
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    E = E_LOC * world
    cfg = MoEConfig(E, TOP_K, HIDDEN, INTERMEDIATE, TOKENS, world_size=world, wait_timeout_s=WAIT_TIMEOUT_S)
    svc = EPService(cfg, comm)
    record = {"rank": rank, "stage": stage, "nodes": svc.nodes.nodes,
              "route": svc.off_node and svc.off_node.route, "dedup": bool(svc.off_node and svc.off_node.dedup),
              "failures": []}
    if svc.off_node is None or world != 4 or svc.nodes.nodes != 2:
        record["failures"].append(f"needs 4 ranks as 2 nodes of 2, got {world} ranks as {svc.nodes.nodes} nodes")
    else:
        for n in range(2):  # warm-up, on inputs other than the failing call's
            x, idx, w, w13, w2 = layer_inputs(SEED + n, [TOKENS] * world, E, TOP_K, HIDDEN, INTERMEDIATE)[
                rank].on_device()
            svc.forward(x, idx, w, w13, w2, check=True)
        cupy.cuda.runtime.deviceSynchronize()
        comm.Barrier()
        x, idx, w, w13, w2 = layer_inputs(SEED + 7, [TOKENS] * world, E, TOP_K, HIDDEN, INTERMEDIATE)[
            rank].on_device()
        injected = inject(svc, stage) if rank == FAILING else None
        start = time.monotonic()
        try:
            svc.forward(x, idx, w, w13, w2, check=True)
            record["outcome"] = "returned"
        except EPServeError as exc:
            record["outcome"] = f"{type(exc).__name__}: {exc}"
            record["error"] = type(exc).__name__
        record["seconds"] = round(time.monotonic() - start, 2)
        record["failures"] += expectations(rank, stage, record, injected)
    start = time.monotonic()
    try:
        svc.close()
        record["close"] = "returned"
    except EPServeError as exc:
        record["close"] = f"raised {type(exc).__name__}"
    record["close_seconds"] = round(time.monotonic() - start, 2)
    record["ok"] = not record["failures"]
    report(comm, record)
    return 0 if comm.allreduce(int(not record["ok"])) == 0 else 1


def expectations(rank: int, stage: str, record: dict, injected) -> list:
    out, outcome = [], record["outcome"]
    raised = outcome != "returned"
    if record["seconds"] > BOUND_TIMEOUTS * WAIT_TIMEOUT_S:  # a few bounded waits in a row, never a hang
        out.append(f"rank {rank} took {record['seconds']} s, over {BOUND_TIMEOUTS} x wait_timeout_s")
    if rank == FAILING:
        want = "dispatch-count-wait" if stage == "dispatch" else "peer-ready-wait"
        if injected != (["exchange_rows"] if stage == "dispatch" else ["exchange_combine"]):
            out.append(f"the failure was not injected ({injected})")
        if not raised or want not in outcome:
            out.append(f"rank {rank} (failing) did not raise its own {want}: {outcome}")
    elif rank in (2, 3):  # the other node
        if record.get("error") != PeerTimeoutError.__name__ or not any(s in outcome for s in OTHER_NODE_STAGES):
            out.append(f"rank {rank} (other node) should raise PeerTimeoutError at {OTHER_NODE_STAGES}: {outcome}")
    elif stage == "dispatch" and not raised:
        out.append(f"rank {rank} returned rows although rank {FAILING} failed its dispatch")
    return out


if __name__ == "__main__":
    sys.exit(main())
