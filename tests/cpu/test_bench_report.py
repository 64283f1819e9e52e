"""The nccl-tests-style preamble and table, and the JSON round trip, on synthetic timings."""

import json

import numpy as np
import pytest

from epserve.bench import arithmetic as ar
from epserve.bench import presets as ps
from epserve.bench import report
from epserve.bench.results import Row, Run, measured_row, with_baselines
from epserve.bench.timing import slowest_rank

PRESET = ps.scaled(ps.get_preset("dsv3-prefill"), tokens_per_rank=64, hidden=256, intermediate=128,
                   num_experts=8, top_k=2)
RATES = ar.Rates(gemm_flop_s=400e12, copy_bytes_s=3.5e12, peer_bytes_s=350e9)


def synthetic_rows():
    routing = ps.balanced()
    topk = routing.draw(PRESET, world_size=2, seed=0)
    counts = ar.count_routing(topk, PRESET.num_experts)
    work = ar.gemm2_combine_work(counts, PRESET.hidden, PRESET.intermediate)
    per_rank = [{"unfused": [3.0, 3.1, 2.9], "fused": [1.5, 1.4, 1.6]},
                {"unfused": [3.2, 3.3, 3.4], "fused": [1.0, 1.1, 1.2]}]
    slowest = slowest_rank(per_rank)
    clocks = {"unfused": [1410.4, 1395.0], "fused": [1502.6, None]}  # by rank; rank 1 read no clock for fused
    during = {"unfused": [1301.0, 1288.5], "fused": [1350.2, None]}
    rows = [measured_row(PRESET, routing, path, slowest[path], work, RATES,
                         per_rank_ms=[r[path] for r in per_rank], wrong=0 if path == "fused" else None,
                         host_waits=0 if path == "fused" else 1, mpi_calls=0 if path == "fused" else 2,
                         per_rank_mhz=clocks[path], per_rank_mhz_during=during[path])
            for path in ("unfused", "fused")]
    rows.append(Row(PRESET, routing, "deepep"))  # not installed here: n/a
    return with_baselines(rows, unfused_path="unfused", library_path="deepep"), work


def test_rows_from_measurements():
    (unfused, fused, deepep), work = synthetic_rows()
    assert unfused.rank == 1 and unfused.timing.median_ms == 3.3
    assert fused.rank == 0 and fused.timing.median_ms == 1.5
    assert fused.unfused_ms == 3.3 and fused.library_ms is None
    assert fused.speedup_vs_unfused == pytest.approx(2.2)
    assert unfused.speedup_vs_unfused == 1.0
    assert fused.speedup_vs_library is None
    assert fused.nvlink_bytes == work.nvlink.busiest > 0
    assert fused.floor == work.floor(RATES)
    assert fused.x_floor == pytest.approx(1.5e-3 / work.floor(RATES).seconds)
    assert fused.tflop_s == pytest.approx(work.flops_per_gpu / 1.5e-3 / 1e12)
    assert fused.nvlink_gb_s == pytest.approx(work.nvlink.busiest / 1.5e-3 / 1e9)
    assert deepep.timing is None and deepep.speedup_vs_unfused is None and deepep.x_floor is None
    # each row keeps the clock of the rank it reports
    assert unfused.sm_mhz == 1395.0 and fused.sm_mhz == 1502.6 and deepep.sm_mhz is None
    assert unfused.sm_mhz_during == 1288.5 and fused.sm_mhz_during == 1350.2 and deepep.sm_mhz_during is None


def test_each_family_of_paths_compares_with_its_own_baselines():
    """A whole layer against the whole unfused and library layers, a dispatch against the
    NCCL dispatch and the bare all-to-all: never a layer against one GEMM's row."""
    from epserve.bench import measure

    routing = ps.balanced()
    counts = ar.count_routing(routing.draw(PRESET, world_size=2, seed=0), PRESET.num_experts)
    work = ar.gemm2_combine_work(counts, PRESET.hidden, PRESET.intermediate)
    times = {"unfused": 3.0, "library": 4.0, "fused": 1.5, "dispatch-nccl": 2.0, "alltoall": 0.5,
             "dispatch-direct": 0.25, "layer-unfused": 9.0, "layer-library": 12.0, "layer-fused": 6.0}
    per_rank = [{p: [t] for p, t in times.items()}] * 2
    slowest = slowest_rank(per_rank)
    rows = [measured_row(PRESET, routing, p, slowest[p], work, RATES) for p in times]
    rows.append(Row(PRESET, routing, "gemm1"))
    got = {r.path: r for r in with_baselines(rows, measure.UNFUSED, measure.LIBRARY)}
    assert got["layer-fused"].speedup_vs_unfused == pytest.approx(1.5)
    assert got["layer-fused"].speedup_vs_library == pytest.approx(2.0)
    assert got["dispatch-direct"].speedup_vs_unfused == pytest.approx(8.0)
    assert got["dispatch-direct"].speedup_vs_library == pytest.approx(2.0)
    assert got["fused"].speedup_vs_unfused == pytest.approx(2.0)
    assert got["fused"].speedup_vs_library == pytest.approx(4.0 / 1.5)
    assert got["gemm1"].unfused_ms is None and got["gemm1"].library_ms is None
    from epserve.bench import measure_fp8  # every path of either dtype has its family's baselines, and no other
    assert set(measure.BASELINES) == set(measure.PATHS) | set(measure_fp8.PATHS)


def test_table_layout():
    rows, work = synthetic_rows()
    names, units, *data = report.table(rows)
    assert names.startswith("# ") and units.startswith("# ")
    for column in ("preset", "routing", "tokens/rank", "path", "time", "spread", "TFLOP/s", "SM clock",
                   "NVLink", "floor", "x floor", "speed-up", "host", "MPI", "#wrong"):
        assert column in names
    for unit in ("(us, median)", "(p10-p90 us)", "(MHz, during)", "(MHz, after)", "(GB)", "(GB/s)", "(us)", "(vs unfused)",
                 "(vs library)", "(waits/call)", "(calls/call)"):
        assert unit in units
    assert names.endswith("#wrong")
    assert len(data) == 3

    unfused, fused, deepep = (line.split() for line in data)
    assert unfused[:4] == ["dsv3-prefill/scaled", "balanced", "64", "unfused"]
    assert fused[3:6] == ["fused", "1500", "1420-1580"]       # us; p10-p90 of 1.4, 1.5, 1.6 ms
    assert fused[-5:] == ["2.20", "-", "0", "0", "0"]         # vs unfused, vs library, host waits, MPI, #wrong
    assert unfused[-3:] == ["1", "2", "-"]                    # counted waits and MPI calls; no #wrong reference
    assert fused[7:9] == ["1350", "1503"] and unfused[7:9] == ["1288", "1395"]  # the reported rank's clock, MHz
    assert fused[9] == f"{work.nvlink.busiest / 1e9:#.4g}"
    assert deepep[:4] == ["dsv3-prefill/scaled", "balanced", "64", "deepep"]
    assert deepep[4:] == ["n/a"] * 14

    # Right-aligned numbers: every line's #wrong cell ends where the header's does.
    assert {len(line) for line in [names] + data} == {len(names)}


def test_preamble():
    info = report.base_info(RATES, argv=["bench.py", "--preset", "dsv3 prefill"])
    info.update(gpus=["NVIDIA H200", "NVIDIA H200"], driver="580.1", cuda="13.0", nccl="2.27.3",
                cupy="14.2.0", world_size=2, iterations=20)
    lines = report.preamble(info)
    assert all(line.startswith("#") for line in lines)
    text = "\n".join(lines)
    assert "# command: bench.py --preset 'dsv3 prefill'" in text
    assert "epserve 0.1.0" in text and "CuPy 14.2.0" in text and "NCCL 2.27.3" in text
    assert "CUDA 13.0" in text and "driver 580.1" in text
    assert "# GPU 0: NVIDIA H200" in text and "# GPU 1: NVIDIA H200" in text
    assert "GEMM 400.0 TFLOP/s, HBM copy 3500 GB/s, NVLink peer store 350.0 GB/s per direction" in text
    assert "# iterations: 20" in text and "# python: " in text


def test_preamble_gives_the_dense_fp8_limit_with_its_clocks():
    info = report.base_info(RATES, argv=["bench.py"])
    info["fp8_dense"] = {"ours": {"tflop_s": 1148.04, "sm_mhz": [1440.2, 1425.0]},
                         "cuBLASLt": {"tflop_s": 1127.0, "sm_mhz": [None, None]}}
    text = "\n".join(report.preamble(info))
    assert ("# FP8 dense GEMM limit, 8192^3 with 1 x 128 and 128 x 128 scales, slowest rank: "
            "ours 1148.0 TFLOP/s at 1440/1425 MHz, cuBLASLt 1127.0 TFLOP/s") in text
    assert "fp8_dense:" not in text


def test_preamble_without_a_link_says_so():
    info = report.base_info(RATES, argv=["bench.py"])
    info.update(world_size=1, link=False)
    text = "\n".join(report.preamble(info))
    assert "NVLink peer store" not in text and "no link (one rank" in text
    assert "# link:" not in text


def test_preamble_says_what_was_not_recorded():
    text = "\n".join(report.preamble({}))
    assert "# measured limits: not recorded" in text
    assert "# GPUs: not recorded" in text
    assert "NCCL not recorded" in text


def test_json_round_trip(tmp_path):
    rows, _ = synthetic_rows()
    info = report.base_info(RATES, argv=["bench.py"])
    info["gpus"] = ["NVIDIA H200"]
    run = Run(info, rows)
    path = tmp_path / "run.json"
    report.write_json(path, run)

    document = json.loads(path.read_text())
    assert document["schema"] == 1
    fused = document["rows"][1]
    assert fused["timing"]["samples_ms"] == [1.5, 1.4, 1.6]
    assert fused["per_rank_ms"] == [[1.5, 1.4, 1.6], [1.0, 1.1, 1.2]]
    assert fused["derived"]["speedup_vs_unfused"] == pytest.approx(2.2)
    assert fused["sm_mhz"] == 1502.6 and fused["sm_mhz_during"] == 1350.2
    assert fused["floor"]["binding"] in ar.BINDING_TERMS
    assert document["info"]["limits"] == {"gemm_flop_s": 400e12, "copy_bytes_s": 3.5e12, "peer_bytes_s": 350e9}

    back = report.read_json(path)
    assert back == run
    assert report.table(back.rows) == report.table(run.rows)


def test_read_json_refuses_other_schemas(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": 2, "info": {}, "rows": []}))
    with pytest.raises(ValueError, match="schema 2"):
        report.read_json(path)


def test_json_refuses_nan(tmp_path):
    run = Run({"limits_note": np.nan}, [])
    with pytest.raises(ValueError):
        report.write_json(tmp_path / "nan.json", run)
    assert not (tmp_path / "nan.json").exists()
