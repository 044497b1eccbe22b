"""``python -m benchmarks e2e``: step time and counted wire bytes of Horovod PyTorch training
over rate-limited links between network namespaces, with none, fp16 and ``hvd_qsgd.QSGD``; and the
cost model's prediction of every measured point and its projection to 16 ranks.

The network. For each rank count n of ``--np`` the command builds n network namespaces, one per
rank, each joined by a veth pair to a Linux bridge in one more namespace (the switch); every link
end is shaped with ``tc ... tbf rate R`` on its egress, so each rank has a full-duplex R link into
a switch (``benchmarks.netns``: names, addresses, token-bucket parameters). The root namespace's
interfaces and routes are not touched, and everything created is deleted at the end (on SIGINT
or SIGTERM too: the ranks are killed, the namespaces deleted, and the command exits with status
130); namespaces of this naming scheme left by a run that was killed outright are deleted at the
start of the next. For each rate of ``--rates`` the links are re-shaped and one job runs.

The job. Horovod's Gloo rendezvous server runs in the switch namespace (a helper process started
with ``ip netns exec``, listening on the bridge's address); each rank is started directly with
``ip netns exec <rank namespace> <python> -m benchmarks.e2e --worker ...`` and the environment a
Gloo worker needs (HOROVOD_CONTROLLER=gloo, HOROVOD_CPU_OPERATIONS=gloo, rendezvous address and
port, HOROVOD_GLOO_IFACE=veth0, its rank, size, local and cross ranks; every namespace is a host of
its own: local size 1, cross size n; see ``netns`` for the host name each namespace resolves). No
ssh, no horovodrun. A job is bounded by ``--timeout``; if a
rank fails or time runs out every process of the job is killed and the rank's output is shown.

What each rank trains. An MLP of ``--depth`` hidden Linear(W, W) + ReLU layers and a Linear(W, 10)
head (W = ``--width``; 4096 and 3: 50,384,906 parameters, 201.5 MB of fp32 gradient per step), on a
synthetic batch of its own (``--batch`` samples). One copy of the model per mode, same initial
weights, each under ``hvd.DistributedOptimizer(SGD, named_parameters=..., compression=...)``:

    none                hvd.Compression.none: allreduce of fp32 gradients
    fp16                hvd.Compression.fp16: allreduce of fp16 gradients
    qsgd<b>-allgather   hvd_qsgd.QSGD(b, reduction="allgather")
    qsgd<b>-scatter     hvd_qsgd.QSGD(b, reduction="scatter_allgather"), reported as unavailable
                        (not run) while hvd_qsgd.settings.REDUCTIONS lacks "scatter_allgather"
    qsgd<b>-hierarchical
                        hvd_qsgd.QSGD(b, reduction="hierarchical"), with --ranks-per-host > 1
    qsgd<b>-<reduction>-overlap
                        the same with overlap=True (payload collectives start during backward)
    qsgd<b>-<reduction>-buffered[M]
                        the same with fusion_mb=M, 64 without M (gradients quantized together in
                        fusion buffers); -buffered[M]-overlap: both (a full buffer's payload
                        collectives start during backward)

Several ranks per host (``--ranks-per-host L``, default 1): each of the n / L host namespaces holds
L consecutive ranks (Horovod's local rank and size say so), which share its one shaped link; what
they send each other stays inside the namespace. The bytes counted on veth0 are then the host
link's (every rank of a host reads the same counters), and the tables say "per host". The cost
model of this command prices one link per rank, so with L > 1 it is not run: the two-link model of
such layouts is ``python -m benchmarks nodes`` (a projection).

and one more copy, ``compute``, with a local optimizer and no exchange. The modes are stepped in
turn, one step of each per round: ``--warmup`` untimed rounds, then ``--steps`` timed rounds, so they
are measured side by side under the same load. Threads: OMP_NUM_THREADS=1 per rank.

Step time. Before a step the ranks meet at a barrier (an allreduce of one float); each rank times
its own zero_grad + forward + backward + optimizer.step (which waits for every exchange); a step's
time is the maximum over ranks; the table gives the median over the timed steps [quartiles].
"speedup" is median(none) / median(mode) at the same n and rate.

Counted bytes. Around every timed step each rank reads its own veth0's ``tx_bytes`` and
``rx_bytes`` (``/sys/class/net``, its namespace's view) after the barrier before the step and after
a second barrier after it, so a window holds all of the step's traffic and one barrier's. The table
gives bytes per rank per step, the mean over ranks and timed steps. These are frames as the veth
carries them: Ethernet/IP/TCP headers (one set per offloaded packet of up to 64 KiB, so fewer than
on a 1500-byte-MTU wire), Gloo's framing, Horovod's own coordination messages, the barrier and the
compressors' control vectors are all in. The ``compute`` row's bytes are that background alone.
Cross-check: the compressor's own count of payload bytes (QSGD ``stats``; for none and fp16 the
bytes handed to the collective), and the model's wire bytes below.

The model (``hvd_qsgd.cost_model``). A step is predicted as compute(mode) + the sum over the
model's gradients of ``cost_model.seconds(reduction, n, bytes, alpha, beta)``, with alpha the
cost model's default latency, beta = R / 8 in the projection and e R / 8 for the measured points
(e fitted, below), and

    none: allreduce of 4d bytes per gradient of d elements; fp16: allreduce of 2d
    QSGD: gradients of >= min_numel elements: allgather (or scatter_allgather) of
          P = codec.payload_nbytes(d, b, bucket) bytes, plus the allreduce of the control vector
          (8 * protocol.control_length(n) bytes); smaller gradients: allreduce of 4d

The model's wire bytes are the bandwidth terms times beta (what a rank receives; in these ring
algorithms it sends as much). compute(mode) = C, the ``compute`` step (forward, backward, SGD);
fp16 adds the casts to fp16 and back of every gradient; QSGD adds the encode time E of the quantized
gradients and the decode time D1 of one payload of each (``codec.decode_sum`` of k payloads, / k):
E + n D1 for allgather; E (1 + 1/n) + 2 D1 for scatter_allgather (encode, decode-sum of n chunks of
d/n, re-encode of the reduced chunk, decode of the n reduced chunks). Compute and communication are
added (no overlap). Two sets of compute times are measured: in the job, on every rank at once
between the timed steps (median over rounds of the max over ranks), for the prediction of the
measured points, which share the machine's cores the same way; and in the launcher after the jobs,
one process on one thread with no other rank computing (one rank per core, as on a cluster), for
the projection.

Fitted: one number per job, the link efficiency e: the fraction of the shaped rate the ranks
actually get, beta = e R / 8, from that job's ``none`` point alone: e = (bytes / (R/8)) /
(measured - C - messages * alpha), with alpha the cost model's default latency (50 us) and
messages = 2(n-1) per allreduce; e is capped at 1 (a larger value would mean the exchange overlapped
the computation). The fp32 ring allreduce is what the model describes without any codec, so it
calibrates the link, and the fp16 and QSGD points of the same job are then predictions, printed
next to their measurements (ratio). e absorbs what the model leaves out for none: headers,
Horovod's coordination, TCP's ramp-up, and above all the CPU the ranks, the TCP stacks and the
token buckets share on a small machine. (A fitted latency would have to carry all of that per
message, and grows absurdly with n in a projection; the bytes do not.) Not fitted: alpha, bytes,
compute. The projection to n = 16 at 10, 25, 100 Gbit/s and the measured rates is the cost model
as it stands (nominal beta, default alpha) with the compute of one rank on one core; a second
speedup column applies the efficiency measured here. With ``--model-only``, or when the namespaces
cannot be made, nothing is measured on a network, no e is fitted, and the output is labelled as
model.

Honesty notes, also printed: with more ranks than cores the ranks' computation is oversubscribed
(the same cores also run the TCP stack and the token buckets of every link), so in-job compute is
larger than one rank's; the batch keeps the computation itself small (its cost is mostly the
passes over the weights, which grow with the parameter count like the gradient bytes): at the
defaults one rank's step takes 0.15-0.3 s on one core, the fp32 allreduce of 4 ranks at 1 Gbit/s
~2.4 s. Horovod's Gloo CPU path sums float16 more slowly than float32, which the fp16 measurement
includes and its model does not.

Outputs under ``--out`` (default ``bench_out/e2e/``, git-ignored): ``results.json`` (every number,
per rank and per step, the definitions, the machine, the qdiscs), ``table.md`` (what is printed),
``plot.png``, and ``logs/`` (each rank's output).

Modules: this one (the arguments and the command), ``netns`` (the namespaces and links),
``e2e_launch`` (the rendezvous helper, the jobs and their clean-up), ``e2e_worker`` (what each rank
runs), ``e2e_model`` (the modes, compute timing and the cost model's view of a step) and
``e2e_report`` (tables, notes, results.json, plot.png).
"""
import argparse
import os
import statistics
import sys
import time

from benchmarks import netns
from benchmarks.common import machine_info, module_main, nonnegative_int, positive_int
from benchmarks.e2e_launch import run_jobs, run_rendezvous
from benchmarks.e2e_model import (MODE, PROJECT_N, PROJECT_RATES, describe, fit_efficiency, local_compute,
                                  param_shapes, prediction_rows, projection, unavailable_modes)
from benchmarks.e2e_report import report, unavailable_lines
from benchmarks.e2e_worker import run_worker

DEFAULT_OUT = os.path.join("bench_out", "e2e")
DEFAULT_MODES = "none,fp16,qsgd4-allgather,qsgd4-scatter"
PROJECTION_COMPUTE_HOW = ("timed in this one process after the jobs (1 thread, no other rank computing: one "
                          "rank per core, as on a cluster)")


# ---- arguments ---------------------------------------------------------------------------------
def _rates(text):
    rates = [r.strip().lower() for r in text.split(",") if r.strip()]
    try:
        for r in rates:
            netns.parse_rate(r)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not rates:
        raise argparse.ArgumentTypeError(f"no rate given: {text!r}")
    return rates


def _modes(text):
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if not MODE.match(m)]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"modes are none, fp16, qsgd<b>-allgather, qsgd<b>-scatter, qsgd<b>-hierarchical (b in 1..8), each "
            f"QSGD mode with -buffered[M], -overlap or -buffered[M]-overlap after it, "
            f"comma-separated: {text!r}")
    if "none" not in modes:
        modes.insert(0, "none")  # the reference of every speedup
    return list(dict.fromkeys(modes))


def add_arguments(p):
    p.add_argument("--np", type=int_at_least_2, nargs="+", default=[4], metavar="N",
                   help="rank counts, one set of namespaces each (default: 4)")
    p.add_argument("--rates", type=_rates, default="1gbit",
                   help="link rates, tc syntax, comma-separated; one job per rate (default %(default)s)")
    p.add_argument("--modes", type=_modes, default=DEFAULT_MODES,
                   help="compression modes, comma-separated (default %(default)s; none is always run)")
    p.add_argument("--ranks-per-host", type=positive_int, default=1, metavar="L",
                   help="consecutive ranks sharing one host namespace and its link (default %(default)s); "
                        "every --np a multiple of it")
    p.add_argument("--net", choices=("mlp", "conv"), default="mlp",
                   help="the model: the MLP (default) or a ResNet-style conv net (--width: its first stage's "
                        "channels; --depth: blocks per stage)")
    p.add_argument("--width", type=positive_int, default=4096, help="MLP width W (default %(default)s)")
    p.add_argument("--depth", type=positive_int, default=3,
                   help="hidden Linear(W, W) layers (default %(default)s: 50,384,906 parameters at W=4096)")
    p.add_argument("--batch", type=positive_int, default=16, help="samples per rank per step (default %(default)s)")
    p.add_argument("--steps", type=positive_int, default=6, help="timed steps per mode (default %(default)s)")
    p.add_argument("--warmup", type=nonnegative_int, default=2,
                   help="untimed steps per mode first (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the data and QSGD")
    p.add_argument("--timeout", type=positive_int, default=540,
                   help="seconds allowed to each job (default %(default)s)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="folder of results.json, table.md, plot.png and logs/ (default %(default)s)")
    p.add_argument("--model-only", action="store_true",
                   help="no namespaces and no network: the cost model's projection only, with compute timed "
                        "in this process")
    # the processes this command starts itself
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--iface", default="veth0", help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", help=argparse.SUPPRESS)
    p.add_argument("--rate", help=argparse.SUPPRESS)


def int_at_least_2(text):
    v = positive_int(text)
    if v < 2:
        raise argparse.ArgumentTypeError(f"a job needs at least 2 ranks: {text!r}")
    return v


# ---- the command ---------------------------------------------------------------------------------
def run(args):
    """The launcher; or, as this command starts them itself, the rendezvous helper or one rank."""
    if args.rendezvous:
        return run_rendezvous(args)
    if args.worker:
        return run_worker(args)
    return run_launcher(args)


def fit_and_project(args, jobs, shapes):
    """The model of the run: each job's link efficiency fitted on its none point (set in the job),
    the predictions of the measured points, and the projection at nominal rates with the compute of
    one rank timed in this process."""
    if args.ranks_per_host > 1:  # this module's model has one link per rank: not these layouts
        for job in jobs:
            job["efficiency"] = None
        return dict(compute=None, compute_how=None, predictions=[], efficiency=None, projection=[])
    print("timing the compute of one rank in this process (for the projection) ...", flush=True)
    comp = local_compute(args, args.modes)
    for job in jobs:
        job["efficiency"] = fit_efficiency(job, shapes)
    preds = prediction_rows(jobs, shapes)
    efficiency = statistics.median(j["efficiency"] for j in jobs) if jobs else None
    rates = list(dict.fromkeys(list(args.rates) + list(PROJECT_RATES)))
    n_list = sorted(set(([] if jobs else list(args.np)) + [PROJECT_N]))
    return dict(compute=comp, compute_how=PROJECTION_COMPUTE_HOW, predictions=preds, efficiency=efficiency,
                projection=projection(args.modes, shapes, comp, rates, n_list, efficiency))


def layout_problem(args):
    """Why --np, --ranks-per-host and --modes do not go together, or None."""
    per_host = args.ranks_per_host
    uneven = [n for n in args.np if n % per_host or n == per_host]
    if uneven:
        return f"--np {' '.join(map(str, uneven))}: not 2 or more hosts of --ranks-per-host {per_host} ranks"
    hierarchical = [m for m in args.modes if m.endswith("-hierarchical")]
    if hierarchical and per_host == 1:
        return f"{', '.join(hierarchical)} needs --ranks-per-host 2 or more (hosts of several ranks)"
    if per_host > 1 and args.model_only:
        return "--model-only prices one link per rank; for hosts of several ranks: python -m benchmarks nodes"
    return None


def run_launcher(args):
    """Measure every rank count and rate (unless --model-only or no namespaces), then the model and
    the report; the exit status (130 if interrupted)."""
    problem = layout_problem(args)
    if problem:
        print(f"e2e: {problem}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    info = machine_info()
    shapes = param_shapes(args.width, args.depth, args.net)
    unavailable = unavailable_modes(args.modes)
    args.run_modes = [m for m in args.modes if m not in unavailable]
    print(f"machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable); "
          f"load average {info['load_avg_1min']:.2f}", flush=True)
    print(f"model: {describe(args, shapes)}; batch {args.batch} per rank", flush=True)
    for ln in unavailable_lines(unavailable):
        print(ln, flush=True)

    not_measured = "--model-only given" if args.model_only else netns.unavailable_reason()
    run = dict(jobs=[], failures=[], qdiscs={}, shaping={}, netns_error=None)
    t_all = time.perf_counter()
    if not not_measured:
        run = run_jobs(args, info)
        if run is None:
            return 130
        if not run["jobs"] and run["netns_error"]:
            not_measured = run["netns_error"]
    if not_measured:
        print(f"\nNO MEASUREMENT: {not_measured}. What follows is the cost model only, with compute timed "
              "in this one process.", flush=True)
    info["load_avg_1min_end"] = os.getloadavg()[0]
    run.update(unavailable=unavailable, not_measured=not_measured)
    return report(args, info, shapes, run, fit_and_project(args, run["jobs"], shapes), t_all)


if __name__ == "__main__":
    sys.exit(module_main("e2e", add_arguments, run))
