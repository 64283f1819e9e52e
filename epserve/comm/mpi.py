"""MPI bootstrap and collective verdicts.

Every multi-rank failure in epserve must end with *every* rank raising, never with one rank
dead and the others parked in a collective that can no longer complete. The tools here do
that by turning a local outcome into a shared one before any data moves: each rank
contributes its error (or None) to an allgather, and every rank raises the same exception
when any rank failed.

Neither mpi4py nor CuPy is imported at module import time: importing mpi4py.MPI initializes
MPI, and the first CuPy CUDA call fixes the process's device, which must be chosen from the
local rank first (docs/design.md, "IPC lifetime").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import socket
import time

from epserve.errors import EPServeError, RankFailedError, RankMismatchError

# The env var that overrides the device a rank uses (the launcher's --share-gpu sets it to 0).
DEVICE_ENV = "EPSERVE_DEVICE"

# Exceptions that are collective by contract: every rank raises them together, so a
# `checked` block passes them through instead of voting again (which would only wrap the
# same verdict a second time and change the class callers catch).
_ALREADY_COLLECTIVE = (RankFailedError, RankMismatchError)

# comm id -> (comm, local rank). The comm is kept in the entry so its id cannot be reused
# by another object while the entry exists.
_local_rank_cache: dict[int, tuple[object, int]] = {}


MPI_MISSING = ("mpi4py found no MPI library to load. Install one: pip install 'epserve[mpich]' (the MPICH "
               "wheel, with its mpiexec), or your system's MPI (Debian/Ubuntu: apt install mpich, or "
               "libopenmpi-dev openmpi-bin), then start the ranks with mpiexec")


def _mpi():
    """The mpi4py.MPI module, imported on first use (the import initializes MPI)."""
    try:
        from mpi4py import MPI
    except RuntimeError as exc:
        # mpi4py's wheel loads libmpi at import time and lists every path it tried.
        if "cannot load MPI library" not in str(exc):
            raise
        raise EPServeError(MPI_MISSING) from None
    return MPI


def world(comm=None):
    """`comm`, or MPI.COMM_WORLD when it is None."""
    if comm is not None:
        return comm
    return _mpi().COMM_WORLD


def local_rank(comm=None) -> int:
    """This rank's index among the ranks of `comm` on the same node (shared-memory domain).

    Collective on the first call for a given communicator (it splits `comm`); later calls
    return the cached value without communicating.
    """
    comm = world(comm)
    cached = _local_rank_cache.get(id(comm))
    if cached is not None and cached[0] is comm:
        return cached[1]
    node_comm = comm.Split_type(_mpi().COMM_TYPE_SHARED)
    try:
        rank = node_comm.Get_rank()
    finally:
        node_comm.Free()
    _local_rank_cache[id(comm)] = (comm, rank)
    return rank


def _requested_device() -> int | None:
    """The device named by EPSERVE_DEVICE, or None when it is unset or empty."""
    text = os.environ.get(DEVICE_ENV, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise EPServeError(f"{DEVICE_ENV}={text!r} is not a device index (an integer >= 0)") from None


def _driver_hint() -> str:
    # Without a driver the runtime says "driver version is insufficient", which sends people
    # looking for a driver upgrade; say plainly when there is no driver at all.
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return " (no NVIDIA driver: libcuda.so.1 cannot be loaded)"
    return ""


def _device_count() -> int:
    """Number of CUDA devices this process sees; raises EPServeError when it sees none."""
    try:
        import cupy
    except Exception as exc:  # an ImportError, or a CUDA library CuPy could not load
        raise EPServeError(f"cannot import cupy to find a GPU: {type(exc).__name__}: {exc}") from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device, driver too old
        raise EPServeError(
            f"no usable NVIDIA GPU on host {socket.gethostname()}{_driver_hint()}: "
            f"cudaGetDeviceCount failed: {type(exc).__name__}: {exc}"
        ) from exc
    if count < 1:
        raise EPServeError(f"no NVIDIA GPU visible on host {socket.gethostname()} (device count 0)")
    return count


def select_device(comm=None, device=None) -> int:
    """Make this rank's GPU current before any other CUDA call, and return its index.

    The device is, in order of precedence: `device`; the EPSERVE_DEVICE environment
    variable; `local_rank(comm) % device_count`. Collective over `comm` (every rank calls it):
    a rank without a usable GPU makes every rank raise RankFailedError (an EPServeError)
    naming it, instead of leaving the others to wait for it later.
    """
    comm = world(comm)
    # Computed even when a device is given, so the call is collective on every rank whatever
    # each rank's arguments or environment say.
    node_rank = local_rank(comm)
    error = None
    chosen = -1
    try:
        requested = device if device is not None else _requested_device()
        count = _device_count()
        chosen = requested if requested is not None else node_rank % count
        if not 0 <= chosen < count:
            source = "device argument" if device is not None else DEVICE_ENV
            raise EPServeError(
                f"{source} asks for GPU {chosen} but host {socket.gethostname()} shows "
                f"{count} GPU(s) (valid: 0..{count - 1})"
            )
        import cupy

        cupy.cuda.Device(chosen).use()
    except Exception as exc:
        error = exc
    collective_verdict(comm, "select_device", error)
    return chosen


def _describe(error) -> str:
    if isinstance(error, BaseException):
        text = str(error)
        return f"{type(error).__name__}: {text}" if text else type(error).__name__
    return str(error)


def collective_verdict(comm, stage: str, error=None) -> None:
    """Agree across all ranks on whether `stage` succeeded; raise everywhere if it did not.

    Every rank of `comm` must call this, with `error` None when its part of the stage went
    well, or the exception (or a message string) when it did not. If any rank reports an
    error, every rank raises RankFailedError naming the stage and each failing rank with its
    message; on a failing rank the local exception is chained as the cause. The exception
    carries `.stage` and `.failures` ({rank: message}).

    Call it before any collective data movement that depends on the stage, so that no rank
    is left waiting for a peer that has already given up.
    """
    comm = world(comm)
    mine = None if error is None else _describe(error)
    reports = comm.allgather(mine)
    failures = {rank: message for rank, message in enumerate(reports) if message is not None}
    if not failures:
        return
    listed = "; ".join(f"rank {rank}: {message}" for rank, message in failures.items())
    exc = RankFailedError(
        f"stage '{stage}' failed on {len(failures)} of {len(reports)} rank(s): {listed}"
    )
    exc.stage = stage
    exc.failures = failures
    if isinstance(error, BaseException):
        raise exc from error
    raise exc


def bounded_barrier(comm, timeout_s: float, tag: int) -> list[int]:
    """A barrier that gives up after timeout_s: every rank tells every other that it arrived,
    then waits (polling, never blocking in MPI) to hear the same from them. Returns the ranks
    it did not hear from in time; empty means every rank arrived. For teardown, where a stuck
    peer must not hang the others (docs/design.md, "IPC lifetime"); `tag` keeps one round's
    messages apart from another's."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return []
    MPI = _mpi()
    token = bytearray(1)
    for d in range(size):
        if d != rank:
            comm.Isend([token, MPI.BYTE], dest=d, tag=tag)  # one byte: sent eagerly, never awaited
    bufs = {s: bytearray(1) for s in range(size) if s != rank}
    pending = {s: comm.Irecv([buf, MPI.BYTE], source=s, tag=tag) for s, buf in bufs.items()}
    deadline = time.monotonic() + timeout_s
    while pending:
        pending = {s: req for s, req in pending.items() if not req.Test()}
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    for req in pending.values():
        req.Cancel()
        req.Wait()
    return sorted(pending)


def _same(a, b) -> bool:
    """Equality for gathered values, robust to values (arrays) whose == is not a bool."""
    try:
        return bool(a == b)
    except Exception:
        return pickle.dumps(a) == pickle.dumps(b)


_MISSING = "<missing>"


def agree(comm, what: str, values: dict) -> None:
    """Check that every rank of `comm` holds the same `values`; raise on every rank if not.

    Collective. `values` maps field names to plain picklable values (ints, strings, tuples).
    On disagreement every rank raises RankMismatchError naming `what`, each field that
    differs and each rank's value of it (a field some rank lacks shows as <missing>). The
    exception carries `.fields` ({field: [value per rank]}).
    """
    comm = world(comm)
    gathered = comm.allgather(dict(values))
    names = []
    for rank_values in gathered:
        names.extend(name for name in rank_values if name not in names)
    differing = {}
    for name in names:
        per_rank = [rank_values.get(name, _MISSING) for rank_values in gathered]
        if not all(_same(per_rank[0], value) for value in per_rank[1:]):
            differing[name] = per_rank
    if not differing:
        return
    details = "; ".join(
        f"{name}: " + ", ".join(f"rank {rank}={value!r}" for rank, value in enumerate(per_rank))
        for name, per_rank in differing.items()
    )
    exc = RankMismatchError(f"ranks disagree on {what}: {details}")
    exc.fields = differing
    raise exc


def agree_choice(comm, read, env: str, what: str):
    """Collective, needing no GPU: read() on every rank (the name a setting such as an
    environment variable gives, or ConfigError); returns the name, the same on every rank,
    or raises ConfigError on every rank with each rank's error, or naming the ranks' choices
    when they differ (`what` they are, `env` where they come from)."""
    from epserve.errors import ConfigError

    try:
        name, error = read(), None
    except ConfigError as exc:
        name, error = None, str(exc)
    seen = comm.allgather((name, error))
    bad = [(r, e) for r, (_, e) in enumerate(seen) if e]
    if bad:
        raise ConfigError("; ".join(f"rank {r}: {e}" for r, e in bad))
    names = {n for n, _ in seen}
    if len(names) > 1:
        raise ConfigError(f"the ranks name different {what} ({env}): {[n for n, _ in seen]}")
    return names.pop()


@contextlib.contextmanager
def checked(comm, stage: str):
    """Run a block as a collective stage: an exception in it on any rank makes every rank
    raise RankFailedError (through collective_verdict), and success is agreed on too.

    Every rank of `comm` must enter and leave the block. Errors that are already collective
    (RankFailedError, RankMismatchError) pass through unchanged. Only Exception is caught:
    KeyboardInterrupt and SystemExit end the process, and `python -m mpi4py` then aborts
    the job.
    """
    comm = world(comm)
    try:
        yield
    except _ALREADY_COLLECTIVE:
        raise
    except Exception as exc:
        collective_verdict(comm, stage, exc)
        raise  # not reached: the verdict raises when this rank reports an error
    collective_verdict(comm, stage, None)
