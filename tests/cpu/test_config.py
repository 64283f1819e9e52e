"""MoEConfig validation, and check_agreement against a fake communicator (the real
multi-process run lives in tests/mpi)."""

import dataclasses

import numpy as np
import pytest

from epserve.config import MoEConfig, check_agreement
from epserve.errors import ConfigError, RankMismatchError

GOOD = dict(num_experts=8, top_k=2, hidden=128, intermediate=64, max_tokens_per_rank=16,
            world_size=2)


@pytest.mark.parametrize("changes, field", [
    (dict(num_experts=0), "num_experts"),
    (dict(num_experts=-8), "num_experts"),
    (dict(num_experts=8.0), "num_experts"),
    (dict(top_k=True), "top_k"),
    (dict(hidden="128"), "hidden"),
    (dict(top_k=0), "top_k"),
    (dict(world_size=0), "world_size"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank"),
    (dict(world_size=3), "num_experts"),
    (dict(top_k=9), "top_k"),
    (dict(num_experts=32, top_k=17), "top_k"),
    (dict(num_experts=256, world_size=256), "world_size"),
    (dict(num_experts=129 * 2, world_size=129), "world_size = 129.*at most 128 .*7 bits"),
    (dict(num_experts=2048, world_size=8), "num_experts.*at most 1024"),
    (dict(num_experts=1024, world_size=1), "1024 experts per rank.*at most 512"),
    (dict(max_tokens_per_rank=2**20 + 1), "max_tokens_per_rank"),
    (dict(hidden=100), "hidden"),
    (dict(intermediate=96), "intermediate"),
    (dict(max_recv_rows=0), "max_recv_rows"),
    (dict(wait_timeout_s=0), "wait_timeout_s"),
    (dict(wait_timeout_s=-1.0), "wait_timeout_s"),
    (dict(wait_timeout_s=float("nan")), "wait_timeout_s"),
    (dict(expert_dtype="fp16"), "expert_dtype"),
    (dict(expert_dtype="fp8"), "intermediate = 64.*fp8.*multiple of 128"),
    (dict(expert_dtype="fp8", intermediate=128, hidden=192), "hidden = 192.*fp8"),
])
def test_bad_config_names_the_field(changes, field):
    with pytest.raises(ConfigError, match=field) as caught:
        MoEConfig(**{**GOOD, **changes})
    print(caught.value)


def test_tile_message_says_why():
    with pytest.raises(ConfigError, match="multiple of 64.*tile"):
        MoEConfig(**{**GOOD, "hidden": 96})


@pytest.mark.parametrize("changes", [
    {},
    dict(world_size=1),
    dict(num_experts=16, top_k=16, world_size=8),
    dict(num_experts=32, top_k=4, world_size=16),  # two nodes of 8
    dict(num_experts=1024, top_k=8, world_size=128),  # what src_info names
    dict(num_experts=1024, world_size=8, max_tokens_per_rank=2**20),  # every limit at its bound
    dict(num_experts=512, world_size=1),
    dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048, max_tokens_per_rank=4096, world_size=8),  # dsv3
    dict(max_recv_rows=1, wait_timeout_s=1),
    dict(num_experts=np.int64(8), hidden=np.int32(7168)),
    dict(expert_dtype="fp8", hidden=7168, intermediate=2048),  # dsv3's FP8 experts
])
def test_good_configs_pass(changes):
    cfg = MoEConfig(**{**GOOD, **changes})
    assert MoEConfig(**cfg.to_dict()) == cfg
    assert all(type(v) in (int, float, str, type(None)) for v in cfg.to_dict().values())


def test_derived_sizes():
    cfg = MoEConfig(**GOOD)
    assert cfg.experts_per_rank == 4
    assert cfg.recv_rows_capacity == 16 * 2 * 2
    # With fewer local experts than top_k a token sends at most one row per local expert.
    assert MoEConfig(**{**GOOD, "top_k": 4, "world_size": 8}).recv_rows_capacity == 16 * 8
    assert MoEConfig(**{**GOOD, "max_recv_rows": 5}).recv_rows_capacity == 5


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MoEConfig(**GOOD).hidden = 256


class FakeComm:
    """Stands in for an mpi4py communicator whose ranks hold `configs`."""

    def __init__(self, configs):
        self.configs = configs

    def allgather(self, obj):
        assert obj in [c.to_dict() for c in self.configs]
        return [c.to_dict() for c in self.configs]

    def Get_size(self):
        return len(self.configs)


def test_agreement_passes():
    configs = [MoEConfig(**GOOD), MoEConfig(**GOOD)]
    for cfg in configs:
        check_agreement(cfg, FakeComm(configs))


def test_mismatch_is_named_identically_on_every_rank():
    configs = [MoEConfig(**{**GOOD, "hidden": 7168}), MoEConfig(**{**GOOD, "hidden": 4096})]
    messages = set()
    for cfg in configs:
        with pytest.raises(RankMismatchError) as caught:
            check_agreement(cfg, FakeComm(configs))
        messages.add(str(caught.value))
    assert messages == {"ranks disagree on MoEConfig: hidden: rank 0=7168, rank 1=4096"}


def test_every_mismatched_field_is_named():
    configs = [MoEConfig(**GOOD), MoEConfig(**{**GOOD, "top_k": 4, "wait_timeout_s": 5.0})]
    with pytest.raises(RankMismatchError) as caught:
        check_agreement(configs[0], FakeComm(configs))
    message = str(caught.value)
    assert "top_k: rank 0=2, rank 1=4" in message
    assert "wait_timeout_s: rank 0=30.0, rank 1=5.0" in message
    assert "hidden" not in message


def test_world_size_must_match_the_communicator():
    configs = [MoEConfig(**{**GOOD, "world_size": 4})] * 2
    with pytest.raises(RankMismatchError, match="world_size = 4.*2 ranks"):
        check_agreement(configs[0], FakeComm(configs))


def test_a_limit_wins_over_a_rank_count_mismatch():
    """MoEConfig refuses a config beyond the kernels' limits itself, so the limit is what a
    user hears about, not that the communicator has another number of ranks."""
    with pytest.raises(ConfigError, match="world_size = 129 .*at most 128") as caught:
        MoEConfig(**{**GOOD, "num_experts": 258, "world_size": 129})
    assert not isinstance(caught.value, RankMismatchError)
