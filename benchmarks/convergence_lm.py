"""``python -m benchmarks convergence --workload lm``: time to accuracy of every communication method on
the byte-level language model of ``examples/pytorch_lm.py`` (the Python standard library's source
files; validation bits per byte on a fixed split), against the 16-bit baseline.

What runs. For each method of ``--methods`` and each seed, one job of ``--np`` ranks (default 4)
trains the same model from the same start for ``--steps`` steps:

* over loopback (``horovodrun -np N --gloo``), or
* with ``--rate R`` (e.g. ``1gbit``) over links shaped to R. That is one network namespace per rank
  joined by a bridge, every link a token bucket: the ``benchmarks.e2e`` harness
  (``benchmarks.netns``, ``benchmarks.e2e_launch``). Each rank runs the example through
  ``benchmarks.demo_rank``, which also reads the bytes its link carried.

The methods (``METHODS``) are the 16-bit baseline ``fp16`` and fp32 ``none``, ``qsgd8``, ``qsgd4``
(the default reduction), ``qsgd2ef``, ``dqsgd``, ``pqasgd`` and ``efsgdm``. Two configurations
that the QSGD paper reports losing accuracy are also offered, to show whether the workload can tell
methods apart: ``qsgd4b8192`` (4 bits, bucket 8192) and ``qsgd2b64`` (2 bits, bucket 64). The
methods of ``SEEDED`` run once per seed of ``--seeds``; the others once, with the first seed.

What is reported:

* **target:** fp32's mean final validation bits per byte, plus 1%;
* **time to target** of a run: the training time (evaluations excluded) at the first evaluation
  whose validation bits per byte is at or below the target. None when the run never reaches it; a
  method's time to target is the mean over its runs that reached it (the table says how many did);
* the table, per method: final validation bits per byte (the mean and the spread of its seeds);
  bytes sent per rank; mean time to target; and the speed-up against fp16 and against fp32 (their
  mean time to target over the method's);
* the PNG: validation bits per byte against steps, bytes sent per rank and training time (one
  line per run);
* ``--json``: every number, every run's full results, the commands, the machine.
"""
import json
import os
import signal
import statistics
import sys
import time

from benchmarks.common import horovodrun, launch_job, machine_info, REPO_ROOT

EXAMPLE = os.path.join("examples", "pytorch_lm.py")
TARGET_MARGIN = 0.01  # the target: fp32's final validation loss + 1%

# name -> (label, the example's flags)
METHODS = {
    "none": ("none (fp32)", ["--compression", "none"]),
    "fp16": ("fp16 (baseline)", ["--compression", "fp16"]),
    "qsgd8": ("QSGD(8)", ["--compression", "qsgd", "--bits", "8"]),
    "qsgd4": ("QSGD(4)", ["--compression", "qsgd", "--bits", "4"]),
    "qsgd2ef": ("QSGD(2) + EF", ["--compression", "qsgd", "--bits", "2", "--error-feedback"]),
    "dqsgd": ("DQSGD (budget 3 bits)", ["--method", "dqsgd", "--budget-bits", "3.0"]),
    "pqasgd": ("PQASGD (p=4, QSGD(2))", ["--method", "pqasgd", "--period", "4", "--bits", "2"]),
    "efsgdm": ("dist-EF-SGDM (BlockSign 512)", ["--method", "efsgdm", "--block-size", "512"]),
    "qsgd4b8192": ("QSGD(4), bucket 8192", ["--compression", "qsgd", "--bits", "4", "--bucket-size", "8192"]),
    "qsgd2b64": ("QSGD(2), bucket 64", ["--compression", "qsgd", "--bits", "2", "--bucket-size", "64"]),
}
SEEDED = ("none", "fp16", "qsgd4", "qsgd8")
# --size: the model and the text (the example's flags)
SIZES = {
    "tiny": ["--d-model", "32", "--layers", "1", "--heads", "2", "--context", "16", "--batch-size", "2",
             "--eval-windows", "32", "--train-mb", "1", "--val-mb", "0.2", "--min-numel", "1000", "--ngram-rows", "512"],
    "default": [],
}


def add_lm_arguments(p):
    p.add_argument("--seeds", default="1,2,3", help="lm: seeds of the SEEDED methods (default %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="lm: optimizer steps of every run (default %(default)s)")
    p.add_argument("--eval-every", type=int, default=30, help="lm: steps between evaluations (default %(default)s)")
    p.add_argument("--size", choices=tuple(SIZES), default="default", help="lm: the model's size (default %(default)s)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="lm: the example's --device: cuda puts every rank's model on GPU local_rank modulo the "
                        "GPUs there are, so ranks may share one (default %(default)s)")
    p.add_argument("--project", metavar="JSON[,JSON...]", default=None,
                   help="lm: run nothing; read the runs of these --json files (loopback runs, e.g. one per seed) "
                        "and print their table with the time to target projected over links of --project-gbps")
    p.add_argument("--project-gbps", default="1,10,100", help="lm: the link rates of --project, Gbit/s "
                                                              "(default %(default)s)")
    p.add_argument("--rate", default=None, help="lm: shape every rank's link to this rate (tc syntax, e.g. 1gbit); "
                                                "default: loopback, nothing shaped")


def runs_of(args):
    """[(method, seed)] in order: each method of args.methods (none first), SEEDED ones per seed."""
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    return [(m, s) for m in args.methods for s in (seeds if m in SEEDED else seeds[:1])]


def example_flags(args, method, seed, json_path):
    """The example's flags for one run; rank 0 writes its results to json_path and its final
    parameters next to it (``.pt``), so that the reported loss can be checked directly."""
    return (["--no-progress", "--json", json_path, "--save", json_path[:-len(".json")] + ".pt", "--seed", str(seed),
             "--max-steps", str(args.steps), "--eval-every", str(args.eval_every), "--device", args.device] + SIZES[args.size]
            + METHODS[method][1])


# ---- the numbers ------------------------------------------------------------------------------------
def time_to_target(curve, target):
    """The training time of the first curve point at or below ``target``; None if none is."""
    for point in curve:
        if point["val_bpb"] <= target:
            return point["train_time"]
    return None


def results_by_method(rows):
    """{method: the results of its runs that finished}, in the rows' order."""
    by = {}
    for r in rows:
        if r["result"] is not None:
            by.setdefault(r["method"], []).append(r["result"])
    return by


def summarize(rows):
    """Per method: the runs' final bits per byte (mean, spread), bytes, mean time to target, speed-ups;
    and the target. ``rows``: dicts with method, seed, result (None for a failed run)."""
    by = results_by_method(rows)
    if "none" not in by:
        return None, {}
    target = statistics.mean(res["final_val_bpb"] for res in by["none"]) * (1 + TARGET_MARGIN)
    out = {}
    for method, results in by.items():
        finals = [res["final_val_bpb"] for res in results]
        times = [time_to_target(res["curve"], target) for res in results]
        reached = [t for t in times if t is not None]
        out[method] = dict(
            runs=len(results), final_mean=statistics.mean(finals),
            final_spread=(max(finals) - min(finals)) if len(finals) > 1 else 0.0,
            bytes_per_rank=statistics.mean(res["bytes_sent_total"] for res in results),
            times_to_target=times, reached=len(reached),
            time_to_target=statistics.mean(reached) if reached else None)
    for method, s in out.items():
        for base in ("fp16", "none"):
            b = out.get(base, {}).get("time_to_target")
            s[f"speedup_vs_{base}"] = b / s["time_to_target"] if b and s["time_to_target"] else None
    return target, out


TABLE_HEADER = ("| method | runs | final val bits/byte (mean ± spread) | bytes sent / rank | time to target (s) | "
                "speed-up vs fp16 | vs fp32 |")


def table_lines(rows, target, summary):
    lines = [TABLE_HEADER, "|" + "---|" * 7]
    labels = {}
    for r in rows:
        labels.setdefault(r["method"], METHODS[r["method"]][0])
    for method, label in labels.items():
        s = summary.get(method)
        if s is None:
            lines.append(f"| {label} | 0 | FAILED | - | - | - | - |")
            continue
        ttt = ("not reached" if s["time_to_target"] is None else f"{s['time_to_target']:.1f}") + (
            f" ({s['reached']} of {s['runs']} runs)" if s["runs"] > 1 else "")
        sp = [("-" if s[k] is None else f"{s[k]:.2f}x") for k in ("speedup_vs_fp16", "speedup_vs_none")]
        lines.append(f"| {label} | {s['runs']} | {s['final_mean']:.4f} ± {s['final_spread'] / 2:.4f} | "
                     f"{s['bytes_per_rank'] / 1e6:,.2f} MB | {ttt} | {sp[0]} | {sp[1]} |")
    lines.append("")
    lines.append(f"target: fp32's mean final validation bits per byte + {TARGET_MARGIN:.0%} = "
                 + ("-" if target is None else f"{target:.4f}"))
    return lines


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), sharey=True)
    keys = (("step", "steps", False), ("bytes_sent_so_far", "bytes sent per rank (log)", True),
            ("train_time", "training time (s)", False))
    for r in rows:
        if r["result"] is None:
            continue
        curve = r["result"]["curve"]
        label = f"{METHODS[r['method']][0]} s{r['seed']}"
        for ax, (key, _, log) in zip(axes, keys):
            pts = [c for c in curve if not log or c[key] > 0]
            ax.plot([c[key] for c in pts], [c["val_bpb"] for c in pts], linewidth=1.2, label=label)
    for ax, (_, name, log) in zip(axes, keys):
        ax.set_xlabel(name)
        if log:
            ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("validation bits per byte")
    axes[2].legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the projection over links of a given rate, from loopback runs ----------------------------------
def projected_time_to_target(result, target, gbps):
    """A loopback run's time to target over links of ``gbps`` Gbit/s: the training time measured at
    its first evaluation at or below ``target``, plus the bytes its rank had sent by then over the
    link's rate. That adds the wire time to the step with no overlap, and keeps loopback's own
    exchange time: a projection, not a measurement. None when the run never reaches the target."""
    for point in result["curve"]:
        if point["val_bpb"] <= target:
            return point["train_time"] + point["bytes_sent_so_far"] * 8 / (gbps * 1e9)
    return None


def projection_lines(rows, target, rates):
    """Per method: the mean projected time to target at each rate (runs that reach it), and its
    speed-up against fp16's at the same rate."""
    by = results_by_method(rows)
    means = {}
    for method, results in by.items():
        for g in rates:
            times = [t for t in (projected_time_to_target(res, target, g) for res in results) if t is not None]
            means[method, g] = statistics.mean(times) if times else None
    lines = ["| method | " + " | ".join(f"{g:g} Gbit/s: time to target (s), vs fp16" for g in rates) + " |",
             "|" + "---|" * (len(rates) + 1)]
    for method in by:
        cells = []
        for g in rates:
            t, base = means[method, g], means.get(("fp16", g))
            cells.append("not reached" if t is None else
                         f"{t:.1f}, " + (f"{base / t:.2f}x" if base else "-"))
        lines.append(f"| {METHODS[method][0]} | " + " | ".join(cells) + " |")
    return lines


def project(args):
    """``--project``: the saved runs' table, and their time to target projected over links."""
    rows = []
    for path in args.project.split(","):
        with open(path) as f:
            rows += json.load(f)["runs"]
    rates = [float(g) for g in str(args.project_gbps).split(",") if g.strip()]
    target, summary = summarize(rows)
    if target is None:
        print("--project: no fp32 (none) run among the files: no target", file=sys.stderr)
        return 2
    print("\n".join(table_lines(rows, target, summary)))
    print("\nPROJECTED (measured training time + bytes sent / link rate, no overlap; not measured):")
    print("\n".join(projection_lines(rows, target, rates)))
    return 0


# ---- launching -----------------------------------------------------------------------------------
def _loopback(args, flags):
    cmd = [horovodrun(), "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo", sys.executable, EXAMPLE] + flags
    status, out, seconds = launch_job(cmd, args.timeout, cwd=REPO_ROOT)
    return cmd, status, out, seconds


def run(args):
    if args.project:
        return project(args)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        print(f"--workload lm has no method {', '.join(unknown)}; its methods: {', '.join(METHODS)}", file=sys.stderr)
        return 2
    info = machine_info()
    todo = runs_of(args)
    where = f"links shaped to {args.rate}" if args.rate else "loopback"
    print(f"machine: {info['cpu']}, {info['usable_cores']} usable cores; {len(todo)} runs of {args.np} ranks "
          f"(device {args.device}) over {where}, {args.steps} steps each", flush=True)
    rows, topo, out_dir = [], None, os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    old_handlers = {}
    if args.rate:  # SIGTERM / SIGINT: kill the ranks and delete the namespaces on the way out
        from benchmarks import e2e_launch
        old_handlers = {s: signal.signal(s, e2e_launch._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if args.rate:
            from benchmarks import e2e_launch, netns
            reason = netns.probe()
            if reason:
                print(f"network namespaces cannot be made here: {reason}", file=sys.stderr)
                return 2
            topo = netns.Topology(args.np)
            topo.create()
            shaping = topo.shape(args.rate)
            info["shaping"] = shaping
        for method, seed in todo:
            json_path = os.path.join(out_dir, f"{method}_s{seed}.json")
            flags = example_flags(args, method, seed, json_path)
            t0 = time.perf_counter()
            result, status, cmd = None, 0, None
            if topo is None:
                cmd, status, out, _ = _loopback(args, flags)
                if status == 0 and os.path.exists(json_path):
                    with open(json_path) as f:
                        result = json.load(f)
                else:
                    print(f"  {method} seed {seed} FAILED (exit status {status}):\n{out[-3000:]}", flush=True)
            else:
                cmd = ["-m", "benchmarks.demo_rank", "--example", "pytorch_lm"] + flags
                log_dir = os.path.join(out_dir, "logs", f"{method}_s{seed}")
                os.makedirs(log_dir, exist_ok=True)
                try:
                    result = e2e_launch.run_job(topo, args.rate, args, json_path, log_dir, worker_argv=cmd)
                except e2e_launch.JobFailed as e:
                    status = 1
                    print(f"  {method} seed {seed} FAILED: {str(e)[-3000:]}", flush=True)
            wall = time.perf_counter() - t0
            if result is not None:
                print(f"  {METHODS[method][0]} seed {seed}: final {result['final_val_bpb']:.4f} bits/byte, "
                      f"training {result['train_time']:.1f} s, {result['bytes_sent_total'] / 1e6:.2f} MB sent "
                      f"(job {wall:.0f} s)", flush=True)
            rows.append(dict(method=method, seed=seed, command=cmd, status=status, wall_s=wall, result=result))
    finally:
        if topo is not None:
            from benchmarks import e2e_launch
            e2e_launch.kill_children()
            topo.destroy()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    target, summary = summarize(rows)
    lines = table_lines(rows, target, summary)
    print()
    print("\n".join(lines))
    if any(r["result"] for r in rows):
        plot(rows, args.png, f"hvd_qsgd: byte-level LM on the standard library, {args.np} ranks over {where}, "
                             f"{args.steps} steps")
        print(f"\nwrote {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, workload="lm", np=args.np, device=args.device, rate=args.rate, steps=args.steps, size=args.size,
                           seeds=args.seeds, target=target, summary=summary, runs=rows, table=lines), f, indent=1)
        print(f"wrote {args.json}")
    failed = any(r["result"] is None or not r["result"]["ranks_identical"] for r in rows)
    return 1 if failed else 0
