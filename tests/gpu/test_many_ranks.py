"""EP = 4 and 8 inside a node (issue 15): the service's check job, the graph job and a fuzz run
at 4 and 8 ranks. Ranks share GPUs where there are fewer GPUs than ranks (CUDA IPC works
between processes on one GPU; the unfused baseline then moves rows by the IPC copy, since
NCCL refuses two ranks on one device); with --share-gpu every rank is on GPU 0, without it
the launcher spreads the ranks over the GPUs there are."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from epserve.runtime.gpu_probe import gpu_count

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
FUZZ_SEED, FUZZ_CASES = 41, 12


def run_job(ranks: int, share_gpu: bool, job: str, *args: str):
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "-n", str(ranks), "--timeout", "400"]
    cmd += ["--share-gpu"] if share_gpu else []
    cmd += ["--", sys.executable, "-m", "mpi4py", str(ROOT / "launch" / "jobs" / job), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=460, cwd=ROOT)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    planned = [int(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("# cases:")]
    return proc, results, planned


def explain(proc):
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"


# (ranks, share_gpu): all on one GPU, or spread over two (two ranks per GPU at EP = 4).
LAYOUTS = pytest.mark.parametrize("ranks,share_gpu", [(4, True), (8, True), (4, False)],
                                  ids=["4-ranks-1-gpu", "8-ranks-1-gpu", "4-ranks-2-gpus"])


def need_layout(share_gpu):
    if not share_gpu and gpu_count() < 2:
        pytest.skip("needs two GPUs")


@LAYOUTS
@pytest.mark.parametrize("job", ["check_service.py", "check_graph.py"])
def test_job_passes_every_case(ranks, share_gpu, job):
    need_layout(share_gpu)
    proc, results, planned = run_job(ranks, share_gpu, job)
    failures = [r for r in results if not r["ok"]]
    assert proc.returncode == 0 and not failures, explain(proc)
    assert planned and len(results) == ranks * planned[0], explain(proc)
    # More ranks than GPUs: some ranks share one, so the unfused path is the IPC copy.
    assert {r.get("transport") for r in results} <= {"ipc"}, results


@LAYOUTS
def test_fuzz_finds_nothing_wrong(ranks, share_gpu):
    need_layout(share_gpu)
    proc, results, _ = run_job(ranks, share_gpu, "fuzz.py", "--seed", str(FUZZ_SEED), "--count", str(FUZZ_CASES),
                               "--share-gpu-ok")
    assert proc.returncode == 0, explain(proc)
    assert f"# fuzz: {FUZZ_CASES} cases, 0 wrong" in proc.stdout.splitlines(), explain(proc)
    assert len(results) == ranks and all(r["cases"] == FUZZ_CASES and r["wrong"] == 0 for r in results)
