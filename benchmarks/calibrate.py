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
localhost:n --gloo`` (the ranks talk over loopback); with ``--rate R`` (root, ``ip``, ``tc``) the
ranks run in network namespaces joined by a switch with every link shaped to R, the topology of
``python -m benchmarks e2e`` (``benchmarks.netns``, started by ``benchmarks.e2e_launch``'s
rendezvous helper). Every rank allocates, for each size S of ``--sizes`` (rounded down to a multiple
of 4n bytes so that fp32 and n-way splits are whole), an fp32 tensor of S bytes (allreduce, op=Sum)
and uint8 tensors of S and S/n bytes (allgather, alltoall). Then ``--warmup`` untimed rounds and
``--reps`` timed rounds; a round runs every collective at every size, each one preceded by
``hvd.barrier()`` and timed on every rank with ``time.perf_counter`` around the synchronous call. A
repetition's time is the maximum over ranks (the collective is done when its last rank is), and a
point's time the median over repetitions (``--stat min``: the minimum). Every op keeps one name
across repetitions, so Horovod's response cache serves it as in a training loop.

The fit (``fit``, a pure function). For each (n, collective), weighted least squares of the points'
(m, b) -> time against ``t = m alpha + b x`` with x = 1/beta, each point weighted by 1/t so that
the residuals are relative (a sweep over 1 KB .. 64 MB spans four decades of time; unweighted, the
largest sizes alone would set alpha). alpha and x are kept >= 0 (if the unconstrained solution has
one negative, it is set to 0 and the other refitted). Also fitted: ``joint``, every collective's
points of one n together (the single (alpha, beta) the cost model uses for all of them), and with
several n, every n's points of one collective together (whether alpha is really per message: a
per-collective overhead shows as points of different n that do not fit one line). Reported: alpha
(us), beta (Gbit/s), the per-op latency m alpha, and the residuals' RMS and maximum (relative).

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
import subprocess
import sys
import tempfile
import time

from benchmarks.common import REPO_ROOT, job_env, launch_job, machine_info, nonnegative_int, positive_int

COLLECTIVES = ("allreduce", "allgather", "alltoall", "scatter_allgather")
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"
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


def fit(messages, nbytes, seconds, weighting="relative"):
    """Least-squares fit of ``seconds[i] ~ messages[i] alpha + nbytes[i] / beta``.

    weighting: "relative" (each point weighted by 1/seconds[i]: minimises the relative residuals) or
    "absolute". alpha and 1/beta are kept >= 0. Returns a dict: alpha_s, beta_Bps (inf where the
    times show no bandwidth term), inv_beta_s_per_B, rms_rel_residual and max_rel_residual (of
    (model - measured) / measured), points, clamped (the parameter set to 0, or None).
    """
    import numpy as np

    m = np.asarray(messages, dtype=np.float64)
    b = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if not (m.shape == b.shape == t.shape and m.ndim == 1):
        raise ValueError("messages, nbytes and seconds must be 1-D sequences of one length")
    if len(t) < 2 or np.any(t <= 0) or np.any(m < 0) or np.any(b < 0):
        raise ValueError("the fit needs at least two points with positive times and non-negative terms")
    if weighting == "relative":
        w = 1.0 / t
    elif weighting == "absolute":
        w = np.ones_like(t)
    else:
        raise ValueError(f"unknown weighting {weighting!r}")
    a = np.stack([m * w, b * w], axis=1)
    y = t * w
    if np.linalg.matrix_rank(a) < 2:
        raise ValueError("the points do not separate latency from bandwidth (need at least two distinct "
                         "byte counts per message count)")
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, y, rcond=None)
    clamped = None
    if alpha < 0 or inv_beta < 0:
        # the better of the two one-parameter fits on the boundary
        candidates = []
        for name, col in (("alpha", 1), ("inv_beta", 0)):
            v = max(0.0, float(a[:, col] @ y / (a[:, col] @ a[:, col]))) if a[:, col].any() else 0.0
            coef = (0.0, v) if col == 1 else (v, 0.0)
            candidates.append((float(np.sum((a @ np.array(coef) - y) ** 2)), name, coef))
        _, clamped, (alpha, inv_beta) = min(candidates)
    rel = (m * alpha + b * inv_beta - t) / t
    return dict(alpha_s=float(alpha), beta_Bps=(1.0 / inv_beta) if inv_beta > 0 else math.inf,
                inv_beta_s_per_B=float(inv_beta), rms_rel_residual=float(np.sqrt(np.mean(rel ** 2))),
                max_rel_residual=float(np.max(np.abs(rel))), points=int(len(t)), clamped=clamped)


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


def analyse(jobs, stat="median"):
    """Fits and crossovers of the jobs' points (``run_worker``'s JSON, one per n)."""
    from hvd_qsgd import cost_model

    fits, crossovers = [], []
    by_coll = {}
    for job in jobs:
        n = job["n"]
        pts = job["points"]
        groups = {c: [p for p in pts if p["collective"] == c] for c in job["collectives"]}
        groups["joint"] = pts
        job_fits = {}
        for coll, ps in groups.items():
            f = fit([p["messages"] for p in ps], [p["bytes_received"] for p in ps], [p[f"{stat}_s"] for p in ps])
            m = model_terms(coll, n, 0)[0] if coll != "joint" else None
            f.update(n=n, collective=coll, per_op_s=(m * f["alpha_s"]) if m is not None else None)
            job_fits[coll] = f
            fits.append(f)
            if coll != "joint":
                by_coll.setdefault(coll, []).extend(ps)
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
    if len(jobs) > 1:
        for coll, ps in by_coll.items():
            f = fit([p["messages"] for p in ps], [p["bytes_received"] for p in ps], [p[f"{stat}_s"] for p in ps])
            f.update(n="all", collective=coll, per_op_s=None)
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
    lines = ["| n | collective | alpha (us) | beta (Gbit/s) | per-op latency m·alpha (us) | RMS residual "
             "| max residual | points |",
             "|---|---|---|---|---|---|---|---|"]
    for f in fits:
        beta = f"{f['beta_Bps'] * 8 / 1e9:.3g}" if math.isfinite(f["beta_Bps"]) else "inf"
        per_op = f"{f['per_op_s'] * 1e6:.0f}" if f["per_op_s"] is not None else ""
        clamp = f" ({f['clamped']} clamped to 0)" if f["clamped"] else ""
        lines.append(f"| {f['n']} | {f['collective']}{clamp} | {f['alpha_s'] * 1e6:.1f} | {beta} | {per_op} | "
                     f"{100 * f['rms_rel_residual']:.1f}% | {100 * f['max_rel_residual']:.1f}% | {f['points']} |")
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
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="a point's time over repetitions (default median)")
    p.add_argument("--rate", help="run over network namespaces with every link tbf-shaped to this rate "
                                  "(e.g. 1gbit; root, ip and tc needed); default: horovodrun on loopback")
    p.add_argument("--json", help="write every point, fit and crossover here")
    p.add_argument("--points", action="store_true", help="print every measured point too")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds allowed to each job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-json", help=argparse.SUPPRESS)


def _worker_argv(args, json_path):
    return ["-m", "benchmarks", "calibrate", "--worker", "--worker-json", json_path,
            "--sizes", ",".join(map(str, args.sizes)), "--collectives", ",".join(args.collectives),
            "--reps", str(args.reps), "--warmup", str(args.warmup)]


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

    def run_op(coll, s):
        buf = bufs[s]
        if coll == "allreduce":
            hvd.allreduce(buf["f32"], op=hvd.Sum, name=f"cal.allreduce.{s}")
        elif coll == "allgather":
            hvd.allgather(buf["u8"], name=f"cal.allgather.{s}")
        elif coll == "alltoall":
            hvd.alltoall(buf["u8"], name=f"cal.alltoall.{s}")
        else:  # scatter_allgather
            hvd.alltoall(buf["u8"], name=f"cal.sa.alltoall.{s}")
            hvd.allgather(buf["chunk"], name=f"cal.sa.allgather.{s}")

    keys = [(c, s) for s in sizes for c in args.collectives]
    times = {k: [] for k in keys}
    for rnd in range(args.warmup + args.reps):
        for c, s in keys:
            hvd.barrier()
            t0 = time.perf_counter()
            run_op(c, s)
            dt = time.perf_counter() - t0
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
                   warmup=args.warmup, points=points,
                   horovod_env={k: v for k, v in os.environ.items()
                                if k in ("HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY", "HOROVOD_FUSION_THRESHOLD")})
        with open(args.worker_json, "w") as f:
            json.dump(job, f)
    hvd.shutdown()
    return 0


def _loopback_job(n, args, json_path):
    cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(n), "-H", f"localhost:{n}",
           "--gloo", sys.executable] + _worker_argv(args, json_path)
    status, out, _ = launch_job(cmd, args.timeout, cwd=REPO_ROOT)
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {status}:\n{out[-4000:]}")
    with open(json_path) as f:
        return json.load(f)


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
        workers, logs = [], []
        for i, ns in enumerate(topo.ranks):
            # the environment e2e_launch gives a Gloo rank in namespace i (a host of its own)
            wenv = dict(env, HOROVOD_GLOO_RENDEZVOUS_ADDR=topo.switch_address, HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
                        HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE=netns.IFACE,
                        HOROVOD_GLOO_TIMEOUT_SECONDS="120", HOROVOD_HOSTNAME=ns, HOROVOD_RANK=str(i),
                        HOROVOD_SIZE=str(n), HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="1",
                        HOROVOD_CROSS_RANK=str(i), HOROVOD_CROSS_SIZE=str(n))
            logs.append(f"{log_prefix}_rank{i}.log")
            with open(logs[-1], "w") as out:
                argv = [netns.IP, "netns", "exec", ns, sys.executable] + _worker_argv(args, json_path)
                proc = subprocess.Popen(argv, env=wenv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            e2e_launch._children.append(proc)
            workers.append(proc)
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
                where = f"links shaped to {args.rate} (network namespaces)" if args.rate else "loopback (horovodrun)"
                print(f"timing {','.join(args.collectives)} on {n} ranks over {where} ...", flush=True)
                path = os.path.join(tmp, f"np{n}.json")
                t0 = time.perf_counter()
                job = _netns_job(n, args, path, tmp) if args.rate else _loopback_job(n, args, path)
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
    where = f"links tbf-shaped to {args.rate} between network namespaces" if args.rate else "loopback"
    print(f"\n## Fitted alpha and beta ({where}; time = {args.stat} of {args.reps} of the slowest rank)\n")
    print(table(fits, crossovers))
    if args.points:
        print("\n## Points\n")
        print(points_table(jobs, args.stat))
    if args.json:
        from hvd_qsgd import cost_model

        def finite(v):
            return v if not (isinstance(v, float) and math.isinf(v)) else None

        result = dict(argv=sys.argv[1:], machine=machine_info(),
                      network=dict(rate=args.rate) if args.rate else "loopback",
                      sizes=list(args.sizes), collectives=list(args.collectives), reps=args.reps,
                      warmup=args.warmup, stat=args.stat,
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
