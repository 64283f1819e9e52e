"""launch/jobs/ab_gemm_fp8.py's ad hoc builds: a spec names its defines, and a define the FP8
GEMM does not read is refused (it would time the shipped build under another name)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "launch" / "jobs"


@pytest.fixture(scope="module")
def job():
    sys.path.insert(0, str(JOBS))  # the job imports its sibling jobs by name
    try:
        spec = importlib.util.spec_from_file_location("ab_gemm_fp8", JOBS / "ab_gemm_fp8.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(JOBS))


def test_a_build_spec_names_its_defines(job):
    assert job.parse_build("noB:EPSERVE_GEMM_FP8_TMA_LOADS=3") == ("noB", {"EPSERVE_GEMM_FP8_TMA_LOADS": 3})
    assert job.parse_build("x:EPSERVE_GEMM_FP8_MMA=0,EPSERVE_GROUP_N=8") == (
        "x", {"EPSERVE_GEMM_FP8_MMA": 0, "EPSERVE_GROUP_N": 8})


@pytest.mark.parametrize("spec", ["noB", "noB:", ":EPSERVE_GEMM_FP8_MMA=0", "x:EPSERVE_GEMM_FP8_MMA",
                                  "x:MMA=0", "x:EPSERVE_GEMM_FP8_MMA=zero"])
def test_malformed_specs_are_refused(job, spec):
    with pytest.raises(ValueError):
        job.parse_build(spec)


def test_only_the_gemms_own_defines_pass(job):
    job.check_defines({"EPSERVE_GEMM_FP8_TMA_LOADS": 3, "EPSERVE_GEMM_FP8_TRACE": 1, "EPSERVE_GROUP_N": 8})
    with pytest.raises(ValueError, match="EPSERVE_GEMM_FP8_TMA_LOAD "):
        job.check_defines({"EPSERVE_GEMM_FP8_TMA_LOAD": 3})


def test_the_layer_launches_the_build_epserve_gemm_fp8_build_names(monkeypatch):
    """$EPSERVE_GEMM_FP8_BUILD swaps the layer's FP8 GEMMs for a KNOBS build (registered once),
    the bulk send warps' builds too (own-bulk is the default sink), and refuses a name KNOBS
    does not have."""
    from epserve.errors import ConfigError
    from epserve.ffn import gemm_fp8
    from epserve.runtime import kernels

    monkeypatch.setattr(kernels, "VARIANTS", dict(kernels.VARIANTS))
    monkeypatch.delenv("EPSERVE_GEMM_FP8_BUILD", raising=False)
    assert gemm_fp8.build_variant("gemm_fp8_peer") == "gemm_fp8_peer"
    monkeypatch.setenv("EPSERVE_GEMM_FP8_BUILD", "split-unpublished")
    for base in ("gemm_fp8_peer", "gemm_fp8_peer_ownbulk", "gemm_fp8_peer_bulk", "gemm_fp8_null", "gemm1_fp8_swiglu"):
        name = gemm_fp8.build_variant(base)
        assert name == f"{base}+split-unpublished"
        assert kernels.VARIANTS[name][1] == {**kernels.VARIANTS[base][1], **gemm_fp8.KNOBS["split-unpublished"]}
        assert gemm_fp8.build_variant(base) == name
    monkeypatch.setenv("EPSERVE_GEMM_FP8_BUILD", "no-such-build")
    with pytest.raises(ConfigError, match="EPSERVE_GEMM_FP8_BUILD"):
        gemm_fp8.build_variant("gemm_fp8_peer")


def test_the_code_column_tells_identical_builds_from_different_ones(job, monkeypatch, tmp_path):
    """A --build whose defines change nothing shows the shipped build's digest on every
    problem, a real knob another one: the rows of a build with the shipped code differ from
    the shipped rows by noise alone (notes/gemm.md, thirty-eighth session)."""
    from epserve.ffn import gemm_fp8
    from epserve.runtime import kernels

    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "VARIANTS", dict(kernels.VARIANTS))
    monkeypatch.setitem(gemm_fp8.KNOBS, "same", {"EPSERVE_GEMM_FP8_SPLIT_TAILS": 1})  # on in every shipped build
    for problem, base in list(job.PROBLEM_BASES.items()) + [("dense8192", "gemm_fp8_null")]:
        for knob in ("same", "split-unpublished"):
            gemm_fp8.register_knob(base, knob)
        shipped = job.code_digest(problem, job.SHIPPED)
        assert job.code_digest(problem, "FP8, same") == shipped, problem
        assert job.code_digest(problem, "FP8, split-unpublished") != shipped, problem
