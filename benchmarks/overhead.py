"""Per-tensor cost: the step time of K small gradients through ``hvd.DistributedOptimizer``
(PyTorch) or ``hvd.DistributedGradientTape`` in a ``tf.function`` step (``--framework tensorflow``).

    python -m benchmarks overhead --np 2 --tensors 1,16,64 --numel 20000
    python -m benchmarks overhead --trees /path/to/other/checkout,.     # two versions side by side
    python -m benchmarks overhead --framework tensorflow --modes none,qsgd4-allgather,qsgd4-scatter
    python -m benchmarks overhead --calls --trees /path/to/other/checkout,.   # per call, one process
    python -m benchmarks overhead --calls --device cuda    # CUDA gradients (on a machine with a GPU)
    python -m benchmarks overhead --codec-calls --steps 1000 --trees /path/to/other/checkout,.   # the codec's calls

Each tree runs its own copy of this benchmark (``python -m benchmarks.overhead`` in the tree): to
compare with a tree that predates a mode or ``--framework``, copy this file into it.

Each mode (none, QSGD(4) with the "auto" reduction, QSGD(4) allgather, QSGD(4) scatter_allgather,
QSGD(4) "auto" with ``fusion=True``, with ``overlap=True``, with ``fusion_mb=64``: fusion buffers, and
with both of the last two; with ``join=False`` (``qsgd4-nojoin``, both frameworks); ``floor-buffered`` and ``floor-allgather``: the least a fusion buffer of
QSGD(4), or a gradient's own allgather exchange, costs with this codec and Horovod's operations, no
compressor around it, ``benchmarks/overhead_floor.py``)
trains a model of K parameters of ``--numel`` elements each (loss = sum of p * x) for ``--steps``
timed steps on ``--np`` Gloo ranks on loopback; a step is zero_grad, backward, step after a
barrier, and its time is the maximum over ranks (and its CPU time, every thread of every rank, in
brackets: what the compressor adds, less moved by how the ranks were scheduled). The table gives the median step per K and mode,
for every tree in ``--trees`` (each a checkout of this package, its kernels built), launched in
turn for each K (``--repeats`` times, alternating) so that both see the same machine load: what a compressed tensor costs beyond the
bytes it moves (the handshake's collectives, Python, the codec at this size). TensorFlow adds a
second table: the first step, which traces the step, optimizes its graph and runs it once.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks import overhead_calls, overhead_codec, overhead_floor
from benchmarks.common import REPO_ROOT, element_count, int_at_least, launch_job, machine_info, module_main, paired_launches

MODES = {"none": None, "qsgd4-auto": "auto", "qsgd4-allgather": "allgather", "qsgd4-scatter": "scatter_allgather",
         "qsgd4-fused": "auto+fusion", "qsgd4-overlap": "auto+overlap",
         "qsgd4-buffered": "auto+buffers", "qsgd4-buffered-overlap": "auto+buffers+overlap",
         "qsgd4-nojoin": "auto+nojoin", "floor-buffered": "floor", "floor-allgather": "floor"}
# "+<setting>": that setting on ("+buffers": fusion_mb=BUFFER_MB; "+nojoin": join=False);
# "floor": benchmarks.overhead_floor
BUFFER_MB = 64
TF_MODES = [m for m in MODES if (MODES[m] or "").replace("+nojoin", "").count("+") == 0 and MODES[m] != "floor"]


def add_arguments(p):
    p.add_argument("--np", type=int_at_least(2), default=2, help="ranks (default %(default)s)")
    p.add_argument("--tensors", default="1,16,64", help="numbers of gradients K (default %(default)s)")
    p.add_argument("--numel", type=element_count, default=20000, help="elements a gradient (K, M: powers of 1024; default %(default)s)")
    p.add_argument("--modes", help=f"modes (default: {','.join(MODES)}; in TensorFlow those of {','.join(TF_MODES)})")
    p.add_argument("--steps", type=int_at_least(1), default=40, help="timed steps (default %(default)s)")
    p.add_argument("--warmup", type=int_at_least(0), default=5, help="untimed steps (default %(default)s)")
    p.add_argument("--trees", default=".", help="checkouts to compare, comma-separated (default: this one)")
    p.add_argument("--repeats", type=int_at_least(1), default=1,
                   help="launches per tree and K, alternating between the trees; the table gives the median")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", choices=("torch", "tensorflow"), default="torch",
                   help="the framework whose Horovod binding carries the step (default %(default)s; "
                        "TensorFlow has no fused or overlap mode)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the gradients are (PyTorch; cuda: each rank on the GPU of its local rank, the CUDA "
                        "kernels encoding, a step timed until the device is done; default %(default)s)")
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--calls", action="store_true",
                   help="time the compressor's compress and decompress per call in one process instead "
                        "(benchmarks/overhead_calls.py; PyTorch)")
    p.add_argument("--calls-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--codec-calls", action="store_true",
                   help="time the codec's calls a gradient makes, by size, instead (benchmarks/overhead_codec.py; "
                        "--steps: calls a timed loop)")
    p.add_argument("--codec-calls-worker", action="store_true", help=argparse.SUPPRESS)


def compression_of(hvd, hvd_qsgd_module, mode, **more):
    red = MODES[mode]
    if red is None:
        return hvd.Compression.none
    if red == "floor":   # the least such an exchange costs: a reference, not hvd_qsgd's compressor
        return (overhead_floor.FloorBuffered if mode == "floor-buffered" else overhead_floor.FloorAllgather)(hvd)
    on = red.split("+")
    join = {"join": False} if "nojoin" in on else {}   # (only then: a tree that predates the setting runs the rest)
    return hvd_qsgd_module.QSGD(4, reduction=on[0], fusion="fusion" in on, overlap="overlap" in on,
                                fusion_mb=BUFFER_MB if "buffers" in on else 0, **join, **more)


def tf_worker(args):
    """K variables, loss = sum of v * x, through hvd.DistributedGradientTape in a tf.function step."""
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import hvd_qsgd
    import hvd_qsgd.tensorflow
    hvd.init()
    results = {}
    for mode in args.modes.split(","):
        for k in [int(v) for v in args.tensors.split(",")]:
            rng = np.random.default_rng(0)
            vs = [tf.Variable(rng.standard_normal(args.numel).astype(np.float32)) for _ in range(k)]
            xs = [tf.constant(rng.standard_normal(args.numel).astype(np.float32)) for _ in range(k)]
            compression = compression_of(hvd, hvd_qsgd.tensorflow, mode)

            @tf.function
            def step():
                with tf.GradientTape() as tape:
                    loss = tf.add_n([tf.reduce_sum(v * x) for v, x in zip(vs, xs)])
                grads = hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, vs)
                for v, g in zip(vs, grads):
                    v.assign_sub(0.01 * g)

            times, cpu = [], []
            for i in range(args.warmup + args.steps):
                hvd.allreduce(tf.zeros([1]), name="barrier")
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                c1 = time.process_time()
                dt = hvd.allreduce(tf.constant([time.perf_counter() - t0]), op=hvd.Max, name="step_time")
                dc = hvd.allreduce(tf.constant([c1 - c0]), op=hvd.Sum, name="step_cpu")
                if i == 0:   # traced, its graph optimized, run once
                    results[f"{mode}/{k}/first"] = float(dt.numpy()[0])
                if i >= args.warmup:
                    times.append(float(dt.numpy()[0]))
                    cpu.append(float(dc.numpy()[0]))
            results[f"{mode}/{k}"] = statistics.median(times)
            results[f"{mode}/{k}/cpu"] = statistics.median(cpu)
    if hvd.rank() == 0:
        with open(args.json, "w") as f:
            json.dump(results, f)


def worker(args):
    if args.framework == "tensorflow":
        return tf_worker(args)
    import torch
    import horovod.torch as hvd
    import hvd_qsgd
    hvd.init()
    device, done = torch_device(torch, hvd, args.device)
    results = {}
    for mode in args.modes.split(","):
        for k in [int(v) for v in args.tensors.split(",")]:
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(args.numel, device=device)) for _ in range(k)]
            xs = [torch.randn(args.numel, device=device) for _ in range(k)]
            compression = compression_of(hvd, hvd_qsgd, mode)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.01), compression=compression,
                                           named_parameters=[(f"p{i}", p) for i, p in enumerate(params)])
            times, cpu = [], []
            for step in range(args.warmup + args.steps):
                hvd.allreduce(torch.zeros(1), name="barrier")
                t0, c0 = time.perf_counter(), time.process_time()
                opt.zero_grad()
                sum((p * x).sum() for p, x in zip(params, xs)).backward()
                opt.step()
                done()
                c1 = time.process_time()
                dt = hvd.allreduce(torch.tensor([time.perf_counter() - t0]), op=hvd.Max, name="step_time")
                dc = hvd.allreduce(torch.tensor([c1 - c0]), op=hvd.Sum, name="step_cpu")
                if step >= args.warmup:
                    times.append(float(dt[0]))
                    cpu.append(float(dc[0]))
            results[f"{mode}/{k}"] = statistics.median(times)
            results[f"{mode}/{k}/cpu"] = statistics.median(cpu)
    if hvd.rank() == 0:
        with open(args.json, "w") as f:
            json.dump(results, f)


def torch_device(torch, hvd, name):
    """(where a rank's gradients are, a function that returns once the device has done its work)."""
    if name != "cuda":
        return torch.device("cpu"), lambda: None
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device()), torch.cuda.synchronize


def cuda_missing():
    """Why ``--device cuda`` cannot run here, or None."""
    import torch
    from hvd_qsgd import cuda
    if not torch.cuda.is_available():
        return "this torch sees no CUDA device"
    if not cuda.available():
        return "hvd_qsgd's CUDA kernels are not available (the CUDA library was not built)"
    return None


def run(args):
    if args.worker:
        return worker(args)
    if getattr(args, "calls_worker", False):
        return overhead_calls.worker(args)
    if getattr(args, "codec_calls_worker", False):
        args.number = args.steps
        return overhead_codec.worker(args)
    tensorflow = args.framework == "tensorflow"
    device = getattr(args, "device", "cpu")
    if device == "cuda":
        why = ("the codec's calls are the CPU library's" if getattr(args, "codec_calls", False) else
               "PyTorch only" if tensorflow else cuda_missing())
        if why:
            print(f"overhead: --device cuda: {why}")
            return 2
    if getattr(args, "codec_calls", False):
        return overhead_codec.run(args, [os.path.abspath(t) for t in args.trees.split(",")])
    args.modes = args.modes or ",".join(TF_MODES if tensorflow else MODES)
    unknown = [m for m in args.modes.split(",") if m not in (TF_MODES if tensorflow else MODES)]
    if unknown:
        print(f"overhead: modes {unknown} are not among {TF_MODES if tensorflow else list(MODES)} ({args.framework})")
        return 2
    if device == "cuda" and any(m.startswith("floor-") for m in args.modes.split(",")):
        print("overhead: --device cuda: the floor modes encode CPU gradients only")
        return 2
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    ks = [int(v) for v in args.tensors.split(",")]
    modes = args.modes.split(",")
    if getattr(args, "calls", False):
        return overhead_calls.run(args, trees, ks, modes)
    table = {}
    for k in ks:
        for tree, hash_seed in paired_launches(trees, args.repeats):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cmd = ["horovodrun", "--gloo", "-np", str(args.np), sys.executable, "-m", "benchmarks.overhead",
                       "--worker", "--json", out.name, "--tensors", str(k), "--numel", str(args.numel),
                       "--modes", args.modes, "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--device", device]
                if args.framework != "torch":
                    cmd += ["--framework", args.framework]
                old = {k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONHASHSEED")}
                # (job_env puts this checkout first: the tree goes before it; horovodrun hands the
                # hash seed of the round to every rank)
                os.environ.update(PYTHONPATH=tree, PYTHONHASHSEED=hash_seed)
                try:
                    status, text, _ = launch_job(cmd, timeout=900, cwd=tree)
                finally:
                    for key, value in old.items():
                        os.environ.pop(key) if value is None else os.environ.update({key: value})
                if status != 0:
                    print(f"{tree} K={k} FAILED:\n{text[-3000:]}")
                    return 1
                with open(out.name) as f:
                    for key, v in json.load(f).items():
                        table.setdefault((tree, key), []).append(v)
    info = machine_info()
    print(f"{info['cpu']}, {info['usable_cores']} usable cores, load {info['load_avg_1min']:.1f}; "
          f"{args.framework}, {args.np} Gloo ranks, gradients of {args.numel} elements on the {device.upper()}, "
          f"median of {args.steps} steps (ms), "
          f"median of {args.repeats} launches per tree, in ABBA order; in brackets the CPU time of a step, all "
          "ranks' threads together (less moved by the ranks' scheduling than the step's wall time)")
    _print_table(trees, ks, modes, lambda tree, key: _cell(table, tree, key))
    if any(key.endswith("/first") for _, key in table):
        print("\nThe first step (s), median over the launches: the step traced, its graph optimized, run once "
              "(the slowest rank; a tree whose benchmark does not time it: -)")
        _print_table(trees, ks, modes, lambda tree, key: _first_cell(table, tree, key))
    return 0


def _print_table(trees, ks, modes, cell):
    """A row per K and tree, a column per mode: cell(tree, "<mode>/<K>")."""
    print("| tree | K | " + " | ".join(modes) + " |")
    print("|---|---|" + "---|" * len(modes))
    for k in ks:
        for tree in trees:
            name = os.path.relpath(tree, REPO_ROOT) if tree.startswith(REPO_ROOT) else tree
            print(f"| {name} | {k} | " + " | ".join(cell(tree, f"{m}/{k}") for m in modes) + " |")


def _first_cell(table, tree, key):
    """A mode's median first step in s, or - where the tree's benchmark does not time it."""
    first = table.get((tree, key + "/first"))
    return "-" if first is None else f"{statistics.median(first):.2f}"


def _cell(table, tree, key):
    """A mode's median step in ms, and its CPU time in brackets (where the tree's benchmark gives it)."""
    wall, cpu = table[(tree, key)], table.get((tree, key + "/cpu"))
    return f"{1e3 * statistics.median(wall):.1f}" + ("" if cpu is None else f" [{1e3 * statistics.median(cpu):.1f}]")


if __name__ == "__main__":
    sys.exit(module_main("overhead", add_arguments, run))
