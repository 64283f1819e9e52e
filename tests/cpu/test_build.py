"""The kernel build, on a machine with no GPU: every shipped variant compiles for sm_90a
through the same function the runtime uses; the cache is keyed by every included file."""

import importlib.util
import re
from pathlib import Path

import pytest

from epserve.errors import BuildError
from epserve.runtime import build, kernels
from epserve.runtime.kernel_structs import PEER_SEND_CONFIG

ROOT = Path(__file__).resolve().parents[2]


def _job(name: str):
    """launch/jobs/`name`.py as a module (its main is not run)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "launch" / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("name", sorted(kernels.VARIANTS))
def test_every_variant_compiles_for_sm90a(name, cache):
    source, defines = kernels.VARIANTS[name]
    art = build.compile_source(source, defines)
    assert art.cubin.stat().st_size > 0 and art.cubin.parent == cache
    assert ".target sm_90a" in art.ptx.read_text()
    assert "spill" in art.log  # ptxas -v resource report is kept beside the cubin
    assert not re.search(r"[1-9]\d* bytes spill stores", art.log), art.log


@pytest.mark.parametrize("base", ["gemm_fp8_null", "gemm_fp8_peer", "gemm1_fp8_swiglu"])
def test_fp8_experimental_builds_compile_without_spills_or_serialized_wgmmas(base, cache):
    """epserve.ffn.gemm_fp8.KNOBS, the builds time_gemm_fp8.py --variants times: each knob is
    one the FP8 GEMM reads, each build compiles with no spill and no C75xx warning (ptxas
    serializing the wgmmas), and none leaves a wgmma group in flight across a promotion.
    Before test_key_covers_defines_options_and_every_included_header on purpose: after NVRTC
    13.5 has compiled any program with -G, later compiles in the same process differ (the
    default gemm_fp8_peer then spills 36 bytes; in a fresh process, none)."""
    from epserve.ffn import gemm_fp8

    gpu_test = (ROOT / "tests" / "gpu" / "test_gemm_fp8.py").read_text()
    source, defines = kernels.VARIANTS[base]
    source_text = "".join(build.include_closure(source).values())  # the kernel and every header it reads
    for knob, knobs in gemm_fp8.KNOBS.items():
        for name in knobs:
            assert f"#ifndef {name}\n" in source_text, name
        gemm = "1" if base.startswith("gemm1") else "2"
        assert f'("{gemm}", "{knob}")' in gpu_test, \
            f"tests/gpu/test_gemm_fp8.py's FP8_KNOB_BUILDS lacks {base} + {knob}"
        art = build.compile_source(source, {**defines, **knobs})
        assert not re.search(r"[1-9]\d* bytes spill stores", art.log), (knob, art.log)
        assert "C75" not in art.log, (knob, art.log)
        ptx = art.ptx.read_text()
        assert "wgmma.wait_group.sync.aligned 1;" not in ptx, knob
    # the shipped build is one of the knobs' builds, so the GPU test's comparisons reach it
    assert {**defines, **gemm_fp8.KNOBS[gemm_fp8.SHIPPED[base]]} == defines, base


def test_sm_clock_probe_compiles(cache):
    """The benchmark's clock probe (epserve/bench/clock.py) builds, and counts SM cycles
    against the global timer."""
    from epserve.bench import clock

    ptx = build.compile_source(*kernels.VARIANTS[clock.VARIANT]).ptx.read_text()
    assert f".entry {clock.KERNEL}" in ptx and "%globaltimer" in ptx and "%clock64" in ptx


def test_fp8_consumer_loop_probe_compiles_at_every_level(cache):
    """launch/jobs/probe_fp8_consumer_loop.py's kernel (the FP8 GEMM's consumer loop alone)
    builds from the GEMM's own helpers at every level the job names, without spills or
    serialized wgmmas, and a level outside them is refused by the kernel."""
    probe = _job("probe_fp8_consumer_loop")
    assert sorted(probe.LEVELS) == list(range(11))
    for level in probe.LEVELS:
        art = build.compile_source(probe.SOURCE, {"EPSERVE_PROBE_LEVEL": level})
        assert not re.search(r"[1-9]\d* bytes spill stores", art.log), (level, art.log)
        assert "C75" not in art.log, (level, art.log)
        assert art.ptx.read_text().count("wgmma.mma_async") >= 4, level
    with pytest.raises(BuildError):
        build.compile_source(probe.SOURCE, {"EPSERVE_PROBE_LEVEL": 11})


def test_racecheck_handover_probe_compiles_for_every_protocol(cache):
    """launch/jobs/probe_racecheck_handover.py's kernel (the shipped tile mailbox with the
    orderings racecheck was asked about) builds for every protocol the job names, with the
    barriers each protocol promises, and refuses one past them; the bytes the job expects
    leave a tail's rows past 64 as poisoned."""
    probe = _job("probe_racecheck_handover")
    assert sorted(probe.PROTOCOLS) == list(range(8))
    for protocol in probe.PROTOCOLS:
        ptx = build.compile_source(probe.SOURCE, {"EPSERVE_PROBE_PROTOCOL": protocol}).ptx.read_text()
        assert f".entry {probe.KERNEL}" in ptx
        assert ("barrier.arrive 5, 256" in ptx) == (protocol == 5), protocol
        assert ("barrier.sync 6, 128" in ptx) == (protocol in (2, 4, 5, 7)), protocol
        assert ("mbarrier.try_wait" in ptx) == (protocol == 6), protocol
    with pytest.raises(BuildError):
        build.compile_source(probe.SOURCE, {"EPSERVE_PROBE_PROTOCOL": 8})
    full, tail = probe.expected(7, 2, 3), probe.expected(6, 2, 3)
    assert full.shape == tail.shape == (6, probe.OUT_BYTES)
    assert (tail[:, 64 * probe.ROW_BYTES : probe.ROWS * probe.ROW_BYTES] == probe.POISON).all()
    assert not (full[:, : probe.ROWS * probe.ROW_BYTES] == probe.POISON).all(axis=1).any()
    # the exchange's words change the values: a protocol that skipped the reads would be #wrong
    assert (probe.expected(6, 2, 3) != probe.expected(1, 2, 3)).any()
    # racecheck's summary line, as compute-sanitizer 2025.3 prints it
    summary = "========= RACECHECK SUMMARY: 4 hazards displayed (22128 errors, 0 warnings)"
    assert probe.racecheck_errors("x\n" + summary + "\n") == 22128
    assert probe.racecheck_errors("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)") == 0
    assert probe.racecheck_errors("no summary: the run died") is None


# The FP8 GEMM's diagnostic builds (cuda/gemm/grouped_gemm_fp8.cu, launch/jobs/probe_gemm_fp8.py):
# not shipped, so not in kernels.VARIANTS, but the next GPU run needs them to compile.
FP8_PROBE_KNOBS = [
    {"EPSERVE_GEMM_FP8_TMA_LOADS": 0, "EPSERVE_GEMM_FP8_MMA": 0},
    {"EPSERVE_GEMM_FP8_TMA_LOADS": 2, "EPSERVE_GEMM_FP8_MMA": 0, "EPSERVE_GEMM_FP8_CHECK_TMA": 1},
    {"EPSERVE_GEMM_FP8_TMA_LOADS": 0},
    {"EPSERVE_GEMM_FP8_CHECK_TMA": 1},
    {"EPSERVE_GEMM_FP8_UNALIGNED_SCALES": 1},
    {"EPSERVE_GEMM_FP8_RELEASE_BY_WARPGROUP": 1},  # the pre-fix stage release (launch/jobs/check_fp8_race.py)
    {"EPSERVE_GEMM_FP8_TRACE": 1},  # %clock64 stamps of each tile (launch/jobs/trace_gemm_fp8.py)
    {"EPSERVE_GEMM_FP8_TRACE": 2},  # and of each warpgroup's k-blocks 0-7 (trace_gemm_fp8.py --k-blocks)
]


@pytest.mark.parametrize("knobs", FP8_PROBE_KNOBS, ids=lambda k: "+".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("base", ["gemm_fp8_null", "gemm1_fp8_swiglu"])
def test_fp8_diagnostic_builds_compile(base, knobs, cache):
    """Before test_key_covers_defines_options_and_every_included_header on purpose, as the
    experimental builds' test above (after NVRTC has compiled a -G program, the no-load
    builds spill 16 bytes in the same process, none in a fresh one)."""
    source, defines = kernels.VARIANTS[base]
    art = build.compile_source(source, {**defines, **knobs})
    assert not re.search(r"[1-9]\d* bytes spill stores", art.log), art.log
    ptx = art.ptx.read_text()
    has_wgmma = "wgmma.mma_async" in ptx
    assert has_wgmma == (knobs.get("EPSERVE_GEMM_FP8_MMA", 1) != 0)
    assert ("cp.async.bulk.tensor" in ptx) == (knobs.get("EPSERVE_GEMM_FP8_TMA_LOADS", 7) != 0)


SPLIT_K = {"EPSERVE_GEMM_SPLIT_K": 2}


def kernel_params(ptx: str) -> int:
    return len(set(re.findall(r"\.param [^\n]*?epserve_grouped_gemm_wgmma_param_(\d+)", ptx)))


@pytest.mark.parametrize("base", ["gemm_wgmma_null", "gemm_wgmma_peer"])
def test_split_k_builds_compile_without_spills_or_serialized_wgmmas(base, cache):
    """GEMM 2 in two K halves (-DEPSERVE_GEMM_SPLIT_K=2, the gemm_wgmma_*_split variants):
    no spill, no C75xx warning (ptxas serialized every wgmma when the accumulators were
    stored or loaded 16 bytes at a time, C7514, or when the kernel called printf, C7510), the
    flag handshake at GPU scope, and four parameters more than the default build, whose
    argument list stays as it was. Before the -G test below, for the reason given above."""
    source, defines = kernels.VARIANTS[base]
    default = build.compile_source(source, defines).ptx.read_text()
    art = build.compile_source(source, {**defines, **SPLIT_K})
    assert not re.search(r"[1-9]\d* bytes spill stores", art.log), art.log
    assert "C75" not in art.log, art.log
    ptx = art.ptx.read_text()
    for op in ("st.release.gpu.global.u32", "ld.acquire.gpu.global.u32", "atom.acq_rel.gpu.global.add.s32",
               "st.global.v2.f32", "ld.global.cg.v2.f32"):
        assert op in ptx, op
        assert op not in default, op
    assert kernel_params(default) == 10 and kernel_params(ptx) == 14
    assert kernels.VARIANTS[base + "_split"] == (source, {**defines, **SPLIT_K})


OVERLAP_VARIANTS = ["gemm_wgmma_peer_overlap", "gemm_wgmma_peer_split_overlap"]


@pytest.mark.parametrize("name", OVERLAP_VARIANTS)
def test_overlap_builds_compile_without_spills_and_send_what_the_peer_build_sends(name, cache):
    """GEMM 2's overlap builds (across nodes, EPSERVE_OFFNODE_OVERLAP=1): no spill, no C75xx
    warning, the peer sink's send code, two parameters more than the build they extend (the
    tile order and its room), the order kernel beside the GEMM; the default builds have
    none of it (their SASS is unchanged: docs/design.md, "Across nodes"). Before the -G test
    below, for the reason given above."""
    source, defines = kernels.VARIANTS[name]
    assert defines["EPSERVE_SINK"] == "EpPeerSinkCountingOffNode" and defines["EPSERVE_GEMM_OFFNODE_FIRST"] == 1
    art = build.compile_source(source, defines)
    assert not re.search(r"[1-9]\d* bytes spill stores", art.log), art.log
    assert "C75" not in art.log, art.log
    ptx = art.ptx.read_text()
    for what, pattern in SEND_CODE.items():
        assert re.search(pattern, ptx), f"{name} lacks a {what}"
    assert config_param_uses(ptx)
    base = name.replace("_overlap", "")
    assert kernel_params(ptx) == kernel_params(variant_ptx(base)) + 2
    assert ".entry epserve_gemm_off_node_first_order(" in ptx
    assert "epserve_gemm_off_node_first_order" not in variant_ptx(base)


@pytest.mark.parametrize("base,knob", [("gemm1_wgmma_swiglu", {}),
                                       ("gemm_wgmma_null", {"EPSERVE_GEMM_CLUSTER": 2}),
                                       ("gemm_wgmma_null", {"EPSERVE_GEMM_SWAP_TAILS": 1}),
                                       ("gemm_wgmma_null", {"EPSERVE_GEMM_BN": 128})])
def test_split_k_is_refused_outside_gemm2_wide_tiles_on_single_ctas(base, knob, cache):
    source, defines = kernels.VARIANTS[base]
    with pytest.raises(BuildError, match="split K: GEMM 2's 128 x 256 tiles"):
        build.compile_source(source, {**defines, **knob, **SPLIT_K})


def test_time_gemm_variants_name_only_real_knobs():
    """A misspelt define would time the default kernel under a variant's name."""
    job = _job("time_gemm")
    source = (ROOT / "cuda" / kernels.WGMMA_GEMM_SOURCE).read_text()
    for base, knobs in job.VARIANTS.values():
        assert base in kernels.VARIANTS
        for name in knobs:
            assert f"#ifndef {name}\n" in source, name


def variants_with_sink(sink: str) -> list[str]:
    """The shipped GEMM variants built with `sink` ("null" or "peer"): the mma.sync and the
    wgmma kernel, and any other that takes a sink."""
    names = [n for n, (_, defines) in kernels.VARIANTS.items() if defines.get("EPSERVE_SINK") == kernels.SINKS[sink]]
    assert {f"gemm_{sink}", f"gemm_wgmma_{sink}"} <= set(names)
    return sorted(names)


def variant_ptx(name: str) -> str:
    source, defines = kernels.VARIANTS[name]
    return build.compile_source(source, defines).ptx.read_text()


def config_param_uses(ptx: str) -> list[str]:
    """PTX lines that read the PeerSendConfig parameter (a load, or taking its address)."""
    param = re.search(rf"\.param \.align 8 \.b8 (epserve_\w+_param_\d+)\[{PEER_SEND_CONFIG.itemsize}\]", ptx)
    assert param, "the GEMM takes PeerSendConfig by value in both builds"
    return [line for line in ptx.splitlines() if param.group(1) in line and ".param .align" not in line]


SEND_CODE = {
    "system-scope fence": r"fence\.(sc|acq_rel)\.sys|membar\.sys",
    "release atomic": r"red\.release\.sys|atom\.release\.sys",
    "acquire load": r"ld\.acquire\.sys",
    "generic 16-byte store (the store through a mapped peer pointer)": r"\bst\.v4\.u32",
}


@pytest.mark.parametrize("name", variants_with_sink("null"))
def test_null_sink_build_contains_no_peer_send_code(name, cache):
    ptx = variant_ptx(name)
    for what, pattern in SEND_CODE.items():
        assert not re.search(pattern, ptx), f"null-sink {name} has a {what}"
    # Stores through peer pointers need the peer pointers: the null build never reads them.
    assert not config_param_uses(ptx), f"null-sink {name} reads PeerSendConfig"


@pytest.mark.parametrize("name", variants_with_sink("peer"))
def test_peer_sink_build_contains_peer_send_code(name, cache):
    ptx = variant_ptx(name)
    for what, pattern in SEND_CODE.items():
        assert re.search(pattern, ptx), f"peer-sink {name} lacks a {what}"
    assert config_param_uses(ptx), f"peer-sink {name} never reads PeerSendConfig"


def test_cache_hit_returns_the_same_entry(cache):
    a = build.compile_source("ffn/swiglu.cu")
    mtime = a.cubin.stat().st_mtime_ns
    b = build.compile_source("ffn/swiglu.cu")
    assert a == b and b.cubin.stat().st_mtime_ns == mtime
    assert not list(cache.glob("*.tmp"))


def test_key_covers_defines_options_and_every_included_header(cache, tmp_path, monkeypatch):
    root = tmp_path / "cuda"
    (root / "inc").mkdir(parents=True)
    (root / "inc" / "deep.cuh").write_text("#pragma once\n#define DEEP 1\n")
    (root / "inc" / "mid.cuh").write_text('#pragma once\n#include "inc/deep.cuh"\n')
    (root / "k.cu").write_text('#include "inc/mid.cuh"\nextern "C" __global__ void k(int* x) { *x = DEEP + V; }\n')
    monkeypatch.setattr(build, "CUDA_ROOT", root)
    assert set(build.include_closure("k.cu")) == {"k.cu", "inc/mid.cuh", "inc/deep.cuh"}
    keys = {build.compile_source("k.cu", {"V": 1}).key}
    keys.add(build.compile_source("k.cu", {"V": 2}).key)
    keys.add(build.compile_source("k.cu", {"V": 2}, ("-G",)).key)
    (root / "inc" / "deep.cuh").write_text("#pragma once\n#define DEEP 2\n")  # two levels down
    keys.add(build.compile_source("k.cu", {"V": 2}, ("-G",)).key)
    assert len(keys) == 4


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert build.compile_source("ffn/swiglu.cu").cubin.parent == tmp_path / "elsewhere"


def test_compile_error_carries_the_log(cache, tmp_path, monkeypatch):
    (tmp_path / "bad.cu").write_text('extern "C" __global__ void k() { undefined_symbol_xyz(); }\n')
    monkeypatch.setattr(build, "CUDA_ROOT", tmp_path)
    with pytest.raises(BuildError, match="undefined_symbol_xyz"):
        build.compile_source("bad.cu")


def test_missing_include_is_named(cache, tmp_path, monkeypatch):
    (tmp_path / "k.cu").write_text('#include "nope/missing.cuh"\n')
    monkeypatch.setattr(build, "CUDA_ROOT", tmp_path)
    with pytest.raises(BuildError, match="nope/missing.cuh"):
        build.compile_source("k.cu")


def test_gemm_without_a_sink_define_is_refused(cache):
    with pytest.raises(BuildError, match="EPSERVE_SINK"):
        build.compile_source(kernels.GEMM_SOURCE, {})


def test_kernel_functions_are_looked_up_once_per_device(monkeypatch):
    """A launch must not pay for load_module, which re-reads and re-hashes every included
    file: that cost 0.7 ms of host time per fused combine before functions were cached."""
    import cupy

    loads = []

    class FakeModule:
        def get_function(self, name):
            return ("function", name)

    def fake_module(name):
        loads.append(name)
        return FakeModule()

    device = [0]
    monkeypatch.setattr(kernels, "module", fake_module)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: device[0])
    kernels._function.cache_clear()
    try:
        for _ in range(3):
            assert kernels.function("rows", "epserve_copy_rows") == ("function", "epserve_copy_rows")
        kernels.function("rows", "epserve_push_rows_to_peers")
        device[0] = 1  # another GPU loads its own copy
        kernels.function("rows", "epserve_copy_rows")
        assert loads == ["rows", "rows", "rows"]
    finally:
        kernels._function.cache_clear()


def test_fp8_probe_job_names_only_real_knobs():
    """A misspelt define would build the default kernel under a probe's name and prove nothing:
    every knob launch/jobs/probe_gemm_fp8.py sets is one the FP8 GEMM reads."""
    job = _job("probe_gemm_fp8")
    source = (ROOT / "cuda" / "gemm" / "grouped_gemm_fp8.cu").read_text()
    for knobs, _ in list(job.PROBES.values()) + [(k, None) for k in FP8_PROBE_KNOBS]:
        for name in knobs:
            assert f"#ifndef {name}\n" in source, name


def test_unread_defines_names_those_no_included_file_tests(tmp_path, monkeypatch):
    (tmp_path / "inc.cuh").write_text("#pragma once\n#ifndef DEEP_KNOB\n#define DEEP_KNOB 0\n#endif\n")
    (tmp_path / "k.cu").write_text('#include "inc.cuh"\n#if defined(TOP_FLAG)\n#endif\n')
    monkeypatch.setattr(build, "CUDA_ROOT", tmp_path)
    assert build.unread_defines("k.cu", ["DEEP_KNOB", "TOP_FLAG", "DEEP_KNOBS", "NOT_THERE"]) == ["DEEP_KNOBS",
                                                                                                  "NOT_THERE"]
