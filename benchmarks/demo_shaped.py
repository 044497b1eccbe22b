"""The demo's shaped-link runs: ``examples/pytorch_digits.py`` on n ranks joined by rate-shaped links.

``python -m benchmarks.demo_shaped --out DIR [--np 4] [--rate 1gbit] [--runs none,fp16,qsgd8,qsgd4]
[--hidden H] [--epochs E] [--max-steps S] [--timeout T] [--mode auto|measure|projection]
[--example tensorflow2_digits]`` (the last: the TensorFlow example instead, the same flags)
writes ``DIR/<run>.json`` (the example's results, with ``link``: the bytes rank 0's link carried in
the training loop, see ``benchmarks.demo_rank``) and ``DIR/shaped.json`` (what was done: ``kind``
"measured", the shaping and the runs, or "projection" and why; the runs of earlier calls with the
same links are kept, as ``scripts/demo.sh`` makes one call per run, each right after its loopback
run). ``--probe`` only prints ``measure`` or ``projection`` (and then writes shaped.json);
``--remove-stale`` only deletes namespaces of this scheme whose creating process is gone (the
demo's trap).

Where network namespaces can be made (root, ``ip`` and ``tc``, and ``ip netns add`` works:
``netns.probe``), and unless ``--mode projection`` (``DEMO_SHAPED=projection``), the runs are
measured: one ``netns.Topology(n)`` (a namespace per rank, a bridge in a switch namespace), every
link shaped to the rate (``Topology.shape``: token bucket on both ends, so each rank has a
full-duplex link of that rate into the switch), and each run launched by
``benchmarks.e2e_launch.run_job`` -- Horovod's Gloo rendezvous server in the switch namespace, each
rank started with ``ip netns exec`` and the Gloo worker's environment, no horovodrun -- as
``python -m benchmarks.demo_rank``, which runs the example unchanged. The namespaces are deleted on
every way out (SIGINT and SIGTERM included: the ranks are killed, the namespaces deleted, exit
status 130); ``netns.remove_stale`` deletes those of a run that was killed outright.

Otherwise nothing is shaped and nothing runs: ``shaped.json`` says why, and the demo's table
(``benchmarks.demo_report``) prints the cost model's projection of the shaped-link time instead,
labelled as one.
"""
import argparse
import json
import os
import signal
import sys
import time

from benchmarks import e2e_launch, netns

RUNS = {  # run name -> the example's flags
    "none": ["--compression", "none"],
    "fp16": ["--compression", "fp16"],
    "qsgd8": ["--compression", "qsgd", "--bits", "8"],
    "qsgd4": ["--compression", "qsgd", "--bits", "4"],
}


def add_arguments(p):
    p.add_argument("--np", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--rate", default="1gbit", help="tc rate of every link (default 1gbit)")
    p.add_argument("--out", help="directory for the results (required unless --remove-stale)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--example", choices=("pytorch_digits", "tensorflow2_digits"), default="pytorch_digits",
                   help="the example each rank runs (default %(default)s; tensorflow2_digits: the same MLP, flags and "
                        "data through Horovod's TensorFlow tape)")
    p.add_argument("--hidden", type=int, default=512, help="the MLP's hidden width (default 512)")
    p.add_argument("--epochs", type=int, default=20, help="the example's --epochs (default 20)")
    p.add_argument("--max-steps", type=int, default=None, help="the example's --max-steps")
    p.add_argument("--timeout", type=int, default=300, help="seconds per run (default 300)")
    p.add_argument("--mode", choices=("auto", "measure", "projection"),
                   default=os.environ.get("DEMO_SHAPED", "auto"),
                   help="auto (default; or $DEMO_SHAPED): measure where namespaces can be made, "
                        "else projection; measure: fail where they cannot")
    p.add_argument("--probe", action="store_true",
                   help="only say (on stdout) whether the runs would be measured ('measure') or projected "
                        "('projection': then shaped.json says why)")
    p.add_argument("--remove-stale", action="store_true",
                   help="only delete namespaces of this scheme whose creating process is gone")


def digits_flags(args, run, json_path):
    flags = RUNS[run] + ["--hidden", str(args.hidden), "--epochs", str(args.epochs), "--no-progress",
                         "--json", json_path]
    if args.max_steps is not None:
        flags += ["--max-steps", str(args.max_steps)]
    return flags


def _on_signal(signum, frame):
    # the first signal starts the clean-up; later ones (a second Ctrl-C, the demo's trap) must not
    # interrupt it
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def measure(args, runs, out):
    """Every run over one shaped topology; the record for shaped.json."""
    record = dict(kind="measured", np=args.np, rate=args.rate, hidden=args.hidden, example=args.example, runs={})
    topo = netns.Topology(args.np)
    log_root = os.path.join(out, "logs")
    try:
        topo.create()
        record["shaping"] = topo.shape(args.rate)
        record["qdiscs"] = topo.qdiscs()
        print(f"[demo] shaped links: namespaces {topo.prefix}*, {args.np} ranks, every link "
              f"{args.rate} full duplex (tc tbf, burst {record['shaping']['burst_bytes']} B)", flush=True)
        for run in runs:
            json_path = os.path.join(out, f"{run}.json")
            log_dir = os.path.join(log_root, run)
            os.makedirs(log_dir, exist_ok=True)
            # run_job starts each rank as `python <worker_argv> --rate R`: here the example (through
            # demo_rank, which takes the --rate off) instead of the e2e benchmark's worker.
            argv = ["-m", "benchmarks.demo_rank", "--example", args.example] + digits_flags(args, run, json_path)
            t0 = time.perf_counter()
            result = e2e_launch.run_job(topo, args.rate, args, json_path, log_dir, worker_argv=argv)
            wall = time.perf_counter() - t0
            record["runs"][run] = dict(json=json_path, wall_s=wall)
            print(f"[demo] shaped {run}: {result['steps']} steps, training {result['train_time_s']:.2f} s "
                  f"(job {wall:.1f} s); rank 0's link carried {result['link']['tx_bytes']:,} B out, "
                  f"{result['link']['rx_bytes']:,} B in", flush=True)
    finally:
        e2e_launch.kill_children()
        left = topo.destroy()
        if left:
            print(f"[demo] warning: could not delete namespaces {' '.join(left)}", flush=True)
    return record


def remove_stale():
    """The demo's trap: namespaces left by shaped runs that were killed outright."""
    if netns.unavailable_reason() is None:
        stale = netns.remove_stale()
        if stale:
            print(f"[demo] deleted namespaces left behind: {' '.join(stale)}", flush=True)
    return 0


def decide(args):
    """None where the runs are to be measured, else why they are projected instead."""
    if args.mode == "projection":
        return "DEMO_SHAPED=projection"
    reason = netns.probe()
    if reason and args.mode == "measure":
        raise SystemExit(f"[demo] network namespaces cannot be made here: {reason}")
    return reason


def write_record(out, record):
    """shaped.json; the runs of earlier calls with the same links are kept (the demo measures one run
    per call, each right after its loopback run)."""
    path = os.path.join(out, "shaped.json")
    if record["kind"] == "measured" and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("kind") == "measured" and all(old.get(k) == record[k] for k in ("np", "rate", "hidden", "example")):
            record["runs"] = {**old["runs"], **record["runs"]}
    with open(path, "w") as f:
        json.dump(record, f, indent=2)


def run(args):
    if args.remove_stale:
        return remove_stale()
    if not args.out:
        raise SystemExit("[demo] --out is required")
    runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise SystemExit(f"[demo] unknown runs {unknown}; known: {', '.join(RUNS)}")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    reason = decide(args)
    if reason:
        write_record(out, dict(kind="projection", np=args.np, rate=args.rate, hidden=args.hidden, reason=reason))
        print(f"[demo] no shaped-link runs ({reason}): the table projects them with the cost model",
              file=sys.stderr if args.probe else sys.stdout, flush=True)
        if args.probe:
            print("projection")
        return 0
    if args.probe:
        print("measure")
        return 0
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stale = netns.remove_stale()
        if stale:
            print(f"[demo] removed stale namespaces of earlier runs: {' '.join(stale)}", flush=True)
        record = measure(args, runs, out)
    except KeyboardInterrupt as e:
        print(f"\n[demo] interrupted ({e or 'SIGINT'}): every rank was killed and the namespaces deleted",
              flush=True)
        return 130
    except (netns.NetnsError, e2e_launch.JobFailed) as e:
        print(f"[demo] error: the shaped-link runs failed: {e}", flush=True)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    write_record(out, record)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.demo_shaped", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
