"""``pip install`` of the source distribution into a fresh environment that already has the frameworks
(torch, TensorFlow and Horovod of the set-up environment, made visible to it by a .pth file): the build
is isolated as pip does by default (no --no-build-isolation), yet finds the installed TensorFlow and
builds its ops against it into a wheel that carries the native libraries (the CPU library and the
TensorFlow ops), which installs, and ``python -m hvd_qsgd --self-test --tensorflow`` run there reports
the installed copy working. The CUDA library is left out (HVD_QSGD_WITHOUT_CUDA=1: it is the same
compile as ``make setup``'s, and the slowest), and the wheel must then not carry one: the setting is
honoured. (The wheel was once built by a test of its own, from the checkout, with the CUDA library:
a second compile of everything, three minutes of the suite on a 2-core machine; every library goes
into a wheel by the same ``ext_modules`` route.)"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests.helpers import ROOT, run_bounded


def _tracked_copy(dest):
    """The repository's tracked files copied to ``dest`` (no build outputs, no .venv)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, stdout=subprocess.PIPE, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def test_the_sdist_installs_into_an_existing_environment_and_passes_its_self_test(tmp_path):
    pytest.importorskip("tensorflow")
    pytest.importorskip("horovod")
    src, dist, env = tmp_path / "src", tmp_path / "dist", tmp_path / "env"
    _tracked_copy(src)
    code, out = run_bounded([sys.executable, "setup.py", "-q", "sdist", "-d", str(dist)], 300, cwd=str(src))
    assert code == 0, out[-3000:]
    (sdist,) = list(dist.glob("hvd_qsgd-*.tar.gz"))
    code, out = run_bounded([sys.executable, "-m", "venv", str(env)], 120)
    assert code == 0, out[-3000:]
    python = str(env / "bin" / "python")
    env_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
    with open(os.path.join(env_site, "frameworks.pth"), "w") as f:   # torch, TensorFlow, Horovod: "already there"
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    build_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    build_env["HVD_QSGD_WITHOUT_CUDA"] = "1"
    wheels = tmp_path / "wheels"
    code, out = run_bounded([python, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(wheels), str(sdist)], 900,
                            env=build_env, cwd=str(tmp_path))
    assert code == 0, out[-5000:]
    assert "TensorFlow found in the environment being installed into" in out, out[-5000:]
    (wheel,) = list(wheels.glob("hvd_qsgd-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.match(r"hvd_qsgd/_lib_cpu.*\.so$", n) for n in names), names
    assert "hvd_qsgd/_build_target.json" in names, names
    assert any(re.match(r"hvd_qsgd/tensorflow/_qsgd_ops.*\.so$", n) for n in names), names
    assert not any("_lib_cuda" in n for n in names), names   # HVD_QSGD_WITHOUT_CUDA=1
    code, out = run_bounded([python, "-m", "pip", "install", "--no-deps", str(wheel)], 300, env=build_env,
                            cwd=str(tmp_path))
    assert code == 0, out[-5000:]
    code, out = run_bounded([python, "-m", "hvd_qsgd", "--self-test", "--tensorflow"], 300,
                            env=build_env, cwd=str(tmp_path))
    assert code == 0, out[-5000:]
    first = out.splitlines()[0]
    assert first.startswith("hvd_qsgd ") and env_site in first, first   # the installed copy, not the checkout
    assert "ops load:" in out and "yes (TensorFlow" in out, out
    assert "self-test cpu" in out and "ok (" in out, out
