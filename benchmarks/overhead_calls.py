"""``python -m benchmarks overhead --calls``: the compressor's own time per call, in one process.

A step of the ``overhead`` benchmark on two ranks sharing two cores moves by more from launch to
launch than the Python a gradient costs, so this mode times that Python where nothing else runs:
one process (Horovod of one rank, no ``horovodrun``), K gradients of ``--numel`` elements handed
to the compressor as Horovod's optimizer hands them (compress each, its control tensor to
``hvd.allreduce_async_``; then synchronize and decompress each), the compressor given the
parameters' names. Per mode and K: the median over blocks of 30 steps of the time per call of
compress, of decompress after the step's first, and of the step's first decompress (which waits for
the step's collectives and, with fusion buffers, encodes and decodes the buffer), and the step's
time per gradient. Each tree in ``--trees`` runs in its own process, alternating, ``--repeats`` times.
"""
import json
import os
import statistics
import subprocess
import sys
import time

BLOCK = 30   # steps a block


def worker(args):
    """One process: every mode and K; the medians as JSON on stdout's last line."""
    import torch
    import horovod.torch as hvd
    import hvd_qsgd
    from benchmarks.overhead import compression_of
    hvd.init()
    clock, results = time.perf_counter, {}
    for mode in args.modes.split(","):
        for k in [int(v) for v in args.tensors.split(",")]:
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(args.numel)) for _ in range(k)]
            for p in params:
                p.grad = torch.randn(args.numel)
            named = {} if mode == "none" else {   # (no Horovod optimizer's frames to learn the names from)
                "named_parameters": [(f"p{i}", p) for i, p in enumerate(params)]}
            c = compression_of(hvd, hvd_qsgd, mode, **named)
            spent = [0.0, 0.0, 0.0]

            def step():
                handles = []
                for i, p in enumerate(params):
                    t0 = clock()
                    tensor, ctx = c.compress(p.grad)
                    spent[0] += clock() - t0
                    handles.append((hvd.allreduce_async_(tensor, name=f"calls.{i}", op=hvd.Average), ctx))
                for j, (h, ctx) in enumerate(handles):
                    out = hvd.synchronize(h)
                    t0 = clock()
                    c.decompress(out, ctx)
                    spent[2 if j == 0 else 1] += clock() - t0

            for _ in range(args.warmup):
                step()
            rows = []
            for _ in range(max(1, args.steps // BLOCK)):
                spent[:] = [0.0, 0.0, 0.0]
                t0 = clock()
                for _ in range(BLOCK):
                    step()
                wall = clock() - t0
                rows.append((spent[0] / BLOCK / k, spent[1] / BLOCK / max(1, k - 1), spent[2] / BLOCK,
                             wall / BLOCK / k))
            results[f"{mode}/{k}"] = [statistics.median(col) for col in zip(*rows)]
    print(json.dumps(results))


def run(args, trees, ks, modes):
    """Launch the worker in each tree (alternating, ``--repeats`` times) and print the table."""
    from benchmarks.common import REPO_ROOT, machine_info
    table = {}
    for tree in [t for _ in range(args.repeats) for t in trees]:
        cmd = [sys.executable, "-m", "benchmarks.overhead", "--calls-worker", "--tensors", args.tensors,
               "--numel", str(args.numel), "--modes", args.modes, "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
        env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            print(f"{tree} FAILED:\n{(done.stdout + done.stderr)[-3000:]}")
            return 1
        for key, v in json.loads(done.stdout.strip().splitlines()[-1]).items():
            table.setdefault((tree, key), []).append(v)
    info = machine_info()
    print(f"{info['cpu']}, {info['usable_cores']} usable cores, load {info['load_avg_1min']:.1f}; one process "
          f"(Horovod of one rank), gradients of {args.numel} elements; us a call (first decompress: ms), median "
          f"over blocks of {BLOCK} steps, median of {args.repeats} runs per tree, alternating")
    print("| tree | K | mode | compress | decompress | first decompress (ms) | step a gradient |")
    print("|---|---|---|---|---|---|---|")
    for k in ks:
        for mode in modes:
            for tree in trees:
                name = os.path.relpath(tree, REPO_ROOT) if tree.startswith(REPO_ROOT) else tree
                comp, dec, first, step = (statistics.median(col) for col in zip(*table[(tree, f"{mode}/{k}")]))
                print(f"| {name} | {k} | {mode} | {1e6 * comp:.0f} | {1e6 * dec:.0f} | {1e3 * first:.2f} | "
                      f"{1e6 * step:.0f} |")
    return 0
