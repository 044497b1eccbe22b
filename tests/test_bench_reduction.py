"""Smoke test of ``python -m benchmarks reduction``: at 2 and 3 ranks the counted bytes per rank
are those of the payloads (allgather: (n-1) P exactly) and scatter_allgather stays within 1.2x of
2 (n-1)/n * d * b/8 while allgather's ratio grows with n."""
import json
import sys

import pytest

from hvd_qsgd import codec
from tests.helpers import run_bounded


def test_bench_reduction_tiny(tmp_path):
    d = 200000
    cmd = [sys.executable, "-m", "benchmarks", "reduction", "--np", "2", "3", "--numel", str(d), "--steps", "2",
           "--out", str(tmp_path), "--timeout", "100"]
    returncode, stdout = run_bounded(cmd, 150)
    assert returncode == 0, stdout[-5000:]
    rows = {(r["n"], r["reduction"]): r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    p = codec.payload_nbytes(d, 4, 512)
    for n in (2, 3):
        assert rows[n, "allgather"]["recv_per_rank"] == (n - 1) * p
        assert rows[n, "allgather"]["sent_per_rank"] == p
        assert 1.0 <= rows[n, "scatter_allgather"]["ratio"] <= 1.2
    assert rows[3, "allgather"]["ratio"] > 1.45 > rows[3, "scatter_allgather"]["ratio"]
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def test_element_counts_take_the_kernel_benchmarks_suffixes():
    """--numel of the reduction and overhead benchmarks reads 4M, 64K as --sizes does (powers of 1024)."""
    import argparse
    from benchmarks import overhead, reduction
    for module, default in ((reduction, 1 << 22), (overhead, 20000)):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        assert p.parse_args(["--numel", "4M"]).numel == 4 << 20 and p.parse_args(["--numel", "64K"]).numel == 65536
        assert p.parse_args(["--numel", "300"]).numel == 300 and p.parse_args([]).numel == default
        for bad in ("0", "4X", "-1K"):
            with pytest.raises(SystemExit):
                p.parse_args(["--numel", bad])
