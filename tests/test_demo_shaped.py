"""The demo's shaped-link part (scripts/demo.sh, benchmarks/demo_shaped.py, demo_rank.py,
demo_report.py): the cost model's projection and its label, a real 2-rank job over network
namespaces that reports bytes and a time, and the namespaces deleted when the demo is stopped.
The namespace tests are skipped, with the reason, where namespaces cannot be made."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hvd_qsgd import codec, cost_model, protocol
from benchmarks import demo_report, netns
from tests.digits_checks import ALL, QUANTIZED, RAW
from tests.helpers import ROOT, mp_env, run_bounded

ALPHA, RATE_BPS = cost_model.LATENCY_S, 1e9  # the projection's latency, the demo's 1 Gbit/s


def _result(compression, bits=None, n=2, steps=10, train_time_s=1.0):
    """What examples/pytorch_digits.py --json writes, as far as the report reads it (hidden 512)."""
    r = dict(compression=compression, bits=bits, bucket_size=512 if bits else None,
             min_numel=10000 if bits else None, np=n, epochs=1, steps=steps, batch_size=32, lr=0.05,
             momentum=0.9, seed=42, test_accuracy=0.9, bytes_per_step_none=4 * ALL,
             train_time_s=train_time_s, params_identical=True, stats=None, quantized=[],
             control_bytes_per_step=0)
    if compression == "none":
        r["bytes_per_step"] = 4 * ALL
    elif compression == "fp16":
        r["bytes_per_step"] = 2 * ALL
    else:
        payload = sum(codec.payload_nbytes(d, bits, 512) for d in QUANTIZED.values())
        r.update(bytes_per_step=payload + 4 * RAW, quantized=list(QUANTIZED),
                 stats=dict(raw_elements=RAW * steps), control_bytes_per_step=2 * 8 * protocol.control_length(n))
    return r


def _ring(n, nbytes):
    """A ring allreduce of nbytes by the cost model's formula, written out."""
    return 2 * (n - 1) * ALPHA + 2 * (n - 1) / n * nbytes / (RATE_BPS / 8)


def test_projection_prices_every_gradient_by_the_cost_model():
    sizes = [64 * 512, 512, 512 * 512, 512, 5120, 10]
    assert demo_report.hidden_of(_result("none")) == 512 and sum(sizes) == ALL
    assert [d for _, d in demo_report.digits_shapes(512)] == sizes
    # none and fp16: a ring allreduce of every gradient, 4 and 2 bytes an element
    for run, width in (("none", 4), ("fp16", 2)):
        expected = sum(_ring(4, width * d) for d in sizes)
        assert demo_report.comm_seconds(run, 4, 512, RATE_BPS) == pytest.approx(expected)
    # QSGD(4) on 2 ranks: the weights' payloads allgathered (n - 1 messages, n - 1 payloads received)
    # plus their control vectors, the rest as float32
    control = 8 * protocol.control_length(2)
    expected = sum(ALPHA + codec.payload_nbytes(d, 4, 512) / (RATE_BPS / 8) + _ring(2, control)
                   for d in QUANTIZED.values()) + sum(_ring(2, 4 * d) for d in sizes if d < 10000)
    assert demo_report.comm_seconds("qsgd4", 2, 512, RATE_BPS) == pytest.approx(expected)
    # 4 ranks: each weight by the reduction the library's default ("auto") picks by the cost model,
    # the biases and fc3 as float32; far fewer bytes than fp32
    modes = dict((shapes[0][0], mode) for mode, shapes in demo_report.plan("qsgd4", 4, 512))
    for name, d in QUANTIZED.items():
        picked = cost_model.choose(4, d, 4, 512)
        assert modes[name] == "qsgd4-" + ("allgather" if picked == "allgather" else "scatter"), (name, picked)
    assert [modes[k] for k in ("fc1.bias", "fc2.bias", "fc3.weight", "fc3.bias")] == ["none"] * 4
    assert demo_report.wire_bytes("qsgd4", 4, 512) < 0.2 * demo_report.wire_bytes("none", 4, 512)


# one rank's CPU parts of a step (seconds), as demo_report.time_parts gives them for hidden 512
PARTS = dict(hidden=512, compute_s=0.004, cast_s=0.001,
             codec={"fc1.weight": dict(encode_s={"4": 0.0002}, decode1_s={"4": 0.0001}),
                    "fc2.weight": dict(encode_s={"4": 0.002}, decode1_s={"4": 0.001})})


def test_projected_step_is_cpu_per_core_share_plus_the_link():
    # 4 ranks on 2 cores: each rank's CPU time counts twice; QSGD adds each gradient's codec work for
    # its reduction: allgather encodes once and decodes n payloads, scatter_allgather encodes 1 + 1/n
    # times (its chunk is re-encoded) and decodes twice
    codec_s = 0.0
    for name, d in QUANTIZED.items():
        enc, dec = PARTS["codec"][name]["encode_s"]["4"], PARTS["codec"][name]["decode1_s"]["4"]
        codec_s += enc + 4 * dec if cost_model.choose(4, d, 4, 512) == "allgather" else enc * 1.25 + 2 * dec
    p = demo_report.projection("qsgd4", 4, RATE_BPS, PARTS, cores=2)
    assert p["share"] == 2 and p["cpu_s"] == pytest.approx(0.004 + codec_s)
    assert p["step_s"] == pytest.approx(2 * (0.004 + codec_s) + demo_report.comm_seconds("qsgd4", 4, 512, RATE_BPS))
    fp16 = demo_report.projection("fp16", 4, RATE_BPS, PARTS, cores=8)  # one rank a core: no sharing
    assert fp16["share"] == 1 and fp16["step_s"] == pytest.approx(
        0.005 + demo_report.comm_seconds("fp16", 4, 512, RATE_BPS))


def test_report_labels_measured_and_projected_columns():
    loop = {"none": _result("none", n=4, steps=20, train_time_s=1.0),
            "qsgd4": _result("qsgd", 4, n=4, steps=20, train_time_s=2.0)}
    shaped = {"none": dict(_result("none", n=4, steps=10, train_time_s=1.5), link=dict(tx_bytes=30_000_000)),
              "qsgd4": dict(_result("qsgd", 4, n=4, steps=10, train_time_s=1.2), link=dict(tx_bytes=5_000_000))}
    record = dict(kind="measured", rate="1gbit", np=4, hidden=512)
    lines, problems = demo_report.render(loop, record, shaped, parts=PARTS, cores=2)
    text = "\n".join(lines)
    assert problems == []
    head = next(ln for ln in lines if ln.startswith("| compression"))
    assert "loopback ms/step" in head and "| 1 Gbit/s ms/step |" in head and "| 1 Gbit/s PROJECTED ms/step |" in head
    none_row = next(ln for ln in lines if ln.startswith("| none"))
    cells = [c.strip() for c in none_row.strip("|").split("|")]
    assert cells[4] == "50 (1.0 s)" and cells[5] == "150 (1.5 s)"
    projected = 1e3 * demo_report.projection("none", 4, RATE_BPS, PARTS, cores=2)["step_s"]
    assert cells[6] == f"{projected:.0f}"
    assert "1 Gbit/s: the same runs, shorter: 10 steps; 4 ranks in network namespaces" in text
    assert "time the link added per step (shaped - loopback): none +100 ms, QSGD(4) +20 ms" in text
    assert "1 Gbit/s: speed-up vs none per step: QSGD(4) 1.25x" in text
    assert "none 3.00 MB out, QSGD(4) 0.50 MB out" in text
    assert "PROJECTED per step: none: 2 x 4.0 ms CPU + " in text and "x 2 ranks per core of this machine" in text

    # without shaped runs: the projection only, labelled, with the reason
    lines, _ = demo_report.render(loop, dict(kind="projection", rate="1gbit", np=4, hidden=512, reason="not root"),
                                  parts=PARTS, cores=2)
    head = next(ln for ln in lines if ln.startswith("| compression"))
    assert "PROJECTED" in head and "| 1 Gbit/s ms/step" not in head
    assert "[demo] NO shaped-link runs (not root)" in lines
    assert any("a cost-model projection, not a measurement" in ln for ln in lines)

    # a wider model on the links: both of its columns say so
    wide = 4 * sum(d for _, d in demo_report.digits_shapes(1024))
    big = {k: dict(v, bytes_per_step_none=wide) for k, v in shaped.items()}
    # (at hidden 1024 fc3.weight, 10,240 elements, is quantized too)
    parts = dict(PARTS, hidden=1024, codec=dict(PARTS["codec"], **{"fc3.weight": PARTS["codec"]["fc1.weight"]}))
    lines, _ = demo_report.render(loop, record, big, parts=parts, cores=2)
    assert any("the same trainings of a 64-1024-1024-10 MLP, NOT the loopback runs' model" in ln for ln in lines)
    head = next(ln for ln in lines if ln.startswith("| compression"))
    assert "| 1 Gbit/s ms/step (hidden 1024) |" in head and "| 1 Gbit/s PROJECTED ms/step (hidden 1024) |" in head
    with pytest.raises(ValueError):  # parts of another model
        demo_report.render(loop, record, big, parts=PARTS)


def _table(out):
    """{compression: cells} of the demo's table."""
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and not ln.startswith("| compression")]
    return {c[0]: c for c in ([x.strip() for x in ln.strip("|").split("|")] for ln in rows)}


@pytest.mark.multirank
@pytest.mark.slow
def test_demo_script_projection(tmp_path):
    """DEMO_SHAPED=projection: one loopback run on 2 ranks, no namespaces, the labelled projection."""
    env = dict(mp_env(), DEMO_SHAPED="projection", DEMO_EPOCHS="1", DEMO_RUNS="qsgd4", DEMO_SHAPED_HIDDEN="512",
               TMPDIR=str(tmp_path))
    status, out = run_bounded(["bash", "scripts/demo.sh", "2"], 120, env=env)
    assert status == 0, out[-5000:]
    assert "[demo] NO shaped-link runs (DEMO_SHAPED=projection)" in out
    assert "1 Gbit/s PROJECTED: a cost-model projection, not a measurement" in out
    head = next(ln for ln in out.splitlines() if ln.startswith("| compression"))
    assert "| 1 Gbit/s PROJECTED ms/step |" in head and "| 1 Gbit/s ms/step" not in head
    (row,) = _table(out).values()
    payload = sum(codec.payload_nbytes(d, 4, 512) for d in QUANTIZED.values())
    assert row[0] == "QSGD(4)" and row[2] == f"{payload + 4 * RAW:,}" and row[3] == "0.145 (6.9x less)"
    # the projected step: one rank's CPU time timed here (2 ranks share 2 cores: x 1) + the model's link
    # time of a 2-rank QSGD(4) step at 1 Gbit/s (~1.5 ms)
    m = re.search(r"PROJECTED per step: QSGD\(4\): (\S+) x ([\d.]+) ms CPU \+ ([\d.]+) ms link", out)
    share, cpu, link = float(m.group(1)), float(m.group(2)), float(m.group(3))
    assert share == max(1, 2 / os.cpu_count()) and cpu > 0
    assert link == pytest.approx(1e3 * demo_report.comm_seconds("qsgd4", 2, 512, RATE_BPS), abs=0.05)
    assert abs(float(row[5]) - (share * cpu + link)) <= 1
    assert re.search(r"\[demo\] total \d+s", out)
    assert "network namespaces" not in out and "shaped links" not in out  # nothing was made
    assert not list(tmp_path.glob("hvd_qsgd_demo.*")), "the demo left its temporary directory"


def _skip_without_netns():
    reason = netns.probe()
    if reason:
        pytest.skip(f"network namespaces cannot be made here: {reason}")


@pytest.mark.multirank
@pytest.mark.slow
def test_shaped_runs_over_namespaces_report_bytes_and_time(tmp_path):
    _skip_without_netns()
    out_dir = tmp_path / "shaped"
    cmd = [sys.executable, "-m", "benchmarks.demo_shaped", "--np", "2", "--rate", "1gbit", "--runs", "none,qsgd4",
           "--max-steps", "5", "--timeout", "50", "--out", str(out_dir)]
    status, out = run_bounded(cmd, 110, env=dict(mp_env(), DEMO_SHAPED="measure"), stop_signal=signal.SIGTERM)
    assert status == 0, out[-5000:]
    prefix = re.search(r"namespaces (hq\d+)\*", out).group(1)
    assert [ns for ns in netns.list_namespaces() if ns.startswith(prefix)] == []
    record = json.loads((out_dir / "shaped.json").read_text())
    assert record["kind"] == "measured" and record["np"] == 2
    assert len(record["qdiscs"]) == 4 and all("tbf" in q and "rate 1Gbit" in q for q in record["qdiscs"])
    runs = {run: json.loads((out_dir / f"{run}.json").read_text()) for run in ("none", "qsgd4")}
    for r in runs.values():
        assert r["np"] == 2 and r["steps"] == 5 and r["params_identical"] and r["train_time_s"] > 0
        # every step's exchange crossed the shaped veth: at 2 ranks a rank sends at least its own
        # contribution each step (the ring sends 2 (n - 1) / n of it, the allgather all of it)
        assert r["link"]["rate"] == "1gbit" and r["link"]["tx_bytes"] >= 5 * r["bytes_per_step"]
        assert r["link"]["rx_bytes"] >= 5 * r["bytes_per_step"]
    assert runs["none"]["bytes_per_step"] == 4 * ALL and runs["qsgd4"]["bits"] == 4
    assert runs["qsgd4"]["link"]["tx_bytes"] < 0.5 * runs["none"]["link"]["tx_bytes"]
    assert "[demo] shaped qsgd4: 5 steps, training" in out


@pytest.mark.multirank
@pytest.mark.slow
def test_the_tensorflow_example_over_shaped_links(tmp_path):
    """``--example tensorflow2_digits``: the TensorFlow example, unchanged, runs QSGD(4) over the
    shaped links, and rank 0's veth carries its exchange: at least its own payloads each step, and
    less than half of what float32 gradients would need (the measurement at 4 ranks and hidden 4096:
    docs/performance.md, "TensorFlow examples")."""
    _skip_without_netns()
    out_dir = tmp_path / "shaped"
    cmd = [sys.executable, "-m", "benchmarks.demo_shaped", "--np", "2", "--rate", "1gbit", "--runs", "qsgd4",
           "--max-steps", "4", "--timeout", "80", "--out", str(out_dir), "--example", "tensorflow2_digits"]
    status, out = run_bounded(cmd, 140, env=dict(mp_env(), DEMO_SHAPED="measure"), stop_signal=signal.SIGTERM)
    assert status == 0, out[-5000:]
    record = json.loads((out_dir / "shaped.json").read_text())
    assert record["kind"] == "measured" and record["example"] == "tensorflow2_digits"
    r = json.loads((out_dir / "qsgd4.json").read_text())
    assert r["framework"] == "tensorflow" and r["steps"] == 4 and r["params_identical"], r
    assert 4 * r["bytes_per_step"] <= r["link"]["tx_bytes"] < 0.5 * 4 * 4 * ALL, r["link"]


def _processes_naming(text):
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read() and int(pid) != os.getpid():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


@pytest.mark.multirank
@pytest.mark.slow
def test_sigterm_to_the_demo_deletes_its_namespaces(tmp_path):
    _skip_without_netns()
    env = dict(mp_env(), DEMO_SHAPED="measure", DEMO_EPOCHS="1", DEMO_SHAPED_STEPS="100000",
               DEMO_SHAPED_HIDDEN="512", DEMO_RUNS="none", TMPDIR=str(tmp_path))
    proc = subprocess.Popen(["bash", "scripts/demo.sh", "2"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        ours = []
        while time.monotonic() < deadline and proc.poll() is None:
            mine = set(_processes_naming(str(tmp_path)))  # the demo's temporary directory is in tmp_path
            drivers = [p for p in _processes_naming("benchmarks.demo_shaped") if p in mine]
            ranks = [p for p in _processes_naming("benchmarks.demo_rank") if p in mine]
            # the namespaces of the shaped run: named after its process (netns.Topology)
            ours = [ns for ns in netns.list_namespaces() for d in drivers if re.fullmatch(rf"hq{d}(s|r\d+)", ns)]
            if len(ours) == 3 and len(ranks) >= 2:
                break
            time.sleep(0.3)
        assert len(ours) == 3 and proc.poll() is None, "the shaped run did not start"
        time.sleep(3)  # the ranks are importing or training
        proc.send_signal(signal.SIGTERM)  # bash only: the shaped run and its ranks are its children
        out, _ = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 143, out[-4000:]
    assert "interrupted" in out, out[-4000:]
    assert set(netns.list_namespaces()) & set(ours) == set()
    assert _processes_naming(str(tmp_path)) == []
    assert not list(tmp_path.glob("hvd_qsgd_demo.*"))
