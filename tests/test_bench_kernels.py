"""The kernel benchmark runs end to end and reports what it measured (a smoke test; speed targets
are read from its output, never asserted in tests)."""
import json
import subprocess
import sys

from hvd_qsgd import codec
from tests.helpers import ROOT


def test_kernel_benchmark_writes_every_measurement(tmp_path):
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "kernels", "--sizes", "64K", "--bits", "2,4",
                           "--repeats", "1", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "64K" in proc.stdout and "e+d/memcpy" in proc.stdout
    rows = json.loads(out.read_text())["cpu"]
    assert sorted((r["numel"], r["bits"]) for r in rows) == [(65536, 2), (65536, 4)]
    for r in rows:
        assert r["payload_bytes"] == codec.payload_nbytes(65536, r["bits"], 512)
        assert r["qsgd_encode_s"] > 0 and r["qsgd_decode_s"] > 0 and r["memcpy_s"] > 0
        assert -1.0 < r["checksum_cost"] < 100.0


def test_kernel_benchmark_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "kernels", "--bits", "9"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "bits must be integers in 2..8" in proc.stderr
