"""The model's side of ``python -m benchmarks e2e``: the compression modes, the MLP every rank
trains, the timing of its compute and codec parts, and the cost model's price of a step
(``hvd_qsgd.cost_model``): the link efficiency fitted on a job's none point, the predictions of the
measured points and the projection to other rank counts and rates. The definitions are in the
docstring of ``benchmarks.e2e``."""
import re
import statistics
import time

from benchmarks.netns import parse_rate

CLASSES = 10
PROJECT_N = 16
PROJECT_RATES = ("10gbit", "25gbit", "100gbit")
REDUCTION_OF = {"allgather": "allgather", "scatter": "scatter_allgather", "hierarchical": "hierarchical"}
MODE = re.compile(r"^(none|fp16|qsgd([1-8])-(allgather|scatter|hierarchical)(-buffered([1-9][0-9]*)?)?(-overlap)?)$")
BUFFER_MB = 64   # fusion_mb of the "-buffered" modes without a size
FLAT_MODEL = ("allgather", "scatter_allgather")  # the reductions this module's (flat, one link) model prices


# ---- modes and the model's view of them ----------------------------------------------------------
def mode_bits(mode):
    m = MODE.match(mode)
    return int(m.group(2)) if m and m.group(2) else None


def mode_reduction(mode):
    """The reduction of a QSGD mode ("allgather" / "scatter_allgather"), None for none and fp16."""
    m = MODE.match(mode)
    return REDUCTION_OF[m.group(3)] if m and m.group(3) else None


def mode_overlap(mode):
    """Whether a QSGD mode runs with ``overlap=True`` (its name ends in "-overlap")."""
    m = MODE.match(mode)
    return bool(m and m.group(6))


def mode_fusion_mb(mode):
    """The ``fusion_mb`` of a QSGD mode: M for "-bufferedM", BUFFER_MB for "-buffered", else 0."""
    m = MODE.match(mode)
    return 0 if not (m and m.group(4)) else int(m.group(5)) if m.group(5) else BUFFER_MB


def mode_label(mode):
    if mode_bits(mode) is None:
        return mode
    return (f"QSGD({mode_bits(mode)}) {mode_reduction(mode)}" + (", overlap" if mode_overlap(mode) else "")
            + (f", fusion_mb={mode_fusion_mb(mode)}" if mode_fusion_mb(mode) else ""))


def unavailable_modes(modes):
    """{mode: why} for modes this installation cannot run."""
    from hvd_qsgd import settings

    out = {}
    for m in modes:
        red = mode_reduction(m)
        if red is not None and red not in settings.REDUCTIONS:
            out[m] = (f"reduction {red!r} is not implemented by this hvd_qsgd "
                      f"(hvd_qsgd.settings.REDUCTIONS = {tuple(settings.REDUCTIONS)})")
    return out


def param_shapes(width, depth, net="mlp"):
    """(name, numel) of the model's parameters, in named_parameters() order."""
    if net == "conv":
        return [(name, p.numel()) for name, p in make_model(width, depth, 0, net).named_parameters()]
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


# ---- compute and codec timing (in the workers, and in the launcher for the projection) -----------
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
            # decoded into an existing array, as the reductions decode into the gradient or their
            # scratch: a fresh one would add its first touch's page faults to the codec's time
            dst = np.zeros(x.size, dtype=np.float32)
            t0 = time.perf_counter()
            p = codec.encode(x, bits, bucket, seed=1)
            t1 = time.perf_counter()
            codec.decode_sum([p] * copies, 1.0 / copies, out=dst)
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


def make_model(width, depth, seed, net="mlp"):
    """The MLP (``depth`` x Linear(width, width), Linear(width, CLASSES)), or with ``net="conv"`` the
    ResNet-style net of ``conv_net``."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    if net == "conv":
        return conv_net(width, depth)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, CLASSES))


def conv_net(width, depth):
    """A ResNet-style net on 3 x 32 x 32 images: a 3x3 stem of W channels, three stages of ``depth``
    basic blocks (two 3x3 convolutions, each with batch norm, and a shortcut) at W, 2W and 4W
    channels, the 2nd and 3rd halving the image in their first block (a 1x1 convolution on the
    shortcut), global average pooling, Linear(4W, CLASSES): many gradients, most of them small."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                      nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential() if stride == 1 and cin == cout else
                         nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers, cin = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()], width
    for stage, cout in enumerate((width, 2 * width, 4 * width)):
        for b in range(depth):
            layers.append(Block(cin, cout, 2 if stage and b == 0 else 1))
            cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, CLASSES))


def make_batch(args, gen):
    """(x, y): ``args.batch`` synthetic samples for the model ``args.net`` (default the MLP)."""
    import torch

    net = getattr(args, "net", "mlp")
    shape = (args.batch, 3, 32, 32) if net == "conv" else (args.batch, args.width)
    return torch.randn(*shape, generator=gen), torch.randint(0, CLASSES, (args.batch,), generator=gen)


def describe(args, shapes):
    """The model whose parameters are ``shapes`` (``param_shapes``), as the printed header and the
    notes name it."""
    numel = sum(d for _, d in shapes)
    if getattr(args, "net", "mlp") == "conv":
        what = (f"ResNet-style conv net, 3 stages of {args.depth} basic blocks at {args.width}/{2 * args.width}/"
                f"{4 * args.width} channels on 3 x 32 x 32 images, {len(shapes)} parameter tensors")
    else:
        what = f"MLP {args.depth} x Linear({args.width}, {args.width}) + Linear({args.width}, {CLASSES})"
    return f"{what}, {numel:,} parameters ({4 * numel / 1e6:.1f} MB fp32)"


def local_compute(args, modes):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model = make_model(args.width, args.depth, args.seed, getattr(args, "net", "mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed)
    x, y = make_batch(args, gen)
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
