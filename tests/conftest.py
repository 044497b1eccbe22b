"""Shared test helpers: launching real multi-rank jobs with a bounded time."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def mp_env():
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    return env


def launch(np_, controller, argv, timeout=180):
    """Run `argv` (a python script and its arguments) on np_ local ranks.

    controller: "gloo" or "mpi" (horovodrun), or "mpirun" (plain Open MPI, for mpi4py workers).
    Raises on a nonzero exit or on timeout; returns the combined output.
    """
    if controller == "mpirun":
        cmd = [shutil.which("mpirun"), "-np", str(np_), "--oversubscribe", "--bind-to", "none"]
    else:
        cmd = [os.path.join(BIN, "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", f"--{controller}"]
        if controller == "mpi":
            cmd += ["--mpi-args=--oversubscribe --bind-to none"]
    cmd += [sys.executable] + list(argv)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=mp_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s:\n{(e.stdout or '')[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-5000:]}")
    return proc.stdout
