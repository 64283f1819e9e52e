"""PeerSendConfig packed in Python must match the CUDA struct byte for byte. The check is
made by the compiler: static_asserts of Python's size and offsets, compiled with NVRTC."""

import numpy as np
import pytest

from epserve import build
from epserve.errors import BuildError
from epserve.sendconfig import MAX_PEERS, PEER_SEND_CONFIG, pack_peer_send_config


def layout_asserts(dtype: np.dtype) -> str:
    lines = [f"static_assert(sizeof(PeerSendConfig) == {dtype.itemsize}, \"size\");",
             f"static_assert(alignof(PeerSendConfig) == {dtype.alignment}, \"alignment\");",
             f"static_assert(EPSERVE_MAX_PEERS == {MAX_PEERS}, \"max peers\");"]
    for name in dtype.names:
        sub, offset = dtype.fields[name][:2]
        lines.append(f"static_assert(__builtin_offsetof(PeerSendConfig, {name}) == {offset}, \"offset of {name}\");")
        lines.append(f"static_assert(sizeof(PeerSendConfig::{name}) == {sub.itemsize}, \"size of {name}\");")
    return " ".join(lines)


def compile_probe(dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path))
    return build.compile_source("probes/peer_send_config_layout.cu", {"EPSERVE_LAYOUT_ASSERTS": layout_asserts(dtype)})


def test_python_packing_matches_the_cuda_struct(tmp_path, monkeypatch):
    compile_probe(PEER_SEND_CONFIG, tmp_path, monkeypatch)


def test_the_probe_can_fail(tmp_path, monkeypatch):
    names = list(PEER_SEND_CONFIG.names)
    swapped = np.dtype({"names": names, "formats": [PEER_SEND_CONFIG.fields[n][0] for n in names],
                        "offsets": [PEER_SEND_CONFIG.fields[n][1] for n in names[:-3]]
                        + [PEER_SEND_CONFIG.fields[n][1] for n in (names[-2], names[-3], names[-1])],
                        "itemsize": PEER_SEND_CONFIG.itemsize})
    with pytest.raises(BuildError, match="offset of"):
        compile_probe(swapped, tmp_path, monkeypatch)


def test_pack_fills_fields():
    cfg = pack_peer_send_config(recv=[0x1000, 0x2000], arrive=[0x3000, 0x4000], ready=0x5000, src_info=0x6000,
                                error=0x7000, epoch=3, timeout_ns=10**9, rank=1, world=2, top_k=8, hidden=7168,
                                max_tokens=4096)
    assert cfg.shape == (1,) and cfg.dtype.itemsize == 192
    raw = cfg.view(np.uint8)
    assert int.from_bytes(raw[64 + 8 : 64 + 16].tobytes(), "little") == 0x4000
    assert int.from_bytes(raw[180:184].tobytes(), "little") == 7168
    assert list(cfg["recv"][0]) == [0x1000, 0x2000] + [0] * (MAX_PEERS - 2)


def test_pack_rejects_too_many_ranks():
    with pytest.raises(ValueError, match="at most"):
        pack_peer_send_config(recv=[1] * 9, arrive=[1] * 9, ready=0, src_info=0, error=0, epoch=1, timeout_ns=1,
                              rank=0, world=9, top_k=1, hidden=64, max_tokens=1)
