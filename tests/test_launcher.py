"""tests/launcher.py, the suite's horovodrun: the build probes run for real once per session file, and
every later launch of the session reads a "built" answer; any other answer is asked again."""
from types import SimpleNamespace

from tests import launcher


def fake_launch(calls, answers):
    """A stand-in for horovod.runner.launch's probes, counting their calls."""
    def probe(name):
        def run(verbose=False):
            calls.append(name)
            return answers[name]
        return run
    return SimpleNamespace(gloo_built=probe("gloo_built"), mpi_built=probe("mpi_built"))


def test_a_built_answer_is_probed_once_per_session_file(tmp_path):
    path = str(tmp_path / "probes.json")
    calls = []
    first = fake_launch(calls, {"gloo_built": True, "mpi_built": None})
    launcher.answer_probes_once(first, path)
    assert first.gloo_built() is True and first.gloo_built() is True
    assert calls == ["gloo_built"]
    second = fake_launch(calls, {"gloo_built": False, "mpi_built": None})   # a later launch
    launcher.answer_probes_once(second, path)
    assert second.gloo_built() is True            # the session's first answer, not probed again
    assert second.mpi_built() is None             # not built: probed, and not kept
    third = fake_launch(calls, {"gloo_built": False, "mpi_built": True})
    launcher.answer_probes_once(third, path)
    assert third.mpi_built() is True and third.gloo_built() is True
    assert calls == ["gloo_built", "mpi_built", "mpi_built"]
    fourth = fake_launch(calls, {"gloo_built": False, "mpi_built": False})
    launcher.answer_probes_once(fourth, path)
    assert fourth.mpi_built() is True and fourth.gloo_built() is True
    assert calls == ["gloo_built", "mpi_built", "mpi_built"]


def test_another_session_file_probes_again(tmp_path):
    calls = []
    for name in ("a.json", "b.json"):
        launch = fake_launch(calls, {"gloo_built": True, "mpi_built": True})
        launcher.answer_probes_once(launch, str(tmp_path / name))
        assert launch.gloo_built() is True
    assert calls == ["gloo_built", "gloo_built"]
