"""The dispatch plan against a brute-force reading of docs/design.md ("Layouts"), on every rank at once."""

import os

import numpy as np
import pytest

from epserve.dispatch.host_plan import count_recv_rows, pack_src_info, plan_dispatch, unpack_src_info
from epserve.errors import ConfigError


def fresh_rng():
    # A new seed each run widens coverage; EPSERVE_TEST_SEED replays a failing one.
    seed = int(os.environ.get("EPSERVE_TEST_SEED", np.random.SeedSequence().entropy % 2**63))
    print(f"rng seed {seed} (set EPSERVE_TEST_SEED={seed} to replay)")
    return np.random.default_rng(seed)


def random_routing(rng, num_tokens, num_experts, top_k, unused_fraction=0.2):
    """Top-k routing over a random subset of experts (so some experts get nothing), with
    distinct experts per token, as a router gives, and some slots unused."""
    allowed = rng.choice(num_experts, size=max(top_k, num_experts * 3 // 4), replace=False)
    picks = np.argsort(rng.random((num_tokens, allowed.size)), axis=1)[:, :top_k]
    idx = allowed[picks].astype(np.int32)
    idx[rng.random(idx.shape) < unused_fraction] = -1
    return idx


def expected_rows(routing, rank, experts_per_rank):
    """(expert, source, token, slot) of every row `rank` receives, in dispatch order."""
    first = rank * experts_per_rank
    rows = [(int(e), s, t, j)
            for s, idx in enumerate(routing)
            for (t, j), e in np.ndenumerate(idx)
            if first <= e < first + experts_per_rank]
    return sorted(rows)


def check_plans(routing, num_experts, world_size):
    """Check every rank's plan, alone and against the other ranks' plans."""
    experts_per_rank = num_experts // world_size
    plans = [plan_dispatch(r, routing, num_experts, world_size) for r in range(world_size)]
    for r, plan in enumerate(plans):
        assert plan.expert_offsets.dtype == np.int32
        for name in ("src_info", "send_token", "send_slot", "recv_perm", "combine_pack_idx",
                     "recv_src_rank", "recv_src_pos"):
            assert getattr(plan, name).dtype == np.int32, name
        for name in ("send_counts", "send_displs", "recv_counts", "recv_displs"):
            assert getattr(plan, name).dtype == np.int64, name

        # Rows: expert-major, then (source, token, slot); offsets cover exactly M rows.
        rows = expected_rows(routing, r, experts_per_rank)
        m = len(rows)
        assert plan.num_recv_rows == m == count_recv_rows(r, routing, num_experts, world_size)
        assert plan.expert_offsets[0] == 0 and plan.expert_offsets[-1] == m
        sizes = np.bincount([e - r * experts_per_rank for e, *_ in rows],
                            minlength=experts_per_rank)
        np.testing.assert_array_equal(np.diff(plan.expert_offsets), sizes)
        sources = np.array([row[1:] for row in rows], dtype=np.int64).reshape(m, 3)
        np.testing.assert_array_equal(plan.src_info, pack_src_info(*sources.T))

        # Unused slots never appear.
        src, tok, slot = unpack_src_info(plan.src_info)
        for s in range(world_size):
            mine = src == s
            assert (routing[s][tok[mine], slot[mine]] >= 0).all()

        # Sender side: ordered by (destination, local expert) = global expert, then (t, j).
        sent = sorted((int(e), t, j) for (t, j), e in np.ndenumerate(routing[r]) if e >= 0)
        np.testing.assert_array_equal(plan.send_token, [t for _, t, _ in sent])
        np.testing.assert_array_equal(plan.send_slot, [j for *_, j in sent])
        dests = np.array([e // experts_per_rank for e, *_ in sent], dtype=np.int64)
        np.testing.assert_array_equal(plan.send_counts, np.bincount(dests, minlength=world_size))
        np.testing.assert_array_equal(plan.send_displs,
                                      np.cumsum(plan.send_counts) - plan.send_counts)
        np.testing.assert_array_equal(plan.recv_displs,
                                      np.cumsum(plan.recv_counts) - plan.recv_counts)

        # recv_perm and combine_pack_idx are inverse permutations of 0..M-1.
        np.testing.assert_array_equal(np.sort(plan.recv_perm), np.arange(m))
        np.testing.assert_array_equal(plan.combine_pack_idx[plan.recv_perm], np.arange(m))
        np.testing.assert_array_equal(plan.recv_perm[plan.combine_pack_idx], np.arange(m))

    for r, plan in enumerate(plans):
        for s, source in enumerate(plans):
            assert source.send_counts[r] == plan.recv_counts[s], (s, r)

        # Staging is each source's block for r, in that source's send order.
        stage_src = np.repeat(np.arange(world_size), plan.recv_counts)
        stage_pos = np.concatenate(
            [np.arange(p.send_displs[r], p.send_displs[r] + p.send_counts[r]) for p in plans])
        stage_info = np.array(
            [pack_src_info(s, plans[s].send_token[p], plans[s].send_slot[p])
             for s, p in zip(stage_src, stage_pos)], dtype=np.int32)
        np.testing.assert_array_equal(stage_info[plan.recv_perm], plan.src_info)
        np.testing.assert_array_equal(plan.src_info[plan.combine_pack_idx], stage_info)

        # Pulling straight from the peers' send buffers finds each row's own (t, j).
        pulled = [pack_src_info(s, plans[s].send_token[p], plans[s].send_slot[p])
                  for s, p in zip(plan.recv_src_rank, plan.recv_src_pos)]
        np.testing.assert_array_equal(np.array(pulled, dtype=np.int32).reshape(-1),
                                      plan.src_info)
    return plans


def test_src_info_bit_positions():
    assert pack_src_info(1, 0, 0) == 1 << 24
    assert pack_src_info(0, 1, 0) == 1 << 4
    assert pack_src_info(0, 0, 1) == 1
    top = pack_src_info(127, 2**20 - 1, 15)
    assert top.dtype == np.int32 and top == 0x7FFFFFFF


def test_src_info_round_trip():
    rng = fresh_rng()
    rank = rng.integers(0, 128, 1000)
    token = rng.integers(0, 2**20, 1000)
    slot = rng.integers(0, 16, 1000)
    packed = pack_src_info(rank, token, slot)
    assert packed.dtype == np.int32 and (packed >= 0).all()
    for got, want in zip(unpack_src_info(packed), (rank, token, slot)):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rank, token, slot, field",
                         [(128, 0, 0, "rank"), (0, 2**20, 0, "token"), (0, 0, 16, "slot"),
                          (-1, 0, 0, "rank")])
def test_src_info_refuses_what_does_not_fit(rank, token, slot, field):
    with pytest.raises(ConfigError, match=field):
        pack_src_info(rank, token, slot)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("top_k", [1, 3])
def test_random_plans(world_size, top_k):
    rng = fresh_rng()
    num_experts = 4 * world_size
    routing = [random_routing(rng, int(rng.integers(0, 40)), num_experts, top_k)
               for _ in range(world_size)]
    check_plans(routing, num_experts, world_size)


def test_rank_that_sends_nothing_and_uneven_tokens():
    rng = fresh_rng()
    routing = [random_routing(rng, 0, 8, 2), random_routing(rng, 17, 8, 2),
               np.full((5, 2), -1, np.int32), random_routing(rng, 3, 8, 2)]
    plans = check_plans(routing, 8, 4)
    for quiet in (0, 2):
        assert plans[quiet].send_counts.sum() == 0
        assert plans[quiet].send_token.size == 0
        assert all(p.recv_counts[quiet] == 0 for p in plans)


def test_experts_that_receive_nothing():
    routing = [np.array([[0, 3], [3, -1]], np.int32), np.array([[3, 0]], np.int32)]
    plans = check_plans(routing, 4, 2)
    np.testing.assert_array_equal(plans[0].expert_offsets, [0, 2, 2])
    np.testing.assert_array_equal(plans[1].expert_offsets, [0, 0, 3])
    # Expert 3's rows: (source 0, token 0, slot 1), (0, 1, 0), (1, 0, 0).
    np.testing.assert_array_equal(plans[1].src_info,
                                  pack_src_info([0, 0, 1], [0, 1, 0], [1, 0, 0]))


def test_nothing_routed_anywhere():
    routing = [np.full((3, 2), -1, np.int32), np.zeros((0, 2), np.int32)]
    for plan in check_plans(routing, 2, 2):
        assert plan.num_recv_rows == 0
        np.testing.assert_array_equal(plan.expert_offsets, [0, 0])


@pytest.mark.parametrize("routing, field", [
    ([np.array([[0, 4]], np.int32)], "expert id"),
    ([np.array([[0, -2]], np.int32)], "expert id"),
    ([np.array([[0.0, 1.0]])], "integer"),
    ([np.array([0, 1], np.int32)], "2-D"),
    ([np.zeros((1, 17), np.int32)], "top_k"),
])
def test_bad_routing_is_refused(routing, field):
    with pytest.raises(ConfigError, match=field):
        plan_dispatch(0, routing, 4, 1)


def test_ranks_must_agree_on_top_k():
    routing = [np.zeros((2, 2), np.int32), np.zeros((2, 3), np.int32)]
    with pytest.raises(ConfigError, match="top_k"):
        plan_dispatch(0, routing, 4, 2)


def test_too_many_tokens_is_refused():
    routing = [np.full((2**20 + 1, 1), -1, np.int32)]
    with pytest.raises(ConfigError, match="tokens"):
        plan_dispatch(0, routing, 4, 1)


@pytest.mark.parametrize("rank, num_experts, world_size, count, field", [
    (2, 4, 2, 2, "rank"),
    (0, 5, 2, 2, "num_experts"),
    (0, 4, 2, 3, "world_size"),
    (0, 256, 256, 256, "world_size"),
])
def test_bad_world_is_refused(rank, num_experts, world_size, count, field):
    routing = [np.zeros((1, 1), np.int32)] * count
    with pytest.raises(ConfigError, match=field):
        plan_dispatch(rank, routing, num_experts, world_size)


def test_recv_capacity_check_names_every_rank_over_it():
    from epserve.dispatch.host_plan import check_recv_capacity

    check_recv_capacity([5, 9, 3], 9)  # at capacity is fine
    with pytest.raises(ConfigError, match=r"rank 1 would receive 9 rows, rank 3 would receive 12 rows, more than "
                                          r"the receive capacity of 8 rows per rank"):
        check_recv_capacity([5, 9, 3, 12], 8)
