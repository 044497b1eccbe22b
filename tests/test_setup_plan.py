"""The decisions of `make setup` as a function of the machine, without downloading anything:
scripts/setup.sh --plan and scripts/build_horovod.sh --plan (and, where it stops before any download,
the real run) against fake tools in a temporary folder:

* a fake Python: the real interpreter with a folder of fake modules first on its path (torch reporting
  a CPU or a CUDA build, TensorFlow, torch's NCCL package), whose ``pip install --dry-run --report``
  answers with a canned report (the local CPU wheel, the registry's CUDA wheel, ...);
* a fake CUDA toolkit (bin/nvcc that answers --version and --dryrun, include/cuda_runtime.h), reached
  through a wrapper script or a symbolic link on PATH, through CUDA_HOME, or as the default folder;
* PATH without /usr/local/bin (so without this machine's nvcc), a cache folder of its own.
"""
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest

from tests.helpers import ROOT

TOOLKIT_TOOLS = ("cuda-13.0", "13.0")
CPU_REQUIRES = ["filelock", "sympy>=1.13.3", 'optree>=0.13.0; extra == "optree"']
CUDA_REQUIRES = CPU_REQUIRES + ['cuda-toolkit[cublas,cudart]==13.0.2; platform_system == "Linux"',
                                'nvidia-cudnn-cu13==9.26.0.51; platform_system == "Linux"',
                                'nvidia-nccl-cu13==2.30.7; platform_system == "Linux"']
LOCAL_CPU_WHEEL = ("2.13.0+cpu", "file:///opt/wheels/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl",
                   CPU_REQUIRES)
REGISTRY_CUDA_WHEEL = ("2.13.0", "https://files.example/torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
                       CUDA_REQUIRES)


class Machine:
    """A fake machine under ``root``: ``run(script, *args)`` runs a script of scripts/ there."""

    def __init__(self, root):
        self.root = root
        self.bin = root / "bin"
        self.site = root / "site"
        self.venv = root / "venv"
        self.cache = root / "cache"
        self.pip_log = root / "pip.log"
        for d in (self.bin, self.site, self.venv / "bin", self.cache):
            d.mkdir(parents=True)
        self.python = self.venv / "bin" / "python"
        self.python.write_text(f"""#!/bin/sh
# pip's dry run answers with the canned report; anything else is the real interpreter with the fake
# modules on its path (after the caller's PYTHONPATH)
if [ "$1 $2 $3" = "-m pip install" ]; then
  case " $* " in *" --dry-run "*)
    echo "$*" >> "{self.pip_log}"
    [ -e "{root}/pip_fails" ] && {{ echo "ERROR: No matching distribution found for torch" >&2; exit 1; }}
    prev=""; for a in "$@"; do [ "$prev" = --report ] && cp "{root}/report.json" "$a"; prev="$a"; done
    exit 0 ;;
  esac
  echo "REAL $*" >> "{self.pip_log}"
fi
PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{self.site}" exec "{sys.executable}" "$@"
""")
        self.python.chmod(0o755)
        # no horovod in the fake environment (the real one's is shadowed)
        (self.site / "horovod").mkdir()
        (self.site / "horovod" / "__init__.py").write_text("raise ImportError('no horovod in this fake environment')\n")
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("HVD_QSGD_", "TORCH_", "TF_", "CUDA", "HOROVOD_", "PYTHON"))}
        self.env.update(PATH=f"{self.bin}:/usr/bin:/bin", HVD_QSGD_VENV=str(self.venv), HVD_QSGD_CACHE=str(self.cache),
                        HVD_QSGD_CUDA_DEFAULT=str(root / "no-default-cuda"),
                        HVD_QSGD_TORCH_CPU_INDEX=f"file://{root}/cpu-index", PYTHON=str(self.python))

    # --- what pip would install, what is installed
    def pip_picks(self, version, url, requires):
        item = {"metadata": {"name": "torch", "version": version, "requires_dist": requires},
                "download_info": {"url": url}}
        (self.root / "report.json").write_text(json.dumps({"install": [item]}))

    def torch(self, version, cuda=None):
        (self.site / "torch").mkdir(exist_ok=True)
        (self.site / "torch" / "__init__.py").write_text(
            f"__version__ = {version!r}\nclass version:\n    cuda = {cuda!r}\n")

    def tensorflow(self, version="2.21.0"):
        (self.site / "tensorflow").mkdir(exist_ok=True)
        (self.site / "tensorflow" / "__init__.py").write_text(
            f"__version__ = {version!r}\nclass sysconfig:\n    get_include = staticmethod(lambda: '/fake/tf/include')\n")

    def nccl(self, version=(2, 30, 7), lib=True):
        d = self.site / "nvidia" / "nccl"
        (d / "include").mkdir(parents=True)
        (d / "include" / "nccl.h").write_text("".join(f"#define NCCL_{k} {v}\n" for k, v in zip(("MAJOR", "MINOR", "PATCH"), version)))
        if lib:
            (d / "lib").mkdir()
            (d / "lib" / "libnccl.so.2").write_text("")
        return d

    # --- the CUDA toolkit
    def toolkit(self, name="cuda-13.0", release="13.0"):
        home = self.root / name
        (home / "bin").mkdir(parents=True)
        (home / "include").mkdir()
        (home / "include" / "cuda_runtime.h").write_text("")
        nvcc = home / "bin" / "nvcc"
        nvcc.write_text(f"""#!/bin/sh
case "$*" in
  *--version*) echo "Cuda compilation tools, release {release}, V{release}.88" ;;
  *--dryrun*) echo "#\\$ _HERE_={home}/bin" >&2; echo "#\\$ TOP={home}/bin/.." >&2 ;;
esac
""")
        nvcc.chmod(0o755)
        return home

    def nvcc_wrapper(self, home):
        """nvcc on PATH as a script that execs the toolkit's (as /usr/local/bin/nvcc can be)."""
        w = self.bin / "nvcc"
        w.write_text(f'#!/bin/sh\nexec "{home}/bin/nvcc" "$@"\n')
        w.chmod(0o755)

    def nvcc_link(self, home):
        (self.bin / "nvcc").symlink_to(home / "bin" / "nvcc")

    def run(self, script, *args, **env):
        full = dict(self.env, **{k: str(v) for k, v in env.items()})
        return subprocess.run(["bash", os.path.join(ROOT, "scripts", script), *args], cwd=ROOT, env=full,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)

    def plan(self, script, *args, **env):
        """The plan's name=value lines (asserting the plan ran), and the process."""
        proc = self.run(script, "--plan", *args, **env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = dict(line.split("=", 1) for line in proc.stdout.splitlines() if re.match(r"^[a-z]+\.[a-z_]+=", line))
        return lines, proc

    def pip_calls(self):
        return self.pip_log.read_text().splitlines() if self.pip_log.exists() else []


@pytest.fixture
def machine(tmp_path):
    return Machine(tmp_path)


# ---------------------------------------------------------------- scripts/setup.sh --plan: torch

def test_local_cpu_wheel_is_installed_as_today(machine):
    """This machine's kind: pip prefers the local CPU wheel; a toolkit on PATH changes nothing."""
    machine.pip_picks(*LOCAL_CPU_WHEEL)
    machine.nvcc_wrapper(machine.toolkit())
    plan, _ = machine.plan("setup.sh")
    assert plan["setup.torch_action"] == "install"
    assert plan["setup.torch_source"].startswith("local-wheel file:///opt/wheels/torch-2.13.0")
    assert plan["setup.torch_build"] == "cpu"
    assert plan["setup.horovod"] == "build after the packages: CPU only (torch is a CPU build)"
    assert plan["setup.torch_spec"] == "torch==2.13.0"
    assert plan["setup.tensorflow"] == "tensorflow-cpu==2.21.0 tf_keras==2.21.0"
    # pip was only asked, with the pin, in a dry run
    (call,) = machine.pip_calls()
    assert "--dry-run" in call and call.endswith("torch==2.13.0") and "--index-url" not in call


def test_registry_cuda_wheel_with_a_toolkit_behind_an_nvcc_wrapper(machine):
    """A GPU machine: the registry's CUDA build, the toolkit found through the wrapper script on PATH
    (its own --dryrun names the toolkit), Horovod to be built with CUDA and torch's NCCL."""
    machine.pip_picks(*REGISTRY_CUDA_WHEEL)
    home = machine.toolkit()
    machine.nvcc_wrapper(home)
    plan, _ = machine.plan("setup.sh")
    assert plan["setup.torch_build"] == "cuda" and plan["setup.torch_source"].startswith("registry https://")
    assert plan["setup.torch_action"] == "install"
    assert plan["setup.cuda_home"].startswith(f"{home} (nvcc on PATH: {machine.bin}/nvcc, a wrapper of {home}/bin/nvcc")
    assert plan["setup.torch_nccl"] == "nvidia-nccl-cu13==2.30.7"
    assert plan["setup.horovod"] == (f"build after the packages: CUDA (toolkit {home}), NCCL from "
                                     "nvidia-nccl-cu13==2.30.7 where it ships include/nccl.h and lib/libnccl.so.2")


def test_toolkit_through_a_symbolic_link_cuda_home_and_the_default_folder(machine):
    machine.pip_picks(*REGISTRY_CUDA_WHEEL)
    linked, other, default = machine.toolkit("cuda-a"), machine.toolkit("cuda-b"), machine.toolkit("cuda-c")
    machine.nvcc_link(linked)
    plan, _ = machine.plan("setup.sh")
    assert plan["setup.cuda_home"] == f"{linked} (nvcc on PATH: {machine.bin}/nvcc -> {linked}/bin/nvcc)"
    plan, _ = machine.plan("setup.sh", CUDA_HOME=other)  # CUDA_HOME first
    assert plan["setup.cuda_home"] == f"{other} (CUDA_HOME)"
    (machine.bin / "nvcc").unlink()
    plan, _ = machine.plan("setup.sh", HVD_QSGD_CUDA_DEFAULT=default)  # then the default folder
    assert plan["setup.cuda_home"] == f"{default} ({default})" and plan["setup.torch_action"] == "install"


def test_cuda_wheel_without_a_toolkit_takes_the_cpu_index_where_reachable(machine):
    machine.pip_picks(*REGISTRY_CUDA_WHEEL)
    (machine.root / "cpu-index" / "torch").mkdir(parents=True)
    plan, _ = machine.plan("setup.sh")
    assert plan["setup.cuda_home"].startswith("none (no CUDA_HOME, no nvcc on PATH")
    assert plan["setup.torch_action"] == f"cpu-index from file://{machine.root}/cpu-index"
    assert plan["setup.horovod"] == "build after the packages: CPU only (torch is a CPU build)"


def test_cuda_wheel_without_a_toolkit_or_cpu_index_stops_at_once_with_one_line(machine):
    """Nothing installed, nothing downloaded: one line that names both ways out, commands included."""
    machine.pip_picks(*REGISTRY_CUDA_WHEEL)
    plan, _ = machine.plan("setup.sh")
    assert plan["setup.torch_action"] == "stop"
    stop = plan["setup.stop"]
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu make setup" in stop
    assert "CUDA_HOME=/path/to/cuda make setup" in stop
    proc = machine.run("setup.sh")
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("[setup] error: pip would install torch 2.13.0 "
                                                                  "as a CUDA build"), proc.stderr
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu make setup" in proc.stderr
    assert not any(c.startswith("REAL") for c in machine.pip_calls()), machine.pip_calls()
    assert not list(machine.venv.glob(".hvd_qsgd_*"))


def test_cuda_home_that_is_not_a_toolkit_stops(machine):
    machine.pip_picks(*REGISTRY_CUDA_WHEEL)
    machine.nvcc_wrapper(machine.toolkit())
    plan, _ = machine.plan("setup.sh", CUDA_HOME=machine.root / "nowhere")
    assert plan["setup.stop"] == (f"CUDA_HOME={machine.root}/nowhere is not a CUDA toolkit "
                                  "(no bin/nvcc or include/cuda_runtime.h there)")


def test_registry_cpu_wheel_and_a_cuda_requirement_under_an_extra_only(machine):
    """Where the registry's default is a CPU build (another platform), and a requirement that only an
    extra brings (not a CUDA build): installed as is, no toolkit needed."""
    machine.pip_picks("2.13.0", "https://files.example/torch-2.13.0-cp311-none-macosx_11_0_arm64.whl",
                      CPU_REQUIRES + ['nvidia-nccl-cu13; extra == "distributed"'])
    plan, _ = machine.plan("setup.sh")
    assert plan["setup.torch_build"] == "cpu" and plan["setup.torch_action"] == "install"
    assert plan["setup.torch_nccl"] == "none"


def test_cuda_local_version_label_counts_as_cuda(machine):
    machine.pip_picks("2.13.0+cu130", "https://download.example/whl/cu130/torch-2.13.0%2Bcu130-cp311.whl", CPU_REQUIRES)
    plan, _ = machine.plan("setup.sh")
    assert plan["setup.torch_build"] == "cuda" and plan["setup.torch_action"] == "stop"


def test_version_overrides_and_torch_index(machine):
    machine.pip_picks("2.15.0+cpu", "https://download.example/whl/cpu/torch-2.15.0%2Bcpu-cp311.whl", CPU_REQUIRES)
    plan, _ = machine.plan("setup.sh", TORCH_VERSION="2.15.0", TF_VERSION="2.20.0",
                           TORCH_INDEX_URL="https://download.example/whl/cpu")
    assert plan["setup.torch_spec"] == "torch==2.15.0"
    assert plan["setup.tensorflow"] == "tensorflow-cpu==2.20.0 tf_keras==2.20.*"
    assert plan["setup.torch_source"].startswith("index https://download.example/whl/cpu/")
    assert plan["setup.torch_action"] == "install from https://download.example/whl/cpu"
    (call,) = machine.pip_calls()
    assert "--index-url https://download.example/whl/cpu" in call and call.endswith("torch==2.15.0")
    plan, _ = machine.plan("setup.sh", TF_VERSION="2.20.0", TF_KERAS_VERSION="2.20.1")
    assert plan["setup.tensorflow"] == "tensorflow-cpu==2.20.0 tf_keras==2.20.1"


def test_pip_that_cannot_resolve_the_pin_stops(machine):
    (machine.root / "pip_fails").write_text("")
    plan, _ = machine.plan("setup.sh", TORCH_VERSION="9.9.9")
    assert plan["setup.torch_action"] == "stop"
    assert plan["setup.stop"].startswith("pip cannot resolve torch==9.9.9: ERROR: No matching distribution")


def test_missing_open_mpi_is_installed_and_a_missing_venv_created(machine, tmp_path):
    """PATH without mpicxx/mpirun (every other tool of /usr/bin and /bin kept, as links)."""
    farm = tmp_path / "farm"
    farm.mkdir()
    for d in ("/bin", "/usr/bin"):
        for name in os.listdir(d):
            if not name.startswith(("mpi", "orte")) and not (farm / name).exists():
                (farm / name).symlink_to(os.path.join(d, name))
    machine.pip_picks(*LOCAL_CPU_WHEEL)
    plan, _ = machine.plan("setup.sh", PATH=f"{machine.bin}:{farm}", HVD_QSGD_VENV=tmp_path / "fresh")
    assert plan["setup.openmpi"] == "install (apt-get install openmpi-bin libopenmpi-dev)"
    assert plan["setup.venv"].startswith(f"create {tmp_path}/fresh with Python 3.")
    assert plan["setup.torch_action"] == "install"  # asked of PYTHON's pip, the venv not being there yet


def test_packages_up_to_date_hands_over_to_the_horovod_plan(machine):
    """With the stamp of the current requirements, set-up asks nothing of pip; the Horovod plan reads
    the installed torch (a CUDA build here) and NCCL."""
    machine.torch("2.15.0+cu132", "13.2")
    machine.tensorflow()
    machine.nccl()
    machine.nvcc_wrapper(machine.toolkit())
    base = subprocess.run(["bash", "-c", "cd scripts && . ./versions.sh && printf '%s\\n' \"torch==$PY_TORCH_VERSION\" "
                           "\"tensorflow-cpu==$PY_TF_VERSION\" \"tf_keras==$PY_TF_KERAS_VERSION\""],
                          cwd=ROOT, text=True, stdout=subprocess.PIPE, env=machine.env).stdout
    rest = "mpi4py numpy pytest hypothesis scikit-learn matplotlib tqdm cffi cloudpickle psutil pyyaml packaging setuptools wheel"
    key = subprocess.run(["sha1sum"], input=base + "\n".join(rest.split()) + "\n", text=True,
                         stdout=subprocess.PIPE).stdout[:12]
    (machine.venv / f".hvd_qsgd_reqs_{key}").write_text("")
    plan, _ = machine.plan("setup.sh")
    assert plan["setup.packages"].startswith("up to date")
    assert machine.pip_calls() == []
    assert plan["setup.horovod"] == "build or take from the cache, and install"
    assert plan["horovod.torch"] == "2.15.0+cu132 (CUDA: 13.2)"
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in plan["horovod.env"]
    # another TORCH_VERSION is another set of requirements: pip is asked again
    machine.pip_picks(*LOCAL_CPU_WHEEL)
    plan, _ = machine.plan("setup.sh", TORCH_VERSION="2.13.1")
    assert plan["setup.packages"].startswith("install torch==2.13.1 ")


# ---------------------------------------------------------------- scripts/build_horovod.sh --plan

def horovod_plan(machine, **env):
    plan, _ = machine.plan("build_horovod.sh", str(machine.python), **env)
    return plan


def pyv():
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def test_cpu_torch_keeps_todays_key_and_flags(machine):
    machine.torch("2.13.0+cpu")
    machine.tensorflow()
    machine.nvcc_wrapper(machine.toolkit())  # a toolkit does not matter to a CPU build of torch
    plan = horovod_plan(machine)
    assert plan["horovod.key"] == f"horovod-0.28.1_torch-2.13.0_tf-2.21.0_{pyv()}"
    assert plan["horovod.env"] == ("HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 "
                                   "HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1")
    assert plan["horovod.cuda_home"] == "none (torch is a CPU build)"
    assert plan["horovod.action"].startswith("build horovod==0.28.1 from its source distribution")
    torch_only = horovod_plan(machine, HVD_QSGD_HOROVOD_FRAMEWORKS="torch")
    assert torch_only["horovod.key"] == f"horovod-0.28.1_torch-2.13.0_tf-none_{pyv()}"
    assert torch_only["horovod.env"].endswith("HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MPI=1")
    with_mpi = horovod_plan(machine, HVD_QSGD_HOROVOD_FRAMEWORKS="torch", HVD_QSGD_HOROVOD_MPI="1")
    assert with_mpi["horovod.key"] == f"horovod-0.28.1_torch-2.13.0_tf-none_mpi-1_{pyv()}"
    assert with_mpi["horovod.env"].endswith("HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITH_MPI=1")


def test_cuda_torch_gets_the_toolkit_and_torchs_nccl(machine):
    machine.torch("2.15.0+cu132", "13.2")
    nccl = machine.nccl()
    home = machine.toolkit()
    machine.nvcc_wrapper(home)
    plan = horovod_plan(machine, HVD_QSGD_HOROVOD_FRAMEWORKS="torch")
    env = plan["horovod.env"].split()
    assert f"CUDA_HOME={home}" in env and f"HOROVOD_CUDA_HOME={home}" in env and f"CUDAToolkit_ROOT={home}" in env
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in env and "HOROVOD_NCCL_LINK=SHARED" in env
    (nccl_home,) = [e.split("=", 1)[1] for e in env if e.startswith("HOROVOD_NCCL_HOME=")]
    assert nccl_home.startswith(f"{machine.cache}/nccl/nccl-2.30.7-")
    assert plan["horovod.nccl"] == f"2.30.7 from {nccl} (HOROVOD_NCCL_HOME={nccl_home})"
    assert plan["horovod.key"] == f"horovod-0.28.1_torch-2.15.0-cu13.2_tf-none_cuda-13.0_nccl-2.30.7_{pyv()}"


def test_nccl_off_missing_or_headers_only(machine):
    machine.torch("2.15.0+cu132", "13.2")
    machine.nvcc_wrapper(machine.toolkit())
    plan = horovod_plan(machine, HVD_QSGD_HOROVOD_FRAMEWORKS="torch")
    assert plan["horovod.nccl"].startswith("none (no HOROVOD_NCCL_HOME, and torch's environment has no nvidia.nccl")
    assert "HOROVOD_GPU_OPERATIONS" not in plan["horovod.env"]
    assert plan["horovod.key"].endswith(f"_cuda-13.0_nccl-none_{pyv()}")
    assert horovod_plan(machine, HVD_QSGD_HOROVOD_FRAMEWORKS="torch", HVD_QSGD_HOROVOD_NCCL="1")[
        "horovod.action"].startswith("stop: HVD_QSGD_HOROVOD_NCCL=1 but no NCCL")
    machine.nccl(lib=False)  # the header without the library is not NCCL
    assert horovod_plan(machine, HVD_QSGD_HOROVOD_FRAMEWORKS="torch")["horovod.nccl"].startswith("none")
    (machine.site / "nvidia" / "nccl" / "lib").mkdir()
    (machine.site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").write_text("")
    plan = horovod_plan(machine, HVD_QSGD_HOROVOD_FRAMEWORKS="torch", HVD_QSGD_HOROVOD_NCCL="0")
    assert plan["horovod.nccl"] == "none (HVD_QSGD_HOROVOD_NCCL=0)"
    assert "HOROVOD_GPU_OPERATIONS" not in plan["horovod.env"]
    mine = machine.root / "my-nccl"
    (mine / "include").mkdir(parents=True)
    (mine / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 27\n#define NCCL_PATCH 3\n")
    plan = horovod_plan(machine, HVD_QSGD_HOROVOD_FRAMEWORKS="torch", HOROVOD_NCCL_HOME=mine)
    assert plan["horovod.nccl"] == f"2.27.3 from HOROVOD_NCCL_HOME (HOROVOD_NCCL_HOME={mine})"


def test_one_wheel_per_combination(machine):
    """Another toolkit version is another key; a wheel in the key's folder is used as it is."""
    machine.torch("2.15.0+cu132", "13.2")
    machine.nccl()
    machine.nvcc_wrapper(machine.toolkit())
    first = horovod_plan(machine, HVD_QSGD_HOROVOD_FRAMEWORKS="torch")
    other = horovod_plan(machine, HVD_QSGD_HOROVOD_FRAMEWORKS="torch", CUDA_HOME=machine.toolkit("cuda-12.8", "12.8"))
    assert other["horovod.key"] == first["horovod.key"].replace("cuda-13.0", "cuda-12.8")
    wheel = machine.cache / "wheels" / first["horovod.key"] / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_text("")
    assert horovod_plan(machine, HVD_QSGD_HOROVOD_FRAMEWORKS="torch")["horovod.action"] == f"use the cached {wheel}"


def test_cuda_torch_without_a_toolkit_stops_before_downloading(machine):
    machine.torch("2.15.0+cu132", "13.2")
    plan = horovod_plan(machine, HVD_QSGD_HOROVOD_FRAMEWORKS="torch")
    assert plan["horovod.action"].startswith("stop: torch 2.15.0+cu132 is a CUDA build (CUDA 13.2), so Horovod's "
                                             "PyTorch extension needs a CUDA toolkit, and none was found")
    proc = machine.run("build_horovod.sh", str(machine.python), HVD_QSGD_HOROVOD_FRAMEWORKS="torch")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("[horovod] error: torch 2.15.0+cu132 is a CUDA build") and proc.stderr.count("\n") == 1
    assert "CUDA_HOME=/path/to/cuda" in proc.stderr and "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in proc.stderr


FAKE_SETUP_PY = '''
import os, shutil
from setuptools import setup
names = ["CUDA_HOME", "HOROVOD_CUDA_HOME", "HOROVOD_GPU_OPERATIONS", "HOROVOD_NCCL_HOME", "HOROVOD_NCCL_LINK",
         "HOROVOD_WITH_MPI", "HOROVOD_WITHOUT_MPI", "HOROVOD_WITHOUT_TENSORFLOW", "HOROVOD_WITH_PYTORCH"]
build = {n: os.environ.get(n) for n in names}
build["nvcc"] = shutil.which("nvcc")
with open("horovod/torch/__init__.py", "w") as f:
    f.write(f"BUILD = {build!r}\\n"
            "def cuda_built(): return bool(BUILD['HOROVOD_CUDA_HOME'])\\n"
            "def nccl_built(): return 23007 if BUILD['HOROVOD_GPU_OPERATIONS'] == 'NCCL' else 0\\n"
            "def gloo_built(): return True\\n"
            "def mpi_built(): return BUILD['HOROVOD_WITH_MPI'] == '1'\\n")
setup(name="horovod", version="0.28.1", packages=["horovod", "horovod.torch"])
'''


def test_real_build_of_a_fake_source_with_cuda_and_nccl(machine):
    """The build path itself, on a stand-in for Horovod's source distribution (the lines the fixes
    change, and a setup.py that records what it was built with): the toolkit's nvcc first on PATH,
    the NCCL folder of links, the wheel cached with its one line of what it has."""
    machine.torch("2.15.0+cu132", "13.2")
    nccl = machine.nccl()
    home = machine.toolkit()
    machine.nvcc_wrapper(home)
    src = machine.root / "sdist" / "horovod-0.28.1"
    (src / "horovod" / "torch").mkdir(parents=True)
    (src / "horovod" / "__init__.py").write_text("__version__ = '0.28.1'\n")
    (src / "CMakeLists.txt").write_text("set(CMAKE_CXX_STANDARD 14)\n")
    (src / "horovod" / "torch" / "CMakeLists.txt").write_text("set(CMAKE_CXX_STANDARD 14)\n")
    (src / "horovod" / "common").mkdir()
    (src / "horovod" / "common" / "group_table.h").write_text("#include <mutex>\n")
    (src / "setup.py").write_text(FAKE_SETUP_PY)
    sdist = machine.root / "horovod-0.28.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(src, arcname="horovod-0.28.1")
    proc = machine.run("build_horovod.sh", str(machine.python), HVD_QSGD_HOROVOD_FRAMEWORKS="torch",
                       HVD_QSGD_HOROVOD_SDIST=sdist)
    assert proc.returncode == 0, proc.stderr
    wheel = proc.stdout.strip()
    key = f"horovod-0.28.1_torch-2.15.0-cu13.2_tf-none_cuda-13.0_nccl-2.30.7_{pyv()}"
    assert os.path.dirname(wheel) == str(machine.cache / "wheels" / key)
    built = (f"built: cuda_built=True nccl_built=23007 gloo_built=True mpi_built=False (horovod 0.28.1, torch "
             f"2.15.0+cu132, tensorflow none, CUDA 13.0 at {home}, NCCL 2.30.7)")
    assert f"[horovod] {built}\n" in proc.stderr
    assert (machine.cache / "wheels" / key / "built.txt").read_text() == built + "\n"
    (nccl_home,) = (machine.cache / "nccl").iterdir()
    assert os.readlink(nccl_home / "lib" / "libnccl.so") == f"{nccl}/lib/libnccl.so.2"
    assert (nccl_home / "include" / "nccl.h").is_file()
    # what the build saw: the toolkit's own nvcc first on PATH (not the wrapper), and the variables
    import zipfile
    record = zipfile.ZipFile(wheel).read("horovod/torch/__init__.py").decode()
    assert f"'nvcc': '{home}/bin/nvcc'" in record and f"'CUDA_HOME': '{home}'" in record
    assert f"'HOROVOD_NCCL_HOME': '{nccl_home}'" in record and "'HOROVOD_NCCL_LINK': 'SHARED'" in record
    # the second time: the cached wheel and the same line, nothing built
    again = machine.run("build_horovod.sh", str(machine.python), HVD_QSGD_HOROVOD_FRAMEWORKS="torch",
                        HVD_QSGD_HOROVOD_SDIST=sdist)
    assert again.stdout.strip() == wheel and f"[horovod] {built}\n" in again.stderr and "building" not in again.stderr
