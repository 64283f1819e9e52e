"""The host side of the cuBLASLt FP8 baseline (epserve/bench/cublaslt.py): each expert's rows
padded to what cuBLASLt's block-scaled GEMM takes, where every real row lands, and where each
expert's activation scales start. The GEMM itself runs in tests/gpu/test_cublaslt.py."""

import numpy as np

from epserve.bench import cublaslt


def _offsets(rows):
    return np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)


def test_padded_offsets_round_each_expert_up():
    padded = cublaslt.padded_offsets(_offsets([1, 0, 16, 17, 33]))
    assert padded.tolist() == [0, 16, 16, 32, 64, 112]
    assert not (np.diff(padded) % cublaslt.ROW_ALIGN).any()


def test_padded_positions_keep_each_expert_in_order():
    off = _offsets([1, 0, 16, 17, 33])
    at = cublaslt.padded_positions(off, cublaslt.padded_offsets(off))
    assert at.tolist() == [0] + list(range(16, 32)) + list(range(32, 49)) + list(range(64, 97))


def test_scale_starts_are_aligned_and_hold_each_block():
    off = _offsets([3, 0, 5, 16])
    starts = cublaslt.scale_starts(off, 3)
    rows = np.diff(off)
    assert (starts % 4 == 0).all()
    assert (np.diff(starts) >= rows * 3).all()
    assert starts[-1] == 12 + 0 + 16 + 48


def test_empty_layout():
    assert cublaslt.padded_offsets(_offsets([0, 0])).tolist() == [0, 0, 0]
    assert cublaslt.padded_positions(_offsets([0, 0]), [0, 0, 0]).size == 0
