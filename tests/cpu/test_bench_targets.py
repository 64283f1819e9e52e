"""epserve.bench.targets on a machine with no GPU: issue 16's targets read off the committed
two-H200 bench (results/h200x2, seventh session) give that run's known numbers and verdicts;
a target whose rows are missing is "not measured", a row with #wrong > 0 meets nothing, a run
on another world size says so, an unreadable file is a one-line error, and the FP8 dispatch of
packed tokens (DeepEP's terms) is printed beside the targets, never judged as one of them."""

import copy
import json
from pathlib import Path

import pytest

from epserve.bench import report, targets
from epserve.bench.results import Run, row_from_dict

ROOT = Path(__file__).resolve().parents[2]
TWO_H200 = ROOT / "results" / "h200x2" / "bench.json"


def run_from(document: dict) -> Run:
    return Run(document["info"], [row_from_dict(r) for r in document["rows"]])


@pytest.fixture
def document():
    return json.loads(TWO_H200.read_text())


def verdicts(run):
    return {v.target.name: v for v in (targets.judge(run, t) for t in targets.ISSUE_16)}


def test_the_seventh_sessions_two_gpu_run(document):
    v = verdicts(run_from(document))
    assert v["GEMM 1 (FP8, SwiGLU, quantize)"].value == pytest.approx(894, abs=1)
    assert v["GEMM 2 (FP8)"].value == pytest.approx(826, abs=1)
    assert v["prefill layer, fused"].value == pytest.approx(4.045, abs=1e-3)
    assert v["decode layer, fused"].value == pytest.approx(1.472, abs=1e-3)
    assert v["FP8/bf16 dispatch, public call"].value == pytest.approx(251 / 342, abs=2e-3)
    # that run predates the dispatch-layer rows
    assert v["FP8/bf16 dispatch, in the layer"].value is None
    assert v["FP8/bf16 dispatch, in the layer"].note == "not measured"
    assert [name for name, x in v.items() if x.met] == ["decode layer, fused"]
    text = "\n".join(targets.lines(run_from(document)))
    assert "not that machine" not in text
    assert "  decode layer, fused             dsv3-decode-fp8       128       1.472         <= 1.6 ms  met" in text


def with_rows(document, preset: str, path: str, new_path: str, scale: float) -> None:
    """A copy of each of preset's `path` rows as `new_path`, its samples scaled."""
    for r in [r for r in document["rows"] if r["preset"]["name"] == preset and r["path"] == path]:
        new = copy.deepcopy(r)
        new["path"] = new_path
        if new["timing"] is not None:
            new["timing"]["samples_ms"] = [s * scale for s in new["timing"]["samples_ms"]]
        document["rows"].append(new)


def test_the_packed_dispatch_is_read_beside_the_targets(document):
    """The committed run predates the dispatch-layer and dispatch-packed rows: no line. With
    them, one line gives packed FP8 over the bf16 dispatch in the layer, and the targets'
    verdicts do not move."""
    assert not any("beside the targets" in line for line in targets.lines(run_from(document)))
    before = {name: (v.value, v.met) for name, v in verdicts(run_from(document)).items()}
    with_rows(document, "dsv3-prefill", "dispatch-direct", "dispatch-layer", 0.5)  # bf16 in the layer
    with_rows(document, "dsv3-prefill-fp8", "dispatch-direct", "dispatch-packed", 0.25)
    run = run_from(document)
    beside = [line for line in targets.lines(run) if "beside the targets" in line]
    ratio = 0.25 * 251 / (0.5 * 342)
    assert len(beside) == 1 and beside[0].endswith(
        f"FP8/bf16 dispatch, tokens packed, dsv3-prefill-fp8 dispatch-packed / dsv3-prefill dispatch-layer at 4096 "
        f"tokens = {ratio:.3f}"), beside
    after = verdicts(run)
    assert after["FP8/bf16 dispatch, in the layer"].value is None  # no FP8 dispatch-layer row: still not measured
    assert {name: (v.value, v.met) for name, v in after.items() if "in the layer" not in name} == \
        {name: x for name, x in before.items() if "in the layer" not in name}
    for r in document["rows"]:
        if r["path"] == "dispatch-packed":
            r["wrong"] = 5
    assert "#wrong 5" in next(line for line in targets.lines(run_from(document)) if "beside the targets" in line)


def test_missing_rows_are_not_measured(document):
    document["rows"] = [r for r in document["rows"] if r["preset"]["name"] != "dsv3-prefill"]
    v = verdicts(run_from(document))["FP8/bf16 dispatch, public call"]
    assert v.value is None and not v.met and "dsv3-prefill dispatch-direct" in v.note
    document["rows"] = [r for r in document["rows"] if r["preset"]["tokens_per_rank"] != 128]
    lines = targets.lines(run_from(document))
    assert any(line.strip().startswith("decode layer, fused") and line.endswith("not measured") for line in lines)


def test_a_wrong_row_meets_nothing(document):
    for r in document["rows"]:
        if r["preset"]["name"] == "dsv3-decode-fp8" and r["path"] == "layer-fused":
            r["wrong"] = 3
    v = verdicts(run_from(document))["decode layer, fused"]
    assert not v.met and v.value == pytest.approx(1.472, abs=1e-3) and "#wrong 3" in v.note


def test_a_target_met_by_a_faster_row(document):
    for r in document["rows"]:
        if r["preset"]["name"] == "dsv3-prefill-fp8" and r["path"] == "gemm2":
            r["timing"]["samples_ms"] = [s / 2 for s in r["timing"]["samples_ms"]]
    assert verdicts(run_from(document))["GEMM 2 (FP8)"].met


def test_another_world_size_is_named(document):
    document["info"]["world_size"], document["info"]["gpus"] = 1, ["NVIDIA H200"]
    assert "# the targets are stated for two GPUs, one rank each: this run is not that machine" in \
        targets.lines(run_from(document))


def test_the_clocks_are_given_where_the_run_read_them(document):
    """The committed run predates the clock: no clock line. With the rows' clocks and the
    dense limit's, one line gives both GEMM rows' clocks and the limit's."""
    assert not any("SM clock" in line for line in targets.lines(run_from(document)))
    for r in document["rows"]:
        if r["preset"]["name"] == "dsv3-prefill-fp8" and r["path"] in ("gemm1", "gemm2"):
            r["sm_mhz"] = {"gemm1": 1290.4, "gemm2": 1350.0}[r["path"]]
            if r["path"] == "gemm1":  # the clock during the row: read by runs since the twenty-ninth session
                r["sm_mhz_during"] = 1201.6
    document["info"]["fp8_dense"] = {"cuBLASLt": {"tflop_s": 1127.0, "sm_mhz": [1440.0, 1425.0]}}
    run = run_from(document)
    assert verdicts(run)["GEMM 1 (FP8, SwiGLU, quantize)"].sm_mhz == 1290.4
    assert targets.lines(run)[-1] == ("# SM clock during one more call of each row's path and right after its "
                                      "timing: GEMM 1 (FP8, SwiGLU, quantize) 1202 MHz during, 1290 MHz after; "
                                      "GEMM 2 (FP8) 1350 MHz after; the dense FP8 GEMM limit (clock after): "
                                      "cuBLASLt 1127.0 TFLOP/s at 1440/1425 MHz")


def test_the_command(tmp_path, capsys, document):
    assert targets.main([str(TWO_H200)]) == 0
    assert "FP8/bf16 dispatch, public call" in capsys.readouterr().out
    assert targets.main([str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err
    document["schema"] = 99
    (tmp_path / "old.json").write_text(json.dumps(document))
    assert targets.main([str(tmp_path / "old.json")]) == 2
    assert "schema 99" in capsys.readouterr().err
    assert report.read_json(TWO_H200).info["world_size"] == 2


def as_stand_in(document: dict, ranks: int = 2, **changes) -> dict:
    """The document's rows as `--as-rank-of ranks` names and shapes them (PRESET/scaled, 1/ranks
    of the experts), with `changes` to the shape on top."""
    for r in document["rows"]:
        p = r["preset"]
        p.update(name=p["name"] + "/scaled", num_experts=p["num_experts"] // ranks, **changes)
    document["info"]["world_size"], document["info"]["gpus"] = 1, ["NVIDIA H200"]
    return document


def test_a_one_gpu_stand_in_for_a_rank_is_read_and_named(document):
    """A run of `--as-rank-of 2` (one GPU, each preset with half its experts, named
    PRESET/scaled) is read for the presets' targets, each verdict and a header line saying
    that it is a stand-in whose layer and dispatch rows crossed no link."""
    v = verdicts(run_from(as_stand_in(document)))
    assert v["GEMM 2 (FP8)"].value == pytest.approx(826, abs=1) and v["GEMM 2 (FP8)"].stand_in == 2
    assert v["decode layer, fused"].met and v["decode layer, fused"].stand_in == 2
    lines = targets.lines(run_from(as_stand_in(json.loads(TWO_H200.read_text()))))
    assert any(line.startswith("# rows of one GPU standing in for a rank of 2 (--as-rank-of 2") for line in lines)
    assert any(line.startswith("  decode layer, fused") and line.endswith("met (stand-in for a rank of 2)")
               for line in lines)


def test_a_preset_shrunk_otherwise_is_not_read(document):
    """--quick shrinks the presets' other dimensions too: such rows stand for nothing."""
    v = verdicts(run_from(as_stand_in(document, hidden=256)))
    assert all(x.value is None and not x.met for x in v.values())
    assert targets.rank_of(targets.presets.get_preset("dsv3-prefill-fp8"), "dsv3-prefill-fp8") == 1
    assert targets.rank_of(targets.presets.get_preset("dsv3-prefill"), "dsv3-prefill-fp8") is None


def test_the_preset_itself_before_a_stand_in(document):
    both = document
    stand_in = as_stand_in(json.loads(TWO_H200.read_text()))
    for r in stand_in["rows"]:
        r["timing"]["samples_ms"] = [s / 2 for s in r["timing"]["samples_ms"]]
    both["rows"] += stand_in["rows"]
    v = verdicts(run_from(both))["prefill layer, fused"]
    assert v.stand_in is None and v.value == pytest.approx(4.045, abs=1e-3)


def test_runs_of_one_machine_are_read_together(tmp_path, capsys, document):
    """A prefill run and a decode run, each written on its own, read as one: the same lines as
    the committed run that holds both. Runs of other machines are refused, naming the file."""
    decode = dict(document, rows=[r for r in document["rows"] if r["preset"]["tokens_per_rank"] <= 128])
    prefill = dict(document, rows=[r for r in document["rows"] if r["preset"]["tokens_per_rank"] > 128])
    assert decode["rows"] and prefill["rows"]
    (tmp_path / "prefill.json").write_text(json.dumps(prefill))
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    assert targets.main([str(tmp_path / "prefill.json"), str(tmp_path / "decode.json")]) == 0
    together = capsys.readouterr().out
    assert targets.main([str(TWO_H200)]) == 0
    assert together == capsys.readouterr().out
    assert targets.main([str(tmp_path / "prefill.json")]) == 0
    alone = capsys.readouterr().out
    assert any(line.startswith("  decode layer, fused") and line.endswith("not measured") for line in alone.splitlines())
    other = dict(decode, info=dict(decode["info"], world_size=1, gpus=["NVIDIA H100 80GB HBM3"]))
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert targets.main([str(tmp_path / "prefill.json"), str(tmp_path / "other.json")]) == 2
    assert "other.json: another machine" in capsys.readouterr().err
