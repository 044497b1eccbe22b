"""``python -m benchmarks calibrate``: measure the per-message latency alpha and the bandwidth beta
that ``hvd_qsgd.cost_model`` assumes, by timing Horovod's own collectives and fitting the model's
form to the times.

The model. On n ranks a collective costs ``T = m alpha + b / beta``, with m the messages a rank
waits for in turn and b the bytes a rank receives, for a message of S bytes per rank:

    allreduce (fp32 ring)       m = 2 (n-1)   b = 2 (n-1)/n S
    allgather (uint8)           m =   (n-1)   b =   (n-1)   S
    alltoall (uint8)            m =   (n-1)   b =   (n-1)/n S
    scatter_allgather           m = 2 (n-1)   b = 2 (n-1)/n S
        (alltoall of S bytes, then allgather of S/n bytes: what reduction="scatter_allgather" moves)

(``MODEL``; the allreduce, allgather and scatter_allgather rows are those of ``cost_model.seconds``).

What runs. For each rank count n of ``--np`` one Horovod job: by default ``horovodrun -np n -H
localhost:n --gloo`` (the ranks talk over loopback; rank 0 prints its results into the job's
output); with ``--hosts H``, ``-H H`` instead (horovodrun's ssh launch: one rank per host measures
the real network); with ``--rate R`` (root, ``ip``, ``tc``) the ranks run on this machine in
network namespaces joined by a switch with every link shaped to R, the topology of ``python -m
benchmarks e2e`` (``benchmarks.netns``, started by ``benchmarks.e2e_launch``'s rendezvous helper).
Every rank allocates, for each size S of ``--sizes`` (rounded down to a multiple
of 4n bytes so that fp32 and n-way splits are whole), an fp32 tensor of S bytes (allreduce, op=Sum)
and uint8 tensors of S and S/n bytes (allgather, alltoall). Then ``--warmup`` untimed rounds and
``--reps`` timed rounds; a round runs every collective at every size, each one preceded by
``hvd.barrier()`` and timed on every rank with ``time.perf_counter`` from its start until it has
completed (``hvd.synchronize``). A
repetition's time is the maximum over ranks (the collective is done when its last rank is), and a
point's time the median over repetitions (``--stat min``: the minimum). Every op keeps one name
across repetitions, so Horovod's response cache serves it as in a training loop.

In flight (``--inflight K``, default 1). A timed operation is K tensors of S bytes, each with a
name of its own, started at once with the ``*_async`` calls and then all waited for (for
scatter_allgather: K alltoalls, then K allgathers), as a training step's gradients are; the time
recorded is the operation's divided by K. With K = 1 every operation pays Horovod's whole fixed
cost (a background-thread cycle, ``HOROVOD_CYCLE_TIME``, and the negotiation); with K > 1 the K
tensors share one cycle, and what is left per tensor is the cost a tensor adds to a busy step.

The fit (``fit``, a pure function). For each (n, collective), weighted least squares of the points'
(m, b) -> time against ``t = m alpha + b x`` with x = 1/beta, each point weighted by 1/t so that
the residuals are relative (a sweep over 1 KB .. 64 MB spans four decades of time; unweighted, the
largest sizes alone would set alpha); the coefficients are kept >= 0 (exact non-negative least
squares over the few columns). Also fitted: ``joint``, every collective's points of one n together
(the single (alpha, beta) the cost model uses for all of them); and with several n, every
collective (and ``joint``) over all n, once in the model's form and once with a third term, a fixed
overhead per Horovod operation, ``t = k overhead + m alpha + b x`` (k = 2 for scatter_allgather's two
operations, else 1), which tells Horovod's per-operation cost (background-thread cycle, negotiation)
apart from a per-message latency: at one n the two are confounded, the model-form alpha being
``alpha + k overhead / m``. Reported: alpha (us per message), beta (Gbit/s), m alpha at that n (the
latency of one operation), the overhead per op, and the residuals' RMS and maximum (relative).

The crossover. ``reduction="auto"`` picks scatter_allgather for a payload P > alpha beta n/(n-2)
(n >= 3). Printed for each n >= 3: that size with the ``joint`` fit's alpha and beta; where the
fitted allgather and scatter_allgather lines cross; the smallest swept size from which the
measured scatter_allgather is faster than the measured allgather at every larger swept size; and
the library's default (``cost_model.LATENCY_S``, ``cost_model.BANDWIDTH_BPS``).

Outputs: the table (markdown) on stdout, and with ``--json PATH`` every point, fit and crossover.
"""
import argparse
import json
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import time

from benchmarks.common import REPO_ROOT, horovodrun, job_env, launch_job, machine_info, nonnegative_int, positive_int

COLLECTIVES = ("allreduce", "allgather", "alltoall", "scatter_allgather")
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"
RESULT_MARK = "HVD_QSGD_CALIBRATE_RESULT "
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


# ---- the model and the fit (pure) -------------------------------------------------------------------
def model_terms(collective, n, size):
    """(messages, bytes received) of one rank for ``collective`` on n ranks with S = ``size`` bytes
    per rank (see the module docstring)."""
    if collective == "allreduce" or collective == "scatter_allgather":
        return 2 * (n - 1), 2 * (n - 1) / n * size
    if collective == "allgather":
        return n - 1, (n - 1) * size
    if collective == "alltoall":
        return n - 1, (n - 1) / n * size
    raise ValueError(f"unknown collective {collective!r}")


def model_ops(collective):
    """Horovod operations a collective takes: 2 for scatter_allgather (alltoall, then allgather), else 1."""
    return 2 if collective == "scatter_allgather" else 1


def _nnls(a, y):
    """min ||a x - y|| over x >= 0, for a few columns: the least-squares solution on every subset of
    the columns (the rest 0), the best one whose coefficients are all >= 0 (an exact NNLS)."""
    import itertools

    import numpy as np

    k = a.shape[1]
    best = (np.inf, np.zeros(k))
    for r in range(k, 0, -1):
        for cols in itertools.combinations(range(k), r):
            sub = a[:, cols]
            if np.linalg.matrix_rank(sub) < r:
                continue
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            x = np.zeros(k)
            x[list(cols)] = coef
            res = float(np.sum((a @ x - y) ** 2))
            if res < best[0] * (1 - 1e-12):
                best = (res, x)
    return best[1]


def fit(messages, nbytes, seconds, weighting="relative", ops=None):
    """Least-squares fit of ``seconds[i] ~ messages[i] alpha + nbytes[i] / beta`` (the cost model's
    form), or with ``ops`` of ``seconds[i] ~ ops[i] overhead + messages[i] alpha + nbytes[i] / beta``
    (a fixed cost per Horovod operation besides the per-message one; it needs points of several n).

    weighting: "relative" (each point weighted by 1/seconds[i]: minimises the relative residuals) or
    "absolute". Every coefficient is kept >= 0 (an exact non-negative least squares). Returns a dict:
    alpha_s, beta_Bps (inf where the times show no bandwidth term), inv_beta_s_per_B, overhead_s
    (None without ``ops``), rms_rel_residual and max_rel_residual (of (model - measured) / measured),
    points, clamped (the names of the coefficients held at 0, comma-separated, or None).
    """
    import numpy as np

    m = np.asarray(messages, dtype=np.float64)
    b = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    cols, names = [m, b], ["alpha", "inv_beta"]
    if ops is not None:
        cols, names = [np.asarray(ops, dtype=np.float64)] + cols, ["overhead"] + names
    if not (all(c.shape == t.shape for c in cols) and t.ndim == 1):
        raise ValueError("messages, nbytes, seconds (and ops) must be 1-D sequences of one length")
    if len(t) < len(cols) or np.any(t <= 0) or any(np.any(c < 0) for c in cols):
        raise ValueError(f"the fit needs at least {len(cols)} points with positive times and non-negative terms")
    if weighting == "relative":
        w = 1.0 / t
    elif weighting == "absolute":
        w = np.ones_like(t)
    else:
        raise ValueError(f"unknown weighting {weighting!r}")
    a = np.stack(cols, axis=1) * w[:, None]
    if np.linalg.matrix_rank(a) < len(cols):
        raise ValueError("the points do not separate the terms (" + ", ".join(names) + "): latency from "
                         "bandwidth needs two distinct byte counts per message count, a per-op overhead from "
                         "a per-message latency two rank counts")
    x = _nnls(a, t * w)
    coef = dict(zip(names, x))
    clamped = [nm for nm, v in coef.items() if v == 0.0]
    pred = np.stack(cols, axis=1) @ x
    rel = (pred - t) / t
    inv_beta = float(coef["inv_beta"])
    return dict(alpha_s=float(coef["alpha"]), beta_Bps=(1.0 / inv_beta) if inv_beta > 0 else math.inf,
                inv_beta_s_per_B=inv_beta, overhead_s=float(coef["overhead"]) if ops is not None else None,
                rms_rel_residual=float(np.sqrt(np.mean(rel ** 2))), max_rel_residual=float(np.max(np.abs(rel))),
                points=int(len(t)), clamped=",".join(clamped) or None)


def crossover_bytes(alpha, beta, n):
    """The payload above which ``reduction="auto"`` picks scatter_allgather: alpha beta n/(n-2);
    None for n < 3 (never) or an infinite beta."""
    if n < 3 or not math.isfinite(beta):
        return None
    return alpha * beta * n / (n - 2)


def lines_crossover(fit_ag, fit_sa, n):
    """Where the fitted allgather and scatter_allgather lines cross (each with its own alpha and
    beta): the payload P from which scatter_allgather is faster, 0.0 if it always is, None if never."""
    m_ag, _ = model_terms("allgather", n, 0)
    m_sa, _ = model_terms("scatter_allgather", n, 0)
    c_ag, c_sa = model_terms("allgather", n, 1)[1], model_terms("scatter_allgather", n, 1)[1]
    lat = m_sa * fit_sa["alpha_s"] - m_ag * fit_ag["alpha_s"]              # extra fixed cost of sa
    slope = c_ag * fit_ag["inv_beta_s_per_B"] - c_sa * fit_sa["inv_beta_s_per_B"]  # its saving per byte
    if slope <= 0:
        return 0.0 if lat < 0 else None
    return max(0.0, lat / slope)


def measured_crossover(sizes, t_ag, t_sa):
    """The smallest swept size from which the measured scatter_allgather is faster than the measured
    allgather at that and every larger size; None if it is not faster at the largest."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    found = None
    for i in reversed(order):
        if t_sa[i] < t_ag[i]:
            found = sizes[i]
        else:
            break
    return found


def _fit_points(ps, stat, with_ops=False):
    return fit([p["messages"] for p in ps], [p["bytes_received"] for p in ps], [p[f"{stat}_s"] for p in ps],
               ops=[model_ops(p["collective"]) for p in ps] if with_ops else None)


def analyse(jobs, stat="median"):
    """Fits and crossovers of the jobs' points (``run_worker``'s JSON, one job per n).

    fits: for every n, every collective and ``joint`` (all of them); with several n also every
    collective and ``joint`` over all n (n = "all"), in the model's form and with a per-op overhead
    (``per_op`` True). crossovers: for every n >= 3 (see the module docstring)."""
    from hvd_qsgd import cost_model

    fits, crossovers = [], []
    pooled = {}
    for job in jobs:
        n = job["n"]
        pts = job["points"]
        groups = {c: [p for p in pts if p["collective"] == c] for c in job["collectives"]}
        groups["joint"] = pts
        job_fits = {}
        for coll, ps in groups.items():
            f = _fit_points(ps, stat)
            m = model_terms(coll, n, 0)[0] if coll != "joint" else None
            f.update(n=n, collective=coll, per_op=False, m_alpha_s=(m * f["alpha_s"]) if m is not None else None)
            job_fits[coll] = f
            fits.append(f)
            pooled.setdefault(coll, []).extend(ps)
        if n >= 3 and "allgather" in groups and "scatter_allgather" in groups:
            ag = sorted(groups["allgather"], key=lambda p: p["bytes"])
            sa = sorted(groups["scatter_allgather"], key=lambda p: p["bytes"])
            j = job_fits["joint"]
            crossovers.append(dict(
                n=n, joint_fit_bytes=crossover_bytes(j["alpha_s"], j["beta_Bps"], n),
                fitted_lines_bytes=lines_crossover(job_fits["allgather"], job_fits["scatter_allgather"], n),
                measured_bytes=measured_crossover([p["bytes"] for p in ag], [p[f"{stat}_s"] for p in ag],
                                                  [p[f"{stat}_s"] for p in sa]),
                default_bytes=crossover_bytes(cost_model.LATENCY_S, cost_model.BANDWIDTH_BPS, n)))
    if len({job["n"] for job in jobs}) > 1:
        for with_ops in (False, True):
            for coll, ps in pooled.items():
                f = _fit_points(ps, stat, with_ops)
                f.update(n="all", collective=coll, per_op=with_ops, m_alpha_s=None)
                fits.append(f)
    return fits, crossovers


# ---- formatting ----------------------------------------------------------------------------------------
def parse_size(text):
    """'1K', '64M', '4096', '1.5MB' -> bytes (binary units: K = 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size (e.g. 4096, 1K, 64M): {text!r}")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size must be at least 1 byte: {text!r}")
    return value


def sizes_arg(text):
    sizes = [parse_size(s) for s in text.split(",") if s.strip()]
    if len(set(sizes)) < 2:
        raise argparse.ArgumentTypeError("give at least two distinct sizes (the fit has two parameters)")
    return sorted(set(sizes))


def collectives_arg(text):
    colls = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in colls if c not in COLLECTIVES]
    if not colls or bad:
        raise argparse.ArgumentTypeError(f"collectives are among {','.join(COLLECTIVES)}: {text!r}")
    return colls


def human_bytes(v):
    if v is None:
        return "never"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.3g} B"


def job_bytes(size, n):
    """The bytes actually moved for a requested size on n ranks: a multiple of 4n, at least 4n."""
    q = 4 * n
    return max(q, size // q * q)


def table(fits, crossovers):
    lines = ["| n | collective | alpha (us per message) | beta (Gbit/s) | m·alpha at this n (us) "
             "| overhead per op (us) | RMS residual | max residual | points |",
             "|---|---|---|---|---|---|---|---|---|"]
    for f in fits:
        beta = f"{f['beta_Bps'] * 8 / 1e9:.3g}" if math.isfinite(f["beta_Bps"]) else "inf"
        m_alpha = f"{f['m_alpha_s'] * 1e6:.0f}" if f.get("m_alpha_s") is not None else ""
        overhead = f"{f['overhead_s'] * 1e6:.0f}" if f.get("overhead_s") is not None else ""
        clamp = f" ({f['clamped']} held at 0)" if f["clamped"] else ""
        n = f"{f['n']} (+ op)" if f.get("per_op") else f["n"]
        lines.append(f"| {n} | {f['collective']}{clamp} | {f['alpha_s'] * 1e6:.1f} | {beta} | {m_alpha} | "
                     f"{overhead} | {100 * f['rms_rel_residual']:.1f}% | {100 * f['max_rel_residual']:.1f}% | "
                     f"{f['points']} |")
    if crossovers:
        lines += ["", "reduction=\"auto\" crossover payload (scatter_allgather above it):", "",
                  "| n | alpha·beta·n/(n-2), joint fit | fitted allgather = fitted scatter_allgather "
                  "| measured | library default (50 us, 10 Gbit/s) |", "|---|---|---|---|---|"]
        for c in crossovers:
            lines.append(f"| {c['n']} | {human_bytes(c['joint_fit_bytes'])} | {human_bytes(c['fitted_lines_bytes'])} | "
                         f"{human_bytes(c['measured_bytes'])} | {human_bytes(c['default_bytes'])} |")
    return "\n".join(lines)


def points_table(jobs, stat):
    lines = ["| n | collective | bytes/rank | " + stat + " (ms) | min (ms) | max (ms) |", "|---|---|---|---|---|---|"]
    for job in jobs:
        for p in job["points"]:
            lines.append(f"| {job['n']} | {p['collective']} | {p['bytes']} | {1e3 * p[stat + '_s']:.3f} | "
                         f"{1e3 * p['min_s']:.3f} | {1e3 * max(p['times_s']):.3f} |")
    return "\n".join(lines)


# ---- the command line ------------------------------------------------------------------------------------
def add_arguments(p):
    p.add_argument("--np", type=positive_int, nargs="+", default=[2, 4], metavar="N",
                   help="rank counts, one job each (default: 2 4)")
    p.add_argument("--sizes", type=sizes_arg, default=DEFAULT_SIZES,
                   help=f"bytes per rank of each message, comma-separated, K/M suffixes (default {DEFAULT_SIZES})")
    p.add_argument("--collectives", type=collectives_arg, default=",".join(COLLECTIVES),
                   help=f"which to time (default {','.join(COLLECTIVES)})")
    p.add_argument("--reps", type=positive_int, default=7, help="timed repetitions of every point (default 7)")
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--inflight", type=positive_int, default=1,
                   help="tensors exchanged at once in each timed operation (started asynchronously, as a training "
                        "step's gradients are); the time recorded is per tensor (default 1)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="a point's time over repetitions (default median)")
    p.add_argument("--rate", help="run over network namespaces with every link tbf-shaped to this rate "
                                  "(e.g. 1gbit; root, ip and tc needed); default: horovodrun on loopback")
    p.add_argument("--hosts", help="horovodrun's -H for the jobs (e.g. h1:1,h2:1,h3:1,h4:1: one rank per host; "
                                   "ssh to each, this checkout at the same path); default localhost:N")
    p.add_argument("--json", help="write every point, fit and crossover here")
    p.add_argument("--points", action="store_true", help="print every measured point too")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds allowed to each job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-json", help=argparse.SUPPRESS)


def _worker_argv(args, json_path=None):
    return ["-m", "benchmarks", "calibrate", "--worker"] + (["--worker-json", json_path] if json_path else []) + [
            "--sizes", ",".join(map(str, args.sizes)), "--collectives", ",".join(args.collectives),
            "--reps", str(args.reps), "--warmup", str(args.warmup), "--inflight", str(args.inflight)]


def run_worker(args):
    """One rank: time every collective at every size; rank 0 writes the points (max over ranks)."""
    import torch
    import horovod.torch as hvd

    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    torch.set_num_threads(1)
    sizes = [job_bytes(s, n) for s in args.sizes]
    bufs = {s: dict(f32=torch.full((s // 4,), float(rank + 1)), u8=torch.full((s,), rank, dtype=torch.uint8),
                    chunk=torch.full((s // n,), rank, dtype=torch.uint8)) for s in sizes}

    k_inflight = args.inflight
    # (Horovod operation, buffer, name) of each stage: scatter_allgather's allgather starts once its
    # alltoall is done, as the compressor's reduction does
    stages = dict(allreduce=[("allreduce", "f32", "cal.allreduce")], allgather=[("allgather", "u8", "cal.allgather")],
                  alltoall=[("alltoall", "u8", "cal.alltoall")],
                  scatter_allgather=[("alltoall", "u8", "cal.sa.alltoall"), ("allgather", "chunk", "cal.sa.allgather")])

    def start(op, tensor, name):
        if op == "allreduce":
            return hvd.allreduce_async(tensor, op=hvd.Sum, name=name)
        return getattr(hvd, f"{op}_async")(tensor, name=name)

    def run_op(coll, s):
        """One timed operation: k_inflight tensors of s bytes at once (distinct names, started
        asynchronously, then all waited for), stage by stage."""
        for op, key, name in stages[coll]:
            handles = [start(op, bufs[s][key], f"{name}.{s}.{i}") for i in range(k_inflight)]
            for h in handles:
                hvd.synchronize(h)

    keys = [(c, s) for s in sizes for c in args.collectives]
    times = {k: [] for k in keys}
    for rnd in range(args.warmup + args.reps):
        for c, s in keys:
            hvd.barrier()
            t0 = time.perf_counter()
            run_op(c, s)
            dt = (time.perf_counter() - t0) / k_inflight
            if rnd >= args.warmup:
                times[(c, s)].append(dt)
    mine = torch.tensor([times[k] for k in keys], dtype=torch.float64)
    slowest = hvd.allreduce(mine, op=hvd.Max, name="cal.times").tolist()
    if rank == 0:
        points = []
        for (c, s), req, ts in zip(keys, [r for r in args.sizes for _ in args.collectives], slowest):
            m, b = model_terms(c, n, s)
            points.append(dict(collective=c, size=req, bytes=s, messages=m, bytes_received=b,
                               median_s=statistics.median(ts), min_s=min(ts), times_s=ts))
        job = dict(n=n, sizes=list(args.sizes), bytes=sizes, collectives=list(args.collectives), reps=args.reps,
                   warmup=args.warmup, inflight=k_inflight, points=points,
                   horovod_env={k: v for k, v in os.environ.items()
                                if k in ("HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY", "HOROVOD_FUSION_THRESHOLD")})
        if args.worker_json:
            with open(args.worker_json, "w") as f:
                json.dump(job, f)
        else:  # to the launcher through horovodrun's output (rank 0 may be on another host)
            print(RESULT_MARK + json.dumps(job), flush=True)
    hvd.shutdown()
    return 0


def _horovodrun_job(n, args):
    """One ``horovodrun --gloo`` job of n ranks on ``--hosts`` (default localhost:n); rank 0's points,
    read from the job's output."""
    hosts = args.hosts or f"localhost:{n}"
    cmd = [horovodrun(), "-np", str(n), "-H", hosts,
           "--gloo", sys.executable] + _worker_argv(args)
    status, out, _ = launch_job(cmd, args.timeout, cwd=REPO_ROOT)
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {status}:\n{out[-4000:]}")
    for line in out.splitlines():
        at = line.find(RESULT_MARK)   # horovodrun prefixes each line with the rank
        if at >= 0:
            return json.loads(line[at + len(RESULT_MARK):])
    raise RuntimeError(f"{' '.join(cmd)} printed no results:\n{out[-4000:]}")


def _netns_job(n, args, json_path, log_dir):
    """One job of n ranks in namespaces whose links are shaped to args.rate (see e2e_launch)."""
    from benchmarks import e2e_launch, netns

    topo = netns.Topology(n)
    try:
        topo.create()
        shaping = topo.shape(args.rate)
        env = job_env()
        deadline = time.monotonic() + args.timeout
        log_prefix = os.path.join(log_dir, f"calibrate_np{n}_{args.rate}")
        port = e2e_launch._start_rendezvous(topo, env, f"{log_prefix}_rendezvous.log")
        workers, logs = e2e_launch.start_ranks(topo, env, port, log_prefix, _worker_argv(args, json_path),
                                               cwd=REPO_ROOT)
        e2e_launch._wait_ranks(workers, logs, deadline, args.timeout)
    except (netns.NetnsError, e2e_launch.JobFailed) as e:
        raise RuntimeError(f"{n} ranks at {args.rate}: {e}") from None
    finally:
        e2e_launch.kill_children()
        left = topo.destroy()
        if left:
            print(f"warning: could not delete namespaces {' '.join(left)}", flush=True)
    with open(json_path) as f:
        job = json.load(f)
    job["shaping"] = shaping
    return job


def _on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(args):
    if args.worker:
        return run_worker(args)
    if args.rate and args.hosts:
        raise SystemExit("--rate runs every rank on this machine, in network namespaces; it does not take --hosts")
    if args.rate:
        from benchmarks import netns

        netns.parse_rate(args.rate)
        reason = netns.probe()
        if reason:
            raise SystemExit(f"--rate needs network namespaces: {reason}")
        netns.remove_stale()
    for n in args.np:
        moved = [job_bytes(s, n) for s in args.sizes]
        if len(set(moved)) < len(moved):
            raise SystemExit(f"--sizes: at {n} ranks sizes are rounded down to multiples of {4 * n} bytes, and "
                             f"two of them become the same ({moved})")
    jobs = []
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with tempfile.TemporaryDirectory(prefix="hvd_qsgd_calibrate_") as tmp:
            for n in args.np:
                where = (f"links shaped to {args.rate} (network namespaces)" if args.rate else
                         f"hosts {args.hosts} (horovodrun)" if args.hosts else "loopback (horovodrun)")
                print(f"timing {','.join(args.collectives)} on {n} ranks over {where} ...", flush=True)
                path = os.path.join(tmp, f"np{n}.json")
                t0 = time.perf_counter()
                job = _netns_job(n, args, path, tmp) if args.rate else _horovodrun_job(n, args)
                job["wall_s"] = time.perf_counter() - t0
                jobs.append(job)
    except KeyboardInterrupt as e:
        print(f"\ninterrupted ({e or 'SIGINT'}): every rank was killed", flush=True)
        return 130
    except RuntimeError as e:
        print(f"FAILED: {e}", flush=True)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    fits, crossovers = analyse(jobs, args.stat)
    where = (f"links tbf-shaped to {args.rate} between network namespaces" if args.rate else
             f"hosts {args.hosts}" if args.hosts else "loopback")
    per = f", per tensor of {args.inflight} in flight" if args.inflight > 1 else ""
    print(f"\n## Fitted alpha and beta ({where}; time = {args.stat} of {args.reps} of the slowest rank{per})\n")
    print(table(fits, crossovers))
    if args.points:
        print("\n## Points\n")
        print(points_table(jobs, args.stat))
    if args.json:
        from hvd_qsgd import cost_model

        def finite(v):
            return v if not (isinstance(v, float) and math.isinf(v)) else None

        result = dict(argv=sys.argv[1:], machine=machine_info(),
                      network=(dict(rate=args.rate) if args.rate else dict(hosts=args.hosts) if args.hosts
                               else "loopback"),
                      sizes=list(args.sizes), collectives=list(args.collectives), reps=args.reps,
                      warmup=args.warmup, inflight=args.inflight, stat=args.stat,
                      model_defaults=dict(alpha_s=cost_model.LATENCY_S, beta_Bps=cost_model.BANDWIDTH_BPS),
                      jobs=jobs, fits=[{k: finite(v) for k, v in f.items()} for f in fits], crossovers=crossovers)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    from benchmarks.common import module_main

    sys.exit(module_main("calibrate", add_arguments, run))
