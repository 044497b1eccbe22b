"""The QSGD codec on NumPy arrays: encode a tensor into a payload, decode and sum payloads.

QSGD (Alistarh et al., NeurIPS 2017) with b bits per coordinate and bucket size B: the tensor is
cut into buckets of B consecutive elements; each bucket v gets a scale

    scale(v) = max_i |v_i|          (norm="max", the paper's experiments; the default)
    scale(v) = ||v||_2              (norm="l2", the paper's analysis)

and each element is rounded stochastically to one of s + 1 levels 0, 1/s, ..., 1 of |v_i| / scale:

    Q(v_i) = scale * sign(v_i) * l_i / s,   l_i = floor(t_i) + Bernoulli(t_i - floor(t_i)),
    t_i = s * |v_i| / scale,

so E[Q(v)] = v (unbiased). With b >= 2 bits a coordinate carries a sign bit and b - 1 level bits,
s = 2^(b-1) - 1 (QSGD(2) is ternary, QSGD(4) has s = 7, QSGD(8) has s = 127). QSGD(1) is the
two-point quantizer Q(v_i) in {-scale, +scale} with P(+scale) = (1 + v_i / scale) / 2.

norm="sign" (bits=1, coding="fixed" only) is not QSGD but the blockwise scaled sign compressor of
dist-EF-SGDM (Zheng, Huang & Kwok, NeurIPS 2019): per bucket v of d elements (the last bucket may be
shorter: d is its own length)

    C(v) = (||v||_1 / d) * sign(v),   sign(v_i) = +1 for v_i >= 0 (+0 and -0 included), -1 below,

deterministic (the seed is not used). The scale ||v||_1 / d, the mean |v_i|, is summed in float64 in
a fixed order, divided by d in float64 and rounded to float32 (docs/wire-format.md), identically on
CPU and CUDA. C is biased, with ||C(v) - v||_2^2 = ||v||_2^2 - ||v||_1^2 / d <= (1 - 1/d) ||v||_2^2
(a contraction, the property error feedback needs); it is meant for error feedback, which keeps
v - C(v) and adds it back at the next step. The payload is a QSGD(1) payload with the norm field 2,
and decodes as one. A bucket holding a NaN decodes to NaN, one holding an Inf (and no NaN) to +Inf,
as with the other norms.

Variance (Lemma 3.1 of the paper, norm="l2", b >= 2): E||Q(v) - v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2
per bucket of d elements. With norm="max" each coordinate's variance is at most (scale/s)^2 / 4.

Payload: a 56-byte header, one fp32 scale per bucket, then the levels, either packed at b bits per
coordinate (coding="fixed": exactly ``payload_nbytes(numel, bits, bucket_size)`` bytes) or
Elias-coded (coding="elias", section 3.1 of the paper: gaps between nonzero levels, signs and
levels; length depends on the data, shorter in the sparse regime of small s and large buckets).
The layout is specified in docs/wire-format.md.

Randomness: element i of a tensor uses a counter-based hash of (seed, i); the same input and seed
give the same payload on every run, thread count and device (the CUDA kernels are bit-identical).
"""
import ctypes
import hashlib
import operator
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import numpy as np

from hvd_qsgd import _native
from hvd_qsgd.errors import EncodeError, PayloadError  # noqa: F401  (PayloadError: part of this module's API)

from hvd_qsgd.codec_params import (  # noqa: F401  (part of this module's API)
    CODINGS, DEFAULT_ENCODER, DTYPE_NAMES, DTYPES, ENCODERS, FLAG_CHECKSUM, FLAG_ENCODER2, HEADER_BYTES, MAX_BUCKET,
    MAX_SEED, NORM_NAMES, NORMS, _check_bits, _check_bucket, _check_choice, _check_u64, check_encoder, config_template,
    cpu_isa, cpu_isas, expected_header, is_bool, is_integer, make_config, set_cpu_isa, set_stream_bytes, stream_bytes)


@dataclass(frozen=True)
class Header:
    """The parsed header of a payload (docs/wire-format.md)."""

    version: int
    coding: str
    bits: int
    norm: str
    dtype: str
    checksum_flag: bool
    encoder: int
    bucket_size: int
    numel: int
    payload_len: int
    fingerprint: int
    segment_buckets: int
    checksum: int

    @property
    def levels(self):
        return levels(self.bits)


def levels(bits: int) -> int:
    """The number of nonzero levels s of QSGD(bits): 1 for 1 and 2 bits, 2^(bits-1) - 1 above."""
    return int(_native.load().qsgd_levels(_check_bits(bits)))


def payload_nbytes(numel: int, bits: int = 4, bucket_size: int = 512) -> int:
    """Exact payload length of the fixed coding: 56 + 4 * ceil(numel / B) + ceil(numel * bits / 8)."""
    if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel < 0:
        raise ValueError(f"numel must be a non-negative integer, got {numel!r}")
    return _nbytes_bound(int(numel), _check_bits(bits), _check_bucket(bucket_size), CODINGS["fixed"])


def max_payload_nbytes(numel: int, bits: int = 4, bucket_size: int = 512, coding: str = "fixed") -> int:
    """An upper bound of the payload length (exact for the fixed coding)."""
    code = _check_choice("coding", coding, CODINGS)
    if code == 0:
        return payload_nbytes(numel, bits, bucket_size)
    return _nbytes_bound(int(numel), _check_bits(bits), _check_bucket(bucket_size), code)


def _nbytes_bound(numel, bits, bucket_size, coding_code):
    """The kernels' bound of a payload's length, exact for the fixed coding (arguments checked)."""
    lib = _native.load()
    return int((lib.qsgd_elias_max_nbytes if coding_code else lib.qsgd_fixed_nbytes)(numel, bits, bucket_size))


def tensor_fingerprint(name: str, shape: Sequence[int] = (), dtype: str = "") -> int:
    """A 64-bit fingerprint of a tensor's identity (name, shape, dtype), recorded in payloads so that
    payloads of different tensors are never summed together."""
    text = f"{name}|{tuple(int(s) for s in shape)}|{dtype}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


_FLOAT32 = np.dtype(np.float32)


def _as_float32(x, what):
    """A C-contiguous float32 view or copy of x, and the source dtype code."""
    if type(x) is np.ndarray and x.dtype is _FLOAT32 and x.flags.c_contiguous:
        return x.reshape(-1), 0
    x = np.asarray(x)
    name = x.dtype.name
    if name not in DTYPE_NAMES:
        raise TypeError(f"{what}: dtype {name} is not supported; QSGD encodes float32, float16 and "
                        f"bfloat16 tensors (route other dtypes around the compressor)")
    code = DTYPE_NAMES.index(name)
    if code:
        x = x.astype(np.float32)
    return np.ascontiguousarray(x.reshape(-1)), code


_UINT8 = np.dtype(np.uint8)


def _as_bytes(payload, what):
    if type(payload) is np.ndarray and payload.dtype is _UINT8 and payload.ndim == 1 and payload.flags.c_contiguous:
        return payload   # (what every collective hands back: as it is)
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return np.frombuffer(payload, dtype=np.uint8)
    p = np.asarray(payload)
    if p.dtype != np.uint8 or p.ndim != 1:
        raise TypeError(f"{what}: a payload is a 1-D uint8 array, got {p.dtype} with shape {p.shape}")
    return np.ascontiguousarray(p)


def encode(x: Any, bits: int = 4, bucket_size: int = 512, norm: str = "max", seed: int = 0, coding: str = "fixed",
           fingerprint: int = 0, checksum: bool = True, name: str = "tensor",
           source_dtype: Optional[str] = None, out: Optional[np.ndarray] = None,
           encoder: int = DEFAULT_ENCODER) -> np.ndarray:
    """Quantize ``x`` (float32, float16 or bfloat16; any shape; flattened) into a payload.

    ``norm``: the bucket scale, "max" or "l2" (QSGD), or "sign" (with ``bits=1`` and the fixed coding:
    the deterministic scaled sign, mean |v| * sign(v) per bucket; see the module docstring).
    ``seed`` selects the random stream (use a different seed per step and tensor); ``fingerprint``
    identifies the tensor (see ``tensor_fingerprint()``); ``checksum`` adds a checksum the decoder verifies.
    ``source_dtype`` ("float32", "float16" or "bfloat16") overrides the dtype recorded in the header,
    for a float32 copy of a lower-precision tensor. Returns a 1-D uint8 array. ``name`` only labels
    error messages. ``out``: a caller-owned contiguous 1-D uint8 array of at least
    ``max_payload_nbytes(...)`` bytes to encode into (the result is then a view of its first bytes),
    which spares a fresh allocation's page faults when the same tensor is encoded every step.
    ``encoder``: the encoder version (2, the default, or 1 to reproduce payloads of earlier releases;
    docs/wire-format.md, "Encoders"); decoders read both.
    """
    cfg = _native.Config.from_buffer_copy(config_template(bits, bucket_size, norm, coding, checksum, encoder))
    cfg.seed, cfg.fingerprint = _check_u64("seed", seed), _check_u64("fingerprint", fingerprint)
    flat, cfg.dtype = _as_float32(x, name)
    if source_dtype is not None:
        cfg.dtype = _check_choice("source_dtype", source_dtype, DTYPES)
    n = flat.size
    cap = _nbytes_bound(n, cfg.bits, cfg.bucket_size, cfg.coding)
    if out is not None and not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1
                                and out.flags.c_contiguous and out.flags.writeable and out.size >= cap):
        raise ValueError(f"{name}: encode out= must be a writeable contiguous 1-D uint8 array of at least "
                         f"{cap} bytes, got {getattr(out, 'dtype', type(out).__name__)} "
                         f"{getattr(out, 'shape', '')}")
    return _encode_into((_native.address(flat), flat.size), cfg, cap, out, name)


def _encode_into(source, cfg, cap, out, name, kernel="qsgd_encode_cpu", after_cfg=()):
    """The kernel's encode of ``source`` (its arguments before the config: a contiguous float32
    array's address and size; ``after_cfg``: those between the config and the output) with the
    checked ``cfg`` into ``out`` (a view of its first bytes is returned), or into a new array of the
    bound ``cap``."""
    given = out is not None
    out = out if given else np.empty(cap, dtype=np.uint8)
    cap = out.size
    out_len = ctypes.c_uint64(0)
    st = getattr(_native.load(), kernel)(*source, ctypes.byref(cfg), *after_cfg, _native.address(out), cap,
                                         ctypes.byref(out_len))
    if st != _native.OK:
        raise EncodeError(f"{name}: encode failed: {_native.status_string(st)}", st)
    if given:
        return out[: out_len.value]
    if out_len.value != cap:
        out = out[: out_len.value].copy()
    return out


def prepare(numel: int, bits: int = 4, bucket_size: int = 512, norm: str = "max", coding: str = "fixed",
            fingerprint: int = 0, checksum: bool = True, source_dtype: str = "float32",
            encoder: int = DEFAULT_ENCODER) -> tuple:
    """What ``encode`` checks and works out before its kernel runs, once, for a tensor of ``numel``
    elements encoded alike step after step (``encode_prepared``; each parameter as ``encode`` takes
    it, ``source_dtype`` the dtype the header records)."""
    cfg = make_config(bits, bucket_size, norm, 0, coding, fingerprint, checksum, source_dtype, encoder=encoder)
    numel = int(numel)
    return cfg, numel, _nbytes_bound(numel, cfg.bits, cfg.bucket_size, cfg.coding)


def encode_prepared(prepared: tuple, x: np.ndarray, seed: int, name: str = "tensor") -> np.ndarray:
    """``encode`` of ``x`` (``prepared_input``) with the prepared parameters (``prepare``) and
    ``seed``: the same bytes, without checking every parameter again."""
    x = prepared_input(prepared, x, name)
    return _encode_into((_native.address(x), x.size), seeded(prepared[0], seed), prepared[2], None, name)


def prepared_input(prepared: tuple, x: Any, name: str = "tensor") -> np.ndarray:
    """``x`` as the float32 array a prepared encode reads (itself where it is one), of the prepared size."""
    if not (type(x) is np.ndarray and x.dtype is _FLOAT32 and x.flags.c_contiguous):
        x = _as_float32(x, name)[0]
    if x.size != prepared[1]:
        raise ValueError(f"{name}: encode was prepared for {prepared[1]} elements, got {x.size}")
    return x


def seeded(template: "_native.Config", seed: int) -> "_native.Config":
    """A copy of a prepared (checked) encoder configuration with ``seed``."""
    cfg = _native.Config.from_buffer_copy(template)
    cfg.seed = _check_u64("seed", seed)
    return cfg


def raise_status(st, where, payload=None):
    msg = f"{where}: {_native.status_string(st)}"
    if payload is not None and st in (_native.E_HEADER, _native.E_LENGTH) and payload.size >= HEADER_BYTES:
        f = _raw_fields(payload)
        msg += " (" + ", ".join(f"{k}={v}" for k, v in f.items()) + f"; buffer has {payload.size} bytes)"
    raise PayloadError(msg, st)


def _raw_fields(p):
    b = bytes(p[:HEADER_BYTES])
    le = lambda o, n: int.from_bytes(b[o:o + n], "little")  # noqa: E731
    return dict(version=b[4], coding=b[5], bits=b[6], norm=b[7], dtype=b[8], flags=b[9],
                reserved0=le(10, 2), bucket_size=le(12, 4), numel=le(16, 8), payload_len=le(24, 8),
                segment_buckets=le(40, 4), reserved1=le(44, 4))


def _header_from_c(h):
    """The Header of a parsed (checked) C header: its fields set directly, as ``Header(...)`` would
    (a frozen dataclass's constructor sets each through ``object.__setattr__``: a third of a
    header's parse, once per payload received)."""
    header = object.__new__(Header)
    header.__dict__.update(
        version=h.version, coding=("fixed", "elias")[h.coding], bits=h.bits,
        norm=NORM_NAMES[h.norm], dtype=DTYPE_NAMES[h.dtype], checksum_flag=bool(h.flags & FLAG_CHECKSUM),
        encoder=2 if h.flags & FLAG_ENCODER2 else 1, bucket_size=h.bucket_size, numel=h.numel, payload_len=h.payload_len,
        fingerprint=h.fingerprint, segment_buckets=h.segment_buckets, checksum=h.checksum)
    return header


def read_header(payload: Any, where: str = "payload") -> Header:
    """Parse and check the header (every field, and the declared length against the layout and the
    buffer). Does not read the data; ``validate`` does."""
    p = _as_bytes(payload, where)
    h = _native.CHeader()
    st = _native.load().qsgd_parse_header(_native.address(p), p.size, ctypes.byref(h))
    if st != _native.OK:
        raise_status(st, where, p)
    return _header_from_c(h)


def validate(payload: Any, where: str = "payload") -> Header:
    """Check a payload completely (header, length, checksum, scales, data); return its Header."""
    p = _as_bytes(payload, where)
    header = read_header(p, where)
    st = _native.load().qsgd_validate_cpu(_native.address(p), p.size)
    if st != _native.OK:
        raise_status(st, where, p)
    return header


def split_payloads(buffer: Any, count: Optional[int] = None, where: str = "buffer",
                   headers: Optional[List[Header]] = None) -> List[np.ndarray]:
    """Split concatenated payloads (what an allgather returns) using each header's length.

    Returns views into ``buffer``. With ``count``, exactly that many payloads must fill the buffer.
    ``headers``: a list each payload's header is appended to (read once: ``decode_sum`` takes them).
    """
    buf = _as_bytes(buffer, where)
    out, off = [], 0
    while off < buf.size and (count is None or len(out) < count):
        h = read_header(buf[off:], f"{where}: payload {len(out)} at byte {off}")
        out.append(buf[off: off + h.payload_len])
        off += h.payload_len
        if headers is not None:
            headers.append(h)
    if off != buf.size or (count is not None and len(out) != count):
        raise PayloadError(
            f"{where}: expected {count if count is not None else 'whole'} payloads filling "
            f"{buf.size} bytes, found {len(out)} covering {off} bytes", _native.E_LENGTH)
    return out


# what payloads summed together must share
SUMMED_FIELDS = ("numel", "fingerprint", "bits", "bucket_size", "coding", "norm", "dtype")
_summed_fields = operator.attrgetter(*SUMMED_FIELDS)


def decode_sum(payloads: Sequence[Any], scale: float = 1.0, out: Optional[np.ndarray] = None,
               accumulate: bool = False, where: str = "decode_sum",
               headers: Optional[Sequence[Header]] = None) -> np.ndarray:
    """``out = [out +] scale * (decode(p_0) + decode(p_1) + ...)`` in one fused pass, summing in list
    order in float32 (so every caller that passes the same payloads in the same order gets
    bit-identical results). All payloads must describe the same tensor (numel, fingerprint, bits,
    bucket size, coding, norm, dtype); each is validated completely before ``out`` is written.
    ``headers``: the payloads' headers as ``read_header`` gave them (else read here).
    Returns a float32 array of numel elements."""
    ps = [_as_bytes(p, f"{where}: payload {i}") for i, p in enumerate(payloads)]
    if not ps:
        raise ValueError(f"{where}: no payloads")
    if headers is None:
        headers = [read_header(p, f"{where}: payload {i} of {len(ps)}") for i, p in enumerate(ps)]
    h0 = headers[0]
    shared = _summed_fields(h0)
    for i, h in enumerate(headers[1:], 1):
        if _summed_fields(h) == shared:
            continue
        for field in SUMMED_FIELDS:   # (the first that differs, named)
            if getattr(h, field) != getattr(h0, field):
                raise PayloadError(
                    f"{where}: payload {i} of {len(ps)} has {field}={getattr(h, field)!r} but payload 0 "
                    f"has {field}={getattr(h0, field)!r}: payloads of different tensors or settings "
                    "cannot be summed", _native.E_MISMATCH)
    n = h0.numel
    if out is None:
        if accumulate:
            raise ValueError(f"{where}: accumulate=True needs out=")
        out = np.empty(n, dtype=np.float32)
    elif out.dtype != np.float32 or out.size != n or not out.flags.c_contiguous:
        raise ValueError(f"{where}: out must be a C-contiguous float32 array of {n} elements, got "
                         f"{out.dtype} with {out.size} elements")
    lib = _native.load()
    ptrs = (ctypes.c_void_p * len(ps))(*[_native.address(p) for p in ps])
    lens = (ctypes.c_uint64 * len(ps))(*[p.size for p in ps])
    st = lib.qsgd_decode_sum_cpu(ptrs, lens, len(ps), float(scale), _native.address(out), n, int(bool(accumulate)))
    if st != _native.OK:
        # name the payload that fails
        for i, p in enumerate(ps):
            st_i = lib.qsgd_validate_cpu(_native.address(p), p.size)
            if st_i != _native.OK:
                raise_status(st_i, f"{where}: payload {i} of {len(ps)}", p)
        raise_status(st, where)
    return out


def decode_gathered(buffer: Any, count: int, expect: Any, scale: float = 1.0,
                    out: Optional[np.ndarray] = None) -> tuple:
    """(``scale`` * the decoded sum of the ``count`` payloads back to back in ``buffer``, what an
    allgather returns; their lengths) in one native call: each payload is cut at its header's length,
    they must fill the buffer, and each header must agree with ``expect`` (anything with the fields
    numel, fingerprint, bits, bucket_size, coding, norm, dtype). The same checks and arithmetic as
    ``split_payloads``, a comparison of the headers and ``decode_sum``; where one fails this raises a
    ``PayloadError`` with the status only (those name the payload and the field)."""
    buf = _as_bytes(buffer, "gathered payloads")
    n = int(expect.numel)
    if out is None:
        out = np.empty(n, dtype=np.float32)
    elif out.dtype != np.float32 or out.size != n or not out.flags.c_contiguous:
        raise ValueError(f"decode_gathered: out must be a C-contiguous float32 array of {n} elements")
    want = expected_header(expect.bits, expect.bucket_size, expect.norm, expect.coding, n, expect.dtype,
                           expect.fingerprint)
    lens = (ctypes.c_uint64 * max(1, count))()
    st = _native.load().qsgd_decode_gathered_cpu(_native.address(buf), buf.size, count, ctypes.byref(want),
                                                 float(scale), _native.address(out), n, lens)
    if st != _native.OK:
        raise PayloadError(f"gathered payloads: {_native.status_string(st)}", st)
    return out, lens[:count]


def decode(payload: Any, where: str = "decode") -> np.ndarray:
    """Decode one payload to a 1-D float32 array (the adapters restore shape and dtype)."""
    return decode_sum([payload], 1.0, where=where)


def set_num_threads(n: int) -> None:
    """Threads of the CPU kernels (n <= 0: OpenMP's default); a choice ``hvd_qsgd.threads`` keeps."""
    global _threads_chosen
    _threads_chosen = True
    _native.load().qsgd_set_num_threads(int(n))


_threads_chosen = False   # set_num_threads was called


def get_num_threads() -> int:
    return int(_native.load().qsgd_get_num_threads())
