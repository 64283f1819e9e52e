"""A short run of every benchmark preset at small sizes completes, writes its JSON and
plots, and reports #wrong = 0 (issue 5)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from epserve.bench.presets import PRESETS
from epserve.runtime.gpu_probe import gpu_count

ROOT = Path(__file__).resolve().parents[2]
# The paths the benchmark compares with a reference (#wrong): bitwise with the unfused output or
# dispatch, within bf16 tolerance for the cuBLAS library paths. Both direct dispatches (the
# public call and the layer's) into poisoned buffers against the NCCL or host-planned one.
CHECKED_PATHS = ("fused", "library", "dispatch-direct", "dispatch-layer", "layer-fused", "layer-library")
# The -fp8 presets (epserve/bench/measure_fp8.py): fused and layer-fused bitwise against the
# unfused ones, GEMM 1 against its own rerun, the direct dispatches as above (with the
# dispatch of tokens quantized already, dispatch-packed, among them), and, where the
# ranks have NCCL (a GPU each), the library layer on cuBLASLt's block-scaled FP8 GEMM within
# bf16 tolerance.
CHECKED_PATHS_FP8 = ("gemm1", "fused", "dispatch-direct", "dispatch-layer", "dispatch-packed", "layer-fused")


def checked_paths(preset: str, share_gpu: bool = True) -> tuple:
    if preset.endswith("-fp8"):
        return CHECKED_PATHS_FP8 + (() if share_gpu else ("layer-library",))
    return CHECKED_PATHS


pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


@pytest.mark.parametrize("share_gpu", [True, False], ids=["2-ranks-1-gpu", "2-ranks-2-gpus"])
def test_quick_bench_of_every_preset(tmp_path, share_gpu):
    """Sharing a GPU, the baselines pull over IPC; with a GPU each they run over NCCL (the
    device-planned unfused path, the all-to-all row and the library layer's composition)."""
    if not share_gpu and gpu_count() < 2:
        pytest.skip("needs two GPUs: with one GPU per rank the NCCL paths run")
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "-n", "2", *(["--share-gpu"] if share_gpu else []),
           "--timeout", "500", "-v", "--",
           sys.executable, "-m", "mpi4py", "-m", "epserve.bench", "--quick", "--iters", "3", "--warmup", "1",
           "--tokens", "16,64", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=560, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "# total #wrong: 0" in proc.stdout
    run = json.loads((tmp_path / "bench.json").read_text())
    seen = {(r["preset"]["name"].split("/")[0], r["path"]) for r in run["rows"] if r["timing"] is not None}
    for name in PRESETS:
        for path in ("unfused", "gemm2", "dispatch-direct", "dispatch-layer", *checked_paths(name, share_gpu)):
            assert (name, path) in seen, (name, path)
        if not share_gpu and not name.endswith("-fp8"):  # the FP8 presets time epserve's paths only
            assert (name, "alltoall") in seen, name
    # Every path that ran was counted: waits and MPI calls per call, never missing.
    assert all(r["host_waits"] is not None and r["mpi_calls"] is not None
               for r in run["rows"] if r["timing"] is not None)
    epserve_paths = [r for r in run["rows"]
                     if r["timing"] is not None
                     and r["path"] in ("layer-fused", "dispatch-direct", "dispatch-layer", "dispatch-packed")]
    assert epserve_paths and all(r["mpi_calls"] == 0 for r in epserve_paths)
    # Every point of a checked path was checked, and found right; None would mean unchecked.
    checked = [r for r in run["rows"]
               if r["path"] in checked_paths(r["preset"]["name"].split("/")[0], share_gpu) + ("layer-torch",)]  # torch: where importable
    assert checked and all(r["wrong"] == 0 for r in checked), [(r["path"], r["wrong"]) for r in checked]
    assert len(list(tmp_path.glob("*.png"))) >= len(PRESETS) + 1
