"""``python -m benchmarks nodes``: a projection (not a measurement) of the gradient exchange of one
data-parallel training step on c nodes of L GPUs, for fp16 allreduce and QSGD's three reductions.

    python -m benchmarks nodes --json docs/nodes_projection.json --png docs/nodes_projection.png
    python -m benchmarks nodes --model resnet50 --layouts 2x8 --rates 100 --compute-ms 30

Nothing runs on a network or a GPU: every number comes from the formulas below, the package's cost
model and the codec kernel times measured on one GPU. The output says PROJECTED on every table.

The gradients (``--model``): ``mlp50m``, the e2e benchmark's MLP (``benchmarks.e2e_model.param_shapes``
with width 4096 and depth 3: 8 tensors, 50,384,906 parameters), or ``resnet50``, ResNet-50's 161
parameter tensors (25,557,032 parameters; the bottleneck network of He et al. with 1000 classes,
its shapes written out by ``resnet50_shapes``; batch-norm statistics are buffers, not gradients).

The network. The n = c L ranks sit on c nodes of L consecutive ranks. A node's link to the network
has rate R (``--rates``, Gbit/s, full duplex, beta = R/8 bytes/s) shared by its L ranks; inside the
node the GPUs talk at beta_i (``--intra-gbps``, 3600 Gbit/s by default: NVLink's 450 GB/s each
way). Every message costs alpha (``--latency-us``, default ``hvd_qsgd.cost_model.LATENCY_S``).

    fp16 (lower bound)  Horovod's fp16 allreduce as a hierarchical ring: the node's reduce-scatter,
                        a ring across the nodes, the node's allgather, on 2d bytes per tensor of d
                        elements: B_x = 2 (c-1)/c 2d leaves (and enters) each node, B_i = 2 (L-1)/L
                        2d per rank inside it, m = 2(L-1) + 2(c-1) messages. NCCL's hierarchical and
                        tree algorithms approach this bound; no fp16 allreduce moves fewer bytes.
    fp16-ring           one flat ring over the n ranks: B_x = 2 (n-1)/n 2d crosses each node link
                        (the ring enters and leaves each node once), m = 2(n-1), nothing separate
                        inside the node.
    qsgd<b>-allgather, qsgd<b>-scatter, qsgd<b>-hierarchical
                        every tensor of >= min_numel elements: ``cost_model.node_costs`` and
                        ``cost_model.seconds_in_nodes`` (allgather, scatter_allgather,
                        hierarchical) with the package's payloads (``codec.payload_nbytes``); the
                        smaller tensors (float32) and the control vectors (one float64 vector of
                        ``protocol.control_length(n)`` entries per compressed tensor, one grouped
                        allreduce per step) go through the same allreduce as fp16's row.

An allreduce is fused as Horovod's tensor fusion does it: one collective per ``--fusion-mb`` (64 MiB)
of the step's allreduced bytes, paying its messages once; each QSGD tensor is an exchange of its own.
A row's exchange time is the sum of its collectives' times, T = m alpha + B_x / beta + B_i / beta_i.

The codec, on the GPU (QSGD rows only). Encode and decode times come from the measured CUDA rows of
``--kernels`` (default ``docs/gpu_h100_kernels.json``, an H100; ``docs/gpu_h200_kernels.json`` is in
the same format): for the bit width given, max norm, fixed coding, the encode and decode throughput
(GB/s of fp32 input) at each measured size s_k, i.e. the times t_k = 4 s_k / throughput. Between two
measured sizes the time is linear in the size; below the smallest it is the smallest size's time
(the kernels' fixed cost: a call on 1M elements takes about 100 us); above the largest the largest
size's throughput holds. A decode-sum of k payloads of s elements is one kernel call
(``qsgd_decode_sum_cuda``), priced as a decode of k s elements. Per compressed tensor of d elements:

    allgather           encode(d) + decode(n d)                    (decode-sum of the n payloads)
    scatter_allgather   encode(d) + decode(d) + encode(d/n) + decode(d)
                        (the n chunk payloads, the decode-sum of the n received chunks of d/n, the
                        reduced chunk re-encoded, the n reduced chunks decoded; as ``benchmarks.e2e``)
    hierarchical        encode(d/L) + decode(c d/L)                (the shard, the c shard payloads)
                        encode(d/L) + decode(d/L) + encode(d/(Lc)) + decode(d/L) where the cross stage
                        is scatter_allgather (``cost_model.cross_stage``)

Not counted: fp16's casts and the hierarchical node sum (float32 additions: memory-bound, about
0.1 ms for 50M parameters on an H100, in QSGD's disfavour left out), and any overlap: a step is
``--compute-ms`` + exchange + codec, in sequence (compute 0 by default: the exchange alone).
"""
import argparse
import json
import math
import os
import sys

from benchmarks.common import REPO_ROOT, module_main

DEFAULT_KERNELS = os.path.join("docs", "gpu_h100_kernels.json")
PROJECTED = "PROJECTED (not measured)"
MB = 1e6


def _layouts(text):
    out = []
    for item in text.split(","):
        try:
            c, L = (int(v) for v in item.lower().split("x"))
        except ValueError:
            c = L = 0
        if c < 1 or L < 1 or c * L < 2:
            raise argparse.ArgumentTypeError(f"a layout is NODESxGPUS with at least 2 ranks in all, got {item!r}")
        out.append((c, L))
    return out


def _rates(text):
    try:
        out = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or any(not (math.isfinite(v) and v > 0) for v in out):
        raise argparse.ArgumentTypeError(f"rates are positive numbers of Gbit/s, comma-separated, got {text!r}")
    return out


def add_arguments(p):
    p.add_argument("--model", choices=("mlp50m", "resnet50"), default="mlp50m",
                   help="whose gradients (default %(default)s: the e2e benchmark's MLP, width 4096, depth 3)")
    p.add_argument("--layouts", type=_layouts, default="2x8,4x8,16x8",
                   help="NODESxGPUS, comma-separated (default %(default)s)")
    p.add_argument("--rates", type=_rates, default="25,100,400", help="node link rates, Gbit/s (default %(default)s)")
    p.add_argument("--intra-gbps", type=float, default=3600.0,
                   help="the link inside a node, Gbit/s each way (default %(default)s: NVLink, 450 GB/s)")
    p.add_argument("--latency-us", type=float, default=None,
                   help="alpha, seconds per message in us (default: hvd_qsgd.cost_model.LATENCY_S)")
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="forward + backward + optimizer per step, ms (default 0: exchange and codec only)")
    p.add_argument("--bits", type=int, choices=(2, 4, 8), default=4, help="QSGD bits (default %(default)s)")
    p.add_argument("--bucket-size", type=int, default=None, help="default: hvd_qsgd.settings.default_bucket_size")
    p.add_argument("--min-numel", type=int, default=None, help="default: hvd_qsgd.settings.Settings().min_numel")
    p.add_argument("--fusion-mb", type=float, default=64.0, help="Horovod's fusion buffer, MiB (default %(default)s)")
    p.add_argument("--kernels", default=DEFAULT_KERNELS, help="measured GPU kernel figures (default %(default)s)")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--png", help="plot projected step time against node link rate here")


# ---- the gradients -------------------------------------------------------------------------------
def resnet50_shapes():
    """(name, numel) of ResNet-50's 161 parameter tensors in named_parameters() order: a 7x7 stem,
    stages of 3, 4, 6, 3 bottleneck blocks (1x1, 3x3, 1x1 convolutions without bias, each followed by
    a batch norm's weight and bias; the first block of a stage has a 1x1 projection and its batch
    norm), and a 2048 -> 1000 linear head."""
    shapes = [("conv1.weight", 64 * 3 * 7 * 7), ("bn1.weight", 64), ("bn1.bias", 64)]
    inplanes = 64
    for stage, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for b in range(blocks):
            at = f"layer{stage}.{b}."
            cin = inplanes if b == 0 else 4 * planes
            for i, (w, cout) in enumerate(((cin * planes, planes), (planes * planes * 9, planes),
                                           (planes * 4 * planes, 4 * planes)), start=1):
                shapes += [(f"{at}conv{i}.weight", w), (f"{at}bn{i}.weight", cout), (f"{at}bn{i}.bias", cout)]
            if b == 0:
                shapes += [(f"{at}downsample.0.weight", cin * 4 * planes),
                           (f"{at}downsample.1.weight", 4 * planes), (f"{at}downsample.1.bias", 4 * planes)]
        inplanes = 4 * planes
    return shapes + [("fc.weight", 1000 * 2048), ("fc.bias", 1000)]


def model_shapes(name):
    if name == "resnet50":
        return resnet50_shapes()
    from benchmarks.e2e_model import param_shapes
    return param_shapes(4096, 3)


# ---- the codec's times, from measured kernels ----------------------------------------------------
def load_kernels(path, bits):
    """[(numel, encode_s, decode_s)], ascending, of the measured CUDA rows of a kernels JSON for
    ``bits`` (max norm, fixed coding, no variant); ValueError where there are none."""
    with open(path) as f:
        data = json.load(f)
    cuda = data.get("cuda") or {}
    gb = float((data.get("config") or {}).get("gb", 1e9))
    points = sorted((int(r["numel"]), 4 * r["numel"] / (r["encode_gbps"] * gb),
                     4 * r["numel"] / (r["decode_gbps"] * gb))
                    for r in cuda.get("rows", []) if r.get("bits") == bits and r.get("norm") == "max"
                    and not r.get("variant") and r.get("encode_gbps") and r.get("decode_gbps"))
    if not cuda.get("measured") or not points:
        raise ValueError(f"{path}: no measured CUDA encode/decode rows for {bits} bits, max norm")
    return points


def kernel_seconds(points, column, numel):
    """Time of a kernel (column 1: encode, 2: decode) on ``numel`` elements: linear in the size
    between measured sizes, the smallest size's time below them, the largest size's throughput above."""
    if numel <= 0:
        return 0.0
    sizes = [p[0] for p in points]
    if numel <= sizes[0]:
        return points[0][column]
    if numel >= sizes[-1]:
        return points[-1][column] * numel / sizes[-1]
    k = next(i for i in range(1, len(sizes)) if numel < sizes[i])
    lo, hi = points[k - 1], points[k]
    return lo[column] + (numel - lo[0]) / (hi[0] - lo[0]) * (hi[column] - lo[column])


def codec_seconds(reduction, d, per_node, nodes, points, cross_scatter=False):
    """Encode and decode time on one rank for one compressed tensor of d elements (module docstring);
    ``cross_scatter``: the hierarchical reduction's cross stage is scatter_allgather."""
    n = per_node * nodes
    enc = lambda m: kernel_seconds(points, 1, m)  # noqa: E731
    dec = lambda m: kernel_seconds(points, 2, m)  # noqa: E731
    if reduction == "allgather":
        return enc(d) + dec(n * d)
    if reduction == "scatter_allgather":
        return enc(d) + dec(d) + enc(-(-d // n)) + dec(d)
    shard = -(-d // per_node)
    if cross_scatter:
        return enc(shard) + dec(shard) + enc(-(-shard // nodes)) + dec(shard)
    return enc(shard) + dec(nodes * shard)


# ---- the exchange --------------------------------------------------------------------------------
def allreduce_costs(nbytes, per_node, nodes, flat, fusion_bytes):
    """(messages, bytes leaving a node, bytes a rank moves inside its node) of a fused allreduce of
    ``nbytes``: one flat ring, or the hierarchical ring's lower bound (module docstring)."""
    if nbytes <= 0:
        return 0, 0.0, 0.0
    n, buffers = per_node * nodes, math.ceil(nbytes / fusion_bytes)
    if flat:
        return buffers * 2 * (n - 1), 2 * (n - 1) / n * nbytes, 0.0
    return (buffers * (2 * (per_node - 1) + 2 * (nodes - 1)), 2 * (nodes - 1) / nodes * nbytes,
            2 * (per_node - 1) / per_node * nbytes)


def methods(bits):
    return {"fp16": None, "fp16-ring": None, f"qsgd{bits}-allgather": "allgather",
            f"qsgd{bits}-scatter": "scatter_allgather", f"qsgd{bits}-hierarchical": "hierarchical"}


def project_layout(cfg, shapes, nodes, per_node, rate_gbps):
    """{method: numbers} of one layout and node link rate."""
    from hvd_qsgd import cost_model, protocol

    alpha, beta, beta_i = cfg["alpha_s"], rate_gbps * 1e9 / 8, cfg["intra_gbps"] * 1e9 / 8
    n, fusion = nodes * per_node, cfg["fusion_bytes"]
    big = [d for _, d in shapes if d >= cfg["min_numel"]]
    rest = 4 * sum(d for _, d in shapes if d < cfg["min_numel"]) + 8 * protocol.control_length(n) * len(big)
    out = {}
    for method, reduction in methods(cfg["bits"]).items():
        if reduction is None:
            ar = allreduce_costs(2 * sum(d for _, d in shapes), per_node, nodes, method == "fp16-ring", fusion)
            parts, codec_s = [], 0.0
        else:
            ar = allreduce_costs(rest, per_node, nodes, False, fusion)
            parts = [cost_model.node_costs(reduction, per_node, nodes, d, cfg["bits"], cfg["bucket_size"], alpha, beta)
                     for d in big]
            codec_s = sum(codec_seconds(reduction, d, per_node, nodes, cfg["points"],
                                        cross_scatter=reduction == "hierarchical" and cost_model.cross_stage(
                                            per_node, nodes, -(-d // per_node), cfg["bits"], cfg["bucket_size"],
                                            alpha, beta) == "scatter_allgather") for d in big)
        qsgd_s = sum(cost_model.seconds_in_nodes(reduction, per_node, nodes, d, cfg["bits"], cfg["bucket_size"],
                                                 alpha, beta, beta_i) for d in big) if reduction else 0.0
        comm_s = ar[0] * alpha + ar[1] / beta + ar[2] / beta_i + qsgd_s
        out[method] = dict(
            cross_bytes=ar[1] + sum(p[1] for p in parts), cross_bytes_compressed=sum(p[1] for p in parts),
            cross_bytes_allreduce=ar[1], intra_bytes=ar[2] + sum(p[2] for p in parts),
            messages=ar[0] + sum(p[0] for p in parts), comm_s=comm_s, codec_s=codec_s,
            step_s=cfg["compute_s"] + comm_s + codec_s)
    for row in out.values():
        row["speedup_fp16"] = out["fp16"]["step_s"] / row["step_s"]
        row["speedup_fp16_ring"] = out["fp16-ring"]["step_s"] / row["step_s"]
    return out


def project(cfg, shapes, layouts, rates):
    """Every row: one per layout, rate and method."""
    rows = []
    for nodes, per_node in layouts:
        for rate in rates:
            for method, v in project_layout(cfg, shapes, nodes, per_node, rate).items():
                rows.append(dict(layout=f"{nodes}x{per_node}", nodes=nodes, per_node=per_node, ranks=nodes * per_node,
                                 rate_gbps=rate, method=method, **v))
    return rows


# ---- the report ----------------------------------------------------------------------------------
def settings_of(args):
    from hvd_qsgd import codec, cost_model, settings

    bucket = settings.default_bucket_size(args.bits) if args.bucket_size is None else args.bucket_size
    codec.payload_nbytes(1, args.bits, bucket)  # ValueError for a bucket size the codec refuses
    min_numel = settings.Settings().min_numel if args.min_numel is None else args.min_numel
    alpha = cost_model.LATENCY_S if args.latency_us is None else args.latency_us * 1e-6
    if not args.intra_gbps > 0 or alpha < 0 or args.compute_ms < 0 or not args.fusion_mb > 0 or min_numel < 1:
        raise ValueError("--intra-gbps and --fusion-mb must be > 0, --latency-us and --compute-ms >= 0, "
                         "--min-numel >= 1")
    path = args.kernels if os.path.isabs(args.kernels) or os.path.exists(args.kernels) else \
        os.path.join(REPO_ROOT, args.kernels)
    return dict(model=args.model, bits=args.bits, bucket_size=bucket, min_numel=min_numel, alpha_s=alpha,
                intra_gbps=args.intra_gbps, compute_s=args.compute_ms * 1e-3, fusion_bytes=args.fusion_mb * 2 ** 20,
                kernels=args.kernels, points=load_kernels(path, args.bits))


def assumptions(cfg, shapes):
    big = [d for _, d in shapes if d >= cfg["min_numel"]]
    figures = "; ".join(f"{s / 2 ** 20:g}M: {4 * s / e / 1e9:.1f} / {4 * s / dt / 1e9:.1f}"
                        for s, e, dt in cfg["points"])
    return [
        f"gradients: {cfg['model']}, {len(shapes)} tensors, {sum(d for _, d in shapes):,} parameters; "
        f"QSGD({cfg['bits']}) bucket {cfg['bucket_size']} on the {len(big)} tensors of >= {cfg['min_numel']} "
        f"elements, the other {len(shapes) - len(big)} in float32 allreduce",
        f"alpha {cfg['alpha_s'] * 1e6:g} us per message; link inside a node {cfg['intra_gbps']:g} Gbit/s; "
        f"compute {cfg['compute_s'] * 1e3:g} ms per step; "
        f"allreduces fused in {cfg['fusion_bytes'] / 2 ** 20:g} MiB buffers",
        "fp16: hierarchical ring lower bound (node reduce-scatter, ring across nodes, node allgather: "
        "NCCL's hierarchical/tree algorithms approach it); fp16-ring: one flat ring over all ranks",
        "QSGD: hvd_qsgd.cost_model.node_costs / seconds_in_nodes per compressed tensor",
        f"codec: {cfg['kernels']}, CUDA rows, {cfg['bits']} bits, max norm; encode / decode GB/s of fp32 "
        f"input at {figures}; time linear in size between, the smallest size's time below",
        "no overlap: step = compute + exchange + codec; fp16 casts and the node sum not counted",
    ]


def table(rows, layout):
    c, L = rows[0]["nodes"], rows[0]["per_node"]
    lines = [f"**{PROJECTED}**: {layout} ({c} nodes x {L} GPUs, {c * L} ranks), under the assumptions above", "",
             "| node link | method | MB leaving a node | messages | exchange ms | codec ms | step ms "
             "| vs fp16 | vs fp16-ring |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate_gbps']:g} Gbit/s | {r['method']} | {r['cross_bytes'] / MB:.1f} | {r['messages']} "
                     f"| {1e3 * r['comm_s']:.2f} | {1e3 * r['codec_s']:.2f} | {1e3 * r['step_s']:.2f} "
                     f"| {r['speedup_fp16']:.2f}x | {r['speedup_fp16_ring']:.2f}x |")
    return "\n".join(lines)


def plot(path, cfg, shapes, layouts, rates):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    lo, hi = min(rates), max(rates)
    grid = sorted(set(rates) | {lo * (hi / lo) ** (k / 40) for k in range(41)}) if hi > lo else list(rates)
    fig, axes = plt.subplots(1, len(layouts), figsize=(5 * len(layouts), 4.2), squeeze=False)
    for ax, (nodes, per_node) in zip(axes[0], layouts):
        curves = {}
        for rate in grid:
            for method, v in project_layout(cfg, shapes, nodes, per_node, rate).items():
                curves.setdefault(method, []).append(1e3 * v["step_s"])
        for method, ys in curves.items():
            ax.plot(grid, ys, label=method, linestyle="--" if method.startswith("fp16") else "-")
            ax.plot([r for r in grid if r in rates], [y for r, y in zip(grid, ys) if r in rates], "k.", ms=4)
        ax.set(xscale="log", yscale="log", xlabel="node link, Gbit/s", ylabel="projected step time, ms",
               title=f"{nodes} nodes x {per_node} GPUs")
        ax.set_xticks(list(rates), [f"{r:g}" for r in rates])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{PROJECTED}: {cfg['model']}, compute {cfg['compute_s'] * 1e3:g} ms, codec from {cfg['kernels']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args):
    try:
        cfg = settings_of(args)
    except (OSError, ValueError) as e:
        print(f"nodes: {e}", file=sys.stderr)
        return 2
    shapes = model_shapes(args.model)
    rows = project(cfg, shapes, args.layouts, args.rates)
    notes = assumptions(cfg, shapes)
    print(f"# {PROJECTED}: gradient exchange per step on nodes of GPUs\n")
    print("Assumptions:\n" + "\n".join(f"- {a}" for a in notes) + "\n")
    for nodes, per_node in args.layouts:
        layout = f"{nodes}x{per_node}"
        print(table([r for r in rows if r["layout"] == layout], layout) + "\n")
    if args.json:
        out = dict(projected=True, label=PROJECTED, assumptions=notes, rows=rows, tensors=len(shapes),
                   parameters=sum(d for _, d in shapes),
                   kernel_points=[dict(numel=s, encode_s=e, decode_s=d) for s, e, d in cfg["points"]],
                   **{k: v for k, v in cfg.items() if k != "points"})
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        plot(args.png, cfg, shapes, args.layouts, args.rates)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(module_main("nodes", add_arguments, run))
