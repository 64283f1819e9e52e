"""Real multi-process runs of launch/jobs/bootstrap_check.py through launch/run.py under the
machine's MPI launcher (Open MPI or MPICH/Hydra): bootstrap, cross-rank agreement, collective
verdicts, and that a crashed or hung rank ends the job instead of hanging it. CPU only."""

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from tests.processes import alive

pytestmark = pytest.mark.mpi

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN_PY = REPO_ROOT / "launch" / "run.py"
JOB = REPO_ROOT / "launch" / "jobs" / "bootstrap_check.py"

# Generous against a loaded 2-core CI machine; a healthy run takes about a second.
JOB_TIMEOUT_S = 120
HANG_TIMEOUT_S = 6
# What the launcher may take beyond its own timeout: SIGTERM grace, then SIGKILL and reaping.
TEARDOWN_S = 15


def _find_launcher():
    import importlib.util

    spec = importlib.util.spec_from_file_location("epserve_launch_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.find_launcher()


LAUNCHER = _find_launcher()
if LAUNCHER is None:
    pytest.skip(
        "no MPI launcher (mpiexec/mpirun) on PATH or beside this Python; "
        "`make install` provides one",
        allow_module_level=True,
    )


def launch(mode_or_command, nprocs=2, timeout_s=JOB_TIMEOUT_S, share_gpu=False):
    """Run a job through launch/run.py; return (returncode, stdout, stderr, seconds)."""
    if isinstance(mode_or_command, str):
        command = [sys.executable, "-m", "mpi4py", str(JOB), mode_or_command]
    else:
        command = list(mode_or_command)
    argv = [sys.executable, str(RUN_PY), "-n", str(nprocs), "--timeout", str(timeout_s)]
    if share_gpu:
        argv.append("--share-gpu")
    start = time.monotonic()
    done = subprocess.run(
        argv + ["--"] + command,
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s + TEARDOWN_S + 30,
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - start


def explain(rc, out, err):
    return f"exit {rc}\n--- stdout\n{out}\n--- stderr\n{err}"


def rank_pids(out):
    return {int(r): int(p) for r, p in re.findall(r"rank (\d+) of \d+ pid (\d+)", out)}


def test_ok_bootstraps_both_ranks_and_agrees_on_config():
    rc, out, err, _ = launch("ok")
    assert rc == 0, explain(rc, out, err)
    # "of 2" proves the ranks joined one world: an mpi4py built for another MPI than the
    # launcher would start two singleton worlds of size 1.
    for rank in (0, 1):
        assert f"rank {rank} of 2 pid" in out, explain(rc, out, err)
        assert f"rank {rank}: config agreed" in out
        assert f"rank {rank}: mode ok done, status 0" in out
    local = dict(re.findall(r"rank (\d+): local_rank (\d+)", out))
    assert local == {"0": "0", "1": "1"}, explain(rc, out, err)


def test_mismatch_reported_by_every_rank_naming_the_field():
    rc, out, err, _ = launch("mismatch")
    assert rc == 0, explain(rc, out, err)
    for rank in (0, 1):
        lines = re.findall(rf"^rank {rank}: RankMismatchError: (.*)$", out, re.MULTILINE)
        assert len(lines) == 1, explain(rc, out, err)
        assert "hidden" in lines[0] and "256" in lines[0] and "512" in lines[0]
    assert "WRONG" not in out


def test_verdict_every_rank_names_the_failing_rank():
    rc, out, err, _ = launch("verdict")
    assert rc == 0, explain(rc, out, err)
    for rank in (0, 1):
        lines = re.findall(rf"^rank {rank}: RankFailedError: (.*)$", out, re.MULTILINE)
        assert len(lines) == 1, explain(rc, out, err)
        assert "load weights" in lines[0]
        assert "rank 1: ValueError: simulated failure on rank 1" in lines[0]


def test_crash_of_one_rank_ends_the_job_quickly():
    rc, out, err, seconds = launch("crash")
    assert rc != 0, explain(rc, out, err)
    assert rc != 124, "the job had to be killed by the timeout: a crashed rank hung the others\n" + explain(rc, out, err)
    assert seconds < JOB_TIMEOUT_S
    assert "deliberate uncaught exception on rank 1" in out + err
    assert "WRONG" not in out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to check for leftover ranks")
def test_hang_is_ended_by_the_launcher_timeout():
    rc, out, err, seconds = launch("hang", timeout_s=HANG_TIMEOUT_S)
    assert rc == 124, explain(rc, out, err)
    assert seconds < HANG_TIMEOUT_S + TEARDOWN_S, f"took {seconds:.1f} s"
    assert f"epserve launch: job timed out after {HANG_TIMEOUT_S} s" in err
    pids = rank_pids(out)
    assert set(pids) == {0, 1}, explain(rc, out, err)
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids.values()), "a rank outlived the timeout"


def test_ranks_get_the_launcher_environment():
    show = (
        # one write per line: print() writes the text and the newline separately, and the
        # two ranks' output would interleave between them
        "import os, sys; sys.stdout.write(' '.join(['ENV', os.environ.get('NCCL_NVLS_ENABLE'), "
        "os.environ.get('PYTHONUNBUFFERED'), os.environ.get('EPSERVE_DEVICE'), "
        "os.environ.get('PYTHONPATH', '').split(os.pathsep)[0]]) + '\\n')"
    )
    rc, out, err, _ = launch([sys.executable, "-c", show], share_gpu=True)
    assert rc == 0, explain(rc, out, err)
    lines = re.findall(r"^ENV (.*)$", out, re.MULTILINE)
    assert lines == [f"0 1 0 {REPO_ROOT}"] * 2, explain(rc, out, err)


def test_failing_rank_status_is_the_job_status():
    rc, out, err, _ = launch([sys.executable, "-c", "import sys; sys.exit(3)"], nprocs=1)
    assert rc == 3, explain(rc, out, err)


@pytest.mark.gpu
def test_select_device_on_two_ranks():
    show = (
        "from epserve.comm.mpi import local_rank, select_device, world; import cupy; "
        "d = select_device(); "
        "rows = world().gather((local_rank(), d, cupy.cuda.runtime.getDevice(), cupy.cuda.runtime.getDeviceCount())); "
        "[print('DEV', *r) for r in rows or []]"
    )
    for share_gpu in (True, False):
        rc, out, err, _ = launch([sys.executable, "-m", "mpi4py", "-c", show], share_gpu=share_gpu)
        assert rc == 0, explain(rc, out, err)
        rows = [tuple(map(int, m)) for m in re.findall(r"^DEV (\d+) (\d+) (\d+) (\d+)$", out, re.MULTILINE)]
        assert len(rows) == 2, explain(rc, out, err)
        for node_rank, chosen, current, count in rows:
            assert chosen == current, "select_device must make its device current"
            assert chosen == (0 if share_gpu else node_rank % count)


# --- EPService on ranks without a GPU: as far as the API goes before it needs one ------------

SERVICE_JOB = REPO_ROOT / "launch" / "jobs" / "service_without_gpu.py"


def service_lines(mode):
    rc, out, err, _ = launch([sys.executable, "-m", "mpi4py", str(SERVICE_JOB), mode])
    assert rc == 0, explain(rc, out, err)
    lines = dict(re.findall(r"^rank (\d+): (.*)$", out, re.MULTILINE))
    assert set(lines) == {"0", "1"}, explain(rc, out, err)
    return lines


def test_service_config_mismatch_is_reported_on_every_rank_before_any_cuda_call():
    for line in service_lines("mismatch").values():
        assert line.startswith("RankMismatchError: ranks disagree on MoEConfig: hidden: rank 0="), line


def test_service_refuses_an_unknown_off_node_carrier_on_every_rank_before_any_cuda_call():
    # EPSERVE_RANKS_PER_NODE=1 plays two nodes on one machine; rank 1 names a carrier that does
    # not exist, so every rank stops at setup with the reason (issue 15).
    for line in service_lines("two-nodes").values():
        assert line.startswith("ConfigError: rank 1: EPSERVE_OFFNODE_CARRIER='pigeon'"), line


def test_service_refuses_an_unknown_gemm_setting_on_every_rank_before_any_cuda_call():
    # A GEMM setting is read when GEMM 2's launches are built, after the dispatch has moved
    # rows: setup checks it first, on every rank.
    for line in service_lines("gemm-setting").values():
        assert line.startswith("ConfigError: rank 0: EPSERVE_GEMM2_SPLIT_K must be one of"), line


def test_service_without_a_gpu_fails_on_every_rank_at_device_selection():
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        pytest.skip("cupy is not installed")
    from epserve.runtime.gpu_probe import gpu_unusable_reason

    if gpu_unusable_reason() is None:
        pytest.skip("this machine has a GPU: the service would start")
    for line in service_lines("agree").values():
        assert line.startswith("RankFailedError: ") and "select_device" in line, line
