"""Across nodes on one machine (issue 15; docs/design.md, "Across nodes"): EPSERVE_RANKS_PER_NODE
plays several nodes, and launch/jobs/check_off_node.py checks that the forced multi-node run is
bitwise the one-node run (fused, unfused, recv slots, the dispatch), fused == unfused, the
float64 reference, and the bad inputs. The carrier:
- ipc: the TEST carrier that imitates the network over CUDA IPC, so every rank may share one
  GPU (NCCL refuses two ranks on one GPU);
- nccl: the production carrier, one GPU per rank (skipped with fewer than two GPUs).
Each in both sizes modes: capacity blocks (the default) and EPSERVE_OFFNODE_SIZES=host (the
routed rows only, compact return blocks). launch/jobs/time_off_node.py, the off-node
transfer's timing job, runs once as a smoke test on one GPU (ipc carrier, no NCCL column)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epserve.runtime.gpu_probe import gpu_count

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def explain(proc):
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def run_off_node(ranks: int, ranks_per_node: int, carrier: str, share_gpu: bool, shapes: int | None = None,
                 sizes: str | None = None, overlap: bool = False, route: str | None = None, dedup: bool = False):
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "-n", str(ranks), "--timeout", "300"]
    cmd += ["--share-gpu"] if share_gpu else []
    cmd += ["--", sys.executable, "-m", "mpi4py", str(ROOT / "launch" / "jobs" / "check_off_node.py"),
            "--ranks-per-node", str(ranks_per_node)]
    cmd += ["--shapes", str(shapes)] if shapes else []
    env = dict(os.environ, EPSERVE_OFFNODE_CARRIER=carrier)
    env.pop("EPSERVE_RANKS_PER_NODE", None)  # the job sets it itself, after its one-node run
    env.pop("EPSERVE_OFFNODE_SIZES", None)
    env.pop("EPSERVE_OFFNODE_OVERLAP", None)
    env.pop("EPSERVE_OFFNODE_ROUTE", None)
    env.pop("EPSERVE_OFFNODE_DEDUP", None)
    if dedup:
        env["EPSERVE_OFFNODE_DEDUP"] = "1"
    if route:
        env["EPSERVE_OFFNODE_ROUTE"] = route
    if sizes:
        env["EPSERVE_OFFNODE_SIZES"] = sizes
    if overlap:
        env["EPSERVE_OFFNODE_OVERLAP"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360, cwd=ROOT, env=env)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    planned = [int(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("# cases:")]
    return proc, results, planned


def check(proc, results, planned, ranks, carrier, nodes, sizes="capacity", overlap=False, route="direct",
          dedup=False):
    failures = [r for r in results if not r["ok"]]
    assert proc.returncode == 0 and not failures, explain(proc)
    assert planned and len(results) == ranks * planned[0], explain(proc)
    assert {(r["carrier"], r["nodes"]) for r in results} == {(carrier, nodes)}, results
    assert {r.get("sizes") for r in results} == {sizes}, results
    assert {r.get("overlap") for r in results} == {overlap}, results
    assert {r.get("route") for r in results} == {route}, results
    assert {r.get("dedup") for r in results} == {dedup}, results


# (ranks, ranks per node, carrier, all on one GPU)
CASES = [
    pytest.param(2, 1, "ipc", True, id="2-nodes-of-1-ipc-1-gpu"),
    pytest.param(4, 2, "ipc", True, id="2-nodes-of-2-ipc-1-gpu"),
    pytest.param(4, 2, "ipc", False, id="2-nodes-of-2-ipc-2-gpus"),
    pytest.param(2, 1, "nccl", False, id="2-nodes-of-1-nccl-2-gpus"),
]


@pytest.mark.parametrize("ranks,ranks_per_node,carrier,share_gpu", CASES)
def test_forced_nodes_are_bitwise_the_one_node_run(ranks, ranks_per_node, carrier, share_gpu):
    if not share_gpu and gpu_count() < 2:
        pytest.skip("needs two GPUs")
    proc, results, planned = run_off_node(ranks, ranks_per_node, carrier, share_gpu)
    check(proc, results, planned, ranks, carrier, ranks // ranks_per_node)


# (ranks, ranks per node, carrier, all on one GPU), with EPSERVE_OFFNODE_SIZES=host
SIZED_CASES = [
    pytest.param(2, 1, "ipc", True, id="2-nodes-of-1-ipc-1-gpu-host-sizes"),
    pytest.param(4, 2, "ipc", True, id="2-nodes-of-2-ipc-1-gpu-host-sizes"),
    pytest.param(2, 1, "nccl", False, id="2-nodes-of-1-nccl-2-gpus-host-sizes"),
]


@pytest.mark.parametrize("ranks,ranks_per_node,carrier,share_gpu", SIZED_CASES)
def test_routed_sizes_are_bitwise_the_one_node_run(ranks, ranks_per_node, carrier, share_gpu):
    """EPSERVE_OFFNODE_SIZES=host: only the routed rows cross (compact return blocks), with
    the same bits as one node, fused and unfused, the host's sizes the routing's, and
    capture refused."""
    if not share_gpu and gpu_count() < 2:
        pytest.skip("needs two GPUs")
    proc, results, planned = run_off_node(ranks, ranks_per_node, carrier, share_gpu, sizes="host")
    check(proc, results, planned, ranks, carrier, ranks // ranks_per_node, sizes="host")


# (ranks, ranks per node, sizes, carrier, all on one GPU), with EPSERVE_OFFNODE_OVERLAP=1
OVERLAP_CASES = [
    pytest.param(2, 1, "capacity", "ipc", True, id="2-nodes-of-1-overlap"),
    pytest.param(4, 2, "capacity", "ipc", True, id="2-nodes-of-2-overlap"),
    pytest.param(2, 1, "host", "ipc", True, id="2-nodes-of-1-overlap-host-sizes"),
    pytest.param(4, 2, "host", "ipc", True, id="2-nodes-of-2-overlap-host-sizes"),
    pytest.param(2, 1, "capacity", "nccl", False, id="2-nodes-of-1-nccl-2-gpus-overlap"),
]


@pytest.mark.parametrize("ranks,ranks_per_node,sizes,carrier,share_gpu", OVERLAP_CASES)
def test_send_under_gemm2_is_bitwise_the_one_node_run(ranks, ranks_per_node, sizes, carrier, share_gpu):
    """EPSERVE_OFFNODE_OVERLAP=1: the fused combine's off-node rows leave on a side stream while
    GEMM 2's overlap build (SMs left free, off-node m-tiles first, staged rows counted) runs;
    the same bits as one node, fused and unfused, every fused call sent that way, GEMM 2's tile
    order the model's, capture refused. The IPC test carrier on one shared GPU; NCCL on two."""
    if not share_gpu and gpu_count() < 2:
        pytest.skip("needs two GPUs")
    proc, results, planned = run_off_node(ranks, ranks_per_node, carrier, share_gpu,
                                          sizes=None if sizes == "capacity" else sizes, overlap=True)
    check(proc, results, planned, ranks, carrier, ranks // ranks_per_node, sizes=sizes, overlap=True)


# (ranks, ranks per node, sizes, carrier, all on one GPU, service shapes), with EPSERVE_OFFNODE_ROUTE=relay
RELAY_CASES = [
    pytest.param(2, 1, "capacity", "ipc", True, None, id="2-nodes-of-1-relay"),
    pytest.param(4, 2, "capacity", "ipc", True, None, id="2-nodes-of-2-relay"),
    pytest.param(8, 2, "capacity", "ipc", True, 1, id="4-nodes-of-2-relay"),
    pytest.param(8, 4, "capacity", "ipc", True, 1, id="2-nodes-of-4-relay"),
    pytest.param(4, 2, "host", "ipc", True, None, id="2-nodes-of-2-relay-host-sizes"),
    pytest.param(8, 2, "host", "ipc", True, 1, id="4-nodes-of-2-relay-host-sizes"),
    pytest.param(4, 2, "capacity", "ipc", False, None, id="2-nodes-of-2-relay-2-gpus"),
    pytest.param(2, 1, "capacity", "nccl", False, None, id="2-nodes-of-1-nccl-2-gpus-relay"),
    pytest.param(2, 1, "host", "nccl", False, None, id="2-nodes-of-1-nccl-2-gpus-relay-host-sizes"),
]


@pytest.mark.parametrize("ranks,ranks_per_node,sizes,carrier,share_gpu,shapes", RELAY_CASES)
def test_relay_through_rail_peers_is_bitwise_the_one_node_run(ranks, ranks_per_node, sizes, carrier, share_gpu,
                                                              shapes):
    """EPSERVE_OFFNODE_ROUTE=relay: each rank talks across nodes only to the ranks of its local
    index (one transfer per node pair and rail), which forward over IPC inside their node; the
    same bits as one node, fused and unfused, the bad inputs still stop every rank, and with
    routed sizes the host's sizes are the routing's and capture is refused."""
    if not share_gpu and gpu_count() < 2:
        pytest.skip("needs two GPUs")
    proc, results, planned = run_off_node(ranks, ranks_per_node, carrier, share_gpu, shapes=shapes,
                                          sizes=None if sizes == "capacity" else sizes, route="relay")
    check(proc, results, planned, ranks, carrier, ranks // ranks_per_node, sizes=sizes, route="relay")


# (ranks, ranks per node, sizes, carrier, all on one GPU, service shapes): the relay with the send
# under GEMM 2 (EPSERVE_OFFNODE_OVERLAP=1)
RELAY_OVERLAP_CASES = [
    pytest.param(4, 2, "capacity", "ipc", True, None, id="2-nodes-of-2-relay-overlap"),
    pytest.param(8, 2, "host", "ipc", True, 1, id="4-nodes-of-2-relay-overlap-host-sizes"),
    pytest.param(2, 1, "capacity", "nccl", False, None, id="2-nodes-of-1-nccl-2-gpus-relay-overlap"),
]


@pytest.mark.parametrize("ranks,ranks_per_node,sizes,carrier,share_gpu,shapes", RELAY_OVERLAP_CASES)
def test_relay_under_gemm2_is_bitwise_the_one_node_run(ranks, ranks_per_node, sizes, carrier, share_gpu, shapes):
    """EPSERVE_OFFNODE_ROUTE=relay with EPSERVE_OFFNODE_OVERLAP=1: on the side stream, each
    destination node's rows go to the rail peers as soon as GEMM 2 has staged them, then along
    the rails; the same bits as one node, every fused call sent that way, capture refused."""
    if not share_gpu and gpu_count() < 2:
        pytest.skip("needs two GPUs")
    proc, results, planned = run_off_node(ranks, ranks_per_node, carrier, share_gpu, shapes=shapes,
                                          sizes=None if sizes == "capacity" else sizes, overlap=True, route="relay")
    check(proc, results, planned, ranks, carrier, ranks // ranks_per_node, sizes=sizes, overlap=True, route="relay")


# (ranks, ranks per node, carrier, all on one GPU, service shapes), with EPSERVE_OFFNODE_ROUTE=relay and
# EPSERVE_OFFNODE_DEDUP=1 (capacity blocks, the send after GEMM 2: what deduplication serves)
RELAY_DEDUP_CASES = [
    pytest.param(4, 2, "ipc", True, None, id="2-nodes-of-2-relay-dedup"),
    pytest.param(8, 2, "ipc", True, 1, id="4-nodes-of-2-relay-dedup"),
    pytest.param(8, 4, "ipc", True, 1, id="2-nodes-of-4-relay-dedup"),
    pytest.param(4, 2, "ipc", False, None, id="2-nodes-of-2-relay-dedup-2-gpus"),
    pytest.param(2, 1, "nccl", False, None, id="2-nodes-of-1-nccl-2-gpus-relay-dedup"),
]


@pytest.mark.parametrize("ranks,ranks_per_node,carrier,share_gpu,shapes", RELAY_DEDUP_CASES)
def test_relay_with_each_token_once_per_node_is_bitwise_the_one_node_run(ranks, ranks_per_node, carrier, share_gpu,
                                                                         shapes):
    """EPSERVE_OFFNODE_DEDUP=1: the rail transfer carries each token row once per destination
    node (a packed block, an index per node rank) and the rail peer fans it out; the same bits as
    one node, fused and unfused, back-to-back dispatches included, the packed blocks the NumPy
    model's, the bad inputs still stop every rank."""
    if not share_gpu and gpu_count() < 2:
        pytest.skip("needs two GPUs")
    proc, results, planned = run_off_node(ranks, ranks_per_node, carrier, share_gpu, shapes=shapes, route="relay",
                                          dedup=True)
    check(proc, results, planned, ranks, carrier, ranks // ranks_per_node, route="relay", dedup=True)
    assert all("rail_bytes" in r for r in results), results


@pytest.mark.parametrize("route,sizes,message", [
    pytest.param(None, None, "EPSERVE_OFFNODE_DEDUP=1 deduplicates the relay's rows per destination node",
                 id="dedup-refused-direct-route"),
    pytest.param("relay", "host", "EPSERVE_OFFNODE_DEDUP=1 serves the capacity blocks",
                 id="dedup-refused-routed-sizes"),
])
def test_dedup_is_refused_where_it_does_not_apply(route, sizes, message):
    """EPSERVE_OFFNODE_DEDUP=1 on the direct route, or with routed sizes: every rank refuses at setup."""
    proc, results, _ = run_off_node(2, 1, "ipc", True, shapes=1, sizes=sizes, route=route, dedup=True)
    assert proc.returncode != 0 or any(not r["ok"] for r in results), explain(proc)
    assert message in proc.stdout + proc.stderr, explain(proc)


def run_at_two_nodes_of_two(job: str, args: list, route: str, timeout: int, dedup: bool = False):
    """launch/jobs/<job> at 4 ranks as 2 nodes of 2 on one shared GPU (ipc carrier, capacity
    blocks, no overlap; with `dedup` EPSERVE_OFFNODE_DEDUP=1) under the launcher's `timeout`:
    the process and each rank's record."""
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "-n", "4", "--timeout", str(timeout), "--share-gpu", "--",
           sys.executable, "-m", "mpi4py", str(ROOT / "launch" / "jobs" / job), *args]
    env = dict(os.environ, EPSERVE_OFFNODE_CARRIER="ipc", EPSERVE_RANKS_PER_NODE="2", EPSERVE_OFFNODE_ROUTE=route)
    for name in ("EPSERVE_OFFNODE_SIZES", "EPSERVE_OFFNODE_OVERLAP", "EPSERVE_OFFNODE_DEDUP"):
        env.pop(name, None)
    if dedup:
        env["EPSERVE_OFFNODE_DEDUP"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60, cwd=ROOT, env=env)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == 4 and all(r["ok"] for r in results), explain(proc)
    return results


@pytest.mark.parametrize("route", ["direct", "relay"])
def test_forward_captured_across_nodes_replays_bitwise(route):
    """The capacity blocks need no host wait, so forward across nodes goes into a CUDA graph:
    launch/jobs/check_graph.py at 4 ranks as 2 nodes of 2 (ipc carrier, one shared GPU), every
    replay bitwise the eager forward, a bad expert id under the graph poisons out and raises on
    every rank, and the next replay is right again."""
    results = run_at_two_nodes_of_two("check_graph.py", ["--replays", "12"], route, timeout=300)
    assert {(r["nodes"], r["route"], r["replays"]) for r in results} == {(2, route, 12)}, results


@pytest.mark.parametrize("route", ["direct", "relay"])
@pytest.mark.parametrize("stage", ["dispatch", "combine"])
def test_a_rank_failing_mid_call_fails_the_ranks_that_read_its_rows(route, stage):
    """launch/jobs/off_node_failure.py at 4 ranks as 2 nodes of 2 (ipc carrier, one shared GPU):
    rank 1 fails as a timed-out wait leaves it, after its move (dispatch) or after GEMM 2
    (combine), before its rows cross. Without the stamps on the carrier's groups the other
    node's ranks would take rank 1's (or its relay's) rows and return; they must raise
    PeerTimeoutError instead, rank 1 its own error, and nobody may hang."""
    results = run_at_two_nodes_of_two("off_node_failure.py", [stage], route, timeout=240)
    assert {(r["nodes"], r["route"], r["stage"]) for r in results} == {(2, route, stage)}, results


def test_forward_captured_with_dedup_replays_bitwise():
    """As above with the relay and EPSERVE_OFFNODE_DEDUP=1 (the packing launches go into the graph)."""
    results = run_at_two_nodes_of_two("check_graph.py", ["--replays", "12"], "relay", timeout=300, dedup=True)
    assert {(r["nodes"], r["route"], r["dedup"], r["replays"]) for r in results} == {(2, "relay", True, 12)}, results


@pytest.mark.parametrize("stage", ["dispatch", "combine"])
def test_a_rank_failing_mid_call_fails_its_readers_with_dedup(stage):
    """As above with the relay and EPSERVE_OFFNODE_DEDUP=1: a failed rank packs nothing and its
    stamp says so, so the other node's ranks raise instead of fanning out an earlier call's rows."""
    results = run_at_two_nodes_of_two("off_node_failure.py", [stage], "relay", timeout=240, dedup=True)
    assert {(r["nodes"], r["route"], r["dedup"], r["stage"]) for r in results} == {(2, "relay", True, stage)}, results


@pytest.mark.parametrize("route,ranks,ranks_per_node", [("direct", 2, 1), ("relay", 4, 2)])
def test_timing_job_runs_on_one_gpu(route, ranks, ranks_per_node):
    """launch/jobs/time_off_node.py with the ipc carrier on one shared GPU: the table, every
    transfer's bytes as the ranks sent them (#wrong 0), the NCCL column n/a; for both routes
    (the relay's groups along the rails, capacity and routed sizes)."""
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "-n", str(ranks), "--timeout", "300", "--share-gpu",
           "--", sys.executable, "-m", "mpi4py", str(ROOT / "launch" / "jobs" / "time_off_node.py"), "--tokens",
           "256", "--iters", "5", "--warmup", "2"]
    env = dict(os.environ, EPSERVE_OFFNODE_CARRIER="ipc", EPSERVE_RANKS_PER_NODE=str(ranks_per_node),
               EPSERVE_OFFNODE_ROUTE=route)
    env.pop("EPSERVE_OFFNODE_SIZES", None)  # the job sets it itself
    env.pop("EPSERVE_OFFNODE_DEDUP", None)  # the job's routed sizes refuse it
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360, cwd=ROOT, env=env)
    assert proc.returncode == 0, explain(proc)
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("dispatch", "combine", "counts"))]
    assert len(rows) == 5, explain(proc)  # counts; dispatch and combine, capacity and host sizes
    assert all(row[-1] == "0" and "n/a" in row for row in rows), explain(proc)  # #wrong 0, no NCCL
    assert f"# time_off_node: carrier ipc, route {route}" in proc.stdout, explain(proc)


def test_nccl_carrier_is_refused_where_ranks_share_a_gpu():
    """NCCL cannot put two ranks on one GPU: every rank refuses at setup, naming the test carrier."""
    proc, results, _ = run_off_node(2, 1, "nccl", True, shapes=1)
    assert proc.returncode != 0 or any(not r["ok"] for r in results), explain(proc)
    assert "EPSERVE_OFFNODE_CARRIER=ipc is the test carrier" in proc.stdout + proc.stderr, explain(proc)
