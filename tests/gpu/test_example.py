"""The README's embedding example runs as printed (examples/embed.py, two ranks on one GPU) and
computes a real layer: a non-zero, finite output, bitwise equal to the unfused baseline's.
tests/cpu/test_docs.py checks that the README shows this file's code."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

LINE = re.compile(r"^rank (\d): out \(300, 1024\) bfloat16, mean \|out\| (\S+), fused == unfused bitwise: (\w+)$",
                  re.MULTILINE)


def test_embedding_example_runs():
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "-n", "2", "--share-gpu", "--timeout", "240", "--",
           sys.executable, "-m", "mpi4py", str(ROOT / "examples" / "embed.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {int(rank): (float(size), same) for rank, size, same in LINE.findall(proc.stdout)}
    assert set(lines) == {0, 1}, proc.stdout[-3000:]
    for rank, (size, same) in lines.items():
        assert same == "True", f"rank {rank}: the fused output differs from the unfused one"
        # x ~ N(0, 1), weights scaled by 1/sqrt(fan-in), router weights in [0, 1): |out| is
        # about 0.1 to 1; zeros or a blow-up mean the layer did not compute.
        assert math.isfinite(size) and 0.01 < size < 10, f"rank {rank}: mean |out| = {size}"
