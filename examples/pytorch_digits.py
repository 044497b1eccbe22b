"""Data-parallel training of a small MLP on scikit-learn's digits, with Horovod and QSGD.

Run under Horovod, e.g.::

    horovodrun -np 4 --gloo -H localhost:4 .venv/bin/python examples/pytorch_digits.py \
        --compression qsgd --bits 4 --json /tmp/qsgd.json

Each rank trains on its own shard of the training set; after ``loss.backward()`` the gradients are
exchanged parameter by parameter, in ``model.named_parameters()`` order (the same on every rank):

* ``none``: ``hvd.allreduce(grad, op=hvd.Average)`` (float32 on the wire);
* ``fp16``: the same with ``compression=hvd.Compression.fp16``;
* ``qsgd``: tensors with at least ``--min-numel`` elements are quantized with ``hvd_qsgd.codec``;
  every rank's payload is gathered with ``hvd.allgather`` (payloads may differ in length), split by
  their headers, and decoded and summed in rank order with ``decode_sum(..., scale=1/size)``, so
  every rank computes a bit-identical averaged gradient. Smaller tensors take the plain average.

The collectives are submitted in that order with the ``_async`` forms (``allreduce_async`` on the
compressed tensor, ``allgather_async``) and then waited for in the same order, which is exactly what
``hvd.allreduce``/``hvd.allgather`` do one at a time, but lets Horovod negotiate a step's tensors in
one cycle: with several ranks sharing few cores, one blocking call per tensor is several times slower.

This is a real multi-rank exchange of the quantized payloads, written out by hand in the training
loop. It is not yet a Horovod ``Compressor``: a proper compressor class that plugs into
``hvd.DistributedOptimizer(compression=...)`` comes later.

Rank 0 prints (and with ``--json`` writes) the test accuracy, the bytes this rank sends per step,
the wall time of training, and whether all ranks end with bit-identical parameters (checked by
gathering a checksum of the parameters from every rank; a mismatch is an error).
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

from hvd_qsgd import codec

SPLIT_SEED = 0  # the train/test split is fixed, independent of --seed
TEST_FRACTION = 0.25


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", choices=("none", "fp16", "qsgd"), default="none")
    p.add_argument("--bits", type=int, default=4, help="QSGD bits per element (default 4)")
    p.add_argument("--bucket-size", type=int, default=512, help="QSGD bucket size (default 512)")
    p.add_argument("--min-numel", type=int, default=10000,
                   help="tensors with fewer elements are not quantized (default 10000)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (default 32)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=1,
                   help="torch and codec threads per rank (default 1: ranks share few cores)")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


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


def qsgd_seed(seed, step, index, rank):
    """A 64-bit encoder seed from (seed, step, parameter index, rank): every rank, step and tensor
    draws different randomness, and a rerun with the same --seed repeats it."""
    text = f"qsgd|{seed}|{step}|{index}|{rank}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


class GradExchange:
    """Averages the gradients over all ranks, one parameter at a time in a fixed order, and counts
    the bytes this rank puts on the wire per step."""

    def __init__(self, named_params, args):
        self.params = list(named_params)  # named_parameters() order: identical on every rank
        self.args = args
        self.size = hvd.size()
        self.rank = hvd.rank()
        self.fingerprints = [codec.tensor_fingerprint(n, tuple(p.shape), "float32")
                             for n, p in self.params]
        self.bytes_per_step = sum(self._nbytes(p.numel()) for _, p in self.params)

    def quantized(self, numel):
        return self.args.compression == "qsgd" and numel >= self.args.min_numel

    def _nbytes(self, numel):
        a = self.args
        if a.compression == "fp16":
            return 2 * numel
        if self.quantized(numel):
            return codec.payload_nbytes(numel, a.bits, a.bucket_size)
        return 4 * numel

    def __call__(self, step):
        """Submit every parameter's collective in order (asynchronously, so that Horovod negotiates
        them in one cycle instead of one cycle each), then wait for them in the same order and write
        the averages back into the gradients."""
        a = self.args
        sent = 0
        pending = []
        for index, (name, p) in enumerate(self.params):
            grad = p.grad
            if self.quantized(grad.numel()):
                flat = grad.detach().contiguous().view(-1).numpy()
                payload = codec.encode(flat, bits=a.bits, bucket_size=a.bucket_size,
                                       seed=qsgd_seed(a.seed, step, index, self.rank),
                                       fingerprint=self.fingerprints[index], name=name)
                sent += payload.size
                handle = hvd.allgather_async(torch.from_numpy(payload), name=f"qsgd.{name}")
                pending.append((grad, handle, None, None))
            else:
                # hvd.allreduce(grad, op=hvd.Average, compression=...) split into its two halves:
                # compress, allreduce_async (which takes no compression=), then decompress.
                compression = hvd.Compression.fp16 if a.compression == "fp16" else hvd.Compression.none
                wire, ctx = compression.compress(grad)
                sent += wire.element_size() * wire.numel()
                handle = hvd.allreduce_async(wire, op=hvd.Average, name=f"grad.{name}")
                pending.append((grad, handle, compression, ctx))
        for grad, handle, compression, ctx in pending:
            out = hvd.synchronize(handle)
            if compression is None:  # a QSGD allgather
                payloads = codec.split_payloads(out.numpy(), count=self.size)
                out = torch.from_numpy(codec.decode_sum(payloads, scale=1.0 / self.size))
            else:
                out = compression.decompress(out, ctx)
            grad.copy_(out.view_as(grad))
        assert sent == self.bytes_per_step, (sent, self.bytes_per_step)
        return sent


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
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    exchange = GradExchange(model.named_parameters(), args)

    steps_per_epoch = (len(x_tr) + args.batch_size - 1) // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    rng = np.random.default_rng([args.seed, rank])  # this rank's shuffling of its own shard

    if rank == 0:
        quant = [n for n, p in model.named_parameters() if exchange.quantized(p.numel())]
        print(f"[digits] np={size} compression={args.compression}"
              + (f" bits={args.bits} bucket={args.bucket_size} quantized={quant}"
                 if args.compression == "qsgd" else "")
              + f" train={n_train} (shard {len(x_tr)}/rank) test={len(test[0])}"
              f" steps={total_steps}", flush=True)

    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
        # Short enough for an 80-column terminal behind horovodrun's "[0]<stdout>:" prefix.
        bar = tqdm(total=total_steps, desc=args.compression, mininterval=0.5, file=sys.stdout,
                   bar_format="{desc} {percentage:3.0f}%|{bar:16}| {n_fmt}/{total_fmt} "
                              "[{elapsed}<{remaining}]{postfix}")

    hvd.allreduce(torch.zeros(1), name="start")  # line the ranks up before timing
    t0 = time.perf_counter()
    step = 0
    for epoch in range(args.epochs):
        order = torch.from_numpy(rng.permutation(len(x_tr)))
        for b in range(steps_per_epoch):
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            exchange(step)
            opt.step()
            step += 1
            if bar is not None:
                bar.update(1)
                if b == steps_per_epoch - 1:
                    bar.set_postfix_str(f"ep {epoch + 1} loss {loss.item():.3f}", refresh=False)
    train_time = time.perf_counter() - t0
    if bar is not None:
        bar.close()

    # Every rank must end with bit-identical parameters.
    mine = torch.tensor([param_checksum(model)], dtype=torch.int64)
    sums = hvd.allgather(mine, name="param_checksum").tolist()
    identical = len(set(sums)) == 1

    result = None
    if rank == 0:
        none_bytes = 4 * sum(p.numel() for p in model.parameters())
        result = dict(
            compression=args.compression,
            bits=args.bits if args.compression == "qsgd" else None,
            bucket_size=args.bucket_size if args.compression == "qsgd" else None,
            min_numel=args.min_numel if args.compression == "qsgd" else None,
            np=size, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
            momentum=args.momentum, seed=args.seed, steps=total_steps,
            test_accuracy=accuracy(model, test),
            bytes_per_step=exchange.bytes_per_step,
            bytes_per_step_none=none_bytes,
            ratio_vs_none=exchange.bytes_per_step / none_bytes,
            train_time_s=train_time,
            params_identical=identical,
            param_checksums=[f"{s:016x}" for s in sums],
        )
        print(f"[digits] {args.compression}: test accuracy {result['test_accuracy']:.4f}, "
              f"{result['bytes_per_step']} bytes sent per step per rank "
              f"({result['ratio_vs_none']:.3f} of none), training {train_time:.2f} s, "
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
