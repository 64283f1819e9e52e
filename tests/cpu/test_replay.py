"""Recorded launches replayed with new per-call arrays (runtime/replay.py), checked without a
GPU: the driver's launch is replaced by a recorder that reads the argument block, and the
kernels' parameter sizes are given (the driver would report them)."""

import numpy as np
import pytest

pytest.importorskip("cupy")

from test_prepared_launch import FakeArray, FakeKernel, read  # noqa: E402

from epserve.runtime import launch, replay  # noqa: E402
from epserve.runtime.kernel_structs import i32, launch_arg, u64  # noqa: E402


class Input(FakeArray):
    """A per-call array: an address and a size in bytes."""

    def __init__(self, ptr, nbytes=1024):
        super().__init__(ptr)
        self.nbytes = nbytes


@pytest.fixture(autouse=True)
def sizes(monkeypatch):
    """Every kernel's parameters taken as 8 bytes each (the by-value structs below are 8 or 16),
    and no CUDA graph (its nodes would name the fake kernels to a real driver)."""
    monkeypatch.setattr(replay, "_param_sizes", lambda function: (8,) * 16)
    monkeypatch.setattr(replay.KernelGraph, "of", classmethod(lambda cls, launches: False))


def record(sequence_specs):
    """The Recording of one call that runs each (key, specs) through its own LaunchSequence."""
    with launch.Recording() as rec:
        for sequence, key, specs in sequence_specs:
            sequence.run(key, specs, stream=5)
    return rec


def test_a_recording_replays_with_the_new_arrays_in_their_slots(launches):
    x, idx, out = Input(0x10000), Input(0x20000), Input(0x30000)
    internal = FakeArray(0x90000)
    k1, k2 = FakeKernel(1), FakeKernel(2)
    a, b = launch.LaunchSequence(), launch.LaunchSequence()
    rec = record([(a, 7, [(k1, (2,), (32,), (x, i32(3), idx), 0)]),
                  (b, 7, [(k2, (1,), (64,), (internal, idx, out, u64(9)), 128)])])
    assert rec.complete and len(rec.specs) == 2
    rep = replay.LaunchReplay.of(rec, {"x": x, "topk_idx": idx, "out": out})
    assert rep is not None
    launches.clear()
    x2, out2 = Input(0x40000), Input(0x50000)
    rep({"x": x2, "topk_idx": idx, "out": out2}, stream=9)
    (dims1, p1), (dims2, p2) = launches
    assert dims1[0] == 1 and dims2[0] == 2 and dims1[-2] == dims2[-2] == 9
    assert read(p1, 0, 8) == (0x40000).to_bytes(8, "little")
    assert read(p1, 1, 4) == (3).to_bytes(4, "little")
    assert read(p1, 2, 8) == (0x20000).to_bytes(8, "little")
    assert read(p2, 0, 8) == (0x90000).to_bytes(8, "little")
    assert read(p2, 2, 8) == (0x50000).to_bytes(8, "little")


def test_the_replay_owns_its_launches(launches):
    """A later call through the LaunchSequence rewrites the sequence's launches, not the replay's."""
    x, other = Input(0x10000), Input(0x70000)
    k = FakeKernel(1)
    seq = launch.LaunchSequence()
    rep = replay.LaunchReplay.of(record([(seq, 1, [(k, 1, 32, (x,), 0)])]), {"x": x})
    seq.run(1, [(k, 1, 32, (other,), 0)], stream=0)
    launches.clear()
    rep({"x": x}, stream=0)
    (_, params), = launches
    assert read(params, 0, 8) == (0x10000).to_bytes(8, "little")


@pytest.mark.parametrize("hiding", ["view", "struct", "tensor map"])
def test_a_per_call_address_it_could_not_rewrite_refuses_the_replay(hiding, launches):
    x = Input(0x10000, nbytes=4096)
    if hiding == "view":  # another array object inside x: a slot rewrite would miss it
        arg = FakeArray(0x10000 + 512)
    elif hiding == "struct":
        arg = launch_arg(np.array([(0x10000 + 8, 4)], dtype=[("p", np.uint64), ("n", np.uint64)]))
    else:
        arg = np.zeros(1, [("opaque", np.uint64, (16,))])
        arg["opaque"][0, 3] = 0x10000
    rec = record([(launch.LaunchSequence(), 0, [(FakeKernel(1), 1, 32, (x, arg), 0)])])
    assert replay.LaunchReplay.of(rec, {"x": x}) is None


def test_an_unreadable_by_value_argument_refuses_the_replay(monkeypatch, launches):
    monkeypatch.setattr(replay, "_param_sizes", lambda function: None)
    x = Input(0x10000)
    rec = record([(launch.LaunchSequence(), 0, [(FakeKernel(1), 1, 32, (x, i32(1)), 0)])])
    assert replay.LaunchReplay.of(rec, {"x": x}) is None


def test_a_launch_outside_the_prepared_path_leaves_the_recording_incomplete(launches):
    seq = launch.LaunchSequence()
    seq.prepared = False
    k = FakeKernel(1)
    rec = record([(seq, 0, [(k, 1, 32, (Input(0x10000),), 0)])])
    assert not rec.complete and k.calls
    assert replay.LaunchReplay.of(rec, {}) is None


def test_recordings_do_not_nest():
    with launch.Recording():
        with pytest.raises(RuntimeError, match="already open"):
            with launch.Recording():
                pass
    with launch.Recording() as rec:  # closed again after the error
        assert rec.complete


class FakeGraph:
    """KernelGraph's part in a replay: which launches' nodes each graph launch updated."""

    def __init__(self):
        self.updates = []

    def launch(self, changed, stream):
        self.updates.append(set(changed))


def test_the_graph_updates_every_node_rewritten_since_its_last_launch(monkeypatch, launches):
    """A replay under stream capture runs the launches themselves; the launches it rewrote
    must still be updated in the graph at its next launch, even if their arrays did not
    change again by then."""
    graph, capturing = FakeGraph(), [False]
    monkeypatch.setattr(replay.KernelGraph, "of", classmethod(lambda cls, launches: graph))
    monkeypatch.setattr(replay._runtime, "streamIsCapturing", lambda stream: capturing[0])
    x, x2 = Input(0x10000), Input(0x20000)
    k1, k2 = FakeKernel(1), FakeKernel(2)
    rec = record([(launch.LaunchSequence(), 0, [(k1, 1, 32, (x,), 0), (k2, 1, 32, (u64(5),), 0)])])
    rep = replay.LaunchReplay.of(rec, {"x": x})
    first = rep._launches[0]
    rep({"x": x}, stream=0)
    assert graph.updates == [set()] and rep.graph_launches == 1
    capturing[0] = True
    launches.clear()
    rep({"x": x2}, stream=0)  # captured: the launches themselves, x2 in place
    assert len(launches) == 2 and graph.updates == [set()]
    capturing[0] = False
    rep({"x": x2}, stream=0)  # x2 again: no change now, but the graph still holds x
    assert graph.updates[-1] == {first} and rep.graph_launches == 2
    rep({"x": x2}, stream=0)
    assert graph.updates[-1] == set()


def test_without_a_graph_the_launches_are_replayed(launches):
    x = Input(0x10000)
    rep = replay.LaunchReplay.of(record([(launch.LaunchSequence(), 0, [(FakeKernel(1), 1, 32, (x,), 0)])]),
                                 {"x": x})
    launches.clear()
    rep({"x": Input(0x30000)}, stream=0)
    (_, params), = launches
    assert read(params, 0, 8) == (0x30000).to_bytes(8, "little") and rep.graph_launches == 0
