"""What the Python side mirrors of kernels/qsgd.h agrees with the header, as the C compiler sees it.

The ctypes structures ``_native.Config`` and ``_native.CHeader`` are compared field by field (name,
order, offset, size, signedness) and in total size with ``sizeof``/``offsetof`` printed by a small C
program compiled with the system compiler against kernels/qsgd.h. Every ``#define`` and enumerator
of the header is found by parsing it, its value printed by the same program, and each must either
equal its Python mirror (``_native``'s status codes, HEADER_BYTES, ABI_VERSION; ``codec``'s codings,
norms, dtypes, flag and bucket limit; ``protocol``'s control-vector constants) or be listed in
NOT_MIRRORED with the reason. A new constant or field in the header therefore fails here until the
Python side says what it does with it.

Also here: the build-target record of the CPU library (setup.py's -march, checked by
``_native.load`` against this CPU), and the installed package version.
"""
import ctypes
import json
import os
import re
import shutil
import subprocess

import pytest

from hvd_qsgd import _native, codec, protocol
from tests.helpers import ROOT

HEADER = os.path.join(ROOT, "kernels", "qsgd.h")

# header constant -> its Python mirror
MIRRORS = {
    "QSGD_ABI_VERSION": lambda: _native.ABI_VERSION,
    "QSGD_HEADER_BYTES": lambda: _native.HEADER_BYTES,
    "QSGD_MAX_BUCKET": lambda: codec.MAX_BUCKET,
    "QSGD_FLAG_CHECKSUM": lambda: codec.FLAG_CHECKSUM,
    "QSGD_FLAG_ENCODER2": lambda: codec.FLAG_ENCODER2,
    "QSGD_CODING_FIXED": lambda: codec.CODINGS["fixed"],
    "QSGD_CODING_ELIAS": lambda: codec.CODINGS["elias"],
    "QSGD_NORM_MAX": lambda: codec.NORMS["max"],
    "QSGD_NORM_L2": lambda: codec.NORMS["l2"],
    "QSGD_NORM_SIGN": lambda: codec.NORMS["sign"],
    "QSGD_DTYPE_F32": lambda: codec.DTYPES["float32"],
    "QSGD_DTYPE_F16": lambda: codec.DTYPES["float16"],
    "QSGD_DTYPE_BF16": lambda: codec.DTYPES["bfloat16"],
    "QSGD_CONTROL_TAGS": lambda: len(protocol.TAG_NAMES),
    "QSGD_CONTROL_TAG_RANGE": lambda: protocol.TAG_RANGE,
    "QSGD_CONTROL_MEMBER_BITS": lambda: protocol.MEMBER_BITS,
}
# header constants with no Python copy, and why none is needed
NOT_MIRRORED = {
    "QSGD_WIRE_VERSION": "the header's version byte is checked by qsgd_parse_header only",
    "QSGD_MAGIC": "the magic is written and checked by the kernels only",
}
# every status code: QSGD_OK -> _native.OK, QSGD_E_X -> _native.E_X
STATUS = re.compile(r"QSGD_(OK|E_[A-Z0-9_]+)$")

STRUCTS = {"qsgd_config": _native.Config, "qsgd_header": _native.CHeader}
SIGNED = {ctypes.c_int8, ctypes.c_int16, ctypes.c_int32, ctypes.c_int64}
UNSIGNED = {ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64}


def _strip_comments(text):
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def header_constants(text):
    """Names of the object-like ``#define QSGD_*`` macros and of the ``QSGD_*`` enumerators."""
    text = _strip_comments(text)
    names = re.findall(r"^\s*#\s*define\s+(QSGD_[A-Z0-9_]+)[ \t]+\S", text, flags=re.M)
    for body in re.findall(r"\benum\b[^{;]*\{(.*?)\}", text, flags=re.S):
        names += re.findall(r"\b(QSGD_[A-Z0-9_]+)\s*(?:=|,|$)", body.strip())
    return list(dict.fromkeys(names))


def header_structs(text):
    """{typedef name: [field names in order]} of the ``typedef struct NAME {...} NAME;`` blocks."""
    out = {}
    for tag, body, name in re.findall(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", _strip_comments(text),
                                      flags=re.S):
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            m = re.match(r"(?:const\s+)?(?:unsigned\s+|signed\s+)?\w+\s+(.*)$", decl, flags=re.S)
            assert m, f"cannot parse the field declaration {decl!r} of struct {tag}"
            for declarator in m.group(1).split(","):
                declarator = declarator.strip()
                assert re.fullmatch(r"\w+", declarator), (
                    f"struct {tag}: the declarator {declarator!r} (pointer, array or bit-field) is not "
                    "handled by this test; extend it")
                fields.append(declarator)
        out[name] = fields
    return out


def _probe_source(constants, structs):
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "qsgd.h"', "int main(void) {"]
    for name in constants:
        lines.append(f'  printf("const {name} %lld\\n", (long long)({name}));')
    for name, fields in structs.items():
        lines.append(f'  printf("sizeof {name} %zu\\n", sizeof({name}));')
        for f in fields:
            lines.append(f'  printf("field {name} {f} %zu %zu %d\\n", offsetof({name}, {f}), '
                         f"sizeof((({name} *)0)->{f}), (int)((__typeof__((({name} *)0)->{f}))-1 < 0));")
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def compile_probe(tmp_dir, constants, structs):
    """{"const": {name: value}, "sizeof": {struct: n}, "field": {struct: [(name, offset, size, signed)]}}
    as the system C compiler lays out kernels/qsgd.h."""
    cc = os.environ.get("CC", "cc")
    if not shutil.which(cc.split()[0]):
        cc = "gcc"
    if not shutil.which(cc.split()[0]):
        pytest.skip("no C compiler (cc, gcc or $CC) to lay out kernels/qsgd.h")
    src = os.path.join(tmp_dir, "abi_probe.c")
    exe = os.path.join(tmp_dir, "abi_probe")
    with open(src, "w") as f:
        f.write(_probe_source(constants, structs))
    proc = subprocess.run(cc.split() + ["-std=gnu11", "-Wall", "-I", os.path.join(ROOT, "kernels"), src, "-o", exe],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, f"the layout probe does not compile:\n{proc.stdout}"
    out = subprocess.run([exe], check=True, stdout=subprocess.PIPE, text=True).stdout
    result = {"const": {}, "sizeof": {}, "field": {}}
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "const":
            result["const"][rest[0]] = int(rest[1])
        elif kind == "sizeof":
            result["sizeof"][rest[0]] = int(rest[1])
        else:
            result["field"].setdefault(rest[0], []).append((rest[1], int(rest[2]), int(rest[3]), rest[4] == "1"))
    return result


def ctypes_layout(cls):
    """[(name, offset, size, signed)] of a ctypes.Structure."""
    out = []
    for name, ctype in cls._fields_:
        assert ctype in SIGNED | UNSIGNED, f"{cls.__name__}.{name}: {ctype} is not a fixed-width integer"
        out.append((name, getattr(cls, name).offset, ctypes.sizeof(ctype), ctype in SIGNED))
    return out


def layout_mismatches(c_struct, c_size, c_fields, cls):
    """Human-readable differences between a C struct's layout and a ctypes.Structure (empty: none)."""
    problems = []
    py_fields = ctypes_layout(cls)
    c_names, py_names = [f[0] for f in c_fields], [f[0] for f in py_fields]
    if c_names != py_names:
        problems.append(f"{cls.__name__} fields {py_names} != {c_struct} fields {c_names}")
    for c, py in zip(c_fields, py_fields):
        if c[0] == py[0] and c != py:
            problems.append(f"{cls.__name__}.{py[0]}: (offset, size, signed) {py[1:]} in ctypes, {c[1:]} in C")
    if ctypes.sizeof(cls) != c_size:
        problems.append(f"sizeof {cls.__name__} {ctypes.sizeof(cls)} != sizeof {c_struct} {c_size}")
    return problems


@pytest.fixture(scope="module")
def header():
    with open(HEADER) as f:
        text = f.read()
    return text


@pytest.fixture(scope="module")
def probe(header, tmp_path_factory):
    constants, structs = header_constants(header), header_structs(header)
    return constants, structs, compile_probe(str(tmp_path_factory.mktemp("abi")), constants, structs)


# ---- constants ------------------------------------------------------------------------------------
def test_the_header_parser_finds_the_constants_and_structs(header):
    constants, structs = header_constants(header), header_structs(header)
    for name in ("QSGD_ABI_VERSION", "QSGD_HEADER_BYTES", "QSGD_OK", "QSGD_E_ARG", "QSGD_NORM_SIGN",
                 "QSGD_CONTROL_TAGS"):
        assert name in constants
    assert set(structs) == set(STRUCTS)
    assert structs["qsgd_header"][:3] == ["magic", "version", "coding"]


def test_every_header_constant_is_mirrored_or_listed(probe):
    constants, _, c = probe
    unaccounted = [n for n in constants if n not in MIRRORS and n not in NOT_MIRRORED and not STATUS.match(n)]
    assert not unaccounted, (f"kernels/qsgd.h defines {unaccounted}: mirror them in Python (and in MIRRORS "
                             "here) or list them in NOT_MIRRORED with the reason")
    stale = [n for n in list(MIRRORS) + list(NOT_MIRRORED) if n not in constants]
    assert not stale, f"{stale} are no longer in kernels/qsgd.h"


def test_mirrored_constants_equal_the_header(probe):
    _, _, c = probe
    wrong = {n: (get(), c["const"][n]) for n, get in MIRRORS.items() if get() != c["const"][n]}
    assert not wrong, f"(python, header) values differ: {wrong}"


def test_status_codes_equal_the_header(probe):
    constants, _, c = probe
    header_codes = {STATUS.match(n).group(1): c["const"][n] for n in constants if STATUS.match(n)}
    python_codes = {k: v for k, v in vars(_native).items() if re.fullmatch(r"OK|E_[A-Z0-9_]+", k)}
    assert python_codes == header_codes, (
        f"only in _native: {sorted(set(python_codes) - set(header_codes))}, "
        f"only in qsgd.h: {sorted(set(header_codes) - set(python_codes))}, "
        f"different values: {sorted(k for k in header_codes if k in python_codes and python_codes[k] != header_codes[k])}")


def test_the_library_reports_the_abi_version_of_the_header(probe):
    _, _, c = probe
    assert _native.load().qsgd_abi_version() == c["const"]["QSGD_ABI_VERSION"] == _native.ABI_VERSION


# ---- structs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("c_struct", sorted(STRUCTS))
def test_ctypes_struct_matches_the_c_layout(probe, c_struct):
    _, structs, c = probe
    assert [f[0] for f in c["field"][c_struct]] == structs[c_struct]
    problems = layout_mismatches(c_struct, c["sizeof"][c_struct], c["field"][c_struct], STRUCTS[c_struct])
    assert not problems, "\n".join(problems)


def test_header_struct_is_the_wire_header(probe):
    """qsgd_header is the 56-byte wire header, field for field (docs/wire-format.md)."""
    _, _, c = probe
    assert c["sizeof"]["qsgd_header"] == c["const"]["QSGD_HEADER_BYTES"] == ctypes.sizeof(_native.CHeader)


def test_a_wrong_mirror_is_caught(probe):
    """The comparison is not vacuous: a swapped field, a wrong width or signedness and a missing
    field are each reported."""
    _, _, c = probe
    fields = list(_native.CHeader._fields_)

    def variant(fs):
        return type("CHeader", (ctypes.Structure,), {"_fields_": fs})

    swapped = fields[:1] + [fields[2], fields[1]] + fields[3:]
    widened = [(n, ctypes.c_uint64 if n == "bucket_size" else t) for n, t in fields]
    signed = [(n, ctypes.c_int8 if n == "version" else t) for n, t in fields]
    for wrong in (swapped, widened, signed, fields[:-1]):
        assert layout_mismatches("qsgd_header", c["sizeof"]["qsgd_header"], c["field"]["qsgd_header"],
                                 variant(wrong))


# ---- the CPU library's build target ---------------------------------------------------------------
def test_build_target_is_recorded_and_this_cpu_runs_it():
    lib = _native._find("_lib_cpu")
    record = _native.build_target(os.path.dirname(lib))
    assert record is not None, "setup.py writes _build_target.json next to the CPU library"
    assert {"march", "compile_flags", "cpu_features"} <= set(record)
    _native.check_cpu(os.path.dirname(lib))  # this machine built it, so it must run it


def test_a_cpu_without_the_built_isa_gets_a_clear_import_error(tmp_path, monkeypatch):
    (tmp_path / "_build_target.json").write_text(json.dumps(
        {"march": "x86-64-v3", "compile_flags": ["-march=x86-64-v3"], "cpu_features": {"AVX2": "avx2", "FMA": "fma",
                                                                                       "SSE2": "sse2"}}))
    monkeypatch.setattr(_native, "_cpu_flags", lambda: {"sse", "sse2", "fma"})
    with pytest.raises(ImportError) as err:
        _native.check_cpu(str(tmp_path))
    msg = str(err.value)
    assert "AVX2 (avx2)" in msg and "FMA (fma)" not in msg
    assert "-march=x86-64-v3" in msg and "HVD_QSGD_MARCH" in msg
    monkeypatch.setattr(_native, "_cpu_flags", lambda: None)  # flags unknown (not Linux): no verdict
    _native.check_cpu(str(tmp_path))


# ---- packaging ------------------------------------------------------------------------------------
def test_installed_version_is_the_package_version():
    """pyproject.toml takes the version from hvd_qsgd.__version__; the installed metadata agrees."""
    from importlib.metadata import version

    import hvd_qsgd
    assert version("hvd_qsgd") == hvd_qsgd.__version__


def test_pyproject_takes_the_version_from_the_package():
    tomllib = pytest.importorskip("tomllib" if __import__("sys").version_info >= (3, 11) else "tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        config = tomllib.load(f)
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hvd_qsgd.__version__"}
