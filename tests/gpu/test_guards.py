"""A corrupt routing must not write outside recv: rows whose src_info names a rank, token or
slot out of range are refused on the device (and reported), by the unfused IPC push and by
the peer sink in both GEMMs, and guard regions around recv stay untouched. One process, one
rank: the same scatter code serves every peer. The rank's communicator is a stand-in, not
MPI: an MPI library initialised in the pytest process would leak its variables into the
mpirun jobs that later tests start."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

H, K, TOP_K, TOKENS, GUARD = 128, 64, 2, 16, 4096
POISON = 0x5A


class OneRank:
    """The slice of an mpi4py communicator that PeerGroup uses, for a world of one."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, value):
        return [value]

    def Barrier(self):
        pass


def setup():
    import cupy

    from epserve.comm import signals as sig
    from epserve.comm.peers import PeerGroup
    from epserve.comm.signals import SignalBlock
    from epserve.dispatch.host_plan import pack_src_info
    from epserve.runtime.kernel_structs import pack_peer_send_config

    group = PeerGroup(OneRank())
    recv_bytes = TOKENS * TOP_K * H * 2
    buf = group.allocate(GUARD + recv_bytes + GUARD)
    raw = buf.view(np.uint8, (GUARD + recv_bytes + GUARD,))
    raw.fill(POISON)
    signals = SignalBlock.create(group)
    good = pack_src_info(np.array([0, 0, 0]), np.array([0, 5, TOKENS - 1]), np.array([0, 1, 1]))
    bad = np.array([(3 << 24) | (1 << 4),                # rank 3 of 1
                    (0 << 24) | (TOKENS << 4),           # token past max_tokens
                    (0 << 24) | (((1 << 20) - 1) << 4),  # the largest token the bits hold
                    (0 << 24) | (2 << 4) | TOP_K,        # slot past top_k
                    (0 << 24) | (2 << 4) | 15], np.int32)
    src_info = cupy.asarray(np.concatenate([good, bad]).astype(np.int32))
    cfg = pack_peer_send_config(recv=[buf.ptr + GUARD], arrive=[signals.peer(0, sig.ARRIVE)],
                                ready=signals.local(sig.READY), src_info=src_info.data.ptr,
                                error=signals.local(sig.ERROR), status=0, timeout_ns=10**9, off_recv=0, rank=0,
                                world=1, top_k=TOP_K, hidden=H, max_tokens=TOKENS, ranks_per_node=1, node_first=0)
    return group, raw, signals, src_info, cfg, len(good)


def check(raw, signals, rows, n_good):
    import cupy

    from epserve.errors import ConfigError

    got = cupy.asnumpy(raw)
    assert (got[:GUARD] == POISON).all() and (got[-GUARD:] == POISON).all(), "a guard region was written"
    recv = got[GUARD:-GUARD].view(np.uint16).reshape(TOKENS, TOP_K, H)
    expected = cupy.asnumpy(rows).view(np.uint16)
    for m, (t, j) in enumerate([(0, 0), (5, 1), (TOKENS - 1, 1)][:n_good]):
        assert np.array_equal(recv[t, j], expected[m]), f"row {m} did not land in slot ({t}, {j})"
    touched = (got[GUARD:-GUARD].reshape(TOKENS, TOP_K, H * 2) != POISON).any(axis=2)
    assert touched.sum() == n_good, "a refused row was written somewhere"
    with pytest.raises(ConfigError, match="src_info"):
        signals.raise_if_error(0)


def test_ipc_push_refuses_corrupt_rows():
    import cupy

    from epserve.arrays import BF16
    from epserve.comm import row_moves

    group, raw, signals, src_info, cfg, n_good = setup()
    try:
        M = src_info.size
        C = cupy.random.standard_normal((M, H), dtype=np.float32).astype(BF16)
        row_moves.push_rows_to_peers(C, M, H, cfg)
        check(raw, signals, C[:n_good], n_good)
    finally:
        group.close()


@pytest.mark.parametrize("impl", ["mma", "wgmma"])
def test_peer_sink_refuses_corrupt_rows(impl):
    import cupy

    from epserve.arrays import BF16
    from epserve.ffn import gemm

    group, raw, signals, src_info, cfg, n_good = setup()
    try:
        M = src_info.size
        A = cupy.random.standard_normal((M, K), dtype=np.float32).astype(BF16)
        B = (cupy.random.standard_normal((1, H, K), dtype=np.float32) / 8).astype(BF16)
        offsets = cupy.asarray(np.array([0, M], np.int32))
        gemm.grouped_gemm("peer", A, B, None, offsets, 1, H, K, cfg, 0, impl=impl)
        C = cupy.empty((M, H), BF16)
        gemm.grouped_gemm("null", A, B, C, offsets, 1, H, K, impl=impl)
        check(raw, signals, C[:n_good], n_good)
    finally:
        group.close()
