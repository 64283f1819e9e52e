"""Structs packed in Python must match the CUDA structs byte for byte. The check is made by
the compiler: NVRTC compiles one probe kernel per field, and its PTX gives the struct's size
and alignment and each field's offset and width."""

import re

import numpy as np
import pytest

from epserve.runtime import build
from epserve.runtime.kernel_structs import (
    MAX_EXPERTS,
    MAX_LOCAL_EXPERTS,
    MAX_PEERS,
    MAX_WORLD,
    PEER_COUNTERS,
    PEER_SEND_CONFIG,
    STRUCTS,
    pack_dispatch_config,
    pack_peer_counters,
    pack_peer_send_config,
)

ONE_NODE = dict(off_recv=0, ranks_per_node=2, node_first=0)  # PeerSendConfig's node fields, for 2 ranks on one node


def probe_kernels(structs: dict) -> str:
    """One kernel per field (first and last element of arrays), reading it from the struct."""
    kernels = []
    for struct, dtype in structs.items():
        for name in dtype.names:
            sub = dtype.fields[name][0]
            picks = [("", "")] if not sub.shape else [("_first", "[0]"), ("_last", f"[{sub.shape[0] - 1}]")]
            for suffix, index in picks:
                kernels.append(f'extern "C" __global__ void probe_{struct}_{name}{suffix}({struct} s, '
                               f"unsigned long long* out) {{ *out = (unsigned long long)(s.{name}{index}); }}")
    return " ".join(kernels)


def compiled_layout(structs, tmp_path, monkeypatch) -> dict:
    """entry name -> (param size, param alignment, offset of the one field it loads, load bits)"""
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path))
    ptx = build.compile_source("probes/struct_layout.cu", {"EPSERVE_LAYOUT_PROBES": probe_kernels(structs)}).ptx
    layout = {}
    for entry in re.finditer(r"\.entry (probe_\w+)\((.*?)^}", ptx.read_text(), re.S | re.M):
        name, body = entry.groups()
        align, size = re.search(rf"\.param \.align (\d+) \.b8 {name}_param_0\[(\d+)\]", body).groups()
        loads = re.findall(rf"ld\.param\.[usb](\d+)\s+%\w+, \[{name}_param_0\+?(\d*)\]", body)
        # The compiler may load two adjacent fields as one vector and use one of them: the
        # field is the element whose register the kernel goes on with.
        for bits, regs, offset in re.findall(rf"ld\.param\.v2\.[usb](\d+)\s+\{{(.*?)\}}, \[{name}_param_0\+?(\d*)\]",
                                             body):
            used = [i for i, reg in enumerate(regs.split(",")) if re.search(rf"{re.escape(reg.strip())}\b(?!\d)",
                                                                              body.split(regs, 1)[1])]
            assert len(used) == 1, (name, regs)
            loads.append((bits, str(int(offset or 0) + used[0] * int(bits) // 8)))
        assert len(loads) == 1, (name, loads)
        bits, offset = loads[0]
        layout[name] = (int(size), int(align), int(offset or 0), int(bits))
    return layout


def test_python_packing_matches_the_cuda_structs(tmp_path, monkeypatch):
    layout = compiled_layout(STRUCTS, tmp_path, monkeypatch)
    for struct, dtype in STRUCTS.items():
        for name in dtype.names:
            sub, offset = dtype.fields[name][:2]
            elem = sub.base.itemsize
            if sub.shape:
                expect = {"_first": offset, "_last": offset + (sub.shape[0] - 1) * elem}
            else:
                expect = {"": offset}
            for suffix, want in expect.items():
                size, align, got, bits = layout[f"probe_{struct}_{name}{suffix}"]
                assert (size, align) == (dtype.itemsize, dtype.alignment), f"{struct}: size or alignment"
                assert got == want, f"{struct}::{name}{suffix}: CUDA offset {got}, Python {want}"
                assert bits == 8 * elem, f"{struct}::{name}: CUDA loads {bits} bits, Python packs {8 * elem}"


def test_the_check_can_fail(tmp_path, monkeypatch):
    names = list(PEER_SEND_CONFIG.names)
    offsets = [PEER_SEND_CONFIG.fields[n][1] for n in names]
    offsets[-3], offsets[-2] = offsets[-2], offsets[-3]  # swap two int fields
    swapped = np.dtype({"names": names, "formats": [PEER_SEND_CONFIG.fields[n][0] for n in names],
                        "offsets": offsets, "itemsize": PEER_SEND_CONFIG.itemsize})
    layout = compiled_layout({"PeerSendConfig": swapped}, tmp_path, monkeypatch)
    got = layout[f"probe_PeerSendConfig_{names[-3]}"][2]
    assert got != swapped.fields[names[-3]][1]


def test_pack_fills_fields():
    cfg = pack_peer_send_config(recv=[0x1000, 0x2000], arrive=[0x3000, 0x4000], ready=0x5000, src_info=0x6000,
                                error=0x7000, status=3, timeout_ns=10**9, rank=1, world=2, top_k=8, hidden=7168,
                                max_tokens=4096, **ONE_NODE)
    assert cfg.shape == (1,) and cfg.dtype.itemsize == 208
    raw = cfg.view(np.uint8)
    assert int.from_bytes(raw[64 + 8 : 64 + 16].tobytes(), "little") == 0x4000
    assert int.from_bytes(raw[188:192].tobytes(), "little") == 7168
    assert list(cfg["recv"][0]) == [0x1000, 0x2000] + [0] * (MAX_PEERS - 2)


def test_tables_hold_one_node_and_the_world_goes_to_128():
    """128 ranks as nodes of 8: the address tables take the 8 ranks of this rank's node, by
    local index; the world is a count (docs/design.md, "Across nodes")."""
    node = [0x1000 * (p + 1) for p in range(8)]
    cfg = pack_peer_send_config(recv=node, arrive=node, ready=1, src_info=1, error=1, status=1, timeout_ns=1,
                                off_recv=0x9000, rank=77, world=128, top_k=8, hidden=64, max_tokens=16,
                                ranks_per_node=8, node_first=72)
    assert list(cfg["recv"][0]) == node and cfg["node_first"][0] == 72 and cfg["off_recv"][0] == 0x9000
    ctr = pack_peer_counters(ready=node, ranks_per_node=8, node_first=72)
    assert list(ctr["ready"][0]) == node and PEER_COUNTERS.itemsize == 8 * 8 + 8
    with pytest.raises(ValueError, match="at most 8 ranks per node"):
        pack_peer_send_config(recv=[1] * 16, arrive=[1] * 16, ready=0, src_info=0, error=0, status=1, timeout_ns=1,
                              off_recv=0, rank=0, world=16, top_k=1, hidden=64, max_tokens=1, ranks_per_node=16,
                              node_first=0)
    with pytest.raises(ValueError, match="must hold rank 80"):  # the node is the rank's own
        pack_peer_send_config(recv=node, arrive=node, ready=0, src_info=0, error=0, status=1, timeout_ns=1,
                              off_recv=0, rank=80, world=128, top_k=1, hidden=64, max_tokens=1, ranks_per_node=8,
                              node_first=72)
    with pytest.raises(ValueError, match="at most 128 ranks"):
        pack_peer_send_config(recv=[1], arrive=[1], ready=0, src_info=0, error=0, status=1, timeout_ns=1, off_recv=0,
                              rank=0, world=129, top_k=1, hidden=64, max_tokens=1, ranks_per_node=1, node_first=0)
    with pytest.raises(ValueError, match="9 ranks per node .at most 8"):
        pack_peer_counters(ready=[1] * 9, ranks_per_node=9, node_first=0)


def test_src_info_names_max_world_ranks():
    """The world's limit is what src_info's rank bits name: pack the last rank, decode it as
    cuda/common/src_info.cuh does."""
    from epserve.dispatch.host_plan import pack_src_info

    v = int(pack_src_info(np.array([MAX_WORLD - 1]), np.array([5]), np.array([3]))[0])
    assert v >= 0 and ((v >> 24) & 0x7F, (v >> 4) & 0xFFFFF, v & 0xF) == (MAX_WORLD - 1, 5, 3)
    text = (build.CUDA_ROOT / "common/src_info.cuh").read_text()
    assert "(v >> 24) & 0x7f" in text and MAX_WORLD == 0x7F + 1


def test_pack_names_missing_and_unknown_fields():
    with pytest.raises(ValueError, match="missing.*hidden"):
        pack_dispatch_config(world=1, count_table=[1], tokens=[1], meta=[1], count_arrive=[1], ready=[1],
                             my_ready=1, my_count_arrive=1, error=1, status=1, timeout_ns=1, rank=0, num_experts=1,
                             top_k=1, max_tokens=1)
    with pytest.raises(ValueError, match="unknown.*bogus"):
        pack_peer_send_config(world=1, bogus=1)


def test_pack_rejects_too_many_ranks_and_short_tables():
    with pytest.raises(ValueError, match="at most"):
        pack_peer_send_config(recv=[1] * 9, arrive=[1] * 9, ready=0, src_info=0, error=0, status=1, timeout_ns=1,
                              off_recv=0, rank=0, world=9, top_k=1, hidden=64, max_tokens=1, ranks_per_node=9,
                              node_first=0)
    with pytest.raises(ValueError, match="one address per rank of the node"):
        pack_peer_send_config(recv=[1], arrive=[1, 2], ready=0, src_info=0, error=0, status=1, timeout_ns=1,
                              rank=0, world=2, top_k=1, hidden=64, max_tokens=1, **ONE_NODE)


def test_python_limits_match_the_cuda_defines():
    for header, define, value in (("common/types.cuh", "EPSERVE_MAX_LOCAL_EXPERTS", MAX_LOCAL_EXPERTS),
                                  ("common/nodes.cuh", "EPSERVE_MAX_PEERS", MAX_PEERS),
                                  ("common/nodes.cuh", "EPSERVE_MAX_WORLD", MAX_WORLD),
                                  ("comm/dispatch_config.cuh", "EPSERVE_MAX_EXPERTS", MAX_EXPERTS)):
        text = (build.CUDA_ROOT / header).read_text()
        assert int(re.search(rf"#define {define} (\d+)", text).group(1)) == value, define


def test_launch_args_point_at_the_packed_bytes():
    """A wrapped struct or scalar is what CuPy itself would make of the size-1 array at each
    launch (a CNumpyArray over its bytes), made once: the kernel gets the same bytes."""
    import ctypes

    from cupy.cuda.function import CNumpyArray, CPointer

    from epserve.runtime.kernel_structs import i32, launch_arg, u64

    cfg = pack_peer_send_config(recv=[0x1000], arrive=[0x3000], ready=0x5000, src_info=0x6000, error=0x7000,
                                status=0x8000, timeout_ns=9, off_recv=0, rank=0, world=1, top_k=8, hidden=2048,
                                max_tokens=64, ranks_per_node=1, node_first=0)
    arg = launch_arg(cfg)
    assert isinstance(arg, CNumpyArray) and isinstance(arg, CPointer)  # CuPy passes a CPointer through as it is
    assert arg.ptr == cfg.ctypes.data
    assert ctypes.string_at(arg.ptr, cfg.itemsize) == cfg.tobytes()
    assert ctypes.c_int32.from_address(i32(-7).ptr).value == -7
    assert ctypes.c_uint64.from_address(u64(2**63 + 5).ptr).value == 2**63 + 5
    assert i32(3) is i32(3)  # made once per value
    with pytest.raises(ValueError, match="one element"):
        launch_arg(np.zeros(4, np.uint8))
