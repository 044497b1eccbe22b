"""Data-parallel training of a small MLP on scikit-learn's digits with Horovod Keras and QSGD.

The Keras counterpart of ``examples/pytorch_digits.py`` (same flags, data split, shards and JSON keys
where they apply). Run under Horovod (Gloo or MPI controller alike), e.g.::

    horovodrun -np 4 --gloo -H localhost:4 .venv/bin/python examples/keras_digits.py \
        --compression qsgd --bits 4 --json /tmp/qsgd.json

Keras 2 (``tf_keras``) is required: Horovod 0.28.1's ``horovod.tensorflow.keras`` imports
``tensorflow.keras``, which is Keras 3 in TensorFlow >= 2.16 unless ``TF_USE_LEGACY_KERAS=1`` is set
before TensorFlow is imported (this script sets it), and its ``DistributedOptimizer`` subclasses
Keras 2 optimizers (``_compute_gradients``/``_aggregate_gradients``), which Keras 3 does not have.

The training is the stock Horovod Keras recipe: ``model.compile(optimizer=
hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum), compression=...))``, ``model.fit`` with
``hvd.callbacks.BroadcastGlobalVariablesCallback(0)`` (it broadcasts rank 0's weights and optimizer
state after the first batch; ranks initialise differently on purpose, so the broadcast is what
makes them agree), with

* ``none``: ``hvd.Compression.none`` (float32 allreduce);
* ``fp16``: ``hvd.Compression.fp16`` (float16 allreduce);
* ``qsgd``: ``hvd_qsgd.QSGD(bits, bucket_size=..., min_numel=..., error_feedback=...)``. Gradients
  with at least ``--min-numel`` elements (fc1/kernel, 32,768, and fc2/kernel, 262,144) are quantized
  in the traced train step; every rank's payload travels by allgather and every rank decodes and
  sums all of them in rank order. Smaller gradients (the biases and fc3) go through Horovod's
  allreduce *as float64* (the TensorFlow adapter casts them, so that a grouped allreduce can hold
  them together with its float64 control vectors).

The model is a ``tf_keras`` Sequential 64-512-512-10 ReLU MLP initialised like PyTorch's
``nn.Linear`` (uniform in +-1/sqrt(fan_in)); SGD with momentum is Keras's. The train/test split is
fixed (stratified, 25% test, independent of ``--seed``); each rank trains on its own equal shard.
Keras shuffles each rank's shard every epoch (seeded by ``--seed`` and the rank).

Rank 0 shows Keras's progress bar (``verbose=1``; ``--no-progress``: none; other ranks are silent)
and prints, and with ``--json`` writes, the test accuracy and cross-entropy (from ``model.predict``
after training), the bytes this rank sends per step, the wall time of ``model.fit`` (tracing
included; ``first_step_s`` is the time to the end of the first batch), and whether all ranks end
with bit-identical weights (a checksum gathered from every rank; a mismatch is an error). Bytes sent
per step are counted as in ``examples/tensorflow2_digits.py``: ``4 * numel`` for ``none``,
``2 * numel`` for ``fp16``, and for ``qsgd`` the QSGD payload bytes plus **8** bytes per element of
the uncompressed (float64) tensors. The QSGD control vectors are reported apart as
``control_bytes_per_step``.
"""
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported: tf.keras is tf_keras (Keras 2)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402

import hvd_qsgd  # noqa: E402
from hvd_qsgd import codec, protocol  # noqa: E402

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
    """The fixed stratified split, features standardised on the training set; this rank's shard
    (the same as examples/pytorch_digits.py)."""
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


def make_model(seed, n_in=64, hidden=512, n_out=10):
    """64-hidden-hidden-10 ReLU MLP initialised like PyTorch's nn.Linear: the kernels with
    VarianceScaling(1/3, fan_in, uniform), i.e. U(+-1/sqrt(fan_in)), and the biases U(+-1/sqrt(fan_in))."""
    layers = []
    for i, (name, fan_in, units) in enumerate((("fc1", n_in, hidden), ("fc2", hidden, hidden),
                                                ("fc3", hidden, n_out))):
        bound = 1.0 / np.sqrt(fan_in)
        kw = dict(input_shape=(n_in,)) if i == 0 else {}
        init = keras.initializers
        layers.append(keras.layers.Dense(
            units, activation="relu" if name != "fc3" else None, name=name,
            kernel_initializer=init.VarianceScaling(1 / 3, "fan_in", "uniform", seed=seed + 2 * i),
            bias_initializer=init.RandomUniform(-bound, bound, seed=seed + 2 * i + 1), **kw))
    return keras.Sequential(layers, name="mlp")


def make_compression(args):
    if args.compression == "none":
        return hvd.Compression.none
    if args.compression == "fp16":
        return hvd.Compression.fp16
    return hvd_qsgd.QSGD(args.bits, bucket_size=args.bucket_size, min_numel=args.min_numel,
                         seed=args.seed, error_feedback=args.error_feedback)


def weight_checksum(model):
    """A 63-bit digest of every weight's bytes, in model.weights order."""
    h = hashlib.blake2b(digest_size=8)
    for v in model.weights:
        h.update(v.name.encode())
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1  # fits a signed int64 tensor


class StepLimit(keras.callbacks.Callback):
    """Stops after ``total`` batches in all (--max-steps); records the time to the first batch's end."""

    def __init__(self, total):
        super().__init__()
        self.total, self.steps, self.t0, self.first_step = total, 0, None, None

    def on_train_begin(self, logs=None):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.first_step is None:
            self.first_step = time.perf_counter() - self.t0
        if self.steps >= self.total:
            self.model.stop_training = True


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

    (x_tr, y_tr), (x_te, y_te), n_train = load_data(rank, size)

    # Each rank initialises (and shuffles) differently on purpose: the broadcast makes them agree.
    keras.utils.set_random_seed(args.seed * 1000 + rank)
    model = make_model(args.seed * 1000 + 10 * rank, hidden=args.hidden)
    compression = make_compression(args)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=args.lr, momentum=args.momentum),
                                   compression=compression)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    steps_per_epoch = (len(x_tr) + args.batch_size - 1) // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    epochs = (total_steps + steps_per_epoch - 1) // steps_per_epoch

    if rank == 0:
        print(f"[digits] keras np={size} compression={args.compression}"
              + (f" {compression!r}" if args.compression == "qsgd" else "") + f" train={n_train} "
              f"(shard {len(x_tr)}/rank) test={len(x_te)} steps={total_steps}", flush=True)

    limit = StepLimit(total_steps)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), limit]
    hvd.allreduce(tf.zeros([1]), name="start")  # line the ranks up before timing
    t0 = time.perf_counter()
    model.fit(x_tr, y_tr, batch_size=args.batch_size, epochs=epochs, shuffle=True, callbacks=callbacks,
              verbose=1 if rank == 0 and not args.no_progress else 0)
    train_time = time.perf_counter() - t0
    step = int(model.optimizer.iterations.numpy())
    if step != limit.steps:
        raise SystemExit(f"[digits] error: {limit.steps} batches but {step} optimizer steps")

    # Every rank must end with bit-identical weights.
    mine = tf.constant([weight_checksum(model)], dtype=tf.int64)
    sums = hvd.allgather(mine, name="param_checksum").numpy().tolist()
    identical = len(set(sums)) == 1

    numel = sum(int(v.shape.num_elements()) for v in model.trainable_weights)
    stats = compression.stats if args.compression == "qsgd" else None
    per_step, control_per_step = bytes_sent(args, numel, stats, step)
    result = None
    if rank == 0:
        qsgd = args.compression == "qsgd"
        none_bytes = 4 * numel
        # Evaluated from the predictions, so that the accuracy is an exact fraction of the test set.
        logits = model.predict(x_te, batch_size=len(x_te), verbose=0)
        test_accuracy = float(np.mean(np.argmax(logits, axis=1) == y_te))
        test_loss = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y_te, logits))
        names = [v.name.split(":")[0] for v in model.trainable_weights]
        result = dict(
            framework="keras",
            compression=args.compression,
            compressor=repr(compression) if qsgd else None,
            bits=compression.settings.bits if qsgd else None,
            bucket_size=compression.settings.bucket_size if qsgd else None,
            min_numel=compression.settings.min_numel if qsgd else None,
            error_feedback=args.error_feedback if qsgd else None,
            quantized=[n for n, v in zip(names, model.trainable_weights)
                       if v.shape.num_elements() >= args.min_numel] if qsgd else [],
            raw_bytes_per_element=RAW_BYTES_QSGD if qsgd else None,
            np=size, epochs=epochs, batch_size=args.batch_size, lr=args.lr,
            momentum=args.momentum, seed=args.seed, steps=step,
            test_accuracy=test_accuracy,
            test_loss=test_loss,
            bytes_per_step=per_step,
            bytes_per_step_none=none_bytes,
            ratio_vs_none=per_step / none_bytes,
            control_bytes_per_step=control_per_step,
            train_time_s=train_time,
            first_step_s=limit.first_step,
            params_identical=identical,
            param_checksums=[f"{s:016x}" for s in sums],
            stats=stats,
        )
        print(f"[digits] {args.compression}: test accuracy {test_accuracy:.4f} (loss {test_loss:.4f}) after "
              f"{step} steps, {per_step:,} bytes sent per step by rank 0 "
              f"({result['ratio_vs_none']:.3f} of float32"
              + (f"; uncompressed tensors as float64; + {control_per_step} control bytes" if qsgd else "")
              + f"), training {train_time:.2f} s (first step {limit.first_step:.2f} s), "
              f"weights bit-identical on all {size} ranks: {identical}", flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        if not identical:
            raise SystemExit(f"[digits] error: weights differ across ranks: {result['param_checksums']}")
    hvd.shutdown()
    return result


if __name__ == "__main__":
    main()
