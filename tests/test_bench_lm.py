"""The language-model workload (``examples/lm_common.py``, ``examples/pytorch_lm.py``) and its
harness (``python -m benchmarks convergence --workload lm``): the split is the documented one, the
batches reproducible, and a tiny 2-rank run reports what it computed -- the bytes against the
compressor's counters, the loss against a direct evaluation of the saved parameters, the target and
the times to target against the curves. No timing assertions."""
import json
import os
import sys
import zlib

import numpy as np
import pytest

from tests.helpers import ROOT, run_bounded

sys.path.insert(0, os.path.join(ROOT, "examples"))
import lm_common as lm  # noqa: E402


def test_the_split_is_the_documented_one_and_the_text_is_the_files():
    corpus = lm.Corpus(max_train_mb=0.5, max_val_mb=0.2)
    root, files = lm.stdlib_root(), lm.source_files()
    assert files == sorted(files) and len(files) > 100
    assert all(zlib.crc32(f.encode()) % 10 == 0 for f in corpus.val_files)
    assert all(zlib.crc32(f.encode()) % 10 != 0 for f in corpus.train_files)
    assert not set(corpus.val_files) & set(corpus.train_files)
    # the first files of each side, in sorted order, each followed by a 0 byte
    assert corpus.train_files == [f for f in files if zlib.crc32(f.encode()) % 10][:len(corpus.train_files)]
    expect = b"".join(open(os.path.join(root, f), "rb").read() + b"\0" for f in corpus.val_files)
    assert corpus.val.tobytes() == expect
    m = corpus.manifest
    assert (m["train_files"], m["val_files"], m["train_bytes"], m["val_bytes"]) == (
        len(corpus.train_files), len(corpus.val_files), corpus.train.size, corpus.val.size)
    assert 0 < corpus.val.size <= 0.2e6 + max(os.path.getsize(os.path.join(root, f)) for f in corpus.val_files)


def test_batches_are_reproducible_per_seed_rank_and_step_and_validation_is_fixed():
    text = np.frombuffer(bytes(range(256)) * 64, dtype=np.uint8)
    x, y = lm.train_batch(text, 4, 16, seed=1, rank=0, step=5)
    assert x.shape == y.shape == (4, 16) and np.array_equal(x[:, 1:], y[:, :-1])
    assert np.array_equal(x, lm.train_batch(text, 4, 16, 1, 0, 5)[0])
    assert not np.array_equal(x, lm.train_batch(text, 4, 16, 1, 1, 5)[0])   # another rank
    assert not np.array_equal(x, lm.train_batch(text, 4, 16, 1, 0, 6)[0])   # another step
    vx, vy = lm.val_windows(text, 16, 8)
    assert vx[0, 0] == text[0] and vy[-1, -1] == text[-1]                   # the first and last bytes


def test_ngram_ids_are_the_documented_hash():
    import torch
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(3, 7))
    for n, rows in ((2, 16384), (3, 16384), (3, 1000)):
        ids = lm.ngram_ids(torch.from_numpy(x), n, rows).numpy()
        for b in range(3):
            for t in range(7):
                h = 0
                for i in range(t - n + 1, t + 1):  # oldest byte first, 0 before the window
                    h = h * 257 + (int(x[b, i]) if i >= 0 else 0)
                assert ids[b, t] == (h * 40503 + 7919 * n) % rows, (n, rows, b, t)
    # the tables start at zero, hold most of the parameters, and get gradients only in the rows used
    model = lm.make_model(32, 1, 2, 16, ngram_rows=4096)
    assert all(not t.weight.detach().any() for t in model.ngrams)
    ngram = sum(t.weight.numel() for t in model.ngrams)
    assert ngram == 2 * 4096 * 32 and ngram > sum(p.numel() for p in model.parameters()) - ngram
    xt = torch.from_numpy(x)
    model(xt).sum().backward()
    for n, t in zip((2, 3), model.ngrams):
        used = set(lm.ngram_ids(xt, n, 4096).flatten().tolist())
        touched = set(torch.nonzero(t.weight.grad.abs().sum(1)).flatten().tolist())
        assert touched <= used and len(touched) > 0


def test_lm_smoke_reports_what_it_computed(tmp_path):
    import torch

    steps, out = 8, tmp_path / "runs"
    cmd = [sys.executable, "-m", "benchmarks", "convergence", "--workload", "lm", "--np", "2", "--size", "tiny",
           "--steps", str(steps), "--eval-every", "4", "--seeds", "1", "--methods", "none,qsgd4,pqasgd",
           "--out", str(out), "--png", str(tmp_path / "lm.png"), "--json", str(tmp_path / "lm.json"),
           "--timeout", "200"]
    returncode, stdout = run_bounded(cmd, 600)
    assert returncode == 0, stdout[-5000:]
    r = json.loads((tmp_path / "lm.json").read_text())
    runs = {run["method"]: run["result"] for run in r["runs"]}
    assert list(runs) == ["none", "qsgd4", "pqasgd"]
    for method, res in runs.items():
        assert res["ranks_identical"] and res["steps"] == steps, method
        assert [p["step"] for p in res["curve"]] == [0, 4, 8] and res["final_val_bpb"] == res["curve"][-1]["val_bpb"]
        # the loss it reports is that of the parameters it saved, evaluated directly
        args = res["model"]
        model = lm.make_model(args["d_model"], args["layers"], args["heads"], args["context"],
                              args["ngram_rows"], args["ngram_orders"])
        model.load_state_dict(torch.load(out / f"{method}_s1.pt"))
        corpus = lm.Corpus(1, 0.2)
        assert corpus.manifest == res["corpus"]
        vx, vy = lm.val_windows(corpus.val, args["context"], 32)
        assert lm.bits_per_byte(model, vx, vy) == pytest.approx(res["final_val_bpb"], rel=1e-6), method
    # the bytes: 4 B per element and step in fp32; the compressor's counters otherwise
    assert runs["none"]["bytes_sent_total"] == 4 * runs["none"]["numel"] * steps
    for method in ("qsgd4", "pqasgd"):
        st = runs[method]["stats"]
        assert runs[method]["bytes_sent_total"] == st["bytes_sent"] + 4 * st["raw_elements"] > 0, method
        assert runs[method]["bytes_sent_total"] < 0.5 * runs["none"]["bytes_sent_total"], method
    assert runs["pqasgd"]["method_info"]["syncs"] == steps // 4
    # the target and the times to target, from the curves
    target = runs["none"]["final_val_bpb"] * 1.01
    assert r["target"] == pytest.approx(target)
    for method, res in runs.items():
        first = next((p["train_time"] for p in res["curve"] if p["val_bpb"] <= target), None)
        assert r["summary"][method]["times_to_target"] == [first], method
    assert (tmp_path / "lm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --project: the same runs' time to target over links of 1 and 10 Gbit/s (measured training time
    # plus the bytes sent by then over the rate), printed and recomputed here from the curves
    from benchmarks import convergence_lm
    returncode, stdout = run_bounded([sys.executable, "-m", "benchmarks", "convergence", "--workload", "lm",
                                      "--project", str(tmp_path / "lm.json"), "--project-gbps", "1,10"], 120)
    assert returncode == 0 and "PROJECTED" in stdout, stdout[-3000:]
    for method, res in runs.items():
        first = next((p for p in res["curve"] if p["val_bpb"] <= target), None)
        for g in (1, 10):
            want = None if first is None else first["train_time"] + first["bytes_sent_so_far"] * 8 / (g * 1e9)
            assert convergence_lm.projected_time_to_target(res, target, g) == want, (method, g)
    first = next(p for p in runs["none"]["curve"] if p["val_bpb"] <= target)
    row = next(line for line in stdout.split("PROJECTED")[1].splitlines() if line.startswith("| none (fp32) |"))
    assert row.split("|")[2].strip().startswith(f"{first['train_time'] + first['bytes_sent_so_far'] * 8 / 1e9:.1f},")
