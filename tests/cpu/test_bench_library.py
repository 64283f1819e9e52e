"""The bench's library layers: torch stays optional (looked up only when its row runs)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_imports_without_touching_torch():
    pytest.importorskip("cupy")
    code = "import sys, epserve.bench.measure, epserve.bench.library_layer; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
