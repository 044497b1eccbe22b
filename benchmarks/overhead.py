"""Per-tensor cost: the step time of K small gradients through ``hvd.DistributedOptimizer``.

    python -m benchmarks overhead --np 2 --tensors 1,16,64 --numel 20000
    python -m benchmarks overhead --trees /path/to/other/checkout,.     # two versions side by side

Each mode (none, QSGD(4) with the "auto" reduction, QSGD(4) allgather, QSGD(4) scatter_allgather,
QSGD(4) "auto" with ``fusion=True``, and with ``overlap=True``)
trains a model of K parameters of ``--numel`` elements each (loss = sum of p * x) for ``--steps``
timed steps on ``--np`` Gloo ranks on loopback; a step is zero_grad, backward, step after a
barrier, and its time is the maximum over ranks. The table gives the median step per K and mode,
for every tree in ``--trees`` (each a checkout of this package, its kernels built), launched in
turn for each K (``--repeats`` times, alternating) so that both see the same machine load: what a compressed tensor costs beyond the
bytes it moves (the handshake's collectives, Python, the codec at this size).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.common import REPO_ROOT, int_at_least, launch_job, machine_info, module_main

MODES = {"none": None, "qsgd4-auto": "auto", "qsgd4-allgather": "allgather", "qsgd4-scatter": "scatter_allgather",
         "qsgd4-fused": "auto+fusion", "qsgd4-overlap": "auto+overlap"}   # "+<setting>": that setting on


def add_arguments(p):
    p.add_argument("--np", type=int_at_least(2), default=2, help="ranks (default %(default)s)")
    p.add_argument("--tensors", default="1,16,64", help="numbers of gradients K (default %(default)s)")
    p.add_argument("--numel", type=int_at_least(1), default=20000, help="elements a gradient (default %(default)s)")
    p.add_argument("--modes", default=",".join(MODES), help="modes (default %(default)s)")
    p.add_argument("--steps", type=int_at_least(1), default=40, help="timed steps (default %(default)s)")
    p.add_argument("--warmup", type=int_at_least(0), default=5, help="untimed steps (default %(default)s)")
    p.add_argument("--trees", default=".", help="checkouts to compare, comma-separated (default: this one)")
    p.add_argument("--repeats", type=int_at_least(1), default=1,
                   help="launches per tree and K, alternating between the trees; the table gives the median")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)


def worker(args):
    import torch
    import horovod.torch as hvd
    import hvd_qsgd
    hvd.init()
    results = {}
    for mode in args.modes.split(","):
        for k in [int(v) for v in args.tensors.split(",")]:
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(args.numel)) for _ in range(k)]
            xs = [torch.randn(args.numel) for _ in range(k)]
            red = MODES[mode]
            compression = hvd.Compression.none if red is None else hvd_qsgd.QSGD(
                4, reduction=red.split("+")[0], fusion=red.endswith("+fusion"), overlap=red.endswith("+overlap"))
            opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.01), compression=compression,
                                           named_parameters=[(f"p{i}", p) for i, p in enumerate(params)])
            times = []
            for step in range(args.warmup + args.steps):
                hvd.allreduce(torch.zeros(1), name="barrier")
                t0 = time.perf_counter()
                opt.zero_grad()
                sum((p * x).sum() for p, x in zip(params, xs)).backward()
                opt.step()
                dt = hvd.allreduce(torch.tensor([time.perf_counter() - t0]), op=hvd.Max, name="step_time")
                if step >= args.warmup:
                    times.append(float(dt[0]))
            results[f"{mode}/{k}"] = statistics.median(times)
    if hvd.rank() == 0:
        with open(args.json, "w") as f:
            json.dump(results, f)


def run(args):
    if args.worker:
        return worker(args)
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    ks = [int(v) for v in args.tensors.split(",")]
    modes = args.modes.split(",")
    table = {}
    for k in ks:
        for tree in [t for _ in range(args.repeats) for t in trees]:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cmd = ["horovodrun", "--gloo", "-np", str(args.np), sys.executable, "-m", "benchmarks.overhead",
                       "--worker", "--json", out.name, "--tensors", str(k), "--numel", str(args.numel),
                       "--modes", args.modes, "--steps", str(args.steps), "--warmup", str(args.warmup)]
                old = os.environ.get("PYTHONPATH")
                os.environ["PYTHONPATH"] = tree   # job_env puts this checkout first: the tree goes before it
                try:
                    status, text, _ = launch_job(cmd, timeout=900, cwd=tree)
                finally:
                    os.environ.pop("PYTHONPATH") if old is None else os.environ.update(PYTHONPATH=old)
                if status != 0:
                    print(f"{tree} K={k} FAILED:\n{text[-3000:]}")
                    return 1
                with open(out.name) as f:
                    for key, v in json.load(f).items():
                        table.setdefault((tree, key), []).append(v)
    info = machine_info()
    print(f"{info['cpu']}, {info['usable_cores']} usable cores, load {info['load_avg_1min']:.1f}; "
          f"{args.np} Gloo ranks, gradients of {args.numel} elements, median of {args.steps} steps (ms), "
          f"median of {args.repeats} launches per tree, alternating")
    print("| tree | K | " + " | ".join(modes) + " |")
    print("|---|---|" + "---|" * len(modes))
    for k in ks:
        for tree in trees:
            name = os.path.relpath(tree, REPO_ROOT) if tree.startswith(REPO_ROOT) else tree
            print(f"| {name} | {k} | " + " | ".join(f"{1e3 * statistics.median(table[(tree, f'{m}/{k}')]):.1f}" for m in modes) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(module_main("overhead", add_arguments, run))
