"""The peer sink on two ranks (issue 3): launch/jobs/check_combine.py under the launcher, with
two ranks sharing one GPU and, where there are two, with one GPU each."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def gpu_count():
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def run_check(share_gpu: bool, quick: bool):
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "-n", "2", "--timeout", "540"]
    cmd += ["--share-gpu"] if share_gpu else []
    cmd += ["--", sys.executable, "-m", "mpi4py", str(ROOT / "launch" / "jobs" / "check_combine.py")]
    cmd += ["--quick"] if quick else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return proc, results


@pytest.mark.parametrize("share_gpu", [True, False], ids=["2-ranks-1-gpu", "2-ranks-2-gpus"])
def test_fused_equals_unfused_and_reference(share_gpu):
    if not share_gpu and gpu_count() < 2:
        pytest.skip("needs two GPUs")
    proc, results = run_check(share_gpu, quick=False)
    failures = [r for r in results if not r["ok"]]
    assert proc.returncode == 0 and not failures, proc.stdout[-6000:] + proc.stderr[-6000:]
    planned = [int(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("# cases:")]
    assert planned and len(results) == 2 * planned[0], proc.stdout[-3000:]
    transports = {r["transport"] for r in results}
    assert transports == ({"ipc"} if share_gpu else {"nccl"})
