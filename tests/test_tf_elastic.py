"""Elastic Horovod training in TensorFlow (Keras 3) with ``hvd_qsgd.QSGD(4, error_feedback=True)``,
``hvd_qsgd.tensorflow.elastic.run`` and ``TensorFlowKerasState`` (worker: tests/mp/tf_elastic_worker.py).

One launch, as tests/test_elastic.py's (whose docstring explains the host names, the timeouts and
the data): ``horovodrun -np 3 --min-np 2 --max-np 3`` over Gloo; the worker on 127.0.0.1 SIGKILLs
itself in the backward pass of step 23 (last commit: step 20); the survivors roll back to step 20
and go on as 2 ranks; 127.0.0.1 is back 1-2 s later and a new worker joins at a commit, at step 40
at the latest; the job ends after 84 steps on 3 ranks. About 50 s here, 20 of them one survivor
waiting for Gloo's timeout.

Checked, from the ranks' ``ELASTIC`` lines: the compressor state is consistent on every rank at
every point between steps (``check_compressor_state``): the statistics count the steps kept, the
exchange counters after the failure are the last commit's, every residual is zero after each reset
and on the new worker, and all ranks have the same creation index, counters and residual layout at
every restart, commit and at the end; all final ranks hold bit-identical weights; the test accuracy
is within the 3-sigma bound of tests/digits_checks.py of the uncompressed run's (``--reference``,
computed alongside the elastic job).
"""
import json
import os
import subprocess
import sys

from tests.elastic_checks import (CLEAN, EPOCHS, LAST_COMMIT, STEPS, check_failure, check_final, check_rejoin,
                                  check_restart_after_failure, events, run_elastic)
from tests.helpers import ROOT, mp_env
from tests.digits_checks import RAW

WORKER = os.path.join(ROOT, "tests", "mp", "tf_elastic_worker.py")
# the quantized exchanges by state key (<traced function>:<position>): fc1's and fc2's kernels
QUANTIZED = {"train_step:0": 64 * 512, "train_step:1": 512 * 512}


def summary(lines):
    """One line per event, for the test's output (pytest -s, or on a failure)."""
    t0 = min(d["time"] for d in lines)
    return "\n".join(
        f"{d['time'] - t0:6.1f}s {d['event']:8} pid {d['pid']} {d['host']:9} rank {d['rank']} size {d['size']} "
        f"step {d['step']:3} seq {d['seq']} occurrences {d['occurrences']} residuals "
        f"{ {k: v[1] for k, v in d['residuals'].items()} } tensors {d['stats']['tensors']} digest {d['digest']}"
        + (f" init {d['init_s']} s" if "init_s" in d else "")
        for d in sorted(lines, key=lambda d: d["time"]) if d["event"] != "commit" or d["step"] in (20, 25, STEPS))


def check_compressor_state(lines):
    """The compressor's state on every rank at every point between steps, across the failure and the
    rejoin (the framework-neutral checks: tests/elastic_checks.py); returns (the survivors' pids, the
    new worker's start event)."""
    first, victim, survivors = check_failure(lines)
    assert len({d["creation_index"] for d in lines}) == 1

    for d in lines:
        if d["event"] not in CLEAN:
            continue
        done = d["step"] - first[d["pid"]]
        where = f"{d['event']} of pid {d['pid']} at step {d['step']}"
        # Occurrence counters: one exchange per quantized kernel and step (none before the first trace).
        assert d["occurrences"] == ({k: d["step"] for k in QUANTIZED} if d["step"] else {}), where
        assert d["slots"] == [], where
        # Statistics count the steps this process did and kept (the undone ones are rolled back).
        s = d["stats"]
        assert s["tensors"] == len(QUANTIZED) * done and s["elements"] == sum(QUANTIZED.values()) * done, where
        assert s["raw_tensors"] == 4 * done and s["raw_elements"] == RAW * done, where
        # Residuals: one per quantized kernel once a step ran anywhere; zero after a (re)start.
        sizes = {k: v[0] for k, v in d["residuals"].items()}
        assert sizes == (QUANTIZED if d["step"] else {}), where
        if d["event"] in ("start", "reset"):
            assert all(v[1] == 0 for v in d["residuals"].values()), where
        elif done > 0:
            assert all(v[1] > 0 for v in d["residuals"].values()), where

    # The failure: the survivors go back to the commit before it (counters and names: the commit's
    # digest) and restart there as ranks 0 and 1 of 2.
    committed = {d["pid"]: d["digest"] for d in lines if d["event"] == "commit" and d["step"] == LAST_COMMIT}
    for event, after in check_restart_after_failure(lines, survivors).items():
        assert all(d["digest"] == committed[d["pid"]] for d in after), (event, after, committed)
    return survivors, check_rejoin(lines, victim, survivors)


def test_worker_killed_mid_step_then_rejoined(tmp_path):
    reference = tmp_path / "reference.json"
    ref = subprocess.Popen([sys.executable, WORKER, "--reference", str(reference), "--epochs", str(EPOCHS)],
                           cwd=ROOT, env=mp_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        returncode, out, seconds = run_elastic(WORKER, tmp_path, [], 180)
        ref_out, _ = ref.communicate(timeout=120)
    finally:
        if ref.poll() is None:
            ref.kill()
            ref.wait()
    assert returncode == 0, f"the elastic job exited with {returncode}:\n{out[-5000:]}"
    assert ref.returncode == 0, ref_out[-3000:]
    lines = events(out)
    print(f"the elastic job took {seconds:.1f} s\n{summary(lines)}")
    try:
        survivors, newcomer = check_compressor_state(lines)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{summary(lines)}") from e
    check_final(lines, survivors, newcomer, json.loads(reference.read_text()))
