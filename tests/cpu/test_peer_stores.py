"""GEMM 2's peer sink builds (epserve/ffn/gemm.py peer_stores, peer_variant), without a GPU:
EPSERVE_SINK_STORES picks the bulk copies for this rank's own rows only (default), the send
warps' stores or the bulk copies for every row, a bad value is a ConfigError, the null sink is never a bulk
build, and every bulk variant exists with the bulk sink and the defines of the build it
replaces."""

import pytest

from epserve.errors import ConfigError
from epserve.ffn import gemm
from epserve.runtime import kernels


def test_default_is_own_rows_by_bulk_copies(monkeypatch):
    monkeypatch.delenv("EPSERVE_SINK_STORES", raising=False)
    assert gemm.peer_stores() == "own-bulk"
    assert gemm.peer_variant("peer") == "peer_ownbulk"
    assert gemm.peer_variant("null") == "null"


def test_warps_picks_the_send_warps_builds(monkeypatch):
    monkeypatch.setenv("EPSERVE_SINK_STORES", "warps")
    assert gemm.peer_variant("peer") == "peer"
    assert gemm.peer_variant("null") == "null"


def test_bulk_picks_the_bulk_builds(monkeypatch):
    monkeypatch.setenv("EPSERVE_SINK_STORES", "bulk")
    assert gemm.peer_variant("peer") == "peer_bulk"
    assert gemm.peer_variant("null") == "null"
    assert "peer_bulk" in gemm.PEER_BUILDS_USED


def test_own_bulk_picks_the_own_rows_builds(monkeypatch):
    monkeypatch.setenv("EPSERVE_SINK_STORES", "own-bulk")
    assert gemm.peer_variant("peer") == "peer_ownbulk"
    assert gemm.peer_variant("null") == "null"
    assert "peer_ownbulk" in gemm.PEER_BUILDS_USED


def test_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("EPSERVE_SINK_STORES", "dma")
    with pytest.raises(ConfigError, match="EPSERVE_SINK_STORES"):
        gemm.peer_variant("peer")


@pytest.mark.parametrize("twin,bulk_define", [("peer_bulk", 1), ("peer_ownbulk", 2)])
@pytest.mark.parametrize("base", ["gemm_wgmma_peer", "gemm_wgmma_peer_split", "gemm_fp8_peer"])
def test_each_peer_build_has_its_bulk_twins(base, twin, bulk_define):
    bulk = base.replace("peer", twin)
    source, defines = kernels.VARIANTS[base]
    bulk_source, bulk_defines = kernels.VARIANTS[bulk]
    assert bulk_source == source
    assert bulk_defines == {**defines, "EPSERVE_SINK": "EpPeerSinkBulk", "EPSERVE_SINK_BULK": bulk_define}
