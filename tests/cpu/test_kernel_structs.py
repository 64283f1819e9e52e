"""Structs packed in Python must match the CUDA structs byte for byte. The check is made by
the compiler: static_asserts of Python's sizes and offsets, compiled with NVRTC."""

import numpy as np
import pytest

from epserve import build
from epserve.errors import BuildError
from epserve.kernel_structs import (MAX_PEERS, PEER_SEND_CONFIG, STRUCTS, pack_dispatch_config,
                                    pack_peer_send_config)


def layout_asserts(structs: dict) -> str:
    lines = [f"static_assert(EPSERVE_MAX_PEERS == {MAX_PEERS}, \"max peers\");"]
    for struct, dtype in structs.items():
        lines.append(f"static_assert(sizeof({struct}) == {dtype.itemsize}, \"size of {struct}\");")
        lines.append(f"static_assert(alignof({struct}) == {dtype.alignment}, \"alignment of {struct}\");")
        for name in dtype.names:
            sub, offset = dtype.fields[name][:2]
            lines.append(f"static_assert(__builtin_offsetof({struct}, {name}) == {offset}, \"offset of {struct}::{name}\");")
            lines.append(f"static_assert(sizeof({struct}::{name}) == {sub.itemsize}, \"size of {struct}::{name}\");")
    return " ".join(lines)


def compile_probe(structs, tmp_path, monkeypatch):
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path))
    return build.compile_source("probes/struct_layout.cu", {"EPSERVE_LAYOUT_ASSERTS": layout_asserts(structs)})


def test_python_packing_matches_the_cuda_structs(tmp_path, monkeypatch):
    compile_probe(STRUCTS, tmp_path, monkeypatch)


def test_the_probe_can_fail(tmp_path, monkeypatch):
    names = list(PEER_SEND_CONFIG.names)
    offsets = [PEER_SEND_CONFIG.fields[n][1] for n in names]
    offsets[-3], offsets[-2] = offsets[-2], offsets[-3]  # swap two int fields
    swapped = np.dtype({"names": names, "formats": [PEER_SEND_CONFIG.fields[n][0] for n in names],
                        "offsets": offsets, "itemsize": PEER_SEND_CONFIG.itemsize})
    with pytest.raises(BuildError, match="offset of PeerSendConfig::"):
        compile_probe({"PeerSendConfig": swapped}, tmp_path, monkeypatch)


def test_pack_fills_fields():
    cfg = pack_peer_send_config(recv=[0x1000, 0x2000], arrive=[0x3000, 0x4000], ready=0x5000, src_info=0x6000,
                                error=0x7000, epoch=3, timeout_ns=10**9, rank=1, world=2, top_k=8, hidden=7168,
                                max_tokens=4096)
    assert cfg.shape == (1,) and cfg.dtype.itemsize == 192
    raw = cfg.view(np.uint8)
    assert int.from_bytes(raw[64 + 8 : 64 + 16].tobytes(), "little") == 0x4000
    assert int.from_bytes(raw[180:184].tobytes(), "little") == 7168
    assert list(cfg["recv"][0]) == [0x1000, 0x2000] + [0] * (MAX_PEERS - 2)


def test_pack_names_missing_and_unknown_fields():
    with pytest.raises(ValueError, match="missing.*hidden"):
        pack_dispatch_config(world=1, count_table=[1], tokens=[1], meta=[1], count_arrive=[1], token_arrive=[1],
                             ready=[1], my_ready=1, my_count_arrive=1, my_token_arrive=1, expected_tokens=1, error=1,
                             epoch=1, timeout_ns=1, rank=0, num_experts=1, top_k=1, max_tokens=1)
    with pytest.raises(ValueError, match="unknown.*bogus"):
        pack_peer_send_config(world=1, bogus=1)


def test_pack_rejects_too_many_ranks_and_short_tables():
    with pytest.raises(ValueError, match="at most"):
        pack_peer_send_config(recv=[1] * 9, arrive=[1] * 9, ready=0, src_info=0, error=0, epoch=1, timeout_ns=1,
                              rank=0, world=9, top_k=1, hidden=64, max_tokens=1)
    with pytest.raises(ValueError, match="one address per rank"):
        pack_peer_send_config(recv=[1], arrive=[1, 2], ready=0, src_info=0, error=0, epoch=1, timeout_ns=1,
                              rank=0, world=2, top_k=1, hidden=64, max_tokens=1)
