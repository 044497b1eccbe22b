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

The flags, the data split and shards, and the end-of-run reporting (bytes per step, summary line,
JSON results) are shared with the PyTorch and Keras examples in ``examples/digits_common.py``.
"""
import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

from hvd_qsgd import codec

import digits_common as common  # examples/digits_common.py: flags, data, reporting

RAW_BYTES_QSGD = 8  # uncompressed gradients travel as float64 with hvd_qsgd's TensorFlow adapter


def parse_args(argv=None):
    return common.parse_args(argv, __doc__.split("\n\n")[0],
                             "TensorFlow intra- and inter-op threads and codec threads per rank "
                             "(default 1: ranks share few cores)")


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


def param_checksum(names, variables):
    """A 63-bit digest of every variable's bytes, in order."""
    return common.checksum((name, v.numpy()) for name, v in zip(names, variables))


def evaluate(model, data):
    """(accuracy, mean cross-entropy) on ``data``."""
    x, y = data
    logits = model(tf.constant(x))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return float(np.mean(tf.argmax(logits, axis=1).numpy() == y)), float(loss)


def main(argv=None):
    args = parse_args(argv)
    threads = max(1, args.threads)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    codec.set_num_threads(threads)

    (x_tr, y_tr), test, n_train = common.load_data(rank, size)

    # Each rank initialises differently on purpose: the broadcast is what makes them agree.
    model = MLP(np.random.default_rng([args.seed, rank, 1]), hidden=args.hidden)
    params = model.params
    names = model.names()
    momenta = [tf.Variable(tf.zeros_like(v), trainable=False, name=f"{n}/momentum")
               for n, v in zip(names, params)]
    compression = common.make_compression(args, hvd.Compression)
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

    _, total_steps, epochs = common.schedule(args, len(x_tr))
    rng = np.random.default_rng([args.seed, rank])  # this rank's shuffling of its own shard

    if rank == 0:
        common.announce(args, compression, "tensorflow", size, n_train, len(x_tr), len(test[0]),
                        total_steps)
    bar = common.progress_bar(args, compression, total_steps) if rank == 0 else None

    hvd.allreduce(tf.zeros([1]), name="start")  # line the ranks up before timing
    t0 = time.perf_counter()
    first_step = None
    step = 0
    for epoch, idx, end in common.minibatches(rng, len(x_tr), args.batch_size, total_steps):
        loss = train_step(tf.constant(x_tr[idx]), tf.constant(y_tr[idx]))
        step += 1
        if first_step is None:
            loss.numpy()  # wait for it: the first step traces the function
            first_step = time.perf_counter() - t0
        if bar is not None:
            bar.update(1)
            if end:
                bar.set_postfix_str(f"ep {epoch + 1} loss {float(loss):.3f}", refresh=False)
    for v in params:
        v.numpy()  # the last step's updates are done
    train_time = time.perf_counter() - t0
    if bar is not None:
        bar.close()

    # Every rank must end with bit-identical parameters.
    mine = tf.constant([param_checksum(names, params)], dtype=tf.int64)
    sums = hvd.allgather(mine, name="param_checksum").numpy().tolist()

    named_sizes = [(n, int(v.shape.num_elements())) for n, v in zip(names, params)]
    stats = common.compressor_stats(args, compression)
    per_step, control_per_step = common.bytes_sent(args, sum(n for _, n in named_sizes), stats, step,
                                                   size, raw_bytes=RAW_BYTES_QSGD)
    result = None
    if rank == 0:
        test_accuracy, test_loss = evaluate(model, test)
        result = common.results(
            args, compression, named_sizes, size=size, epochs=epochs, steps=step,
            test_accuracy=test_accuracy, per_step=per_step, control_per_step=control_per_step,
            train_time=train_time, checksums=sums, stats=stats, framework="tensorflow",
            raw_bytes_per_element=RAW_BYTES_QSGD, test_loss=test_loss, first_step=first_step)
        common.report(args, result)
    hvd.shutdown()
    return result


if __name__ == "__main__":
    main()
