"""The codec's C ABI under AddressSanitizer and UndefinedBehaviorSanitizer (scripts/fuzz.sh).

* The kept fuzzing inputs (tests/fuzz/corpus.pack, tests/fuzz/regressions/) run through
  tests/fuzz/fuzz_codec.cc built with g++'s sanitizers, with the CPU library (every ISA variant this
  CPU runs) and the CUDA library compiled for the host: every property the harness states holds
  (the readers of a payload agree with its validation and with each other, the variants and the
  device give the CPU's bytes and verdicts) and nothing is read or written outside its buffer.
* The codec's own tests against the CPU library built with the same sanitizers
  (``HVD_QSGD_CPU_LIB``), their runtimes preloaded into Python: the payloads of every format, the
  validation of bad ones and its hypothesis fuzzing, the ISA variants, error feedback, the chunks
  of the scatter reduction, on the library's threads. That the sanitizer is live there is checked
  first: a read past a buffer stops the process with its report.
* The TensorFlow op library built with AddressSanitizer (``HVD_QSGD_TF_OPS_LIB``; UBSan's checks do
  not compile with TensorFlow's headers): the single-process tests of the ops and of the compressor
  in TensorFlow pass with it, and it is the library those processes load.
"""
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

TF_TESTS = ["tests/test_tf_compressor.py"]
CODEC_TESTS = ["tests/test_codec_validation.py", "tests/test_codec_format.py", "tests/test_native_abi.py",
               "tests/test_cpu_isa.py", "tests/test_error_feedback_encode.py", "tests/test_reduction.py"]


def _fuzz_sh(*args, timeout, env=None):
    proc = subprocess.run(["bash", "scripts/fuzz.sh", *args], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def _runtimes(*names):
    """The sanitizer runtimes (and libraries) to preload into Python, as LD_PRELOAD lists them."""
    return ":".join(subprocess.run(["g++", f"-print-file-name={name}"], stdout=subprocess.PIPE, text=True,
                                   check=True).stdout.strip() for name in names)


def _single_process_tests(files, env, at_least):
    """The tests of ``files`` that start no job, run in ``env``: all pass (at least ``at_least``), and no
    sanitizer reported anything."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m",
                           "not multirank and not slow and not gpu", *files], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
    assert proc.returncode == 0 and "Sanitizer" not in proc.stdout, proc.stdout[-6000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= at_least, proc.stdout[-2000:]


def _pack_count(path):
    sys.path.insert(0, os.path.join(ROOT, "tests", "fuzz"))
    try:
        import pack
        return sum(1 for _ in pack.records(path))
    finally:
        sys.path.pop(0)


def test_the_kept_fuzzing_inputs_hold_every_property_under_the_sanitizers(tmp_path):
    env = dict(os.environ, BUILD=str(tmp_path))
    out = _fuzz_sh("replay", timeout=900, env=env)
    kept = _pack_count(os.path.join(ROOT, "tests", "fuzz", "corpus.pack"))
    regressions = len(os.listdir(os.path.join(ROOT, "tests", "fuzz", "regressions")))
    assert kept > 500 and regressions > 0
    assert re.search(rf"^replayed {kept + regressions} inputs$", out, flags=re.M), out[-3000:]


@pytest.fixture(scope="module")
def sanitized_env(tmp_path_factory):
    """The environment in which Python loads the sanitized CPU library."""
    directory = tmp_path_factory.mktemp("sanitized")
    _fuzz_sh("library", str(directory), timeout=600, env=dict(os.environ, BUILD=str(directory / "build")))
    return dict(os.environ, HVD_QSGD_CPU_LIB=str(directory / "_lib_cpu.so"),
                LD_PRELOAD=_runtimes("libasan.so", "libubsan.so"), ASAN_OPTIONS="detect_leaks=0",
                UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", PYTHONPATH=ROOT)


def test_the_sanitizer_is_live_in_python_a_read_past_a_buffer_stops_it(sanitized_env):
    code = ("import ctypes, numpy as np\n"
            "from hvd_qsgd import _native\n"
            "lib = _native.load()\n"
            "print('loaded', lib._name, flush=True)\n"
            "buf = np.zeros(8, np.uint8)\n"
            "lib.qsgd_checksum_cpu.restype = ctypes.c_uint64\n"
            "lib.qsgd_checksum_cpu(ctypes.c_void_p(buf.ctypes.data), ctypes.c_uint64(4096))\n"
            "print('not caught', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=sanitized_env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert f"loaded {sanitized_env['HVD_QSGD_CPU_LIB']}" in proc.stdout, proc.stdout[-3000:]
    assert proc.returncode != 0 and "not caught" not in proc.stdout
    assert re.search(r"AddressSanitizer: heap-buffer-overflow .*\n(.*\n)*READ of size", proc.stdout), \
        proc.stdout[-3000:]


def test_the_codec_tests_pass_against_the_sanitized_library(sanitized_env):
    _single_process_tests(CODEC_TESTS, sanitized_env, at_least=300)


def test_the_tensorflow_ops_pass_their_tests_built_with_address_sanitizer(tmp_path):
    _fuzz_sh("tf-ops", str(tmp_path), timeout=600, env=dict(os.environ, BUILD=str(tmp_path / "build")))
    ops = str(tmp_path / "_qsgd_ops.so")
    # libstdc++ with the runtime: ASan finds C++'s throw only in a library loaded before it
    env = dict(os.environ, HVD_QSGD_TF_OPS_LIB=ops, LD_PRELOAD=_runtimes("libasan.so", "libstdc++.so.6"),
               ASAN_OPTIONS="detect_leaks=0", PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    code = ("from hvd_qsgd import _tf_ops\n"
            "_tf_ops.load()\n"
            "maps = open('/proc/self/maps').read()\n"
            "print('ops mapped', %r in maps, 'asan mapped', 'libasan' in maps)\n" % ops)
    proc = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    assert "ops mapped True asan mapped True" in proc.stdout, proc.stdout[-3000:]
    _single_process_tests(TF_TESTS, env, at_least=9)
