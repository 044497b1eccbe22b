"""ctypes binding of the codec's C ABI (kernels/qsgd.h).

The CPU library is always built; the CUDA library only where nvcc was found at install time, and
it only runs where a CUDA device is visible. Nothing here knows about a framework: callers pass
data pointers (and, for CUDA, a stream handle).
"""
import ctypes
import glob
import json
import os
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_lock = threading.Lock()
_cpu = None
_cuda = None
_cuda_tried = False

HEADER_BYTES = 56
ABI_VERSION = 13  # QSGD_ABI_VERSION of kernels/qsgd.h

# qsgd_status codes (kernels/qsgd.h)
OK = 0
E_ARG, E_CAPACITY, E_TRUNCATED, E_MAGIC, E_VERSION, E_HEADER = -1, -2, -3, -4, -5, -6
E_LENGTH, E_CHECKSUM, E_SCALE, E_STREAM, E_PADDING, E_MISMATCH = -7, -8, -9, -10, -11, -12
E_NOMEM, E_CUDA, E_ISA = -13, -14, -15
E_CTRL_LENGTH, E_CTRL_OP, E_CTRL_FAULT, E_CTRL_MEMBERS, E_CTRL_TAG = -20, -21, -22, -23, -24


class Config(ctypes.Structure):
    _fields_ = [
        ("bits", ctypes.c_int32), ("coding", ctypes.c_int32), ("norm", ctypes.c_int32),
        ("dtype", ctypes.c_int32), ("bucket_size", ctypes.c_uint32), ("flags", ctypes.c_uint32),
        ("seed", ctypes.c_uint64), ("fingerprint", ctypes.c_uint64),
    ]


class CHeader(ctypes.Structure):
    _fields_ = [
        ("magic", ctypes.c_uint32), ("version", ctypes.c_uint8), ("coding", ctypes.c_uint8),
        ("bits", ctypes.c_uint8), ("norm", ctypes.c_uint8), ("dtype", ctypes.c_uint8),
        ("flags", ctypes.c_uint8), ("reserved0", ctypes.c_uint16), ("bucket_size", ctypes.c_uint32),
        ("numel", ctypes.c_uint64), ("payload_len", ctypes.c_uint64),
        ("fingerprint", ctypes.c_uint64), ("segment_buckets", ctypes.c_uint32),
        ("reserved1", ctypes.c_uint32), ("checksum", ctypes.c_uint64),
    ]


_P = ctypes.c_void_p
_U64 = ctypes.c_uint64
_I32 = ctypes.c_int32


def _find(stem):
    hits = sorted(glob.glob(os.path.join(_HERE, stem + "*.so")))
    return hits[0] if hits else None


def _declare_common(lib):
    lib.qsgd_status_string.restype = ctypes.c_char_p
    lib.qsgd_status_string.argtypes = [_I32]


def _check_abi(lib, symbol, path):
    fn = getattr(lib, symbol, None)
    found = None
    if fn is not None:
        fn.restype, fn.argtypes = _I32, []
        found = fn()
    if found != ABI_VERSION:
        raise ImportError(
            f"{path} implements codec ABI {found}, this package needs {ABI_VERSION}: the native library "
            "is stale; rebuild it with `pip install -e .` (or `make setup`) in the repository")


BUILD_TARGET = "_build_target.json"  # written by setup.py next to the CPU library
# another build of the CPU library to load instead of the package's: scripts/fuzz.sh's sanitized one
CPU_LIB_ENV = "HVD_QSGD_CPU_LIB"


def build_target(directory=_HERE):
    """The record setup.py wrote of what the CPU library (and the TensorFlow ops, built with the same
    flags) was compiled for: ``march`` (the -march value, or null), ``compile_flags`` and
    ``cpu_features`` ({"AVX2": "avx2", ...}: the ISA extensions the compiler was allowed to use,
    named as in /proc/cpuinfo); None for a library built before setup.py wrote it."""
    try:
        with open(os.path.join(directory, BUILD_TARGET)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _cpu_flags():
    """The CPU's feature flags as /proc/cpuinfo names them (x86: "flags", Arm: "Features"), or None
    where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return None


def check_cpu(directory=_HERE):
    """Raise ImportError when this CPU lacks an instruction set extension the native libraries in
    ``directory`` were compiled for (loading them would kill the process with SIGILL). Silent where
    nothing is recorded or the CPU's flags cannot be read."""
    record = build_target(directory)
    features = (record or {}).get("cpu_features") or {}
    have = _cpu_flags() if features else None
    if have is None:
        return
    missing = [f"{label} ({flag})" for label, flag in sorted(features.items()) if flag not in have]
    if missing:
        target = " ".join(record.get("compile_flags") or []) or "the compiler's default target"
        raise ImportError(
            f"hvd_qsgd's native libraries in {directory} were built for {target}, and this CPU lacks "
            f"{', '.join(missing)}: loading them would stop the process with SIGILL (illegal "
            "instruction). Rebuild them on this machine with `pip install --no-build-isolation --no-deps "
            "-e .` (or `make setup`), which compiles the common code for baseline x86-64 and chooses "
            "the per-element kernels at run time, or choose the target with HVD_QSGD_MARCH (for example "
            "HVD_QSGD_MARCH=x86-64-v2; HVD_QSGD_MARCH=native builds for the building CPU only)")


_from_buffer, _addressof = ctypes.c_char.from_buffer, ctypes.addressof


def address(a) -> int:
    """The address of NumPy array ``a``'s first element, as ``a.ctypes.data`` gives it, without the
    Python-level object NumPy makes for ``ctypes`` (a third of the time for a writable contiguous
    array, which every hot call passes: ``ctypes.c_char.from_buffer``; others go NumPy's way)."""
    try:
        return _addressof(_from_buffer(a))
    except (TypeError, ValueError):   # read-only, not contiguous or empty
        return a.ctypes.data


def load():
    """The CPU library (built by ``pip install``); raises ImportError with the fix if missing, or if
    it was built for instructions this CPU lacks."""
    global _cpu
    if _cpu is not None:
        return _cpu
    with _lock:
        if _cpu is not None:
            return _cpu
        path = os.environ.get(CPU_LIB_ENV) or _find("_lib_cpu")
        if path is None:
            raise ImportError(
                "hvd_qsgd's native codec library is not built: run `pip install -e .` (or "
                "`make setup`) in the repository, which compiles kernels/ with g++ and OpenMP")
        check_cpu(os.path.dirname(path))
        lib = ctypes.CDLL(path)
        _check_abi(lib, "qsgd_abi_version", path)
        _declare_common(lib)
        lib.qsgd_levels.restype = _I32
        lib.qsgd_levels.argtypes = [_I32]
        lib.qsgd_fixed_nbytes.restype = _U64
        lib.qsgd_fixed_nbytes.argtypes = [_U64, _I32, ctypes.c_uint32]
        lib.qsgd_elias_max_nbytes.restype = _U64
        lib.qsgd_elias_max_nbytes.argtypes = [_U64, _I32, ctypes.c_uint32]
        lib.qsgd_elias_segment_buckets.restype = ctypes.c_uint32
        lib.qsgd_elias_segment_buckets.argtypes = [ctypes.c_uint32]
        lib.qsgd_parse_header.restype = _I32
        lib.qsgd_parse_header.argtypes = [_P, _U64, ctypes.POINTER(CHeader)]
        lib.qsgd_checksum_cpu.restype = _U64
        lib.qsgd_checksum_cpu.argtypes = [_P, _U64]
        lib.qsgd_encode_cpu.restype = _I32
        lib.qsgd_encode_cpu.argtypes = [_P, _U64, ctypes.POINTER(Config), _P, _U64,
                                        ctypes.POINTER(_U64)]
        lib.qsgd_encode_ef_cpu.restype = _I32
        lib.qsgd_encode_ef_cpu.argtypes = [_P, _U64, ctypes.POINTER(Config), _P, _I32, _P, _U64, ctypes.POINTER(_U64)]
        lib.qsgd_encode_segments_cpu.restype = _I32
        lib.qsgd_encode_segments_cpu.argtypes = [ctypes.POINTER(_P), ctypes.POINTER(_U64), ctypes.POINTER(_U64), _I32,
                                                 _U64, ctypes.POINTER(Config), _P, _U64, ctypes.POINTER(_U64)]
        lib.qsgd_encode_segments_ef_cpu.restype = _I32
        lib.qsgd_encode_segments_ef_cpu.argtypes = [ctypes.POINTER(_P), ctypes.POINTER(_P), ctypes.POINTER(_U64),
                                                    ctypes.POINTER(_U64), _I32, _U64, ctypes.POINTER(Config), _I32, _P,
                                                    _U64, ctypes.POINTER(_U64)]
        lib.qsgd_validate_cpu.restype = _I32
        lib.qsgd_validate_cpu.argtypes = [_P, _U64]
        lib.qsgd_decode_sum_cpu.restype = _I32
        lib.qsgd_decode_sum_cpu.argtypes = [ctypes.POINTER(_P), ctypes.POINTER(_U64), _I32,
                                            ctypes.c_float, _P, _U64, _I32]
        lib.qsgd_decode_gathered_cpu.restype = _I32
        lib.qsgd_decode_gathered_cpu.argtypes = [_P, _U64, _I32, ctypes.POINTER(CHeader), ctypes.c_float, _P, _U64,
                                                 ctypes.POINTER(_U64)]
        lib.qsgd_step_seed.restype = _U64
        lib.qsgd_step_seed.argtypes = [_U64, _U64]
        lib.qsgd_control_length.restype = ctypes.c_int64
        lib.qsgd_control_length.argtypes = [_I32]
        lib.qsgd_control_vector.restype = _I32
        lib.qsgd_control_vector.argtypes = [_I32, _I32, _I32, _P, _I32, _P, ctypes.c_int64]
        lib.qsgd_check_control.restype = _I32
        lib.qsgd_check_control.argtypes = [_P, ctypes.c_int64, _I32, _P, _I32, ctypes.POINTER(ctypes.c_double),
                                           ctypes.POINTER(_I32)]
        lib.qsgd_check_control_present.restype = _I32
        lib.qsgd_check_control_present.argtypes = [_P, ctypes.c_int64, _I32, _P, _I32, _P, _I32,
                                                   ctypes.POINTER(ctypes.c_double), ctypes.POINTER(_I32)]
        lib.qsgd_control_participants.restype = _I32
        lib.qsgd_control_participants.argtypes = [_P, ctypes.c_int64, _I32, _P, ctypes.POINTER(_I32)]
        lib.qsgd_control_joined.restype = _I32
        lib.qsgd_control_joined.argtypes = [_P, ctypes.c_int64, _I32, _P, _I32, _P, ctypes.POINTER(_I32),
                                            ctypes.POINTER(_I32)]
        lib.qsgd_chunk_range.restype = _I32
        lib.qsgd_chunk_range.argtypes = [_U64, ctypes.c_uint32, _I32, _I32, ctypes.POINTER(_U64),
                                         ctypes.POINTER(_U64)]
        lib.qsgd_chunk_seed.restype = _U64
        lib.qsgd_chunk_seed.argtypes = [_U64, _I32, _I32]
        lib.qsgd_chunks_max_nbytes.restype = _U64
        lib.qsgd_chunks_max_nbytes.argtypes = [_U64, _I32, ctypes.c_uint32, _I32, _I32]
        lib.qsgd_encode_chunks_cpu.restype = _I32
        lib.qsgd_encode_chunks_cpu.argtypes = [_P, _U64, ctypes.POINTER(Config), _I32, _P, _U64, _P]
        lib.qsgd_encode_chunks_ef_cpu.restype = _I32
        lib.qsgd_encode_chunks_ef_cpu.argtypes = [_P, _U64, ctypes.POINTER(Config), _I32, _P, _I32, _P, _U64, _P]
        lib.qsgd_reduce_chunk_cpu.restype = _I32
        lib.qsgd_reduce_chunk_cpu.argtypes = [ctypes.POINTER(_P), ctypes.POINTER(_U64), _I32,
                                              ctypes.POINTER(Config), _I32, _P, _U64, _P, _U64,
                                              ctypes.POINTER(_U64)]
        lib.qsgd_reduce_chunk_ef_cpu.restype = _I32
        lib.qsgd_reduce_chunk_ef_cpu.argtypes = [ctypes.POINTER(_P), ctypes.POINTER(_U64), _I32,
                                                 ctypes.POINTER(Config), _I32, _P, _U64, _P, _U64,
                                                 ctypes.POINTER(_U64), _P, _U64]
        lib.qsgd_decode_chunks_cpu.restype = _I32
        lib.qsgd_decode_chunks_cpu.argtypes = [ctypes.POINTER(_P), ctypes.POINTER(_U64), _I32, ctypes.c_float,
                                               _P, _U64, ctypes.c_uint32]
        lib.qsgd_set_num_threads.restype = None
        lib.qsgd_set_num_threads.argtypes = [_I32]
        lib.qsgd_get_num_threads.restype = _I32
        lib.qsgd_get_num_threads.argtypes = []
        lib.qsgd_set_stream_bytes.restype = None
        lib.qsgd_set_stream_bytes.argtypes = [_U64]
        lib.qsgd_get_stream_bytes.restype = _U64
        lib.qsgd_get_stream_bytes.argtypes = []
        _declare_isa(lib)
        check_isa_env(lib, path)
        _cpu = lib
        return lib


def _declare_isa(lib):
    lib.qsgd_cpu_isa.restype = ctypes.c_char_p
    lib.qsgd_cpu_isa.argtypes = []
    lib.qsgd_cpu_isa_count.restype = _I32
    lib.qsgd_cpu_isa_count.argtypes = []
    lib.qsgd_cpu_isa_name.restype = ctypes.c_char_p
    lib.qsgd_cpu_isa_name.argtypes = [_I32]
    lib.qsgd_cpu_isa_supported.restype = _I32
    lib.qsgd_cpu_isa_supported.argtypes = [_I32]
    lib.qsgd_set_cpu_isa.restype = _I32
    lib.qsgd_set_cpu_isa.argtypes = [ctypes.c_char_p]
    lib.qsgd_cpu_isa_env_status.restype = _I32
    lib.qsgd_cpu_isa_env_status.argtypes = []


def isa_variants(lib):
    """[(name, runs on this CPU)] of the CPU codec variants compiled into ``lib``, narrowest first."""
    return [(lib.qsgd_cpu_isa_name(i).decode(), bool(lib.qsgd_cpu_isa_supported(i)))
            for i in range(lib.qsgd_cpu_isa_count())]


def check_isa_env(lib, path="the codec library"):
    """Raise ImportError when HVD_QSGD_ISA names a variant ``lib`` does not have or this CPU cannot
    run (the library then uses its widest variant: a forced choice is never dropped silently)."""
    st = lib.qsgd_cpu_isa_env_status()
    if st == OK:
        return
    value = os.environ.get("HVD_QSGD_ISA", "")
    variants = isa_variants(lib)
    runs = [n for n, ok in variants if ok]
    why = ("is not one of its variants" if st == E_ARG else "cannot run on this CPU (it lacks the instructions)")
    raise ImportError(
        f"HVD_QSGD_ISA={value!r}: {why}. {path} has the CPU codec variants "
        f"{', '.join(n for n, _ in variants)}; this CPU runs {', '.join(runs)}. Unset HVD_QSGD_ISA (or set "
        "it to 'auto') to use the widest one this CPU runs")


def load_cuda():
    """The CUDA library, or None when it was not built or no CUDA device is visible."""
    global _cuda, _cuda_tried
    if _cuda_tried:
        return _cuda
    with _lock:
        if _cuda_tried:
            return _cuda
        _cuda_tried = True
        path = _find("_lib_cuda")
        if path is None:
            return None
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            return None
        _check_abi(lib, "qsgd_cuda_abi_version", path)
        lib.qsgd_cuda_device_count.restype = _I32
        lib.qsgd_cuda_device_count.argtypes = []
        declare_cuda(lib)
        if lib.qsgd_cuda_device_count() > 0:
            _cuda = lib
        return _cuda


def declare_cuda(lib):
    """The argument types of the CUDA library's codec entry points (also used on the emulated
    library, tests/emulated_cuda.py)."""
    H = ctypes.POINTER(CHeader)
    lib.qsgd_encode_cuda.restype = _I32
    lib.qsgd_encode_cuda.argtypes = [_P, _U64, ctypes.POINTER(Config), _P, _U64, _P]
    lib.qsgd_decode_sum_cuda.restype = _I32
    lib.qsgd_decode_sum_cuda.argtypes = [ctypes.POINTER(_P), H, _I32, ctypes.c_float, _P, _U64, _I32, _P, _P, _P]
    lib.qsgd_encode_ex_cuda.restype = _I32
    lib.qsgd_encode_ex_cuda.argtypes = [_P, _I32, _U64, ctypes.POINTER(Config), _P, _I32, _P, _U64, _P]
    lib.qsgd_encode_elias_cuda.restype = _I32
    lib.qsgd_encode_elias_cuda.argtypes = [_P, _I32, _U64, ctypes.POINTER(Config), _P, _U64, ctypes.POINTER(_U64), _P]
    lib.qsgd_encode_chunks_cuda.restype = _I32
    lib.qsgd_encode_chunks_cuda.argtypes = [_P, _U64, ctypes.POINTER(Config), _I32, _P, _U64, ctypes.POINTER(_U64), _P]
    lib.qsgd_reduce_chunk_cuda.restype = _I32
    lib.qsgd_reduce_chunk_cuda.argtypes = [ctypes.POINTER(_P), H, _I32, ctypes.POINTER(Config), _I32, _P, _U64, _P,
                                           _U64, ctypes.POINTER(_U64), _P, _U64, _P, _P, _P]
    lib.qsgd_decode_chunks_cuda.restype = _I32
    lib.qsgd_decode_chunks_cuda.argtypes = [ctypes.POINTER(_P), H, _I32, ctypes.c_float, _P, _U64, ctypes.c_uint32,
                                            _P, _P, _P]


def cuda_built():
    """True when the CUDA library was compiled into this installation."""
    return _find("_lib_cuda") is not None


def status_string(code):
    return load().qsgd_status_string(code).decode()
