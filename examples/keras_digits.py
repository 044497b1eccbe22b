"""Data-parallel training of a small MLP on scikit-learn's digits with Horovod Keras and QSGD.

The Keras counterpart of ``examples/pytorch_digits.py`` (same flags, data split, shards and JSON keys
where they apply). Run under Horovod (Gloo or MPI controller alike), e.g.::

    horovodrun -np 4 --gloo -H localhost:4 .venv/bin/python examples/keras_digits.py \
        --compression qsgd --bits 4 --json /tmp/qsgd.json

Keras 3 by default, as TensorFlow 2.16 and later ship it: ``model.compile(optimizer=
hvd_qsgd.tensorflow.keras.DistributedOptimizer(keras.optimizers.SGD(lr, momentum),
compression=...), jit_compile=False)`` and ``model.fit`` with the callbacks
``hvd_qsgd.tensorflow.keras.BroadcastInitialState(0)`` (rank 0's weights and optimizer state to every
rank at the start, and after the first batch) and ``MetricAverage()``. Horovod 0.28.1's own Keras
wrapper does not average a Keras 3 optimizer's gradients (its issue 4290), which is why the
package's is used. ``--tf-keras`` runs the stock Horovod Keras recipe on Keras 2 (``tf_keras``,
``TF_USE_LEGACY_KERAS=1`` set before TensorFlow is imported): ``horovod.tensorflow.keras.
DistributedOptimizer`` and ``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``. Ranks initialise
differently on purpose, so the broadcast is what makes them agree. The compressions:

* ``none``: ``hvd.Compression.none`` (float32 allreduce);
* ``fp16``: ``hvd.Compression.fp16`` (float16 allreduce);
* ``qsgd``: ``hvd_qsgd.QSGD(bits, bucket_size=..., min_numel=..., error_feedback=...)``. Gradients
  with at least ``--min-numel`` elements (fc1/kernel, 32,768, and fc2/kernel, 262,144) are quantized
  in the traced train step; every rank's payload travels by allgather and every rank decodes and
  sums all of them in rank order. Smaller gradients (the biases and fc3) go through Horovod's
  allreduce *as float64* (the TensorFlow adapter casts them, so that a grouped allreduce can hold
  them together with its float64 control vectors).

The model is a Keras Sequential 64-512-512-10 ReLU MLP initialised like PyTorch's
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

The flags, the data split and shards, and the end-of-run reporting (bytes per step, summary line,
JSON results) are shared with the PyTorch and TensorFlow 2 examples in ``examples/digits_common.py``.
"""
import os
import sys

TF_KERAS = "--tf-keras" in sys.argv
if TF_KERAS:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported: tf.keras is tf_keras (Keras 2)

import time  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if TF_KERAS:
    import tf_keras as keras  # noqa: E402
    import horovod.tensorflow.keras as hvd  # noqa: E402
    hqk = None
else:
    import keras  # noqa: E402
    import horovod.tensorflow as hvd  # noqa: E402
    import hvd_qsgd.tensorflow.keras as hqk  # noqa: E402

from hvd_qsgd import codec  # noqa: E402

import digits_common as common  # noqa: E402  (examples/digits_common.py: flags, data, reporting)

RAW_BYTES_QSGD = 8  # uncompressed gradients travel as float64 with hvd_qsgd's TensorFlow adapter


def add_flags(p):
    p.add_argument("--tf-keras", action="store_true",
                   help="Keras 2 (tf_keras) and Horovod's own Keras wrapper instead of Keras 3")


def parse_args(argv=None):
    return common.parse_args(argv, __doc__.split("\n\n")[0],
                             "TensorFlow intra- and inter-op threads and codec threads per rank "
                             "(default 1: ranks share few cores)", add_flags=add_flags)


def make_model(seed, n_in=64, hidden=512, n_out=10):
    """64-hidden-hidden-10 ReLU MLP initialised like PyTorch's nn.Linear: the kernels with
    VarianceScaling(1/3, fan_in, uniform), i.e. U(+-1/sqrt(fan_in)), and the biases U(+-1/sqrt(fan_in))."""
    layers = []
    for i, (name, fan_in, units) in enumerate((("fc1", n_in, hidden), ("fc2", hidden, hidden),
                                                ("fc3", hidden, n_out))):
        bound = 1.0 / np.sqrt(fan_in)
        kw = dict(input_shape=(n_in,)) if i == 0 and TF_KERAS else {}
        init = keras.initializers
        layers.append(keras.layers.Dense(
            units, activation="relu" if name != "fc3" else None, name=name,
            kernel_initializer=init.VarianceScaling(1 / 3, "fan_in", "uniform", seed=seed + 2 * i),
            bias_initializer=init.RandomUniform(-bound, bound, seed=seed + 2 * i + 1), **kw))
    if not TF_KERAS:
        layers.insert(0, keras.Input((n_in,)))
    return keras.Sequential(layers, name="mlp")


def weight_name(v):
    """A weight's name without the model's: ``fc1/kernel`` (Keras 3: its path; tf_keras: its name)."""
    name = v.path if not TF_KERAS else v.name.split(":")[0]
    return name[len("mlp/"):] if name.startswith("mlp/") else name


def weight_checksum(model):
    """A 63-bit digest of every weight's bytes, in model.weights order."""
    return common.checksum((weight_name(v), v.numpy()) for v in model.weights)


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


def main(argv=None):
    args = parse_args(argv)
    threads = max(1, args.threads)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    codec.set_num_threads(threads)

    (x_tr, y_tr), (x_te, y_te), n_train = common.load_data(rank, size)

    # Each rank initialises (and shuffles) differently on purpose: the broadcast makes them agree.
    keras.utils.set_random_seed(args.seed * 1000 + rank)
    model = make_model(args.seed * 1000 + 10 * rank, hidden=args.hidden)
    compression = common.make_compression(args, hvd.Compression)
    sgd = keras.optimizers.SGD(learning_rate=args.lr, momentum=args.momentum)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if TF_KERAS:
        opt = hvd.DistributedOptimizer(sgd, compression=compression)
        model.compile(optimizer=opt, loss=loss, metrics=["accuracy"])
        broadcast = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    else:  # XLA off: Horovod's collectives and the codec's ops have no XLA kernels
        opt = hqk.DistributedOptimizer(sgd, compression=compression)
        model.compile(optimizer=opt, loss=loss, metrics=["accuracy"], jit_compile=False)
        broadcast = [hqk.BroadcastInitialState(0), hqk.MetricAverage()]

    _, total_steps, epochs = common.schedule(args, len(x_tr))

    if rank == 0:
        common.announce(args, compression, "keras", size, n_train, len(x_tr), len(x_te), total_steps)

    limit = StepLimit(total_steps)
    callbacks = broadcast + [limit]
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

    named_sizes = [(weight_name(v), int(np.prod(v.shape))) for v in model.trainable_weights]
    stats = common.compressor_stats(args, compression)
    per_step, control_per_step = common.bytes_sent(args, sum(n for _, n in named_sizes), stats, step,
                                                   size, raw_bytes=RAW_BYTES_QSGD)
    result = None
    if rank == 0:
        # Evaluated from the predictions, so that the accuracy is an exact fraction of the test set.
        logits = model.predict(x_te, batch_size=len(x_te), verbose=0)
        test_accuracy = float(np.mean(np.argmax(logits, axis=1) == y_te))
        test_loss = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y_te, logits))
        result = common.results(
            args, compression, named_sizes, size=size, epochs=epochs, steps=step,
            test_accuracy=test_accuracy, per_step=per_step, control_per_step=control_per_step,
            train_time=train_time, checksums=sums, stats=stats, framework="keras" if not TF_KERAS else "tf_keras",
            raw_bytes_per_element=RAW_BYTES_QSGD, test_loss=test_loss, first_step=limit.first_step)
        common.report(args, result, what="weights")
    hvd.shutdown()
    return result


if __name__ == "__main__":
    main()
