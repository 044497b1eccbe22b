"""What each rank of ``python -m benchmarks e2e`` runs, in its own network namespace (``e2e_launch``
starts it as ``python -m benchmarks.e2e --worker ...``): one copy of the MLP per mode and one with a
local optimizer (``compute``), stepped in turn, with a barrier and a reading of the veth's byte
counters before and after every step; rank 0 gathers every rank's numbers and writes the job's JSON
(``--json``). The definitions are in the docstring of ``benchmarks.e2e``."""
import json
import os
import statistics
import time

from benchmarks.e2e_model import (CLASSES, make_batch, make_model, mode_bits, mode_fusion_mb, mode_overlap,
                                  mode_reduction, time_codec)


def build_runs(args, hvd):
    """{name: dict(model, opt, comp)}: ``compute`` (local SGD, no exchange), then one per mode, each
    under ``hvd.DistributedOptimizer`` with the mode's compression; the same initial weights in all."""
    import torch

    import hvd_qsgd
    from benchmarks.torch import _Counting

    runs = {}
    local = make_model(args.width, args.depth, args.seed, args.net)
    runs["compute"] = dict(model=local, opt=torch.optim.SGD(local.parameters(), lr=1e-3), comp=None)
    for mode in args.modes:
        model = make_model(args.width, args.depth, args.seed, args.net)
        if mode == "none":
            comp = _Counting(hvd.Compression.none)
        elif mode == "fp16":
            comp = _Counting(hvd.Compression.fp16)
        else:
            comp = hvd_qsgd.QSGD(mode_bits(mode), reduction=mode_reduction(mode), seed=args.seed,
                                 overlap=mode_overlap(mode), fusion_mb=mode_fusion_mb(mode),
                                 named_parameters=model.named_parameters())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                       named_parameters=model.named_parameters(), compression=comp)
        runs[mode] = dict(model=model, opt=opt, comp=comp)
    return runs


def compressor_counts(comp):
    """The compressor's own counts: QSGD's stats (but its ratio), the bytes a counting none / fp16
    handed to the collective; nothing for the local run."""
    from benchmarks.torch import _Counting

    if comp is None:
        return {}
    if isinstance(comp, _Counting):
        return {"bytes_sent": comp.bytes}
    return {k: v for k, v in comp.stats.items() if k != "ratio"}


def measure(args, hvd, runs, order, x, y):
    """Step the runs of ``order`` in turn, one step of each per round: --warmup untimed rounds, then
    --steps timed ones. This rank's dict(times, tx, rx) (arrays [timed round, run]: step seconds and
    veth bytes from the barrier before the step to the one after it), codec (the codec timings of
    each timed round) and stats (the compressors' counts over the timed rounds)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from benchmarks.netns import read_counters, tcp_retransmits

    bits_list = sorted({mode_bits(m) for m in args.modes if mode_bits(m) is not None})
    barrier_tensor = torch.zeros(1)

    def barrier():
        hvd.allreduce(barrier_tensor, name="e2e.barrier")

    def step(r):
        r["opt"].zero_grad()
        F.cross_entropy(r["model"](x), y).backward()
        r["opt"].step()

    s = args.steps
    times = np.zeros((s, len(order)))
    tx = np.zeros((s, len(order)), dtype=np.int64)
    rx = np.zeros((s, len(order)), dtype=np.int64)
    retrans = np.zeros((s, len(order)), dtype=np.int64)
    codec_rounds = []
    before = None
    for r in range(args.warmup + s):
        timed = r >= args.warmup
        if timed and before is None:
            before = {name: compressor_counts(runs[name]["comp"]) for name in order}
        for j, name in enumerate(order):
            barrier()
            c0, q0 = read_counters(args.iface), tcp_retransmits()
            t0 = time.perf_counter()
            step(runs[name])
            dt = time.perf_counter() - t0
            barrier()
            c1, q1 = read_counters(args.iface), tcp_retransmits()
            if timed:
                i = r - args.warmup
                times[i, j] = dt
                tx[i, j], rx[i, j], retrans[i, j] = c1[0] - c0[0], c1[1] - c0[1], q1 - q0
        if timed:
            barrier()
            grads = [p.grad for p in runs["compute"]["model"].parameters()]
            codec_rounds.append(time_codec(grads, bits_list, hvd.size(), "fp16" in args.modes))
    after = {name: compressor_counts(runs[name]["comp"]) for name in order}
    stats = {name: {k: after[name][k] - before[name].get(k, 0) for k in after[name]} for name in order}
    return dict(times=times, tx=tx, rx=rx, retrans=retrans, codec=codec_rounds, stats=stats)


def job_rows(everyone, tmax, order, steps):
    """One row per run of ``order`` from every rank's numbers (``everyone``) and the per-step maxima
    over ranks of the step times (``tmax``)."""
    import numpy as np

    rows = []
    for j, name in enumerate(order):
        steps_max = tmax[:, j].tolist()
        tx_all = [[e["tx"][i][j] for i in range(steps)] for e in everyone]
        rx_all = [[e["rx"][i][j] for i in range(steps)] for e in everyone]
        retrans_all = [[e["retrans"][i][j] for i in range(steps)] for e in everyone]
        row = dict(mode=name, step_s_max_over_ranks=steps_max, step_s_median=statistics.median(steps_max),
                   tx_bytes_per_rank_step=tx_all, rx_bytes_per_rank_step=rx_all,
                   tcp_retransmits_per_rank_step=retrans_all, tx_bytes_per_step=float(np.mean(tx_all)), rx_bytes_per_step=float(np.mean(rx_all)))
        if name != "compute":
            row["stats_per_step"] = {k: statistics.fmean(e["stats"][name][k] for e in everyone) / steps
                                     for k in everyone[0]["stats"][name]}
            row["params_identical_across_ranks"] = len({e["digests"][name] for e in everyone}) == 1
        rows.append(row)
    return rows


def compute_parts(everyone, compute_row, modes, steps, n):
    """The in-job compute parts: the compute step's median, and the codec and cast times as the median
    over rounds of the max over ranks."""
    bits_list = sorted({mode_bits(m) for m in modes if mode_bits(m) is not None})

    def per_round_max(key, sub=None):
        vals = []
        for i in range(steps):
            per_rank = [(e["codec"][i][key] if sub is None else e["codec"][i][key][sub]) for e in everyone]
            vals.append(max(per_rank))
        return statistics.median(vals)

    return dict(compute_s=compute_row["step_s_median"], cast_s=per_round_max("cast_s"),
                encode_s={str(b): per_round_max("encode_s", str(b)) for b in bits_list},
                decode1_s={str(b): per_round_max("decode1_s", str(b)) for b in bits_list},
                decode_copies=n)


def run_worker(args):
    """One rank of a job: build, measure, gather on rank 0, which writes ``args.json``."""
    import torch
    import horovod
    import horovod.torch as hvd

    from hvd_qsgd import codec
    from benchmarks.torch import _param_digest

    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    gen = torch.Generator().manual_seed(args.seed * 1000003 + rank)
    x, y = make_batch(args, gen)
    runs = build_runs(args, hvd)
    order = ["compute"] + args.modes
    m = measure(args, hvd, runs, order, x, y)

    tmax = hvd.allreduce(torch.from_numpy(m["times"]), op=hvd.Max, name="e2e.times").numpy()
    mine = dict(rank=rank, tx=m["tx"].tolist(), rx=m["rx"].tolist(), retrans=m["retrans"].tolist(), codec=m["codec"], stats=m["stats"],
                digests={mode: _param_digest(runs[mode]["model"]) for mode in args.modes})
    everyone = hvd.allgather_object(mine)
    if rank != 0:
        return 0

    rows = job_rows(everyone, tmax, order, args.steps)
    shapes = [(nm, p.numel()) for nm, p in runs["compute"]["model"].named_parameters()]
    result = dict(np=n, per_host=hvd.local_size(), rate=args.rate, numel=sum(d for _, d in shapes),
                  parameters=shapes, rows=rows,
                  compute=compute_parts(everyone, rows[0], args.modes, args.steps, n),
                  torch=torch.__version__, horovod=horovod.__version__,
                  torch_threads=torch.get_num_threads(), codec_threads=codec.get_num_threads())
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0
