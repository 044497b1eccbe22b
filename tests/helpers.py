"""What tests (and the workers under tests/mp/) share for running real processes: the repository
root, the virtual environment's bin/, the environment of a multi-rank job, and bounded launches.

Plain functions, not pytest hooks: test modules import them from here (``from tests.helpers import
launch``), never from conftest.py or from another test module."""
import atexit
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
# the suite's horovodrun: Horovod's launcher with its build probes answered once per session
# (tests/launcher.py; the answers in LAUNCH_PROBES, removed when the session ends)
HOROVODRUN = [sys.executable, os.path.join(ROOT, "tests", "launcher.py")]
LAUNCH_PROBES = os.path.join(tempfile.gettempdir(), f"hvd_qsgd_launch_probes.{os.getpid()}.json")
atexit.register(lambda: os.path.exists(LAUNCH_PROBES) and os.remove(LAUNCH_PROBES))


@functools.lru_cache(maxsize=1)
def horovod_check_build():
    """The output (stdout and stderr) of ``horovodrun --check-build``, run once per test session (it
    imports every framework: ~40 s on 2 busy cores; two test files read it)."""
    return subprocess.run([os.path.join(BIN, "horovodrun"), "--check-build"], env=dict(mp_env(), TF_CPP_MIN_LOG_LEVEL="3"),
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300).stdout


def mp_env():
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", HVD_QSGD_LAUNCH_PROBES=LAUNCH_PROBES)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    return env


def launch(np_, controller, argv, timeout=180, expect_failure=False, env=None, hosts=None):
    """Run `argv` (a python script and its arguments) on np_ local ranks.

    controller: "gloo" or "mpi" (horovodrun), or "mpirun" (plain Open MPI, for mpi4py workers).
    On timeout the whole process group (launcher and ranks) is killed and the test fails. Returns the
    combined output; fails the test on a nonzero exit, or with ``expect_failure`` on a zero exit.
    ``env``: extra environment variables. ``hosts``: horovodrun's ``-H`` (default ``localhost:<np>``;
    ``localhost:2,127.0.0.1:4`` makes two hosts of this machine, which Horovod tells apart).
    """
    if controller == "mpirun":
        cmd = [shutil.which("mpirun"), "-np", str(np_), "--oversubscribe", "--bind-to", "none"]
    else:
        cmd = HOROVODRUN + ["-np", str(np_), "-H", hosts or f"localhost:{np_}", f"--{controller}"]
        if controller == "mpi":
            cmd += ["--mpi-args=--oversubscribe --bind-to none"]
    cmd += [sys.executable] + list(argv)
    full_env = mp_env()
    full_env.update(env or {})
    returncode, out = run_bounded(cmd, timeout, env=full_env)
    if controller == "mpi":
        out = split_tagged_chunks(out)
    if expect_failure and returncode == 0:
        pytest.fail(f"{' '.join(cmd)} succeeded but was expected to fail:\n{out[-5000:]}")
    if not expect_failure and returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {returncode}:\n{out[-5000:]}")
    return out


def split_tagged_chunks(out):
    """Open MPI's ``--tag-output`` tags every chunk a rank writes, not every line: with unbuffered
    workers, ``print`` writes its text and its newline apart, and another rank's chunk can land between
    them, mid-line (``[1,0]<stdout>:RAISED ...[1,1]<stdout>:RAISED ...``). Start every tagged chunk
    on a line of its own, so that line-anchored patterns see one rank's text per line."""
    return re.sub(r"(?<=[^\n])(\[\d+,\d+\]<std(?:out|err)>:)", r"\n\1", out)


@functools.lru_cache(maxsize=None)
def launch_once(np_, controller, argv, timeout=180, env=()):
    """``launch`` once per distinct arguments in a test session (``argv`` a tuple, ``env`` a tuple of
    (name, value) pairs): the tests that check the cases of one shared job read its output. A failed
    launch is not kept: each of its tests fails on its own."""
    return launch(np_, controller, list(argv), timeout=timeout, env=dict(env))


def raised_in(out, scenario):
    """[(rank, "<type>: <message>")] of the ranks whose worker printed
    ``RAISED <type>: <message> (scenario <scenario>)`` (tagged ``[rank]`` by Gloo, ``[1,rank]`` by MPI)."""
    return [(int(r), msg) for r, msg, s in re.findall(r"^\[(?:\d+,)?(\d+)\]<stdout>:RAISED (.*) \(scenario (\S+)\)$", out,
                                                    flags=re.M) if s == scenario]


def run_bounded(cmd, timeout, env=None, stop_signal=signal.SIGKILL, cwd=None):
    """Run ``cmd`` in its own process group from ``cwd`` (default: the repository root); return (exit
    status, combined output). On timeout the group gets ``stop_signal`` (then SIGKILL after 20 s) and
    the test fails."""
    proc = subprocess.Popen(cmd, cwd=cwd or ROOT, env=env if env is not None else mp_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, stop_signal)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s:\n{(out or '')[-4000:]}")
    return proc.returncode, out
