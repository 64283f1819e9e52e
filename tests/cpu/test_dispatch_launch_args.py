"""Every launch the two dispatchers queue hands its kernel as many arguments as the kernel
takes, each as wide as the parameter in its place (read from the compiled PTX), without a GPU:
an argument added to a kernel and not to its launch, or passed in another place, fails here
instead of corrupting a launch on the GPU."""

import re
import types

import numpy as np
import pytest

pytest.importorskip("cupy")

from epserve.dispatch import direct as direct_mod  # noqa: E402
from epserve.dispatch import nccl as nccl_mod  # noqa: E402
from epserve.dispatch import route as route_mod  # noqa: E402
from epserve.ffn.fp8 import packed_row_bytes  # noqa: E402
from epserve.runtime import build, kernels  # noqa: E402
from epserve.runtime.kernel_structs import DISPATCH_CONFIG  # noqa: E402

E, W, K, H, T = 256, 2, 8, 7168, 4096


def variant_ptx(tmp_path_factory, variant: str) -> str:
    import os

    old = os.environ.get("EPSERVE_CACHE_DIR")
    os.environ["EPSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    try:
        source, defines = kernels.VARIANTS[variant]
        return build.compile_source(source, defines).ptx.read_text()
    finally:
        if old is None:
            del os.environ["EPSERVE_CACHE_DIR"]
        else:
            os.environ["EPSERVE_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    return variant_ptx(tmp_path_factory, "dispatch")


@pytest.fixture(scope="module")
def quantize_ptx(tmp_path_factory):
    """The FP8 build of the dispatch (EPSERVE_DISPATCH_QUANTIZE): its move quantizes x."""
    return variant_ptx(tmp_path_factory, "dispatch_quantize")


def param_sizes(ptx: str, kernel: str) -> list[int]:
    """The byte width of each parameter of `kernel`, in order."""
    head = re.search(rf"\.entry {kernel}\((.*?)\)", ptx, re.S)
    assert head, kernel
    sizes = []
    for param in head.group(1).split(","):
        if m := re.search(r"\.b8 \w+\[(\d+)\]", param):
            sizes.append(int(m.group(1)))
        elif m := re.search(r"\.param \.[usb](\d+) ", param):
            sizes.append(int(m.group(1)) // 8)
    return sizes


class Device:
    """A device pointer argument (as a CuPy array passes): 8 bytes."""

    def __init__(self, shape=(1,), dtype=None):
        self.shape, self.dtype = shape, dtype
        self.data = types.SimpleNamespace(ptr=0x1000)

    def __getitem__(self, s):
        return Device()


class Function:
    def __init__(self, name):
        self.name = name
        self.max_dynamic_shared_size_bytes = 0


class Recorder:
    """A LaunchSequence that keeps the specs it is handed."""

    def __init__(self):
        self.specs = []

    def run(self, key, specs, stream=None):
        self.specs += specs


def arg_size(a) -> int:
    if a is None or isinstance(a, Device):
        return 8
    assert isinstance(a, np.ndarray), type(a)
    return a.nbytes


def by_value(value, dtype=np.int32):
    return np.full(1, value, dtype)


@pytest.fixture
def fakes(monkeypatch):
    """Pointers and by-value arguments the test can measure; the route's module and cupy."""
    fake_cupy = types.SimpleNamespace(
        empty=lambda *a, **k: Device(), zeros=lambda *a, **k: Device(), full=lambda *a, **k: Device(),
        cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(attributes={"MultiProcessorCount": 132}),
                                   get_current_stream=lambda: types.SimpleNamespace(ptr=0)))
    monkeypatch.setattr(route_mod, "cupy", fake_cupy)
    monkeypatch.setattr(route_mod.kernels, "module", lambda name: types.SimpleNamespace(get_function=Function))
    for mod in (direct_mod, nccl_mod):
        monkeypatch.setattr(mod, "i32", by_value)
        monkeypatch.setattr(mod, "_NULL", by_value(0, np.uint64))
    monkeypatch.setattr(nccl_mod, "cupy", fake_cupy)


def check(ptx, specs):
    for kernel, grid, block, args, shared_mem in specs:
        sizes = param_sizes(ptx, kernel.name)
        assert [arg_size(a) for a in args] == sizes, kernel.name


def direct_dispatcher(fuse_release: bool, own_in_send: bool, quantize_cols: int = 0):
    d = direct_mod.DirectDispatcher.__new__(direct_mod.DirectDispatcher)
    width = packed_row_bytes(quantize_cols) // 2 if quantize_cols else H  # the rows moved, in 2-byte units
    d.rank, d.world, d.E, d.k, d.H, d.max_tokens = 0, W, E, K, width, T
    d.quantize_cols, d.quantize_in_send = quantize_cols, bool(quantize_cols)
    d._x_cols = by_value(quantize_cols)
    d._move_quantize = Function("epserve_dispatch_move") if quantize_cols else None
    d.route = route_mod.Route("direct", num_experts=E, world=W, top_k=K, max_tokens=T)
    d._cfg = np.zeros(1, DISPATCH_CONFIG)
    d._shapes, d.send_blocks_max, d.expand_blocks = {}, 132, 264
    d._move, d._release = Function("epserve_dispatch_move"), Function("epserve_dispatch_release")
    for name in ("_base", "rows", "src_info", "expert_offsets", "_chunk_ptrs", "_expected_chunk", "_done"):
        setattr(d, name, Device())
    d._max_chunks_arg = by_value(T // 32)
    d.fuse_release, d.own_in_send = fuse_release, own_in_send
    d._staging_bytes = 8 * 2 * width if quantize_cols else 0  # a packed row a warp (own_row_staging_bytes)
    d.stage_own_rows = False
    d.launches = Recorder()
    return d


@pytest.mark.parametrize("fuse_release", [True, False])
@pytest.mark.parametrize("rejected", [False, True])
@pytest.mark.parametrize("armed", [False, True], ids=["combine-arms", "layout-arms"])
def test_direct_launches_match_their_kernels(ptx, fakes, fuse_release, rejected, armed):
    d = direct_dispatcher(fuse_release, own_in_send=True)
    arm = (by_value(0x1000, np.uint64), by_value(H // 64)) if armed else None
    if rejected:
        d.enqueue(None, None, rejected=True, arm_combine=arm)
    else:
        d.enqueue(Device((T, H)), Device((T, K)), arm_combine=arm)
    names = [spec[0].name for spec in d.launches.specs]
    assert names == ["epserve_dispatch_route_count_publish", "epserve_dispatch_route_rank_layout",
                     "epserve_dispatch_move"] + ([] if fuse_release else ["epserve_dispatch_release"])
    check(ptx, d.launches.specs)


@pytest.mark.parametrize("own_in_send", [False, True])
@pytest.mark.parametrize("rejected", [False, True])
@pytest.mark.parametrize("hidden", [H, 384], ids=["H7168", "H384"])
def test_quantizing_direct_launches_match_their_kernels(ptx, quantize_ptx, fakes, own_in_send, rejected, hidden):
    """FP8 experts: the move of the dispatch_quantize build takes x's bf16 width last, and the
    launch hands it; the route launches are the plain build's (the same in both builds). Packed
    rows (quantize_in_send off, or tokens that came quantized) go to the plain move, with the
    same arguments as bf16."""
    d = direct_dispatcher(True, own_in_send, quantize_cols=hidden)
    arm = (by_value(0x1000, np.uint64), by_value(hidden // 64))
    if rejected:
        d.enqueue(None, None, rejected=True, arm_combine=arm)
    else:
        d.enqueue(Device((T, hidden)), Device((T, K)), arm_combine=arm)
    names = [spec[0].name for spec in d.launches.specs]
    assert names == ["epserve_dispatch_route_count_publish", "epserve_dispatch_route_rank_layout",
                     "epserve_dispatch_move"]
    route, move = d.launches.specs[:2], d.launches.specs[2]
    check(ptx, route)
    check(quantize_ptx, [move])
    assert move[0] is d._move_quantize
    assert move[3][-1] is d._x_cols and int(move[3][-1][0]) == hidden
    assert move[4] == 0  # the own rows stored by the warps (stage_own_rows off): no staging rows
    assert len(param_sizes(quantize_ptx, "epserve_dispatch_move")) == len(param_sizes(ptx, "epserve_dispatch_move")) + 1
    with pytest.raises(ValueError, match="rows of"):  # packed rows' width, but bf16: tokens are due
        d.enqueue(Device((T, d.H)), Device((T, K)))
    with pytest.raises(ValueError, match="rows of"):  # uint8 of a bf16 token's width: packed rows are due
        d.enqueue(Device((T, hidden), np.uint8), Device((T, K)))
    # Rows packed already (tokens that came quantized: uint8 [T, 2H]) go to the plain move, as
    # the packed rows of quantize_in_send off do (bf16-typed [T, H]).
    for quantize_in_send, rows in ((True, Device((T, 2 * d.H), np.uint8)), (False, Device((T, d.H)))):
        d.quantize_in_send = quantize_in_send
        d.launches.specs = []
        d.enqueue(rows, Device((T, K)), arm_combine=arm)
        assert d.launches.specs[2][0] is d._move and d.launches.specs[2][4] == 0
        check(ptx, d.launches.specs)
    d.quantize_in_send = True
    assert not d.quantizes_call(Device((T, 2 * d.H), np.uint8))
    assert d.quantizes_call(Device((T, hidden))) and d.quantizes_call(None)
    d.quantize_in_send, d.stage_own_rows = True, True  # the own rows staged: a packed row a warp
    d.launches.specs = []
    d.enqueue(Device((T, hidden)), Device((T, K)), arm_combine=arm)
    assert d.launches.specs[2][0] is d._move_quantize and d.launches.specs[2][4] == 8 * 2 * d.H


def test_quantize_build_differs_only_in_the_move(ptx, quantize_ptx):
    """The quantizing build adds x's width to the move and changes no other kernel's parameters;
    the quantizer's e4m3 conversion is in it and not in the plain build."""
    kernels_of = lambda text: re.findall(r"\.entry (\w+)\(", text)  # noqa: E731
    assert kernels_of(ptx) == kernels_of(quantize_ptx)
    for name in kernels_of(ptx):
        if name != "epserve_dispatch_move":
            assert param_sizes(ptx, name) == param_sizes(quantize_ptx, name), name
    assert param_sizes(quantize_ptx, "epserve_dispatch_move") == param_sizes(ptx, "epserve_dispatch_move") + [4]
    assert "e4m3x2" in quantize_ptx and "e4m3x2" not in ptx


def test_direct_launches_across_nodes_match_their_kernels(ptx, fakes, monkeypatch):
    """With an off-node part (epserve/comm/off_node.py): the same launches around the carrier,
    then the off-node expand, whose arguments match its kernel too."""
    from epserve.comm import off_node as off_mod

    monkeypatch.setattr(off_mod.kernels, "function", lambda module, name: Function(name))
    carried = []
    fake = types.SimpleNamespace(
        host_sizes=False,
        exchange_counts=lambda table, cfg: carried.append("counts"),
        exchange_rows=lambda tokens, meta, status, sizes, cfg, offsets, e_loc: carried.append("rows"),
        expand_spec=lambda *a: off_mod.OffNode.expand_spec(None, *a))
    d = direct_dispatcher(True, own_in_send=False)
    d.off_node, d.status = fake, Device()
    d._table = d._tokens = d._meta = types.SimpleNamespace(ptr=0x2000)
    d.enqueue(Device((T, H)), Device((T, K)))
    names = [spec[0].name for spec in d.launches.specs]
    assert names == ["epserve_dispatch_route_count_publish", "epserve_dispatch_route_rank_layout",
                     "epserve_dispatch_move", "epserve_dispatch_expand_off_node"]
    assert carried == ["counts", "rows"]
    check(ptx, d.launches.specs)


def test_direct_launches_with_sizes_through_the_host(ptx, fakes, monkeypatch, tmp_path):
    """EPSERVE_OFFNODE_SIZES=host: the count table goes to the host right after the count
    rows' group, before the layout and the move are queued; the host waits only after them;
    the rows cross at the sizes it read; the return slots follow the off-node expand. Every
    launch's arguments match its kernel."""
    from epserve.comm import off_node as off_mod
    from epserve.comm.topology import NodeLayout

    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path))
    source, defines = kernels.VARIANTS["staging"]
    staging_ptx = build.compile_source(source, defines).ptx.read_text()
    monkeypatch.setattr(off_mod.kernels, "function", lambda module, name: Function(name))
    monkeypatch.setattr(off_mod, "i32", by_value)
    monkeypatch.setattr(off_mod, "u64", lambda v: by_value(v, np.uint64))
    events = []
    o = off_mod.OffNode.__new__(off_mod.OffNode)
    o.plan = off_mod.OffNodePlan(NodeLayout(4, 2), 1, E, K, H, H, T)
    o.rank, o.world, o.sizes, o.sink_src_info = 1, 4, "host", Device()
    o.exchange_counts = lambda table, cfg: events.append("counts")
    o.counts_to_host = lambda table: events.append("to host")
    o.await_sizes = lambda: events.append(("wait", len(d.launches.specs))) or "sizes"
    o.exchange_rows = lambda tokens, meta, status, sizes, cfg, offsets, e_loc: events.append(("rows", sizes))
    d = direct_dispatcher(True, own_in_send=False)
    d.off_node, d.status = o, Device()
    d._table = d._tokens = d._meta = types.SimpleNamespace(ptr=0x2000)
    d.enqueue(Device((T, H)), Device((T, K)))
    names = [spec[0].name for spec in d.launches.specs]
    assert names == ["epserve_dispatch_route_count_publish", "epserve_dispatch_route_rank_layout",
                     "epserve_dispatch_move", "epserve_dispatch_expand_off_node", "epserve_off_node_return_slots"]
    assert events == ["counts", "to host", ("wait", 3), ("rows", "sizes")]  # the wait behind layout + move
    check(ptx, d.launches.specs[:4])
    spec = d.launches.specs[4]
    sizes = [8 if isinstance(a, Device) else np.asarray(a).nbytes for a in spec[3]]
    assert sizes == param_sizes(staging_ptx, "epserve_off_node_return_slots")


def test_nccl_launches_match_their_kernels(ptx, fakes):
    n = nccl_mod.NcclDispatcher(None, None, rank=0, world=1, num_experts=E, top_k=K, hidden=H, max_tokens=T,
                                max_recv_rows=T * K, dtype=np.uint16)
    n._ready = True  # what _setup makes, faked: world 1, so no NCCL call is made
    n.route = route_mod.Route("nccl", num_experts=E, world=1, top_k=K, max_tokens=T)
    n._cfg = np.zeros(1, DISPATCH_CONFIG)
    n._shapes, n._sms, n._expand_grid = {}, 132, (528,)
    n._pack, n._expand = Function("epserve_nccl_dispatch_pack"), Function("epserve_nccl_dispatch_expand")
    for name in ("_table", "_send_tok", "_send_meta", "_recv_tok", "_recv_meta", "_home_base", "home_idx", "_base",
                 "_ret_base", "rows", "src_info", "ret_idx", "expert_offsets"):
        setattr(n, name, Device())
    n.launches = Recorder()
    n.enqueue(Device((T, H)), Device((T, K)))
    names = [spec[0].name for spec in n.launches.specs]
    assert names == ["epserve_nccl_dispatch_count_publish", "epserve_nccl_dispatch_rank_layout",
                     "epserve_nccl_dispatch_pack", "epserve_nccl_dispatch_expand"]
    check(ptx, n.launches.specs)


class Called:
    """A kernel looked up by name whose calls are kept: fn(grid, block, args)."""

    calls = []

    def __init__(self, name):
        self.name = name

    def __call__(self, grid, block, args, shared_mem=0):
        Called.calls.append((self, grid, block, args, shared_mem))


def fake_stamps(monkeypatch, world):
    """CallStamps made without a GPU (epserve/comm/off_node_stamps.py): its device arrays are
    Device, its by-value arguments measurable."""
    from epserve.comm import off_node_stamps as st

    monkeypatch.setattr(st, "i32", by_value)
    monkeypatch.setattr(st, "u64", lambda v: by_value(v, np.uint64))
    s = st.CallStamps.__new__(st.CallStamps)
    s.world, s.signals, s._peer_lists = world, types.SimpleNamespace(local=lambda a: 0x3000 + a), {}
    s.out = types.SimpleNamespace(ptr=0x8000)
    s._landed, s._calls = Device((st.KINDS, world, 2)), Device((st.KINDS,))
    s._landed_of, s._calls_of = [Device((world, 2))] * st.KINDS, [Device()] * st.KINDS
    s._peer_array = lambda peers: Device((max(1, len(peers)),))
    return s


def bare_off_node(monkeypatch, tmp_path):
    """An OffNode of rank 1 of two nodes of 2, made without a GPU, whose kernel calls are kept
    (Called), and the staging module's PTX."""
    from epserve.comm import off_node as off_mod
    from epserve.comm.topology import NodeLayout

    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path))
    source, defines = kernels.VARIANTS["staging"]
    staging_ptx = build.compile_source(source, defines).ptx.read_text()
    monkeypatch.setattr(kernels, "function", lambda module, name: Called(name))
    monkeypatch.setattr(off_mod, "i32", by_value)
    monkeypatch.setattr(off_mod, "u64", lambda v: by_value(v, np.uint64))
    Called.calls = []
    o = off_mod.OffNode.__new__(off_mod.OffNode)
    o.plan = off_mod.OffNodePlan(NodeLayout(4, 2), 1, E, K, H, H, T)
    o.rank, o.world = 1, 4
    o.signals = types.SimpleNamespace(local=lambda offset: 0x3000 + offset)
    o.stamps = fake_stamps(monkeypatch, o.world)
    return o, staging_ptx


def test_off_node_launches_match_their_kernels(monkeypatch, tmp_path):
    """The launches around the off-node carrier and the IPC test carrier's (cuda/comm/staging.cu)."""
    from epserve.comm import carriers

    o, staging_ptx = bare_off_node(monkeypatch, tmp_path)
    o.carrier = types.SimpleNamespace(exchange=lambda sends, recvs, status=None: None)
    o._dispatch_staging = o._combine_staging = types.SimpleNamespace(ptr=0x4000)
    o._landing = types.SimpleNamespace(ptr=0x5000)
    o._groups = {}
    o.exchange_counts(0x6000)
    o.exchange_combine(Device((T, K)), T, K, H, E // 4, Device(), Device())
    c = carriers.IpcTestCarrier.__new__(carriers.IpcTestCarrier)
    c.rank, c.error_ptr, c.timeout_ns, c._groups = 1, 0x7000, 10**9, {}
    c._flag_blocks, c._local, c._done = Device(), Device(), Device()
    c._tables = lambda sends, recvs: (Device(), 1, Device(), 1, Device(), 2)
    o.exchange_rows(0x6100, 0x6200, Device())
    c.exchange([], [], Device())
    names = [call[0].name for call in Called.calls]
    assert names == ["epserve_off_node_counts_landed", "epserve_off_node_stamp", "epserve_off_node_stamps_check",
                     "epserve_off_node_combine_land", "epserve_off_node_stamp", "epserve_off_node_stamps_check",
                     "epserve_ipc_carrier_exchange"]
    for fn, _, _, args, _ in Called.calls:
        sizes = [8 if isinstance(a, Device) else np.asarray(a).nbytes for a in args]
        assert sizes == param_sizes(staging_ptx, fn.name), fn.name


@pytest.mark.parametrize("transport", ["direct", "nccl"])
def test_more_than_a_node_of_ranks_takes_the_wide_route_kernels(ptx, fakes, transport):
    """Past 8 ranks the route's *_wide kernels (a token's destination set in several registers,
    cuda/comm/dispatch.cu) take the place of the one-node ones, with the same parameters."""
    for name in route_mod._KERNELS[transport]:
        assert param_sizes(ptx, name + "_wide") == param_sizes(ptx, name), name
    for world, wide in ((2, False), (8, False), (16, True), (128, True)):
        r = route_mod.Route(transport, num_experts=1024, world=world, top_k=K, max_tokens=T)
        names = (r.count_publish.name, r.rank_layout.name)
        assert names == tuple(n + "_wide" if wide else n for n in route_mod._KERNELS[transport]), world


def test_compact_land_launch_matches_its_kernel(monkeypatch, tmp_path):
    """EPSERVE_OFFNODE_SIZES=host: the combine's carrier group at the latest dispatch's sizes,
    then the land from compact return blocks, whose arguments match its kernel; without
    a direct dispatch before it, refused."""
    from epserve.comm.off_node_sizes import OffNodeSizes

    o, staging_ptx = bare_off_node(monkeypatch, tmp_path)
    o.sizes = "host"
    groups = []
    o.carrier = types.SimpleNamespace(exchange=lambda sends, recvs, status=None: groups.append((sends, recvs)))
    o._combine_staging = types.SimpleNamespace(ptr=0x4000)
    o._landing = types.SimpleNamespace(ptr=0x5000)
    o._dispatch = (0x6000, 0x6100, 0x6200, Device())
    with pytest.raises(RuntimeError, match="before any direct dispatch"):
        o.exchange_combine(Device((T, K)), T, K, H, E // 4, Device(), Device(), compact=True)
    o._last = OffNodeSizes(tokens_to={2: 5, 3: 0}, tokens_from={2: 1, 3: 2}, returns_to={2: 7, 3: 0},
                           returns_from={2: 0, 3: 9})
    o.exchange_combine(Device((T, K)), T, K, H, E // 4, Device(), Device(), compact=True)
    (sends, recvs), = groups
    stamp = o.stamps.out  # every off-node peer's stamp ends the group, whatever its rows
    assert [(x.peer, x.nbytes) for x in sends if x.staging is not stamp] == [(2, 7 * H * 2)]  # none of zero bytes
    assert [(x.peer, x.nbytes) for x in recvs if x.staging is not stamp] == [(3, 9 * H * 2)]
    assert [(x.peer, x.nbytes) for x in sends if x.staging is stamp] == [(2, 16), (3, 16)]
    assert [(x.peer, x.nbytes) for x in recvs if x.staging is stamp] == [(2, 16), (3, 16)]
    fn = Called.calls[-1][0]
    args = Called.calls[-1][3]
    assert [c[0].name for c in Called.calls] == ["epserve_off_node_stamp", "epserve_off_node_stamps_check",
                                                 "epserve_off_node_combine_land_compact"]
    sizes = [8 if isinstance(a, Device) else np.asarray(a).nbytes for a in args]
    assert sizes == param_sizes(staging_ptx, fn.name)
