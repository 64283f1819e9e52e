"""The sweep progress display: rank 0 only, tqdm or plain lines."""

import io

import pytest

from epserve.bench import progress as pg


def test_plain_lines_on_rank_0():
    out = io.StringIO()
    got = list(pg.progress(["a", "b", "c"], label=str.upper, plain=True, stream=out))
    assert got == ["a", "b", "c"]
    assert out.getvalue().splitlines() == ["[1/3] A", "[2/3] B", "[3/3] C"]


def test_plain_fallback_without_tqdm(monkeypatch):
    monkeypatch.setattr(pg, "_tqdm", lambda: None)
    out = io.StringIO()
    assert list(pg.progress(range(2), stream=out)) == [0, 1]
    assert out.getvalue().splitlines() == ["[1/2] 0", "[2/2] 1"]


@pytest.mark.parametrize("plain", [True, False])
def test_silent_on_other_ranks(plain):
    out = io.StringIO()
    assert list(pg.progress(iter([1, 2]), rank=1, plain=plain, stream=out)) == [1, 2]
    assert out.getvalue() == ""


def test_tqdm_bar_when_available():
    pytest.importorskip("tqdm", reason="tqdm is not installed: only the plain fallback can show")
    out = io.StringIO()
    assert list(pg.progress(["x", "y"], label=lambda s: f"point {s}", stream=out)) == ["x", "y"]
    assert "2/2" in out.getvalue() and "point y" in out.getvalue()
