"""Payload layout, exactness, determinism and the edge cases of the codec."""
import math

import ml_dtypes
import numpy as np
import pytest

from hvd_qsgd import codec
from tests.references import (documented_sign_decode, documented_sign_scales, fold_order_bucket,
                              l1_fold_order_bucket)


def _rand(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


# ---- lengths -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 511, 512, 513, 1000, 4099])
@pytest.mark.parametrize("bucket", [1, 3, 8, 128, 512])
def test_fixed_length_is_payload_nbytes(bits, numel, bucket):
    p = codec.encode(_rand(numel), bits=bits, bucket_size=bucket)
    expected = 56 + 4 * math.ceil(numel / bucket) + math.ceil(numel * bits / 8)
    assert p.size == codec.payload_nbytes(numel, bits, bucket) == expected
    h = codec.read_header(p)
    assert (h.numel, h.bits, h.bucket_size, h.payload_len, h.coding) == (numel, bits, bucket, p.size, "fixed")
    assert codec.decode(p).shape == (numel,)


# ---- exactness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_grid_values_round_trip_exactly(bits):
    """Values on the quantization grid of a bucket whose max is s * 2^k decode exactly, whatever the
    seed (rounding is deterministic on the grid)."""
    s = codec.levels(bits)
    rng = np.random.default_rng(1)
    buckets = []
    for k in range(-3, 5):
        b = rng.integers(-s, s + 1, size=64).astype(np.float32) * np.float32(2.0 ** k)
        b[0] = s * 2.0 ** k  # the bucket max
        buckets.append(b)
    x = np.concatenate(buckets)
    for seed in range(5):
        np.testing.assert_array_equal(codec.decode(codec.encode(x, bits=bits, bucket_size=64, seed=seed)), x)


@pytest.mark.parametrize("numel", [0, 1, 5, 513])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_zeros_decode_to_zeros(numel, bits):
    x = np.zeros(numel, dtype=np.float32)
    y = codec.decode(codec.encode(x, bits=bits))
    assert y.dtype == np.float32 and y.shape == (numel,)
    assert np.all(y == 0)


def test_empty_tensor():
    p = codec.encode(np.zeros((0, 3), dtype=np.float32))
    assert p.size == 56 and codec.read_header(p).numel == 0
    assert codec.decode(p).shape == (0,)
    assert codec.decode_sum([p, p], scale=0.5).shape == (0,)


@pytest.mark.parametrize("bits", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("norm", ["max", "l2"])
def test_decoded_values_lie_on_the_grid(bits, norm):
    """Every decoded value is sign * l * scale / s with l one of the two grid points around |x|/scale*s."""
    n, bucket = 1037, 100  # neither a multiple of the bucket nor of the packing width
    x = _rand(n, 2) * 3
    y = codec.decode(codec.encode(x, bits=bits, bucket_size=bucket, norm=norm, seed=9))
    s = codec.levels(bits)
    for b in range(0, n, bucket):
        xb, yb = x[b:b + bucket].astype(np.float64), y[b:b + bucket].astype(np.float64)
        S = np.abs(xb).max() if norm == "max" else np.sqrt((xb ** 2).sum())
        if bits == 1:
            assert np.allclose(np.abs(yb), S, rtol=1e-6)
            continue
        t = np.abs(xb) / S * s
        lev = np.abs(yb) / S * s
        assert np.allclose(lev, np.round(lev), atol=1e-4)
        assert np.all((np.round(lev) == np.floor(t)) | (np.round(lev) == np.floor(t) + 1) | (np.round(lev) == s))
        assert np.all((np.sign(yb) == np.sign(xb)) | (yb == 0))


# ---- determinism ---------------------------------------------------------------------------------
@pytest.mark.parametrize("coding,bits", [("fixed", 4), ("fixed", 3), ("elias", 2)])
def test_determinism_by_seed_and_thread_count(coding, bits):
    x = _rand(300_001, 3)  # large enough for the parallel path
    a = codec.encode(x, bits=bits, seed=7, coding=coding)
    b = codec.encode(x, bits=bits, seed=7, coding=coding)
    c = codec.encode(x, bits=bits, seed=8, coding=coding)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    before = codec.get_num_threads()
    try:
        codec.set_num_threads(1)
        d = codec.encode(x, bits=bits, seed=7, coding=coding)
        y1 = codec.decode_sum([a, c], scale=0.5)
        codec.set_num_threads(3)
        e = codec.encode(x, bits=bits, seed=7, coding=coding)
        y3 = codec.decode_sum([a, c], scale=0.5)
    finally:
        codec.set_num_threads(before)
    np.testing.assert_array_equal(a, d)
    np.testing.assert_array_equal(a, e)
    np.testing.assert_array_equal(y1, y3)


def test_elements_use_independent_randomness():
    """Identical elements in one bucket round independently (the stream is indexed by element)."""
    x = np.full(4096, 0.5, dtype=np.float32)
    x[0] = 1.0  # scale 1, t = 0.5 * s
    y = codec.decode(codec.encode(x, bits=2, bucket_size=4096, seed=1))[1:]
    frac_up = np.mean(y == 1.0)
    # Binomial(4095, 1/2): 6 standard deviations
    assert abs(frac_up - 0.5) < 6 * math.sqrt(0.25 / 4095)


# ---- dtypes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_inputs_go_through_fp32(dtype):
    x = (_rand(5000, 4) * 2).astype(dtype)
    p = codec.encode(x, seed=3)
    q = codec.encode(x.astype(np.float32), seed=3)
    assert codec.read_header(p).dtype == np.dtype(dtype).name
    np.testing.assert_array_equal(codec.decode(p), codec.decode(q))
    # identical bytes apart from the dtype byte and the checksum
    diff = np.nonzero(p != q)[0]
    assert set(diff.tolist()) <= {8} | set(range(48, 56))


def test_multidimensional_and_noncontiguous_input():
    x = _rand(64 * 40, 5).reshape(64, 40)
    np.testing.assert_array_equal(codec.encode(x[:, ::2], seed=1), codec.encode(np.ascontiguousarray(x[:, ::2]), seed=1))


# ---- non-finite values ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("norm", ["max", "l2"])
@pytest.mark.parametrize("coding,bits", [("fixed", 1), ("fixed", 4), ("fixed", 8), ("elias", 2)])
def test_non_finite_bucket_decodes_non_finite(bad, norm, coding, bits):
    x = _rand(2048, 6)
    x[700] = bad  # bucket 1 of 4
    y = codec.decode(codec.encode(x, bits=bits, norm=norm, coding=coding))
    assert not np.any(np.isfinite(y[512:1024])), "every element of the bucket must be non-finite"
    assert np.all(np.isfinite(y[:512])) and np.all(np.isfinite(y[1024:]))
    if bad != bad:
        assert np.all(np.isnan(y[512:1024]))
    # and the finite buckets decode exactly as without the bad bucket
    x2 = x.copy()
    x2[512:1024] = 0
    y2 = codec.decode(codec.encode(x2, bits=bits, norm=norm, coding=coding))
    np.testing.assert_array_equal(y[:512], y2[:512])
    np.testing.assert_array_equal(y[1024:], y2[1024:])


def test_nan_propagates_through_decode_sum():
    x = _rand(1024, 7)
    x[3] = np.nan
    y = codec.decode_sum([codec.encode(_rand(1024, 8)), codec.encode(x)], scale=0.5)
    assert np.all(np.isnan(y[:512])) and np.all(np.isfinite(y[512:]))


def test_huge_finite_values_do_not_overflow_the_l2_scale():
    x = np.full(512, 3e38, dtype=np.float32)  # sum of squares overflows fp32, not the fp64 accumulator
    with np.errstate(over="ignore"):
        y = codec.decode(codec.encode(x, bits=4, norm="l2"))
    assert np.all(np.isfinite(y))
    assert abs(float(y.astype(np.float64).mean()) - 3e38) / 3e38 < 0.2


def test_subnormal_scale():
    x = np.zeros(512, dtype=np.float32)
    x[:4] = np.array([1e-45, -1e-45, 0, 2.8e-45], dtype=np.float32)
    y = codec.decode(codec.encode(x, bits=8))
    assert np.all(np.isfinite(y)) and np.all(np.abs(y) <= 2.9e-45)


# ---- decode_sum ----------------------------------------------------------------------------------
@pytest.mark.parametrize("coding,bits", [("fixed", 4), ("fixed", 7), ("elias", 3)])
def test_decode_sum_is_the_ordered_fp32_sum(coding, bits):
    xs = [_rand(10_007, 10 + r) * (r + 1) for r in range(5)]
    ps = [codec.encode(x, bits=bits, bucket_size=128, seed=r, coding=coding) for r, x in enumerate(xs)]
    ds = [codec.decode(p) for p in ps]
    acc = np.zeros_like(ds[0])
    for d in ds:
        acc = (acc + d).astype(np.float32)
    alpha = np.float32(1 / 5)
    np.testing.assert_array_equal(codec.decode_sum(ps, scale=1 / 5), alpha * acc)
    out = np.full(acc.shape, 2.0, dtype=np.float32)
    codec.decode_sum(ps, scale=1 / 5, out=out, accumulate=True)
    np.testing.assert_array_equal(out, np.float32(2.0) + alpha * acc)


def test_elias_and_fixed_decode_identically():
    x = _rand(100_000, 11)
    for bits in (2, 3, 5, 8):
        for norm in ("max", "l2"):
            e = codec.encode(x, bits=bits, norm=norm, coding="elias", bucket_size=1000, seed=4)
            f = codec.encode(x, bits=bits, norm=norm, coding="fixed", bucket_size=1000, seed=4)
            np.testing.assert_array_equal(codec.decode(e), codec.decode(f))


def test_elias_payloads_of_different_lengths_sum():
    xs = [_rand(50_000, 20), _rand(50_000, 21) * np.float32(1e-3), np.zeros(50_000, np.float32)]
    xs[1][::3] = 0
    ps = [codec.encode(x, bits=2, coding="elias", norm="l2", bucket_size=2048, seed=i) for i, x in enumerate(xs)]
    assert len({p.size for p in ps}) == 3
    ref = [codec.decode(codec.encode(x, bits=2, norm="l2", bucket_size=2048, seed=i)) for i, x in enumerate(xs)]
    np.testing.assert_array_equal(codec.decode_sum(ps), (ref[0] + ref[1]) + ref[2])


# ---- Elias coding vs the paper -------------------------------------------------------------------
def _theorem_3_2_bits(d, s):
    """QSGD Theorem 3.2 (o(1) term dropped): expected bits to send Q_s(v) of dimension d, L2 scaling."""
    return (3 + 1.5 * math.log2(2 * (s * s + d) / (s * (s + math.sqrt(d))))) * s * (s + math.sqrt(d)) + 32


@pytest.mark.parametrize("bucket", [1024, 4096, 16384])
@pytest.mark.parametrize("kind", ["gaussian", "heavy_tailed", "sparse"])
def test_elias_beats_fixed_for_small_s_and_meets_theorem_3_2(bucket, kind):
    rng = np.random.default_rng(bucket)
    n = bucket * 16
    if kind == "gaussian":
        x = rng.standard_normal(n)
    elif kind == "heavy_tailed":
        x = rng.standard_t(2, n)
    else:
        x = rng.standard_normal(n) * (rng.random(n) < 0.05)
    x = x.astype(np.float32)
    s = codec.levels(2)  # QSGD(2): s = 1, the paper's sparse regime
    sizes = [codec.encode(x, bits=2, norm="l2", coding="elias", bucket_size=bucket, seed=k).size for k in range(8)]
    fixed = codec.payload_nbytes(n, 2, bucket)
    assert max(sizes) < fixed / 4, "Elias must beat the 2-bit fixed coding by far for s = 1, large buckets"
    nb = n // bucket
    # our overhead beyond the paper's count: the header, and per segment an 8-byte offset and padding
    seg = bucket_segments = math.ceil(nb / max(1, 32768 // bucket))
    overhead_bits = 8 * 56 + bucket_segments * (64 + 7)
    mean_bits = np.mean(sizes) * 8 - overhead_bits
    assert mean_bits / nb <= _theorem_3_2_bits(bucket, s), (mean_bits / nb, _theorem_3_2_bits(bucket, s), seg)


def test_elias_rejects_one_bit():
    with pytest.raises(ValueError, match="bits >= 2"):
        codec.encode(_rand(10), bits=1, coding="elias")


def documented_l2_scale(x):
    lane = [0.0] * 32
    for i, v in enumerate(x.astype(np.float64)):
        lane[i % 32] += v * v
    off = 16
    while off:
        for j in range(off):
            lane[j] = lane[j] + lane[j + off]
        off //= 2
    return np.float32(np.sqrt(lane[0]))


def test_l2_scale_follows_the_documented_summation_order():
    x = fold_order_bucket()
    sequential = np.float32(np.sqrt(sum(float(v) * float(v) for v in x)))
    assert sequential == np.float32(1.0)
    assert documented_l2_scale(x) == np.float32(1.0) + np.finfo(np.float32).eps
    p = codec.encode(x, bits=4, bucket_size=32, norm="l2")
    assert p[56:60].view(np.float32)[0] == documented_l2_scale(x)


# ---- norm="sign": the scaled sign of dist-EF-SGDM ------------------------------------------------
@pytest.mark.parametrize("numel", [0, 1, 7, 31, 32, 33, 1000, 4099])
@pytest.mark.parametrize("bucket", [1, 3, 32, 100, 512])
def test_sign_norm_is_the_documented_scaled_sign(numel, bucket):
    x = _rand(numel, 30) * np.float32(3)
    x[::17] = 0.0
    x[5::23] = -0.0
    p = codec.encode(x, bits=1, bucket_size=bucket, norm="sign", seed=3)
    assert p.size == codec.payload_nbytes(numel, 1, bucket)
    h = codec.read_header(p)
    assert (h.norm, h.bits, h.coding, h.numel) == ("sign", 1, "fixed", numel)
    assert p[7] == 2  # the header's norm field
    nb = math.ceil(numel / bucket)
    np.testing.assert_array_equal(p[56:56 + 4 * nb].view(np.float32), documented_sign_scales(x, bucket))
    y = codec.decode(p)
    want = documented_sign_decode(x, bucket)
    np.testing.assert_array_equal(y, want)  # exact: scales and signs
    assert not np.signbit(y[x >= 0]).any() and np.all(np.signbit(y[x < 0]) | (y[x < 0] == 0))


def test_sign_norm_is_the_bucket_mean_of_abs_times_sign():
    """The math, with a bucket length that is not a multiple of 32 and a short last bucket."""
    x = _rand(1000, 31)
    y = codec.decode(codec.encode(x, bits=1, bucket_size=300, norm="sign"))
    for b in range(0, 1000, 300):
        v = x[b:b + 300].astype(np.float64)
        mean = np.abs(v).sum() / v.size  # last bucket: 100 elements, its own length
        np.testing.assert_allclose(y[b:b + 300], np.where(v >= 0, mean, -mean), rtol=1e-6)


def test_sign_norm_is_deterministic_and_ignores_the_seed():
    x = _rand(300_001, 32)  # large enough for the parallel path
    a = codec.encode(x, bits=1, norm="sign", seed=1)
    np.testing.assert_array_equal(codec.encode(x, bits=1, norm="sign", seed=2**64 - 1), a)
    before = codec.get_num_threads()
    try:
        codec.set_num_threads(1)
        b = codec.encode(x, bits=1, norm="sign", seed=1)
        codec.set_num_threads(3)
        c = codec.encode(x, bits=1, norm="sign", seed=1)
    finally:
        codec.set_num_threads(before)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(codec.decode(a), documented_sign_decode(x, 512))


def test_sign_norm_zero_buckets_decode_to_positive_zero():
    x = np.zeros(1100, np.float32)
    x[512:1024] = -0.0
    x[1030] = -2.0  # the short last bucket is not zero
    y = codec.decode(codec.encode(x, bits=1, norm="sign"))
    assert np.all(y[:1024] == 0) and not np.signbit(y[:1024]).any()
    mean = np.float32(2.0 / 76)
    assert y[1030] == -mean and np.all(np.delete(y[1024:], 6) == mean)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_sign_norm_non_finite_bucket_decodes_non_finite(bad):
    """The contract of the other norms: a bucket holding a NaN decodes to NaN in every element, one
    holding an Inf (and no NaN) to +Inf (the QSGD(1) decode of all-zero codes); no other bucket changes."""
    x = _rand(2048, 33)
    x[700] = bad  # bucket 1 of 4
    p = codec.encode(x, bits=1, norm="sign")
    y = codec.decode(p)
    if bad != bad:
        assert np.all(np.isnan(y[512:1024]))
        assert p[56 + 4:56 + 8].view(np.uint32)[0] == 0x7FC00000  # the canonical NaN
    else:
        assert np.all(y[512:1024] == np.inf)
    x2 = x.copy()
    x2[512:1024] = 0
    y2 = codec.decode(codec.encode(x2, bits=1, norm="sign"))
    np.testing.assert_array_equal(np.delete(y, np.s_[512:1024]), np.delete(y2, np.s_[512:1024]))
    np.testing.assert_array_equal(y, documented_sign_decode(x, 512))
    both = x.copy()
    both[701] = np.nan
    assert np.all(np.isnan(codec.decode(codec.encode(both, bits=1, norm="sign"))[512:1024]))


def test_sign_norm_huge_and_tiny_values():
    x = np.full(512, 3e38, dtype=np.float32)
    x[::2] *= -1
    y = codec.decode(codec.encode(x, bits=1, norm="sign"))  # the L1 sum overflows fp32, not fp64
    np.testing.assert_array_equal(y, x)
    tiny = np.zeros(512, np.float32)
    tiny[3] = -1e-45  # the mean, 1.4e-45 / 512, rounds to 0: a zero scale, decoding to +0.0
    y = codec.decode(codec.encode(tiny, bits=1, norm="sign"))
    assert np.all(y == 0) and not np.signbit(y).any()
    y = codec.decode(codec.encode(tiny, bits=1, bucket_size=1, norm="sign"))
    np.testing.assert_array_equal(y, tiny)  # a bucket of one: exact


def test_sign_norm_payloads_sum_like_qsgd1_payloads():
    xs = [_rand(5000, 40 + r) for r in range(3)]
    ps = [codec.encode(x, bits=1, bucket_size=128, norm="sign") for x in xs]
    acc = np.zeros(5000, np.float32)
    for x in xs:
        acc = (acc + documented_sign_decode(x, 128)).astype(np.float32)
    np.testing.assert_array_equal(codec.decode_sum(ps, scale=1 / 3), np.float32(1 / 3) * acc)


def test_sign_scale_follows_the_documented_summation_order():
    x = l1_fold_order_bucket()
    acc = 0.0
    for v in x.astype(np.float64):
        acc += abs(v)
    assert np.float32(acc / 32) == np.float32(1 / 32)
    want = np.float32((1 + 2.0 ** -23) / 32)
    assert documented_sign_scales(x, 32)[0] == want
    p = codec.encode(x, bits=1, bucket_size=32, norm="sign")
    assert p[56:60].view(np.float32)[0] == want


def test_encode_into_a_caller_buffer_gives_the_same_bytes_and_checks_the_buffer():
    x = np.random.default_rng(2).standard_normal(10_000).astype(np.float32)
    for coding in ("fixed", "elias"):
        ref = codec.encode(x, bits=4, seed=3, coding=coding)
        buf = np.full(codec.max_payload_nbytes(x.size, 4, 512, coding) + 10, 0xAB, dtype=np.uint8)
        got = codec.encode(x, bits=4, seed=3, coding=coding, out=buf)
        assert np.array_equal(got, ref)
        assert np.shares_memory(got, buf) and got.size == ref.size
    small = np.empty(codec.payload_nbytes(x.size, 4, 512) - 1, dtype=np.uint8)
    with pytest.raises(ValueError, match="grads: encode out= must be .* at least"):
        codec.encode(x, bits=4, out=small, name="grads")
    with pytest.raises(ValueError, match="out="):
        codec.encode(x, bits=4, out=np.empty(codec.payload_nbytes(x.size, 4, 512), dtype=np.float32))


@pytest.mark.parametrize("coding, bits, norm", [("fixed", 4, "max"), ("elias", 2, "l2"), ("fixed", 1, "sign")])
def test_a_prepared_encode_gives_encodes_bytes(coding, bits, norm):
    """``codec.prepare`` + ``encode_prepared`` (the CPU backend's path, parameters checked once) give
    ``encode``'s bytes, for float32 and for a float16 source converted as ``encode`` converts it."""
    x = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    for source, arr in (("float32", x), ("float16", x.astype(np.float16))):
        prepared = codec.prepare(x.size, bits, 128, norm, coding, fingerprint=11, source_dtype=source)
        got = codec.encode_prepared(prepared, arr, seed=77)
        want = codec.encode(arr, bits, 128, norm, 77, coding, fingerprint=11, source_dtype=source)
        assert got.tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="prepared for 5000 elements, got 4999"):
        codec.encode_prepared(prepared, x[1:], seed=1)
    with pytest.raises(ValueError, match="seed"):
        codec.encode_prepared(prepared, x, seed=-1)
