"""Build and install hvd_qsgd.

The codec's native libraries are built from ``kernels/`` by calling the compilers directly:

* ``hvd_qsgd/_lib_cpu*.so``  -- always: the C++ implementation, OpenMP, vectorised (g++ / $CXX);
* ``hvd_qsgd/_lib_cuda*.so`` -- whenever ``nvcc`` is found (or $HVD_QSGD_NVCC names one); set
  ``HVD_QSGD_WITHOUT_CUDA=1`` to skip it, ``HVD_QSGD_WITH_CUDA=1`` to make its absence an error.
* ``hvd_qsgd/tensorflow/_qsgd_ops*.so`` -- whenever TensorFlow is importable at build time, in the
  build's environment or, under pip's isolated build, in the environment being installed into: the
  TensorFlow ops (``hvd_qsgd/tensorflow/qsgd_ops.cc``) compiled with the same kernel sources against
  the installed TensorFlow's headers and ABI; ``HVD_QSGD_WITHOUT_TENSORFLOW=1`` skips it.

They are plain shared libraries with a C ABI (``kernels/qsgd.h``), loaded with ctypes; they are
declared as extensions only so that setuptools puts them in the right place for both ``pip install .``
and ``pip install -e .``.

The package's metadata (name, version, dependencies) is in pyproject.toml's [project]; this file only
says how to compile the native libraries.

Environment: ``CXX`` (default g++), ``HVD_QSGD_MARCH`` (``-march=`` of the CPU library's common
code and the TensorFlow ops; see ``_march_flags``), ``HVD_QSGD_CUDA_ARCHS`` (default ``80;90``),
``HVD_QSGD_BUILD_JOBS`` (libraries built at once; default: the CPU count).

One portable build, the fastest kernels chosen at run time: the codec's per-element loops
(``kernels/qsgd_cpu_isa.cc``) are compiled once per instruction-set variant (``ISA_VARIANTS``: on
x86-64 ``baseline`` for -march=x86-64, ``sse4`` for x86-64-v2, ``avx2`` for x86-64-v3, ``avx512``
for x86-64-v4; elsewhere one ``generic``) and the library picks the widest the CPU runs when it is first used (CPUID and
XGETBV; ``HVD_QSGD_ISA`` forces one). The rest of the library is compiled for baseline x86-64
(SSE2) with ``-mtune=native`` (scheduling only), so the library runs on any x86-64 CPU.
``HVD_QSGD_MARCH=native`` (or any other -march value) compiles that common code for another target;
``HVD_QSGD_MARCH=`` (empty) passes no -march. What the common code was built for is written next to
the library (``_build_target.json``: the flags, the instruction set extensions they allow, named as
in /proc/cpuinfo, and the variants), and ``hvd_qsgd._native.load`` refuses with an ImportError,
instead of dying with SIGILL, on a CPU lacking any of them. The payload bytes depend neither on the
target nor on the variant: the codec's arithmetic is compiled without FMA contraction or
reassociation (CPU_FLAGS).
"""
import concurrent.futures
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(ROOT, "kernels")
CPU_SOURCES = ["kernels/qsgd_cpu.cc", "kernels/qsgd_elias_cpu.cc", "kernels/qsgd_control.cc",
               "kernels/qsgd_chunks.cc"]
ISA_SOURCE = "kernels/qsgd_cpu_isa.cc"  # compiled once per ISA_VARIANTS entry
CUDA_SOURCES = ["kernels/qsgd_cuda.cu"]
TF_SOURCES = ["hvd_qsgd/tensorflow/qsgd_ops.cc"]
CPU_FLAGS = [
    "-O3", "-std=c++17", "-fopenmp", "-fPIC", "-shared",
    # no FMA contraction: the CPU and CUDA libraries must round identically
    "-ffp-contract=off", "-fno-math-errno",
    # lets the vectoriser if-convert the float selects (values are unchanged: only the
    # floating-point exception flags are assumed unobserved)
    "-fno-trapping-math"]
HEADERS = ["kernels/qsgd.h", "kernels/qsgd_math.h", "kernels/qsgd_cpu_internal.h", ISA_SOURCE]


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
    """The C++ compiler's command ($CXX, default g++), checked to build OpenMP programs (once per
    build: the check compiles a program)."""
    return list(_checked_cxx(os.environ.get("CXX", "g++")))


@functools.lru_cache(maxsize=None)
def _checked_cxx(cxx):
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
    return tuple(cxx.split())


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


BUILD_TARGET = "_build_target.json"  # next to the CPU library; read by hvd_qsgd._native.check_cpu


class BuildNative(build_ext):
    """Compile the C ABI libraries; each Extension's name picks the recipe. The CPU library's build
    target record (BUILD_TARGET) is one of the outputs, copied into the source tree with the libraries
    for an editable install."""

    def finalize_options(self):
        # the libraries build side by side (setuptools' -j; HVD_QSGD_BUILD_JOBS=1 builds one at a time):
        # the TensorFlow ops, the CUDA library and the CPU library are independent compiles
        if self.parallel is None:
            self.parallel = int(os.environ.get("HVD_QSGD_BUILD_JOBS") or os.cpu_count() or 1)
        super().finalize_options()

    def build_extensions(self):
        # the C++ compiler every library but the CUDA one needs, checked before any build starts: a
        # missing one stops the build at once instead of after the CUDA library's compile
        cxx = _find_cxx()
        # the CUDA library first: the longest compile, started while the ISA objects compile
        self.extensions.sort(key=lambda ext: not ext.name.endswith("_lib_cuda"))
        # the ISA variants' objects, which the CPU library and the TensorFlow ops both link: compiled
        # once, side by side (the slowest variant first), while the libraries that need no ISA
        # objects (CUDA) build; each library that links them waits for them
        variants = _isa_variants(tuple(cxx))
        workers = self.parallel if isinstance(self.parallel, int) else 1
        if workers <= 1:  # one compile at a time: the objects when the first library needs them
            self._isa_objects = functools.lru_cache(maxsize=None)(
                lambda: [self._isa_object(cxx, name, march) for name, march in variants])
            super().build_extensions()
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(self._isa_object, cxx, name, march) for name, march in reversed(variants)][::-1]
            self._isa_objects = lambda: [f.result() for f in futures]
            try:
                super().build_extensions()
            finally:
                for f in futures:
                    f.cancel()

    def get_outputs(self):
        outputs = super().get_outputs()
        return outputs + [os.path.join(os.path.dirname(o), BUILD_TARGET) for o in outputs
                          if os.path.basename(o).startswith("_lib_cpu")]

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()
        if any(ext.name.endswith("_lib_cpu") for ext in self.extensions):
            self.copy_file(os.path.join(self.build_lib, "hvd_qsgd", BUILD_TARGET),
                           os.path.join(os.path.dirname(self.get_ext_fullpath("hvd_qsgd._lib_cpu")), BUILD_TARGET))

    def _isa_object(self, cxx, name, march):
        """ISA_SOURCE compiled for one variant (its -march and -DQSGD_ISA=<name>): the object file.
        One object serves both libraries: the file includes no TensorFlow header and no type whose
        layout TensorFlow's flags (its C++ library ABI) change, and exports only its table of
        function pointers of plain types (qsgd_cpu_internal.h's Kernels)."""
        obj = os.path.join(self.build_temp, f"qsgd_cpu_isa_{name}.o")
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        _run(cxx + CPU_FLAGS + march + ["-c", "-Wall", "-Wextra", "-Ikernels", f"-DQSGD_ISA={name}", ISA_SOURCE,
                                        "-o", obj])
        return obj

    def _isa_objects(self):
        """Every variant's object file (build_extensions sets how they are made)."""
        raise BuildError("the ISA objects are made in build_extensions")

    def build_extension(self, ext):
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if ext.name.endswith("_lib_cpu"):
            cxx = _find_cxx()
            march, source = _march_flags(tuple(cxx))
            objects = self._isa_objects()
            cmd = cxx + CPU_FLAGS + march + ["-Wall", "-Wextra", "-Ikernels", *CPU_SOURCES, *objects, "-o", out]
            _run(cmd)
            _write_build_target(os.path.dirname(out), cxx, march, source)
        elif ext.name.endswith("_qsgd_ops"):
            compile_flags, link_flags = _tensorflow_flags()
            cxx = _find_cxx()
            objects = self._isa_objects()
            # TensorFlow's flags set -std=c++17 and its C++ ABI; they come after ours
            cmd = cxx + CPU_FLAGS + _march_flags(tuple(cxx))[0] + [
                "-Wno-deprecated-declarations", "-Ikernels", *compile_flags, *TF_SOURCES, *CPU_SOURCES, *objects,
                *link_flags, "-o", out]
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


# The x86-64 micro-architecture levels (the x86-64 psABI) of the ISA variants, as explicit -m options
# for a compiler that does not know -march=x86-64-vN (GCC < 11).
X86_64_LEVEL_OPTIONS = {
    "x86-64-v2": ["-march=x86-64", "-mcx16", "-msahf", "-mpopcnt", "-msse3", "-mssse3", "-msse4.1", "-msse4.2"],
    "x86-64-v3": ["-march=x86-64", "-mcx16", "-msahf", "-mpopcnt", "-msse3", "-mssse3", "-msse4.1", "-msse4.2",
                  "-mavx", "-mavx2", "-mbmi", "-mbmi2", "-mf16c", "-mfma", "-mlzcnt", "-mmovbe", "-mxsave"],
}
X86_64_LEVEL_OPTIONS["x86-64-v4"] = X86_64_LEVEL_OPTIONS["x86-64-v3"] + [
    "-mavx512f", "-mavx512bw", "-mavx512cd", "-mavx512dq", "-mavx512vl"]
# The ISA variants on x86-64: (name, -march level), narrowest first; kernels/qsgd_cpu.cc declares the
# same names in the same order and checks each one's instructions with CPUID before using it.
ISA_VARIANTS = [("baseline", "x86-64"), ("sse4", "x86-64-v2"), ("avx2", "x86-64-v3"), ("avx512", "x86-64-v4")]

# Instruction set extensions a compiler may emit, by the macro it predefines when allowed to, and
# the /proc/cpuinfo flag of each (what _build_target.json records and _native.check_cpu checks).
ISA_MACROS = {
    "__SSE__": "sse", "__SSE2__": "sse2", "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1",
    "__SSE4_2__": "sse4_2", "__SSE4A__": "sse4a", "__POPCNT__": "popcnt",
    "__GCC_HAVE_SYNC_COMPARE_AND_SWAP_16": "cx16", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma",
    "__FMA4__": "fma4", "__XOP__": "xop", "__BMI__": "bmi1", "__BMI2__": "bmi2", "__F16C__": "f16c",
    "__LZCNT__": "abm", "__ABM__": "abm", "__MOVBE__": "movbe", "__AES__": "aes", "__PCLMUL__": "pclmulqdq",
    "__SHA__": "sha_ni", "__ADX__": "adx", "__RDRND__": "rdrand", "__RDSEED__": "rdseed", "__VAES__": "vaes",
    "__VPCLMULQDQ__": "vpclmulqdq", "__GFNI__": "gfni", "__AVXVNNI__": "avx_vnni", "__AVX512F__": "avx512f",
    "__AVX512CD__": "avx512cd", "__AVX512DQ__": "avx512dq", "__AVX512BW__": "avx512bw",
    "__AVX512VL__": "avx512vl", "__AVX512IFMA__": "avx512ifma", "__AVX512VBMI__": "avx512vbmi",
    "__AVX512VBMI2__": "avx512_vbmi2", "__AVX512VNNI__": "avx512_vnni", "__AVX512BITALG__": "avx512_bitalg",
    "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq", "__AVX512BF16__": "avx512_bf16", "__AVX512FP16__": "avx512_fp16",
}


def _compiles(cxx, flags, code="int main() { return 0; }\n", run=False):
    """Whether `cxx flags` compiles (and, with run, runs with exit status 0) a tiny program."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "probe.cc"), os.path.join(tmp, "probe")
        with open(src, "w") as f:
            f.write(code)
        proc = subprocess.run(list(cxx) + list(flags) + [src, "-o", exe], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        if proc.returncode != 0:
            return False
        return not run or subprocess.run([exe], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def _is_x86_64(cxx):
    machine = subprocess.run(list(cxx) + ["-dumpmachine"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True).stdout.strip()
    return machine.startswith(("x86_64", "amd64")), machine


def _tune(cxx, flags):
    """flags + -mtune=native where the compiler takes it: scheduling for the building CPU, never an
    instruction outside the target (measured: encode ~6% faster than the generic tuning on a Zen 3)."""
    return flags + ["-mtune=native"] if _compiles(cxx, flags + ["-mtune=native"]) else flags


@functools.lru_cache(maxsize=None)
def _isa_variants(cxx):
    """[(variant name, its compile flags)] for ISA_SOURCE: every ISA_VARIANTS level on x86-64 (the
    library dispatches among them at run time), one "generic" variant with no -march elsewhere."""
    x86, _ = _is_x86_64(cxx)
    if not x86:
        return [("generic", [])]
    variants = []
    for name, level in ISA_VARIANTS:
        flags = ["-march=" + level]
        if not _compiles(cxx, flags):
            flags = X86_64_LEVEL_OPTIONS.get(level)
            if flags is None or not _compiles(cxx, flags):
                raise BuildError(f"'{' '.join(cxx)}' cannot compile for {level} (the codec's {name} kernels); "
                                 "use g++ >= 9 or clang >= 12")
        variants.append((name, _tune(cxx, flags)))
    return variants


@functools.lru_cache(maxsize=None)
def _march_flags(cxx):
    """(the -march options of the common CPU code, why they were chosen); see the module's docstring."""
    if "HVD_QSGD_MARCH" in os.environ:
        value = os.environ["HVD_QSGD_MARCH"].strip()
        return (["-march=" + value] if value else []), "HVD_QSGD_MARCH"
    x86, machine = _is_x86_64(cxx)
    if not x86:
        return [], f"default: no -march for {machine or 'this compiler'}'s target"
    return _tune(cxx, ["-march=x86-64"]), ("default: baseline x86-64, the per-element kernels chosen at run "
                                           "time among " + ", ".join(n for n, _ in ISA_VARIANTS))


def _write_build_target(directory, cxx, march, source):
    """_build_target.json: the target of the CPU code and the instruction set extensions it allows
    (the compiler's predefined macros under those flags), for hvd_qsgd._native.check_cpu."""
    proc = subprocess.run(list(cxx) + march + ["-dM", "-E", "-x", "c++", os.devnull], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise BuildError(f"'{' '.join(cxx + march)} -dM -E' failed:\n{proc.stdout[-2000:]}")
    macros = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("#define ")}
    features = {m.strip("_").replace("GCC_HAVE_SYNC_COMPARE_AND_SWAP_16", "CX16"): flag
                for m, flag in ISA_MACROS.items() if m in macros}
    march_values = [f.split("=", 1)[1] for f in march if f.startswith("-march=")]
    record = {"march": march_values[-1] if march_values else None, "compile_flags": march, "chosen_by": source,
              "compiler": " ".join(cxx), "cpu_features": dict(sorted(features.items())),
              "isa_variants": {name: flags for name, flags in _isa_variants(tuple(cxx))}}
    with open(os.path.join(directory, BUILD_TARGET), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"hvd_qsgd: CPU code built with {' '.join(march) or 'no -march'} ({source})", flush=True)


# what pip sets up for an isolated build (``pip install .`` without --no-build-isolation): its own
# folders on the path, and the environment's own packages hidden from the build
_ISOLATION_VARIABLES = ("PYTHONPATH", "PYTHONNOUSERSITE")


@functools.lru_cache(maxsize=None)
def _tensorflow_flags():
    """TensorFlow's compile and link flags, or None when TensorFlow is not importable (asked once:
    importing TensorFlow takes seconds). Asked of this Python as it runs the build, then, where pip
    isolates the build, of the same Python without pip's variables: the environment the package is
    being installed into, whose TensorFlow the ops must be built against."""
    if os.environ.get("HVD_QSGD_WITHOUT_TENSORFLOW") == "1":
        return None
    code = ("import json, tensorflow as tf; "
            "print(json.dumps([tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()]))")
    envs = [dict(os.environ)]
    if any(k in os.environ for k in _ISOLATION_VARIABLES):
        envs.append({k: v for k, v in os.environ.items() if k not in _ISOLATION_VARIABLES})
    for i, env in enumerate(envs):
        proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env=dict(env, TF_CPP_MIN_LOG_LEVEL="3"))
        if proc.returncode == 0:
            if i:
                print("hvd_qsgd: TensorFlow found in the environment being installed into (outside pip's "
                      "isolated build): building the TensorFlow ops against it", file=sys.stderr)
            return json.loads(proc.stdout.strip().splitlines()[-1])
    return None


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


setup(
    # name, version, dependencies and the packages (hvd_qsgd*) are in pyproject.toml
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildNative},
)
