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
