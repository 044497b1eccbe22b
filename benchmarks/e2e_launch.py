"""The jobs of ``python -m benchmarks e2e``: for every rank count a ``netns.Topology``, for every rate
its links shaped and one job; a job is Horovod's Gloo rendezvous server in the switch namespace
(``python -m benchmarks.e2e --rendezvous ...``) and one ``python -m benchmarks.e2e --worker ...`` per
rank namespace, started with ``ip netns exec`` and the environment of a Gloo worker (no ssh, no
horovodrun), bounded by ``--timeout``. Every process of a job is killed on any way out of it; on
SIGINT or SIGTERM the namespaces are deleted too. The definitions are in the docstring of
``benchmarks.e2e``."""
import json
import os
import select
import signal
import subprocess
import sys
import time

from benchmarks import netns
from benchmarks.common import job_env


class JobFailed(RuntimeError):
    pass


_children = []  # Popen objects of the running job (killed on any way out)


def kill_children():
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


# ---- rendezvous helper (in the switch namespace) -------------------------------------------------
def run_rendezvous(args):
    """Horovod's Gloo rendezvous server for the hosts ``name:L,name:L,...`` (L ranks each); prints its
    port and serves until its standard input closes (the launcher ends or closes it)."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    hosts = parse_hosts(args.rendezvous)
    plan = get_host_assignments(hosts, sum(h.slots for h in hosts))
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    print(f"port {port}", flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()
    return 0


# ---- one job ---------------------------------------------------------------------------------------
def _worker_argv(args, json_path):
    return ["-m", "benchmarks.e2e", "--worker", "--json", json_path, "--modes", ",".join(args.run_modes),
            "--width", str(args.width), "--depth", str(args.depth), "--net", args.net, "--batch", str(args.batch),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
            "--ranks-per-host", str(getattr(args, "ranks_per_host", 1))]


def _start_rendezvous(topo, env, log_path):
    """Start the rendezvous server in the switch namespace; its port."""
    hosts = ",".join(f"{ns}:{topo.per_host}" for ns in topo.hosts)
    with open(log_path, "w") as err:
        rdv = subprocess.Popen([netns.IP, "netns", "exec", topo.switch, sys.executable, "-m", "benchmarks.e2e",
                                "--rendezvous", hosts], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=err, text=True, start_new_session=True)
    _children.append(rdv)
    ready, _, _ = select.select([rdv.stdout], [], [], 60)
    line = rdv.stdout.readline() if ready else ""
    if not line.startswith("port "):
        raise JobFailed(f"the rendezvous server did not start: {line!r}\n{_tail(log_path)}")
    return int(line.split()[1])


def rank_env(topo, env, port, i):
    """The environment of Gloo rank i: local rank i mod L of its host's L ranks (consecutive ranks
    share a host), its rendezvous the server in the switch namespace, its interface the host's veth."""
    n, per_host = topo.n, topo.per_host
    return dict(env, HOROVOD_GLOO_RENDEZVOUS_ADDR=topo.switch_address, HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
                HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE=netns.IFACE,
                HOROVOD_GLOO_TIMEOUT_SECONDS="120", HOROVOD_HOSTNAME=topo.ranks[i], HOROVOD_RANK=str(i),
                HOROVOD_SIZE=str(n), HOROVOD_LOCAL_RANK=str(i % per_host), HOROVOD_LOCAL_SIZE=str(per_host),
                HOROVOD_CROSS_RANK=str(i // per_host), HOROVOD_CROSS_SIZE=str(n // per_host))


def start_ranks(topo, env, port, log_prefix, worker_argv, cwd=None):
    """Start ``python <worker_argv>`` in every rank namespace (``rank_env``), each killed with the job;
    (their Popen objects, their log files)."""
    workers, logs = [], []
    for i, ns in enumerate(topo.ranks):
        log = f"{log_prefix}_rank{i}.log"
        logs.append(log)
        with open(log, "w") as out:
            proc = subprocess.Popen([netns.IP, "netns", "exec", ns, sys.executable] + list(worker_argv),
                                    env=rank_env(topo, env, port, i), cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        _children.append(proc)
        workers.append(proc)
    return workers, logs


def _wait_ranks(workers, logs, deadline, timeout):
    """Wait for every worker to exit with status 0; JobFailed at the first failure or past the deadline."""
    n = len(workers)
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
            return
        if time.monotonic() > deadline:
            raise JobFailed(f"the job did not finish in {timeout}s; every rank was killed\n" +
                            "".join(f"\n--- rank {k} ---\n{_tail(logs[k], 1500)}" for k in range(n)))
        time.sleep(0.2)


def run_job(topo, rate, args, json_path, log_dir, worker_argv=None):
    """One job of topo.n ranks at ``rate`` (the links already shaped); rank 0's results, or JobFailed.
    Each rank runs ``python <worker_argv>`` (default: this benchmark's worker), then ``--rate <rate>``."""
    if worker_argv is None:
        worker_argv = _worker_argv(args, json_path)
    deadline = time.monotonic() + args.timeout
    env = job_env()
    log_prefix = os.path.join(log_dir, f"np{topo.n}_{rate}")
    logs = []
    try:
        port = _start_rendezvous(topo, env, f"{log_prefix}_rendezvous.log")
        workers, logs = start_ranks(topo, env, port, log_prefix, list(worker_argv) + ["--rate", rate])
        _wait_ranks(workers, logs, deadline, args.timeout)
    finally:
        kill_children()
    try:
        with open(json_path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise JobFailed(f"every rank exited with status 0 but rank 0's results are unreadable: {e}\n"
                        f"{_tail(logs[0])}") from None


# ---- every rank count and rate ---------------------------------------------------------------------
def _run_rate(topo, rate, args, info, log_dir, measured):
    """Shape topo's links at ``rate`` and run one job; its results, or the failure, into ``measured``."""
    n = topo.n
    measured["shaping"][rate] = topo.shape(rate)
    measured["qdiscs"][f"np{n}_{rate}"] = topo.qdiscs()
    json_path = os.path.join(os.path.abspath(args.out), f"raw_np{n}_{rate}.json")
    if os.path.exists(json_path):
        os.remove(json_path)
    print(f"running {n} ranks at {rate} (namespaces {topo.prefix}*, Gloo) ...", flush=True)
    t0 = time.perf_counter()
    try:
        job = run_job(topo, rate, args, json_path, log_dir)
    except JobFailed as e:
        measured["failures"].append(f"np{n}_{rate}")
        print(f"{n} ranks at {rate} FAILED after {time.perf_counter() - t0:.0f}s: {e}", flush=True)
        return
    job.update(wall_s=time.perf_counter() - t0, oversubscribed=n > info["usable_cores"])
    measured["jobs"].append(job)
    print(f"  done in {job['wall_s']:.0f}s", flush=True)


def _run_rank_count(n, args, info, log_dir, measured):
    """Make the namespaces of n ranks, run a job at every rate of ``args.rates``, delete them."""
    topo = netns.Topology(n, per_host=args.ranks_per_host)
    try:
        try:
            topo.create()
        except netns.NetnsError as e:
            measured["netns_error"] = f"the network namespaces could not be made: {e}"
            measured["failures"].append(f"np{n}")
            print(f"{n} ranks: {measured['netns_error']}", flush=True)
            return
        for rate in args.rates:
            _run_rate(topo, rate, args, info, log_dir, measured)
    finally:
        kill_children()
        left = topo.destroy()
        if left:
            print(f"warning: could not delete namespaces {' '.join(left)}", flush=True)


def _on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_jobs(args, info):
    """Every job of ``args.np`` x ``args.rates``: dict(jobs, failures, qdiscs, shaping, netns_error);
    None if interrupted (SIGINT or SIGTERM: every rank killed, the namespaces deleted)."""
    measured = dict(jobs=[], failures=[], qdiscs={}, shaping={}, netns_error=None)
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    log_dir = os.path.join(os.path.abspath(args.out), "logs")
    os.makedirs(log_dir, exist_ok=True)
    try:
        stale = netns.remove_stale()
        if stale:
            print(f"removed stale namespaces of earlier runs: {' '.join(stale)}", flush=True)
        for n in args.np:
            _run_rank_count(n, args, info, log_dir, measured)
    except KeyboardInterrupt as e:
        print(f"\ninterrupted ({e or 'SIGINT'}): every rank was killed and the namespaces deleted", flush=True)
        return None
    finally:
        kill_children()
        for s, h in old.items():
            signal.signal(s, h)
    return measured
