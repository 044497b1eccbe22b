"""The demo's final table (``scripts/demo.sh``): loopback runs beside the same trainings over shaped
links, and the cost model's projection where it applies.

``python -m benchmarks.demo_report --loopback DIR --shaped DIR [--np N] [--runs none,fp16,qsgd8,qsgd4]``

* ``--loopback DIR``: ``<run>.json`` (``examples/pytorch_digits.py --json``) of the horovodrun runs
  on this machine's loopback;
* ``--shaped DIR``: what ``benchmarks.demo_shaped`` wrote: ``shaped.json`` (``kind`` "measured",
  with ``<run>.json`` of the runs over the shaped links, or "projection" and the reason).

Columns: compression; test accuracy, bytes sent per step (one rank's own contribution: the
example's ``bytes_per_step``) and its ratio to float32's, from the loopback runs; milliseconds per
step of the training loop (``train_time_s / steps``: the example's timed loop, evaluation excluded;
the loop's seconds beside it) on loopback and over the shaped links (measured); and the cost
model's projection of the latter. Times per step compare runs of different lengths. Where the
shaped runs trained a different model (a wider hidden layer), their column says so, the notes give
their bytes per step, and no projection is shown (it is of the loopback runs' model).

The projection (``comm_seconds``) is the loopback run's time per step plus the cost model's time of
one step's exchanges at the link's nominal rate (``hvd_qsgd.cost_model.seconds`` with its default
latency, priced per gradient as ``benchmarks.e2e_model`` prices a step; no overlap with
computation): for ``none`` / ``fp16`` a ring allreduce of 4 / 2 bytes per element of every gradient,
for QSGD(b) the allgather or scatter_allgather (the one the compressor's ``exchange_reduction``
resolves to, the library default "auto") of each quantized gradient's ``codec.payload_nbytes`` plus
its control vector, and a float32 allreduce of the others. The loopback time already holds the
(fast) loopback exchange, so the projection counts that part twice; it assumes the link delivers its
full rate, and prices no per-operation overhead beyond the model's latency.
"""
import argparse
import json
import os
import sys

from benchmarks import e2e_model
from benchmarks.netns import parse_rate

RUNS = ("none", "fp16", "qsgd8", "qsgd4")
N_IN, N_OUT = 64, 10  # the digits MLP: 64-H-H-10


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


def _qsgd_mode(result, n, numel):
    """e2e_model's mode name for one quantized gradient of ``result``'s compressor."""
    from hvd_qsgd.settings import Settings

    settings = Settings.make(bits=result["bits"], bucket_size=result["bucket_size"], min_numel=result["min_numel"])
    if (settings.bucket_size, settings.min_numel) != e2e_model.qsgd_settings(settings.bits):
        raise ValueError("the projection prices the compressor's default bucket size and min_numel; "
                         f"this run has {settings}")
    reduction = settings.exchange_reduction(n, numel) if hasattr(settings, "exchange_reduction") \
        else settings.reduction
    return f"qsgd{settings.bits}-" + ("allgather" if reduction == "allgather" else "scatter")


def modes_per_tensor(result, n):
    """[(e2e_model mode, [(name, numel)])]: how each gradient of the run is exchanged."""
    shapes = digits_shapes(hidden_of(result))
    if result["compression"] in ("none", "fp16"):
        return [(result["compression"], shapes)]
    if result["compression"] != "qsgd":
        raise ValueError(f"no projection for compression {result['compression']!r}")
    # the tensors QSGD leaves uncompressed go through Horovod's float32 allreduce, as with none
    return [(_qsgd_mode(result, n, d) if d >= result["min_numel"] else "none", [(name, d)]) for name, d in shapes]


def comm_seconds(result, n, rate_bps):
    """The cost model's seconds of one step's exchanges at ``rate_bps`` bit/s (default latency)."""
    from hvd_qsgd import cost_model

    return sum(e2e_model.model_comm_seconds(mode, n, shapes, cost_model.LATENCY_S, rate_bps)
               for mode, shapes in modes_per_tensor(result, n))


def wire_bytes(result, n):
    """The cost model's bytes one rank receives per step."""
    return sum(e2e_model.model_wire_bytes(mode, n, shapes) for mode, shapes in modes_per_tensor(result, n))


def projected_seconds(result, n, rate_bps):
    """The loopback run's training time plus every step's modelled exchange at ``rate_bps``."""
    return result["train_time_s"] + result["steps"] * comm_seconds(result, n, rate_bps)


def load_runs(directory, runs):
    out = {}
    for run in runs:
        with open(os.path.join(directory, f"{run}.json")) as f:
            out[run] = json.load(f)
    return out


def label(r):
    return f"QSGD({r['bits']})" if r["compression"] == "qsgd" else r["compression"]


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


def render(loopback, shaped_record, shaped=None, np_=None):
    """The table and its notes, as lines; and the problems (runs whose ranks' parameters differ).

    Times are per step (the training loop's seconds / steps) with the loop's seconds beside them,
    so runs of different lengths compare; the projection is of the loopback runs, shown where the
    shaped runs trained the same model (or where there are none)."""
    runs = list(loopback)
    base = loopback["none"] if "none" in loopback else None
    first = loopback[runs[0]]
    n = np_ or first["np"]
    rate = shaped_record["rate"]
    rate_bps = parse_rate(rate)
    rate_name = f"{rate_bps / 1e9:g} Gbit/s" if rate_bps >= 1e9 else f"{rate_bps / 1e6:g} Mbit/s"
    measured = shaped_record["kind"] == "measured"
    same_model = measured and all(_same_model(loopback[r], shaped[r]) for r in runs)
    project = same_model or not measured
    hs = hidden_of(shaped[runs[0]]) if measured else None
    head = ["compression", "test accuracy", "bytes sent per step", "ratio vs none", "loopback ms/step"]
    if measured:
        head.append(f"{rate_name} ms/step" + ("" if same_model else f" (hidden {hs})"))
    if project:
        head.append(f"{rate_name} PROJECTED ms/step")
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
        if project:
            row.append(_cell(ms_per_step(r) + 1e3 * comm_seconds(r, n, rate_bps)))
        body.append(row)

    h = hidden_of(first)
    lines = [f"[demo] digits MLP 64-{h}-{h}-10 on {n} ranks; loopback: horovodrun --gloo on this machine, "
             f"{first['epochs']} epochs, {first['steps']} steps; bytes sent per step by one rank; "
             "ms/step: the training loop's time / steps (its seconds in brackets)"]
    if measured:
        s0 = shaped[runs[0]]
        if same_model:
            what = "the same runs" + ("" if s0["steps"] == first["steps"] else f", shorter: {s0['steps']} steps")
        else:
            what = (f"the same trainings of a 64-{hs}-{hs}-10 MLP, NOT the loopback runs' model "
                    f"({s0['bytes_per_step_none']:,} bytes of float32 gradient a step, so that the exchange is "
                    f"a real share of the step), {s0['steps']} steps each")
        lines.append(f"[demo] {rate_name}: {what}; {n} ranks in network namespaces, every rank's link shaped to "
                     f"{rate} full duplex (tc tbf); measured")
    else:
        lines.append(f"[demo] NO shaped-link runs ({shaped_record['reason']})")
    if project:
        lines.append(f"[demo] {rate_name} PROJECTED: a cost-model projection, not a measurement: loopback ms/step "
                     f"+ hvd_qsgd.cost_model time of one step's exchanges at {rate_name} (50 us latency, the "
                     "full rate, no overlap)")
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
        if same_model and "none" in runs:
            added = ms_per_step(shaped["none"]) - ms_per_step(loopback["none"])
            model = 1e3 * comm_seconds(loopback["none"], n, rate_bps)
            if added > 0:
                lines.append(f"[demo] none's link time per step, model / measured: {model:.0f} ms / {added:.0f} ms "
                             f"(the exchange got {min(1.0, model / added):.2f} of the nominal rate)")
    q = [loopback[r] for r in runs if loopback[r]["compression"] == "qsgd"]
    if q:
        r = q[-1]
        raw = r["stats"]["raw_elements"] // r["steps"]
        lines.append(f"[demo] QSGD quantizes {', '.join(r['quantized'])} (tensors of >= {r['min_numel']:,} "
                     f"elements); the other {raw:,} gradient elements go as float32, and each quantized tensor "
                     f"adds a control vector ({r['control_bytes_per_step']:,} bytes per step, not counted above)")
    problems = [f"{label(r)} ({where})" for where, rs in (("loopback", loopback), ("shaped", shaped or {}))
                for r in rs.values() if not r["params_identical"]]
    if not problems:
        lines.append(f"[demo] all runs ended with bit-identical parameters on all {n} ranks")
    if base is not None and base["test_accuracy"] <= 0.95:
        lines.append(f"[demo] warning: uncompressed accuracy {base['test_accuracy']:.4f} <= 0.95 (raise DEMO_EPOCHS)")
    return lines, problems


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.demo_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--loopback", required=True)
    p.add_argument("--shaped", required=True)
    p.add_argument("--np", type=int, default=None)
    p.add_argument("--runs", default=",".join(RUNS))
    args = p.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    loopback = load_runs(args.loopback, runs)
    with open(os.path.join(args.shaped, "shaped.json")) as f:
        record = json.load(f)
    shaped = load_runs(args.shaped, runs) if record["kind"] == "measured" else None
    lines, problems = render(loopback, record, shaped, args.np)
    print("\n".join(lines))
    if problems:
        print(f"[demo] error: parameters differ across ranks in: {', '.join(problems)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
