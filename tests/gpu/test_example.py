"""The README's embedding example runs as printed (examples/embed.py, two ranks on one GPU)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def test_embedding_example_runs():
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "-n", "2", "--share-gpu", "--timeout", "240", "--",
           sys.executable, "-m", "mpi4py", str(ROOT / "examples" / "embed.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: out (300, 1024) bfloat16" in proc.stdout
