"""The CUDA library's source compiled for the host, and the wrappers run on it.

``build(directory)`` compiles kernels/qsgd_cuda.cu as host C++ against tests/cuda_emu/cuda_runtime.h
(a warp's lanes as fibers, real shuffles and atomics; 'device' pointers are host pointers) and
``load(path)`` opens it with the CUDA library's argument types. This checks the kernels' arithmetic,
indexing, packing, reduction order and validation on any machine, not the GPU's memory model,
streams or speed: a result from it is an emulated result.

``on_host(lib)`` goes further: within it, host torch tensors stand for CUDA tensors. The three points
where ``hvd_qsgd.cuda`` meets the device (``_lib``, ``_stream_handle``, ``_is_device``) and
``cuda.available`` are pointed at the emulation, so every wrapper, ``backends.CudaBackend`` and
(``adapter=True``: ``backends.choose`` gives host tensors the CUDA backend) the PyTorch adapter's
device path run on it, with the payloads, residuals and frames they make on a GPU.
"""
import contextlib
import ctypes
import os
import shutil
import subprocess
from types import SimpleNamespace

from hvd_qsgd import _native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = "HVD_QSGD_EMULATED_CUDA_LIB"  # a built library's path, handed to multi-rank workers


def build(directory, defines=()):
    """The path of the emulated library built in ``directory`` (``defines``: ``NAME=VALUE`` macros, e.g.
    a kernel variant the GPU build does not take by default); RuntimeError without a compiler."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler to build the emulated CUDA library")
    so = os.path.join(str(directory), "libqsgd_cuda_emu.so")
    cmd = [cxx, "-O2", "-std=c++20", "-x", "c++", "-fPIC", "-shared", "-pthread", "-ffp-contract=off",
           "-fno-trapping-math", *(f"-D{d}" for d in defines), "-Itests/cuda_emu", "-Ikernels",
           "kernels/qsgd_cuda.cu", "-o", so]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return so


def load(path):
    """The emulated library at ``path``, with the argument types of the CUDA library's entry points."""
    lib = ctypes.CDLL(path)
    _native.declare_cuda(lib)
    return lib


def environ_path():
    """The built library's path a multi-rank worker was handed (``ENV``)."""
    path = os.environ.get(ENV)
    if not path or not os.path.exists(path):
        raise RuntimeError(f"{ENV} must name the emulated CUDA library built by tests/emulated_cuda.build "
                           f"(got {path!r})")
    return path


@contextlib.contextmanager
def on_host(lib, adapter=False):
    """Within: host tensors are the device's, and hvd_qsgd.cuda runs the emulated ``lib``; with
    ``adapter``, ``backends.choose`` also gives host tensors the CUDA backend (where it has every
    step). Yields an object whose ``calls`` counts the wrappers' calls into ``lib``. Restored on
    exit."""
    from hvd_qsgd import backends, cuda
    saved = [(cuda, "_lib", cuda._lib), (cuda, "_stream_handle", cuda._stream_handle),
             (cuda, "_is_device", cuda._is_device), (cuda, "available", cuda.available),
             (backends, "choose", backends.choose)]
    choose, seen = backends.choose, SimpleNamespace(calls=0)

    def emulated():
        seen.calls += 1
        return lib

    cuda._lib = emulated
    cuda._stream_handle = lambda torch, device: None
    cuda._is_device = lambda t: t.device.type == "cpu"
    cuda.available = lambda: True
    if adapter:
        backends.choose = lambda device_type, settings, red: choose("cuda", settings, red)
    try:
        yield seen
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
