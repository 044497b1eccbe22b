"""``horovodrun`` for the suite's jobs: Horovod's own launcher (``horovod.runner.launch.run_commandline``,
all the ``horovodrun`` script runs), with its build probes answered once per test session.

At every launch, before it starts a rank, ``horovodrun`` asks whether Horovod was built with Gloo (or
MPI): ``horovod.common.util.gloo_built`` / ``mpi_built`` import each framework's Horovod extension in
a new process, TensorFlow's first. On the 2-core machines the suite runs on that is about 6 s of
every launch (a 2-rank job that only calls ``hvd.init()``: 10.6-12.7 s through ``horovodrun``,
4.4-5.9 s through this script), and a fifth of the suite's time (66:10 -> 53:01, docs/install.md).
Here the first launch of a session runs each probe for real and keeps a "built" answer in the file
named by ``HVD_QSGD_LAUNCH_PROBES`` (``tests/helpers.py`` names one per pytest process); later
launches read it. Any other answer is not kept: the next launch probes again, as ``horovodrun``
would. Everything else -- arguments, rendezvous, the ranks, their environment and output -- is
``horovodrun``'s. Without ``HVD_QSGD_LAUNCH_PROBES`` this is plain ``horovodrun``.

Usage: python tests/launcher.py HOROVODRUN_ARGUMENTS...
"""
import json
import os
import sys

PROBES = ("gloo_built", "mpi_built")


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write(path, answers):
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(answers, f)
    os.replace(tmp, path)


def answer_probes_once(launch, path):
    """Replace the launcher's build probes by ones that run for real once per ``path``."""
    answers = _read(path)
    for name in PROBES:
        real = getattr(launch, name)

        def probe(verbose=False, _name=name, _real=real):
            if answers.get(_name) is True:
                return True
            found = _real(verbose=verbose)
            if found is True:   # (a "not built" answer is not kept: the next launch asks again)
                answers[_name] = True
                _write(path, answers)
            return found

        setattr(launch, name, probe)


def main():
    import horovod.runner.launch as launch
    path = os.environ.get("HVD_QSGD_LAUNCH_PROBES")
    if path:
        answer_probes_once(launch, path)
    sys.argv[0] = "horovodrun"
    return launch.run_commandline()


if __name__ == "__main__":   # (the launcher starts processes with multiprocessing's spawn)
    sys.exit(main())
