"""What this installation of hvd_qsgd can do: ``python -m hvd_qsgd`` and ``hvd_qsgd.diagnose()``.

It reports the package's version; the CPU codec library (what it was built for, the kernel variant in
use and those compiled in); the CUDA library (built or not, the GPU architectures its fat binary holds,
whether a device is visible and covered); the TensorFlow ops (built or not; loaded only with
``--tensorflow``, since importing TensorFlow takes seconds); Horovod (version, frameworks, controllers,
GPU operations); the reduction ``reduction="auto"`` picks for the layout given (``--np``,
``--ranks-per-node``, ``--link-gbps``); and with ``--self-test`` one encode/decode round trip per codec
backend (``hvd_qsgd.install_selftest``). Every problem is printed with what to do about it.

Exit status (``main``, and what ``diagnose`` returns): 0 when everything checked works (a missing
optional part, such as CUDA or TensorFlow, is a notice), 1 when a self-test fails or a part that is
there does not work. Torch, TensorFlow and Horovod are imported only inside the checks, never when
the package is imported.
"""
import argparse
import importlib.util
import os
import platform
import struct
import sys
from typing import List, Optional, Sequence, Tuple

from hvd_qsgd import _native, codec, cuda
from hvd_qsgd.settings import Settings

SIZES = (10_000, 100_000, 1_000_000, 10_000_000, 100_000_000)   # elements, for the auto table
FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
REBUILD = "pip install --no-build-isolation --no-deps -e . (or `make setup`) in the repository"


class Report:
    """The lines printed as they come, and the notices and problems, each with what to do, at the end."""

    def __init__(self, out):
        self.out = out
        self.notices: List[Tuple[str, str]] = []
        self.problems: List[Tuple[str, str]] = []

    def section(self, title: str) -> None:
        print(f"\n{title}", file=self.out, flush=True)

    def line(self, label: str, value) -> None:
        print(f"  {label + ':':<30} {value}", file=self.out, flush=True)

    def notice(self, what: str, fix: str) -> None:
        self.notices.append((what, fix))

    def problem(self, what: str, fix: str) -> None:
        self.problems.append((what, fix))

    def summary(self) -> None:
        for title, items in (("notices (optional parts; nothing is broken)", self.notices),
                             ("PROBLEMS", self.problems)):
            if items:
                self.section(title)
                for what, fix in items:
                    print(f"  - {what}\n      what to do: {fix}", file=self.out)
        verdict = "everything checked works" if not self.problems else f"{len(self.problems)} problem(s) found"
        print(f"\n{verdict}", file=self.out, flush=True)


# -- CPU ---------------------------------------------------------------------------------------------

def _check_cpu(rep: Report) -> bool:
    rep.section("CPU codec library")
    try:
        lib = _native.load()
    except ImportError as e:
        rep.line("library", "does not load")
        rep.problem(f"the CPU codec library does not load: {e}", "follow the message above; after a rebuild run "
                    "`python -m hvd_qsgd --self-test` again")
        return False
    rep.line("library", f"{lib._name} (codec ABI {_native.ABI_VERSION})")
    record = _native.build_target()
    if record:
        rep.line("common code built for", " ".join(record.get("compile_flags") or []) or "the compiler's default")
    else:
        rep.line("common code built for", "not recorded (a library built before _build_target.json existed)")
    rep.line("variant in use", codec.cpu_isa())
    variants = codec.cpu_isas()
    rep.line("variants", ", ".join(n + ("" if ok else " (not on this CPU)") for n, ok in variants.items()))
    forced = os.environ.get("HVD_QSGD_ISA")
    if forced and forced != "auto":
        rep.line("chosen by", f"HVD_QSGD_ISA={forced}")
    else:
        rep.line("chosen by", "the widest this CPU runs (HVD_QSGD_ISA forces one)")
    rep.line("threads", codec.get_num_threads())
    return True


# -- CUDA --------------------------------------------------------------------------------------------

def cuda_archs(path: str) -> Tuple[List[int], List[int]]:
    """(SASS architectures, PTX architectures) of the CUDA fat binaries in the library at ``path``, as
    numbers (90 for sm_90), read from the fat binary headers; ([], []) where none can be read."""
    with open(path, "rb") as f:
        data = f.read()
    sass, ptx = set(), set()
    at = data.find(FATBIN_MAGIC)
    while at >= 0 and at + 16 <= len(data):
        _, _, head, size = struct.unpack_from("<IHHQ", data, at)
        entry, end = at + head, min(at + head + size, len(data))
        while entry + 32 <= end:
            kind, _, entry_head, entry_size = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            (ptx if kind == 1 else sass if kind == 2 else set()).add(arch)
            if entry_head == 0:
                break
            entry += entry_head + entry_size
        at = data.find(FATBIN_MAGIC, max(end, at + 4))
    return sorted(sass), sorted(ptx)


def _torch_devices():
    """(torch version or None, torch's CUDA version or None, [(index, name, sm)]) without failing."""
    if importlib.util.find_spec("torch") is None:
        return None, None, []
    import torch
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            devices.append((i, torch.cuda.get_device_name(i), major * 10 + minor))
    return torch.__version__, torch.version.cuda, devices


def _covered(sm: int, sass: Sequence[int], ptx: Sequence[int]) -> str:
    """"sass", "ptx" (compiled at first use by the driver) or "" for a device of architecture ``sm``."""
    if any(a // 10 == sm // 10 and a <= sm for a in sass):
        return "sass"
    return "ptx" if any(a <= sm for a in ptx) else ""


def _check_cuda(rep: Report) -> None:
    rep.section("CUDA")
    path = _native._find("_lib_cuda")
    sass, ptx = cuda_archs(path) if path else ([], [])
    if path:
        archs = ", ".join(f"sm_{a}" for a in sass) or "unknown"
        rep.line("library built", f"yes: {archs}" + "".join(f"; PTX compute_{a}" for a in ptx))
    else:
        rep.line("library built", "no")
    version, torch_cuda, devices = _torch_devices()
    rep.line("torch", f"{version} (CUDA {torch_cuda or 'not compiled in'})" if version else "not installed")
    loads = _cuda_library_loads(rep, path)
    rep.line("devices visible", "; ".join(f"cuda:{i} {n} (sm_{sm})" for i, n, sm in devices) or "none")
    if not path:
        rep.notice("the CUDA library was not built (nvcc was not found at install time), so CUDA tensors are "
                   "encoded on the host", "install the CUDA toolkit (nvcc) and rebuild with HVD_QSGD_WITH_CUDA=1 "
                   f"(HVD_QSGD_NVCC=/path/to/nvcc if it is not on PATH; HVD_QSGD_CUDA_ARCHS=\"80;90\" picks the "
                   f"GPU architectures): {REBUILD}" if devices else
                   "nothing, on a machine without a GPU; on a GPU machine install nvcc and rebuild with "
                   f"HVD_QSGD_WITH_CUDA=1: {REBUILD}")
    elif not devices:
        rep.notice("no CUDA device is visible" + ("" if version else " (torch, which the CUDA path needs, is not "
                                                  "installed)"),
                   "nothing, on a machine without a GPU; else check nvidia-smi, CUDA_VISIBLE_DEVICES and that "
                   "torch was built with CUDA (torch.version.cuda)")
    for i, name, sm in devices if path and loads else []:
        how = _covered(sm, sass, ptx)
        if not how:
            rep.problem(f"cuda:{i} ({name}) is sm_{sm}, and the CUDA library holds code for "
                        f"{', '.join(f'sm_{a}' for a in sass + ptx)} only",
                        f"rebuild with HVD_QSGD_CUDA_ARCHS=\"{';'.join(str(a) for a in sorted(set(sass) | {sm}))}\": "
                        + REBUILD)
        elif how == "ptx":
            rep.notice(f"cuda:{i} ({name}, sm_{sm}) runs the library's PTX, compiled by the driver at first use",
                       f"for a faster start rebuild with sm_{sm} in HVD_QSGD_CUDA_ARCHS: {REBUILD}")
    rep.line("CUDA kernels usable", "yes" if path and loads and devices and cuda.available() else "no")


def _cuda_library_loads(rep: Report, path: Optional[str]) -> bool:
    if not path:
        return False
    try:
        _native.load_cuda()
        return True
    except (ImportError, OSError) as e:
        rep.line("library loads", "no")
        rep.problem(f"the CUDA library does not load: {e}", f"rebuild the native libraries together: {REBUILD}")
        return False


# -- TensorFlow --------------------------------------------------------------------------------------

def _check_tensorflow(rep: Report, load: bool) -> None:
    rep.section("TensorFlow ops")
    here = os.path.join(os.path.dirname(os.path.abspath(codec.__file__)), "tensorflow")
    built = sorted(f for f in os.listdir(here) if f.startswith("_qsgd_ops") and f.endswith(".so"))
    installed = importlib.util.find_spec("tensorflow") is not None
    skip_env = os.environ.get("HVD_QSGD_WITHOUT_TENSORFLOW") == "1"
    rep.line("ops library built", f"yes: {built[0]}" if built else "no")
    rep.line("tensorflow", "installed" if installed else "not installed")
    if not built:
        if installed:
            rep.notice("the TensorFlow ops were not built although TensorFlow is installed"
                       + (" (HVD_QSGD_WITHOUT_TENSORFLOW=1 is set here: it skips them at build time)"
                          if skip_env else ""),
                       f"unset HVD_QSGD_WITHOUT_TENSORFLOW and rebuild with TensorFlow importable: {REBUILD}")
        rep.line("ops load", "no (not built)")
        return
    if not installed:
        rep.notice("the TensorFlow ops are built but TensorFlow is not installed here",
                   "nothing for PyTorch jobs; for TensorFlow install the version they were built against")
        rep.line("ops load", "no (TensorFlow is not installed)")
        return
    if skip_env or not load:
        why = "HVD_QSGD_WITHOUT_TENSORFLOW=1 is set" if skip_env else "pass --tensorflow"
        rep.line("ops load", f"not checked ({why}; importing TensorFlow takes seconds)")
        return
    from hvd_qsgd import _tf_ops
    try:
        _tf_ops.load()
    except Exception as e:  # noqa: BLE001 - the op library's load errors are of several kinds
        rep.line("ops load", "FAILED")
        rep.problem(f"the TensorFlow ops do not load: {type(e).__name__}: {e}",
                    "they must be built against the TensorFlow installed now: " + REBUILD)
        return
    import tensorflow as tf
    rep.line("ops load", f"yes (TensorFlow {tf.__version__})")


# -- Horovod -----------------------------------------------------------------------------------------

HOROVOD_FRAMEWORKS = {"torch": "mpi_lib_v2", "tensorflow": "mpi_lib", "mxnet": "mpi_lib"}


def _horovod_basics(frameworks: Sequence[str], tensorflow: bool):
    """The Horovod module whose *_built() answer for this build (horovod.torch, else horovod.tensorflow
    when TensorFlow may be imported), or (None, why)."""
    if "torch" in frameworks and importlib.util.find_spec("torch") is not None:
        import horovod.torch as hvd
        return hvd, ""
    if "tensorflow" in frameworks and tensorflow and os.environ.get("HVD_QSGD_WITHOUT_TENSORFLOW") != "1":
        import horovod.tensorflow as hvd
        return hvd, ""
    if "tensorflow" in frameworks:
        return None, "read through TensorFlow only: pass --tensorflow"
    return None, "no framework extension of Horovod can be loaded"


def _check_horovod(rep: Report, tensorflow: bool) -> None:
    rep.section("Horovod")
    spec = importlib.util.find_spec("horovod")
    if spec is None:
        rep.line("Horovod", "not installed")
        rep.notice("Horovod is not installed: the codec works, the compressors have nothing to plug into",
                   "install it with `make setup` (scripts/setup.sh builds Horovod 0.28.1 against the installed "
                   "frameworks), or HOROVOD_WITH_PYTORCH=1 pip install --no-cache-dir 'horovod>=0.28.1,<0.29'")
        return
    import horovod
    rep.line("Horovod", horovod.__version__)
    root = list(spec.submodule_search_locations)[0]
    frameworks = [fw for fw, stem in HOROVOD_FRAMEWORKS.items() if os.path.isdir(os.path.join(root, fw)) and any(
        f.startswith(stem + ".") and f.endswith(".so") for f in os.listdir(os.path.join(root, fw)))]
    rep.line("frameworks", ", ".join(frameworks) or "none")
    try:
        hvd, why = _horovod_basics(frameworks, tensorflow)
    except Exception as e:  # noqa: BLE001 - a broken extension raises what its loader raises
        hvd, why = None, ""
        rep.problem(f"Horovod's framework extension does not load: {type(e).__name__}: {e}",
                    "rebuild Horovod against the installed framework (`make setup`)")
    if hvd is None:
        rep.line("controllers", f"unknown ({why or 'see PROBLEMS'})")
        if not frameworks:
            rep.notice("Horovod was built without any framework", "rebuild it with HOROVOD_WITH_PYTORCH=1 "
                       "and/or HOROVOD_WITH_TENSORFLOW=1 (`make setup` does)")
        return
    gloo, mpi = bool(hvd.gloo_built()), bool(hvd.mpi_built())
    rep.line("Gloo controller", "built" if gloo else "not built")
    rep.line("MPI controller", "built" if mpi else "not built")
    nccl = hvd.nccl_built()
    rep.line("NCCL operations", f"built (NCCL {nccl})" if nccl and not isinstance(nccl, bool) else
             "built" if nccl else "not built")
    rep.line("GPU builds", ", ".join(f"{k} {'yes' if f() else 'no'}" for k, f in
                                     (("CUDA", hvd.cuda_built), ("ROCm", hvd.rocm_built))))
    if not (gloo or mpi):
        rep.problem("Horovod was built with neither Gloo nor MPI: horovodrun cannot start a job",
                    "rebuild Horovod with HOROVOD_WITH_GLOO=1 (`make setup` does)")
    if not nccl and cuda.available():
        rep.notice("Horovod has no NCCL operations: GPU tensors are reduced through the host",
                   "rebuild Horovod with HOROVOD_GPU_OPERATIONS=NCCL for GPU collectives")


# -- reduction="auto" --------------------------------------------------------------------------------

def _check_auto(rep: Report, n: int, per_node: Optional[int], link_gbps: Optional[float]) -> None:
    settings = Settings.make(4, link_gbps=link_gbps)
    layout = f"{n} ranks" + (f", {per_node} per node" if per_node else ", one per node")
    link = (f"{link_gbps:g} Gbit/s" if link_gbps else
            f"{os.environ['HVD_QSGD_BANDWIDTH_GBITS']} Gbit/s (HVD_QSGD_BANDWIDTH_GBITS)"
            if os.environ.get("HVD_QSGD_BANDWIDTH_GBITS") else "10 Gbit/s (the default; --link-gbps sets it)")
    rep.section(f"reduction=\"auto\" (QSGD {settings.bits} bits, bucket {settings.bucket_size}) for {layout}, "
                f"link {link}")
    if per_node and (n % per_node or per_node > n):
        rep.problem(f"--np {n} is not a whole number of nodes of {per_node} ranks: auto weighs the flat "
                    "reductions only", "give --ranks-per-node a divisor of --np (Horovod's local size)")
    for numel in SIZES:  # host tensors, then CUDA tensors (the link inside a node differs: cost_model.intra_link)
        rep.line(f"auto for {numel} elements", f"{settings.exchange_reduction(n, numel, per_node, 'cpu')} "
                 f"(CUDA tensors: {settings.exchange_reduction(n, numel, per_node, 'cuda')})")
    rep.line("uncompressed", f"tensors of fewer than {settings.min_numel} elements (min_numel)")


# -- self-test, the whole report, the command --------------------------------------------------------

def _self_test(rep: Report) -> None:
    from hvd_qsgd import install_selftest
    rep.section("self-test (one encode/decode round trip per backend, against the CPU library)")
    for r in install_selftest.run():
        verdict = "skipped" if r.ok is None else "ok" if r.ok else "FAILED"
        rep.line(f"self-test {r.backend}", f"{verdict}: {r.detail}" if r.ok is False else
                 f"{verdict}" + (f" ({r.detail})" if r.ok else r.detail[len("skipped"):]))
        if r.ok is False:
            rep.problem(f"self-test {r.backend} FAILED: {r.detail}", r.fix)


def diagnose(np: int = 4, ranks_per_node: Optional[int] = None, link_gbps: Optional[float] = None,
             self_test: bool = False, tensorflow: bool = False, out=None) -> int:
    """Print what this installation can do (to ``out``, default stdout) and return the exit status:
    0 when everything checked works, 1 when a self-test fails or a part that is there does not work."""
    rep = Report(out or sys.stdout)
    # the root package ran before this module (a package runs before its modules); read, not imported,
    # since the root package exports diagnose (an import back would be a cycle)
    root = sys.modules[__name__.rpartition(".")[0]]
    print(f"hvd_qsgd {root.__version__} ({os.path.dirname(os.path.abspath(root.__file__))})", file=rep.out)
    print(f"Python {platform.python_version()}, {platform.machine()}", file=rep.out, flush=True)
    cpu_ok = _check_cpu(rep)
    _check_cuda(rep)
    _check_tensorflow(rep, tensorflow)
    _check_horovod(rep, tensorflow)
    if cpu_ok:   # (auto weighs payload sizes: the CPU library computes them)
        _check_auto(rep, np, ranks_per_node, link_gbps)
    else:
        rep.section('reduction="auto"')
        rep.line("auto", "not weighed: the CPU library does not load (above)")
    if self_test and cpu_ok:
        _self_test(rep)
    rep.summary()
    return 1 if rep.problems else 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hvd_qsgd", description="Say what this installation of hvd_qsgd "
                                "can do, and what to do about what it cannot.")
    p.add_argument("--np", type=int, default=4, help="ranks of the job, for the reduction auto picks (default 4)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks on each node (Horovod's local size)")
    p.add_argument("--link-gbps", type=float, default=None, help="each node's network link, Gbit/s")
    p.add_argument("--self-test", action="store_true", help="an encode/decode round trip per codec backend")
    p.add_argument("--tensorflow", action="store_true", help="import TensorFlow and load the ops (seconds)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.np < 1 or (args.ranks_per_node is not None and args.ranks_per_node < 1):
        _parser().error("--np and --ranks-per-node must be positive")
    if args.link_gbps is not None and not args.link_gbps > 0:
        _parser().error("--link-gbps must be a positive number of Gbit/s")
    if args.tensorflow:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return diagnose(args.np, args.ranks_per_node, args.link_gbps, args.self_test, args.tensorflow)
