"""epserve/check/testing.py's LayerInputs, as the GPU jobs take them: on_device hands the five
arrays over in the order forward takes them, each converted once (here with NumPy standing in
for CuPy's asarray, as this machine has no GPU)."""

import numpy as np

from epserve.check.testing import layer_inputs


def test_on_device_gives_forwards_arrays_in_order(monkeypatch):
    import cupy

    seen = []
    monkeypatch.setattr(cupy, "asarray", lambda a: seen.append(a) or np.array(a, copy=True))
    me = layer_inputs(3, [5, 7], 8, 2, 64, 32)[1]
    got = me.on_device()
    want = (me.x, me.topk_idx, me.topk_weights, me.w13, me.w2)
    assert len(got) == 5 and all(g is not w and np.array_equal(g, w) for g, w in zip(got, want))
    assert [a is w for a, w in zip(seen, want)] == [True] * 5
