"""``python -m benchmarks convergence``: test accuracy against bytes sent, for every
communication method of the package, on the PyTorch digits example.

What runs. For each method of ``--methods`` the command launches one job,
``horovodrun -np N -H localhost:N --gloo <python> examples/pytorch_digits.py --no-progress --json ...
--epochs E --seed S <the method's flags>``, one after the other (N = ``--np``, default 4). The example
trains the 64-512-512-10 MLP on scikit-learn's digits (fixed split, each rank its own shard, batch 32
per rank, momentum SGD at lr 0.05, momentum 0.9) and records after every epoch the bytes rank 0 has
sent so far and the test accuracy on the 450 held-out samples (its JSON ``curve``). The methods:

    none     fp32 allreduce (hvd.DistributedOptimizer, hvd.Compression.none): the reference
    qsgd4    hvd_qsgd.QSGD(4) in hvd.DistributedOptimizer
    qsgd2ef  hvd_qsgd.QSGD(2, error_feedback=True), following the learning rate
    dqsgd    hvd_qsgd.DynamicQSGD(budget_bits_per_coord=3.0) in hvd.DistributedOptimizer
    pqasgd   hvd_qsgd.torch.PeriodicQuantizedAveraging(SGD, period=4, compression=QSGD(2)):
             local steps, a quantized average of the model differences every 4 steps
    efsgdm   hvd_qsgd.torch.EFSGDM(compression=hvd_qsgd.BlockSign(block_size=512)): dist-EF-SGDM,
             scatter_allgather with worker and server error feedback (two-way 1-bit compression)

``none`` always runs (first): it is what "vs none" divides by.

Bytes sent per rank. What rank 0 hands to the collectives, each element once (the example's
definition): ``4 * numel`` per step for none; for the others the compressor's payload bytes
(``stats['bytes_sent']``) plus ``4 *`` the elements it left uncompressed (tensors under
``min_numel``, here the biases and fc3, allreduced in fp32). PQASGD sends at its syncs only;
DQSGD's payloads change length with its bits; EFSGDM's count holds both phases of scatter_allgather
(the chunks this rank sends to the others in the alltoall, and its re-quantized chunk in the
allgather). Control vectors (a few float64 per compressed tensor) are not included. This is not
link traffic: an allgather delivers each payload to n - 1 ranks, a ring allreduce moves about
2 (n - 1) / n of its input through each link.

The table gives for each method the final test accuracy (after the last epoch; for PQASGD after a
last sync, so that every rank holds the same model), the total bytes sent per rank, their ratio to
none's, the job's wall time (horovodrun start-up included) and the training loop's own time. The PNG
plots every curve: test accuracy against bytes sent per rank (log scale), one marker per epoch.

Outputs: the PNG (``--png``, default ``convergence.png``) and, with ``--json PATH``, every number
(each example's full results, the commands, the machine). The exit status is 1 if a job failed.
"""
import json
import os
import sys
import tempfile
import time

from benchmarks.common import horovodrun, launch_job, machine_info, module_main, positive_int, REPO_ROOT

EXAMPLE = os.path.join("examples", "pytorch_digits.py")

# name -> (label, the example's flags)
METHODS = {
    "none": ("none (fp32)", ["--method", "sgd", "--compression", "none"]),
    "qsgd4": ("QSGD(4)", ["--method", "sgd", "--compression", "qsgd", "--bits", "4"]),
    "qsgd2ef": ("QSGD(2) + EF", ["--method", "sgd", "--compression", "qsgd", "--bits", "2", "--error-feedback"]),
    "dqsgd": ("DQSGD (budget 3 bits)", ["--method", "dqsgd", "--budget-bits", "3.0"]),
    "pqasgd": ("PQASGD (p=4, QSGD(2))", ["--method", "pqasgd", "--period", "4", "--bits", "2"]),
    "efsgdm": ("dist-EF-SGDM (BlockSign 512)", ["--method", "efsgdm", "--block-size", "512"]),
}
DEFAULT_PNG = "convergence.png"


def _methods(text):
    import argparse

    from benchmarks import convergence_lm

    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS and m not in convergence_lm.METHODS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"methods are {', '.join(METHODS)} (digits) or "
                                         f"{', '.join(convergence_lm.METHODS)} (lm), comma-separated: {text!r}")
    return ["none"] + [m for m in dict.fromkeys(names) if m != "none"]  # none: the reference, first


def add_arguments(p):
    from benchmarks import convergence_lm

    p.add_argument("--workload", choices=("digits", "lm"), default="digits",
                   help="digits: the MLP on scikit-learn's digits (this module's docstring); lm: the byte-level "
                        "language model on the standard library, time to target (benchmarks/convergence_lm.py)")
    p.add_argument("--np", type=positive_int, default=4, help="ranks of every job (default %(default)s)")
    p.add_argument("--epochs", type=positive_int, default=20,
                   help="training epochs of every method (default %(default)s, the example's)")
    p.add_argument("--max-steps", type=positive_int, default=None, metavar="N",
                   help="stop every job after N steps (quick checks)")
    p.add_argument("--methods", type=_methods, default=None,
                   help="comma-separated (none is always run); default: every method of the workload")
    p.add_argument("--seed", type=int, default=42, help="the example's --seed (default %(default)s)")
    p.add_argument("--png", default=DEFAULT_PNG, help="the plot (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="write every result here")
    p.add_argument("--timeout", type=positive_int, default=900,
                   help="seconds allowed to each job (default %(default)s)")
    p.add_argument("--out", default=os.path.join("bench_out", "convergence_lm"),
                   help="lm: the directory of every run's results (default %(default)s)")
    convergence_lm.add_lm_arguments(p)


# ---- launching -----------------------------------------------------------------------------------
def command(method, args, json_path):
    """The horovodrun command line of one method's job."""
    cmd = [horovodrun(), "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo", sys.executable,
           EXAMPLE, "--no-progress", "--json", json_path, "--epochs", str(args.epochs), "--seed", str(args.seed)]
    if args.max_steps is not None:
        cmd += ["--max-steps", str(args.max_steps)]
    return cmd + METHODS[method][1]


# ---- reporting -----------------------------------------------------------------------------------
TABLE_HEADER = ("| method | final test accuracy | bytes sent / rank | vs none | steps | wall s | train s |")


def _mb(nbytes):
    return f"{nbytes / 1e6:,.2f} MB"


def _x(v):
    return f"{v:.4f}x" if v < 0.01 else f"{v:.3f}x"


def table_lines(rows):
    """The printed table: one line per method that ran, in order (a failed one says so)."""
    none = next((r for r in rows if r["method"] == "none" and r["result"]), None)
    lines = [TABLE_HEADER, "|" + "---|" * 7]
    for r in rows:
        res = r["result"]
        if res is None:
            lines.append(f"| {r['label']} | FAILED (exit status {r['status']}) | - | - | - | {r['wall_s']:.0f} | - |")
            continue
        total = res["bytes_sent_total"]
        rel = _x(total / none["result"]["bytes_sent_total"]) if none else "-"
        lines.append(f"| {r['label']} | {res['test_accuracy']:.4f} | {_mb(total)} | {rel} | {res['steps']} | "
                     f"{r['wall_s']:.0f} | {res['train_time_s']:.1f} |")
    return lines


def notes(rows, args, info):
    out = [f"{args.np} ranks (horovodrun --gloo), {args.epochs} epochs"
           + (f" (at most {args.max_steps} steps)" if args.max_steps else "")
           + f", seed {args.seed}; 64-512-512-10 MLP on scikit-learn digits, batch 32 per rank, lr 0.05, "
           "momentum 0.9; test accuracy on the 450 held-out samples",
           "bytes sent / rank: what rank 0 hands to the collectives over the whole run: 4*numel per step for none; "
           "otherwise the compressor's payload bytes + 4 B per uncompressed element (biases, fc3); PQASGD at its "
           "syncs only, EFSGDM both scatter_allgather phases; control vectors excluded; not link traffic",
           "wall s: the whole job, horovodrun and Python start-up included; train s: the training loop "
           "(rank 0, evaluations excluded)",
           f"machine: {info['cpu']}, {info['usable_cores']} usable cores"
           + (f"; {args.np} ranks oversubscribe them" if args.np > info["usable_cores"] else "")]
    load = (info["load_avg_1min"], info.get("load_avg_1min_end", info["load_avg_1min"]))
    if max(load) > 0.5 * info["usable_cores"]:
        out.append(f"warning: other processes were using the CPUs (1-min load average {load[0]:.2f} at the start, "
                   f"{load[1]:.2f} at the end, on {info['usable_cores']} cores): the times are shared with them")
    bad = [r["label"] for r in rows if r["result"] is not None and not r["result"]["params_identical"]]
    if bad:
        out.append("CHECK FAILED: parameters differ across ranks: " + ", ".join(bad))
    elif any(r["result"] for r in rows):
        out.append("checked: every method ended with bit-identical parameters on all ranks")
    return out


def plot(rows, path, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    for r in rows:
        if r["result"] is None:
            continue
        curve = [c for c in r["result"]["curve"] if c["bytes_sent_so_far"] > 0]
        ax.plot([c["bytes_sent_so_far"] for c in curve], [c["test_accuracy"] for c in curve], marker="o",
                markersize=3.5, linewidth=1.4, label=r["label"])
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per rank (log scale)")
    ax.set_ylabel("test accuracy (450 samples)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    epochs = f"{args.epochs} epochs" + (f" (at most {args.max_steps} steps)" if args.max_steps else "")
    ax.set_title(f"hvd_qsgd: digits MLP, {args.np} ranks (Horovod Gloo), {epochs}, one marker per epoch",
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args):
    if args.workload == "lm":
        from benchmarks import convergence_lm
        if args.methods is None:
            args.methods = list(convergence_lm.METHODS)
        if args.png == DEFAULT_PNG:
            args.png = "convergence_lm.png"
        return convergence_lm.run(args)
    if args.methods is None:
        args.methods = list(METHODS)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        print(f"--workload digits has no method {', '.join(unknown)}; its methods: {', '.join(METHODS)}",
              file=sys.stderr)
        return 2
    if not os.path.exists(os.path.join(REPO_ROOT, EXAMPLE)):
        print(f"the example {EXAMPLE} is not under {REPO_ROOT}: run from a checkout of the repository", file=sys.stderr)
        return 2
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable); "
          f"load average {info['load_avg_1min']:.2f}", flush=True)
    rows = []
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hvd_qsgd_convergence_") as tmp:
        for method in args.methods:
            label = METHODS[method][0]
            path = os.path.join(tmp, f"{method}.json")
            cmd = command(method, args, path)
            print(f"running {label}: horovodrun {' '.join(cmd[1:6])} python {' '.join(cmd[7:])}", flush=True)
            status, out, seconds = launch_job(cmd, args.timeout, cwd=REPO_ROOT)
            result = None
            if status == 0 and os.path.exists(path):
                with open(path) as f:
                    result = json.load(f)
                print(f"  done in {seconds:.0f}s: test accuracy {result['test_accuracy']:.4f}, "
                      f"{_mb(result['bytes_sent_total'])} sent", flush=True)
            else:
                print(f"  {label} FAILED (exit status {status}) after {seconds:.0f}s:\n{out[-4000:]}", flush=True)
            rows.append(dict(method=method, label=label, command=cmd, status=status, wall_s=seconds, result=result))
    total = time.perf_counter() - t_all
    info["load_avg_1min_end"] = os.getloadavg()[0]
    lines = table_lines(rows)
    note_lines = notes(rows, args, info)
    print()
    print("\n".join(lines))
    print()
    print("\n".join("- " + ln for ln in note_lines))
    ok = [r for r in rows if r["result"] is not None]
    if ok:
        plot(rows, args.png, args)
        print(f"\nwrote {args.png}", flush=True)
    if args.json:
        config = {k: getattr(args, k) for k in ("np", "epochs", "max_steps", "methods", "seed")}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, config=config, runs=rows, table=lines, notes=note_lines,
                           total_wall_s=total), f, indent=1)
        print(f"wrote {args.json}")
    failed = len(ok) < len(rows) or any(not r["result"]["params_identical"] for r in ok)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(module_main("convergence", add_arguments, run))
