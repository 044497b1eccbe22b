"""The CPU backend's result arrays, reused once nothing holds them (hvd_qsgd.result_pool)."""
import numpy as np

from hvd_qsgd import backends, codec
from hvd_qsgd.result_pool import MIN_ELEMENTS, ResultPool


def test_an_array_is_reused_only_once_nothing_holds_it():
    pool = ResultPool()
    a = pool.take(MIN_ELEMENTS)
    b = pool.take(MIN_ELEMENTS)
    assert a is not b                       # a is held here
    view = a[10:20]
    del a
    c = pool.take(MIN_ELEMENTS)
    assert c is not view.base               # a view of it is alive
    del view, c
    d = pool.take(MIN_ELEMENTS)             # a free again
    assert d.size == MIN_ELEMENTS and len(pool) == 3
    held = pool.take(MIN_ELEMENTS)
    assert held is not d


def test_small_arrays_are_not_pooled_and_the_pool_is_bounded():
    pool = ResultPool(keep=2)
    assert pool.take(MIN_ELEMENTS - 1).size == MIN_ELEMENTS - 1 and len(pool) == 0
    kept = [pool.take(MIN_ELEMENTS + i) for i in range(4)]
    assert len(pool) == 2 and all(k.dtype == np.float32 for k in kept)


def test_the_cpu_backend_decodes_into_reused_arrays_with_the_same_values():
    x = np.random.default_rng(0).standard_normal(MIN_ELEMENTS * 2).astype(np.float32)
    payloads = [codec.encode(x, seed=s) for s in (1, 2)]
    want = codec.decode_sum(payloads, 0.5)
    first = backends.CPU.decode_sum(payloads, 0.5, "test")
    assert np.array_equal(first, want)
    address = first.ctypes.data
    del first
    again = backends.CPU.decode_sum(payloads, 0.5, "test")
    assert np.array_equal(again, want) and again.ctypes.data == address
    bad = np.zeros(100, np.uint8)
    try:
        backends.CPU.decode_sum([bad], 1.0, "test")
    except codec.PayloadError as e:
        assert "payload 0" in str(e)
    else:
        raise AssertionError("a malformed payload decoded")
