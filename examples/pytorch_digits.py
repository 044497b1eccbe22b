"""Data-parallel training of a small MLP on scikit-learn's digits with Horovod and QSGD compression.

Run under Horovod (Gloo or MPI controller alike), e.g.::

    horovodrun -np 4 --gloo -H localhost:4 .venv/bin/python examples/pytorch_digits.py \
        --compression qsgd --bits 4 --json /tmp/qsgd.json

The training loop is the stock Horovod one: ``hvd.DistributedOptimizer(opt, named_parameters=...,
compression=...)`` averages the gradients over all ranks, with

* ``none``: ``hvd.Compression.none`` (float32 allreduce);
* ``fp16``: ``hvd.Compression.fp16`` (float16 allreduce);
* ``qsgd``: ``hvd_qsgd.QSGD(bits, bucket_size=..., min_numel=..., error_feedback=...,
  named_parameters=...)``. Gradients with at least ``--min-numel`` elements (here fc1.weight, 32,768,
  and fc2.weight, 262,144) are quantized; every rank's payload travels by allgather and every rank
  decodes and sums all of them in rank order, so all ranks apply a bit-identical averaged gradient.
  Smaller gradients (the biases and fc3) go through Horovod's float32 allreduce.

The model is a 64-512-512-10 MLP. The train/test split is fixed (stratified, 25% test, independent of
``--seed``); each rank trains on its own equal shard of the training set. Rank 0's initial parameters
and optimizer state are broadcast to all ranks (``hvd.broadcast_parameters``,
``hvd.broadcast_optimizer_state``); ranks initialise differently on purpose, so the broadcast is what
makes them start alike.

Rank 0 shows a progress bar (``--no-progress``: none) and prints, and with ``--json`` writes, the test
accuracy, the bytes this rank sends per step, the wall time of the training loop, and whether all
ranks end with bit-identical parameters (a checksum of the parameters gathered from every rank; a
mismatch is an error). Bytes sent per step is the size of this rank's own contribution to the
gradient exchange: ``4 * numel`` of every gradient for ``none``, ``2 * numel`` for ``fp16``, and for
``qsgd`` the QSGD payload bytes of the quantized gradients plus ``4 * numel`` of the others, taken
from ``compression.stats`` and divided by the number of steps. It is not link traffic: a ring
allreduce moves about 2 (n - 1) / n times its input through each rank's link, an allgather about
(n - 1) times each rank's payload. The QSGD control vectors (a few float64 per compressed tensor,
reduced by Horovod's allreduce) are reported apart as ``control_bytes_per_step``.
"""
import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd

import hvd_qsgd
from hvd_qsgd import codec, protocol

SPLIT_SEED = 0  # the train/test split is fixed, independent of --seed
TEST_FRACTION = 0.25


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", choices=("none", "fp16", "qsgd"), default="none")
    p.add_argument("--bits", type=int, default=4, help="QSGD bits per element (default 4)")
    p.add_argument("--bucket-size", type=int, default=None,
                   help="QSGD bucket size (default: the compressor's, 512, or 128 for bits <= 2)")
    p.add_argument("--min-numel", type=int, default=10000,
                   help="QSGD leaves tensors with fewer elements uncompressed (default 10000)")
    p.add_argument("--error-feedback", action="store_true", help="QSGD with error feedback")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="stop after N optimizer steps in total (for quick launch checks)")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (default 32)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seed", type=int, default=42,
                   help="model initialisation, shuffling and QSGD randomness (default 42)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch and codec threads per rank (default 1: ranks share few cores)")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error("--epochs must be at least 1")
    if args.max_steps is not None and args.max_steps < 1:
        p.error("--max-steps must be at least 1")
    return args


def load_data(rank, size):
    """The fixed stratified split, features standardised on the training set; this rank's shard.

    Shards are equal in size (the training set is cut to a multiple of ``size``), so every rank
    takes the same number of steps and the collectives stay matched."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED)
    scaler = StandardScaler().fit(x_tr)
    x_tr = scaler.transform(x_tr).astype(np.float32)
    x_te = scaler.transform(x_te).astype(np.float32)
    per_rank = len(x_tr) // size
    if per_rank == 0:
        raise SystemExit(f"[digits] error: {size} ranks but only {len(x_tr)} training samples")
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    shard = (torch.from_numpy(x_tr[lo:hi]), torch.from_numpy(y_tr[lo:hi].astype(np.int64)))
    test = (torch.from_numpy(x_te), torch.from_numpy(y_te.astype(np.int64)))
    return shard, test, len(x_tr)


class MLP(nn.Module):
    def __init__(self, n_in=64, hidden=512, n_out=10):
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, n_out)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def make_compression(args, model):
    if args.compression == "none":
        return hvd.Compression.none
    if args.compression == "fp16":
        return hvd.Compression.fp16
    return hvd_qsgd.QSGD(args.bits, bucket_size=args.bucket_size, min_numel=args.min_numel,
                         seed=args.seed, error_feedback=args.error_feedback,
                         named_parameters=model.named_parameters())


def param_checksum(model):
    """A 63-bit digest of every parameter's bytes, in named_parameters() order."""
    h = hashlib.blake2b(digest_size=8)
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1  # fits a signed int64 tensor


@torch.no_grad()
def accuracy(model, data):
    x, y = data
    model.eval()
    pred = model(x).argmax(dim=1)
    model.train()
    return float((pred == y).float().mean())


def bytes_sent(args, model, stats, steps):
    """(bytes this rank sent per step, control-vector bytes per step) of the gradient exchange."""
    numel = sum(p.numel() for p in model.parameters())
    if args.compression == "none":
        return 4 * numel, 0
    if args.compression == "fp16":
        return 2 * numel, 0
    total = stats["bytes_sent"] + 4 * stats["raw_elements"]  # raw tensors are float32 here
    if total % steps or stats["tensors"] % steps:
        raise SystemExit(f"[digits] error: the compressor's counters {stats} are not a multiple of "
                         f"{steps} steps")
    control = stats["tensors"] // steps * 8 * protocol.control_length(hvd.size())
    return total // steps, control


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(max(1, args.threads))
    codec.set_num_threads(max(1, args.threads))

    (x_tr, y_tr), test, n_train = load_data(rank, size)

    # Each rank initialises differently on purpose: the broadcast is what makes them agree.
    torch.manual_seed(args.seed + rank)
    model = MLP(hidden=args.hidden)
    compression = make_compression(args, model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    steps_per_epoch = (len(x_tr) + args.batch_size - 1) // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    rng = np.random.default_rng([args.seed, rank])  # this rank's shuffling of its own shard

    if rank == 0:
        print(f"[digits] np={size} compression={args.compression}"
              + (f" {compression!r}" if args.compression == "qsgd" else "") + f" train={n_train} "
              f"(shard {len(x_tr)}/rank) test={len(test[0])} steps={total_steps}", flush=True)

    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
        # Short enough for an 80-column terminal behind horovodrun's "[0]<stdout>:" prefix.
        desc = f"qsgd{compression.settings.bits}" if args.compression == "qsgd" else args.compression
        bar = tqdm(total=total_steps, desc=desc, mininterval=0.5, file=sys.stdout,
                   bar_format="{desc} {percentage:3.0f}%|{bar:16}| {n_fmt}/{total_fmt} "
                              "[{elapsed}<{remaining}]{postfix}")

    hvd.allreduce(torch.zeros(1), name="start")  # line the ranks up before timing
    t0 = time.perf_counter()
    step = 0
    epoch = 0
    while step < total_steps:
        order = torch.from_numpy(rng.permutation(len(x_tr)))
        for b in range(steps_per_epoch):
            if step == total_steps:
                break
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
            step += 1
            if bar is not None:
                bar.update(1)
                if b == steps_per_epoch - 1 or step == total_steps:
                    bar.set_postfix_str(f"ep {epoch + 1} loss {loss.item():.3f}", refresh=False)
        epoch += 1
    train_time = time.perf_counter() - t0
    if bar is not None:
        bar.close()

    # Every rank must end with bit-identical parameters.
    mine = torch.tensor([param_checksum(model)], dtype=torch.int64)
    sums = hvd.allgather(mine, name="param_checksum").tolist()
    identical = len(set(sums)) == 1

    stats = compression.stats if args.compression == "qsgd" else None
    per_step, control_per_step = bytes_sent(args, model, stats, step)
    result = None
    if rank == 0:
        qsgd = args.compression == "qsgd"
        none_bytes = 4 * sum(p.numel() for p in model.parameters())
        result = dict(
            compression=args.compression,
            compressor=repr(compression) if qsgd else None,
            bits=compression.settings.bits if qsgd else None,
            bucket_size=compression.settings.bucket_size if qsgd else None,
            min_numel=compression.settings.min_numel if qsgd else None,
            error_feedback=args.error_feedback if qsgd else None,
            quantized=[n for n, p in model.named_parameters() if p.numel() >= args.min_numel] if qsgd else [],
            np=size, epochs=epoch, batch_size=args.batch_size, lr=args.lr,
            momentum=args.momentum, seed=args.seed, steps=step,
            test_accuracy=accuracy(model, test),
            bytes_per_step=per_step,
            bytes_per_step_none=none_bytes,
            ratio_vs_none=per_step / none_bytes,
            control_bytes_per_step=control_per_step,
            train_time_s=train_time,
            params_identical=identical,
            param_checksums=[f"{s:016x}" for s in sums],
            stats=stats,
        )
        print(f"[digits] {args.compression}: test accuracy {result['test_accuracy']:.4f} after "
              f"{step} steps, {per_step:,} bytes sent per step by rank 0 "
              f"({result['ratio_vs_none']:.3f} of float32"
              + (f"; + {control_per_step} control bytes" if qsgd else "")
              + f"), training {train_time:.2f} s, "
              f"parameters bit-identical on all {size} ranks: {identical}", flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        if not identical:
            raise SystemExit(f"[digits] error: parameters differ across ranks: {result['param_checksums']}")
    hvd.shutdown()
    return result


if __name__ == "__main__":
    main()
