"""Data-parallel training of a small MLP on scikit-learn's digits with Horovod TensorFlow and QSGD.

The TensorFlow 2 counterpart of ``examples/pytorch_digits.py`` (same flags, data split, shards and
JSON keys where they apply). Run under Horovod (Gloo or MPI controller alike), e.g.::

    horovodrun -np 4 --gloo -H localhost:4 .venv/bin/python examples/tensorflow2_digits.py \
        --compression qsgd --bits 4 --json /tmp/qsgd.json

The training step is a ``@tf.function`` with the stock Horovod wrapper
``hvd.DistributedGradientTape(tape, compression=...)``, which averages the gradients over all ranks,
with

* ``none``: ``hvd.Compression.none`` (float32 allreduce);
* ``fp16``: ``hvd.Compression.fp16`` (float16 allreduce);
* ``qsgd``: ``hvd_qsgd.QSGD(bits, bucket_size=..., min_numel=..., error_feedback=...)``. Gradients
  with at least ``--min-numel`` elements (here fc1/kernel, 32,768, and fc2/kernel, 262,144) are
  quantized in-graph; every rank's payload travels by allgather and every rank decodes and sums all
  of them in rank order, so all ranks apply a bit-identical averaged gradient. Smaller gradients
  (the biases and fc3) go through Horovod's allreduce *as float64*: the TensorFlow adapter casts them
  so that a grouped allreduce can hold them together with its float64 control vectors.

The model is a 64-512-512-10 MLP of plain ``tf.Variable``s, initialised like PyTorch's
``nn.Linear`` (uniform in +-1/sqrt(fan_in)); SGD with momentum is applied by this script with
PyTorch's update rule (``v <- momentum * v + g; w <- w - lr * v``). The train/test split is fixed
(stratified, 25% test, independent of ``--seed``); each rank trains on its own equal shard of the
training set. Ranks initialise differently on purpose; ``hvd.broadcast_variables`` of rank 0's
weights and momentum buffers before the first step is what makes them start alike.

Rank 0 shows a progress bar (``--no-progress``: none) and prints, and with ``--json`` writes, the test
accuracy and cross-entropy, the bytes this rank sends per step, the wall time of the training loop
(the first step includes tracing the ``tf.function``; ``first_step_s`` says how long it took), and
whether all ranks end with bit-identical parameters (a checksum of the variables gathered from every
rank; a mismatch is an error). Bytes sent per step is the size of this rank's own contribution to
the gradient exchange: ``4 * numel`` of every gradient for ``none``, ``2 * numel`` for ``fp16``, and
for ``qsgd`` the QSGD payload bytes of the quantized gradients (``compression.stats``) plus **8**
bytes per element of the others (they travel as float64, see above), divided by the number of
steps. It is not link traffic (see ``examples/pytorch_digits.py``). The QSGD control vectors (a few
float64 per compressed tensor, reduced by Horovod's allreduce) are reported apart as
``control_bytes_per_step``.
"""
import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

import hvd_qsgd
from hvd_qsgd import codec, protocol

SPLIT_SEED = 0  # the train/test split is fixed, independent of --seed
TEST_FRACTION = 0.25
RAW_BYTES_QSGD = 8  # uncompressed gradients travel as float64 with hvd_qsgd's TensorFlow adapter


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
                   help="TensorFlow intra- and inter-op threads and codec threads per rank "
                        "(default 1: ranks share few cores)")
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

    The same split and shards as examples/pytorch_digits.py: shards are equal in size (the training
    set is cut to a multiple of ``size``), so every rank takes the same number of steps."""
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
    shard = (x_tr[lo:hi], y_tr[lo:hi].astype(np.int64))
    test = (x_te, y_te.astype(np.int64))
    return shard, test, len(x_tr)


class MLP(tf.Module):
    """64-hidden-hidden-10 ReLU MLP; variables named fc1/kernel, fc1/bias, ... in creation order."""

    def __init__(self, rng, n_in=64, hidden=512, n_out=10):
        super().__init__(name="mlp")
        self.params = []
        for name, fan_in, fan_out in (("fc1", n_in, hidden), ("fc2", hidden, hidden), ("fc3", hidden, n_out)):
            bound = 1.0 / np.sqrt(fan_in)  # PyTorch's nn.Linear default initialisation
            w = rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32)
            b = rng.uniform(-bound, bound, (fan_out,)).astype(np.float32)
            self.params.append(tf.Variable(w, name=f"{name}/kernel"))
            self.params.append(tf.Variable(b, name=f"{name}/bias"))

    def names(self):
        return [v.name.split(":")[0] for v in self.params]

    def __call__(self, x):
        w1, b1, w2, b2, w3, b3 = self.params
        h = tf.nn.relu(tf.matmul(x, w1) + b1)
        h = tf.nn.relu(tf.matmul(h, w2) + b2)
        return tf.matmul(h, w3) + b3


def make_compression(args):
    if args.compression == "none":
        return hvd.Compression.none
    if args.compression == "fp16":
        return hvd.Compression.fp16
    return hvd_qsgd.QSGD(args.bits, bucket_size=args.bucket_size, min_numel=args.min_numel,
                         seed=args.seed, error_feedback=args.error_feedback)


def param_checksum(names, variables):
    """A 63-bit digest of every variable's bytes, in order."""
    h = hashlib.blake2b(digest_size=8)
    for name, v in zip(names, variables):
        h.update(name.encode())
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1  # fits a signed int64 tensor


def evaluate(model, data):
    """(accuracy, mean cross-entropy) on ``data``."""
    x, y = data
    logits = model(tf.constant(x))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return float(np.mean(tf.argmax(logits, axis=1).numpy() == y)), float(loss)


def bytes_sent(args, numel, stats, steps):
    """(bytes this rank sent per step, control-vector bytes per step) of the gradient exchange."""
    if args.compression == "none":
        return 4 * numel, 0
    if args.compression == "fp16":
        return 2 * numel, 0
    total = stats["bytes_sent"] + RAW_BYTES_QSGD * stats["raw_elements"]
    if total % steps or stats["tensors"] % steps:
        raise SystemExit(f"[digits] error: the compressor's counters {stats} are not a multiple of "
                         f"{steps} steps")
    control = stats["tensors"] // steps * 8 * protocol.control_length(hvd.size())
    return total // steps, control


def main(argv=None):
    args = parse_args(argv)
    threads = max(1, args.threads)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    codec.set_num_threads(threads)

    (x_tr, y_tr), test, n_train = load_data(rank, size)

    # Each rank initialises differently on purpose: the broadcast is what makes them agree.
    model = MLP(np.random.default_rng([args.seed, rank, 1]), hidden=args.hidden)
    params = model.params
    names = model.names()
    momenta = [tf.Variable(tf.zeros_like(v), trainable=False, name=f"{n}/momentum")
               for n, v in zip(names, params)]
    compression = make_compression(args)
    hvd.broadcast_variables(params + momenta, root_rank=0)
    lr = tf.constant(args.lr, tf.float32)
    momentum = tf.constant(args.momentum, tf.float32)

    @tf.function(input_signature=[tf.TensorSpec([None, x_tr.shape[1]], tf.float32),
                                  tf.TensorSpec([None], tf.int64)])
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, params)
        for v, m, g in zip(params, momenta, grads):
            m.assign(momentum * m + g)
            v.assign_sub(lr * m)
        return loss

    steps_per_epoch = (len(x_tr) + args.batch_size - 1) // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    rng = np.random.default_rng([args.seed, rank])  # this rank's shuffling of its own shard

    if rank == 0:
        print(f"[digits] tensorflow np={size} compression={args.compression}"
              + (f" {compression!r}" if args.compression == "qsgd" else "") + f" train={n_train} "
              f"(shard {len(x_tr)}/rank) test={len(test[0])} steps={total_steps}", flush=True)

    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
        desc = f"qsgd{compression.settings.bits}" if args.compression == "qsgd" else args.compression
        bar = tqdm(total=total_steps, desc=desc, mininterval=0.5, file=sys.stdout,
                   bar_format="{desc} {percentage:3.0f}%|{bar:16}| {n_fmt}/{total_fmt} "
                              "[{elapsed}<{remaining}]{postfix}")

    hvd.allreduce(tf.zeros([1]), name="start")  # line the ranks up before timing
    t0 = time.perf_counter()
    first_step = None
    step = 0
    epoch = 0
    while step < total_steps:
        order = rng.permutation(len(x_tr))
        for b in range(steps_per_epoch):
            if step == total_steps:
                break
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            loss = train_step(tf.constant(x_tr[idx]), tf.constant(y_tr[idx]))
            step += 1
            if first_step is None:
                loss.numpy()  # wait for it: the first step traces the function
                first_step = time.perf_counter() - t0
            if bar is not None:
                bar.update(1)
                if b == steps_per_epoch - 1 or step == total_steps:
                    bar.set_postfix_str(f"ep {epoch + 1} loss {float(loss):.3f}", refresh=False)
        epoch += 1
    for v in params:
        v.numpy()  # the last step's updates are done
    train_time = time.perf_counter() - t0
    if bar is not None:
        bar.close()

    # Every rank must end with bit-identical parameters.
    mine = tf.constant([param_checksum(names, params)], dtype=tf.int64)
    sums = hvd.allgather(mine, name="param_checksum").numpy().tolist()
    identical = len(set(sums)) == 1

    numel = sum(int(v.shape.num_elements()) for v in params)
    stats = compression.stats if args.compression == "qsgd" else None
    per_step, control_per_step = bytes_sent(args, numel, stats, step)
    result = None
    if rank == 0:
        qsgd = args.compression == "qsgd"
        none_bytes = 4 * numel
        test_accuracy, test_loss = evaluate(model, test)
        result = dict(
            framework="tensorflow",
            compression=args.compression,
            compressor=repr(compression) if qsgd else None,
            bits=compression.settings.bits if qsgd else None,
            bucket_size=compression.settings.bucket_size if qsgd else None,
            min_numel=compression.settings.min_numel if qsgd else None,
            error_feedback=args.error_feedback if qsgd else None,
            quantized=[n for n, v in zip(names, params)
                       if v.shape.num_elements() >= args.min_numel] if qsgd else [],
            raw_bytes_per_element=RAW_BYTES_QSGD if qsgd else None,
            np=size, epochs=epoch, batch_size=args.batch_size, lr=args.lr,
            momentum=args.momentum, seed=args.seed, steps=step,
            test_accuracy=test_accuracy,
            test_loss=test_loss,
            bytes_per_step=per_step,
            bytes_per_step_none=none_bytes,
            ratio_vs_none=per_step / none_bytes,
            control_bytes_per_step=control_per_step,
            train_time_s=train_time,
            first_step_s=first_step,
            params_identical=identical,
            param_checksums=[f"{s:016x}" for s in sums],
            stats=stats,
        )
        print(f"[digits] {args.compression}: test accuracy {test_accuracy:.4f} (loss {test_loss:.4f}) after "
              f"{step} steps, {per_step:,} bytes sent per step by rank 0 "
              f"({result['ratio_vs_none']:.3f} of float32"
              + (f"; uncompressed tensors as float64; + {control_per_step} control bytes" if qsgd else "")
              + f"), training {train_time:.2f} s (first step {first_step:.2f} s), "
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
