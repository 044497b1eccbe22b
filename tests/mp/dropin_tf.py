"""Worker for tests/test_dropin.py: Horovod's TensorFlow 2 tape pipeline as its examples write it,
with the compression built inside the ``tf.function`` step, and with a process set.

``step-built``: for QSGD(4) with error feedback, DynamicQSGD, BlockSign and the TensorFlow
adapter class (``hvd_qsgd.tensorflow.QSGD``) with error feedback, the step of Horovod's
synthetic benchmark (``@tf.function def step(first_batch)``: the compressor built in the step,
``hvd.DistributedGradientTape``, the broadcast on the first batch) runs STEPS times, so the step is
traced again when ``first_batch`` turns False; then the same program with the compressor built once
outside the step, from the same creation index. The parameters must be bit-identical after every
step, the replicas identical across ranks, the in-step instances one compressor (shared state),
its statistics counting every step once and its residuals non-zero.

``process-set`` (at -np 3): the tape reduces over the process set of the even ranks (or of the odd
rank), the compressor given no set (it takes Horovod's): the replicas are identical within each set
and the compressor reduced every gradient of the even set; a tape over the even set, run on every
rank, hands the odd rank its own gradient back, as Horovod does.

``v1-init-first``: a ``tf.compat.v1`` session that ran its initializer before the tape (and so the
compressor's variables) was built, as Horovod's graph-mode tests do: the step runs, exact.

``one-rank-retrace``: one rank's batch is smaller at one step (an uneven last shard), so that rank
alone traces the step again: the exchanges of its new trace meet the other ranks' (they hung),
and the replicas stay identical, with and without error feedback, both reductions.

``shared-state``: one compressor with error feedback handed to the steps of two models, traced
functions of the same name (a tape step; two Keras 3 models' fit): the second step's trace raises, on
every rank, rather than mix the two models' residuals; the steps of one model, traced again for
another batch size, take it.

``differentiable``: ``hvd.allreduce(x, compression=...)`` under a gradient tape, eagerly and in a
``tf.function``, carries the gradient back as Horovod's own allreduce does (the same gradient as
uncompressed, for Average, Sum and scale factors).

Every rank prints ``OK <scenario>`` when its checks pass.
"""
import itertools
import re
import sys

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import hvd_qsgd
import hvd_qsgd.tensorflow
from hvd_qsgd import settings as hvd_qsgd_settings

SHAPES = [(32, 10), (10,)]   # a linear model: every exchange is traced, a retrace costs each again
STEPS = 4
CREATION_INDEX = 1000


def make_vars():
    rng = np.random.default_rng(5 + hvd.rank())  # different on every rank: the first step broadcasts
    return [tf.Variable(rng.standard_normal(s).astype(np.float32) * 0.1) for s in SHAPES]


def batch(step):
    rng = np.random.default_rng(100 * step + hvd.rank())
    return (tf.constant(rng.standard_normal((16, 32)).astype(np.float32)),
            tf.constant(rng.integers(0, 10, 16)))


def loss_fn(vs, x, y):
    logits = x @ vs[0] + vs[1]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


COMPRESSORS = {
    "qsgd-ef": lambda: hvd_qsgd.QSGD(4, min_numel=1, error_feedback=True),
    "dqsgd": lambda: hvd_qsgd.DynamicQSGD(3.0, min_numel=1),
    "blocksign": lambda: hvd_qsgd.BlockSign(block_size=64, min_numel=1, reduction="allgather"),
    "tf-adapter-ef": lambda: hvd_qsgd.tensorflow.QSGD(4, min_numel=1, error_feedback=True),
}


def train(make, inside):
    """The parameters after each step, and the compressor instances the steps used."""
    hvd_qsgd_settings._creation_counter = itertools.count(CREATION_INDEX)  # the same exchange names
    vs = make_vars()
    used = []
    outside = None if inside else make()

    @tf.function
    def step(x, y, first_batch):
        compression = make() if inside else outside
        used.append(compression)
        with tf.GradientTape() as tape:
            loss = loss_fn(vs, x, y)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, vs)
        for v, g in zip(vs, grads):
            v.assign_sub(0.1 * g)
        if first_batch:
            hvd.broadcast_variables(vs, root_rank=0)
        return loss

    history = []
    for i in range(STEPS):
        x, y = batch(i)
        step(x, y, i == 0)
        history.append([v.numpy().copy() for v in vs])
    return history, used


def scenario_step_built():
    for label, make in COMPRESSORS.items():
        built, used_in = train(make, inside=True)
        once, _ = train(make, inside=False)
        assert len(used_in) >= 2, f"{label}: the step was traced {len(used_in)} times, expected a retrace"
        assert len({id(c) for c in used_in}) == len(used_in), f"{label}: a trace reused the instance"
        assert len({id(c.__dict__) for c in used_in}) == 1, f"{label}: the in-step instances do not share state"
        for i, (a, b) in enumerate(zip(built, once)):
            for j, (va, vb) in enumerate(zip(a, b)):
                assert np.array_equal(va, vb), f"{label}: step {i} parameter {j} differs from the compressor built outside"
        for j, v in enumerate(built[-1]):
            others = hvd.allgather(tf.constant(v[None])).numpy()
            assert all(np.array_equal(o, v) for o in others), f"{label}: replicas differ in parameter {j}"
        c = used_in[-1]
        stats = c.stats
        assert stats["tensors"] == STEPS * len(SHAPES), f"{label}: stats count {stats['tensors']} exchanges"
        if c.settings.error_feedback:
            adapter = c._adapter("tensorflow") if isinstance(c, hvd_qsgd.QSGD) else c
            residuals = adapter.residuals.residuals
            assert len(residuals) == len(SHAPES) and all(float(tf.reduce_sum(tf.abs(r))) > 0
                                                         for r in residuals.values()), f"{label}: residuals"
    print("OK step-built", flush=True)


def scenario_process_set():
    rank, size = hvd.rank(), hvd.size()
    even = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odd = hvd.add_process_set([r for r in range(size) if r % 2 == 1])
    mine = even if rank % 2 == 0 else odd
    try:
        vs = make_vars()
        compression = hvd_qsgd.QSGD(4, min_numel=1, error_feedback=True)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(vs, x, y)
            tape = hvd.DistributedGradientTape(tape, compression=compression, process_set=mine)
            for v, g in zip(vs, tape.gradient(loss, vs)):
                v.assign_sub(0.1 * g)
            return loss

        hvd.broadcast_variables(vs, root_rank=0)
        start = [v.numpy().copy() for v in vs]
        for i in range(STEPS):
            step(*batch(i))
        for j, v in enumerate(vs):
            assert not np.array_equal(v.numpy(), start[j]), f"parameter {j} was not updated"
            others = hvd.allgather(tf.constant(v.numpy()[None]), process_set=mine).numpy()
            assert all(np.array_equal(o, v.numpy()) for o in others), f"replicas differ in parameter {j}"
        # Horovod reduces nothing over a set of one rank (the odd set at -np 3)
        expected = STEPS * len(SHAPES) if mine.size() > 1 else 0
        assert compression.stats["tensors"] == expected, (expected, compression.stats)
        # a tape over the even set, on every rank: Horovod hands a rank outside the set its own
        # gradient back, and so does the compressor
        x = tf.constant(np.full(4, float(rank), np.float32))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(x * x)
        outside = hvd_qsgd.QSGD(4, min_numel=1)
        g = hvd.DistributedGradientTape(tape, process_set=even, compression=outside).gradient(y, [x])[0].numpy()
        if rank % 2 == 1:
            assert np.array_equal(g, 2 * x.numpy()) and outside.stats["tensors"] == 0, (g, outside.stats)
        else:
            assert outside.stats["tensors"] == 1, outside.stats
    finally:
        hvd.remove_process_set(odd)
        hvd.remove_process_set(even)
    print("OK process-set", flush=True)


def scenario_v1_init_first():
    """A tf.compat.v1 graph whose session ran the initializer before the tape was built (the order of
    Horovod's graph-mode tests): the compressor's variables are initialized as they are made."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        w = tf.Variable(tf.ones([40]) * (hvd.rank() + 1.0))
        sess.run(tf.compat.v1.global_variables_initializer())
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        compression = hvd_qsgd.QSGD(4, min_numel=1)
        grads = hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, [w])
        for _ in range(2):
            g = sess.run(grads)[0]
            # 2w is constant per rank: every bucket quantizes it exactly, so the average is exact
            expected = np.float32(sum(2.0 * (r + 1) for r in range(hvd.size())) / hvd.size())
            assert np.array_equal(g, np.full(40, expected, np.float32)), g
        assert sess.run(compression.stats["tensors"]) == 2
    print("OK v1-init-first", flush=True)


def scenario_one_rank_retrace():
    compressors = {"allgather": lambda: hvd_qsgd.QSGD(8, min_numel=1, reduction="allgather"),
                   "scatter-ef": lambda: hvd_qsgd.QSGD(4, min_numel=1, reduction="scatter_allgather",
                                                       error_feedback=True)}
    for label, make in compressors.items():
        v = tf.Variable(np.random.default_rng(0).standard_normal((30, 40)).astype(np.float32) * 0.1)
        compression = make()

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.tanh(x @ v) ** 2)
            g = hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, [v])[0]
            v.assign_sub(0.01 * g)

        for i in range(4):
            rows = 8 if (i == 2 and hvd.rank() == 1) else 16
            step(tf.constant(np.random.default_rng(10 * i + hvd.rank()).standard_normal((rows, 30)), tf.float32))
        traces = hvd.allgather(tf.constant([step.experimental_get_tracing_count()])).numpy()
        assert traces[1] == 2 and all(t == 1 for r, t in enumerate(traces) if r != 1), (label, traces)
        every = hvd.allgather(v[None]).numpy()
        assert all(np.array_equal(every[0], w) for w in every), label
    print("OK one-rank-retrace", flush=True)


def scenario_shared_state():
    shared = hvd_qsgd.QSGD(4, min_numel=1, error_feedback=True)

    def model():
        v = tf.Variable(tf.ones([30, 40]))

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((x @ v) ** 2)
            v.assign_sub(1e-4 * hvd.DistributedGradientTape(tape, compression=shared).gradient(loss, [v])[0])
        return step

    first, second = model(), model()
    first(tf.ones([4, 30]))
    first(tf.ones([6, 30]))   # (traced again, for the same variable)
    try:
        second(tf.ones([4, 30]))
    except ValueError as e:
        message = " ".join(str(e).split())
        assert re.search(r"hvd_qsgd: the gradients of two variables \(\S+, \S+\) reach one compressor at the same "
                         r"place \(step:0\) of traced functions named alike, and it keeps error-feedback residuals by "
                         r"that place, where theirs would mix: give each model's training step \(or tape\) its own "
                         r"compressor", message), message
    else:
        raise AssertionError("a second model's step shared the first one's residuals")
    keras_models_sharing_state()
    print("OK shared-state", flush=True)


def keras_models_sharing_state():
    """The same through the package's Keras 3 DistributedOptimizer and model.fit, whose steps Keras
    names alike (``one_step_on_data``): the second model's fit raises, naming both variables' paths
    (it mixed the residuals silently: that optimizer's hvd.allreduce is not Horovod's allreduce_grads,
    in whose frames the variable was found)."""
    import keras
    import hvd_qsgd.tensorflow.keras as hvd_keras
    shared = hvd_qsgd.QSGD(4, min_numel=1, error_feedback=True)
    x, y = np.ones((8, 6), np.float32), np.ones((8, 2), np.float32)
    models = []
    for _ in range(2):
        m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
        m.compile(loss="mse", optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=shared))
        models.append(m)
    models[0].fit(x, y, batch_size=8, epochs=1, verbose=0)
    try:
        models[1].fit(x, y, batch_size=8, epochs=1, verbose=0)
    except ValueError as e:
        first, second = (m.layers[0].kernel.path for m in models)
        assert f"two variables ({first}, {second}) reach one compressor" in str(e), str(e)
    else:
        raise AssertionError("a second Keras model's fit shared the first one's residuals")


def scenario_differentiable():
    calls = [dict(), dict(op=hvd.Sum), dict(op=hvd.Average, prescale_factor=0.5, postscale_factor=3.0)]
    for mode, (i, kwargs) in itertools.product(("eager", "function"), enumerate(calls)):
        grads, values = [], []
        for compression in (hvd.Compression.none, hvd_qsgd.QSGD(8, min_numel=1)):
            rng = np.random.default_rng(100 + hvd.rank())
            w = tf.Variable(rng.standard_normal(3000, dtype=np.float32))
            upstream = tf.constant(rng.standard_normal(3000, dtype=np.float32))

            def step():
                with tf.GradientTape() as tape:
                    y = hvd.allreduce(w * 2, compression=compression, name=f"differentiable.{mode}.{i}", **kwargs)
                    loss = tf.reduce_sum(y * upstream)
                return y, tape.gradient(loss, w)
            y, grad = (tf.function(step) if mode == "function" else step)()
            assert grad is not None, (mode, kwargs)
            grads.append(grad.numpy())
            values.append(y.numpy())
        np.testing.assert_allclose(grads[1], grads[0], rtol=1e-6, atol=1e-6, err_msg=f"{mode} {kwargs}")
        # (the values are QSGD's: within 8-bit quantization of the exact ones)
        assert np.linalg.norm(values[1] - values[0]) < 0.05 * np.linalg.norm(values[0]), (mode, kwargs)
    print("OK differentiable", flush=True)


def main():
    hvd.init()
    for s in sys.argv[1:]:
        {"step-built": scenario_step_built, "process-set": scenario_process_set,
         "v1-init-first": scenario_v1_init_first, "differentiable": scenario_differentiable,
         "one-rank-retrace": scenario_one_rank_retrace, "shared-state": scenario_shared_state}[s]()


if __name__ == "__main__":
    main()
