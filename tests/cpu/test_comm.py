"""epserve.comm.mpi's collective logic, with fake communicators: one thread per rank, and an
allgather that really waits for every rank, so a rank that skipped the collective would show
up as a hang (bounded by a barrier timeout) rather than pass by accident."""

import pathlib
import sys
import threading
import types

import pytest

from epserve.comm import mpi as epcomm
from epserve.errors import EPServeError, RankFailedError, RankMismatchError

BARRIER_TIMEOUT_S = 10


class FakeWorld:
    """State shared by the fake ranks of one communicator."""

    def __init__(self, size, node_of=None):
        self.size = size
        self.node_of = node_of or [0] * size  # node index of each rank
        self.slots = [None] * size
        self.barrier = threading.Barrier(size, timeout=BARRIER_TIMEOUT_S)
        self.allgathers = 0


class FakeComm:
    """The slice of mpi4py.MPI.Comm that epserve.comm.mpi uses."""

    def __init__(self, world, rank):
        self.world = world
        self.rank = rank
        self.split_calls = 0

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.world.size

    def allgather(self, value):
        w = self.world
        w.slots[self.rank] = value
        w.barrier.wait()
        result = list(w.slots)
        if self.rank == 0:
            w.allgathers += 1
        w.barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return result

    def Split_type(self, split_type):
        assert split_type == FAKE_MPI.COMM_TYPE_SHARED
        self.split_calls += 1
        node = self.world.node_of[self.rank]
        ranks_on_node = [r for r in range(self.world.size) if self.world.node_of[r] == node]
        return FakeNodeComm(ranks_on_node.index(self.rank))


class FakeNodeComm:
    def __init__(self, rank):
        self.rank = rank
        self.freed = False

    def Get_rank(self):
        return self.rank

    def Free(self):
        self.freed = True


FAKE_MPI = types.SimpleNamespace(COMM_TYPE_SHARED="shared-memory-split", COMM_WORLD=None)


@pytest.fixture(autouse=True)
def no_real_mpi(monkeypatch):
    # Keep MPI_Init out of the pytest process: these tests never need the real library.
    monkeypatch.setattr(epcomm, "_mpi", lambda: FAKE_MPI)
    monkeypatch.setattr(epcomm, "_local_rank_cache", {})


def run_ranks(size, body, node_of=None):
    """Run body(comm) on `size` fake ranks at once; return (results, errors) per rank."""
    world = FakeWorld(size, node_of)
    comms = [FakeComm(world, r) for r in range(size)]
    results, errors = [None] * size, [None] * size

    def one(rank):
        try:
            results[rank] = body(comms[rank])
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever came out
            errors[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BARRIER_TIMEOUT_S * 3)
        assert not t.is_alive(), "a fake rank hung"
    for exc in errors:
        assert not isinstance(exc, threading.BrokenBarrierError), "a rank skipped a collective"
    return results, errors


# --- collective_verdict -------------------------------------------------------------------


def test_verdict_all_ok_returns_on_every_rank():
    results, errors = run_ranks(3, lambda c: epcomm.collective_verdict(c, "stage", None))
    assert errors == [None, None, None]


def test_verdict_one_failure_raises_everywhere_naming_rank_and_stage():
    local = ValueError("bad weights file")

    def body(c):
        epcomm.collective_verdict(c, "load weights", local if c.rank == 1 else None)

    _, errors = run_ranks(3, body)
    for rank, exc in enumerate(errors):
        assert isinstance(exc, RankFailedError), (rank, exc)
        text = str(exc)
        assert "load weights" in text
        assert "rank 1: ValueError: bad weights file" in text
        assert "rank 0:" not in text and "rank 2:" not in text
        assert exc.stage == "load weights"
        assert exc.failures == {1: "ValueError: bad weights file"}
    # The failing rank keeps its own exception as the cause; the others have none.
    assert errors[1].__cause__ is local
    assert errors[0].__cause__ is None and errors[2].__cause__ is None


def test_verdict_lists_every_failing_rank_with_its_message():
    def body(c):
        error = {0: "disk full", 2: KeyError("w13")}.get(c.rank)
        epcomm.collective_verdict(c, "stage x", error)

    _, errors = run_ranks(3, body)
    messages = {str(e) for e in errors}
    assert len(messages) == 1, "every rank must raise the same message"
    text = messages.pop()
    assert "2 of 3 rank(s)" in text
    assert "rank 0: disk full" in text and "rank 2: KeyError: 'w13'" in text


def test_verdict_on_one_rank_world():
    _, errors = run_ranks(1, lambda c: epcomm.collective_verdict(c, "solo", RuntimeError("x")))
    assert isinstance(errors[0], RankFailedError)
    assert "rank 0: RuntimeError: x" in str(errors[0])


# --- agree --------------------------------------------------------------------------------


def test_agree_equal_values_passes():
    _, errors = run_ranks(2, lambda c: epcomm.agree(c, "shapes", {"H": 7168, "k": 8, "dt": "bf16"}))
    assert errors == [None, None]


def test_agree_names_each_differing_field_and_each_rank_value():
    def body(c):
        values = {"hidden": 7168 if c.rank != 1 else 4096, "top_k": 8, "dtype": f"bf{16 + c.rank}"}
        epcomm.agree(c, "MoE shapes", values)

    _, errors = run_ranks(3, body)
    assert all(isinstance(e, RankMismatchError) for e in errors), errors
    text = str(errors[0])
    assert all(str(e) == text for e in errors)
    assert "MoE shapes" in text
    assert "hidden: rank 0=7168, rank 1=4096, rank 2=7168" in text
    assert "dtype: rank 0='bf16', rank 1='bf17', rank 2='bf18'" in text
    assert "top_k" not in text
    assert set(errors[0].fields) == {"hidden", "dtype"}


def test_agree_field_missing_on_one_rank_is_a_mismatch():
    def body(c):
        values = {"a": 1} if c.rank == 0 else {"a": 1, "b": 2}
        epcomm.agree(c, "fields", values)

    _, errors = run_ranks(2, body)
    assert all(isinstance(e, RankMismatchError) for e in errors)
    assert "b: rank 0='<missing>', rank 1=2" in str(errors[1])


def test_agree_compares_arrays_without_ambiguity():
    np = pytest.importorskip("numpy")

    def body(c):
        epcomm.agree(c, "array", {"v": np.arange(4) + (c.rank == 1)})

    _, errors = run_ranks(2, body)
    assert all(isinstance(e, RankMismatchError) for e in errors)
    _, errors = run_ranks(2, lambda c: epcomm.agree(c, "array", {"v": np.arange(4)}))
    assert errors == [None, None]


# --- checked ------------------------------------------------------------------------------


def test_checked_turns_a_local_exception_into_a_collective_failure():
    def body(c):
        with epcomm.checked(c, "build kernels"):
            if c.rank == 0:
                raise OSError("nvrtc missing")
        return "passed the block"

    results, errors = run_ranks(2, body)
    assert results == [None, None]
    for exc in errors:
        assert isinstance(exc, RankFailedError)
        assert "build kernels" in str(exc) and "rank 0: OSError: nvrtc missing" in str(exc)
    assert isinstance(errors[0].__cause__, OSError)


def test_checked_success_agrees_and_continues():
    world_holder = {}

    def body(c):
        world_holder["w"] = c.world
        with epcomm.checked(c, "fine"):
            pass
        return c.rank

    results, errors = run_ranks(2, body)
    assert results == [0, 1] and errors == [None, None]
    assert world_holder["w"].allgathers == 1, "success must be agreed on too"


def test_checked_passes_collective_errors_through_unchanged():
    def body(c):
        with epcomm.checked(c, "outer"):
            epcomm.agree(c, "inner", {"rank": c.rank})

    _, errors = run_ranks(2, body)
    assert all(type(e) is RankMismatchError for e in errors), errors


# --- local_rank ---------------------------------------------------------------------------


def test_local_rank_per_node_and_cached():
    def body(c):
        first = epcomm.local_rank(c)
        again = epcomm.local_rank(c)
        return first, again, c.split_calls

    results, errors = run_ranks(4, body, node_of=[0, 0, 1, 1])
    assert errors == [None] * 4
    assert [r[0] for r in results] == [0, 1, 0, 1]
    assert all(r[0] == r[1] and r[2] == 1 for r in results), "second call must hit the cache"


# --- select_device ------------------------------------------------------------------------


class FakeCupy(types.ModuleType):
    """Just enough of cupy for select_device: a device count and Device(d).use()."""

    def __init__(self, count=None, error=None):
        super().__init__("cupy")
        self.used = []
        fake = self

        def get_device_count():
            if error is not None:
                raise error
            return count

        class Device:
            def __init__(self, index):
                self.index = index

            def use(self):
                fake.used.append(self.index)

        self.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDeviceCount=get_device_count), Device=Device
        )


@pytest.fixture
def fake_cupy(monkeypatch):
    def install(**kwargs):
        module = FakeCupy(**kwargs)
        monkeypatch.setitem(sys.modules, "cupy", module)
        return module

    monkeypatch.delenv(epcomm.DEVICE_ENV, raising=False)
    return install


def test_select_device_from_local_rank_modulo_count(fake_cupy):
    cupy = fake_cupy(count=2)
    results, errors = run_ranks(3, lambda c: epcomm.select_device(c))
    assert errors == [None] * 3
    assert results == [0, 1, 0]
    assert sorted(cupy.used) == [0, 0, 1]


def test_select_device_explicit_argument_wins(fake_cupy, monkeypatch):
    fake_cupy(count=4)
    monkeypatch.setenv(epcomm.DEVICE_ENV, "1")
    results, errors = run_ranks(2, lambda c: epcomm.select_device(c, device=3))
    assert results == [3, 3] and errors == [None, None]


def test_select_device_env_var(fake_cupy, monkeypatch):
    fake_cupy(count=2)
    monkeypatch.setenv(epcomm.DEVICE_ENV, "0")
    results, errors = run_ranks(2, lambda c: epcomm.select_device(c))
    assert results == [0, 0] and errors == [None, None]


def test_select_device_no_gpu_raises_everywhere(fake_cupy):
    fake_cupy(error=RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected"))
    _, errors = run_ranks(2, lambda c: epcomm.select_device(c))
    for exc in errors:
        assert isinstance(exc, EPServeError) and isinstance(exc, RankFailedError)
        assert "select_device" in str(exc) and "no usable NVIDIA GPU" in str(exc)
        assert "rank 0:" in str(exc) and "rank 1:" in str(exc)


def test_select_device_out_of_range_and_bad_env(fake_cupy, monkeypatch):
    fake_cupy(count=1)
    _, errors = run_ranks(1, lambda c: epcomm.select_device(c, device=2))
    assert "asks for GPU 2" in str(errors[0]) and "1 GPU(s)" in str(errors[0])
    monkeypatch.setenv(epcomm.DEVICE_ENV, "first")
    _, errors = run_ranks(1, lambda c: epcomm.select_device(c))
    assert "EPSERVE_DEVICE='first' is not a device index" in str(errors[0])


def test_select_device_without_any_gpu_on_this_machine(gpu_probe):
    """The real cupy on a machine with no usable GPU: a clear EPServeError, not a crash."""
    if gpu_probe() is None:
        pytest.skip("a GPU is usable here; this checks the no-GPU message")
    pytest.importorskip("cupy")
    _, errors = run_ranks(1, lambda c: epcomm.select_device(c))
    assert isinstance(errors[0], EPServeError), errors[0]
    assert "select_device" in str(errors[0])


def test_importing_comm_imports_neither_mpi_nor_cupy():
    import subprocess

    code = (
        "import sys, epserve.comm.mpi; "
        "bad = [m for m in ('mpi4py.MPI', 'cupy') if m in sys.modules]; "
        "sys.exit(f'imported at import time: {bad}' if bad else 0)"
    )
    repo_root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_a_rank_s_own_input_error_wins_over_the_call_record_and_without_one_the_record_is_raised():
    pytest.importorskip("cupy")
    from epserve.comm.signals import SignalBlock
    from epserve.errors import ConfigError

    record = RankFailedError("rank 0: stage dispatch-verdict: rank 0 rejected its input")
    own = ConfigError("x must be bf16")

    class Stub:
        def __init__(self, pending):
            self.pending = pending

        def raise_pending(self, rank):
            if self.pending is not None:
                raise self.pending

    raise_pending_or = SignalBlock.raise_pending_or
    with pytest.raises(ConfigError) as got:
        raise_pending_or(Stub(record), 0, own)  # the record only says this rank rejected its input
    assert got.value is own
    with pytest.raises(ConfigError):
        raise_pending_or(Stub(None), 0, own)
    with pytest.raises(RankFailedError) as got:
        raise_pending_or(Stub(record), 0, None)
    assert got.value is record
    raise_pending_or(Stub(None), 0, None)  # nothing to raise
