"""Worker for tests/test_tf_elastic.py: elastic Horovod training of the Keras 3 digits MLP
(examples/keras_digits.py's model) with ``hvd_qsgd.QSGD(4, error_feedback=True)``,
``hvd_qsgd.tensorflow.keras.DistributedOptimizer`` in a custom ``tf.function`` step, and
``hvd_qsgd.tensorflow.elastic`` (``run``, ``TensorFlowKerasState``), under ``horovodrun
--host-discovery-script tests/mp/discover_hosts.sh`` (localhost: ranks 0 and 1; 127.0.0.1: rank 2).

The run, in steps (``state.step``; ``state.commit()`` every --commit-every steps), as in
tests/mp/elastic_worker.py:

* step --kill-step: the worker on 127.0.0.1 SIGKILLs itself in its backward pass (a
  ``tf.py_function`` in the gradient of fc1's output). The survivors' step fails; they roll back to
  the last commit, Horovod blacklists 127.0.0.1 and they go on as 2 ranks.
* once 127.0.0.1's cooldown is over, a commit raises HostsUpdatedInterrupt, a new worker starts
  there and every rank is synchronised from rank 0; by step --rejoin-step at the latest (the
  workers wait there, committing every 0.5 s, at most 30 s).
* the last step: every rank reports its weight checksum and test accuracy.

The training step is traced anew each time the training function starts (after every reset).
Data: step t trains on a fixed global batch of 96 samples; rank r of n takes the r-th of n equal
slices, so the averaged gradient is the global batch's whatever n is, and ``--reference PATH``
computes the uncompressed trajectory in one process.

Every rank prints ``ELASTIC {json}`` lines, ``event`` one of: start (entering the training function,
after the sync; ``init_s``: seconds from the first line of this file to the return of
``hvd.init()``), commit, kill, failed (a step raised a TensorFlow op error), reset (Horovod's reset
callbacks, after the compressor's reset and before the sync), waiting, final. Each holds the rank,
size, step, the compressor's creation index, exchange counters (``seq``, ``occurrences`` by state
key), residuals (state key: [elements, norm]), integer statistics and ``digest``: a hash of the
creation index, the counters and the residuals' keys and sizes.
"""
import time

STARTED = time.time()  # before the imports: how long a joining worker takes to reach hvd.init()

import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

import hvd_qsgd  # noqa: E402
import hvd_qsgd.tensorflow.elastic as elastic  # noqa: E402
import hvd_qsgd.tensorflow.keras as hvd_keras  # noqa: E402
from hvd_qsgd import codec  # noqa: E402
from hvd_qsgd.settings import Stats  # noqa: E402

from elastic_common import (LR, MOMENTUM, SEED, digest, global_batch, parse_args,  # noqa: E402  (tests/mp/)
                            rank_slice, reporter, steps, write_reference)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
import digits_common  # noqa: E402  (examples/: the digits split)
from keras_digits import make_model, weight_checksum  # noqa: E402

def single_threaded():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def accuracy(model, data):
    x, y = data
    return float(np.mean(np.argmax(model(x, training=False).numpy(), axis=1) == y))


def make_train_step(model, optimizer, after_fc1=tf.identity):
    """A new ``tf.function`` training step (a new trace; named train_step, so its state keys are
    ``train_step:<i>``). ``after_fc1``: applied to fc1's output (the kill point)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    fc1, fc2, fc3 = (model.get_layer(n) for n in ("fc1", "fc2", "fc3"))

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, fc3(fc2(after_fc1(fc1(x)))))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return tf.function(train_step)


def reference(args):
    """The uncompressed run: the same global batches, in one process."""
    single_threaded()
    (x, y), test, _ = digits_common.load_data(0, 1)
    per_epoch, total = steps(len(x), args.epochs)
    model = make_model(SEED)
    train_step = make_train_step(model, keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM))
    for step in range(total):
        idx = global_batch(step, len(x), per_epoch)
        train_step(tf.constant(x[idx]), tf.constant(y[idx]))
    write_reference(args, total, accuracy(model, test))


def snapshot(adapter):
    """The compressor's state on this rank (reads its internals: a test's view)."""
    residuals = {k: [int(v.shape.num_elements()), round(float(tf.norm(v)), 6)]
                 for k, v in sorted(adapter.residuals.residuals.items())}
    counters = adapter.exchange_counters()
    layout = [adapter._creation_index, counters["seq"], sorted(counters["occurrences"].items()),
              [(k, v[0]) for k, v in residuals.items()]]
    stats = adapter.stats
    return dict(creation_index=adapter._creation_index, seq=counters["seq"], occurrences=counters["occurrences"],
                slots=sorted(adapter.names.slots), residuals=residuals,
                stats={k: stats[k] for k in Stats.GRAPH_FIELDS},
                digest=digest(layout))


def main(args):
    hvd.init()  # first: a joining worker's peers wait for it in Gloo's rendezvous
    init_s = round(time.time() - STARTED, 2)
    single_threaded()
    codec.set_num_threads(1)
    host = os.environ.get("HOROVOD_HOSTNAME")
    (x, y), test, _ = digits_common.load_data(0, 1)
    per_epoch, total = steps(len(x), args.epochs)

    model = make_model(SEED)  # the same on every rank (the sync makes sure)
    compression = hvd_qsgd.QSGD(4, error_feedback=True, reduction=args.reduction, seed=SEED)
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM),
                                               compression=compression)
    state = elastic.TensorFlowKerasState(model, optimizer, compression=compression, step=0)
    adapter = elastic.tf_adapter(compression)
    marker = os.path.join(args.out, "killed")
    armed = []

    report = reporter(hvd, host, state, lambda: snapshot(adapter))

    def kill_if_armed():
        if armed:
            open(marker, "w").close()
            report("kill")
            os.kill(os.getpid(), signal.SIGKILL)
        return np.float32(0.0)

    @tf.custom_gradient
    def kill_point(h):
        def grad(dy):
            return dy + tf.py_function(kill_if_armed, [], tf.float32)
        return tf.identity(h), grad

    state.register_reset_callbacks([lambda: report("reset")])

    @elastic.run
    def train(state):
        train_step = make_train_step(model, optimizer, kill_point)  # traced for this world
        report("start", init_s=init_s)
        while state.step < total:
            if state.step == args.rejoin_step and hvd.size() < args.max_ranks:
                report("waiting")
                for _ in range(60):  # until a commit raises HostsUpdatedInterrupt
                    time.sleep(0.5)
                    state.commit()
            idx = rank_slice(global_batch(state.step, len(x), per_epoch), hvd.rank(), hvd.size())
            if state.step == args.kill_step and host == "127.0.0.1" and not os.path.exists(marker):
                armed.append(True)
            try:
                train_step(tf.constant(x[idx]), tf.constant(y[idx]))
            except tf.errors.OpError as e:
                report("failed", error=str(e.message)[-160:])
                raise
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()
                report("commit")

    train(state)
    report("final", checksum=f"{weight_checksum(model):016x}", test_accuracy=accuracy(model, test))


if __name__ == "__main__":
    a = parse_args(__doc__.split("\n\n")[0])
    reference(a) if a.reference else main(a)
