"""The demo's final table (``scripts/demo.sh``): loopback runs beside the same trainings over shaped
links, and the cost model's projection of the latter.

``python -m benchmarks.demo_report --loopback DIR --shaped DIR [--np N] [--runs none,fp16,qsgd8,qsgd4]``

* ``--loopback DIR``: ``<run>.json`` (``examples/pytorch_digits.py --json``) of the horovodrun runs
  on this machine's loopback;
* ``--shaped DIR``: what ``benchmarks.demo_shaped`` wrote: ``shaped.json`` (``kind`` "measured",
  with ``<run>.json`` of the runs over the shaped links, or "projection" and the reason; the rate and
  the hidden width of the shaped runs either way).

Columns: compression; test accuracy, bytes sent per step (one rank's own contribution: the
example's ``bytes_per_step``) and its ratio to float32's, from the loopback runs; milliseconds per
step of the training loop (``train_time_s / steps``: the example's timed loop, evaluation excluded;
the loop's seconds beside it) on loopback and over the shaped links (measured); and the cost
model's projection of a step over the shaped links. Times per step compare runs of different
lengths. Where the shaped runs train a wider MLP than the loopback runs, their columns say so and
the notes give their bytes per step.

The projection (``projection``), for the shaped runs' model, is made without running anything
distributed, as ``benchmarks.e2e_model.predict`` makes its own: a step is the CPU time of one rank
times the ranks per core of this machine (the ranks share its cores) plus the cost model's time of
the step's exchanges. The CPU time (``time_parts``) is timed here, in one process on one thread: the
example's MLP (its own class) doing zero_grad, forward and backward of a batch of 32 and an SGD step
with momentum (median of a few), plus for fp16 the casts of every gradient to float16 and back, and
for QSGD(b) the codec work of each quantized gradient as ``e2e_model.compute_seconds`` counts it
for the reduction the gradient goes by (encode, and n decodes for allgather; for scatter_allgather
1 + 1/n encodes and 2 decodes). The exchanges (``comm_seconds``) are priced per gradient as
``e2e_model`` prices a step, with ``hvd_qsgd.cost_model.seconds`` at its default latency and the
link's nominal rate, no overlap with computation: for none / fp16 a ring allreduce of 4 / 2 bytes
per element of every gradient; for QSGD(b) the allgather or scatter_allgather of each quantized
gradient's ``codec.payload_nbytes`` (the reduction the library default "auto" resolves to) plus its
control vector, and a float32 allreduce of the gradients left uncompressed.
"""
import argparse
import json
import os
import statistics
import sys
import time

from benchmarks import e2e_model
from benchmarks.common import REPO_ROOT
from benchmarks.netns import parse_rate

RUNS = {"none": ("none", None), "fp16": ("fp16", None), "qsgd8": ("qsgd", 8), "qsgd4": ("qsgd", 4)}
N_IN, N_OUT = 64, 10  # the digits MLP: 64-H-H-10
BATCH = 32            # the example's per-rank batch


def digits_shapes(hidden):
    """(name, numel) of the example's MLP parameters, in named_parameters() order."""
    h = hidden
    return [("fc1.weight", N_IN * h), ("fc1.bias", h), ("fc2.weight", h * h), ("fc2.bias", h),
            ("fc3.weight", N_OUT * h), ("fc3.bias", N_OUT)]


def hidden_of(result):
    """The hidden width of a run, from its float32 bytes per step: 4 (H^2 + 76 H + 10)."""
    numel = result["bytes_per_step_none"] // 4
    for h in range(1, 1 << 16):
        n = sum(d for _, d in digits_shapes(h))
        if n == numel:
            return h
        if n > numel:
            break
    raise ValueError(f"no hidden width gives {numel} parameters")


def check_defaults(result):
    """The projection prices QSGD at the compressor's defaults (the example's): say so if a run is not."""
    if result["compression"] == "qsgd":
        expected = e2e_model.qsgd_settings(result["bits"])
        if (result["bucket_size"], result["min_numel"]) != expected:
            raise ValueError(f"the projection prices QSGD({result['bits']}) with bucket size and min_numel "
                             f"{expected}; this run has {(result['bucket_size'], result['min_numel'])}")


def _qsgd_mode(bits, n, numel):
    """e2e_model's mode name for one quantized gradient: the reduction the library's default picks."""
    from hvd_qsgd.settings import Settings

    settings = Settings.make(bits=bits)
    reduction = settings.exchange_reduction(n, numel) if hasattr(settings, "exchange_reduction") \
        else settings.reduction
    return f"qsgd{bits}-" + ("allgather" if reduction == "allgather" else "scatter")


def plan(run, n, hidden):
    """[(e2e_model mode, [(name, numel)])]: how each gradient of ``run`` is exchanged on n ranks."""
    compression, bits = RUNS[run]
    shapes = digits_shapes(hidden)
    if bits is None:
        return [(compression, shapes)]
    _, min_numel = e2e_model.qsgd_settings(bits)
    # the gradients QSGD leaves uncompressed go through Horovod's float32 allreduce, as with none
    return [(_qsgd_mode(bits, n, d) if d >= min_numel else "none", [(name, d)]) for name, d in shapes]


def comm_seconds(run, n, hidden, rate_bps):
    """The cost model's seconds of one step's exchanges at ``rate_bps`` bit/s (default latency)."""
    from hvd_qsgd import cost_model

    return sum(e2e_model.model_comm_seconds(mode, n, shapes, cost_model.LATENCY_S, rate_bps)
               for mode, shapes in plan(run, n, hidden))


def wire_bytes(run, n, hidden):
    """The cost model's bytes one rank receives per step."""
    return sum(e2e_model.model_wire_bytes(mode, n, shapes) for mode, shapes in plan(run, n, hidden))


def time_parts(hidden, runs, rounds=3):
    """One rank's CPU parts of a step of the example's MLP, timed here on one thread: ``compute_s``
    (median step), ``cast_s`` (fp16 casts of every gradient), and per quantized gradient and bits
    the codec times of ``e2e_model.time_codec`` (``codec[name]``: encode_s, decode1_s)."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    from pytorch_digits import MLP

    torch.set_num_threads(1)
    from hvd_qsgd import codec
    codec.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP(hidden=hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(BATCH, N_IN), torch.randint(0, N_OUT, (BATCH,))
    steps = []
    for i in range(1 + rounds):  # the first step allocates the gradients and momentum buffers
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if i:
            steps.append(time.perf_counter() - t0)
    grads = {name: p.grad for name, p in model.named_parameters()}
    bits = sorted({RUNS[r][1] for r in runs if RUNS[r][1] is not None})
    parts = dict(hidden=hidden, compute_s=statistics.median(steps), cast_s=0.0, codec={})
    if "fp16" in runs:
        parts["cast_s"] = statistics.median(
            e2e_model.time_codec(list(grads.values()), [], 2, True)["cast_s"] for _ in range(rounds))
    for b in bits:
        _, min_numel = e2e_model.qsgd_settings(b)
        for name, g in grads.items():
            if g.numel() >= min_numel:
                timed = [e2e_model.time_codec([g], [b], 2, False) for _ in range(rounds)]
                entry = parts["codec"].setdefault(name, dict(encode_s={}, decode1_s={}))
                for key in ("encode_s", "decode1_s"):
                    entry[key][str(b)] = statistics.median(t[key][str(b)] for t in timed)
    return parts


def cpu_seconds(run, n, parts):
    """One rank's CPU time of a step: compute, plus the fp16 casts or each gradient's codec work."""
    compression, bits = RUNS[run]
    t = parts["compute_s"]
    if compression == "fp16":
        return t + parts["cast_s"]
    for mode, shapes in plan(run, n, parts["hidden"]):
        if e2e_model.mode_bits(mode) is not None:
            (name, _), = shapes
            comp = dict(compute_s=0.0, cast_s=0.0, **parts["codec"][name])
            t += e2e_model.compute_seconds(mode, n, comp)
    return t


def ranks_per_core(n, cores=None):
    """How many ranks share a core here (at least 1): n ranks on this machine's cores."""
    return max(1.0, n / (cores or os.cpu_count() or 1))


def projection(run, n, rate_bps, parts, cores=None):
    """The projected step: dict(cpu_s, share, comm_s, step_s = share * cpu_s + comm_s)."""
    cpu = cpu_seconds(run, n, parts)
    share = ranks_per_core(n, cores)
    comm = comm_seconds(run, n, parts["hidden"], rate_bps)
    return dict(cpu_s=cpu, share=share, comm_s=comm, step_s=share * cpu + comm)


def load_runs(directory, runs):
    out = {}
    for run in runs:
        with open(os.path.join(directory, f"{run}.json")) as f:
            out[run] = json.load(f)
    return out


def label(r):
    return f"QSGD({r['bits']})" if r["compression"] == "qsgd" else r["compression"]


def run_label(run):
    compression, bits = RUNS[run]
    return f"QSGD({bits})" if bits else compression


def ms_per_step(r):
    return 1e3 * r["train_time_s"] / r["steps"]


def _cell(ms, seconds=None):
    """Milliseconds per step, and the whole loop's seconds where given."""
    return f"{ms:.0f}" + ("" if seconds is None else f" ({seconds:.1f} s)")


def _grid(head, body):
    w = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(cells)) + " |"
    return [line(head), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(b) for b in body]


def _same_model(a, b):
    """Whether two runs train the same model the same way (their lengths may differ)."""
    keys = ("np", "batch_size", "lr", "momentum", "seed", "bytes_per_step_none", "bytes_per_step")
    return all(a[k] == b[k] for k in keys)


def render(loopback, shaped_record, shaped=None, np_=None, parts=None, cores=None):
    """The table and its notes, as lines; and the problems (runs whose ranks' parameters differ).

    ``parts``: ``time_parts`` of the shaped runs' model, for the projection column (None: none)."""
    runs = list(loopback)
    first = loopback[runs[0]]
    n = np_ or first["np"]
    rate = shaped_record["rate"]
    rate_bps = parse_rate(rate)
    rate_name = f"{rate_bps / 1e9:g} Gbit/s" if rate_bps >= 1e9 else f"{rate_bps / 1e6:g} Mbit/s"
    measured = shaped_record["kind"] == "measured"
    h = hidden_of(first)
    hs = hidden_of(shaped[runs[0]]) if measured else shaped_record["hidden"]
    same_model = measured and all(_same_model(loopback[r], shaped[r]) for r in runs)
    wider = "" if hs == h else f" (hidden {hs})"
    proj = {r: projection(r, n, rate_bps, parts, cores) for r in runs} if parts is not None else None
    if proj is not None and parts["hidden"] != hs:
        raise ValueError(f"the projection's parts are of hidden {parts['hidden']}, the shaped runs' {hs}")

    head = ["compression", "test accuracy", "bytes sent per step", "ratio vs none", "loopback ms/step"]
    if measured:
        head.append(f"{rate_name} ms/step{wider}")
    if proj is not None:
        head.append(f"{rate_name} PROJECTED ms/step{wider}")
    body = []
    for run in runs:
        r = loopback[run]
        # float32's bytes per step are none's: every run knows them
        ratio = "1.000" if run == "none" else \
            f"{r['bytes_per_step'] / r['bytes_per_step_none']:.3f} " \
            f"({r['bytes_per_step_none'] / r['bytes_per_step']:.1f}x less)"
        row = [label(r), f"{r['test_accuracy']:.4f}", f"{r['bytes_per_step']:,}", ratio,
               _cell(ms_per_step(r), r["train_time_s"])]
        if measured:
            row.append(_cell(ms_per_step(shaped[run]), shaped[run]["train_time_s"]))
        if proj is not None:
            row.append(_cell(1e3 * proj[run]["step_s"]))
        body.append(row)

    lines = [f"[demo] digits MLP 64-{h}-{h}-10 on {n} ranks; loopback: horovodrun --gloo on this machine, "
             f"{first['epochs']} epochs, {first['steps']} steps; bytes sent per step by one rank; "
             "ms/step: the training loop's time / steps (its seconds in brackets)"]
    if measured:
        s0 = shaped[runs[0]]
        if same_model:
            what = "the same runs" + ("" if s0["steps"] == first["steps"] else f", shorter: {s0['steps']} steps")
        elif hs != h:
            what = (f"the same trainings of a 64-{hs}-{hs}-10 MLP, NOT the loopback runs' model "
                    f"({s0['bytes_per_step_none']:,} bytes of float32 gradient a step, so that the exchange is "
                    f"a real share of the step), {s0['steps']} steps each")
        else:
            what = f"runs NOT set up as the loopback runs, {s0['steps']} steps each"
        lines.append(f"[demo] {rate_name}: {what}; {n} ranks in network namespaces, every rank's link shaped to "
                     f"{rate} full duplex (tc tbf); measured")
    else:
        lines.append(f"[demo] NO shaped-link runs ({shaped_record['reason']})")
    if proj is not None:
        from hvd_qsgd import cost_model

        share = proj[runs[0]]["share"]
        lines.append(f"[demo] {rate_name} PROJECTED: a cost-model projection, not a measurement, of a step of the "
                     f"64-{hs}-{hs}-10 MLP on {n} ranks: one rank's CPU time (its step, and the codec or the fp16 "
                     f"casts, timed here on one thread) x {share:g} ranks per core of this machine + "
                     f"hvd_qsgd.cost_model time of the step's exchanges at {rate_name} "
                     f"({cost_model.LATENCY_S * 1e6:g} us latency, the full rate, no overlap)")
    lines += _grid(head, body)

    if measured:
        s = [shaped[r] for r in runs]
        if "none" in runs:
            lines.append(f"[demo] {rate_name}: speed-up vs none per step: " + ", ".join(
                f"{label(shaped[r])} {ms_per_step(shaped['none']) / ms_per_step(shaped[r]):.2f}x"
                for r in runs if r != "none"))
        if same_model:
            lines.append("[demo] time the link added per step (shaped - loopback): " + ", ".join(
                f"{label(loopback[r])} {ms_per_step(shaped[r]) - ms_per_step(loopback[r]):+.0f} ms"
                for r in runs))
        else:
            lines.append(f"[demo] the {rate_name} runs' bytes sent per step: " + ", ".join(
                f"{label(x)} {x['bytes_per_step']:,}" for x in s))
        lines.append(f"[demo] the {rate_name} runs' test accuracy after {s0['steps']} steps: " + ", ".join(
            f"{label(x)} {x['test_accuracy']:.4f}" for x in s))
        lines.append("[demo] rank 0's link carried per step of the training loop (frames: headers and Horovod's "
                     "coordination included): " + ", ".join(
                         f"{label(x)} {x['link']['tx_bytes'] / x['steps'] / 1e6:.2f} MB out" for x in s))
    if proj is not None:
        lines.append("[demo] PROJECTED per step: " + "; ".join(
            f"{run_label(r)}: {p['share']:g} x {1e3 * p['cpu_s']:.1f} ms CPU + {1e3 * p['comm_s']:.1f} ms link"
            for r, p in proj.items()))
    q = [run for run in runs if loopback[run]["compression"] == "qsgd"]
    if q:
        r = loopback[q[-1]]
        raw = r["stats"]["raw_elements"] // r["steps"]
        lines.append(f"[demo] QSGD quantizes {', '.join(r['quantized'])} (tensors of >= {r['min_numel']:,} "
                     f"elements); the other {raw:,} gradient elements go as float32, and each quantized tensor "
                     f"adds a control vector ({r['control_bytes_per_step']:,} bytes per step, not counted above)")
        if measured and not same_model:
            lines.append(f"[demo] in the {rate_name} runs QSGD quantizes {', '.join(shaped[q[-1]]['quantized'])}")
    problems = [f"{label(r)} ({where})" for where, rs in (("loopback", loopback), ("shaped", shaped or {}))
                for r in rs.values() if not r["params_identical"]]
    if not problems:
        lines.append(f"[demo] all runs ended with bit-identical parameters on all {n} ranks")
    if "none" in loopback and loopback["none"]["test_accuracy"] <= 0.95:
        lines.append(f"[demo] warning: uncompressed accuracy {loopback['none']['test_accuracy']:.4f} <= 0.95 "
                     "(raise DEMO_EPOCHS)")
    return lines, problems


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.demo_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--loopback", required=True)
    p.add_argument("--shaped", required=True)
    p.add_argument("--np", type=int, default=None)
    p.add_argument("--runs", default=",".join(RUNS))
    args = p.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise SystemExit(f"[demo] unknown runs {unknown}; known: {', '.join(RUNS)}")
    loopback = load_runs(args.loopback, runs)
    with open(os.path.join(args.shaped, "shaped.json")) as f:
        record = json.load(f)
    shaped = load_runs(args.shaped, runs) if record["kind"] == "measured" else None
    for r in list(loopback.values()) + list((shaped or {}).values()):
        check_defaults(r)
    hidden = hidden_of(shaped[runs[0]]) if shaped else record["hidden"]
    lines, problems = render(loopback, record, shaped, args.np, time_parts(hidden, runs))
    print("\n".join(lines))
    if problems:
        print(f"[demo] error: parameters differ across ranks in: {', '.join(problems)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
