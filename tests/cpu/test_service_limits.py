"""Limits the kernels set beyond MoEConfig's own rules, checked before any GPU work."""

import pytest

from epserve.config import MoEConfig
from epserve.errors import ConfigError
from epserve.service import MAX_EXPERTS, MAX_LOCAL_EXPERTS, check_service_limits


def test_dsv3_fits():
    check_service_limits(MoEConfig(256, 8, 7168, 2048, 4096, world_size=8))


@pytest.mark.parametrize("config,message", [
    (MoEConfig(64, 2, 256, 128, 16, world_size=16), "at most 8 GPUs"),
    (MoEConfig(2 * MAX_LOCAL_EXPERTS, 2, 256, 128, 16, world_size=1), "schedules at most"),
    (MoEConfig(2 * MAX_EXPERTS, 2, 256, 128, 16, world_size=4), "counts at most"),
])
def test_beyond_the_kernels_limits(config, message):
    with pytest.raises(ConfigError, match=message):
        check_service_limits(config)


def test_python_limit_matches_the_cuda_define():
    import re

    from epserve.build import CUDA_ROOT

    text = (CUDA_ROOT / "common" / "types.cuh").read_text()
    assert int(re.search(r"#define EPSERVE_MAX_LOCAL_EXPERTS (\d+)", text).group(1)) == MAX_LOCAL_EXPERTS
