"""``python -m benchmarks reduction``: bytes per rank of QSGD's two reductions as n grows.

What runs. For each rank count n of ``--np`` one job, ``horovodrun -np n -H localhost:n --gloo``;
every rank allreduces one float32 tensor of ``--numel`` elements (its own random values) through
``hvd_qsgd.QSGD(b, reduction=...)`` with ``allgather`` and with ``scatter_allgather``, ``--warmup``
untimed then ``--steps`` timed exchanges of each, alternating.

Bytes, counted: ``bytes_received`` and ``bytes_sent`` of the compressor's ``stats`` over the timed
exchanges, divided by the steps, averaged over ranks. They count the payload bytes each rank takes
off / puts on the wire (both phases of scatter_allgather, its 8-byte frame lengths included; the
rank's own payload or chunk excluded). Beside them the targets and the model:

    target   2 (n-1)/n * d * b/8          (what a bandwidth-optimal reduction of b-bit values needs)
    allgather       (n-1) * P             (P = codec.payload_nbytes(d, b, B): header and scales too)
    scatter_allgather  ~ 2 (n-1)/n * P

and the ratio counted / target, which the reduction keeps near 1 for every n (the scales add 4/B
bytes per element: 1.6% at 4 bits, B = 512) while allgather's grows like n/2.

Time per exchange (median over steps of the slowest rank) is reported too, but the ranks share this
machine's cores and talk over loopback, so it says little about a network; ``bench e2e`` measures
on shaped links. Outputs under ``--out`` (default ``bench_out/reduction/``): results.json, table.md,
plot.png.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import bit_widths, element_count, horovodrun, job_env, machine_info, nonnegative_int, positive_int

REDUCTIONS = ("allgather", "scatter_allgather")
DEFAULT_OUT = os.path.join("bench_out", "reduction")


def add_arguments(p):
    p.add_argument("--np", type=positive_int, nargs="+", default=[2, 4, 8, 16], metavar="N",
                   help="rank counts, one horovodrun job each (default: 2 4 8 16)")
    p.add_argument("--numel", type=element_count, default=1 << 22,
                   help="elements of the tensor (K, M: powers of 1024; default 4M)")
    p.add_argument("--bits", type=bit_widths(1), default="4", help="QSGD bit widths (default 4)")
    p.add_argument("--steps", type=positive_int, default=5, help="timed exchanges per reduction")
    p.add_argument("--warmup", type=nonnegative_int, default=1, help="untimed exchanges first")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder of the results (default %(default)s)")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds allowed to each job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)


def run_worker(args):
    import torch
    import horovod.torch as hvd

    import hvd_qsgd

    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    torch.set_num_threads(1)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(rank))
    rows = []
    for bits in args.bits:
        comps = {r: hvd_qsgd.QSGD(bits, reduction=r, min_numel=1) for r in REDUCTIONS}
        times = {r: [] for r in REDUCTIONS}
        before = {}
        for step in range(args.warmup + args.steps):
            for r, c in comps.items():
                if step == args.warmup:
                    before[r] = c.stats
                hvd.allreduce(torch.zeros(1), name="bench.barrier")
                t0 = time.perf_counter()
                hvd.allreduce(x, compression=c, name=f"bench.{bits}.{r}")
                times[r].append(time.perf_counter() - t0)
        for r, c in comps.items():
            st = c.stats
            mine = torch.tensor([[(st["bytes_sent"] - before[r]["bytes_sent"]) / args.steps,
                                  (st["bytes_received"] - before[r]["bytes_received"]) / args.steps]],
                                dtype=torch.float64)
            per_rank = hvd.allgather(mine, name=f"bench.bytes.{bits}.{r}")
            slowest = hvd.allreduce(torch.tensor(times[r][args.warmup:], dtype=torch.float64), op=hvd.Max,
                                    name=f"bench.time.{bits}.{r}")
            rows.append(dict(n=n, bits=bits, reduction=r, numel=args.numel,
                             sent_per_rank=float(per_rank[:, 0].mean()), recv_per_rank=float(per_rank[:, 1].mean()),
                             recv_min=float(per_rank[:, 1].min()), recv_max=float(per_rank[:, 1].max()),
                             seconds=float(statistics.median(slowest.tolist()))))
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f)


def _launch(n, args, path):
    cmd = [horovodrun(), "-np", str(n), "-H", f"localhost:{n}",
           "--gloo", sys.executable, "-m", "benchmarks", "reduction", "--worker", "--json", path,
           "--numel", str(args.numel), "--bits", ",".join(map(str, args.bits)), "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}")
    with open(path) as f:
        return json.load(f)


def _table(rows):
    from hvd_qsgd import codec
    from hvd_qsgd.settings import default_bucket_size

    lines = ["| n | bits | reduction | recv B/rank/step (counted) | target 2(n-1)/n·d·b/8 | counted/target "
             "| model | sent B/rank/step | s/exchange |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n, b, d = r["n"], r["bits"], r["numel"]
        target = 2 * (n - 1) / n * d * b / 8
        p = codec.payload_nbytes(d, b, default_bucket_size(b))
        model = (n - 1) * p if r["reduction"] == "allgather" else 2 * (n - 1) / n * p
        r.update(target=target, model=model, ratio=r["recv_per_rank"] / target if target else 0.0)
        lines.append(f"| {n} | {b} | {r['reduction']} | {r['recv_per_rank']:,.0f} | {target:,.0f} | "
                     f"{r['ratio']:.3f} | {model:,.0f} | {r['sent_per_rank']:,.0f} | {r['seconds']:.4f} |")
    return "\n".join(lines)


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for red in REDUCTIONS:
        for b in sorted({r["bits"] for r in rows}):
            pts = [(r["n"], r["ratio"]) for r in rows if r["reduction"] == red and r["bits"] == b]
            ax.plot(*zip(*pts), marker="o", label=f"QSGD({b}) {red}")
    ax.axhline(1.2, color="grey", ls="--", lw=0.8, label="1.2 x target")
    ax.set_xlabel("ranks n")
    ax.set_ylabel("bytes received per rank / (2(n-1)/n · d·b/8)")
    ax.set_title("QSGD traffic per rank (counted)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args):
    if args.worker:
        return run_worker(args)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for n in args.np:
        print(f"[reduction] -np {n} ...", flush=True)
        rows += _launch(n, args, os.path.join(args.out, f"np{n}.json"))
    table = _table(rows)
    print(table)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(rows=rows, machine=machine_info(), argv=sys.argv), f, indent=1)
    _plot(rows, os.path.join(args.out, "plot.png"))
    print(f"[reduction] wrote {args.out}/table.md, results.json, plot.png")
    bad = [r for r in rows if r["reduction"] == "scatter_allgather" and r["ratio"] > 1.2]
    if bad:
        print(f"[reduction] scatter_allgather above 1.2 x target at n = {[r['n'] for r in bad]}")
    return 0
