"""Bad inputs, single process: the codec (NumPy) and the compressors' constructors.

What each case must give is stated in docs/compressor.md ("What happens to a tensor") and, for
non-finite values, in docs/wire-format.md ("Scales", "Decoding"):

* a bucket (``bucket_size`` consecutive elements of the flattened tensor) holding a NaN or an
  Inf has a NaN or +Inf scale and all-zero codes, so every element of it decodes to ``0 * step``:
  NaN for bits >= 2; for bits = 1 (level 1) NaN if the bucket holds a NaN, else +Inf. Summed over
  ranks (``decode_sum``, scatter_allgather's reduce) the bucket stays non-finite: NaN if any rank's
  decodes to NaN, else +Inf. Every other bucket is finite and bit-identical to the result without
  the non-finite values.

The multi-rank cases (Horovod, both frameworks) are in test_robustness_mp.py.
"""
import ml_dtypes
import numpy as np
import pytest

import hvd_qsgd
from hvd_qsgd import codec, reduction
from hvd_qsgd.settings import Settings
from tests.references import check_nonfinite, cleaned

# index -> value; with buckets of 512: NaN in bucket 0, +Inf in 2, -Inf and +Inf in 5, -Inf and NaN in 7
BAD = {100: np.nan, 1500: np.inf, 2600: -np.inf, 2700: np.inf, 3601: -np.inf, 3602: np.nan}


def rand(n, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


# ---- NaN and Inf ---------------------------------------------------------------------------------
@pytest.mark.parametrize("coding,bits", [("fixed", 1), ("fixed", 2), ("fixed", 4), ("fixed", 8), ("elias", 2),
                                         ("elias", 4), ("elias", 8)])
@pytest.mark.parametrize("norm", ["max", "l2"])
def test_codec_nonfinite_buckets_decode_nonfinite_and_the_others_exact(coding, bits, norm):
    x = rand(4000)
    for i, v in BAD.items():
        x[i] = v
    kw = dict(bits=bits, bucket_size=512, norm=norm, coding=coding, seed=5)
    p = codec.encode(x, **kw)
    codec.validate(p)   # NaN and +Inf scales are legal
    scales = np.frombuffer(p[56:56 + 4 * 8].tobytes(), "<u4")
    assert [hex(s) for s in scales[[0, 2, 5, 7]]] == ["0x7fc00000", "0x7f800000", "0x7f800000", "0x7fc00000"]
    assert np.isfinite(scales[[1, 3, 4, 6]].view(np.float32)).all()
    check_nonfinite(codec.decode(p), [x], 512, bits, codec.decode(codec.encode(cleaned(x), **kw)))


@pytest.mark.parametrize("bits", [1, 4])
def test_decode_sum_and_scatter_allgather_keep_a_bucket_nonfinite_if_any_rank_has_one(bits):
    """Three ranks: rank 0 has a NaN in bucket 0, rank 1 an Inf in bucket 2 and a -Inf in bucket 5,
    rank 2 a +Inf in bucket 5 (Inf - Inf) and a NaN in bucket 2 (with rank 1's Inf)."""
    xs = [rand(4000, r) for r in range(3)]
    xs[0][10], xs[1][1100], xs[1][2600], xs[2][2601], xs[2][1200] = np.nan, np.inf, -np.inf, np.inf, np.nan
    xs[1][3000] = np.inf    # bucket 5 too
    xs[2][3999] = -np.inf   # bucket 7, alone
    kw = dict(bits=bits, bucket_size=512, seed=0)
    for alpha in (1 / 3, 1.0):
        ps = [codec.encode(x, **dict(kw, seed=r)) for r, x in enumerate(xs)]
        clean = codec.decode_sum([codec.encode(cleaned(x), **dict(kw, seed=r)) for r, x in enumerate(xs)], alpha)
        check_nonfinite(codec.decode_sum(ps, alpha), xs, 512, bits, clean)
        s = Settings.make(bits, bucket_size=512, min_numel=1)
        out = reduction.simulate(xs, s, [7, 8, 9], alpha)[0]
        clean = reduction.simulate([cleaned(x) for x in xs], s, [7, 8, 9], alpha)[0]
        check_nonfinite(out, xs, 512, bits, clean)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_codec_nonfinite_low_precision(dtype):
    x = rand(3000, 1).astype(dtype)
    x[5], x[2000] = np.inf, np.nan
    y = codec.decode(codec.encode(x))
    check_nonfinite(y, [x.astype(np.float32)], 512, 4,
                    codec.decode(codec.encode(cleaned(x.astype(np.float32)), source_dtype=np.dtype(dtype).name)))
    assert np.isnan(y.astype(dtype)[:512]).all() and np.isnan(y.astype(dtype)[1536:2048]).all()


def test_l2_norm_can_overflow_float16_from_finite_values():
    """Documented: with norm="l2" a decoded element can be as large as the bucket's L2 norm, beyond
    float16's 65504 for finite inputs near that range (norm="max" never exceeds max |x|)."""
    x = np.full(512, 60000, np.float16)
    with np.errstate(over="ignore"):
        assert np.isinf(codec.decode(codec.encode(x, norm="l2")).astype(np.float16)).any()
    y = codec.decode(codec.encode(x, norm="max"))
    assert np.isfinite(y.astype(np.float16)).all() and np.abs(y).max() <= 60000


# ---- zeros, empty, 0-d, non-contiguous, dtypes -------------------------------------------------------
@pytest.mark.parametrize("coding,bits", [("fixed", 1), ("fixed", 4), ("elias", 4)])
def test_all_zero_tensor_decodes_to_exact_positive_zeros(coding, bits):
    x = np.zeros(5000, np.float32)
    x[7] = -0.0
    p = codec.encode(x, bits=bits, coding=coding)
    y = codec.decode_sum([p, p], 0.5)
    assert np.array_equal(y, x) and not np.signbit(y).any()
    out = reduction.simulate([x, x, x], Settings.make(bits, coding=coding), [1, 2, 3], 1 / 3)[0]
    assert np.array_equal(out, x) and not np.signbit(out).any()


@pytest.mark.parametrize("coding", ["fixed", "elias"])
def test_empty_tensor_is_a_header_only_payload(coding):
    p = codec.encode(np.zeros((0, 7), np.float32), coding=coding)
    assert p.size == codec.HEADER_BYTES and codec.read_header(p).numel == 0
    assert codec.decode_sum([p, p]).shape == (0,)
    out, sent, reduced = reduction.simulate([np.zeros(0, np.float32)] * 3, Settings.make(4, coding=coding),
                                            [1, 2, 3], 1 / 3)
    assert out.shape == (0,) and all(q.size == codec.HEADER_BYTES for q in reduced)


def test_zero_dimensional_array_is_one_element():
    x = np.array(-2.5, np.float32)
    p = codec.encode(x, seed=3)
    assert codec.read_header(p).numel == 1
    assert np.array_equal(p, codec.encode(x.reshape(1), seed=3))
    assert codec.decode(p).shape == (1,)


@pytest.mark.parametrize("view", ["transposed", "strided", "reversed", "fortran"])
def test_non_contiguous_array_encodes_like_its_contiguous_copy(view):
    base = rand(60000, 2).reshape(300, 200)
    x = {"transposed": base.T, "strided": base.reshape(-1)[::3], "reversed": base[::-1, ::-2],
         "fortran": np.asfortranarray(base)}[view]
    assert not x.flags.c_contiguous
    before = base.copy()
    for coding in ("fixed", "elias"):
        assert np.array_equal(codec.encode(x, seed=4, coding=coding),
                              codec.encode(np.ascontiguousarray(x), seed=4, coding=coding))
    assert np.array_equal(base, before)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.float64, np.complex64])
def test_codec_refuses_non_float_dtypes_naming_tensor_and_dtype(dtype):
    with pytest.raises(TypeError, match=rf"layer\.bias: dtype {np.dtype(dtype).name} is not supported"):
        codec.encode(np.ones(10, dtype), name="layer.bias")


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_low_precision_payload_is_the_float32_copys_with_the_source_dtype(dtype):
    x = rand(5000, 3).astype(dtype)
    name = np.dtype(dtype).name
    p = codec.encode(x, seed=9)
    assert codec.read_header(p).dtype == name
    assert np.array_equal(p, codec.encode(x.astype(np.float32), seed=9, source_dtype=name))
    y = codec.decode(p)
    assert y.dtype == np.float32 and np.array_equal(y, codec.decode(codec.encode(x.astype(np.float32), seed=9)))


# ---- invalid parameters ----------------------------------------------------------------------------
def _torch_qsgd(**kw):
    import hvd_qsgd.torch
    return hvd_qsgd.torch.QSGD(**kw)


def _tf_qsgd(**kw):
    import hvd_qsgd.tensorflow
    return hvd_qsgd.tensorflow.QSGD(**kw)


def _mpi_reducer(**kw):
    from hvd_qsgd.mpi import QSGDReducer
    return QSGDReducer(comm=object(), **kw)   # the communicator is not used before the settings are checked


def _encode(**kw):
    return codec.encode(np.ones(10, np.float32), **kw)


ENTRY_POINTS = {"hvd_qsgd.QSGD": hvd_qsgd.QSGD, "hvd_qsgd.torch.QSGD": _torch_qsgd,
                "hvd_qsgd.tensorflow.QSGD": _tf_qsgd, "hvd_qsgd.mpi.QSGDReducer": _mpi_reducer,
                "codec.encode": _encode}
NOT_A_PARAMETER = {"codec.encode": {"min_numel", "reduction", "error_feedback"},
                   "hvd_qsgd.mpi.QSGDReducer": {"error_feedback"}}
INVALID = [
    ("bits", 0), ("bits", 9), ("bits", -1), ("bits", 4.5), ("bits", 4.0), ("bits", True), ("bits", "4"), ("bits", None),
    ("bucket_size", 0), ("bucket_size", -5), ("bucket_size", 2**31), ("bucket_size", 512.0), ("bucket_size", False),
    ("seed", -1), ("seed", 2**64), ("seed", 1.5), ("seed", None),
    ("norm", "l1"), ("norm", None), ("norm", ["max"]), ("coding", "huffman"), ("coding", 0),
    ("reduction", "ring"), ("reduction", None), ("reduction", ["allgather"]),
    ("min_numel", 0), ("min_numel", -1), ("min_numel", 1.5), ("min_numel", True),
    ("error_feedback", "no"), ("error_feedback", None), ("checksum", None), ("checksum", "yes"), ("checksum", 1),
]


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_invalid_parameters_raise_a_value_error_naming_the_parameter(entry):
    make = ENTRY_POINTS[entry]
    tried = 0
    for param, value in INVALID:
        if param in NOT_A_PARAMETER.get(entry, ()):
            continue
        with pytest.raises(ValueError, match=rf"^{param} must be") as info:
            make(**{param: value})
        assert repr(value) in str(info.value), (param, value, str(info.value))
        tried += 1
    assert tried >= 17


def test_elias_with_one_bit_is_refused_by_every_entry_point():
    for entry, make in ENTRY_POINTS.items():
        with pytest.raises(ValueError, match="elias.*bits >= 2"):
            make(bits=1, coding="elias")


def test_numpy_integers_are_accepted_as_parameters():
    s = hvd_qsgd.QSGD(np.int64(2), min_numel=np.int32(5), seed=np.uint64(3)).settings
    assert (s.bits, s.bucket_size, s.min_numel, s.seed) == (2, 128, 5, 3)
    assert type(s.bits) is int and type(s.min_numel) is int
    assert hvd_qsgd.QSGD(np.int8(8), bucket_size=np.int64(64)).settings.bucket_size == 64


# ---- more than 2^31 elements ---------------------------------------------------------------------
def _mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def test_round_trip_of_more_than_2_31_elements():
    """2^31 + 1000 float32 zeros (untouched pages cost no memory) with one nonzero in a few buckets:
    near the start, on both sides of element 2^31 and at the end. A lone nonzero v in a max-norm
    bucket has level s, so it decodes to s * (|v| / s), which is exactly v for these values; every
    other element decodes to 0. Peak memory: the decoded output (8.6 GB) and the 4-bit payload
    (1.1 GB). Skipped when the machine has less than 12 GB available (it is shared)."""
    available = _mem_available()
    if available is not None and available < 12 * 2**30:
        pytest.skip(f"{available / 2**30:.1f} GB available, the test needs about 10 GB")
    n = 2**31 + 1000
    x = np.zeros(n, np.float32)   # read through the (huge) zero page
    # the pages written: 4 kB pages here faulted in 2-4x faster than NumPy's default 2 MB pages
    previous = _madvise_hugepage(False)
    try:
        _round_trip(x)
    finally:
        _madvise_hugepage(previous)


def _madvise_hugepage(enabled):
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:
        try:
            from numpy.core.multiarray import _set_madvise_hugepage
        except ImportError:
            return enabled
    return _set_madvise_hugepage(enabled)


def _round_trip(x):
    n = x.size
    values = {0: 7.0, 5 * 512 + 3: -3.5, 2**31 - 513: 0.4375, 2**31 - 1: -7.0, 2**31: 28.0, n - 1: -1.75}
    for i, v in values.items():
        x[i] = v
    idx = np.array(sorted(values))
    want = np.array([values[i] for i in idx], np.float32)
    assert len({i // 512 for i in idx}) == len(idx)
    out = np.empty(n, np.float32)
    for coding in ("fixed", "elias"):
        p = codec.encode(x, bits=4, bucket_size=512, seed=1, coding=coding)
        h = codec.read_header(p)
        assert (h.numel, h.payload_len, h.coding) == (n, p.size, coding)
        if coding == "fixed":
            assert p.size == codec.payload_nbytes(n, 4, 512)
        codec.decode_sum([p], out=out)
        del p
        assert np.array_equal(out[idx], want), (coding, out[idx])
        assert np.count_nonzero(out) == len(idx), coding
        out[idx] = 1.0   # the next decode must overwrite these
