"""The kill-a-worker run of elastic training, shared by tests/test_elastic.py (PyTorch) and
tests/test_tf_elastic.py (TensorFlow): the launch, the workers' ``ELASTIC`` lines, and the checks
that do not depend on the framework (who was killed, who failed, who rejoined, the counters alike
on every rank at every commit, the final weights and accuracy). test_elastic.py's docstring explains
the host names and the timeouts."""
import json
import os
import re
import sys
import time

from tests.helpers import HOROVODRUN, ROOT, mp_env, run_bounded
from tests.digits_checks import check_parity

DISCOVER = os.path.join(ROOT, "tests", "mp", "discover_hosts.sh")
KILL_STEP, COMMIT_EVERY, REJOIN_STEP, EPOCHS = 23, 5, 40, 6
STEPS = 14 * EPOCHS  # 1,347 training samples: 14 global batches of 96 an epoch
CLEAN = ("start", "reset", "commit", "waiting", "final")          # events between steps
LAST_COMMIT = KILL_STEP // COMMIT_EVERY * COMMIT_EVERY


def run_elastic(worker, tmp_path, extra, timeout):
    """(return code, output, seconds) of ``horovodrun -np 3 --min-np 2 --max-np 3`` (Gloo, elastic) of
    ``worker`` with the kill, commit and rejoin steps above and the arguments ``extra``."""
    env = mp_env()
    env.update(HVD_QSGD_ELASTIC_DIR=str(tmp_path), HOROVOD_GLOO_TIMEOUT_SECONDS="20")
    cmd = HOROVODRUN + ["-np", "3", "--min-np", "2", "--max-np", "3",
                        "--host-discovery-script", DISCOVER, "--gloo", "--network-interface", "lo",
                        "--blacklist-cooldown-range", "1", "2", "--elastic-timeout", "60",
                        sys.executable, worker, "--out", str(tmp_path), *extra, "--epochs", str(EPOCHS),
                        "--kill-step", str(KILL_STEP), "--commit-every", str(COMMIT_EVERY),
                        "--rejoin-step", str(REJOIN_STEP)]
    t0 = time.monotonic()
    returncode, out = run_bounded(cmd, timeout, env=env)
    return returncode, out, time.monotonic() - t0


def events(out):
    return [json.loads(m) for m in re.findall(r"ELASTIC (\{.*\})$", out, flags=re.M)]


def check_failure(lines):
    """The initial world (ranks 0 and 1 on localhost, rank 2 on 127.0.0.1), the kill of rank 2 at
    KILL_STEP and the survivors' failed step; returns (each process's first step: 0, or for the
    worker that joined, the step it joined at; the victim's pid; the survivors' pids)."""
    by_pid = {}
    for d in lines:
        by_pid.setdefault(d["pid"], []).append(d)
    first = {pid: min(d["step"] for d in ds if d["event"] == "start") for pid, ds in by_pid.items()}
    starts = [d for d in lines if d["event"] == "start" and d["step"] == 0]
    assert sorted((d["rank"], d["host"], d["size"]) for d in starts) == [
        (0, "localhost", 3), (1, "localhost", 3), (2, "127.0.0.1", 3)]
    victim = next(d["pid"] for d in starts if d["rank"] == 2)
    survivors = {d["pid"] for d in starts} - {victim}
    assert [(d["pid"], d["step"]) for d in lines if d["event"] == "kill"] == [(victim, KILL_STEP)]
    failed = [d for d in lines if d["event"] == "failed"]
    assert {d["pid"] for d in failed} == survivors and {d["step"] for d in failed} == {KILL_STEP}
    return first, victim, survivors


def check_restart_after_failure(lines, survivors):
    """The survivors reset to the commit before the failure and restart there as ranks 0 and 1 of 2;
    returns {"reset": their reset events, "start": their start events}."""
    out = {}
    for event in ("reset", "start"):
        after = out[event] = [d for d in lines if d["event"] == event and d["size"] == 2]
        assert sorted((d["pid"], d["step"]) for d in after) == sorted((p, LAST_COMMIT) for p in survivors), event
        assert sorted(d["rank"] for d in after) == [0, 1], event
    return out


def check_rejoin(lines, victim, survivors):
    """A new process on 127.0.0.1 and the survivors restart together, at the same step, with the same
    counters and residual layout (``digest``); and at every commit and the end every rank has the
    same. Returns the new worker's start event."""
    rejoin = [d for d in lines if d["event"] == "start" and d["size"] == 3 and d["step"] > 0]
    assert {d["pid"] for d in rejoin} >= survivors and len(rejoin) == 3, rejoin
    newcomer = next(d for d in rejoin if d["pid"] not in survivors)
    assert newcomer["host"] == "127.0.0.1" and newcomer["rank"] == 2 and newcomer["pid"] != victim
    assert len({d["step"] for d in rejoin}) == 1 and LAST_COMMIT < newcomer["step"] <= REJOIN_STEP
    assert len({d["digest"] for d in rejoin}) == 1, rejoin  # the newcomer names its exchanges alike
    groups = {}
    for d in lines:
        if d["event"] in ("commit", "final"):
            groups.setdefault((d["event"], d["step"], d["size"]), []).append(d)
    for key, ds in groups.items():
        assert len({d["digest"] for d in ds}) == 1 and len(ds) == key[2], (key, ds)
    return newcomer


def check_final(lines, survivors, newcomer, uncompressed):
    """The survivors and the new worker end at STEPS on 3 ranks with bit-identical weights, and the
    test accuracy is within the parity bound of the uncompressed run's (``uncompressed``: its JSON)."""
    final = [d for d in lines if d["event"] == "final"]
    assert {d["pid"] for d in final} == survivors | {newcomer["pid"]}
    assert all(d["step"] == STEPS and d["size"] == 3 for d in final)
    assert len({d["checksum"] for d in final}) == 1, final  # bit-identical weights
    print(f"test accuracy {final[0]['test_accuracy']:.4f}, uncompressed {uncompressed['test_accuracy']:.4f}")
    check_parity(uncompressed, [{"bits": 4, "test_accuracy": final[0]["test_accuracy"]}])
