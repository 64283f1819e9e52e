"""The wheel carries the kernel sources, and an installed epserve compiles from them, not from
a `cuda/` folder that happens to sit beside it (site-packages/cuda is cuda-python's). CI also
installs the wheel into a fresh virtual environment and compiles every variant (.ci/run)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from epserve.runtime import build, kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    setuptools = pytest.importorskip("setuptools")
    version = tuple(int(v) for v in setuptools.__version__.split(".")[:2])
    if version < (64, 0):
        pytest.skip(f"setuptools {setuptools.__version__} is older than the build needs (64)")
    if version < (70, 1):  # bdist_wheel moved into setuptools in 70.1
        pytest.importorskip("wheel")
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the test must not need a package index.
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("epserve-*.whl")
    return path


def test_wheel_carries_every_file_every_variant_includes(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {name for source, defines in kernels.VARIANTS.values() for name in build.include_closure(source)}
    missing = sorted(n for n in needed if f"epserve/_cuda/{n}" not in names)
    assert not missing, f"the wheel lacks kernel sources: {missing}"


def test_installed_package_compiles_from_its_own_copy(wheel, tmp_path):
    site = tmp_path / "site-packages"
    zipfile.ZipFile(wheel).extractall(site)
    # Where cuda-python's `cuda` lives, beside epserve (no __init__: the real one still imports).
    (site / "cuda" / "bindings").mkdir(parents=True)
    probe = ("import epserve.runtime.build as b; a = b.compile_source('ffn/swiglu.cu'); "
             "print(b.CUDA_ROOT); print('.target sm_90a' in a.ptx.read_text())")
    env = {**os.environ, "PYTHONPATH": str(site), "EPSERVE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(site / "epserve" / "_cuda"), "True"]
