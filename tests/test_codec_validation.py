"""The decoder checks every field: truncated, corrupted or mismatched payloads raise a ValueError
(PayloadError) naming the problem, and nothing is read out of bounds (fuzzed with hypothesis)."""
import ctypes
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_qsgd import _native, codec
from hvd_qsgd.codec import PayloadError
from tests.references import reseal as _reseal


def _payload(n=1000, bits=4, coding="fixed", seed=0, checksum=True, **kw):
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return codec.encode(x, bits=bits, coding=coding, seed=seed, checksum=checksum, **kw)


def _set(p, off, nbytes, value):
    p = p.copy()
    p[off:off + nbytes] = np.frombuffer(int(value).to_bytes(nbytes, "little"), np.uint8)
    return _reseal(p)


# ---- parameters ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(bits=0), "bits must be"), (dict(bits=9), "bits must be"), (dict(bits=2.5), "bits must be"),
    (dict(bucket_size=0), "bucket_size must be"), (dict(bucket_size=2**31), "bucket_size must be"),
    (dict(seed=-1), "seed must be"), (dict(seed=2**64), "seed must be"),
    (dict(norm="l1"), "norm must be"), (dict(coding="huffman"), "coding must be"),
    (dict(fingerprint=-5), "fingerprint must be"),
    (dict(norm="sign"), r"norm='sign' needs bits=1 .*got bits=4"),
    (dict(norm="sign", bits=2), r"norm='sign' needs bits=1 .*got bits=2"),
    (dict(norm="sign", bits=8), r"norm='sign' needs bits=1"),
    (dict(norm="sign", bits=1, coding="elias"), r"norm='sign' needs coding='fixed'.*got coding='elias'"),
    (dict(norm="sign", bits=3, coding="elias"), r"norm='sign' needs bits=1"),
])
def test_invalid_parameters_name_the_parameter(kw, match):
    with pytest.raises(ValueError, match=match):
        codec.encode(np.ones(10, np.float32), **kw)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.uint8, bool])
def test_unsupported_dtypes_are_refused(dtype):
    with pytest.raises(TypeError, match=np.dtype(dtype).name):
        codec.encode(np.ones(10, dtype=dtype), name="layer1.weight")


def test_error_names_the_tensor():
    with pytest.raises(TypeError, match="layer1.weight"):
        codec.encode(np.ones(10, dtype=np.float64), name="layer1.weight")


# ---- truncation and corruption -------------------------------------------------------------------
@pytest.mark.parametrize("coding,bits", [("fixed", 4), ("fixed", 3), ("elias", 2)])
def test_every_truncation_is_detected(coding, bits):
    p = _payload(700, bits=bits, coding=coding, bucket_size=64)
    for k in range(p.size):
        with pytest.raises(PayloadError, match="truncated|length"):
            codec.decode(p[:k])


@pytest.mark.parametrize("coding,bits", [("fixed", 4), ("fixed", 1), ("elias", 3)])
def test_every_single_byte_flip_is_detected(coding, bits):
    p = _payload(300, bits=bits, coding=coding, bucket_size=32)
    rng = np.random.default_rng(0)
    for k in range(p.size):
        q = p.copy()
        q[k] ^= np.uint8(1 << rng.integers(8))
        with pytest.raises(PayloadError):
            codec.decode(q)


def test_trailing_bytes_are_refused():
    p = _payload()
    with pytest.raises(PayloadError, match="length"):
        codec.decode(np.concatenate([p, np.zeros(1, np.uint8)]))


@pytest.mark.parametrize("off,nbytes,value,match", [
    (0, 4, 0x12345678, "magic"),
    (4, 1, 2, "version"),
    (5, 1, 3, "header"),          # coding
    (6, 1, 0, "header"),          # bits
    (6, 1, 9, "header"),
    (7, 1, 2, "header"),          # norm: sign is only for bits 1 (this payload has 4)
    (7, 1, 3, "header"),          # norm: no such norm
    (8, 1, 3, "header"),          # dtype
    (9, 1, 4, "header"),          # unknown flag (bit 0: checksum, bit 1: encoder version 2)
    (9, 1, 0x83, "header"),       # the known flags with an unknown one
    (10, 2, 1, "header"),         # reserved
    (12, 4, 0, "header"),         # bucket size 0
    (16, 8, 900, "length"),       # numel disagrees with the length
    (16, 8, 2**60, "header"),     # absurd numel
    (24, 8, 10**6, "length"),     # declared length
    (40, 4, 1, "header"),         # segment_buckets in the fixed coding
    (44, 4, 1, "header"),         # reserved
])
def test_header_fields_are_validated(off, nbytes, value, match):
    with pytest.raises(PayloadError, match=match):
        codec.decode(_set(_payload(), off, nbytes, value))


def test_the_kernels_refuse_sign_with_other_bits_or_the_elias_coding():
    lib = _native.load()
    x = np.ones(100, np.float32)
    out = np.empty(4096, np.uint8)
    n = ctypes.c_uint64(0)
    for bits, coding, norm, want in [(1, 0, 2, _native.OK), (2, 0, 2, _native.E_ARG), (8, 0, 2, _native.E_ARG),
                                     (4, 1, 2, _native.E_ARG), (1, 0, 3, _native.E_ARG), (1, 0, -1, _native.E_ARG)]:
        cfg = _native.Config(bits=bits, coding=coding, norm=norm, dtype=0, bucket_size=64, flags=1)
        assert lib.qsgd_encode_cpu(x.ctypes.data, x.size, ctypes.byref(cfg), out.ctypes.data, out.size,
                                   ctypes.byref(n)) == want, (bits, coding, norm)


@pytest.mark.parametrize("off,value", [(6, 2), (6, 8), (5, 1)])
def test_a_sign_payload_claiming_other_bits_or_coding_is_refused(off, value):
    p = _payload(bits=1, norm="sign")
    assert codec.validate(p).norm == "sign"
    with pytest.raises(PayloadError, match="header"):
        codec.decode(_set(p, off, 1, value))


def test_the_norm_field_does_not_change_decoding():
    """The norm byte is informative: a QSGD(1) payload relabelled as norm 2 decodes to the same values."""
    p = _payload(bits=1, norm="max")
    np.testing.assert_array_equal(codec.decode(_set(p, 7, 1, 2)), codec.decode(p))


def test_negative_scale_is_refused():
    p = _payload()
    p[56 + 3] |= 0x80  # sign bit of the first bucket scale
    with pytest.raises(PayloadError, match="negative bucket scale"):
        codec.decode(_reseal(p))


def test_nonzero_padding_is_refused():
    p = _payload(n=1001, bits=3)  # 3003 bits: 5 padding bits in the last byte
    p[-1] |= 0x80
    with pytest.raises(PayloadError, match="padding"):
        codec.decode(_reseal(p))


def test_without_checksum_a_flipped_data_byte_still_decodes():
    """The checksum is what detects data corruption; with it off (flags bit 0) decoding proceeds."""
    p = _payload(checksum=False)
    assert not codec.read_header(p).checksum_flag
    p[-10] ^= 0xFF
    assert codec.decode(p).shape == (1000,)


@pytest.mark.parametrize("field,kw", [
    ("numel", dict(n=999)), ("fingerprint", dict(fingerprint=5)), ("bits", dict(bits=8)),
    ("bucket_size", dict(bucket_size=128)), ("coding", dict(coding="elias", bits=4)),
    ("norm", dict(norm="l2")),
])
def test_decode_sum_refuses_payloads_of_different_tensors(field, kw):
    base = _payload(bits=4)
    args = dict(n=1000, bits=4)
    args.update(kw)
    other = _payload(**args)
    with pytest.raises(PayloadError, match=f"payload 1 of 2 has {field}="):
        codec.decode_sum([base, other])


def test_decode_sum_refuses_mixing_sign_and_qsgd1_payloads():
    with pytest.raises(PayloadError, match="payload 1 of 2 has norm='max' but payload 0 has norm='sign'"):
        codec.decode_sum([_payload(bits=1, norm="sign"), _payload(bits=1, norm="max")])


def test_decode_sum_names_the_corrupt_payload_and_leaves_out_untouched():
    ps = [_payload(seed=i) for i in range(3)]
    ps[2] = ps[2].copy()
    ps[2][100] ^= 1
    out = np.full(1000, 7.0, np.float32)
    with pytest.raises(PayloadError, match="payload 2 of 3: checksum"):
        codec.decode_sum(ps, out=out, accumulate=True)
    assert np.all(out == 7.0)


def test_split_payloads():
    ps = [_payload(n=100 * (i + 1), seed=i, coding="elias", bits=2) for i in range(3)]
    buf = np.concatenate(ps)
    got = codec.split_payloads(buf, count=3)
    assert [g.size for g in got] == [p.size for p in ps]
    with pytest.raises(PayloadError, match="expected 4 payloads"):
        codec.split_payloads(buf, count=4)
    with pytest.raises(PayloadError):
        codec.split_payloads(buf[:-1], count=3)


# ---- fuzzing (bounded time) ----------------------------------------------------------------------
SEEDS = [_payload(n, bits, coding, seed=n, bucket_size=b)
         for n, bits, coding, b in [(0, 4, "fixed", 512), (1, 1, "fixed", 3), (77, 3, "fixed", 8),
                                    (1000, 8, "fixed", 100), (600, 2, "elias", 64), (2000, 5, "elias", 300)]] + [
    _payload(333, 1, "fixed", seed=3, bucket_size=40, norm="sign")]


def _decode_or_error(p):
    try:
        y = codec.decode(p)
    except PayloadError:
        return None
    assert y.dtype == np.float32 and y.size == codec.read_header(p).numel
    return y


@settings(max_examples=1500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.sampled_from(range(len(SEEDS))),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.integers(0, 10**6), reseal=st.booleans())
def test_fuzz_mutated_payloads(seed, edits, cut, reseal):
    p = SEEDS[seed].copy()
    for pos, val in edits:
        p[pos % p.size] = val
    if cut % 5 == 0:
        p = p[: cut % (p.size + 1)]
    if reseal and p.size >= 56:
        p = _reseal(p)
    _decode_or_error(p)


@settings(max_examples=800, deadline=None, derandomize=True)
@given(st.binary(min_size=0, max_size=400))
def test_fuzz_random_bytes(data):
    with pytest.raises(PayloadError):
        codec.decode(np.frombuffer(data, np.uint8))


@settings(max_examples=800, deadline=None, derandomize=True)
@given(header=st.binary(min_size=56, max_size=56), tail=st.binary(max_size=300))
def test_fuzz_plausible_headers(header, tail):
    """Random headers with the magic and version right, resealed: the layout checks must hold."""
    p = np.frombuffer(b"QSGD\x01" + header[5:] + tail, np.uint8).copy()
    p[9] &= 1
    _decode_or_error(_reseal(p))


def test_fuzz_time_bounded():
    """A coverage-free sweep of single-bit flips over resealed Elias payloads for a fixed budget."""
    rng = np.random.default_rng(5)
    deadline = time.monotonic() + 5.0
    p0 = SEEDS[5]
    n = 0
    while time.monotonic() < deadline:
        p = p0.copy()
        for _ in range(rng.integers(1, 4)):
            k = rng.integers(56, p.size)
            p[k] ^= np.uint8(1 << rng.integers(8))
        _decode_or_error(_reseal(p))
        n += 1
    assert n > 100
