"""``python -m benchmarks nodes``: the projection's numbers are the cost model's and the measured
kernels', its bounds hold where they can be derived by hand, and every table says PROJECTED.
One process, no Horovod job."""
import json
import math
import subprocess
import sys

import pytest

from benchmarks import nodes
from benchmarks.common import module_main
from hvd_qsgd import cost_model, protocol, settings
from tests.helpers import ROOT

MLP_SHAPES = nodes.model_shapes("mlp50m")


def _run(tmp_path, capsys, *argv):
    """(printed text, the JSON rows by (layout, rate, method), the JSON) of one in-process run."""
    out = tmp_path / "nodes.json"
    assert module_main("nodes", nodes.add_arguments, nodes.run, list(argv) + ["--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {(r["layout"], r["rate_gbps"], r["method"]): r for r in data["rows"]}
    return capsys.readouterr().out, rows, data


def test_models_have_the_documented_tensors():
    assert sum(d for _, d in MLP_SHAPES) == 50_384_906 and len(MLP_SHAPES) == 8
    resnet = nodes.resnet50_shapes()
    assert len(resnet) == 161 and sum(d for _, d in resnet) == 25_557_032
    assert len({name for name, _ in resnet}) == 161


def test_hierarchical_bytes_are_node_costs_and_a_quarter_of_fp16s_at_2x8(tmp_path, capsys):
    text, rows, data = _run(tmp_path, capsys, "--layouts", "2x8,4x8", "--rates", "25,100")
    bucket, min_numel = settings.default_bucket_size(4), settings.Settings().min_numel
    big = [d for _, d in MLP_SHAPES if d >= min_numel]
    small = [d for _, d in MLP_SHAPES if d < min_numel]
    assert len(big) == 4 and data["bucket_size"] == bucket and data["min_numel"] == min_numel
    d_all = sum(d for _, d in MLP_SHAPES)
    for (c, L) in ((2, 8), (4, 8)):
        layout = f"{c}x{L}"
        for method, reduction in (("qsgd4-hierarchical", "hierarchical"), ("qsgd4-scatter", "scatter_allgather"),
                                  ("qsgd4-allgather", "allgather")):
            r = rows[layout, 25.0, method]
            costs = [cost_model.node_costs(reduction, L, c, d, 4, bucket) for d in big]
            assert r["cross_bytes_compressed"] == pytest.approx(sum(x[1] for x in costs), rel=1e-12)
            # the rest: float32 small tensors and the control vectors, through the hierarchical allreduce
            rest = 4 * sum(small) + 8 * protocol.control_length(c * L) * len(big)
            assert r["cross_bytes_allreduce"] == pytest.approx(2 * (c - 1) / c * rest, rel=1e-12)
            assert r["cross_bytes"] == pytest.approx(r["cross_bytes_compressed"] + r["cross_bytes_allreduce"])
            assert r["messages"] == sum(x[0] for x in costs) + 2 * (L - 1) + 2 * (c - 1)
        fp16, ring = rows[layout, 25.0, "fp16"], rows[layout, 25.0, "fp16-ring"]
        assert fp16["cross_bytes"] == pytest.approx(2 * (c - 1) / c * 2 * d_all, rel=1e-12)
        assert ring["cross_bytes"] == pytest.approx(2 * (c * L - 1) / (c * L) * 2 * d_all, rel=1e-12)
    # at 2 x 8 the hierarchical cross stage sends about d/2 bytes (4 bits, scales) against fp16's 2d
    hier, fp16 = rows["2x8", 25.0, "qsgd4-hierarchical"], rows["2x8", 25.0, "fp16"]
    assert 0.5 * d_all < hier["cross_bytes"] < 0.53 * d_all < 2 * d_all == pytest.approx(fp16["cross_bytes"])
    assert hier["step_s"] < fp16["step_s"] and hier["speedup_fp16"] > 1
    assert text.count("**PROJECTED (not measured)**") == 2 and data["projected"] is True


def test_times_are_the_cost_models_plus_the_kernels(tmp_path, capsys):
    _, rows, data = _run(tmp_path, capsys, "--layouts", "2x8", "--rates", "100", "--latency-us", "10",
                         "--intra-gbps", "1000", "--compute-ms", "7")
    points = nodes.load_kernels(f"{ROOT}/docs/gpu_h100_kernels.json", 4)
    big = [d for _, d in MLP_SHAPES if d >= 10000]
    r = rows["2x8", 100.0, "qsgd4-hierarchical"]
    exchange = sum(cost_model.seconds_in_nodes("hierarchical", 8, 2, d, 4, 512, 10e-6, 100e9 / 8, 1000e9 / 8)
                   for d in big)
    ar = r["cross_bytes_allreduce"]
    assert r["comm_s"] == pytest.approx(exchange + 16 * 10e-6 + ar / (100e9 / 8) + 2 * 7 / 8 * ar / (1000e9 / 8))
    codec_s = sum(nodes.kernel_seconds(points, 1, -(-d // 8)) + nodes.kernel_seconds(points, 2, 2 * -(-d // 8))
                  for d in big)
    assert r["codec_s"] == pytest.approx(codec_s) and codec_s > 0
    assert r["step_s"] == pytest.approx(7e-3 + r["comm_s"] + r["codec_s"])
    assert rows["2x8", 100.0, "fp16"]["codec_s"] == 0 and data["alpha_s"] == pytest.approx(10e-6)
    for row in rows.values():
        assert row["speedup_fp16"] == pytest.approx(rows["2x8", 100.0, "fp16"]["step_s"] / row["step_s"])


def test_kernel_times_interpolate_the_measured_rows():
    points = nodes.load_kernels(f"{ROOT}/docs/gpu_h100_kernels.json", 4)
    data = json.load(open(f"{ROOT}/docs/gpu_h100_kernels.json"))
    row = next(r for r in data["cuda"]["rows"] if r["numel"] == 1 << 24 and r["bits"] == 4 and not r.get("variant"))
    assert nodes.kernel_seconds(points, 1, 1 << 24) == pytest.approx(4 * (1 << 24) / (row["encode_gbps"] * 1e9))
    lo, hi = nodes.kernel_seconds(points, 2, 1 << 20), nodes.kernel_seconds(points, 2, 1 << 24)
    assert nodes.kernel_seconds(points, 2, (1 << 20) + (1 << 24) >> 1) == pytest.approx((lo + hi) / 2)
    assert nodes.kernel_seconds(points, 2, 1000) == lo                     # the fixed cost below 1M
    top = points[-1]
    assert nodes.kernel_seconds(points, 1, 2 * top[0]) == pytest.approx(2 * top[1])  # throughput held above
    assert len(points) == 4 and all(math.isfinite(v) for p in points for v in p)


def test_hierarchical_stays_under_the_fp16_bound_where_nodes_are_many(tmp_path, capsys):
    """At 16 nodes the cross stage is scatter_allgather: L (c-1) (2 P_s / c + 8) bytes leave a node,
    about 2 (c-1)/c P = 2 (c-1)/c d/2 at 4 bits, a quarter of the fp16 bound's 2 (c-1)/c 2d (the
    direct sends of an allgather cross stage would be L (c-1) P_s, about 7.5 d, four times the bound)."""
    _, rows, _ = _run(tmp_path, capsys, "--layouts", "16x8", "--rates", "400")
    hier, fp16 = rows["16x8", 400.0, "qsgd4-hierarchical"], rows["16x8", 400.0, "fp16"]
    assert cost_model.cross_stage(8, 16, 4096 * 4096 // 8, 4, 512, bandwidth_bps=400e9 / 8) == "scatter_allgather"
    assert 0.24 < hier["cross_bytes_compressed"] / fp16["cross_bytes"] < 0.27, (hier, fp16)


def test_the_command_line_plots_with_other_kernels(tmp_path):
    png = tmp_path / "nodes.png"
    cmd = [sys.executable, "-m", "benchmarks", "nodes", "--model", "resnet50", "--layouts", "2x4", "--rates",
           "10,100", "--kernels", "docs/gpu_h200_kernels.json", "--png", str(png)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "**PROJECTED (not measured)**: 2x4" in done.stdout and "docs/gpu_h200_kernels.json" in done.stdout
    assert "161 tensors" in done.stdout and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        module_main("nodes", nodes.add_arguments, nodes.run, ["--layouts", "1x1"])
    assert e.value.code == 2 and "NODESxGPUS" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module_main("nodes", nodes.add_arguments, nodes.run, ["--rates", "0"])
    assert module_main("nodes", nodes.add_arguments, nodes.run, ["--kernels", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err
    assert module_main("nodes", nodes.add_arguments, nodes.run, ["--intra-gbps", "0"]) == 2
