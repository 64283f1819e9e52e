"""Prepared launches (runtime/launch.py): the kernelParams block holds, for every argument,
the address of the bytes the kernel will read, and a later call rewrites only what changed.
Checked without a GPU: the driver's launch is replaced by a recorder that reads the block."""

import ctypes

import numpy as np
import pytest

pytest.importorskip("cupy")

from epserve.runtime import launch  # noqa: E402
from epserve.runtime.kernel_structs import i32, launch_arg, u64  # noqa: E402


class FakeKernel:
    """A RawKernel's shape: .kernel.ptr is the CUfunction; calling it is CuPy's launch."""

    def __init__(self, ptr):
        self.kernel = type("Function", (), {"ptr": ptr})()
        self.calls = []

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((grid, block, args, shared_mem))


class FakeArray:
    """A CuPy array's shape as a pointer argument: .data.ptr."""

    def __init__(self, ptr):
        self.data = type("Memory", (), {"ptr": ptr})()


def read(params_address: int, index: int, size: int) -> bytes:
    address = ctypes.c_uint64.from_address(params_address + 8 * index).value
    return ctypes.string_at(address, size)


def test_every_argument_kind_lands_as_the_kernel_reads_it(launches):
    struct = launch_arg(np.array([(7, 2.5)], dtype=[("a", np.int32), ("b", np.float32)]))
    args = (FakeArray(0x1234_5678_9ABC), i32(-3), u64(2**40 + 5), None, np.int64(-9), struct,
            np.full(1, 11, np.uint16))
    prepared = launch.PreparedLaunch(FakeKernel(0xF00D), (5,), (128, 2), args, shared_mem=4096)
    prepared(stream=77)
    (dims, params), = launches
    assert dims == (0xF00D, 5, 1, 1, 128, 2, 1, 4096, 77, 0)
    assert read(params, 0, 8) == (0x1234_5678_9ABC).to_bytes(8, "little")
    assert read(params, 1, 4) == (-3).to_bytes(4, "little", signed=True)
    assert read(params, 2, 8) == (2**40 + 5).to_bytes(8, "little")
    assert read(params, 3, 8) == bytes(8)  # None: a null pointer
    assert read(params, 4, 8) == (-9).to_bytes(8, "little", signed=True)
    assert read(params, 5, 8) == np.array([(7, 2.5)], dtype=[("a", np.int32), ("b", np.float32)]).tobytes()
    assert read(params, 6, 2) == (11).to_bytes(2, "little")


def test_set_rewrites_one_argument_and_keeps_the_rest(launches):
    prepared = launch.PreparedLaunch(FakeKernel(1), 1, 32, (FakeArray(100), i32(4), FakeArray(200)))
    prepared.set(0, FakeArray(300))
    prepared.set(1, i32(8))
    prepared(stream=0)
    (_, params), = launches
    assert read(params, 0, 8) == (300).to_bytes(8, "little")
    assert read(params, 1, 4) == (8).to_bytes(4, "little")
    assert read(params, 2, 8) == (200).to_bytes(8, "little")


def test_an_argument_it_cannot_pass_is_refused_by_name():
    with pytest.raises(TypeError, match="argument 1"):
        launch.PreparedLaunch(FakeKernel(1), 1, 32, (None, 5))  # a Python int: its width is unknown


def test_sequence_prepares_once_per_key_and_rewrites_what_changed(launches, monkeypatch):
    made = []
    real = launch.PreparedLaunch

    def counting(*args, **kwargs):
        made.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "PreparedLaunch", counting)
    a, b = FakeKernel(1), FakeKernel(2)
    fixed = FakeArray(500)
    seq = launch.LaunchSequence()

    def specs(x):
        return [(a, (2,), (64,), (x, fixed, i32(1)), 0), (b, (1,), (32,), (fixed, x), 128)]

    seq.run(7, specs(FakeArray(10)), stream=1)
    seq.run(7, specs(FakeArray(20)), stream=1)  # same key: x rewritten, nothing prepared again
    assert len(made) == 2
    last_a, last_b = launches[-2][1], launches[-1][1]
    assert read(last_a, 0, 8) == (20).to_bytes(8, "little") and read(last_b, 1, 8) == (20).to_bytes(8, "little")
    assert read(last_a, 1, 8) == (500).to_bytes(8, "little")
    seq.run(8, specs(FakeArray(30)), stream=1)  # another key: prepared anew
    assert len(made) == 4
    c = FakeKernel(3)
    seq.run(7, [(c, (2,), (64,), (FakeArray(40), fixed, i32(1)), 0)], stream=1)  # another kernel: anew
    assert len(made) == 5
    seq.prepared = False  # every spec through the kernel's own call
    seq.run(7, specs(FakeArray(50)), stream=1)
    assert len(a.calls) == 1 and len(b.calls) == 1 and b.calls[0][3] == 128


def test_arguments_with_the_same_bytes_are_not_rewritten_but_new_values_are(launches, monkeypatch):
    rewritten = []
    real_set = launch.PreparedLaunch.set

    def counting_set(self, index, value):
        rewritten.append(index)
        real_set(self, index, value)

    seq = launch.LaunchSequence()
    k = FakeKernel(1)
    seq.run(0, [(k, (1,), (32,), (FakeArray(10), i32(5), u64(7)), 0)], stream=1)
    monkeypatch.setattr(launch.PreparedLaunch, "set", counting_set)
    seq.run(0, [(k, (1,), (32,), (FakeArray(10), i32(5), u64(7)), 0)], stream=1)  # equal bytes, new objects
    assert rewritten == []  # a new view of the same buffer is the same pointer
    seq.run(0, [(k, (1,), (32,), (FakeArray(11), i32(6), u64(7)), 0)], stream=1)
    assert rewritten == [0, 1]
    params = launches[-1][1]
    assert read(params, 0, 8) == (11).to_bytes(8, "little")
    assert read(params, 1, 4) == (6).to_bytes(4, "little") and read(params, 2, 8) == (7).to_bytes(8, "little")
