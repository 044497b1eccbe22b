"""``python -m benchmarks torch``: per-step time and bytes of a PyTorch training step under
Horovod with no compression, fp16 and ``hvd_qsgd.QSGD(b)``.

What runs. For each rank count n of ``--np`` the command launches one job,
``horovodrun -np n -H localhost:n --gloo <python> -m benchmarks.torch --worker ...``. Each rank
builds one copy of an MLP per compression mode (same initial weights on every rank; its own
synthetic batch per rank, so the ranks' gradients differ), wraps it in ``hvd.DistributedOptimizer``
(SGD with momentum) with ``compression=`` the mode, and steps all the modes in turn, one step of each
per round: ``--warmup`` untimed rounds, then ``--steps`` timed rounds. The modes are thus measured
side by side in one process, under the same machine load. A ``compute only`` row steps one more copy
with a plain local optimizer (no exchange) under the same conditions: the difference between a
mode's time and it is what the exchange costs (communication, quantization, waiting).

Per-step time. Before every timed step the ranks meet at a barrier (an allreduce of a scalar); each
rank times its own step (zero_grad, forward, backward, optimizer.step, which waits for every
gradient's exchange); a step's time is the maximum over ranks (an allreduce with ``hvd.Max`` of the
per-rank times, after the run), and the table gives the median over the timed steps (the JSON keeps
every step). "vs none" is median(mode) / median(none) at the same n.

Bytes per rank per step. ``sent`` is the size of what this rank hands to the collectives, each
gradient element once:

    none:     4 * numel            (fp32 allreduce; numel = the model's parameter count)
    fp16:     2 * numel            (hvd.Compression.fp16)
    QSGD(b):  bytes_sent + 4 * raw_elements   (from the compressor's ``stats``, per timed step)

where bytes_sent counts the QSGD payloads of the quantized tensors (fixed coding:
``codec.payload_nbytes(d, b, B) = 56 + 4*ceil(d/B) + ceil(d*b/8)`` for a tensor of d elements) and
raw_elements those of the tensors under ``min_numel`` (default 10,000: the biases), allreduced in
fp32. For none and fp16 the count is taken from the tensors the compressor returns to Horovod (a
counting wrapper), which must equal 4 * numel and 2 * numel. Not included: each quantized tensor's
control vector (8 * ``protocol.control_length(n)`` bytes, allreduced; listed in the JSON as
``control_bytes_per_step``) and Horovod's own negotiation messages.

``recv`` is what arrives at a rank, which depends on the collective, not only on the tensor:

    allreduce of S bytes (none, fp16, QSGD's raw tensors):  2 * (n-1)/n * S  (ring allreduce, the
        bandwidth-optimal algorithm; Gloo's default, which Horovod's Gloo controller uses)
    allgather of QSGD payloads:  the other ranks' payloads, (n-1) * P with fixed coding, as counted
        by the compressor's ``stats['bytes_received']``

So ``sent`` is the compression ratio of the data, and ``recv`` is the traffic: QSGD reduces by
allgather, so its traffic grows with n - 1 while an allreduce's stays below 2 * S. With b bits
QSGD's traffic falls below fp32's ring allreduce only while (n-1) * P < 2 * (n-1)/n * 4 * numel,
i.e. about P/(4*numel) < 2/n: at n = 8, QSGD(8) (P ~ numel) already receives about as much as none.

Honesty notes, also printed with the results: the ranks share this machine's cores; with more ranks
than cores the computation is oversubscribed and the step time measures contention as much as
communication. All traffic is local (loopback TCP through Gloo), far faster than a network link, so
the time a smaller payload saves on a real network is not visible here. Threads: OMP_NUM_THREADS=1
for every rank (PyTorch and the codec's OpenMP kernels run one thread per rank).

Outputs under ``--out`` (default ``bench_out/torch/``, git-ignored): ``results.json`` (every number,
the definitions and the machine), ``table.md`` (the table printed on stdout) and ``plot.png``.
"""
import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.common import (bit_widths, horovodrun, launch_job, machine_info, module_main,
                               ms_quartiles, nonnegative_int, positive_int)

MODES_FIXED = ("none", "fp16")
DEFAULT_OUT = os.path.join("bench_out", "torch")
CLASSES = 10


# ---- arguments ---------------------------------------------------------------------------------
def _hidden(text):
    v = positive_int(text)
    if v < 2 or v % 2:
        raise argparse.ArgumentTypeError(f"--hidden must be an even integer >= 2: {text!r}")
    return v


_bits = bit_widths(1)


def add_arguments(p):
    p.add_argument("--np", type=positive_int, nargs="+", default=[2, 4, 8], metavar="N",
                   help="rank counts, one horovodrun job each (default: 2 4 8)")
    p.add_argument("--bits", type=_bits, default="2,4,8",
                   help="QSGD bit widths, comma-separated (default %(default)s)")
    p.add_argument("--hidden", type=_hidden, default=2048,
                   help="MLP hidden width H: layers H/2 -> H -> H/2 -> 10 (default %(default)s: "
                        "4,207,626 parameters)")
    p.add_argument("--batch", type=positive_int, default=32, help="samples per rank per step (default %(default)s)")
    p.add_argument("--steps", type=positive_int, default=20, help="timed steps per mode (default %(default)s)")
    p.add_argument("--warmup", type=nonnegative_int, default=3,
                   help="untimed steps per mode first (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the data and QSGD")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="folder of results.json, table.md and plot.png (default %(default)s)")
    p.add_argument("--timeout", type=positive_int, default=1200,
                   help="seconds allowed to each horovodrun job (default %(default)s)")
    # worker mode (what horovodrun starts on every rank)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)


# ---- shared definitions --------------------------------------------------------------------------
def mode_names(bits):
    return list(MODES_FIXED) + [f"qsgd{b}" for b in bits]


def mode_label(mode):
    return f"QSGD({mode[4:]})" if mode.startswith("qsgd") else mode


def layer_dims(hidden):
    return [hidden // 2, hidden, hidden // 2, CLASSES]


def ring_allreduce_recv(nbytes, n):
    """Bytes a rank receives in a ring allreduce of ``nbytes`` over n ranks."""
    return 2 * (n - 1) * nbytes / n


# ---- worker (one rank of a horovodrun job) -------------------------------------------------------
def _make_model(hidden, seed):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    d = layer_dims(hidden)
    return nn.Sequential(nn.Linear(d[0], d[1]), nn.ReLU(), nn.Linear(d[1], d[2]), nn.ReLU(),
                         nn.Linear(d[2], d[3]))


class _Counting:
    """Wraps a Horovod compressor and counts the bytes of the tensors it hands to the collective."""

    def __init__(self, inner):
        self.inner = inner
        self.bytes = 0

    def compress(self, tensor):
        wire, ctx = self.inner.compress(tensor)
        self.bytes += wire.element_size() * wire.numel()
        return wire, ctx

    def decompress(self, tensor, ctx):
        return self.inner.decompress(tensor, ctx)


def _param_digest(model):
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for _, p in model.named_parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_worker(args):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import horovod
    import horovod.torch as hvd

    import hvd_qsgd
    from hvd_qsgd import codec, protocol

    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    modes = mode_names(args.bits)
    gen = torch.Generator().manual_seed(args.seed * 1000003 + rank)
    x = torch.randn(args.batch, layer_dims(args.hidden)[0], generator=gen)
    y = torch.randint(0, CLASSES, (args.batch,), generator=gen)

    runs = {}  # name -> dict(model, opt, compressor)
    local_model = _make_model(args.hidden, args.seed)
    runs["compute"] = dict(model=local_model, opt=torch.optim.SGD(local_model.parameters(), lr=0.01, momentum=0.9),
                           comp=None)
    for mode in modes:
        model = _make_model(args.hidden, args.seed)
        if mode == "none":
            comp = _Counting(hvd.Compression.none)
        elif mode == "fp16":
            comp = _Counting(hvd.Compression.fp16)
        else:
            comp = hvd_qsgd.QSGD(int(mode[4:]), seed=args.seed, named_parameters=model.named_parameters())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=comp)
        runs[mode] = dict(model=model, opt=opt, comp=comp)
    order = ["compute"] + modes
    numel = sum(p.numel() for p in local_model.parameters())
    shapes = [(name, list(p.shape), p.numel()) for name, p in local_model.named_parameters()]

    barrier_tensor = torch.zeros(1)

    def barrier():
        hvd.allreduce(barrier_tensor, name="bench.barrier")

    def step(r):
        r["opt"].zero_grad()
        loss = F.cross_entropy(r["model"](x), y)
        loss.backward()
        r["opt"].step()
        return loss

    def counters(name):
        comp = runs[name]["comp"]
        if comp is None:
            return {}
        if isinstance(comp, _Counting):
            return {"bytes_sent": comp.bytes}
        return dict(comp.stats)

    for _ in range(args.warmup):
        for name in order:
            barrier()
            step(runs[name])
    before = {name: counters(name) for name in order}
    times = np.zeros((args.steps, len(order)))
    for i in range(args.steps):
        for j, name in enumerate(order):
            barrier()
            t0 = time.perf_counter()
            step(runs[name])
            times[i, j] = time.perf_counter() - t0
    after = {name: counters(name) for name in order}
    tmax = hvd.allreduce(torch.from_numpy(times), op=hvd.Max, name="bench.times").numpy()
    tmin = hvd.allreduce(torch.from_numpy(times), op=hvd.Min, name="bench.times_min").numpy()
    deltas = {name: {k: after[name][k] - before[name].get(k, 0) for k in after[name] if k != "ratio"}
              for name in order}
    all_deltas = hvd.allgather_object(deltas)
    digests = hvd.allgather_object({m: _param_digest(runs[m]["model"]) for m in modes})
    if rank != 0:
        return 0

    s = args.steps
    rows = []
    for j, name in enumerate(order):
        per_step_max = tmax[:, j].tolist()
        row = dict(mode=name, step_s_median=statistics.median(per_step_max),
                   step_s_mean=statistics.fmean(per_step_max), step_s_max_over_ranks=per_step_max,
                   step_s_min_over_ranks=tmin[:, j].tolist(), step_s_rank0=times[:, j].tolist())
        if name != "compute":
            d = deltas[name]
            row["params_identical_across_ranks"] = len({dg[name] for dg in digests}) == 1
            row["counters_per_rank"] = [dd[name] for dd in all_deltas]
            if name in MODES_FIXED:
                sent = d["bytes_sent"] / s
                recv = ring_allreduce_recv(sent, n)
                expected = (4 if name == "none" else 2) * numel
                control = 0
            else:
                bits = int(name[4:])
                settings = runs[name]["comp"].settings
                sent = (d["bytes_sent"] + 4 * d["raw_elements"]) / s
                recv = d["bytes_received"] / s + ring_allreduce_recv(4 * d["raw_elements"] / s, n)
                expected = sum(codec.payload_nbytes(k, bits, settings.bucket_size) if k >= settings.min_numel
                               else 4 * k for _, _, k in shapes)
                control = d["tensors"] / s * 8 * protocol.control_length(n)
                row.update(bucket_size=settings.bucket_size, min_numel=settings.min_numel,
                           payload_bytes_per_step=d["bytes_sent"] / s,
                           payload_bytes_received_per_step=d["bytes_received"] / s,
                           raw_elements_per_step=d["raw_elements"] / s,
                           quantized_tensors_per_step=d["tensors"] / s)
            row.update(sent_bytes_per_step=sent, recv_bytes_per_step=recv, expected_sent_bytes_per_step=expected,
                       control_bytes_per_step=control)
        rows.append(row)
    result = dict(np=n, numel=numel, parameters=shapes, hidden=args.hidden, batch=args.batch, steps=args.steps,
                  warmup=args.warmup, seed=args.seed, torch=torch.__version__,
                  torch_threads=torch.get_num_threads(), codec_threads=codec.get_num_threads(),
                  horovod=horovod.__version__, rows=rows)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


# ---- launcher ------------------------------------------------------------------------------------
def _launch(n, args, json_path):
    """Run one horovodrun job of n ranks; (exit status, output, seconds)."""
    cmd = [horovodrun(), "-np", str(n), "-H", f"localhost:{n}", "--gloo", sys.executable, "-m",
           "benchmarks.torch", "--worker", "--json", json_path, "--bits", ",".join(map(str, args.bits)),
           "--hidden", str(args.hidden), "--batch", str(args.batch), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--seed", str(args.seed)]
    return launch_job(cmd, args.timeout)


def _mb(nbytes):
    return f"{nbytes / 1e6:.3f}"


def _x(v):
    return f"{v:.3f}x" if v < 0.1 else f"{v:.2f}x"


def _ms(row):
    """'median [q1-q3]' of the per-step times (max over ranks), in ms."""
    return ms_quartiles(row["step_s_max_over_ranks"], median_digits=1)


TABLE_HEADER = ("| ranks | mode | step ms: median [quartiles] | time vs none | sent MB/rank/step | "
                "sent vs none | recv MB/rank/step | recv vs none |")


def table_lines(runs):
    lines = [TABLE_HEADER, "|" + "---|" * 8]
    for run in runs:
        rows = {r["mode"]: r for r in run["rows"]}
        none = rows["none"]
        tag = f"{run['np']}" + (" (oversubscribed)" if run["oversubscribed"] else "")
        for r in run["rows"]:
            ms = _ms(r)
            tr = _x(r["step_s_median"] / none["step_s_median"])
            if r["mode"] == "compute":
                lines.append(f"| {tag} | compute only (no exchange) | {ms} | {tr} | - | - | - | - |")
                continue
            lines.append(f"| {tag} | {mode_label(r['mode'])} | {ms} | {tr} | {_mb(r['sent_bytes_per_step'])} | "
                         f"{_x(r['sent_bytes_per_step'] / none['sent_bytes_per_step'])} | "
                         f"{_mb(r['recv_bytes_per_step'])} | "
                         f"{_x(r['recv_bytes_per_step'] / none['recv_bytes_per_step'])} |")
    return lines


def notes(runs, info, args):
    first = runs[0]
    out = [f"model: MLP {'-'.join(map(str, layer_dims(args.hidden)))}, {first['numel']:,} parameters "
           f"(fp32: {_mb(4 * first['numel'])} MB); batch {args.batch} per rank (synthetic); SGD with momentum; "
           f"{args.warmup} warm-up + {args.steps} timed steps per mode, modes interleaved step by step",
           "step ms: each rank times zero_grad+forward+backward+step after a barrier; a step's time is the max "
           "over ranks; median [first-third quartile] over the timed steps; time vs none: ratio of medians",
           "sent: bytes this rank hands to the collectives per step: none 4*numel, fp16 2*numel, QSGD its "
           "payloads (stats bytes_sent) + 4*raw_elements (tensors under min_numel, fp32); control vectors "
           "(8*control_length(n) B per quantized tensor) excluded",
           "recv: bytes arriving at a rank per step: ring allreduce 2(n-1)/n*S for allreduced tensors; QSGD "
           "payloads by allgather, (n-1)*P, from stats bytes_received: QSGD's traffic grows with n",
           f"machine: {info['cpu']}, {info['usable_cores']} usable cores; OMP_NUM_THREADS=1 per rank; Gloo over "
           "loopback TCP (no real network: the time a smaller payload saves on a link is not visible here)"]
    load = (info["load_avg_1min"], info.get("load_avg_1min_end", info["load_avg_1min"]))
    if max(load) > 0.5 * info["usable_cores"]:
        out.append(f"warning: other processes were using the CPUs (1-min load average {load[0]:.2f} at the start, "
                   f"{load[1]:.2f} at the end, on {info['usable_cores']} cores): the times are shared with them")
    over = [r["np"] for r in runs if r["oversubscribed"]]
    if over:
        out.append(f"warning: {', '.join(map(str, over))} ranks on {info['usable_cores']} cores: the computation is "
                   "oversubscribed; those step times measure CPU contention as much as the exchange")
    bad = [f"np={run['np']} {r['mode']}" for run in runs for r in run["rows"]
           if r["mode"] != "compute" and (r["sent_bytes_per_step"] != r["expected_sent_bytes_per_step"]
                                          or not r["params_identical_across_ranks"])]
    if bad:
        out.append("CHECK FAILED (sent bytes differ from the expected count, or replicas differ): " + ", ".join(bad))
    else:
        out.append("checked: sent bytes equal the expected count (codec.payload_nbytes of the quantized tensors "
                   "+ 4 B per raw element; 4*numel / 2*numel) and the parameters are identical on every rank")
    return out, not bad


def plot(runs, path, info):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [r["mode"] for r in runs[0]["rows"] if r["mode"] != "compute"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    width = 0.8 / len(runs)
    panels = [("step time (ms, median of max over ranks)", lambda r: 1e3 * r["step_s_median"]),
              ("sent MB / rank / step", lambda r: r["sent_bytes_per_step"] / 1e6),
              ("recv MB / rank / step (ring allreduce; QSGD allgather)", lambda r: r["recv_bytes_per_step"] / 1e6)]
    for ax, (title, value) in zip(axes, panels):
        for k, run in enumerate(runs):
            rows = {r["mode"]: r for r in run["rows"]}
            xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(modes))]
            label = f"{run['np']} ranks" + (" (oversubscribed)" if run["oversubscribed"] else "")
            bars = ax.bar(xs, [value(rows[m]) for m in modes], width, label=label)
            if "step time" in title and "compute" in rows:
                ax.hlines(1e3 * rows["compute"]["step_s_median"], xs[0] - width / 2, xs[-1] + width / 2,
                          colors=bars.patches[0].get_facecolor(), linestyles="dashed", linewidth=1.2, zorder=3)
        ax.set_xticks(range(len(modes)), [mode_label(m) for m in modes])
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, title="dashed: compute only", title_fontsize=8)
    fig.suptitle(f"hvd_qsgd torch benchmark: MLP {runs[0]['numel']:,} params, Horovod Gloo, "
                 f"{info['usable_cores']}-core {info['cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args):
    if args.worker:
        if not args.json:
            print("--worker needs --json", file=sys.stderr)
            return 2
        return run_worker(args)
    os.makedirs(args.out, exist_ok=True)
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable); "
          f"load average {info['load_avg_1min']:.2f}", flush=True)
    runs, failures, t_all = [], [], time.perf_counter()
    for n in args.np:
        path = os.path.join(os.path.abspath(args.out), f"raw_np{n}.json")
        if os.path.exists(path):
            os.remove(path)
        print(f"running {n} ranks (horovodrun --gloo) ...", flush=True)
        status, out, seconds = _launch(n, args, path)
        if status != 0 or not os.path.exists(path):
            failures.append(n)
            print(f"{n} ranks FAILED (exit status {status}) after {seconds:.0f}s:\n{out[-4000:]}", flush=True)
            continue
        with open(path) as f:
            result = json.load(f)
        result.update(wall_s=seconds, oversubscribed=n > info["usable_cores"])
        runs.append(result)
        print(f"  done in {seconds:.0f}s", flush=True)
    total = time.perf_counter() - t_all
    if not runs:
        print("no run succeeded")
        return 1
    info["load_avg_1min_end"] = os.getloadavg()[0]
    lines = table_lines(runs)
    note_lines, checks_ok = notes(runs, info, args)
    print()
    print("\n".join(lines))
    print()
    print("\n".join("- " + ln for ln in note_lines))
    config = {k: getattr(args, k) for k in ("np", "bits", "hidden", "batch", "steps", "warmup", "seed")}
    definitions = dict(
        step_s_median="median over timed steps of max over ranks of one rank's step time (after a barrier)",
        sent_bytes_per_step="bytes this rank hands to the collectives per step: none 4*numel, fp16 2*numel, "
                            "QSGD stats bytes_sent + 4*raw_elements (control vectors excluded)",
        recv_bytes_per_step="bytes arriving at a rank per step: 2(n-1)/n*S for allreduced tensors (ring), "
                            "QSGD stats bytes_received for the allgathered payloads",
        control_bytes_per_step="QSGD control vectors (float64, allreduced), per step, not in sent/recv")
    results = dict(machine=info, config=config, definitions=definitions, runs=runs, failed_np=failures,
                   checks_ok=checks_ok, total_wall_s=total, notes=note_lines)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n\n" + "\n".join("- " + ln for ln in note_lines) + "\n")
    plot(runs, os.path.join(args.out, "plot.png"), info)
    print(f"\nwrote {os.path.join(args.out, 'results.json')}, table.md, plot.png ({total:.0f}s in all)")
    return 1 if failures or not checks_ok else 0


if __name__ == "__main__":
    sys.exit(module_main("torch", add_arguments, run))
