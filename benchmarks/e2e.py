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
"""
import argparse
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import time

from benchmarks.common import (job_env, machine_info, module_main, ms_quartiles,
                               nonnegative_int, positive_int)
from benchmarks.netns import parse_rate

DEFAULT_OUT = os.path.join("bench_out", "e2e")
DEFAULT_MODES = "none,fp16,qsgd4-allgather,qsgd4-scatter"
CLASSES = 10
PROJECT_N = 16
PROJECT_RATES = ("10gbit", "25gbit", "100gbit")
REDUCTION_OF = {"allgather": "allgather", "scatter": "scatter_allgather"}
_MODE = re.compile(r"^(none|fp16|qsgd([1-8])-(allgather|scatter))$")


# ---- arguments ---------------------------------------------------------------------------------
def _rates(text):
    rates = [r.strip().lower() for r in text.split(",") if r.strip()]
    try:
        for r in rates:
            parse_rate(r)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not rates:
        raise argparse.ArgumentTypeError(f"no rate given: {text!r}")
    return rates


def _modes(text):
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if not _MODE.match(m)]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"modes are none, fp16, qsgd<b>-allgather, qsgd<b>-scatter (b in 1..8), comma-separated: {text!r}")
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


# ---- modes and the model's view of them ----------------------------------------------------------
def mode_bits(mode):
    m = _MODE.match(mode)
    return int(m.group(2)) if m and m.group(2) else None


def mode_reduction(mode):
    """The reduction of a QSGD mode ("allgather" / "scatter_allgather"), None for none and fp16."""
    m = _MODE.match(mode)
    return REDUCTION_OF[m.group(3)] if m and m.group(3) else None


def mode_label(mode):
    if mode_bits(mode) is None:
        return mode
    return f"QSGD({mode_bits(mode)}) {mode_reduction(mode)}"


def unavailable_modes(modes):
    """{mode: why} for modes this installation cannot run."""
    from hvd_qsgd import settings as compressor

    out = {}
    for m in modes:
        red = mode_reduction(m)
        if red is not None and red not in compressor.REDUCTIONS:
            out[m] = (f"reduction {red!r} is not implemented by this hvd_qsgd "
                      f"(hvd_qsgd.settings.REDUCTIONS = {tuple(compressor.REDUCTIONS)})")
    return out


def param_shapes(width, depth):
    """(name, numel) of the MLP's parameters, in named_parameters() order."""
    shapes = []
    for i in range(depth):
        shapes += [(f"{2 * i}.weight", width * width), (f"{2 * i}.bias", width)]
    return shapes + [(f"{2 * depth}.weight", CLASSES * width), (f"{2 * depth}.bias", CLASSES)]


def qsgd_settings(bits):
    """(bucket_size, min_numel): the compressor's defaults for ``bits``."""
    from hvd_qsgd.settings import Settings, default_bucket_size

    return default_bucket_size(bits), Settings().min_numel


def exchanges(mode, n, shapes):
    """[(reduction, bytes per rank)] of one step: the collectives the cost model prices."""
    from hvd_qsgd import codec, protocol

    bits = mode_bits(mode)
    if bits is None:
        per = 4 if mode == "none" else 2
        return [("allreduce", per * d) for _, d in shapes]
    bucket, min_numel = qsgd_settings(bits)
    control = 8 * protocol.control_length(n)
    out = []
    for _, d in shapes:
        if d >= min_numel:
            out += [(mode_reduction(mode), codec.payload_nbytes(d, bits, bucket)), ("allreduce", control)]
        else:
            out.append(("allreduce", 4 * d))
    return out


def model_wire_bytes(mode, n, shapes):
    from hvd_qsgd import cost_model

    return sum(cost_model.received_bytes(r, n, b) for r, b in exchanges(mode, n, shapes))


def model_messages(mode, n, shapes):
    return sum((n - 1) if r == "allgather" else 2 * (n - 1) for r, _ in exchanges(mode, n, shapes))


def model_comm_seconds(mode, n, shapes, alpha, rate_bps):
    from hvd_qsgd import cost_model

    return sum(cost_model.seconds(r, n, b, alpha, rate_bps / 8) for r, b in exchanges(mode, n, shapes))


def compute_seconds(mode, n, comp):
    """compute(mode) from the measured parts (see the module docstring)."""
    t = comp["compute_s"]
    bits = mode_bits(mode)
    if mode == "fp16":
        return t + comp["cast_s"]
    if bits is None:
        return t
    enc, dec1 = comp["encode_s"][str(bits)], comp["decode1_s"][str(bits)]
    if mode_reduction(mode) == "allgather":
        return t + enc + n * dec1
    return t + enc * (1 + 1 / n) + 2 * dec1


# ---- codec timing (shared by the workers and --model-only) ---------------------------------------
def time_codec(grads, bits_list, copies, want_cast):
    """Seconds of encoding every gradient of >= min_numel elements with QSGD(b), of decoding one
    payload of each (decode_sum of ``copies`` payloads, / copies), and of casting every gradient to
    fp16 and back."""
    import numpy as np
    import torch
    from hvd_qsgd import codec

    out = dict(encode_s={}, decode1_s={})
    for bits in bits_list:
        bucket, min_numel = qsgd_settings(bits)
        enc = dec = 0.0
        for g in grads:
            if g.numel() < min_numel:
                continue
            x = g.detach().reshape(-1).numpy()
            t0 = time.perf_counter()
            p = codec.encode(x, bits, bucket, seed=1)
            t1 = time.perf_counter()
            codec.decode_sum([p] * copies, 1.0 / copies, out=np.empty(x.size, dtype=np.float32))
            t2 = time.perf_counter()
            enc += t1 - t0
            dec += (t2 - t1) / copies
        out["encode_s"][str(bits)] = enc
        out["decode1_s"][str(bits)] = dec
    if want_cast:
        t0 = time.perf_counter()
        for g in grads:
            g.to(torch.float16).to(torch.float32)
        out["cast_s"] = time.perf_counter() - t0
    else:
        out["cast_s"] = 0.0
    return out


def make_model(width, depth, seed):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, CLASSES))


# ---- worker (one rank, in its namespace) ---------------------------------------------------------
def run_worker(args):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import horovod
    import horovod.torch as hvd

    import hvd_qsgd
    from hvd_qsgd import codec
    from benchmarks.netns import read_counters
    from benchmarks.torch import _Counting, _param_digest

    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    modes = args.modes
    gen = torch.Generator().manual_seed(args.seed * 1000003 + rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randint(0, CLASSES, (args.batch,), generator=gen)

    runs = {}
    local = make_model(args.width, args.depth, args.seed)
    runs["compute"] = dict(model=local, opt=torch.optim.SGD(local.parameters(), lr=1e-3), comp=None)
    for mode in modes:
        model = make_model(args.width, args.depth, args.seed)
        if mode == "none":
            comp = _Counting(hvd.Compression.none)
        elif mode == "fp16":
            comp = _Counting(hvd.Compression.fp16)
        else:
            comp = hvd_qsgd.QSGD(mode_bits(mode), reduction=mode_reduction(mode), seed=args.seed,
                                 named_parameters=model.named_parameters())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                       named_parameters=model.named_parameters(), compression=comp)
        runs[mode] = dict(model=model, opt=opt, comp=comp)
    order = ["compute"] + modes
    bits_list = sorted({mode_bits(m) for m in modes if mode_bits(m) is not None})

    barrier_tensor = torch.zeros(1)

    def barrier():
        hvd.allreduce(barrier_tensor, name="e2e.barrier")

    def step(r):
        r["opt"].zero_grad()
        F.cross_entropy(r["model"](x), y).backward()
        r["opt"].step()

    def counters(name):
        comp = runs[name]["comp"]
        if comp is None:
            return {}
        if isinstance(comp, _Counting):
            return {"bytes_sent": comp.bytes}
        return {k: v for k, v in comp.stats.items() if k != "ratio"}

    s = args.steps
    times = np.zeros((s, len(order)))
    tx = np.zeros((s, len(order)), dtype=np.int64)
    rx = np.zeros((s, len(order)), dtype=np.int64)
    codec_rounds = []
    before = None
    for r in range(args.warmup + s):
        timed = r >= args.warmup
        if timed and before is None:
            before = {name: counters(name) for name in order}
        for j, name in enumerate(order):
            barrier()
            c0 = read_counters(args.iface)
            t0 = time.perf_counter()
            step(runs[name])
            dt = time.perf_counter() - t0
            barrier()
            c1 = read_counters(args.iface)
            if timed:
                i = r - args.warmup
                times[i, j] = dt
                tx[i, j], rx[i, j] = c1[0] - c0[0], c1[1] - c0[1]
        if timed:
            barrier()
            grads = [p.grad for p in runs["compute"]["model"].parameters()]
            codec_rounds.append(time_codec(grads, bits_list, n, "fp16" in modes))
    after = {name: counters(name) for name in order}

    tmax = hvd.allreduce(torch.from_numpy(times), op=hvd.Max, name="e2e.times").numpy()
    mine = dict(rank=rank, tx=tx.tolist(), rx=rx.tolist(), codec=codec_rounds,
                stats={name: {k: after[name][k] - before[name].get(k, 0) for k in after[name]} for name in order},
                digests={m: _param_digest(runs[m]["model"]) for m in modes})
    everyone = hvd.allgather_object(mine)
    if rank != 0:
        return 0

    def per_round_max(key, sub=None):
        vals = []
        for i in range(s):
            per_rank = [(e["codec"][i][key] if sub is None else e["codec"][i][key][sub]) for e in everyone]
            vals.append(max(per_rank))
        return statistics.median(vals)

    rows = []
    for j, name in enumerate(order):
        steps_max = tmax[:, j].tolist()
        tx_all = [[e["tx"][i][j] for i in range(s)] for e in everyone]
        rx_all = [[e["rx"][i][j] for i in range(s)] for e in everyone]
        row = dict(mode=name, step_s_max_over_ranks=steps_max, step_s_median=statistics.median(steps_max),
                   tx_bytes_per_rank_step=tx_all, rx_bytes_per_rank_step=rx_all,
                   tx_bytes_per_step=float(np.mean(tx_all)), rx_bytes_per_step=float(np.mean(rx_all)))
        if name != "compute":
            row["stats_per_step"] = {k: statistics.fmean(e["stats"][name][k] for e in everyone) / s
                                     for k in everyone[0]["stats"][name]}
            row["params_identical_across_ranks"] = len({e["digests"][name] for e in everyone}) == 1
        rows.append(row)
    comp = dict(compute_s=rows[0]["step_s_median"], cast_s=per_round_max("cast_s"),
                encode_s={str(b): per_round_max("encode_s", str(b)) for b in bits_list},
                decode1_s={str(b): per_round_max("decode1_s", str(b)) for b in bits_list},
                decode_copies=n)
    shapes = [(nm, p.numel()) for nm, p in local.named_parameters()]
    result = dict(np=n, rate=args.rate, numel=sum(d for _, d in shapes), parameters=shapes, rows=rows,
                  compute=comp, torch=torch.__version__, horovod=horovod.__version__,
                  torch_threads=torch.get_num_threads(), codec_threads=codec.get_num_threads())
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


# ---- rendezvous helper (in the switch namespace) -------------------------------------------------
def run_rendezvous(args):
    """Horovod's Gloo rendezvous server for the hosts ``name:1,name:1,...``; prints its port and
    serves until its standard input closes (the launcher ends or closes it)."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    hosts = parse_hosts(args.rendezvous)
    plan = get_host_assignments(hosts, len(hosts))
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    print(f"port {port}", flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()
    return 0


# ---- launcher --------------------------------------------------------------------------------------
class JobFailed(RuntimeError):
    pass


_children = []  # Popen objects of the running job (killed on any way out)


def _kill_children():
    for proc in _children:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    _children.clear()


def _tail(path, chars=3000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return "(no output)"


def _worker_argv(args, json_path):
    return ["-m", "benchmarks.e2e", "--worker", "--json", json_path, "--modes", ",".join(args.run_modes),
            "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed)]


def run_job(topo, rate, args, json_path, log_dir):
    """One job of topo.n ranks at ``rate`` (the links already shaped); raises JobFailed."""
    from benchmarks.netns import IFACE, IP

    n = topo.n
    deadline = time.monotonic() + args.timeout
    env = job_env()
    tag = f"np{n}_{rate}"
    try:
        hosts = ",".join(f"{ns}:1" for ns in topo.ranks)
        rdv_log = os.path.join(log_dir, f"{tag}_rendezvous.log")
        with open(rdv_log, "w") as err:
            rdv = subprocess.Popen([IP, "netns", "exec", topo.switch, sys.executable, "-m", "benchmarks.e2e",
                                    "--rendezvous", hosts], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=err, text=True, start_new_session=True)
        _children.append(rdv)
        ready, _, _ = select.select([rdv.stdout], [], [], 60)
        line = rdv.stdout.readline() if ready else ""
        if not line.startswith("port "):
            raise JobFailed(f"the rendezvous server did not start: {line!r}\n{_tail(rdv_log)}")
        port = int(line.split()[1])
        logs = []
        for i, ns in enumerate(topo.ranks):
            wenv = dict(env, HOROVOD_GLOO_RENDEZVOUS_ADDR=topo.switch_address, HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
                        HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE=IFACE,
                        HOROVOD_GLOO_TIMEOUT_SECONDS="120", HOROVOD_HOSTNAME=ns, HOROVOD_RANK=str(i),
                        HOROVOD_SIZE=str(n), HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="1",
                        HOROVOD_CROSS_RANK=str(i), HOROVOD_CROSS_SIZE=str(n))
            log = os.path.join(log_dir, f"{tag}_rank{i}.log")
            logs.append(log)
            with open(log, "w") as out:
                proc = subprocess.Popen([IP, "netns", "exec", ns, sys.executable] + _worker_argv(args, json_path)
                                        + ["--rate", rate], env=wenv, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            _children.append(proc)
        workers = _children[1:]
        while True:
            codes = [w.poll() for w in workers]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i = failed[0]
                time.sleep(1)  # let the others report what they saw
                others = "".join(f"\n--- rank {k} (exit status {workers[k].poll()}) ---\n{_tail(logs[k], 800)}"
                                 for k in range(n) if k != i)
                raise JobFailed(f"rank {i} exited with status {codes[i]}:\n{_tail(logs[i])}{others}")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise JobFailed(f"the job did not finish in {args.timeout}s; every rank was killed\n" +
                                "".join(f"\n--- rank {k} ---\n{_tail(logs[k], 1500)}" for k in range(n)))
            time.sleep(0.2)
    finally:
        _kill_children()
    try:
        with open(json_path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise JobFailed(f"every rank exited with status 0 but rank 0's results are unreadable: {e}\n"
                        f"{_tail(logs[0])}") from None


# ---- compute timed in this process (--model-only, or no namespaces) -------------------------------
def local_compute(args, modes):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model = make_model(args.width, args.depth, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randint(0, CLASSES, (args.batch,), generator=gen)
    bits_list = sorted({mode_bits(m) for m in modes if mode_bits(m) is not None})
    steps, codec_rounds = [], []
    for r in range(max(1, args.warmup) + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if r >= max(1, args.warmup):
            steps.append(time.perf_counter() - t0)
            codec_rounds.append(time_codec([p.grad for p in model.parameters()], bits_list, 2, "fp16" in modes))
    med = lambda key, sub=None: statistics.median(c[key] if sub is None else c[key][sub] for c in codec_rounds)
    return dict(compute_s=statistics.median(steps), cast_s=med("cast_s"),
                encode_s={str(b): med("encode_s", str(b)) for b in bits_list},
                decode1_s={str(b): med("decode1_s", str(b)) for b in bits_list}, decode_copies=2)


# ---- model: fit, predictions, projection ----------------------------------------------------------
def fit_efficiency(job, shapes):
    """The link efficiency e of a job, from its none point (see the module docstring), in (0, 1]."""
    from hvd_qsgd import cost_model

    n, rate_bps = job["np"], parse_rate(job["rate"])
    measured = next(r["step_s_median"] for r in job["rows"] if r["mode"] == "none")
    transfer = model_comm_seconds("none", n, shapes, 0.0, rate_bps)
    rest = (measured - compute_seconds("none", n, job["compute"])
            - model_messages("none", n, shapes) * cost_model.LATENCY_S)
    return 1.0 if rest <= transfer else transfer / rest


def predict(mode, n, rate_bps, shapes, comp, efficiency=1.0):
    """compute(mode) + the cost model's communication at beta = efficiency * rate / 8 and its default
    latency; seconds."""
    from hvd_qsgd import cost_model

    c = compute_seconds(mode, n, comp)
    comm = model_comm_seconds(mode, n, shapes, cost_model.LATENCY_S, efficiency * rate_bps)
    return dict(compute_s=c, comm_s=comm, step_s=c + comm)


def projection(modes, shapes, comp, rates, n_list, efficiency=None):
    """Predicted steps at every (n, rate) at the nominal rates, and the speedups at ``efficiency``."""
    rows = []
    for n in n_list:
        for rate in rates:
            bps = parse_rate(rate)
            preds = {m: predict(m, n, bps, shapes, comp) for m in modes}
            for m in modes:
                row = dict(np=n, rate=rate, mode=m, wire_bytes=model_wire_bytes(m, n, shapes),
                           speedup=preds["none"]["step_s"] / preds[m]["step_s"], **preds[m])
                if efficiency is not None:
                    eff = {k: predict(k, n, bps, shapes, comp, efficiency)["step_s"] for k in ("none", m)}
                    row["speedup_at_efficiency"] = eff["none"] / eff[m]
                rows.append(row)
    return rows


# ---- output ----------------------------------------------------------------------------------------
def _mb(b):
    return f"{b / 1e6:.2f}"


def _ms(s):
    return f"{1e3 * s:.0f}" if s >= 0.1 else f"{1e3 * s:.1f}"


MEASURED_HEADER = ("| ranks | link | mode | step ms: median [quartiles] | speedup vs none | tx MB/rank/step | "
                   "rx MB/rank/step | model MB/rank/step | counted rx / model | compressor MB sent / recv |")


def measured_lines(jobs, shapes):
    lines = [MEASURED_HEADER, "|" + "---|" * 10]
    for job in jobs:
        n, rate = job["np"], job["rate"]
        rows = {r["mode"]: r for r in job["rows"]}
        none = rows["none"]["step_s_median"]
        for r in job["rows"]:
            m = r["mode"]
            sp = f"{none / r['step_s_median']:.2f}x"
            if m == "compute":
                lines.append(f"| {n} | {rate} | compute only (no exchange) | {ms_quartiles(r['step_s_max_over_ranks'])} | "
                             f"({sp}: the bound) | {_mb(r['tx_bytes_per_step'])} | {_mb(r['rx_bytes_per_step'])} | "
                             "0 | - | - |")
                continue
            model = model_wire_bytes(m, n, shapes)
            st = r["stats_per_step"]
            comp = (f"{_mb(st['bytes_sent'])} / {_mb(st['bytes_received'])}" if "bytes_received" in st
                    else f"{_mb(st['bytes_sent'])} / -")
            lines.append(f"| {n} | {rate} | {mode_label(m)} | {ms_quartiles(r['step_s_max_over_ranks'])} | {sp} | "
                         f"{_mb(r['tx_bytes_per_step'])} | {_mb(r['rx_bytes_per_step'])} | {_mb(model)} | "
                         f"{r['rx_bytes_per_step'] / model:.3f} | {comp} |")
    return lines


def unavailable_lines(unavailable):
    return [f"{mode_label(m)}: not measured: {why}" for m, why in unavailable.items()]


def prediction_rows(jobs, shapes):
    rows = []
    for job in jobs:
        for r in job["rows"]:
            if r["mode"] != "compute":
                p = predict(r["mode"], job["np"], parse_rate(job["rate"]), shapes, job["compute"], job["efficiency"])
                rows.append(dict(np=job["np"], rate=job["rate"], mode=r["mode"], efficiency=job["efficiency"],
                                 measured_s=r["step_s_median"], ratio=r["step_s_median"] / p["step_s"],
                                 model_wire_bytes=model_wire_bytes(r["mode"], job["np"], shapes), **p))
    return rows


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
                     f"{_ms(r['step_s'])} | {r['speedup']:.2f}x |{at_e} {_mb(r['wire_bytes'])} |")
    return lines


def plot(path, jobs, proj_rows, modes, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if jobs else 1
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
                      (axes[1], "counted rx MB / rank / step (veth)")):
            ax.set_xticks(range(len(modes)), [mode_label(m).replace(" ", "\n") for m in modes], fontsize=8)
            ax.set_title(t, fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8)
    ax = axes[-1]
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
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(args):
    if args.rendezvous:
        return run_rendezvous(args)
    if args.worker:
        return run_worker(args)

    from hvd_qsgd import cost_model
    from benchmarks import netns

    os.makedirs(args.out, exist_ok=True)
    info = machine_info()
    shapes = param_shapes(args.width, args.depth)
    numel = sum(d for _, d in shapes)
    unavailable = unavailable_modes(args.modes)
    args.run_modes = [m for m in args.modes if m not in unavailable]
    print(f"machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable); "
          f"load average {info['load_avg_1min']:.2f}", flush=True)
    print(f"model: MLP {args.depth} x Linear({args.width}, {args.width}) + Linear({args.width}, {CLASSES}), "
          f"{numel:,} parameters ({_mb(4 * numel)} MB fp32); batch {args.batch} per rank", flush=True)
    for ln in unavailable_lines(unavailable):
        print(ln, flush=True)

    not_measured = "--model-only given" if args.model_only else netns.unavailable_reason()
    jobs, failures, qdiscs, shaping, netns_error = [], [], {}, {}, None
    t_all = time.perf_counter()
    if not not_measured:
        old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        log_dir = os.path.join(os.path.abspath(args.out), "logs")
        os.makedirs(log_dir, exist_ok=True)
        try:
            stale = netns.remove_stale()
            if stale:
                print(f"removed stale namespaces of earlier runs: {' '.join(stale)}", flush=True)
            for n in args.np:
                topo = netns.Topology(n)
                try:
                    try:
                        topo.create()
                    except netns.NetnsError as e:
                        netns_error = f"the network namespaces could not be made: {e}"
                        failures.append(f"np{n}")
                        print(f"{n} ranks: {netns_error}", flush=True)
                        continue
                    for rate in args.rates:
                        shaping[rate] = topo.shape(rate)
                        qdiscs[f"np{n}_{rate}"] = topo.qdiscs()
                        json_path = os.path.join(os.path.abspath(args.out), f"raw_np{n}_{rate}.json")
                        if os.path.exists(json_path):
                            os.remove(json_path)
                        print(f"running {n} ranks at {rate} (namespaces {topo.prefix}*, Gloo) ...", flush=True)
                        t0 = time.perf_counter()
                        try:
                            job = run_job(topo, rate, args, json_path, log_dir)
                        except JobFailed as e:
                            failures.append(f"np{n}_{rate}")
                            print(f"{n} ranks at {rate} FAILED after {time.perf_counter() - t0:.0f}s: {e}", flush=True)
                            continue
                        job.update(wall_s=time.perf_counter() - t0, oversubscribed=n > info["usable_cores"])
                        jobs.append(job)
                        print(f"  done in {job['wall_s']:.0f}s", flush=True)
                finally:
                    _kill_children()
                    left = topo.destroy()
                    if left:
                        print(f"warning: could not delete namespaces {' '.join(left)}", flush=True)
        except KeyboardInterrupt as e:
            print(f"\ninterrupted ({e or 'SIGINT'}): every rank was killed and the namespaces deleted", flush=True)
            return 130
        finally:
            _kill_children()
            for s, h in old.items():
                signal.signal(s, h)
        if not jobs and netns_error:
            not_measured = netns_error
    if not_measured:
        print(f"\nNO MEASUREMENT: {not_measured}. What follows is the cost model only, with compute timed "
              "in this one process.", flush=True)
    info["load_avg_1min_end"] = os.getloadavg()[0]

    # the model: the link efficiency of each job fitted on its none point; the projection at nominal rates
    print("timing the compute of one rank in this process (for the projection) ...", flush=True)
    proj_comp = local_compute(args, args.modes)
    proj_comp_how = ("timed in this one process after the jobs (1 thread, no other rank computing: one rank "
                     "per core, as on a cluster)")
    for job in jobs:
        job["efficiency"] = fit_efficiency(job, shapes)
    preds = prediction_rows(jobs, shapes)
    efficiency = statistics.median(j["efficiency"] for j in jobs) if jobs else None
    proj_rates = list(dict.fromkeys(list(args.rates) + list(PROJECT_RATES)))
    proj_n = sorted(set(([] if jobs else list(args.np)) + [PROJECT_N]))
    proj = projection(args.modes, shapes, proj_comp, proj_rates, proj_n, efficiency)

    out_lines = []
    if jobs:
        out_lines += ["## Measured (network namespaces, tbf-shaped veth links, Horovod Gloo)", ""]
        out_lines += measured_lines(jobs, shapes) + [""]
    out_lines += [f"- {ln}" for ln in unavailable_lines(unavailable)]
    if not_measured:
        out_lines += [f"- NO MEASUREMENT: {not_measured}; everything below is the cost model (labelled model)"]
    out_lines.append("")
    if jobs:
        out_lines += ["## Model vs measured (hvd_qsgd.cost_model; beta = e * link rate / 8 with e fitted on the "
                      f"none row; alpha {1e6 * cost_model.LATENCY_S:.0f} us; compute measured in the job)", ""]
        out_lines += prediction_lines(preds) + [""]
    out_lines += [f"## MODEL projection (hvd_qsgd.cost_model: nominal link rate, alpha "
                  f"{1e6 * cost_model.LATENCY_S:.0f} us; compute of one rank on one core of this machine)", ""]
    out_lines += projection_lines(proj, unavailable, efficiency) + [""]

    def comp_text(c):
        return (f"compute step {_ms(c['compute_s'])} ms"
                + "".join(f", QSGD({b}) encode E {_ms(c['encode_s'][b])} ms, decode of one payload of each tensor "
                          f"D1 {_ms(c['decode1_s'][b])} ms" for b in c["encode_s"])
                + (f", fp16 casts {_ms(c['cast_s'])} ms" if "fp16" in args.modes else ""))

    notes = [f"model: MLP {args.depth} x Linear({args.width}, {args.width}) + Linear({args.width}, {CLASSES}), "
             f"{numel:,} parameters ({_mb(4 * numel)} MB fp32 per gradient step); batch {args.batch} per rank, "
             "synthetic; SGD"]
    if jobs:
        notes += [f"{args.warmup} warm-up + {args.steps} timed rounds, modes interleaved step by step; each rank "
                  "times zero_grad+forward+backward+step after a barrier; a step is the max over ranks; median "
                  "[quartiles] over timed steps; speedup = median(none) / median(mode)",
                  "tx/rx: counted on each rank's veth0 (tx_bytes/rx_bytes, barrier to barrier around each step), "
                  "mean over ranks and steps: headers, Gloo framing, Horovod's coordination and QSGD's control "
                  "vectors included; the compute row is that background alone",
                  "model MB: what the cost model says a rank receives (ring allreduce 2(n-1)/n S, allgather (n-1) P, "
                  "scatter_allgather 2(n-1)/n P); compressor MB: QSGD stats bytes_sent / bytes_received per step, "
                  "or the bytes none / fp16 hand to the collective",
                  "compute in the job (model vs measured): " + "; ".join(
                      f"n={j['np']} {j['rate']}: {comp_text(j['compute'])}" for j in jobs)
                  + " (every rank at once, median over rounds of the max over ranks)"]
    notes += [f"alpha: {1e6 * cost_model.LATENCY_S:.0f} us (the cost model's default), not fitted; "
              + ("e: the link efficiency, beta = e * rate / 8, fitted per job on its none point alone: "
                 "e = (bytes / (rate/8)) / (measured - compute - messages * alpha), at most 1; the fp16 and QSGD "
                 "rows are predictions; the projection's last speedup column uses the median e"
                 if jobs else "beta: the nominal link rate / 8"),
              f"compute for the projection: {proj_comp_how}: {comp_text(proj_comp)}; compute(mode) = compute + "
              "E + n D1 (allgather), E (1+1/n) + 2 D1 (scatter_allgather), the casts (fp16); compute and "
              "communication are added (no overlap)",
              "fp16: the model prices only its bytes; Horovod's Gloo CPU path also sums float16 more slowly than "
              "float32, which the measurement includes and the model does not"]
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
    bad = [f"np{j['np']} {j['rate']} {r['mode']}" for j in jobs for r in j["rows"]
           if r["mode"] != "compute" and not r["params_identical_across_ranks"]]
    if bad:
        notes.append("CHECK FAILED: parameters differ across ranks: " + ", ".join(bad))
    elif jobs:
        notes.append("checked: after the run every mode's parameters are identical on every rank")
    out_lines += [f"- {ln}" for ln in notes]
    text = "\n".join(out_lines)
    print("\n" + text, flush=True)

    total = time.perf_counter() - t_all
    config = {k: getattr(args, k) for k in ("np", "rates", "modes", "width", "depth", "batch", "steps", "warmup",
                                            "seed", "timeout", "model_only")}
    definitions = dict(
        step_s_median="median over timed steps of the max over ranks of one rank's step time (after a barrier)",
        tx_bytes_per_step="bytes counted on a rank's veth0 tx_bytes between the barriers around a step, mean over "
                          "ranks and timed steps (rx likewise); per rank and step in *_per_rank_step",
        stats_per_step="the compressor's own count per step, mean over ranks: QSGD stats (payload bytes); none / "
                       "fp16: bytes handed to the collective",
        model_wire_bytes="cost_model.received_bytes summed over the step's exchanges",
        efficiency="e with beta = e * rate / 8, fitted per job on its none point (alpha = cost_model.LATENCY_S)",
        compute="in-job compute parts: compute_s (the compute step), encode_s, decode1_s, cast_s; median over "
                "rounds of the max over ranks",
        projection="cost model at the nominal rate and default alpha, compute_for_projection; speedup_at_efficiency "
                   "at beta = efficiency_median * rate / 8")
    results = dict(machine=info, config=config, definitions=definitions, numel=numel, parameters=shapes, measured=bool(jobs),
                   not_measured_reason=not_measured, unavailable_modes=unavailable, failed_jobs=failures,
                   shaping=shaping, qdiscs=qdiscs, jobs=jobs, alpha_s=cost_model.LATENCY_S,
                   efficiency_median=efficiency, compute_for_projection=proj_comp,
                   compute_for_projection_how=proj_comp_how, projection=proj, predictions=preds,
                   checks_ok=not bad, notes=notes, total_wall_s=total)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    title = (f"hvd_qsgd e2e: MLP {numel:,} params, Horovod Gloo over tbf-shaped veth links"
             if jobs else f"hvd_qsgd e2e: MODEL ONLY (nothing measured), MLP {numel:,} params")
    plot(os.path.join(args.out, "plot.png"), jobs, proj, args.modes, title)
    print(f"\nwrote {os.path.join(args.out, 'results.json')}, table.md, plot.png ({total:.0f}s in all)")
    return 1 if failures or bad else 0


if __name__ == "__main__":
    sys.exit(module_main("e2e", add_arguments, run))
