"""More than 8 ranks (issue 15, "Limits raised"; docs/design.md, "Across nodes", "Limits"):
16 ranks sharing ONE GPU, as two forced nodes of 8 with the IPC test carrier
(EPSERVE_OFFNODE_CARRIER=ipc; NCCL refuses two ranks on one GPU). 16 ranks cannot be one node
(a node holds at most 8), so launch/jobs/check_off_node.py's reference run is another forced
layout, 4 nodes of 4: both must give the same bits (fused, unfused, every used recv slot, the
direct dispatch's rows, expert_offsets and src_info), fused == unfused, the float64
reference, and check_service's bad inputs raise on every rank. At 16 ranks the route runs its
*_wide kernels and the move kernel its lane-per-slot send: the code 128 ranks run. A small
shape (check_service's first), so that 16 processes fit on one GPU and it runs in about a
minute."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
RANKS = 16


def explain(proc):
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def test_sixteen_ranks_as_two_nodes_of_eight_on_one_gpu():
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "-n", str(RANKS), "--timeout", "240", "--share-gpu",
           "--", sys.executable, "-m", "mpi4py", str(ROOT / "launch" / "jobs" / "check_off_node.py"),
           "--ranks-per-node", "8", "--reference-ranks-per-node", "4", "--shapes", "1"]
    env = dict(os.environ, EPSERVE_OFFNODE_CARRIER="ipc")
    env.pop("EPSERVE_RANKS_PER_NODE", None)  # the job sets it itself, for each of its two runs
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    planned = [int(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("# cases:")]
    failures = [r for r in results if not r["ok"]]
    assert proc.returncode == 0 and not failures, explain(proc)
    assert planned and len(results) == RANKS * planned[0], explain(proc)
    assert {(r["carrier"], r["nodes"], r["reference_nodes"]) for r in results} == {("ipc", 2, 4)}, results
