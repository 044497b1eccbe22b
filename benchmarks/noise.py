"""Quantization noise against minibatch noise, on the language-model workload's own gradients:
which codec configurations this workload can tell apart from fp32, and why.

SGD with an unbiased compressor sees the averaged gradient plus two independent noises. With R ranks,
per-rank batches of b windows, per-window gradient covariance Sigma_1 and expected gradient G:

* minibatch noise of the averaged gradient: ``E||g_bar - G||^2 = tr(Sigma_1) / (R b)``;
* quantization noise (each rank's Q unbiased, drawn independently):
  ``E||mean_r Q(g_r) - g_bar||^2 = (1 / R^2) sum_r E||Q(g_r) - g_r||^2``.

Their ratio ``rho = quantization / minibatch`` is how much the compressor adds to the noise SGD
already has: to first order, training with it is training with a batch ``1 + rho`` times smaller. A
configuration can end visibly worse than fp32 only where rho is not small against 1; where rho is a
few percent, no number of seeds on this workload will separate it from fp32 (nor from another
configuration with a similarly small rho).

With ``q = E||Q(g_r) - g_r||^2 / E||g_r||^2`` (the codec's relative variance on these gradients) and
the gradient noise scale ``B_noise = tr(Sigma_1) / ||G||^2`` (in windows), ``E||g_r||^2 = ||G||^2 +
tr(Sigma_1) / b`` gives ``rho = q (1 + b / B_noise)``: rho >= q whatever the batch, and a per-rank
batch of about ``(1 / q - 1) B_noise`` would make quantization noise as large as the minibatch noise
(q held at its measured value; q itself changes with the batch).

Measured single-process (no Horovod, no network): the example's model and corpus, trained with the
R ranks' batches averaged (the fp32 data-parallel run) to each checkpoint; at a checkpoint, the
gradients of R ranks' batches for ``--samples`` consecutive steps, each quantized ``--draws`` times
per configuration exactly as the compressor does (per tensor of at least ``--min-numel`` elements;
smaller tensors exact). G is estimated by the mean of all sampled gradients (the minibatch noise's
estimate corrected for it: ``S / (S - 1)``).

``python -m benchmarks noise`` (about 4 minutes here); ``--json`` keeps every number.
"""
import json
import os
import sys
import time

import numpy as np

# label -> (bits, bucket size, norm)
CONFIGS = {
    "QSGD(8)": (8, 512, "max"),
    "QSGD(4)": (4, 512, "max"),
    "QSGD(4), bucket 8192": (4, 8192, "max"),
    "QSGD(2), bucket 128": (2, 128, "max"),
    "QSGD(2), bucket 64": (2, 64, "max"),
    "QSGD(4), bucket 8192, L2 norm": (4, 8192, "l2"),
}
# the model of examples/pytorch_lm.py with its default flags
MODEL = dict(d_model=128, layers=2, heads=4, context=64, ngram_rows=16384, ngram_orders=(2, 3))


def add_arguments(p):
    p.add_argument("--ranks", type=int, default=4, help="ranks R whose batches are averaged (default 4)")
    p.add_argument("--batch-size", type=int, default=4, help="per-rank batch b in windows (default 4, the example's)")
    p.add_argument("--checkpoints", default="0,100,300",
                   help="training steps at which the noises are measured (default 0,100,300)")
    p.add_argument("--samples", type=int, default=16, help="steps sampled at each checkpoint (default 16)")
    p.add_argument("--draws", type=int, default=2, help="quantizations of every gradient per configuration (default 2)")
    p.add_argument("--min-numel", type=int, default=10000, help="tensors below this are not quantized (default 10000)")
    p.add_argument("--seed", type=int, default=1, help="the example's --seed (default 1)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--json", metavar="PATH", help="write every number here")


def quantization_error(grads, bits, bucket, norm, seed, min_numel):
    """||Q(g) - g||^2 summed over the quantized tensors of one gradient (a list of float32 arrays)."""
    from hvd_qsgd import codec
    err = 0.0
    for k, g in enumerate(grads):
        if g.size < min_numel:
            continue
        g = g.ravel()
        q = codec.decode(codec.encode(g, bits=bits, bucket_size=bucket, norm=norm, seed=seed * 1000 + k))
        err += float(np.sum((q.astype(np.float64) - g) ** 2))
    return err


def batch_loss(args, model, context, corpus, rank, step):
    """The example's training loss of rank's batch at step (``lm_common.train_batch``)."""
    import torch
    import torch.nn.functional as F
    import lm_common as lm
    x, y = lm.train_batch(corpus.train, args.batch_size, context, args.seed, rank, step)
    return F.cross_entropy(model(torch.from_numpy(x)).reshape(-1, 256), torch.from_numpy(y).reshape(-1))


def measure(args, model, context, corpus, step0, configs):
    """The noises at the model's current parameters, from the batches of steps step0+1 .. step0+S."""
    R, S = args.ranks, args.samples
    per_rank = []   # [s][r] -> list of float32 arrays (one per parameter)
    for s in range(S):
        row = []
        for r in range(R):
            model.zero_grad()
            batch_loss(args, model, context, corpus, r, step0 + 1 + s).backward()
            row.append([p.grad.detach().numpy().copy() for p in model.parameters()])
        per_rank.append(row)
    flat = lambda gs: np.concatenate([g.ravel().astype(np.float64) for g in gs])
    g = np.stack([np.stack([flat(gs) for gs in row]) for row in per_rank])   # (S, R, numel)
    G = g.mean(axis=(0, 1))
    g_bar = g.mean(axis=1)
    minibatch = float(np.mean(np.sum((g_bar - G) ** 2, axis=1))) * S / (S - 1)
    per_rank_sq = float(np.mean(np.sum(g ** 2, axis=2)))
    # per-window covariance trace: E||g_r - G||^2 = tr(Sigma_1) / b (G's own noise corrected)
    tr_sigma1 = float(np.mean(np.sum((g - G) ** 2, axis=2))) * (S * R) / (S * R - 1) * args.batch_size
    g_norm_sq = max(float(np.sum(G ** 2)) - tr_sigma1 / (args.batch_size * S * R), 1e-30)
    out = dict(step=step0, minibatch_noise=minibatch, grad_norm_sq=g_norm_sq, per_rank_grad_sq=per_rank_sq,
               tr_sigma1=tr_sigma1, noise_scale_windows=tr_sigma1 / g_norm_sq, configs={})
    for label, (bits, bucket, norm) in configs.items():
        errs = [quantization_error(per_rank[s][r], bits, bucket, norm, seed=(step0 * 7919 + s * 131 + r) * 16 + d,
                                   min_numel=args.min_numel)
                for s in range(S) for r in range(R) for d in range(args.draws)]
        mean_err = float(np.mean(errs))   # E||Q(g_r) - g_r||^2
        quant = mean_err / R   # (1/R^2) sum over R ranks of E||Q(g_r) - g_r||^2
        q = mean_err / per_rank_sq
        out["configs"][label] = dict(bits=bits, bucket_size=bucket, norm=norm, quantization_noise=quant,
                                     relative_variance_q=q, rho=quant / minibatch,
                                     batch_for_rho_1=(1 / q - 1) * out["noise_scale_windows"] if q < 1 else 0.0)
    return out


def train(args, model, context, opt, corpus, start, stop):
    """The fp32 data-parallel run from step start+1 to stop: every step the R ranks' batches' mean gradient."""
    for step in range(start + 1, stop + 1):
        opt.zero_grad()
        for r in range(args.ranks):
            (batch_loss(args, model, context, corpus, r, step) / args.ranks).backward()
        opt.step()


def table(results, args):
    lines = [f"per-rank batch {args.batch_size} windows, {args.ranks} ranks, {args.samples} steps x "
             f"{args.draws} draws per checkpoint; rho = quantization noise / minibatch noise of the averaged gradient",
             "", "| configuration | " + " | ".join(f"step {r['step']}: q, rho" for r in results) + " |",
             "|---|" + "---|" * len(results)]
    for label in CONFIGS:
        cells = [f"{r['configs'][label]['relative_variance_q']:.3g}, {r['configs'][label]['rho']:.3g}" for r in results]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| checkpoint | minibatch noise | ||G||^2 | B_noise (windows) | per-rank batch for rho = 1, QSGD(4) | "
                 "same, QSGD(4) bucket 8192 |")
    lines.append("|---|---|---|---|---|---|")
    for r in results:
        c = r["configs"]
        lines.append(f"| step {r['step']} | {r['minibatch_noise']:.4g} | {r['grad_norm_sq']:.4g} | "
                     f"{r['noise_scale_windows']:.0f} | {c['QSGD(4)']['batch_for_rho_1']:.0f} | "
                     f"{c['QSGD(4), bucket 8192']['batch_for_rho_1']:.0f} |")
    return "\n".join(lines)


def run(args):
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import lm_common as lm
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    corpus = lm.Corpus(8.0, 1.0)
    torch.manual_seed(args.seed)
    model = lm.make_model(**MODEL)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    checkpoints = sorted(int(c) for c in args.checkpoints.split(","))
    results, at = [], 0
    for c in checkpoints:
        train(args, model, MODEL["context"], opt, corpus, at, c)
        at = c
        results.append(measure(args, model, MODEL["context"], corpus, c, CONFIGS))
        print(f"[noise] step {c}: minibatch noise {results[-1]['minibatch_noise']:.4g}, B_noise "
              f"{results[-1]['noise_scale_windows']:.0f} windows ({time.perf_counter() - t0:.0f} s)", flush=True)
    text = table(results, args)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items() if not k.startswith("_")}, results=results,
                           wall_s=time.perf_counter() - t0), f, indent=1)
    return 0
