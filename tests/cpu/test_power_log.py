"""epserve.bench.power (nvidia-smi sampled while a benchmark runs) and the block timing of
launch/jobs/time_gemm_sustained.py, on a machine with no GPU: nvidia-smi's lines are parsed
(unsupported fields, truncated lines), a stand-in nvidia-smi on PATH is sampled and stopped,
samples are attributed to time spans, and the job's block order, settled median and #wrong
count are what its table says."""

import importlib.util
import os
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from epserve.bench import power

JOBS = Path(__file__).resolve().parents[2] / "launch" / "jobs"
CAPPED = "2026/12/02 00:31:12.345, 688.53, 1410, 52, Active, Not Active, Not Active, Not Active"


def test_a_capped_sample_parses():
    s = power.parse_line(CAPPED)
    assert (s.watts, s.sm_mhz, s.celsius, s.power_capped, s.thermal) == (688.53, 1410.0, 52.0, True, False)
    assert s.t == pytest.approx(power.datetime(2026, 12, 2, 0, 31, 12, 345000).timestamp())


def test_unsupported_fields_and_stray_lines():
    s = power.parse_line("2026/12/02 00:31:12.445, [N/A], 1980, [N/A], Not Active, Not Active, Active, Not Active")
    assert s.watts is None and s.celsius is None and s.sm_mhz == 1980.0
    assert not s.power_capped and s.thermal
    assert power.parse_line("2026/12/02 00:31:12.5, 688.5") is None  # cut off when the log was stopped
    assert power.parse_line("Failed to initialize NVML: Driver/library version mismatch") is None
    assert power.parse_line("not a time, 1, 2, 3, Active, Active, Active, Active") is None


def test_summary_medians_and_shares():
    lines = [CAPPED, CAPPED.replace("688.53", "600").replace("1410", "1500").replace("Active,", "Not Active,", 1),
             CAPPED.replace("688.53", "700").replace("1410", "1300")]
    stats = power.summary([power.parse_line(x) for x in lines])
    assert stats["samples"] == 3 and stats["watts"] == 688.53 and stats["sm_mhz"] == 1410.0
    assert stats["power_capped"] == pytest.approx(2 / 3) and stats["thermal"] == 0
    assert power.describe(stats) == "689 W, 1410 MHz, capped 67% (3)"
    empty = power.summary([])
    assert empty["samples"] == 0 and empty["watts"] is None and power.describe(empty) == "no samples"


def test_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "")
    with power.PowerLog("0") as log:
        pass
    assert log.unavailable == "nvidia-smi is not on PATH" and log.samples == []
    assert power.power_limit("0") is None


def fake_nvidia_smi(directory: Path, body: str) -> None:
    exe = directory / "nvidia-smi"
    exe.write_text(f"#!{sys.executable}\n{body}")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("knows_instant", [True, False], ids=["instant-power", "averaged-power-only"])
def test_a_stand_in_nvidia_smi_is_sampled_and_stopped(tmp_path, monkeypatch, knows_instant):
    # writes down its arguments, answers one-field queries (refusing power.draw.instant as an
    # older driver does, or not), prints three samples, then loops as nvidia-smi --loop-ms does
    fake_nvidia_smi(tmp_path, f"""import sys, time
open({str(tmp_path / "args")!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
if "--query-gpu=enforced.power.limit" in sys.argv:
    print("700.00"); sys.exit()
if "--query-gpu=power.draw.instant" in sys.argv:
    if {knows_instant!r}:
        print("512.25"); sys.exit()
    print('Field "power.draw.instant" is not a valid field to query.'); sys.exit(2)
for i, w in enumerate((650, 690, 700)):
    print("2026/12/02 00:31:12.%d00, %d, 1400, 50, Active, Not Active, Not Active, Not Active" % (i, w))
sys.stdout.flush()
open({str(tmp_path / "ready")!r}, "w").close()
time.sleep(60)
""")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert power.power_limit("00000000:19:00.0") == 700.0
    with power.PowerLog("00000000:19:00.0", period_ms=20) as log:
        deadline = time.time() + 30  # the stand-in prints at once; the log reads it when it closes
        while not (tmp_path / "ready").exists() and time.time() < deadline:
            time.sleep(0.05)
    assert log._proc.returncode is not None, "the sampler must be stopped when the log closes"
    field = "power.draw.instant" if knows_instant else "power.draw"
    assert log.power_field == field
    calls = (tmp_path / "args").read_text().splitlines()
    one_field = "-i 00000000:19:00.0 --query-gpu={} --format=csv,noheader,nounits"
    assert calls[:2] == [one_field.format("enforced.power.limit"), one_field.format("power.draw.instant")]
    assert calls[2] == one_field.format(",".join(power.fields(field))) + " --loop-ms=20"
    assert log.unavailable is None
    assert [s.watts for s in log.samples] == [650.0, 690.0, 700.0]
    t0 = log.samples[0].t
    assert [s.watts for s in log.samples_between(t0 + 0.05, t0 + 0.15)] == [690.0]


def test_a_stand_in_that_prints_only_an_error(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, 'print("No devices were found")\n')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with power.PowerLog("0") as log:
        time.sleep(1.0)
    assert log.samples == [] and log.unavailable == "nvidia-smi gave no samples: No devices were found"


@pytest.fixture(scope="module")
def job():
    sys.path.insert(0, str(JOBS))  # the job imports launch/jobs/time_gemm.py by name
    try:
        spec = importlib.util.spec_from_file_location("time_gemm_sustained", JOBS / "time_gemm_sustained.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(JOBS))


def test_blocks_alternate_and_settle(job):
    names = ["shipped", "knob a", "knob b"]
    assert [job.block_order(names, r) for r in range(3)] == [names, names[::-1], names]
    # the first third is the clock settling: left out
    assert job.settled_ms([9.0, 9.0, 9.0, 1.0, 2.0, 3.0, 2.0, 2.0, 2.0]) == 2.0


def test_wrong_counts_differing_elements(job):
    ref = np.arange(12, dtype=np.uint16).reshape(3, 4)
    out = ref.copy()
    assert job.wrong((out,), (ref,)) == 0
    out[1, 2] ^= 0x8000  # -0 against +0 and the like: any bit
    out[2, 0] += 1
    assert job.wrong((out,), (ref,)) == 2
    codes, scales = np.zeros((2, 6), np.uint8), np.ones((2, 3), np.float32)
    codes2, scales2 = codes.copy(), scales.copy()
    codes2[0, 1] = 0x7F  # one e4m3 code: one element, not a pair of bytes
    scales2[1, 2] = np.nextafter(np.float32(1), np.float32(2))
    assert job.wrong((out, codes2, scales2), (ref, codes, scales)) == 4
