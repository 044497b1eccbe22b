"""Smoke test of ``python -m benchmarks convergence``: a tiny 2-rank run of three methods (6 steps
each: PQASGD's period 4 then ends with its extra sync) prints a row per method and none for the
others, writes the PNG and the JSON, and the bytes it reports are the example's curves. Three
horovodrun launches of ~20-30 s each on a 2-core machine. (Every method ran here until the suite's
time had to come down; each method's own run of the example is tests/test_algorithms_convergence.py's
and tests/test_algorithms.py's.)"""
import json
import sys

from benchmarks.convergence import METHODS, TABLE_HEADER
from tests.helpers import run_bounded

STEPS = 6
SMOKED = ["none", "qsgd4", "pqasgd"]   # the reference, a compressed run, and the one with extra syncs
NUMEL = 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10


def test_bench_convergence_tiny(tmp_path):
    png, out = tmp_path / "conv.png", tmp_path / "conv.json"
    cmd = [sys.executable, "-m", "benchmarks", "convergence", "--np", "2", "--epochs", "1",
           "--max-steps", str(STEPS), "--methods", ",".join(SMOKED), "--png", str(png), "--json", str(out), "--timeout", "150"]
    returncode, stdout = run_bounded(cmd, 480)
    assert returncode == 0, stdout[-5000:]

    assert TABLE_HEADER in stdout, stdout[-3000:]
    table = stdout[stdout.index(TABLE_HEADER):].splitlines()
    for name, (label, _) in METHODS.items():
        rows = [ln for ln in table if ln.startswith(f"| {label} | ")]
        if name in SMOKED:
            assert len(rows) == 1 and "FAILED" not in rows[0], (name, table)
        else:
            assert rows == [], (name, table)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    r = json.loads(out.read_text())
    runs = {run["method"]: run for run in r["runs"]}
    assert list(runs) == SMOKED
    for name, run in runs.items():
        res = run["result"]
        assert run["status"] == 0 and res["np"] == 2 and res["steps"] == STEPS, name
        assert res["params_identical"], name
        (point,) = res["curve"]  # one epoch, cut to STEPS steps
        assert point["step"] == STEPS and point["bytes_sent_so_far"] == res["bytes_sent_total"] > 0, name
        assert point["test_accuracy"] == res["test_accuracy"], name
    assert runs["none"]["result"]["bytes_sent_total"] == 4 * NUMEL * STEPS
    for name in SMOKED[1:]:
        assert runs[name]["result"]["bytes_sent_total"] < 0.2 * 4 * NUMEL * STEPS, name
    # PQASGD: syncs after steps 4 and 6 (the last one so that the ranks end alike)
    assert runs["pqasgd"]["result"]["syncs"] == 2
