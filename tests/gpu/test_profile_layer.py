"""launch/jobs/profile_layer.py times one forward launch by launch: every stage's kernels are
listed in call order, and the launches' spans add up to the call or less (their medians
against the call's, within 5%)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


@pytest.mark.parametrize("preset", ["qwen3-moe", "dsv3-decode-fp8"])
def test_forward_launch_by_launch(preset):
    job = [sys.executable, str(ROOT / "launch" / "jobs" / "profile_layer.py"), "--preset", preset, "--tokens", "64",
           "--as-rank-of", "2", "--iters", "3"]
    run = subprocess.run([sys.executable, str(ROOT / "launch" / "run.py"), "-n", "1", "--timeout", "240", "--", *job],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = re.findall(r"^\s*\d+\s+(\w+)\s+([\d.]+)$", run.stdout, re.M)
    kernels = [name for name, _ in rows]
    assert kernels[0].startswith("epserve_dispatch"), run.stdout
    assert kernels[-1].startswith("epserve_combine_reduce"), run.stdout
    gemms = [k for k in kernels if k.startswith("epserve_grouped_gemm")]
    assert len(gemms) == 2, run.stdout  # GEMM 1 (with SwiGLU) and GEMM 2 (with the peer sink)
    total = float(re.search(r"sum of the launches\s+([\d.]+)", run.stdout).group(1))
    call = float(re.search(r"the call \(start to end event\)\s+([\d.]+)", run.stdout).group(1))
    assert all(float(us) > 0 for _, us in rows)
    assert 0 < total <= call * 1.05, run.stdout  # medians of the spans against the call's
