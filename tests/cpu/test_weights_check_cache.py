"""EPService._weights: CuPy weights checked once pass again without the checks, and the
service holds them by weak references only (a model that drops its weights frees them).
Checked without a GPU: arrays over unowned addresses, and a stand-in for the checks."""

import gc
import types
import weakref

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from epserve.layer.service import EPService  # noqa: E402


def array(ptr: int):
    mem = cupy.cuda.UnownedMemory(ptr, 64, None, device_id=0)
    return cupy.ndarray((4, 4), np.float32, memptr=cupy.cuda.MemoryPointer(mem, 0))


def service():
    svc = types.SimpleNamespace(_checked_weights={}, checks=0)

    def check(w13, w2):
        svc.checks += 1
        return w13, w2

    svc._check_weights = check
    return svc


def test_weights_checked_once_pass_again_unchecked():
    svc, w13, w2 = service(), array(0x1000), array(0x2000)
    assert EPService._weights(svc, w13, w2) == (w13, w2)
    assert EPService._weights(svc, w13, w2) == (w13, w2)
    assert svc.checks == 1
    other = array(0x3000)
    EPService._weights(svc, other, w2)
    assert svc.checks == 2


def test_the_service_keeps_no_weights_alive():
    svc, w13, w2 = service(), array(0x1000), array(0x2000)
    EPService._weights(svc, w13, w2)
    gone = weakref.ref(w13)
    del w13
    gc.collect()
    assert gone() is None
    again = array(0x1000)  # may take the dead array's id: it must be checked anew
    EPService._weights(svc, again, w2)
    assert svc.checks == 2


def test_foreign_arrays_are_checked_every_call():
    """Not CuPy arrays (a wrapper could change what it points to): no caching."""
    svc = service()
    w13 = types.SimpleNamespace(__cuda_array_interface__=None)
    w2 = array(0x2000)
    EPService._weights(svc, w13, w2)
    EPService._weights(svc, w13, w2)
    assert svc.checks == 2
