"""The stack `make setup` promises, and the packaging of the native libraries."""
import os
import re
import subprocess
import sys

import pytest


from tests.helpers import ROOT, horovod_check_build


def test_horovod_check_build_shows_frameworks_and_controllers():
    out = horovod_check_build()
    assert "v0.28.1" in out
    for item in ("TensorFlow", "PyTorch", "MPI", "Gloo"):
        assert re.search(rf"\[X\] {item}\b", out), f"horovodrun --check-build lacks {item}:\n{out}"


def test_pinned_frameworks():
    """The versions `make setup` installs: the pins of scripts/versions.sh, or TORCH_VERSION/TF_VERSION
    where set; torch a CPU or a CUDA build, as the machine decided (scripts/setup.sh)."""
    import tensorflow as tf
    import torch
    torch_pin, tf_pin = subprocess.run(["bash", "-c", ". scripts/versions.sh; echo $PY_TORCH_VERSION $PY_TF_VERSION"],
                                       cwd=ROOT, text=True, stdout=subprocess.PIPE, check=True).stdout.split()
    assert torch.__version__.split("+")[0] == torch_pin
    assert tf.__version__ == tf_pin


def test_missing_compiler_gives_a_clear_error(tmp_path):
    env = dict(os.environ, CXX="no-such-compiler-xyz")
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path),
                           "--build-temp", str(tmp_path / "t")], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode != 0
    assert "hvd_qsgd build error: no C++ compiler: 'no-such-compiler-xyz' is not on PATH" in proc.stdout
    assert "Traceback" not in proc.stdout


@pytest.mark.parametrize("env, says", [
    ({"HVD_QSGD_HOROVOD_FRAMEWORKS": "mxnet"}, "HVD_QSGD_HOROVOD_FRAMEWORKS must be 'torch,tensorflow' (default) or "
                                               "'torch', got 'mxnet'"),
    ({"HVD_QSGD_HOROVOD_FRAMEWORKS": "torch", "HVD_QSGD_HOROVOD_SDIST": "/no/such/horovod.tar.gz"},
     "HVD_QSGD_HOROVOD_SDIST=/no/such/horovod.tar.gz is not a file"),
])
def test_horovod_build_options_are_checked_before_building(tmp_path, env, says):
    """scripts/build_horovod.sh's options for make gpu-check-horovod: a wrong framework list or a
    missing carried source distribution stops the script at once, saying which (nothing is built)."""
    full = dict(os.environ, HVD_QSGD_CACHE=str(tmp_path), **env)
    proc = subprocess.run(["bash", "scripts/build_horovod.sh", sys.executable], cwd=ROOT, env=full, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert proc.returncode != 0 and f"[horovod] error: {says}" in proc.stdout, proc.stdout
    assert "building" not in proc.stdout


def test_stale_native_library_is_refused(tmp_path):
    """A library from other headers (here: one without the ABI entry point) gives a clear ImportError."""
    import ctypes

    from hvd_qsgd import _native
    src = tmp_path / "old.c"
    src.write_text("int qsgd_levels(int b) { return b; }\n")
    so = tmp_path / "old.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    with pytest.raises(ImportError, match=r"stale; rebuild it with `pip install -e \.`"):
        _native._check_abi(ctypes.CDLL(str(so)), "qsgd_abi_version", str(so))
