"""Build and install hvd_qsgd.

The codec's native libraries are built from ``kernels/`` by calling the compilers directly:

* ``hvd_qsgd/_lib_cpu*.so``  -- always: the C++ implementation, OpenMP, vectorised (g++ / $CXX);
* ``hvd_qsgd/_lib_cuda*.so`` -- whenever ``nvcc`` is found (or $HVD_QSGD_NVCC names one); set
  ``HVD_QSGD_WITHOUT_CUDA=1`` to skip it, ``HVD_QSGD_WITH_CUDA=1`` to make its absence an error.
* ``hvd_qsgd/tensorflow/_qsgd_ops*.so`` -- whenever TensorFlow is importable at build time: the
  TensorFlow ops (``hvd_qsgd/tensorflow/qsgd_ops.cc``) compiled with the same kernel sources against
  the installed TensorFlow's headers and ABI; ``HVD_QSGD_WITHOUT_TENSORFLOW=1`` skips it.

They are plain shared libraries with a C ABI (``kernels/qsgd.h``), loaded with ctypes; they are
declared as extensions only so that setuptools puts them in the right place for both ``pip install .``
and ``pip install -e .``.

Environment: ``CXX`` (default g++), ``HVD_QSGD_MARCH`` (default ``native``; ``-march=`` of the CPU
library), ``HVD_QSGD_CUDA_ARCHS`` (default ``80;90``).
"""
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(ROOT, "kernels")
CPU_SOURCES = ["kernels/qsgd_cpu.cc", "kernels/qsgd_elias_cpu.cc", "kernels/qsgd_control.cc",
               "kernels/qsgd_chunks.cc"]
CUDA_SOURCES = ["kernels/qsgd_cuda.cu"]
TF_SOURCES = ["hvd_qsgd/tensorflow/qsgd_ops.cc"]
CPU_FLAGS = [
    "-O3", "-std=c++17", "-fopenmp", "-fPIC", "-shared",
    # no FMA contraction: the CPU and CUDA libraries must round identically
    "-ffp-contract=off", "-fno-math-errno",
    # lets the vectoriser if-convert the float selects (values are unchanged: only the
    # floating-point exception flags are assumed unobserved)
    "-fno-trapping-math"]
HEADERS = ["kernels/qsgd.h", "kernels/qsgd_math.h", "kernels/qsgd_cpu_internal.h"]


class BuildError(SystemExit):
    """Stops the build with a one-paragraph message instead of a compiler-driver traceback."""

    def __init__(self, msg):
        super().__init__("\nhvd_qsgd build error: " + msg + "\n")


def _run(cmd):
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.stdout:
        print(proc.stdout, flush=True)
    if proc.returncode != 0:
        raise BuildError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}")


def _find_cxx():
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx.split()[0])
    if not path:
        raise BuildError(
            f"no C++ compiler: '{cxx}' is not on PATH. The codec's CPU library needs a C++17 compiler "
            "with OpenMP (g++ >= 9). Install one (Debian: apt-get install g++) or set CXX.")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp.cc")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(){return omp_get_max_threads() > 0 ? 0 : 1;}\n")
        proc = subprocess.run(cxx.split() + ["-fopenmp", src, "-o", os.path.join(tmp, "a.out")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise BuildError(f"'{cxx}' cannot build OpenMP programs (-fopenmp):\n{proc.stdout[-2000:]}")
    return cxx.split()


def _find_nvcc():
    if os.environ.get("HVD_QSGD_WITHOUT_CUDA") == "1":
        return None
    nvcc = os.environ.get("HVD_QSGD_NVCC") or shutil.which("nvcc")
    if not nvcc:
        for cand in ("/usr/local/cuda/bin/nvcc",):
            if os.path.exists(cand):
                nvcc = cand
    if not nvcc and os.environ.get("HVD_QSGD_WITH_CUDA") == "1":
        raise BuildError("HVD_QSGD_WITH_CUDA=1 but nvcc was not found (set HVD_QSGD_NVCC or PATH).")
    return nvcc


class BuildNative(build_ext):
    """Compile the C ABI libraries; each Extension's name picks the recipe."""

    def build_extension(self, ext):
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if ext.name.endswith("_lib_cpu"):
            cmd = _find_cxx() + CPU_FLAGS + [_march(), "-Wall", "-Wextra", "-Ikernels", *CPU_SOURCES, "-o", out]
            _run(cmd)
        elif ext.name.endswith("_qsgd_ops"):
            compile_flags, link_flags = _tensorflow_flags()
            # TensorFlow's flags set -std=c++17 and its C++ ABI; they come after ours
            cmd = _find_cxx() + CPU_FLAGS + [_march(), "-Wno-deprecated-declarations", "-Ikernels",
                                             *compile_flags, *TF_SOURCES, *CPU_SOURCES, *link_flags, "-o", out]
            _run(cmd)
        elif ext.name.endswith("_lib_cuda"):
            nvcc = _find_nvcc()
            archs = os.environ.get("HVD_QSGD_CUDA_ARCHS", "80;90").split(";")
            gencode = []
            for a in archs:
                gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
            gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
            cmd = [nvcc, "-O3", "--fmad=false", "-std=c++17", "-Xcompiler", "-fPIC", "-shared",
                   "-cudart", "static", *gencode, "-Ikernels", *CUDA_SOURCES, "-o", out]
            _run(cmd)
        else:
            raise BuildError(f"unknown native target {ext.name}")


def _march():
    return "-march=" + os.environ.get("HVD_QSGD_MARCH", "native")


@functools.lru_cache(maxsize=None)
def _tensorflow_flags():
    """TensorFlow's compile and link flags, or None when TensorFlow is not importable (asked once:
    importing TensorFlow takes seconds)."""
    if os.environ.get("HVD_QSGD_WITHOUT_TENSORFLOW") == "1":
        return None
    code = ("import json, tensorflow as tf; "
            "print(json.dumps([tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()]))")
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _extensions():
    exts = [Extension("hvd_qsgd._lib_cpu", sources=CPU_SOURCES, depends=HEADERS)]
    if _tensorflow_flags():
        exts.append(Extension("hvd_qsgd.tensorflow._qsgd_ops", sources=TF_SOURCES + CPU_SOURCES, depends=HEADERS))
    else:
        print("hvd_qsgd: TensorFlow not importable; building without the TensorFlow ops", file=sys.stderr)
    if _find_nvcc():
        exts.append(Extension("hvd_qsgd._lib_cuda", sources=CUDA_SOURCES, depends=HEADERS))
    else:
        print("hvd_qsgd: nvcc not found; building without the CUDA library", file=sys.stderr)
    return exts


def _version():
    with open(os.path.join(ROOT, "hvd_qsgd", "__init__.py")) as f:
        for line in f:
            if line.startswith("__version__"):
                return line.split("=")[1].strip().strip('"')
    raise BuildError("hvd_qsgd/__init__.py has no __version__")


setup(
    name="hvd_qsgd",
    version=_version(),
    description="QSGD gradient compression for Horovod (PyTorch and TensorFlow), CPU and CUDA kernels",
    packages=find_packages(include=["hvd_qsgd", "hvd_qsgd.*"]),
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildNative},
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={"test": ["pytest", "hypothesis", "mpi4py"]},
)
