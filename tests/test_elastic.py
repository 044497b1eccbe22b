"""Elastic Horovod training with ``hvd_qsgd.QSGD(4, error_feedback=True)`` and
``hvd_qsgd.torch.elastic.TorchState`` (worker: tests/mp/elastic_worker.py).

``horovodrun -np 3 --min-np 2 --max-np 3`` in elastic mode over Gloo, on two names of this machine
(tests/mp/discover_hosts.sh): localhost holds ranks 0 and 1, 127.0.0.1 rank 2. Horovod blacklists
the host of a failed worker, and a job whose hosts are all blacklisted stops: one host name could
not survive a kill. The run:

* the worker on 127.0.0.1 SIGKILLs itself in the backward pass of step 23 (last commit: step 20);
  the survivors' step fails, they roll back to step 20 and go on as 2 ranks;
* 2 s later (``--blacklist-cooldown-range 1 2``) 127.0.0.1 is back; a fresh worker joins at a
  commit, at step 40 at the latest (the survivors wait there), and is synchronised from rank 0;
* the job ends after 84 steps on 3 ranks.

Bounded time: ``HOROVOD_GLOO_TIMEOUT_SECONDS=20`` (default 30) bounds how long a survivor waits
before it sees the failure: one whose pending receive is from the other survivor, not from the dead
rank, waits the whole timeout (one survivor did in 7 of 9 runs). It is also how long the survivors
wait in Gloo's rendezvous for the joining worker to start Python, import torch and call hvd.init(),
which took up to 11 s here with other jobs loading the machine, hence not less (``init_s`` in the
output).
``--elastic-timeout 60`` bounds the wait for slots; the whole job is killed after 240 s.

Checked, from the ranks' ``ELASTIC`` lines: the compressor state is consistent on every rank after
each reset (see ``check_compressor_state``); all final ranks hold bit-identical parameters; the test
accuracy is within the 3-sigma bound of tests/digits_checks.py of the uncompressed run's. The
worker's global batch does not depend on the number of ranks, so the uncompressed elastic run
follows the trajectory of one process training on the same global batches: ``--reference``
computes it.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.elastic_checks import (CLEAN, EPOCHS, STEPS, check_failure, check_final, check_rejoin,
                                  check_restart_after_failure, events, run_elastic)
from tests.helpers import ROOT, mp_env
from tests.digits_checks import QUANTIZED, RAW

WORKER = os.path.join(ROOT, "tests", "mp", "elastic_worker.py")


def summary(lines):
    """One line per event, for the test's output (pytest -s, or on a failure)."""
    t0 = min(d["time"] for d in lines)
    return "\n".join(
        f"{d['time'] - t0:6.1f}s {d['event']:8} pid {d['pid']} {d['host']:9} rank {d['rank']} size {d['size']} "
        f"step {d['step']:3} occurrences {d['occurrences']} seq {d['seq']} pending {d['pending']} "
        f"in_flight {d['in_flight']} scattering {d['scattering']} residuals "
        f"{ {k: v[0][0] for k, v in d['residuals'].items()} } tensors {d['stats']['tensors']} digest {d['digest']}"
        + (f" init {d['init_s']} s" if "init_s" in d else "")
        for d in sorted(lines, key=lambda d: d["time"]) if d["event"] != "commit" or d["step"] in (20, 25, STEPS))


def check_compressor_state(lines):
    """The compressor's state on every rank at every point between steps, across the failure and the
    rejoin (the framework-neutral checks: tests/elastic_checks.py)."""
    first, victim, survivors = check_failure(lines)

    for d in lines:
        if d["event"] not in CLEAN:
            continue
        done = d["step"] - first[d["pid"]]
        where = f"{d['event']} of pid {d['pid']} at step {d['step']}"
        # Exchange counters: one exchange per quantized parameter and step, named by the parameter.
        assert d["occurrences"] == ({k: d["step"] for k in QUANTIZED} if d["step"] else {}), where
        assert d["seq"] == 0 and d["pending"] == 0 and d["in_flight"] == [] and d["scattering"] == 0, where
        # Statistics count the steps this process did and kept (the undone ones are rolled back).
        s = d["stats"]
        assert s["tensors"] == len(QUANTIZED) * done and s["elements"] == sum(QUANTIZED.values()) * done, where
        assert s["raw_tensors"] == 4 * done and s["raw_elements"] == RAW * done, where
        # Residuals: none right after a (re)start; one per quantized parameter once a step ran.
        if d["event"] in ("start", "reset"):
            assert d["residuals"] == {}, where
        elif done > 0:
            assert {k: v[0] for k, v in d["residuals"].items()} == {k: [n] for k, n in QUANTIZED.items()}, where
            assert all(v[1] > 0 for v in d["residuals"].values()), where

    # The failure: the survivors reset to the commit before it and restart there as ranks 0 and 1 of 2,
    # with the same counters and residual layout.
    for event, after in check_restart_after_failure(lines, survivors).items():
        assert len({d["digest"] for d in after}) == 1, event
    return survivors, check_rejoin(lines, victim, survivors)


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory):
    """The uncompressed run's results, a function: computed by a subprocess that runs alongside the
    first elastic job (which spends most of its time waiting: on Gloo's timeout, on the rejoin)."""
    path = tmp_path_factory.mktemp("elastic") / "reference.json"
    proc = subprocess.Popen([sys.executable, WORKER, "--reference", str(path), "--epochs", str(EPOCHS)], cwd=ROOT,
                            env=mp_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    done = {}

    def result():
        if not done:
            out, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0, out[-3000:]
            with open(path) as f:
                done.update(json.load(f))
        return done

    yield result
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("reduction", ["allgather", "scatter_allgather"])
def test_worker_killed_mid_step_then_rejoined(tmp_path, reduction, uncompressed):
    returncode, out, seconds = run_elastic(WORKER, tmp_path, ["--reduction", reduction], 240)
    assert returncode == 0, f"the elastic job exited with {returncode}:\n{out[-5000:]}"
    lines = events(out)
    print(f"{reduction}: the elastic job took {seconds:.1f} s\n{summary(lines)}")
    try:
        survivors, newcomer = check_compressor_state(lines)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{summary(lines)}") from e
    check_final(lines, survivors, newcomer, uncompressed())
