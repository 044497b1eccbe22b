"""What the benchmark subcommands share: argument types, the description of the machine, and the
entry point of a subcommand module run on its own."""
import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_main(module, add_arguments, run, argv=None):
    """``python -m benchmarks.<module>``: parse the subcommand's arguments and run it, as
    ``python -m benchmarks <module>`` does (the torch and e2e benchmarks start their workers so)."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def job_env():
    """The environment of a benchmark's horovodrun job: this checkout first on PYTHONPATH, this
    Python's bin (horovodrun) first on PATH, one OpenMP thread per rank, unbuffered output, Open MPI
    allowed to run as root."""
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="2",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def horovodrun():
    """The horovodrun beside this Python, else the first on PATH (Horovod installed with
    ``pip --target`` elsewhere, as on the GPU machine)."""
    beside = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return beside if os.access(beside, os.X_OK) else (shutil.which("horovodrun") or beside)


def launch_job(cmd, timeout, cwd=None):
    """Run ``cmd`` (a horovodrun job) in its own session with ``job_env()``; (exit status, output,
    seconds). Past ``timeout`` seconds the whole session is killed and the status is 124."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out = (out or "") + f"\n[timed out after {timeout}s; the job was killed]"
        status = 124
    return status, out, time.perf_counter() - t0


def launch_order(trees, repeats):
    """The trees' launches, ``repeats`` rounds in ABBA order (each round reversing the last): a launch's
    place in a round moves its times (the one after another job runs slower here), so each tree takes
    each place equally often."""
    return [t for i in range(repeats) for t in (trees if i % 2 == 0 else trees[::-1])]


def paired_launches(trees, repeats):
    """``launch_order``'s launches with the PYTHONHASHSEED of each: its round's number, so that the
    trees of a round run with the same hash seed and the rounds with different ones (the user's
    PYTHONHASHSEED, where set, for all). The hash seed lays out a process's dicts and sets: two
    launches of one checkout differed by up to 30% in a step here with random seeds, and by 1-4%
    with the same seed (docs/performance.md)."""
    fixed = os.environ.get("PYTHONHASHSEED")
    return [(t, fixed if fixed is not None else str(i // len(trees))) for i, t in enumerate(launch_order(trees, repeats))]


def tree_runs(trees, repeats, worker_args):
    """Run ``python -m benchmarks.overhead <worker_args>`` in each tree (its own process, ``repeats``
    rounds in ABBA order, a round's launches with one hash seed: ``paired_launches``), each printing a JSON object on its last line: {(tree, key): [every run's
    value]}, keys in the order the workers give them; None (the failure printed) where one fails."""
    table = {}
    for tree, hash_seed in paired_launches(trees, repeats):
        cmd = [sys.executable, "-m", "benchmarks.overhead"] + list(worker_args)
        env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONHASHSEED=hash_seed)
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            print(f"{tree} FAILED:\n{(done.stdout + done.stderr)[-3000:]}")
            return None
        for key, v in json.loads(done.stdout.strip().splitlines()[-1]).items():
            table.setdefault((tree, key), []).append(v)
    return table


def int_at_least(low):
    """An argparse type: an integer >= low."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            v = low - 1
        if v < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}: {text!r}")
        return v
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def bit_widths(low=1):
    """An argparse type: comma-separated bit widths in low..8."""
    def parse(text):
        try:
            bits = [int(b) for b in text.split(",") if b.strip()]
        except ValueError:
            bits = []
        if not bits or any(not low <= b <= 8 for b in bits):
            raise argparse.ArgumentTypeError(f"bits must be integers in {low}..8, comma-separated: {text!r}")
        return bits
    return parse


def ms_quartiles(seconds, median_digits=0):
    """'median [q1-q3]' of a list of times in seconds, in ms (just the median for fewer than 2)."""
    t = [1e3 * v for v in seconds]
    med = f"{statistics.median(t):.{median_digits}f}"
    if len(t) < 2:
        return med
    q1, _, q3 = statistics.quantiles(t, n=4, method="inclusive")
    return f"{med} [{q1:.0f}-{q3:.0f}]"


# AMD's core generations by CPUID family and model range (the model name of a virtual machine's CPU,
# "AMD EPYC", often says neither)
AMD_CORES = {23: [(0x00, 0xFF, "Zen/Zen 2")],
             25: [(0x00, 0x0F, "Zen 3"), (0x10, 0x1F, "Zen 4"), (0x20, 0x2F, "Zen 3"), (0x40, 0x5F, "Zen 3"),
                  (0x60, 0x7F, "Zen 4"), (0xA0, 0xAF, "Zen 4")],
             26: [(0x00, 0xFF, "Zen 5")]}


def cpu_description(cpuinfo):
    """The CPU as reports name it, from /proc/cpuinfo's text: its model name, CPUID family and model
    (and AMD's core generation where known), and its widest vector extension, e.g. "AMD EPYC (family
    25 model 17, Zen 4; AVX-512)": machines whose model names are alike run the kernels at different
    speeds."""
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break   # the first processor's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    details = []
    if fields.get("cpu family", "").isdigit() and fields.get("model", "").isdigit():
        family, model = int(fields["cpu family"]), int(fields["model"])
        core = [c for lo, hi, c in AMD_CORES.get(family, []) if lo <= model <= hi]
        amd = fields.get("vendor_id") == "AuthenticAMD"
        details.append(f"family {family} model {model}" + (f", {core[0]}" if amd and core else ""))
    flags = set(fields.get("flags", "").split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2" if flags else None
    return name + (f" ({'; '.join(details + ([vector] if vector else []))})" if details or vector else "")


def machine_info():
    """CPU (``cpu_description``), core counts, Python version and the 1-minute load average (a busy
    machine's timings are noisy; every report records it)."""
    try:
        with open("/proc/cpuinfo") as f:
            model = cpu_description(f.read())
    except OSError:
        model = platform.processor() or platform.machine()
    return dict(cpu=model, cores=os.cpu_count(), usable_cores=len(os.sched_getaffinity(0)),
                python=platform.python_version(), load_avg_1min=os.getloadavg()[0])


# element counts on the command line: suffixes K, M, G are powers of 1024
ELEMENT_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def element_count(text):
    """'64M' -> 64 * 2^20 (suffixes K, M, G are powers of 1024; a plain integer is elements)."""
    t = text.strip().upper()
    unit = t[-1] if t and t[-1] in ELEMENT_UNITS else ""
    try:
        n = int(t[: len(t) - len(unit)]) * ELEMENT_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a size must be positive: {text!r}")
    return n
