"""Two-rank GPU jobs under the launcher, with two ranks sharing one GPU and, where there are
two, with one GPU each:
  check_combine.py  the peer sink: fused == unfused bitwise, reference, poison, repeats, gate (issue 3)
  check_service.py  EPService: forward, direct vs NCCL dispatch, foreign arrays, bad inputs (issue 4)
  check_graph.py    forward captured in a CUDA graph, replayed with fresh inputs == eager bitwise (issue 13)
  check_fp8.py      FP8 experts: fused == unfused bitwise on every path, float64 FP8 reference, bad weights (issue 16)
  check_quantize_send.py  FP8: the direct dispatch quantizing in its send == quantize then dispatch, bitwise (issue 16)
  check_dispatch_queued.py  dispatch(wait=False) == the waiting dispatch bitwise (bf16, FP8), expert_ffn on it
                    == forward, and its failures through check()
  check_graph.py --fp8  the graph with FP8 experts
  check_replay.py   forward's replayed launches == launches built anew, bitwise, across token counts and weights (issue 13)
  check_replay.py --fp8  the same with FP8 experts
  check_fp8_race.py FP8 at DeepSeek-V3's sizes: many fused calls back to back, each == unfused bitwise
                    (two GPUs only: the race it guards against showed over NVLink only)
and check_service, check_graph and check_replay once more with GEMM 2's split build forced
(EPSERVE_GEMM2_SPLIT_K=always): its workspace and flags under forward, graphs and replays;
and five of them with each of GEMM 2's peer sink builds named (EPSERVE_SINK_STORES=own-bulk,
the default: bulk copies for the rows whose home is the sending rank; warps: the send warps'
stores; bulk: bulk copies for every row).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from epserve.runtime.gpu_probe import gpu_count

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def run_job(job: str, share_gpu: bool):
    """job: a script in launch/jobs, with its arguments after a space."""
    script, *job_args = job.split()
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "-n", "2", "--timeout", "540"]
    cmd += ["--share-gpu"] if share_gpu else []
    cmd += ["--", sys.executable, "-m", "mpi4py", str(ROOT / "launch" / "jobs" / script), *job_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    planned = [int(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("# cases:")]
    return proc, results, planned


@pytest.mark.parametrize("job", ["check_combine.py", "check_service.py", "check_graph.py", "check_fp8.py",
                                 "check_quantize_send.py", "check_dispatch_queued.py", "check_graph.py --fp8",
                                 "check_replay.py", "check_replay.py --fp8"])
@pytest.mark.parametrize("share_gpu", [True, False], ids=["2-ranks-1-gpu", "2-ranks-2-gpus"])
def test_job_passes_every_case(job, share_gpu):
    if not share_gpu and gpu_count() < 2:
        pytest.skip("needs two GPUs")
    proc, results, planned = run_job(job, share_gpu)
    failures = [r for r in results if not r["ok"]]
    assert proc.returncode == 0 and not failures, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert planned and len(results) == 2 * planned[0], proc.stdout[-3000:]
    # Each record names the unfused transport it ran: the IPC copy where ranks share a GPU
    # (NCCL refuses that), NCCL otherwise. A record without one fails here.
    expected = "ipc" if share_gpu else "nccl"
    assert [r.get("transport") for r in results] == [expected] * len(results), results


@pytest.mark.parametrize("job", ["check_service.py", "check_graph.py", "check_replay.py"])
def test_job_passes_with_gemm2_split_in_k_halves(job, monkeypatch):
    """GEMM 2's split build (epserve/ffn/tiles.py) chooses itself only at shapes too large for
    these jobs (K >= 4096 and few waves); forced, every tile of every GEMM 2 runs in two K
    halves, fused and unfused, eager, captured and replayed. Its bits equal the default
    build's (tests/gpu/test_gemm_swiglu.py), so every bitwise oracle of the jobs holds as is."""
    monkeypatch.setenv("EPSERVE_GEMM2_SPLIT_K", "always")
    proc, results, planned = run_job(job, share_gpu=True)
    failures = [r for r in results if not r["ok"]]
    assert proc.returncode == 0 and not failures, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert planned and len(results) == 2 * planned[0], proc.stdout[-3000:]


@pytest.mark.parametrize("job", ["check_combine.py", "check_service.py", "check_fp8.py", "check_graph.py",
                                 "check_replay.py --fp8"])
@pytest.mark.parametrize("share_gpu", [True, False], ids=["2-ranks-1-gpu", "2-ranks-2-gpus"])
@pytest.mark.parametrize("stores,build", [("own-bulk", "peer_ownbulk"), ("warps", "peer"), ("bulk", "peer_bulk")])
def test_job_passes_with_each_peer_store_build(job, share_gpu, stores, build, monkeypatch):
    """GEMM 2's peer sink with each way of moving its rows (EPSERVE_SINK_STORES: own-bulk, the
    default, bulk copies for the rows whose home is this rank; warps, the send warps' stores
    for every row; bulk, bulk copies for every row; cuda/sinks/row_scatter_bulk.cuh): the same
    bytes in the same slots, the bulk rows' arrival published a tile later, so every bitwise
    oracle of the jobs holds as is; every rank must have launched that build and no other
    peer build."""
    if not share_gpu and gpu_count() < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setenv("EPSERVE_SINK_STORES", stores)
    proc, results, planned = run_job(job, share_gpu)
    failures = [r for r in results if not r["ok"]]
    assert proc.returncode == 0 and not failures, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert planned and len(results) == 2 * planned[0], proc.stdout[-3000:]
    # Each record lists the builds its rank launched so far; the last case's records (one a
    # rank) cover the whole job.
    builds = [r["peer_builds"] for r in results]
    assert all(set(b) <= {build} for b in builds) and builds[-2:] == [[build]] * 2, builds


def test_fp8_back_to_back_fused_calls_equal_unfused():
    """The bench found FP8 fused != unfused now and then on two H200s (the split tails' A
    scales read after their ring stage was freed: cuda/gemm/grouped_gemm_fp8.cu, `release`);
    check_fp8.py, one synchronized forward at a time on small shapes, never did. Every one
    of many back-to-back fused calls at dsv3-prefill-fp8's sizes must equal unfused."""
    if gpu_count() < 2:
        pytest.skip("needs two GPUs")
    proc, results, planned = run_job("check_fp8_race.py --calls 32", share_gpu=False)
    failures = [r for r in results if not r["ok"]]
    assert proc.returncode == 0 and not failures, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert planned and len(results) == 2 * planned[0], proc.stdout[-3000:]
