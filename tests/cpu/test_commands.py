"""The commands a user types, on a machine without a GPU: `make help`, the benchmark's --help,
GPU commands that stop with one line, GPU-only test runs that refuse to pass when they tested
nothing, and a missing MPI library that says what to install."""

import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from epserve.runtime.gpu_probe import gpu_unusable_reason

ROOT = Path(__file__).resolve().parents[2]


def run(argv, **kw):
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, **kw)


def test_make_help_documents_every_target_and_variable():
    makefile = (ROOT / "Makefile").read_text()
    targets = re.search(r"^\.PHONY: (.*)$", makefile, re.M).group(1).split()
    variables = re.findall(r"^(\w+) \?=", makefile, re.M)
    assert "help" in targets and "BENCH_ARGS" in variables
    proc = run(["make", "--no-print-directory", "help"])
    assert proc.returncode == 0, proc.stderr
    for target in targets:
        assert re.search(rf"^\s+make {re.escape(target)}\s", proc.stdout, re.M), f"make help omits target {target}"
    for name in variables:
        assert re.search(rf"^\s+{name}=", proc.stdout, re.M), f"make help omits variable {name}"


def test_bench_help_gives_the_description_presets_and_defaults():
    from epserve.bench import measure, presets

    proc = run([sys.executable, "-m", "epserve.bench", "--help"])
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "python launch/run.py -n 2 -- python -m mpi4py -m epserve.bench" in text  # how to run it
    assert "exit status is 1 when any path got a wrong element" in " ".join(text.split())  # the end of the description
    for name, p in presets.PRESETS.items():
        assert re.search(rf"^\s+{name}\s+hidden\s+{p.hidden},", text, re.M), name
    for path in measure.PATHS:
        assert re.search(rf"^\s+{path}\s", text, re.M), path
    for option, default in (("--iters", "10"), ("--warmup", "3"), ("--seed", "17"), ("--routing", "balanced,skewed")):
        assert re.search(rf"{option} \w+\s.*?\(default: {default}\)", text, re.S), option


@pytest.mark.parametrize("module", ["epserve.bench", "epserve.main"])
def test_gpu_commands_without_a_gpu_say_so_in_one_line(module):
    if gpu_unusable_reason() is None:
        pytest.skip("this machine has a usable GPU")
    proc = run([sys.executable, "-m", module])
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"python -m {module} needs an NVIDIA Hopper GPU"), proc.stderr


def pytest_run(tmp_path, body, *flags):
    (tmp_path / "test_it.py").write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "--confcutdir", str(ROOT), "-c", os.devnull, "-p", "tests.conftest", *flags,
                           str(tmp_path)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_a_gpu_run_that_skipped_everything_fails(tmp_path):
    skipped = "import pytest\n\ndef test_a():\n    pytest.skip('no GPU')\n"
    proc = pytest_run(tmp_path, skipped, "--fail-if-all-skipped")
    assert proc.returncode == 1, proc.stdout
    assert "epserve: nothing was tested: every selected test was skipped" in proc.stdout
    assert pytest_run(tmp_path, skipped).returncode == 0  # without the flag a skip is fine
    assert pytest_run(tmp_path, "def test_a():\n    pass\n", "--fail-if-all-skipped").returncode == 0


def test_make_gpu_targets_refuse_to_pass_on_skips():
    proc = run(["make", "--no-print-directory", "-n", "test-gpu", "dead-peer"])
    pytest_lines = [line for line in proc.stdout.splitlines() if " -m pytest " in line]
    assert len(pytest_lines) == 2, proc.stdout
    assert all("--fail-if-all-skipped" in line for line in pytest_lines), pytest_lines


def test_missing_mpi_library_says_what_to_install(monkeypatch):
    from epserve.comm import mpi as comm
    from epserve.errors import EPServeError

    def no_library(name):
        raise RuntimeError("cannot load MPI library\nlibmpi.so: cannot open shared object file")

    fake = types.ModuleType("mpi4py")
    fake.__getattr__ = no_library  # `from mpi4py import MPI` fails as mpi4py's wheel does without libmpi
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    with pytest.raises(EPServeError, match=r"pip install 'epserve\[mpich\]'"):
        comm.world()
