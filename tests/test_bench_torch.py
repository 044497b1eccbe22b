"""Smoke test of ``python -m benchmarks torch``: a tiny 2-rank run writes its table, JSON and
plot, and the bytes it reports are the codec's payload sizes of the model's quantized tensors."""
import json
import sys

from hvd_qsgd import codec
from tests.helpers import run_bounded

# --hidden 256: Linear(128, 256), Linear(256, 128), Linear(128, 10), weights then biases
WEIGHTS = [256 * 128, 128 * 256, 10 * 128]
BIASES = [256, 128, 10]
NUMEL = sum(WEIGHTS) + sum(BIASES)
BUCKETS = {2: 128, 4: 512, 8: 512}   # the compressor's defaults
MIN_NUMEL = 10000                      # its default: smaller tensors are allreduced in fp32


def test_bench_torch_tiny(tmp_path):
    out_dir = tmp_path / "torch"
    cmd = [sys.executable, "-m", "benchmarks", "torch", "--np", "2", "--steps", "2", "--warmup", "1",
           "--hidden", "256", "--batch", "8", "--out", str(out_dir), "--timeout", "100"]
    returncode, stdout = run_bounded(cmd, 120)
    assert returncode == 0, stdout[-5000:]

    assert "| ranks | mode |" in stdout and "| 2 | QSGD(4) |" in stdout, stdout[-3000:]
    assert (out_dir / "table.md").read_text().startswith("| ranks | mode |")
    assert (out_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = json.loads((out_dir / "results.json").read_text())
    assert r["checks_ok"] and r["failed_np"] == []
    (run,) = r["runs"]
    assert run["np"] == 2 and run["numel"] == NUMEL
    rows = {row["mode"]: row for row in run["rows"]}
    assert set(rows) == {"compute", "none", "fp16", "qsgd2", "qsgd4", "qsgd8"}
    assert rows["none"]["sent_bytes_per_step"] == 4 * NUMEL
    assert rows["fp16"]["sent_bytes_per_step"] == 2 * NUMEL

    raw = sum(BIASES) + sum(w for w in WEIGHTS if w < MIN_NUMEL)
    for bits, bucket in BUCKETS.items():
        row = rows[f"qsgd{bits}"]
        payloads = sum(codec.payload_nbytes(w, bits, bucket) for w in WEIGHTS if w >= MIN_NUMEL)
        assert row["payload_bytes_per_step"] == payloads, bits
        assert row["raw_elements_per_step"] == raw, bits
        assert row["sent_bytes_per_step"] == payloads + 4 * raw, bits
        # 2 ranks: the other rank's payloads come in, and a ring allreduce receives 2(n-1)/n = 1 x S
        assert row["payload_bytes_received_per_step"] == payloads, bits
        assert row["recv_bytes_per_step"] == payloads + 4 * raw, bits
        assert row["params_identical_across_ranks"], bits
        assert len(row["step_s_max_over_ranks"]) == 2 and min(row["step_s_max_over_ranks"]) > 0
