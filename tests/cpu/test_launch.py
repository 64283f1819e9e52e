"""launch/run.py without MPI: finding the launcher, telling Open MPI from Hydra, the command
and environment it builds, argument checks, exit statuses and the timeout's process-group
kill (exercised with plain shell commands standing in for mpiexec)."""

import importlib.util
import os
import pathlib
import subprocess
import sys
import time

import pytest

from tests.processes import alive

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN_PY = REPO_ROOT / "launch" / "run.py"


def load_run_module():
    spec = importlib.util.spec_from_file_location("epserve_launch_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = load_run_module()

OPENMPI_VERSION = "mpirun (Open MPI) 4.1.6\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
OPENMPI5_VERSION = "mpirun (Open MPI) 5.0.3\n"
HYDRA_VERSION = "HYDRA build details:\n    Version:                                 5.0.2\n"


def make_executable(directory, name, body="#!/bin/sh\nexit 0\n"):
    path = directory / name
    path.write_text(body)
    path.chmod(0o755)
    return str(path)


# --- flavor -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, flavor",
    [
        (OPENMPI_VERSION, run.OPENMPI),
        (OPENMPI5_VERSION, run.OPENMPI),
        ("mpiexec (OpenRTE) 3.1.3\n", run.OPENMPI),
        (HYDRA_VERSION, run.HYDRA),
        ("Intel(R) MPI Library for Linux* OS, Version 2021.10\n", run.HYDRA),
        ("some other launcher 1.0\n", None),
    ],
)
def test_flavor_from_version_text(text, flavor):
    assert run.flavor_from_version_text(text) == flavor


def test_launcher_flavor_runs_version(tmp_path):
    fake = make_executable(tmp_path, "mpiexec", f"#!/bin/sh\nprintf '{OPENMPI5_VERSION}'\n")
    assert run.launcher_flavor(fake) == run.OPENMPI
    odd = make_executable(tmp_path, "odd", "#!/bin/sh\necho 'frobnicator 2'\n")
    with pytest.raises(run.LaunchError, match="neither Open MPI nor MPICH"):
        run.launcher_flavor(odd)


# --- finding the launcher -----------------------------------------------------------------


def test_find_launcher_prefers_path_then_python_dir(tmp_path):
    on_path, beside_python = tmp_path / "path", tmp_path / "venv_bin"
    on_path.mkdir()
    beside_python.mkdir()
    venv_mpiexec = make_executable(beside_python, "mpiexec")
    env = {"PATH": str(on_path)}
    assert run.find_launcher(env, exe_dir=str(beside_python)) == venv_mpiexec
    path_mpirun = make_executable(on_path, "mpirun")
    assert run.find_launcher(env, exe_dir=str(beside_python)) == path_mpirun
    path_mpiexec = make_executable(on_path, "mpiexec")
    assert run.find_launcher(env, exe_dir=str(beside_python)) == path_mpiexec


def test_find_launcher_none_and_override(tmp_path):
    assert run.find_launcher({"PATH": str(tmp_path)}, exe_dir=str(tmp_path)) is None
    chosen = make_executable(tmp_path, "my-mpiexec")
    env = {"PATH": "", run.LAUNCHER_ENV: chosen}
    assert run.find_launcher(env, exe_dir=str(tmp_path)) == chosen
    with pytest.raises(run.LaunchError, match="is not an executable"):
        run.find_launcher({"PATH": "", run.LAUNCHER_ENV: str(tmp_path / "nope")}, exe_dir="")


# --- environment and command --------------------------------------------------------------


def test_rank_environment_forces_nvls_off_and_prepends_repo():
    base = {"NCCL_NVLS_ENABLE": "1", "PYTHONPATH": "/a:/repo:/b"}
    updates = run.rank_environment(base, share_gpu=False, repo_root="/repo")
    assert updates["NCCL_NVLS_ENABLE"] == "0"
    assert updates["PYTHONUNBUFFERED"] == "1"
    assert updates["PYTHONPATH"] == os.pathsep.join(["/repo", "/a", "/b"])
    assert "EPSERVE_DEVICE" not in updates
    shared = run.rank_environment({}, share_gpu=True, repo_root="/repo")
    assert shared["EPSERVE_DEVICE"] == "0" and shared["PYTHONPATH"] == "/repo"


def test_forwarded_names_include_settings_and_relevant_caller_vars():
    env = {"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/root", "PATH": "/bin"}
    updates = {"NCCL_NVLS_ENABLE": "0", "PYTHONPATH": "/repo"}
    names = run.forwarded_names(env, updates)
    assert names[:2] == ["NCCL_NVLS_ENABLE", "PYTHONPATH"]
    assert {"NCCL_DEBUG", "CUDA_VISIBLE_DEVICES", "PATH"} <= set(names)
    assert "HOME" not in names


def test_openmpi_command_as_root():
    env = {"NCCL_NVLS_ENABLE": "0", "PYTHONPATH": "/repo"}
    argv = run.build_command(
        "/usr/bin/mpirun", run.OPENMPI, 2, env, ["NCCL_NVLS_ENABLE", "PYTHONPATH"],
        ["python", "-m", "mpi4py", "job.py"], as_root=True,
    )
    assert argv[:3] == ["/usr/bin/mpirun", "-n", "2"]
    assert "--allow-run-as-root" in argv and "--oversubscribe" in argv
    assert argv[argv.index("-x") + 1] == "NCCL_NVLS_ENABLE"
    assert ["-x", "PYTHONPATH"] == argv[argv.index("PYTHONPATH") - 1 : argv.index("PYTHONPATH") + 1]
    assert "-genv" not in argv
    assert argv[-4:] == ["python", "-m", "mpi4py", "job.py"]


def test_openmpi_command_not_root():
    argv = run.build_command("mpirun", run.OPENMPI, 4, {}, [], ["true"], as_root=False)
    assert "--allow-run-as-root" not in argv and "--oversubscribe" in argv
    assert argv[-1] == "true"


def test_the_program_is_made_absolute_by_the_launchers_path(tmp_path):
    (tmp_path / "prog").write_text("#!/bin/sh\n")
    (tmp_path / "prog").chmod(0o755)
    env = {"PATH": str(tmp_path)}
    argv = run.build_command("mpirun", run.OPENMPI, 2, env, [], ["prog", "arg"], as_root=False)
    assert argv[-2:] == [str(tmp_path / "prog"), "arg"]
    assert run.resolve_program(["./local", "x"], env) == ["./local", "x"]
    assert run.resolve_program(["not-there"], env) == ["not-there"]


def test_hydra_command_passes_values_with_genv():
    env = {"NCCL_NVLS_ENABLE": "0", "EPSERVE_DEVICE": "0"}
    argv = run.build_command(
        "mpiexec", run.HYDRA, 2, env, ["NCCL_NVLS_ENABLE", "EPSERVE_DEVICE"], ["python", "x.py"],
        as_root=True,
    )
    assert argv == [
        "mpiexec", "-n", "2",
        "-genv", "NCCL_NVLS_ENABLE", "0",
        "-genv", "EPSERVE_DEVICE", "0",
        "python", "x.py",
    ]


def test_dry_run_shows_the_whole_command(tmp_path, capsys, monkeypatch):
    make_executable(tmp_path, "mpiexec", f"#!/bin/sh\nprintf '{OPENMPI_VERSION}'\n")
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv(run.LAUNCHER_ENV, raising=False)
    assert run.main(["-n", "2", "--share-gpu", "--dry-run", "--", "python", "-m", "mpi4py", "j.py"]) == 0
    err = capsys.readouterr().err
    assert "ignoring NCCL_NVLS_ENABLE=1" in err
    assert "-x NCCL_NVLS_ENABLE" in err and "-x EPSERVE_DEVICE" in err
    assert err.rstrip().endswith("python -m mpi4py j.py")


# --- arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, command",
    [
        (["-n", "2", "--", "python", "-m", "mpi4py", "x.py", "-n", "3"],
         ["python", "-m", "mpi4py", "x.py", "-n", "3"]),
        (["-n", "2", "python", "x.py", "--", "y"], ["python", "x.py", "--", "y"]),
        (["--timeout", "5", "-n", "1", "--share-gpu", "--", "echo"], ["echo"]),
    ],
)
def test_parse_args_keeps_the_command_whole(argv, command):
    assert run.parse_args(argv).command == command


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "0", "--", "true"], "-n must be between 1"),
        (["-n", "-2", "--", "true"], "-n must be between 1"),
        (["-n", "2"], "no command given"),
        (["-n", "2", "--timeout", "0", "--", "true"], "--timeout must be positive"),
    ],
)
def test_parse_args_rejects(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        run.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_no_launcher_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k != run.LAUNCHER_ENV}
    env["PATH"] = "/nonexistent"
    # A copy of the interpreter's path that has no mpiexec beside it: run the script with
    # the venv's python would find mpich there, so point sys.executable's dir elsewhere.
    code = (
        "import runpy, sys; sys.executable = '/nonexistent/python'; "
        f"sys.argv = ['run.py', '-n', '2', '--', 'true']; runpy.run_path({str(RUN_PY)!r}, run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == run.NO_LAUNCHER_EXIT
    assert "no MPI launcher found" in done.stderr and "mpiexec" in done.stderr


# --- running, exit status, timeout --------------------------------------------------------


def test_run_job_returns_the_job_status():
    assert run.run_job(["sh", "-c", "exit 3"], dict(os.environ), timeout_s=30) == 3
    assert run.run_job(["true"], dict(os.environ), timeout_s=30) == 0


def test_run_job_reports_a_signal_death_the_shell_way():
    assert run.run_job(["sh", "-c", "kill -9 $$"], dict(os.environ), timeout_s=30) == 128 + 9


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find the processes")
def test_timeout_kills_process_group_and_escapees(tmp_path, capsys):
    pids = tmp_path / "pids"
    # A child in the job's group, and one that moves to a session of its own, as some MPI
    # launchers do with their ranks; both must be gone after the timeout.
    script = (
        f"sleep 300 & echo $! >> {pids}; "
        f"setsid sleep 300 & echo $! >> {pids}; "
        "wait"
    )
    start = time.monotonic()
    status = run.run_job(["sh", "-c", script], dict(os.environ), timeout_s=1.5)
    elapsed = time.monotonic() - start
    assert status == run.TIMEOUT_EXIT
    assert elapsed < 1.5 + run.KILL_GRACE_S + 5
    assert "epserve launch: job timed out after 1.5 s" in capsys.readouterr().err
    children = [int(p) for p in pids.read_text().split()]
    assert len(children) == 2
    deadline = time.monotonic() + 5
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in children), "a process of the job outlived the timeout"


def test_timeout_when_the_launcher_ignores_sigterm():
    # A stand-in launcher that ignores SIGTERM, in a fresh interpreter where run_job owns the
    # main thread: the SIGKILL after the grace period must still end it.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import run; "
        "sys.exit(run.run_job(sys.argv[2:], {'PATH': '/usr/bin:/bin'}, 1))"
    )
    stubborn = ["sh", "-c", "trap '' TERM; sleep 300"]
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code, str(RUN_PY.parent), *stubborn],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == run.TIMEOUT_EXIT, done.stderr
    assert done.stderr.strip() == "epserve launch: job timed out after 1 s"
    assert time.monotonic() - start < 1 + run.KILL_GRACE_S + 10


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find the processes")
def test_sigterm_to_the_launcher_takes_the_job_down(tmp_path):
    pid_file = tmp_path / "pid"
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import run; "
        "sys.exit(run.run_job(sys.argv[2:], {'PATH': '/usr/bin:/bin'}, 300))"
    )
    job = ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; wait"]
    launcher = subprocess.Popen(
        [sys.executable, "-c", code, str(RUN_PY.parent), *job],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    launcher.terminate()
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + 15, err
    assert "interrupted" in err
    assert not alive(child), "the job outlived its launcher"
