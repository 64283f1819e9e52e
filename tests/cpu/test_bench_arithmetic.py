"""The benchmark's arithmetic on cases small enough to count by hand, and on a random routing
against a brute-force count, slot by slot."""

import numpy as np
import pytest

from epserve.bench import arithmetic as ar
from epserve.errors import ConfigError

H, I = 8, 4

# Two ranks, four experts: rank 0 owns experts 0 and 1, rank 1 owns 2 and 3. Nobody picks
# expert 1, so rank 0 has one expert with rows. Rank 0's token 2 sends both its slots to
# rank 1 (one row when deduplicated); rank 1's token 1 has an unused slot.
ROUTING = [np.array([[0, 2], [0, 3], [2, 3]]), np.array([[2, 3], [3, -1]])]


@pytest.fixture
def counts():
    return ar.count_routing(ROUTING, num_experts=4)


def test_counts_by_hand(counts):
    assert counts.world_size == 2 and counts.top_k == 2 and counts.experts_per_rank == 2
    assert counts.tokens.tolist() == [3, 2]
    assert counts.slots.tolist() == [[2, 4], [0, 3]]
    assert counts.token_dests.tolist() == [[2, 3], [0, 2]]
    assert counts.rows.tolist() == [2, 7]
    assert counts.used_slots.tolist() == [6, 3]
    assert counts.experts_with_rows.tolist() == [1, 2]


def test_flops_by_hand(counts):
    assert ar.gemm1_flops(7, H, I) == 2 * 7 * 8 * 8
    assert ar.gemm2_flops(7, H, I) == 2 * 7 * 4 * 8
    assert ar.expert_ffn_flops(7, H, I) == 896 + 448
    assert ar.gemm2_flops(counts.rows, H, I).tolist() == [128, 448]


def test_gemm2_bytes_count_only_experts_with_rows(counts):
    # rank 0: one expert's weights 8*4*2 = 64, activations 2*4*2 = 16, outputs 2*8*2 = 32;
    # its second expert has no rows and is never read.
    # rank 1: two experts' weights 128, activations 7*4*2 = 56, outputs 7*8*2 = 112.
    got = ar.gemm2_hbm_bytes(counts.rows, counts.experts_with_rows, H, I)
    assert got.tolist() == [112, 296]


def test_layer_bytes_by_hand(counts):
    # 2 * (2*T*H + 2*M*H + M*I + E_r*3*H*I)
    # rank 0: 2 * (48 + 32 + 8 + 96) = 368; rank 1: 2 * (32 + 112 + 28 + 192) = 728
    got = ar.layer_hbm_bytes(counts.tokens, counts.rows, counts.experts_with_rows, H, I)
    assert got.tolist() == [368, 728]


def test_combine_bytes_skip_rows_that_stay_home(counts):
    # Rank 1 computed 4 rows of rank 0's tokens and sends them home; the 2 rows rank 0
    # computed for itself and the 3 rank 1 computed for itself never cross NVLink.
    link = ar.combine_nvlink_bytes(counts, H)
    assert link.sent.tolist() == [0, 4 * H * 2]
    assert link.received.tolist() == [4 * H * 2, 0]
    assert link.busiest == 64 and link.total == 64


def test_dispatch_dedup_sends_one_row_per_token_and_destination(counts):
    dedup = ar.dispatch_nvlink_bytes(counts, H)
    assert dedup.sent.tolist() == [3 * H * 2, 0]     # tokens 0, 1, 2 of rank 0, once each
    assert dedup.received.tolist() == [0, 3 * H * 2]
    per_slot = ar.dispatch_nvlink_bytes(counts, H, dedup=False)
    assert per_slot.sent.tolist() == [4 * H * 2, 0]  # token 2's two slots are two rows
    assert per_slot.received.tolist() == [0, 4 * H * 2]


def test_counts_match_brute_force_on_three_ranks():
    rng = np.random.default_rng(3)
    world, num_experts, k, per_rank = 3, 6, 3, 2
    routing = [np.where(rng.random((T, k)) < 0.15, -1, rng.integers(0, num_experts, (T, k)))
               for T in (5, 0, 9)]
    counts = ar.count_routing(routing, num_experts)
    slots = np.zeros((world, world), int)
    dests = np.zeros((world, world), int)
    used = set()
    for s, idx in enumerate(routing):
        for t in range(idx.shape[0]):
            for d in {int(e) // per_rank for e in idx[t] if e >= 0}:
                dests[s, d] += 1
            for e in idx[t]:
                if e >= 0:
                    slots[s, e // per_rank] += 1
                    used.add(int(e))
    assert counts.slots.tolist() == slots.tolist()
    assert counts.token_dests.tolist() == dests.tolist()
    assert counts.experts_with_rows.tolist() == [len([e for e in used if e // per_rank == r]) for r in range(world)]
    combine = ar.combine_nvlink_bytes(counts, H)
    for r in range(world):
        assert combine.sent[r] == sum(slots[s, r] for s in range(world) if s != r) * H * 2
        assert combine.received[r] == sum(slots[r, d] for d in range(world) if d != r) * H * 2


@pytest.mark.parametrize("routing, num_experts, match", [
    ([np.array([[0, 4]])], 4, "outside"),
    ([np.array([[0, -2]])], 4, "outside"),
    ([np.array([[0]]), np.array([[0]])], 3, "evenly"),
    ([np.array([[0, 1]]), np.array([[0]])], 4, r"\[T, k\]"),
])
def test_count_routing_rejects_bad_input(routing, num_experts, match):
    with pytest.raises(ConfigError, match=match):
        ar.count_routing(routing, num_experts)


RATES = ar.Rates(gemm_flop_s=1e3, copy_bytes_s=1e3, peer_bytes_s=1e3)


@pytest.mark.parametrize("flops, hbm, nvlink, binding", [
    (5000, 100, 100, "gemm"),
    (100, [100, 7000], 100, "hbm"),
    (100, 100, [9000, 0], "nvlink"),
])
def test_floor_picks_the_binding_term(flops, hbm, nvlink, binding):
    result = ar.floor(flops, hbm, nvlink, RATES)
    assert result.binding == binding
    assert result.seconds == max(result.terms.values())
    assert result.terms == {"gemm": np.max(flops) / 1e3, "hbm": np.max(hbm) / 1e3, "nvlink": np.max(nvlink) / 1e3}


def test_floor_takes_each_terms_slowest_rank():
    result = ar.floor([10, 30], [40, 20], [0, 0], ar.Rates(10.0, 20.0, 1.0))
    assert result.terms == {"gemm": 3.0, "hbm": 2.0, "nvlink": 0.0}
    assert result.binding == "gemm"


def test_work_floor_uses_each_ranks_busier_link_direction(counts):
    work = ar.gemm2_combine_work(counts, H, I)
    assert work.nvlink.per_rank.tolist() == [64, 64]
    f = work.floor(ar.Rates(gemm_flop_s=1e9, copy_bytes_s=1e9, peer_bytes_s=1.0))
    assert f.binding == "nvlink" and f.seconds == 64.0
    assert work.flops_per_gpu == (128 + 448) / 2


def test_gemm2_alone_moves_nothing_over_nvlink(counts):
    work = ar.gemm2_work(counts, H, I)
    assert work.nvlink.busiest == 0
    assert work.floor(RATES).terms["nvlink"] == 0.0


def test_layer_work_adds_dispatch_and_combine(counts):
    work = ar.layer_work(counts, H, I)
    assert work.flops.tolist() == ar.expert_ffn_flops(counts.rows, H, I).tolist()
    assert work.nvlink.sent.tolist() == [48 + 0, 0 + 64]
    assert work.nvlink.received.tolist() == [0 + 64, 48 + 0]
    per_slot = ar.layer_work(counts, H, I, dedup_dispatch=False)
    assert per_slot.nvlink.sent.tolist() == [64, 64]


def test_design_numbers_reproduce_section_7():
    # DeepSeek-V3-like GEMM 2 at 4096 tokens per rank on two ranks, uniform routing: each
    # rank computes 32768 rows, half of them for the other rank's tokens.
    half = 4096 * 8 // 2
    counts = ar.RoutingCounts(top_k=8, experts_per_rank=128, tokens=np.array([4096, 4096]),
                              slots=np.full((2, 2), half), token_dests=np.full((2, 2), 4096),
                              experts_with_rows=np.array([128, 128]))
    rates = ar.Rates(ar.DESIGN_GROUPED_GEMM_FLOP_S, ar.DESIGN_COPY_BYTES_S, ar.DESIGN_PEER_STORE_BYTES_S)
    f = ar.gemm2_combine_work(counts, 7168, 2048).floor(rates)
    assert f.binding == "gemm"
    assert f.terms["gemm"] == pytest.approx(2.04e-3, rel=0.02)
    assert f.terms["nvlink"] == pytest.approx(0.63e-3, rel=0.02)
    assert ar.combine_nvlink_bytes(counts, 7168).busiest == pytest.approx(232e6, rel=0.02)


def test_ratios_and_rates():
    assert ar.x_floor(3e-3, 2e-3) == pytest.approx(1.5)
    assert ar.speedup(2.0, 1.0) == 2.0
    assert ar.tflop_per_s(1e12, 0.5) == 2.0
    assert ar.gb_per_s(1e9, 0.25) == 4.0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1e12"])
def test_rates_must_be_positive_finite_numbers(bad):
    with pytest.raises(ConfigError, match="gemm_flop_s"):
        ar.Rates(gemm_flop_s=bad, copy_bytes_s=1.0, peer_bytes_s=1.0)


def test_mma_row_fraction_by_hand():
    """Each expert pays whole 128-row tiles plus its tail rounded up to the step: 16 (the
    wgmma GEMM's swapped tails), 64 (its 64-row halves) or 128 (whole tiles)."""
    rows = [128, 1, 16, 17, 0, 129]
    real = sum(rows)  # 291
    assert ar.mma_row_fraction(rows) == pytest.approx(real / (128 + 16 + 16 + 32 + 0 + 144))
    assert ar.mma_row_fraction(rows, 128, 64) == pytest.approx(real / (128 + 64 + 64 + 64 + 0 + 192))
    assert ar.mma_row_fraction(rows, 128, 128) == pytest.approx(real / (128 + 128 + 128 + 128 + 0 + 256))
    assert ar.mma_row_fraction([0, 0]) == 1.0
