"""The route both dispatches share (epserve/dispatch/route.py), without a GPU: its block sizes
are the CUDA ones, its grids cover every chunk, and its two launches go through prepared
launches with every argument passable, the done counters fixed, and only the routing
rewritten from one call to the next."""

import pathlib
import re
import types

import pytest

pytest.importorskip("cupy")

from epserve.dispatch import route as route_mod  # noqa: E402
from epserve.runtime import launch  # noqa: E402
from epserve.runtime.kernel_structs import MAX_LOCAL_EXPERTS, i32, launch_arg  # noqa: E402

CUDA = pathlib.Path(__file__).resolve().parents[2] / "cuda" / "comm"


def cuda_constant(name: str) -> str:
    text = (CUDA / "dispatch_common.cuh").read_text()
    match = re.search(rf"constexpr int {name} = (\w+);", text)
    assert match, name
    return match.group(1)


def test_block_sizes_are_the_kernels():
    assert int(cuda_constant("kCountThreads")) == route_mod.COUNT_THREADS
    assert int(cuda_constant("kChunk")) == route_mod.CHUNK
    assert cuda_constant("kRankThreads") == "kLayoutThreads"  # the layout's thread per local expert
    assert cuda_constant("kLayoutThreads") == "EPSERVE_MAX_LOCAL_EXPERTS"
    assert route_mod.RANK_THREADS == MAX_LOCAL_EXPERTS
    from epserve.dispatch import direct

    assert int(cuda_constant("kMoveThreads")) == direct.MOVE_THREADS


class FakeDeviceArray:
    """A CuPy array's shape as far as the route touches it: .data.ptr and 1-D slices."""

    def __init__(self, ptr, itemsize=4):
        self.data = types.SimpleNamespace(ptr=ptr)
        self.itemsize = itemsize

    def __getitem__(self, s):
        return FakeDeviceArray(self.data.ptr + s.start * self.itemsize, self.itemsize)


class FakeFunction:
    def __init__(self, name, ptr):
        self.name = name
        self.kernel = types.SimpleNamespace(ptr=ptr)
        self.max_dynamic_shared_size_bytes = 0


@pytest.fixture
def fake_gpu(monkeypatch):
    """route.py's cupy and kernel module, replaced: arrays at distinct addresses, 132 SMs."""
    addresses = iter(range(0x1000, 0x100000, 0x1000))

    def array(*args, **kwargs):
        return FakeDeviceArray(next(addresses))

    fake_cupy = types.SimpleNamespace(
        empty=array, zeros=array, full=array,
        cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(attributes={"MultiProcessorCount": 132})))
    functions = {}

    def get_function(name):
        return functions.setdefault(name, FakeFunction(name, len(functions) + 1))

    monkeypatch.setattr(route_mod, "cupy", fake_cupy)
    monkeypatch.setattr(route_mod.kernels, "module", lambda name: types.SimpleNamespace(get_function=get_function))
    return functions


@pytest.fixture
def launches(monkeypatch):
    from cupy_backends.cuda.api import driver

    seen = []
    monkeypatch.setattr(driver, "launchKernel", lambda *args: seen.append(args))
    return seen


@pytest.mark.parametrize("transport", ["direct", "nccl"])
def test_kernels_and_shared_memory(fake_gpu, transport):
    r = route_mod.Route(transport, num_experts=256, world=2, top_k=8, max_tokens=4096)
    prefix = "epserve_dispatch_route" if transport == "direct" else "epserve_nccl_dispatch"
    assert r.count_publish.name == f"{prefix}_count_publish" and r.rank_layout.name == f"{prefix}_rank_layout"
    # a counter per expert and destination for each warp
    assert r.count_publish.max_dynamic_shared_size_bytes == 32 * 258 * 4 == r.count_smem
    assert r.rank_layout.max_dynamic_shared_size_bytes == 16 * 258 * 4 == r.rank_smem


def test_grids_cover_every_chunk_and_never_vanish(fake_gpu):
    r = route_mod.Route("direct", num_experts=256, world=2, top_k=8, max_tokens=1 << 16)
    assert r.grids(4096) == ((4,), (8,))  # 128 chunks: 32 warps a count CTA, 16 a rank CTA
    assert r.grids(4097) == ((5,), (9,))
    assert r.grids(0) == ((1,), (1,))  # the last CTA still publishes and lays out
    assert r.grids(1 << 16) == ((64,), (128,))


def test_chunk_counts_hold_a_row_per_chunk_and_one_per_count_cta(fake_gpu, monkeypatch):
    """Each count CTA scans its own COUNT_CHUNKS_PER_CTA chunks (cuda/comm/dispatch_route.cuh,
    count_chunks) and leaves its totals in a row after the chunk rows, which the rank kernel
    finds at row chunks + c / kCountWarps: the buffer holds both at max_tokens."""
    text = (CUDA / "dispatch_common.cuh").read_text()
    assert "constexpr int kCountWarps = kCountThreads / 32;" in text
    assert route_mod.COUNT_CHUNKS_PER_CTA == route_mod.COUNT_THREADS // 32
    shapes = []
    made = route_mod.cupy.empty

    def empty(shape, *args, **kwargs):
        shapes.append(shape)
        return made(shape, *args, **kwargs)

    monkeypatch.setattr(route_mod.cupy, "empty", empty)
    r = route_mod.Route("direct", num_experts=256, world=2, top_k=8, max_tokens=5000)
    assert (157 + 5, 258) in shapes  # 157 chunks of 32 tokens, 5 count CTAs
    assert r.grids(5000)[0] == (5,) and r.grids(4096)[0] == (4,) and r.grids(100)[0] == (1,)
    assert route_mod.count_ctas(0) == 1  # the last CTA still publishes


def test_launches_are_prepared_once_and_rewrite_only_the_routing(fake_gpu, launches, monkeypatch):
    made = []
    real = launch.PreparedLaunch

    def counting(*args, **kwargs):
        made.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "PreparedLaunch", counting)
    r = route_mod.Route("direct", num_experts=256, world=2, top_k=8, max_tokens=4096)
    cfg = launch_arg(__import__("numpy").zeros(1, [("a", "u8")]))
    offsets, base = FakeDeviceArray(0xA000), FakeDeviceArray(0xB000)
    seq = launch.LaunchSequence()

    def specs(idx):
        return [r.count_publish_spec(idx, 4096, i32(4096), i32(0), cfg),
                r.rank_layout_spec(idx, 4096, i32(4096), cfg, offsets, base)]

    seq.run((4096, False), specs(FakeDeviceArray(0x10)), stream=1)
    seq.run((4096, False), specs(FakeDeviceArray(0x20)), stream=1)
    assert len(made) == 2 and len(launches) == 4
    import ctypes

    def arg(launch_args, index):
        params = launch_args[9]
        return ctypes.c_uint64.from_address(ctypes.c_uint64.from_address(params + 8 * index).value).value

    count, rank = launches[2], launches[3]
    assert count[1:8] == (4, 1, 1, route_mod.COUNT_THREADS, 1, 1, r.count_smem)
    assert rank[1:8] == (8, 1, 1, route_mod.RANK_THREADS, 1, 1, r.rank_smem)
    assert arg(count, 0) == 0x20 and arg(rank, 0) == 0x20  # the new routing
    # the done counters: one each, distinct, 4 bytes apart in one zeroed buffer
    assert arg(rank, 6) - arg(count, 6) == 4
    assert arg(rank, 7) == 0xA000 and arg(rank, 8) == 0xB000  # the layout's outputs follow
    assert arg(count, 4) == arg(rank, 3)  # the scan's chunk bases are what rank reads
