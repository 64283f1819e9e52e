"""The direct dispatch's route against the host plan, which shares no kernel with it
(launch/jobs/time_dispatch.py's checks, a routing with repeated experts and unused slots among
them), at token counts that give the count kernel one CTA and several, the last one partial
(each count CTA scans its own chunks, cuda/comm/dispatch_route.cuh, count_chunks): every row,
expert offset and src_info equal, bf16 rows and the FP8 move that quantizes (its own rows
stored by the warps, the default, and staged for the bulk copy engine), and the FP8 dispatch
of tokens packed already (the plain move of packed rows)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from epserve.dispatch.route import CHUNK, count_ctas

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


@pytest.mark.parametrize("preset,tokens", [("dsv3-prefill", 5000), ("dsv3-prefill-fp8", 5000), ("dsv3-decode", 100),
                                           ("dsv3-decode-fp8", 100)])
def test_direct_dispatch_route_equals_the_host_plan(preset, tokens):
    chunks = -(-tokens // CHUNK)
    assert count_ctas(chunks) == (5 if tokens == 5000 else 1)  # several count CTAs, the last partial; or one
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "-n", "1", "--timeout", "280", "--",
           sys.executable, "-m", "mpi4py", str(ROOT / "launch" / "jobs" / "time_dispatch.py"),
           "--preset", preset, "--tokens", str(tokens), "--iters", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = proc.stdout + proc.stderr
    # time_dispatch exits 1 when any check found a wrong byte
    assert proc.returncode == 0, out[-6000:]
    assert "NCCL dispatch #wrong 0" in out and "where they exist): #wrong 0" in out, out[-6000:]
    if preset.endswith("-fp8"):  # the quantizing move's own rows, staged for the bulk copies and by the warps
        assert "own rows staged " in out and "own rows by the warps" in out, out[-6000:]
        assert "quantize alone" in out and re.search(r"^tokens packed already .* 0$", out, re.M), out[-6000:]
