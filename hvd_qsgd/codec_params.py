"""The codec's parameters, each checked with one message naming it and the value, the kernels'
encoder configuration (``_native.Config``) made from them, and the CPU kernels' instruction-set
variant and the size from which its decodes stream their results (``hvd_qsgd.codec`` re-exports all
of it). ``config_template`` keeps each checked
configuration: an encode of the same settings copies it and sets its seed and fingerprint, instead
of checking every parameter again (a few microseconds per tensor and step, docs/performance.md
"Per-tensor cost")."""
import functools
from typing import Optional

import numpy as np

from hvd_qsgd import _native

CODINGS = {"fixed": 0, "elias": 1}
NORM_NAMES = ("max", "l2", "sign")
NORMS = {name: code for code, name in enumerate(NORM_NAMES)}
DTYPE_NAMES = ("float32", "float16", "bfloat16")
DTYPES = {name: code for code, name in enumerate(DTYPE_NAMES)}
MAX_BUCKET = 0x7FFFFFFF
MAX_SEED = 2**64 - 1
HEADER_BYTES = _native.HEADER_BYTES
FLAG_CHECKSUM = 1
FLAG_ENCODER2 = 2
ENCODERS = (1, 2)   # encoder versions (docs/wire-format.md, "Encoders"); 2 is the default
DEFAULT_ENCODER = 2
TEMPLATES_KEPT = 256   # checked configurations kept at most (then the store starts again)


def is_integer(v):
    """An int or NumPy integer, not a bool (True is not a bit width)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_bool(v):
    return isinstance(v, (bool, np.bool_))


def _check_bits(bits):
    if not is_integer(bits) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    return int(bits)


def _check_bucket(bucket_size):
    if not is_integer(bucket_size) or not 1 <= bucket_size <= MAX_BUCKET:
        raise ValueError(f"bucket_size must be an integer in 1..{MAX_BUCKET}, got {bucket_size!r}")
    return int(bucket_size)


def _check_u64(name, v):
    if type(v) is int and 0 <= v <= MAX_SEED:   # (what every caller passes: as it is)
        return v
    if not is_integer(v) or not 0 <= v <= MAX_SEED:
        raise ValueError(f"{name} must be an integer in 0..2**64-1, got {v!r}")
    return int(v)


def check_encoder(encoder):
    """The encoder version, 1 or 2 (ValueError otherwise)."""
    if not is_integer(encoder) or int(encoder) not in ENCODERS:
        raise ValueError(f"encoder must be 1 or 2 (the encoder version, docs/wire-format.md), got {encoder!r}")
    return int(encoder)


def _check_choice(name, v, choices):
    if not isinstance(v, str) or v not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {v!r}")
    return choices[v]


def make_config(bits: int = 4, bucket_size: int = 512, norm: str = "max", seed: int = 0, coding: str = "fixed",
                fingerprint: int = 0, checksum: bool = True, dtype: str = "float32",
                encoder: int = DEFAULT_ENCODER) -> "_native.Config":
    """The kernels' encoder configuration, every parameter checked (ValueError naming it)."""
    encoder = check_encoder(encoder)
    if not is_bool(checksum):
        raise ValueError(f"checksum must be True or False, got {checksum!r}")
    cfg = _native.Config(
        bits=_check_bits(bits), coding=_check_choice("coding", coding, CODINGS),
        norm=_check_choice("norm", norm, NORMS), dtype=_check_choice("dtype", dtype, DTYPES),
        bucket_size=_check_bucket(bucket_size),
        flags=(FLAG_CHECKSUM if checksum else 0) | (FLAG_ENCODER2 if encoder == 2 else 0),
        seed=_check_u64("seed", seed), fingerprint=_check_u64("fingerprint", fingerprint))
    if norm == "sign" and cfg.bits != 1:
        raise ValueError(f"norm='sign' needs bits=1 (the scaled sign is one bit per coordinate), got bits={bits!r}")
    if norm == "sign" and coding != "fixed":
        raise ValueError(f"norm='sign' needs coding='fixed' (one bit per coordinate has nothing for the Elias "
                         f"coding to skip), got coding={coding!r}")
    if coding == "elias" and cfg.bits < 2:
        raise ValueError("coding='elias' needs bits >= 2 (QSGD(1) has no zero level to skip)")
    return cfg


_templates = {}


def config_template(bits, bucket_size, norm, coding, checksum, encoder) -> "_native.Config":
    """``make_config``'s configuration of these parameters with seed and fingerprint 0, checked the
    first time and kept (the caller copies it: ``_native.Config.from_buffer_copy``). The key holds
    each value's type, so that a value equal to a valid one but not itself valid (True for 1) is
    checked, and refused, on its own."""
    key = (bits, bucket_size, norm, coding, checksum, encoder)
    key += tuple(type(v) for v in key)
    try:
        cfg = _templates.get(key)
    except TypeError:   # an unhashable value: make_config's check names it (nothing is kept)
        cfg, key = None, None
    if cfg is None:
        cfg = make_config(bits, bucket_size, norm, 0, coding, 0, checksum, encoder=encoder)
        if key is None:
            return cfg
        if len(_templates) >= TEMPLATES_KEPT:
            _templates.clear()
        _templates[key] = cfg
    return cfg


@functools.lru_cache(maxsize=4096)   # (a tensor's exchanges expect the same header step after step)
def expected_header(bits, bucket_size, norm, coding, numel, dtype, fingerprint) -> "_native.CHeader":
    """The header fields every payload of a tensor has, which the kernels compare with each payload's
    own (``codec.decode_gathered`` on the host; the CUDA decodes on the device); with the fixed coding
    its length too (0 with the Elias coding, whose length depends on the data). Read-only: shared."""
    code = CODINGS[coding]
    return _native.CHeader(bits=bits, bucket_size=bucket_size, norm=NORMS[norm], coding=code, numel=numel,
                           dtype=DTYPES[dtype], fingerprint=fingerprint,
                           payload_len=0 if code else _native.load().qsgd_fixed_nbytes(numel, bits, bucket_size))


# -- the CPU kernels' instruction-set variant (a parameter of every CPU kernel call) ----------

def cpu_isa() -> str:
    """The instruction-set variant of the CPU kernels in use ("baseline", "sse4", "avx2", "avx512"
    on x86-64; "generic" elsewhere): the widest this CPU runs, or the one HVD_QSGD_ISA names. Every
    variant produces the same payload bytes and the same decoded sums."""
    return _native.load().qsgd_cpu_isa().decode()


def cpu_isas() -> dict:
    """{variant name: whether this CPU runs it} for every variant compiled into the CPU library,
    narrowest first."""
    return dict(_native.isa_variants(_native.load()))


def set_cpu_isa(name: str = "auto") -> None:
    """Use the CPU kernels' variant ``name`` from now on ("auto": the widest this CPU runs); for
    comparing variants in one process (tests, benchmarks). ValueError for a name the library does
    not have or a variant this CPU cannot run."""
    if not isinstance(name, str):
        raise TypeError(f"set_cpu_isa: the variant is a str, got {type(name).__name__}")
    lib = _native.load()
    st = lib.qsgd_set_cpu_isa(name.encode())
    if st != _native.OK:
        known = ", ".join(f"{n}{'' if ok else ' (not on this CPU)'}" for n, ok in _native.isa_variants(lib))
        raise ValueError(f"set_cpu_isa({name!r}): {_native.status_string(st)}; the variants are {known}")


def stream_bytes() -> int:
    """The size (bytes) of a decoded result from which the CPU decodes write it past the caches
    (streaming stores: the same values, without the read of each line a cached write makes); by
    default 3/8 of the last-level cache, where the C library's memcpy starts to stream."""
    return int(_native.load().qsgd_get_stream_bytes())


def set_stream_bytes(nbytes: Optional[int] = None) -> None:
    """Set ``stream_bytes`` (None: the default; 2**64 - 1: never stream)."""
    _check_u64("nbytes", 0 if nbytes is None else nbytes)
    _native.load().qsgd_set_stream_bytes(0 if nbytes is None else int(nbytes))
