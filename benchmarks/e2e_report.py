"""The report of ``python -m benchmarks e2e``: the tables (measured; model vs measured; the model's
projection), the notes that qualify them, and the files under ``--out``: ``results.json`` (every
number, the definitions, the machine, the qdiscs), ``table.md`` (what is printed) and ``plot.png``.
The definitions are in the docstring of ``benchmarks.e2e``."""
import json
import os
import time

from benchmarks.common import ms_quartiles
from benchmarks.e2e_model import PROJECT_N, describe, mode_label, model_wire_bytes
from benchmarks.netns import parse_rate

DEFINITIONS = dict(
    step_s_median="median over timed steps of the max over ranks of one rank's step time (after a barrier)",
    tx_bytes_per_step="bytes counted on a rank's veth0 tx_bytes between the barriers around a step, mean over "
                      "ranks and timed steps (rx likewise); per rank and step in *_per_rank_step",
    tcp_retransmits_per_rank_step="TCP segments retransmitted in a rank's namespace during the step (/proc/net/snmp "
                                  "RetransSegs): bytes a link carried again",
    stats_per_step="the compressor's own count per step, mean over ranks: QSGD stats (payload bytes); none / "
                   "fp16: bytes handed to the collective",
    model_wire_bytes="cost_model.received_bytes summed over the step's exchanges",
    efficiency="e with beta = e * rate / 8, fitted per job on its none point (alpha = cost_model.LATENCY_S)",
    compute="in-job compute parts: compute_s (the compute step), encode_s, decode1_s, cast_s; median over "
            "rounds of the max over ranks",
    projection="cost model at the nominal rate and default alpha, compute_for_projection; speedup_at_efficiency "
               "at beta = efficiency_median * rate / 8")


# ---- tables ----------------------------------------------------------------------------------------
def mb(b):
    return f"{b / 1e6:.2f}"


def _ms(s):
    return f"{1e3 * s:.0f}" if s >= 0.1 else f"{1e3 * s:.1f}"


MEASURED_HEADER = ("| ranks | link | mode | step ms: median [quartiles] | speedup vs none | tx MB/{w}/step | "
                   "rx MB/{w}/step | model MB/rank/step | counted rx / model | compressor MB sent / recv (per rank) |")


def measured_lines(jobs, shapes):
    """The measured table; with hosts of several ranks the counted bytes are each host link's."""
    per_host = max([j.get("per_host", 1) for j in jobs] or [1])
    lines = [MEASURED_HEADER.format(w="host" if per_host > 1 else "rank"), "|" + "---|" * 10]
    for job in jobs:
        n, rate, hosts = job["np"], job["rate"], job["np"] // job.get("per_host", 1)
        ranks = f"{n} ({hosts} hosts x {n // hosts})" if hosts < n else str(n)
        rows = {r["mode"]: r for r in job["rows"]}
        none = rows["none"]["step_s_median"]
        for r in job["rows"]:
            m = r["mode"]
            sp = f"{none / r['step_s_median']:.2f}x"
            if m == "compute":
                lines.append(f"| {ranks} | {rate} | compute only (no exchange) | {ms_quartiles(r['step_s_max_over_ranks'])} | "
                             f"({sp}: the bound) | {mb(r['tx_bytes_per_step'])} | {mb(r['rx_bytes_per_step'])} | "
                             "0 | - | - |")
                continue
            model = model_wire_bytes(m, n, shapes) if hosts == n else None
            st = r["stats_per_step"]
            comp = (f"{mb(st['bytes_sent'])} / {mb(st['bytes_received'])}" if "bytes_received" in st
                    else f"{mb(st['bytes_sent'])} / -")
            modelled = f"{mb(model)} | {r['rx_bytes_per_step'] / model:.3f}" if model else "- | -"
            lines.append(f"| {ranks} | {rate} | {mode_label(m)} | {ms_quartiles(r['step_s_max_over_ranks'])} | {sp} | "
                         f"{mb(r['tx_bytes_per_step'])} | {mb(r['rx_bytes_per_step'])} | {modelled} | {comp} |")
    return lines


def unavailable_lines(unavailable):
    return [f"{mode_label(m)}: not measured: {why}" for m, why in unavailable.items()]


def prediction_lines(preds):
    lines = ["| ranks | link | e (fitted on none) | mode | compute ms (measured) | comm ms (model at e) | "
             "predicted ms | measured ms | measured / predicted |", "|" + "---|" * 9]
    for p in preds:
        lines.append(f"| {p['np']} | {p['rate']} | {p['efficiency']:.3f} | {mode_label(p['mode'])} | "
                     f"{_ms(p['compute_s'])} | {_ms(p['comm_s'])} | {_ms(p['step_s'])} | {_ms(p['measured_s'])} | "
                     f"{p['ratio']:.2f} |")
    return lines


def projection_lines(rows, unavailable, efficiency):
    extra = f" speedup at e = {efficiency:.2f} |" if efficiency is not None else ""
    lines = ["| ranks | link | mode | compute ms | comm ms | step ms | speedup vs none |" + extra +
             " wire MB/rank/step |", "|" + "---|" * (9 if extra else 8)]
    for r in rows:
        label = mode_label(r["mode"]) + (" (not implemented here)" if r["mode"] in unavailable else "")
        at_e = f" {r['speedup_at_efficiency']:.2f}x |" if extra else ""
        lines.append(f"| {r['np']} | {r['rate']} | {label} | {_ms(r['compute_s'])} | {_ms(r['comm_s'])} | "
                     f"{_ms(r['step_s'])} | {r['speedup']:.2f}x |{at_e} {mb(r['wire_bytes'])} |")
    return lines


# ---- plot ------------------------------------------------------------------------------------------
def _plot_projection(ax, proj_rows, modes):
    for m in modes:
        if m == "none":
            continue
        pts = [(parse_rate(r["rate"]) / 1e9, r["speedup"]) for r in proj_rows if r["mode"] == m
               and r["np"] == PROJECT_N]
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=mode_label(m))
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("link Gbit/s")
    ax.set_title(f"model: speedup over none at {PROJECT_N} ranks", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot(path, jobs, proj_rows, modes, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (2 if jobs else 0) + (1 if proj_rows or not jobs else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.8), squeeze=False)
    axes = axes[0]
    if jobs:
        width = 0.8 / len(jobs)
        for k, job in enumerate(jobs):
            rows = {r["mode"]: r for r in job["rows"]}
            ms = [m for m in modes if m in rows]
            xs = [modes.index(m) + (k - (len(jobs) - 1) / 2) * width for m in ms]
            label = f"{job['np']} ranks, {job['rate']}"
            axes[0].bar(xs, [1e3 * rows[m]["step_s_median"] for m in ms], width, label=label)
            axes[1].bar(xs, [rows[m]["rx_bytes_per_step"] / 1e6 for m in ms], width, label=label)
        for ax, t in ((axes[0], "measured step time (ms, median of max over ranks)"),
                      (axes[1], "counted rx MB / {} / step (veth)".format(
                          "host" if any(j.get("per_host", 1) > 1 for j in jobs) else "rank"))):
            ax.set_xticks(range(len(modes)), [mode_label(m).replace(" ", "\n") for m in modes], fontsize=8)
            ax.set_title(t, fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8)
    if panels > (2 if jobs else 0):
        _plot_projection(axes[-1], proj_rows, modes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the run's text: tables and notes ------------------------------------------------------------
def table_lines(jobs, model, unavailable, not_measured, shapes):
    """The tables of the run, with the unavailable modes and the no-measurement line between them."""
    from hvd_qsgd import cost_model

    lines = []
    if jobs:
        lines += ["## Measured (network namespaces, tbf-shaped veth links, Horovod Gloo)", ""]
        lines += measured_lines(jobs, shapes) + [""]
    lines += [f"- {ln}" for ln in unavailable_lines(unavailable)]
    if not_measured:
        lines += [f"- NO MEASUREMENT: {not_measured}; everything below is the cost model (labelled model)"]
    lines.append("")
    if model["compute"] is None:  # hosts of several ranks: this one-link model does not apply
        return lines + ["- no model here: it prices one link per rank; the two-link model of hosts of several "
                        "ranks is `python -m benchmarks nodes` (a projection)", ""]
    if jobs:
        lines += ["## Model vs measured (hvd_qsgd.cost_model; beta = e * link rate / 8 with e fitted on the "
                  f"none row; alpha {1e6 * cost_model.LATENCY_S:.0f} us; compute measured in the job)", ""]
        lines += prediction_lines(model["predictions"]) + [""]
    lines += [f"## MODEL projection (hvd_qsgd.cost_model: nominal link rate, alpha "
              f"{1e6 * cost_model.LATENCY_S:.0f} us; compute of one rank on one core of this machine)", ""]
    lines += projection_lines(model["projection"], unavailable, model["efficiency"]) + [""]
    return lines


def compute_text(c, modes):
    """The compute parts ``c`` in words."""
    return (f"compute step {_ms(c['compute_s'])} ms"
            + "".join(f", QSGD({b}) encode E {_ms(c['encode_s'][b])} ms, decode of one payload of each tensor "
                      f"D1 {_ms(c['decode1_s'][b])} ms" for b in c["encode_s"])
            + (f", fp16 casts {_ms(c['cast_s'])} ms" if "fp16" in modes else ""))


def measurement_notes(args, jobs):
    """How the measured table was taken (nothing without jobs)."""
    if not jobs:
        return []
    return [f"{args.warmup} warm-up + {args.steps} timed rounds, modes interleaved step by step; each rank "
            "times zero_grad+forward+backward+step after a barrier; a step is the max over ranks; median "
            "[quartiles] over timed steps; speedup = median(none) / median(mode)",
            "tx/rx: counted on each rank's veth0 (tx_bytes/rx_bytes, barrier to barrier around each step), "
            "mean over ranks and steps: headers, Gloo framing, Horovod's coordination and QSGD's control "
            "vectors included; the compute row is that background alone"
            + ("; with hosts of several ranks every rank of a host reads its host's veth0, so these are the "
               "host link's bytes (its ranks' traffic to each other stays inside the host)"
               if args.ranks_per_host > 1 else ""),
            "model MB: what the cost model says a rank receives (ring allreduce 2(n-1)/n S, allgather (n-1) P, "
            "scatter_allgather 2(n-1)/n P); compressor MB: QSGD stats bytes_sent / bytes_received per step, "
            "or the bytes none / fp16 hand to the collective",
            "compute in the job (model vs measured): " + "; ".join(
                f"n={j['np']} {j['rate']}: {compute_text(j['compute'], args.modes)}" for j in jobs)
            + " (every rank at once, median over rounds of the max over ranks)"]


def model_notes(args, jobs, model):
    """What the model fits and assumes (nothing where it was not run)."""
    from hvd_qsgd import cost_model

    if model["compute"] is None:
        return []
    return [f"alpha: {1e6 * cost_model.LATENCY_S:.0f} us (the cost model's default), not fitted; "
            + ("e: the link efficiency, beta = e * rate / 8, fitted per job on its none point alone: "
               "e = (bytes / (rate/8)) / (measured - compute - messages * alpha), at most 1; the fp16 and QSGD "
               "rows are predictions; the projection's last speedup column uses the median e"
               if jobs else "beta: the nominal link rate / 8"),
            f"compute for the projection: {model['compute_how']}: {compute_text(model['compute'], args.modes)}; "
            "compute(mode) = compute + E + n D1 (allgather), E (1+1/n) + 2 D1 (scatter_allgather), the casts "
            "(fp16); compute and communication are added (no overlap)",
            "fp16: the model prices only its bytes; Horovod's Gloo CPU path also sums float16 more slowly than "
            "float32, which the measurement includes and the model does not"]


def machine_notes(info, jobs):
    """The machine, and warnings about oversubscription and other load."""
    notes = []
    if jobs:
        notes.append(f"machine: {info['cpu']}, {info['usable_cores']} usable cores; OMP_NUM_THREADS=1 per rank; "
                     "the same cores run every link's TCP stack and token buckets")
    over = sorted({j["np"] for j in jobs if j["oversubscribed"]})
    if over:
        notes.append(f"warning: {', '.join(map(str, over))} ranks on {info['usable_cores']} cores: the computation "
                     "is oversubscribed (the compute and codec times in the job are measured under the same "
                     "contention, which is why they exceed the projection's)")
    if jobs and info["load_avg_1min"] > 0.5 * info["usable_cores"]:
        notes.append(f"warning: other processes were using the CPUs (1-min load average {info['load_avg_1min']:.2f} "
                     "before the run): the times are shared with them")
    return notes


def differing_params(jobs):
    """The (job, mode)s whose parameters differ across ranks after the run."""
    return [f"np{j['np']} {j['rate']} {r['mode']}" for j in jobs for r in j["rows"]
            if r["mode"] != "compute" and not r["params_identical_across_ranks"]]


def all_notes(args, info, jobs, model, shapes, bad):
    """Every note printed under the tables."""
    notes = [f"model: {describe(args, shapes)} per gradient step; batch {args.batch} per rank, synthetic; SGD"]
    notes += measurement_notes(args, jobs) + model_notes(args, jobs, model) + machine_notes(info, jobs)
    if bad:
        notes.append("CHECK FAILED: parameters differ across ranks: " + ", ".join(bad))
    elif jobs:
        notes.append("checked: after the run every mode's parameters are identical on every rank")
    return notes


# ---- the run's files ---------------------------------------------------------------------------------
def results(args, info, shapes, run, model, notes, bad, total):
    """Everything of the run, as written to results.json."""
    from hvd_qsgd import cost_model

    config = {k: getattr(args, k) for k in ("np", "ranks_per_host", "rates", "modes", "net", "width", "depth", "batch",
                                            "steps", "warmup", "seed", "timeout", "model_only")}
    return dict(machine=info, config=config, definitions=DEFINITIONS, numel=sum(d for _, d in shapes),
                parameters=shapes, measured=bool(run["jobs"]), not_measured_reason=run["not_measured"],
                unavailable_modes=run["unavailable"], failed_jobs=run["failures"], shaping=run["shaping"],
                qdiscs=run["qdiscs"], jobs=run["jobs"], alpha_s=cost_model.LATENCY_S,
                efficiency_median=model["efficiency"], compute_for_projection=model["compute"],
                compute_for_projection_how=model["compute_how"], projection=model["projection"],
                predictions=model["predictions"], checks_ok=not bad, notes=notes, total_wall_s=total)


def report(args, info, shapes, run, model, t_all):
    """Print the tables and notes, write results.json, table.md and plot.png; the exit status (1 if a
    job failed or the ranks' parameters differ). ``run``: dict(jobs, failures, qdiscs, shaping,
    unavailable, not_measured); ``model``: dict(compute, compute_how, predictions, efficiency,
    projection)."""
    jobs = run["jobs"]
    numel = sum(d for _, d in shapes)
    bad = differing_params(jobs)
    run_notes = all_notes(args, info, jobs, model, shapes, bad)
    text = "\n".join(table_lines(jobs, model, run["unavailable"], run["not_measured"], shapes)
                     + [f"- {ln}" for ln in run_notes])
    print("\n" + text, flush=True)

    total = time.perf_counter() - t_all
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results(args, info, shapes, run, model, run_notes, bad, total), f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    net = "conv net" if getattr(args, "net", "mlp") == "conv" else "MLP"
    title = (f"hvd_qsgd e2e: {net} {numel:,} params, Horovod Gloo over tbf-shaped veth links"
             if jobs else f"hvd_qsgd e2e: MODEL ONLY (nothing measured), {net} {numel:,} params")
    plot(os.path.join(args.out, "plot.png"), jobs, model["projection"], args.modes, title)
    print(f"\nwrote {os.path.join(args.out, 'results.json')}, table.md, plot.png ({total:.0f}s in all)")
    return 1 if run["failures"] or bad else 0
