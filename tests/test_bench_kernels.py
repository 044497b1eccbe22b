"""The kernel benchmark runs end to end and reports what it measured (a smoke test; speed targets
are read from its output, never asserted in tests)."""
import json
import subprocess
import sys

import pytest

from hvd_qsgd import codec
from tests.helpers import ROOT


def test_kernel_benchmark_writes_every_measurement(tmp_path):
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "kernels", "--sizes", "64K", "--bits", "2,4",
                           "--repeats", "1", "--isa", "all", "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "64K" in proc.stdout and "e+d/memcpy" in proc.stdout and "roofline" in proc.stdout
    assert f"variant in use {codec.cpu_isa()}" in proc.stdout
    rows = json.loads(out.read_text())["cpu"]
    runnable = [name for name, runs in codec.cpu_isas().items() if runs]
    # every variant with both encoders, side by side (the default --encoder 2,1)
    assert sorted((r["numel"], r["bits"], r["isa"], r["encoder"]) for r in rows) == sorted(
        (65536, b, isa, e) for b in (2, 4) for isa in runnable for e in (1, 2))
    for r in rows:
        payload = codec.payload_nbytes(65536, r["bits"], 512)
        assert r["payload_bytes"] == payload
        assert r["qsgd_encode_s"] > 0 and r["qsgd_decode_s"] > 0 and r["memcpy_s"] > 0
        assert -1.0 < r["checksum_cost"] < 100.0
        assert r["threads"] == codec.get_num_threads()  # 2^16 elements: the parallel threshold
        assert abs(r["encode_ns_per_elem_thread"] - r["qsgd_encode_s"] * r["threads"] / 65536 * 1e9) < 1e-6
        # the roofline: bytes moved and floor time at memcpy's bandwidth (8 bytes per element)
        assert r["encode_bytes"] == r["decode_bytes"] == 4 * 65536 + payload
        bandwidth = 8 * 65536 / r["memcpy_s"]
        assert abs(r["encode_of_floor"] - r["encode_bytes"] / bandwidth / r["qsgd_encode_s"]) < 1e-9


def test_error_feedback_benchmark_checks_then_times_every_variant(tmp_path):
    """``benchmarks error-feedback``: the composed and fused steps, checked equal, then timed side by
    side for every variant this CPU runs, the CPU named."""
    out = tmp_path / "ef.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "error-feedback", "--sizes", "1000,70000", "--bits",
                           "2,8", "--repeats", "1", "--isa", "all", "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cpu: " in proc.stdout and "composed/fused" in proc.stdout
    runnable = [name for name, runs in codec.cpu_isas().items() if runs]
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["isa"], r["n"], r["bits"]) for r in rows) == sorted(
        (isa, n, b) for isa in runnable for n in (1000, 70000) for b in (2, 8))
    assert all(r["composed_us"] > 0 and r["fused_us"] > 0 and r["encode_us"] > 0 and r["composed_over_fused"] > 0
               for r in rows)



@pytest.mark.parametrize("argv,header", [(["--members", "5"], "staged/segmented"),
                                         (["--framework", "tensorflow"], "composed/fused")])
def test_error_feedback_benchmark_of_a_buffer_and_of_the_tensorflow_ops(argv, header, tmp_path):
    """``--members``: a fusion buffer staged against encoded where its members are; ``--framework
    tensorflow``: the TensorFlow ops composed against ``QsgdEncodeEf``; each checked equal, then timed."""
    out = tmp_path / "ef.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "error-feedback", "--sizes", "70000", "--bits", "4",
                           "--repeats", "1", "--json", str(out), *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert header in proc.stdout and "FAILED" not in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and all(rows[0][k] > 0 for k in ("composed_us", "fused_us", "encode_us")), rows

@pytest.mark.parametrize("argv,message", [
    (["--bits", "9"], "bits must be integers in 2..8"),
    (["--isa", "avx9000"], "--isa: avx9000 not among the variants this CPU runs"),
    (["--encoder", "3"], "encoder versions are 1 and 2"),
])
def test_kernel_benchmark_rejects_bad_arguments(argv, message, capsys):
    # the command's own parser, in this process (a subprocess each cost ~15 s of imports on 2 cores)
    from benchmarks.__main__ import main
    with pytest.raises(SystemExit) as stopped:
        main(["kernels", *argv])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
cpu family\t: {family}
model\t\t: {model}
model name\t: {name}
flags\t\t: fpu sse2 {flags}

processor\t: 1
model name\t: another block
"""


@pytest.mark.parametrize("vendor,family,model,name,flags,expected", [
    ("AuthenticAMD", 25, 1, "AMD EPYC", "avx2", "AMD EPYC (family 25 model 1, Zen 3; AVX2)"),
    ("AuthenticAMD", 25, 17, "AMD EPYC", "avx2 avx512f avx512bw", "AMD EPYC (family 25 model 17, Zen 4; AVX-512)"),
    ("AuthenticAMD", 26, 2, "AMD EPYC", "avx2 avx512f", "AMD EPYC (family 26 model 2, Zen 5; AVX-512)"),
    ("GenuineIntel", 6, 85, "Intel Xeon", "avx2 avx512f", "Intel Xeon (family 6 model 85; AVX-512)"),
    ("GenuineIntel", 6, 15, "Intel Core 2", "ssse3", "Intel Core 2 (family 6 model 15; no AVX2)"),
])
def test_reports_name_the_cpu_generation_and_its_vector_extension(vendor, family, model, name, flags, expected):
    """Machines whose model names are alike ("AMD EPYC") run the kernels at different speeds: every
    report names the CPUID family and model, AMD's core generation, and the widest vector extension,
    from the first processor's block of /proc/cpuinfo."""
    from benchmarks.common import cpu_description
    text = CPUINFO.format(vendor=vendor, family=family, model=model, name=name, flags=flags)
    assert cpu_description(text) == expected
