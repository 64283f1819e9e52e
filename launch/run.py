#!/usr/bin/env python3
"""Start an epserve job on N ranks under the local MPI launcher (Open MPI or MPICH/Hydra).

    python launch/run.py -n N [--timeout SEC] [--share-gpu] [--] command ...

Start Python ranks as `python -m mpi4py script.py ...` (or `python -m mpi4py -m module`):
mpi4py's runner then calls MPI_Abort when a rank raises an uncaught exception, so the whole
job ends at once with a non-zero status instead of the surviving ranks waiting forever in
their next collective. This launcher runs whatever command it is given; it does not add that.

What the launcher does:
- finds `mpiexec` or `mpirun` (EPSERVE_MPIEXEC, then PATH, then the directory of the Python
  running this file, where the `mpich` wheel puts its `mpiexec`), and tells Open MPI from
  MPICH/Hydra by its `--version` output;
- sets, for every rank: NCCL_NVLS_ENABLE=0 (NVLink multicast stays off, whatever the caller's
  environment says: docs/design.md, "IPC lifetime"), PYTHONUNBUFFERED=1 (rank output arrives as it is
  printed, not at exit), PYTHONPATH with the repository root first (so `import epserve`
  works without installing it) and, with --share-gpu, EPSERVE_DEVICE=0 (every rank on GPU 0;
  without it each rank takes local_rank % GPUs in epserve.comm.mpi.select_device);
- passes those and the caller's EPSERVE_*, NCCL_*, CUDA_* and CUPY_* variables to the ranks
  explicitly (`-x NAME` for Open MPI, `-genv NAME VALUE` for Hydra), since Open MPI forwards
  nothing it is not told to;
- runs the MPI launcher in a new process session and, after --timeout seconds (default 600),
  kills the whole process group (and any rank that left it), prints
  `epserve launch: job timed out after N s` to stderr and exits 124;
- otherwise exits with the job's status: non-zero when any rank failed.

Importable: the pieces are functions (find_launcher, launcher_flavor, rank_environment,
build_command, run_job, main) so tests can check the command without starting MPI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TIMEOUT_EXIT = 124  # what coreutils `timeout` returns, so CI scripts read it the same way
NO_LAUNCHER_EXIT = 127  # the shell's "command not found"
DEFAULT_TIMEOUT_S = 600.0
MAX_RANKS = 1024  # far above any one-host job; a larger -n is a typo
KILL_GRACE_S = 5.0  # time the MPI launcher gets after SIGTERM to take its ranks down

OPENMPI = "openmpi"
HYDRA = "hydra"

LAUNCHER_NAMES = ("mpiexec", "mpirun")
LAUNCHER_ENV = "EPSERVE_MPIEXEC"
# Caller variables that matter to ranks and are forwarded when set.
FORWARDED_PREFIXES = ("EPSERVE_", "NCCL_", "CUDA_", "CUPY_")
FORWARDED_NAMES = ("PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")


class LaunchError(Exception):
    """A problem with the launch itself (not with the job); main prints it and exits."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def _say(message: str) -> None:
    print(f"epserve launch: {message}", file=sys.stderr, flush=True)


def find_launcher(env=None, exe_dir=None) -> str | None:
    """Path of the MPI launcher to use, or None when there is none.

    Looks at $EPSERVE_MPIEXEC, then for mpiexec/mpirun on $PATH, then beside the Python
    interpreter (`exe_dir`, default the directory of sys.executable, not resolved through
    symlinks so a virtual environment's bin/ is the one searched).
    """
    env = os.environ if env is None else env
    explicit = env.get(LAUNCHER_ENV)
    if explicit:
        found = shutil.which(explicit, path=env.get("PATH"))
        if found is None:
            raise LaunchError(f"{LAUNCHER_ENV}={explicit!r} is not an executable", NO_LAUNCHER_EXIT)
        return found
    for name in LAUNCHER_NAMES:
        found = shutil.which(name, path=env.get("PATH", os.defpath))
        if found:
            return found
    exe_dir = os.path.dirname(sys.executable) if exe_dir is None else exe_dir
    for name in LAUNCHER_NAMES:
        found = shutil.which(name, path=exe_dir)
        if found:
            return found
    return None


def flavor_from_version_text(text: str) -> str | None:
    """OPENMPI or HYDRA from a launcher's `--version` output; None if it is neither."""
    if "Open MPI" in text or "OpenRTE" in text or "Open RTE" in text:
        return OPENMPI
    if "HYDRA" in text or "Hydra" in text or "MPICH" in text or "Intel(R) MPI" in text:
        return HYDRA
    return None


def launcher_flavor(launcher: str) -> str:
    """Ask `launcher --version` which MPI it belongs to."""
    try:
        done = subprocess.run(
            [launcher, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run '{launcher} --version': {exc}") from exc
    text = done.stdout + done.stderr
    flavor = flavor_from_version_text(text)
    if flavor is None:
        first = text.strip().splitlines()[:2]
        raise LaunchError(
            f"'{launcher}' is neither Open MPI nor MPICH/Hydra; its --version said: {first}"
        )
    return flavor


def rank_environment(base_env, share_gpu: bool, repo_root: str = REPO_ROOT) -> dict:
    """The variables this launcher sets for the ranks (to be laid over `base_env`)."""
    old_path = base_env.get("PYTHONPATH", "")
    kept = [p for p in old_path.split(os.pathsep) if p and p != repo_root]
    updates = {
        "NCCL_NVLS_ENABLE": "0",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([repo_root] + kept),
    }
    if share_gpu:
        updates["EPSERVE_DEVICE"] = "0"
    return updates


def forwarded_names(env, updates) -> list:
    """Names of the variables to hand to the ranks explicitly, in a stable order."""
    names = list(updates)
    for name in sorted(env):
        if name in names:
            continue
        if name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES):
            names.append(name)
    return names


def build_command(launcher, flavor, nprocs, env, names, command, as_root=None) -> list:
    """The full argv: launcher, its flags, the environment to forward, then `command`.

    `env` is the environment the launcher itself will run with (values for Hydra's -genv),
    `names` the variables to forward.
    """
    if as_root is None:
        as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    argv = [launcher, "-n", str(nprocs)]
    if flavor == OPENMPI:
        if as_root:
            argv.append("--allow-run-as-root")
        # More ranks than cores is normal here (2 ranks on a 2-core CI machine, or on one GPU
        # host with few slots); and GPU ranks want all cores for their helper threads rather
        # than Open MPI's default pinning to one.
        argv += ["--oversubscribe", "--bind-to", "none"]
        for name in names:
            argv += ["-x", name]
    elif flavor == HYDRA:
        for name in names:
            argv += ["-genv", name, env[name]]
    else:
        raise LaunchError(f"unknown MPI launcher flavor {flavor!r}")
    return argv + resolve_program(command, env)


def resolve_program(command, env) -> list:
    """The command with its program made absolute by the launcher's own PATH: Open MPI's
    daemons look a bare name up in their own PATH, which may find another python3."""
    command = list(command)
    if command and os.sep not in command[0] and env.get("PATH"):
        found = shutil.which(command[0], path=env["PATH"])
        if found:
            command[0] = os.path.abspath(found)
    return command


def _descendants(pid: int) -> list:
    """All live descendants of `pid`, from /proc (empty where /proc is missing)."""
    children = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: parse after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _signal_all(pgid: int, pids, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_job(proc: subprocess.Popen) -> None:
    """Take the job down: SIGTERM first so the MPI launcher can stop its ranks, then SIGKILL
    for the process group and every descendant found, including ranks that a launcher
    moved into process groups of their own."""
    pids = _descendants(proc.pid)
    _signal_all(proc.pid, pids, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    pids = sorted(set(pids) | set(_descendants(proc.pid)))
    _signal_all(proc.pid, pids, signal.SIGKILL)
    proc.wait()


class _Terminated(Exception):
    """This launcher got SIGTERM while the job ran."""


def _exit_status(returncode: int) -> int:
    # A launcher killed by a signal reads as a negative code; report it the shell's way.
    return 128 - returncode if returncode < 0 else returncode


def run_job(argv, env, timeout_s: float) -> int:
    """Run `argv` in its own session with `env`; return its exit status, or 124 after
    printing the timeout line when it runs longer than `timeout_s` seconds."""
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    # SIGTERM to this launcher (a CI runner's timeout, pytest killing a subprocess) must not
    # orphan the job: turn it into the same teardown as a timeout.
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        # Once is enough: a second SIGTERM must not cut the bounded teardown short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Terminated

    in_main_thread = _is_main_thread()
    if in_main_thread:
        signal.signal(signal.SIGTERM, on_term)
    try:
        try:
            return _exit_status(proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            # Said first: the MPI launcher's own teardown noise follows it.
            _say(f"job timed out after {_format_seconds(timeout_s)} s")
            _kill_job(proc)
            return TIMEOUT_EXIT
        except (KeyboardInterrupt, _Terminated) as exc:
            _say("interrupted; killing the job")
            _kill_job(proc)
            return 128 + (signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _format_seconds(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else f"{seconds:g}"


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="launch/run.py",
        description="Run a command on N MPI ranks with epserve's environment.",
        epilog="Python ranks: start them as `python -m mpi4py script.py` so an uncaught "
        "exception aborts the whole job.",
    )
    parser.add_argument("-n", "--np", dest="nprocs", type=int, required=True, help="number of ranks")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"kill the job after SEC seconds and exit {TIMEOUT_EXIT} (default %(default)g)",
        metavar="SEC",
    )
    parser.add_argument(
        "--share-gpu",
        action="store_true",
        help="put every rank on GPU 0 (EPSERVE_DEVICE=0), e.g. two ranks on a one-GPU host",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print the MPI command line")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the MPI command line and exit without running it"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    args = parser.parse_args(argv)
    # Some Python versions keep the "--" that separates the command in REMAINDER.
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given (usage: run.py -n N [options] [--] command ...)")
    if not 1 <= args.nprocs <= MAX_RANKS:
        parser.error(f"-n must be between 1 and {MAX_RANKS}, got {args.nprocs}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be positive, got {args.timeout:g}")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        launcher = find_launcher()
        if launcher is None:
            raise LaunchError(
                "no MPI launcher found: looked for "
                + " and ".join(LAUNCHER_NAMES)
                + f" on PATH and in {os.path.dirname(sys.executable)}; install Open MPI or "
                "MPICH, `pip install mpich` into this Python's environment, run `make install`, "
                f"or point {LAUNCHER_ENV} at one",
                NO_LAUNCHER_EXIT,
            )
        flavor = launcher_flavor(launcher)
    except LaunchError as exc:
        _say(str(exc))
        return exc.exit_code
    env = dict(os.environ)
    if env.get("NCCL_NVLS_ENABLE", "0") != "0":
        _say(f"ignoring NCCL_NVLS_ENABLE={env['NCCL_NVLS_ENABLE']}: NVLink multicast stays off")
    updates = rank_environment(env, args.share_gpu)
    env.update(updates)
    argv = build_command(launcher, flavor, args.nprocs, env, forwarded_names(env, updates), args.command)
    if args.verbose or args.dry_run:
        _say(" ".join(argv))
    if args.dry_run:
        return 0
    return run_job(argv, env, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
