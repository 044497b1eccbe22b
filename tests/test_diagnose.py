"""``python -m hvd_qsgd`` / ``hvd_qsgd.diagnose()``: the facts it reports are the installation's, and
its exit status says whether what it checked works."""
import importlib.util
import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import hvd_qsgd
from hvd_qsgd import backends, codec, install_check
from hvd_qsgd.settings import Settings
from tests.helpers import ROOT, horovod_check_build


def facts(text):
    """{label: value} of the report's "  label: value" lines."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^  ([^-\s][^:]*):\s+(.*)$", line)
        if m:
            out[m.group(1).strip()] = m.group(2).strip()
    return out


@pytest.fixture(scope="module")
def command_run():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "hvd_qsgd", "--self-test", "--np", "16", "--ranks-per-node", "8"],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    return proc


def test_the_command_reports_this_installation(command_run):
    out = command_run.stdout
    assert command_run.returncode == 0, out
    f = facts(out)
    assert out.startswith(f"hvd_qsgd {hvd_qsgd.__version__} ")
    assert f["variant in use"] == codec.cpu_isa()
    assert f["variants"].split(", ")[0].split()[0] == next(iter(codec.cpu_isas()))
    assert f["library built"].startswith("yes" if hvd_qsgd.cuda.built() else "no")
    cpu_lines = [v for k, v in f.items() if k.startswith("self-test cpu")]
    assert len(cpu_lines) == 1 and cpu_lines[0].startswith("ok"), out
    cuda_line = f["self-test cuda"] if "self-test cuda" in f else next(
        v for k, v in f.items() if k.startswith("self-test cuda"))
    assert cuda_line.startswith("ok" if hvd_qsgd.cuda.available() else "skipped"), out
    assert "everything checked works" in out and "PROBLEMS" not in out


def test_the_command_reports_horovods_build(command_run):
    f = facts(command_run.stdout)
    if importlib.util.find_spec("horovod") is None:
        assert f["Horovod"] == "not installed"
        return
    import horovod
    assert f["Horovod"] == horovod.__version__
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the controllers are read through horovod.torch here")
    hvd = pytest.importorskip("horovod.torch")
    assert f["Gloo controller"] == ("built" if hvd.gloo_built() else "not built")
    assert f["MPI controller"] == ("built" if hvd.mpi_built() else "not built")
    assert f["NCCL operations"].startswith("built" if hvd.nccl_built() else "not built")
    assert "torch" in f["frameworks"].split(", ")


def test_the_command_names_the_reduction_auto_picks(command_run):
    f = facts(command_run.stdout)
    settings = Settings.make(4, link_gbps=None)
    for numel in install_check.SIZES:
        assert f[f"auto for {numel} elements"] == (f"{settings.exchange_reduction(16, numel, 8, 'cpu')} (CUDA tensors: "
                                                   f"{settings.exchange_reduction(16, numel, 8, 'cuda')})")
    assert "16 ranks, 8 per node" in command_run.stdout


def test_the_link_given_changes_the_answer_as_the_settings_say():
    buf = io.StringIO()
    assert hvd_qsgd.diagnose(np=16, ranks_per_node=8, link_gbps=25, out=buf) == 0
    f = facts(buf.getvalue())
    settings = Settings.make(4, link_gbps=25.0)
    assert {n: f[f"auto for {n} elements"] for n in install_check.SIZES} == {
        n: f"{settings.exchange_reduction(16, n, 8, 'cpu')} (CUDA tensors: {settings.exchange_reduction(16, n, 8, 'cuda')})"
        for n in install_check.SIZES}
    assert "link 25 Gbit/s" in buf.getvalue()
    assert "self-test" not in buf.getvalue()   # only when asked


def test_a_failing_self_test_gives_status_1_and_says_what_to_do(monkeypatch):
    real = backends.CpuBackend.encode

    def corrupt(self, *args, **kwargs):
        payload = np.array(real(self, *args, **kwargs))
        payload[-1] ^= 0x10
        return payload

    monkeypatch.setattr(backends.CpuBackend, "encode", corrupt)
    buf = io.StringIO()
    assert hvd_qsgd.diagnose(self_test=True, out=buf) == 1
    out = buf.getvalue()
    cpu_line = next(v for k, v in facts(out).items() if k.startswith("self-test cpu"))
    assert cpu_line.startswith("FAILED: payload differs from the CPU library's"), out
    assert "PROBLEMS" in out and "what to do: the native libraries disagree" in out
    assert "1 problem(s) found" in out


def test_a_library_that_does_not_load_is_a_problem_not_a_traceback():
    """HVD_QSGD_ISA naming no variant: the CPU library does not load, which the report says, with
    what to do, and status 1; the sections that need the library say they were not checked."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HVD_QSGD_ISA="bogus")
    proc = subprocess.run([sys.executable, "-m", "hvd_qsgd", "--self-test"], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout, proc.stdout
    problems = proc.stdout.split("PROBLEMS", 1)[1]
    assert "does not load" in problems and "HVD_QSGD_ISA='bogus'" in problems and "what to do" in problems
    assert facts(proc.stdout)["auto"].startswith("not weighed")


def test_a_bad_layout_is_a_problem_with_its_fix():
    buf = io.StringIO()
    assert hvd_qsgd.diagnose(np=12, ranks_per_node=8, out=buf) == 1
    assert "--np 12 is not a whole number of nodes of 8 ranks" in buf.getvalue()


def test_the_fat_binary_is_read_and_devices_matched(tmp_path):
    plain = tmp_path / "plain.so"
    plain.write_bytes(b"\x7fELF" + bytes(100))
    assert install_check.cuda_archs(str(plain)) == ([], [])
    path = hvd_qsgd._native._find("_lib_cuda")
    if path:
        sass, ptx = install_check.cuda_archs(path)
        assert sass and all(a >= 50 for a in sass + ptx), (sass, ptx)
    assert install_check._covered(86, [80, 90], [90]) == "sass"    # sm_80 code runs on 8.x
    assert install_check._covered(90, [80, 90], [90]) == "sass"
    assert install_check._covered(100, [80, 90], [90]) == "ptx"    # newer: the driver compiles the PTX
    assert install_check._covered(75, [80, 90], [90]) == ""


def test_the_command_line_refuses_nonsense(capsys):
    with pytest.raises(SystemExit) as e:
        install_check.main(["--np", "0"])
    assert e.value.code == 2
    assert "--np and --ranks-per-node must be positive" in capsys.readouterr().err


def test_importing_the_package_stays_light():
    code = ("import sys, hvd_qsgd; print(sorted(m for m in ('torch', 'tensorflow', 'horovod', 'argparse') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    assert "torch" not in out.stdout and "tensorflow" not in out.stdout and "horovod" not in out.stdout


def test_horovods_build_matches_horovodruns_check_build(command_run):
    """The frameworks, controllers and NCCL the report names are those ``horovodrun --check-build``
    lists as available."""
    if importlib.util.find_spec("horovod") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("Horovod with PyTorch is not installed")
    check_build = horovod_check_build()
    marks = {}  # name -> available; MPI and Gloo appear twice (controllers first): the first counts
    for mark, name in re.findall(r"^\s*\[([X ])\] (\w+)", check_build, re.M):
        marks.setdefault(name, mark == "X")
    assert {"PyTorch", "Gloo", "NCCL"} <= set(marks), check_build
    f = facts(command_run.stdout)
    frameworks = f["frameworks"].split(", ")
    assert ("torch" in frameworks) == marks["PyTorch"]
    assert ("tensorflow" in frameworks) == marks.get("TensorFlow", False)
    assert f["Gloo controller"] == ("built" if marks["Gloo"] else "not built")
    assert f["MPI controller"] == ("built" if marks.get("MPI", False) else "not built")
    assert f["NCCL operations"].startswith("built" if marks["NCCL"] else "not built")
