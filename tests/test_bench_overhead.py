"""``python -m benchmarks overhead``: TensorFlow's mode runs a tiny 2-rank job and prints a step time
for every tree and mode, and the first step's (traced and optimized); a mode TensorFlow does not
have is refused before anything is launched; ``--calls`` times the compressor's calls in one process."""
import re
import sys
from types import SimpleNamespace

from benchmarks import overhead
from tests.helpers import run_bounded


def test_tensorflow_refuses_the_modes_it_does_not_have(capsys):
    args = SimpleNamespace(worker=False, framework="tensorflow", modes="none,qsgd4-fused", trees=".", tensors="1")
    assert overhead.run(args) == 2
    assert "qsgd4-fused" in capsys.readouterr().out
    assert "qsgd4-fused" not in overhead.TF_MODES and "qsgd4-scatter" in overhead.TF_MODES


def test_tensorflow_overhead_tiny():
    cmd = [sys.executable, "-m", "benchmarks", "overhead", "--framework", "tensorflow", "--tensors", "2",
           "--steps", "2", "--warmup", "1", "--modes", "none,qsgd4-allgather,qsgd4-scatter"]
    returncode, stdout = run_bounded(cmd, 240)
    assert returncode == 0, stdout[-5000:]
    assert "tensorflow, 2 Gloo ranks" in stdout, stdout[-3000:]
    cell = r"([\d.]+) \[([\d.]+)\]"   # the step's wall time [its CPU time]
    row = re.search(rf"^\| \. \| 2 \| {cell} \| {cell} \| {cell} \|$", stdout, re.M)
    assert row and all(float(v) > 0 for v in row.groups()), stdout[-3000:]
    # the first step (traced, optimized, run) is timed too, and costs more than a later one
    first = re.search(r"^\| \. \| 2 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", stdout.split("The first step")[-1], re.M)
    assert "The first step (s)" in stdout and first, stdout[-3000:]
    assert all(float(f) > float(w) / 1e3 for f, w in zip(first.groups(), row.groups()[::2])), stdout[-3000:]


def test_calls_mode_times_compress_and_decompress_in_one_process():
    """``--calls``: a row per K and mode, the compressor's calls timed (QSGD's compress costs more than
    Horovod's own none, whose compress returns the tensor), without horovodrun."""
    cmd = [sys.executable, "-m", "benchmarks", "overhead", "--calls", "--tensors", "3", "--steps", "30",
           "--warmup", "1", "--modes", "none,qsgd4-buffered,floor-buffered"]
    returncode, stdout = run_bounded(cmd, 240)
    assert returncode == 0, stdout[-5000:]
    assert "one process (Horovod of one rank)" in stdout, stdout[-3000:]
    rows = dict(re.findall(r"^\| \. \| 3 \| (\S+) \| ([\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ / [\d.]+ \| "
                           r"[\d]+ / [\d]+) \|$", stdout, re.M))
    assert set(rows) == {"none", "qsgd4-buffered", "floor-buffered"}, stdout[-3000:]
    none, buffered, floor = ([float(v) for v in re.split(r" \| | / ", rows[m])]
                             for m in ("none", "qsgd4-buffered", "floor-buffered"))
    assert buffered[0] > none[0] and buffered[2] > 0 and buffered[3] > 0, stdout[-3000:]
    assert floor[2] > 0 and floor[3] > 0, stdout[-3000:]   # (its buffer's exchange: in the first decompress)
    # the Python instructions a gradient runs: Horovod's none returns its tensor (a few), the floor keeps
    # a view, the compressor names, checks and places it
    assert buffered[6] > floor[6] > none[6] > 0 and buffered[7] > floor[7] > 0, stdout[-3000:]
    # the fastest block of a call is at most its median (printed to the microsecond: within half of one)
    assert all(0 < row[4] <= row[0] + 0.55 and row[5] <= row[1] + 0.55 for row in (buffered, floor)), stdout[-3000:]


FLOOR_CHECK = """
import numpy as np, torch, horovod.torch as hvd
from benchmarks.overhead_floor import FloorAllgather, FloorBuffered, reference
from hvd_qsgd import codec
hvd.init()
floor = FloorBuffered(hvd, bits=4, bucket_size=512)
rng = np.random.default_rng(3)
for step in range(2):
    tensors = [rng.standard_normal(n).astype(np.float32) for n in (20000, 700, 5000)]
    handed = [floor.compress(torch.from_numpy(t)) for t in tensors]
    got = [floor.decompress(c, i).numpy() for c, i in handed]
    want = reference(4, 512, tensors, seed=step)
    assert all(np.array_equal(g, w) for g, w in zip(got, want)), step
    assert all(float(c.abs().sum()) == 0 for c, _ in handed)
gather = FloorAllgather(hvd, bits=4, bucket_size=512)
for step in range(2):
    tensors = [rng.standard_normal(n).astype(np.float32) for n in (20000, 700)]
    handed = [gather.compress(torch.from_numpy(t)) for t in tensors]
    for t, (c, key) in zip(tensors, handed):
        want = codec.decode(codec.encode(t, 4, 512, seed=key))
        assert np.array_equal(gather.decompress(c, key).numpy(), want), (step, key)
print("floor ok")
"""


def test_the_floor_modes_make_the_exchanges_they_are_compared_with():
    """``floor-buffered`` is a fair floor only if it does the work of a fusion buffer: its members at
    bucket-aligned offsets, encoded as one tensor, decoded, cut again; on one rank its results are
    those of the assembled buffer encoded and decoded, step after step. ``floor-allgather``: each
    gradient's own payload, encoded and decoded."""
    returncode, stdout = run_bounded([sys.executable, "-c", FLOOR_CHECK], 240)
    assert returncode == 0 and "floor ok" in stdout, stdout[-5000:]


def test_trees_are_launched_in_abba_order(monkeypatch):
    """Each tree takes the first and the second place of a round equally often (a launch's place moves
    its times), and with one tree nothing changes; the trees of a round share a hash seed."""
    from benchmarks.common import launch_order
    assert launch_order(["a", "b"], 4) == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert launch_order(["a"], 3) == ["a", "a", "a"]
    from benchmarks.common import paired_launches   # a round's trees with one hash seed, the rounds with others
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert paired_launches(["a", "b"], 3) == [("a", "0"), ("b", "0"), ("b", "1"), ("a", "1"), ("a", "2"), ("b", "2")]
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert {seed for _, seed in paired_launches(["a", "b"], 2)} == {"7"}


def test_codec_calls_mode_times_every_call_by_size():
    cmd = [sys.executable, "-m", "benchmarks", "overhead", "--codec-calls", "--steps", "5"]
    returncode, stdout = run_bounded(cmd, 240)
    assert returncode == 0, stdout[-5000:]
    rows = dict(re.findall(r"^\| ([a-z_.]+ ?\w*, [\dx ]+) \| ([\d.]+) \|$", stdout, re.M))
    assert {"encode kernel, 20000", "codec.encode, 2000", "decode_gathered, 16 x 20000",
            "decode_report, 2 x 2500"} <= set(rows), stdout[-3000:]
    assert all(float(v) > 0 for v in rows.values()), stdout[-3000:]
    # the codec's call does the kernel's work and more
    assert float(rows["codec.encode, 20000"]) > float(rows["encode kernel, 20000"]), stdout[-3000:]


def test_cuda_device_is_refused_where_it_cannot_run(capsys):
    """``--device cuda`` says why it cannot run (no device seen, TensorFlow, the codec's CPU calls) and
    launches nothing."""
    base = dict(worker=False, calls_worker=False, codec_calls_worker=False, codec_calls=False, calls=False,
                framework="torch", modes="none", trees=".", tensors="1", device="cuda")
    floor = overhead.run(SimpleNamespace(**{**base, "modes": "none,floor-buffered"}))
    assert floor == 2 and "floor modes encode CPU gradients only" in capsys.readouterr().out \
        or overhead.cuda_missing() is not None
    for more, why in ((dict(framework="tensorflow"), "PyTorch only"),
                      (dict(codec_calls=True), "the codec's calls are the CPU library's"),
                      ({}, overhead.cuda_missing())):
        if why is None:   # (a machine with a GPU and the CUDA kernels runs it: see docs/gpu.md)
            continue
        assert overhead.run(SimpleNamespace(**{**base, **more})) == 2
        assert f"--device cuda: {why}" in capsys.readouterr().out
