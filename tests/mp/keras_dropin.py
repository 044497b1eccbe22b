"""Worker for tests/test_keras_dropin.py: a Horovod Keras script run through the drop-in module
``hvd_qsgd.tensorflow.keras`` (imported as ``hvd``) with every callback, under horovodrun.

``python tests/mp/keras_dropin.py tf_keras|keras3``: the first sets ``TF_USE_LEGACY_KERAS=1`` before
TensorFlow is imported (tf_keras models and optimizers), the second uses Keras 3. Cases, each a
``model.fit`` of 4 epochs of 4 batches from weights that differ on every rank, on data that differs
on every rank (so the ranks' metrics differ): ``none`` (``hvd.Compression.none``; on tf_keras with a
legacy SGD, whose momentum is a variable, so momentum correction is checked), ``fp16`` and ``qsgd``
(``hvd_qsgd.QSGD(4, min_numel=1)``: every tensor quantized); then ``load_model`` of the ``none``
model and one more epoch; ``collectives`` (allreduce, allgather, broadcast, reducescatter,
process sets). Each rank prints one line per case, ``RESULT <keras> <case> OK`` or ``RESULT <keras>
<case> FAIL <reason>``, then ``CALLED <names>``: the drop-in names the worker used.
"""
import os
import sys
import tempfile
import traceback
import warnings

KERAS = sys.argv[1]
if KERAS == "tf_keras":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_qsgd  # noqa: E402
import hvd_qsgd.tensorflow.keras as hvd_module  # noqa: E402

if KERAS == "tf_keras":
    import tf_keras as keras  # noqa: E402
else:
    import keras  # noqa: E402

CALLED = set()
WARNINGS = []  # the messages of the warnings every fit gave


class Tracked:
    """The drop-in module, noting every name the worker takes from it (``callbacks.X`` and
    ``elastic.X`` by their dotted names)."""

    def __init__(self, module, prefix=""):
        self._module, self._prefix = module, prefix

    def __getattr__(self, name):
        CALLED.add(self._prefix + name)
        value = getattr(self._module, name)
        return Tracked(value, f"{name}.") if name in ("callbacks", "elastic") and not self._prefix else value


hvd = Tracked(hvd_module)
LR, EPOCHS, STEPS, BATCH, WARMUP = 0.1, 4, 4, 8, 2


def value(x):
    return float(x.numpy()) if hasattr(x, "numpy") else float(x)


def gather(x):
    return hvd_module.allgather(np.asarray(x, np.float64).reshape(1, -1)).numpy()


def identical(x, what):
    g = gather(np.ravel(x))
    assert all(np.array_equal(g[0], row) for row in g), f"{what} differs between ranks"


def build(seed):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.standard_normal(w.shape).astype(np.float32) * 0.3 for w in model.get_weights()])
    return model


def data(rank):
    rng = np.random.default_rng(1000 + rank)
    return rng.standard_normal((STEPS * BATCH, 8)).astype(np.float32), rng.integers(0, 4, STEPS * BATCH)


class Recorder(keras.callbacks.Callback):
    """lr (and momentum) at every batch, after the learning-rate callbacks set it; the weights
    before the first step; the epoch logs it sees (before or after MetricAverageCallback)."""

    def __init__(self):
        super().__init__()
        self.lr, self.momentum, self.first, self.logs, self.epoch = [], [], None, [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        opt = self.model.optimizer
        self.lr.append((self.epoch, batch, value(opt.learning_rate)))
        m = getattr(opt, "momentum", 0.0)
        self.momentum.append(value(m))
        if self.first is None:
            self.first = [w.copy() for w in self.model.get_weights()]

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append({k: float(v) for k, v in (logs or {}).items()})


def warmup_lr(epoch, batch, size):
    e = epoch + (batch + 1) / STEPS
    return LR / size * (e * (size - 1) / WARMUP + 1)


def expected_lr(epoch, batch, size):
    if epoch < WARMUP:
        return warmup_lr(epoch, batch, size)
    return LR * 0.5 ** (epoch - WARMUP)  # LearningRateScheduleCallback(multiplier=0.5, start_epoch=WARMUP)


def optimizer(case):
    if case == "none" and KERAS == "tf_keras":
        return keras.optimizers.legacy.SGD(LR, momentum=0.9)  # momentum is a variable: corrected
    return keras.optimizers.SGD(LR, momentum=0.9)


def compression(case):
    if case == "qsgd":
        return hvd_qsgd.QSGD(4, min_numel=1, seed=7)
    return hvd.Compression.fp16 if case == "fp16" else hvd.Compression.none


def fit_case(case, state_holder):
    rank, size = hvd.rank(), hvd.size()
    model = build(100 + rank)  # different on every rank: the broadcast makes them alike
    root = [hvd.broadcast(w, 0).numpy() for w in model.get_weights()]
    x, y = data(rank)
    c = compression(case)
    opt = hvd.DistributedOptimizer(optimizer(case), compression=c)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    local, averaged, rec = Recorder(), Recorder(), Recorder()
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), local, hvd.callbacks.MetricAverageCallback(),
                 averaged, hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=WARMUP, verbose=1),
                 hvd.callbacks.LearningRateScheduleCallback(initial_lr=LR, multiplier=0.5, start_epoch=WARMUP), rec]
    if case == "none":  # Horovod's elastic callbacks, wired to a state (no elastic launch here)
        state = hvd.elastic.KerasState(model, batch=0, epoch=0)
        commits = []
        state.commit = lambda: commits.append(1)
        callbacks += [hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
                      hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=callbacks)
    messages = [str(w.message) for w in caught]
    WARNINGS.extend(messages)

    # broadcast: every rank started from rank 0's weights
    for i, (w, r) in enumerate(zip(rec.first, root)):
        assert np.array_equal(w, r), f"weight {i} before the first step is not rank 0's"
    # the gradients were reduced: replicas identical after fit (ranks saw different data)
    for i, w in enumerate(model.get_weights()):
        identical(w, f"trained weight {i}")
    assert not np.array_equal(model.get_weights()[0], root[0]), "training did not move the weights"
    # the learning rate batch by batch: warm-up, then the schedule's multiplier
    assert len(rec.lr) == EPOCHS * STEPS, rec.lr
    for epoch, batch, lr in rec.lr:
        want = expected_lr(epoch, batch, size)
        assert np.isclose(lr, want, rtol=1e-6), f"lr at epoch {epoch} batch {batch}: {lr}, want {want}"
    assert np.isclose(rec.lr[0][2], LR / size * (1 + (size - 1) / (WARMUP * STEPS)), rtol=1e-6)
    assert np.isclose(rec.lr[WARMUP * STEPS - 1][2], LR, rtol=1e-6), "warm-up does not end at initial_lr"
    assert np.isclose(rec.lr[-1][2], LR * 0.5, rtol=1e-6), "the schedule's multiplier was not applied"
    assert np.isclose(rec.logs[-1]["lr"], LR * 0.5, rtol=1e-6), rec.logs[-1]
    # momentum correction: applied where momentum is a variable, else one warning saying so
    if case == "none" and KERAS == "tf_keras":
        prev = LR
        for (epoch, batch, lr), m in zip(rec.lr, rec.momentum):
            assert np.isclose(m, 0.9 * lr / prev, rtol=1e-5), f"momentum at {epoch}/{batch}: {m}"
            prev = lr
        assert np.isclose(value(model.optimizer.momentum), 0.9), "momentum not restored"
    else:
        assert all(np.isclose(m, 0.9) for m in rec.momentum), rec.momentum
    # metric averaging: the mean over the ranks of each rank's own (different) values
    for epoch, (mine, avg) in enumerate(zip(local.logs, averaged.logs)):
        for key in ("loss", "accuracy"):
            per_rank = gather([mine[key]])[:, 0]
            if key == "loss":
                assert len(set(per_rank.tolist())) == size, f"the ranks' losses are alike: {per_rank}"
            assert np.isclose(avg[key], per_rank.mean(), rtol=1e-9), f"{key} epoch {epoch}: {avg[key]} vs {per_rank}"
    if case == "qsgd":
        assert c.stats["tensors"] >= 4 * EPOCHS * STEPS, c.stats  # every tensor quantized, every step
    if case == "none":
        assert (state.batch, state.epoch) == (0, EPOCHS), (state.batch, state.epoch)
        assert len(commits) == EPOCHS * STEPS // 2 + EPOCHS, len(commits)
        state_holder["model"] = model


def load_model_case(state_holder):
    """The ``none`` model saved and loaded by hvd.load_model: its optimizer is distributed, one more
    epoch keeps the replicas identical."""
    model = state_holder["model"]
    path = os.path.join(tempfile.mkdtemp(), f"model_{hvd.rank()}.keras")
    model.save(path)
    legacy = KERAS == "tf_keras"  # the none case trained tf_keras's legacy SGD
    loaded = hvd.load_model(path, compression=hvd.Compression.none, legacy_opts=legacy)
    opt = loaded.optimizer
    assert getattr(opt, "_hvd_qsgd_wrapper", None) or hasattr(opt, "_allreduce_grads"), type(opt)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        assert np.array_equal(a, b)
    x, y = data(hvd.rank())
    loaded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    for i, w in enumerate(loaded.get_weights()):
        identical(w, f"weight {i} after loading and training")
    assert not np.array_equal(loaded.get_weights()[0], model.get_weights()[0])


def collectives_case():
    rank, size = hvd.rank(), hvd.size()
    assert hvd.is_initialized() and hvd.local_rank() == rank and hvd.local_size() == size
    assert hvd.cross_rank() == 0 and hvd.cross_size() == 1
    v = np.full((size * 2,), float(rank + 1), np.float32)
    assert np.allclose(hvd.allreduce(v).numpy(), (size + 1) / 2)
    assert np.allclose(hvd.allreduce(v, op=hvd.Sum).numpy(), size * (size + 1) / 2)
    assert np.allclose(hvd.allreduce(v, compression=hvd.Compression.fp16).numpy(), (size + 1) / 2)
    assert hvd.Adasum is not None and hvd.Average is not None
    got = hvd.allgather(np.array([[rank]], np.int32)).numpy()
    assert got.ravel().tolist() == list(range(size)), got
    assert hvd.broadcast(np.array([rank + 5.0]), 1).numpy().tolist() == [6.0]
    assert np.allclose(hvd.reducescatter(v, op=hvd.Sum).numpy(), size * (size + 1) / 2)
    assert hvd.reducescatter(v).shape[0] == 2
    var = tf.Variable([float(rank)])
    hvd.broadcast_variables([var], root_rank=1)
    assert var.numpy().tolist() == [1.0]
    try:  # Horovod's own: graph mode only
        hvd.broadcast_global_variables(0)
        raise AssertionError("broadcast_global_variables ran in eager mode")
    except RuntimeError as e:
        assert "broadcast_variables" in str(e), e
    sets = [hvd.add_process_set(hvd.ProcessSet([r])) for r in range(size)]
    mine = sets[rank]
    assert mine.included() and hvd.global_process_set.size() == size
    assert np.allclose(hvd.allreduce(v, process_set=mine).numpy(), v)
    for s in sets:
        hvd.remove_process_set(s)


def main():
    hvd.init(process_sets="dynamic")
    held = {}
    for case in ("none", "fp16", "qsgd"):
        run(case, fit_case, case, held)
    run("warnings", warnings_case)
    run("tape", tape_case)
    run("load_model", load_model_case, held)
    run("collectives", collectives_case)
    run("aliases", aliases_case)
    run("sparse_as_dense", sparse_as_dense_case)
    if KERAS == "keras3":   # (tf_keras: Horovod's own optimizer, which refuses a loss scaler)
        run("loss_scaler", loss_scaler_case)
    hvd.shutdown()
    print(f"CALLED {','.join(sorted(CALLED))}", flush=True)


def tape_case():
    """A GradientTape pipeline through ``hvd_qsgd.tensorflow`` (the drop-in for ``horovod.tensorflow``):
    broadcast_variables, PartialDistributedGradientTape with QSGD(4) and the last layer local: after
    two steps the other layers are identical across ranks and the local one is not; and its
    DistributedOptimizer (Keras 3: reduced in apply_gradients; tf_keras: Horovod's)."""
    import hvd_qsgd.tensorflow as htf
    rank = htf.rank()
    model = build(300 + rank)
    htf.broadcast_variables(model.variables, root_rank=0)
    x, y = data(rank)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(0.1)
    c = hvd_qsgd.QSGD(4, min_numel=1, seed=3)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = htf.PartialDistributedGradientTape(tape, compression=c, local_layers=[model.layers[-1]])
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for i in range(2):
        step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
    w = model.get_weights()
    identical(w[0], "first kernel")
    identical(w[1], "first bias")
    assert not np.array_equal(gather(np.ravel(w[2]))[0], gather(np.ravel(w[2]))[1]), "the local layer was reduced"
    dist = htf.DistributedOptimizer(keras.optimizers.SGD(0.1))
    if KERAS == "tf_keras":
        assert hasattr(dist, "_allreduce_grads"), type(dist)  # Horovod's own tf_keras optimizer
        return
    model = build(400 + rank)
    htf.broadcast_variables(model.variables, 0)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    dist.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    for i, w in enumerate(model.get_weights()):
        identical(w, f"weight {i} after DistributedOptimizer.apply_gradients")


def warnings_case():
    """The fits whose SGD holds momentum as a Python number (all but tf_keras's legacy one) warned,
    once in the process, that momentum_correction has no effect there."""
    said = [m for m in WARNINGS if "momentum_correction has no effect" in m]
    assert len(said) == 1, WARNINGS


def aliases_case():
    """The package's earlier names still work: a one-epoch fit with them leaves replicas identical."""
    model = build(200 + hvd.rank())
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(hvd.rank())
    cbs = [hvd.BroadcastInitialState(0), hvd.MetricAverage()]
    assert isinstance(cbs[0], hvd.callbacks.BroadcastGlobalVariablesCallback)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=cbs)
    for i, w in enumerate(model.get_weights()):
        identical(w, f"weight {i}")


def loss_scaler_case():
    """Keras 3 mixed precision. The loss scaler inside the distributed optimizer checks the reduced
    gradients: where rank 1 alone overflows in one batch, every rank skips that step (iterations one
    short of the batches on every rank, replicas identical). Around it, as model.compile wraps an
    optimizer under a mixed_float16 policy, it would check each rank's own gradients and leave rank
    0 waiting in the skipped step's collectives: refused on every rank, naming the order to use."""
    rank = hvd.rank()
    x, y = data(rank)
    if rank == 1:
        x[BATCH:2 * BATCH] *= 3e4   # float16 overflow in this rank's gradients of batch 1

    def fit(optimizer):
        model = build(500)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        return model

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = fit(hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR)),
                                             compression=hvd_qsgd.QSGD(4, min_numel=1)))
        assert int(model.optimizer.iterations.numpy()) == STEPS - 1, int(model.optimizer.iterations.numpy())
        for i, w in enumerate(model.get_weights()):
            identical(w, f"weight {i} with the loss scaler inside")
        try:
            fit(hvd.DistributedOptimizer(keras.optimizers.SGD(LR), compression=hvd_qsgd.QSGD(4, min_numel=1)))
            raise AssertionError("model.compile's loss scaler around the distributed optimizer was taken")
        except ValueError as e:
            assert "is the inner optimizer of LossScaleOptimizer" in str(e), e
            assert "DistributedOptimizer(keras.optimizers.LossScaleOptimizer(optimizer)" in str(e), e
    finally:
        keras.mixed_precision.set_global_policy("float32")


def sparse_as_dense_case():
    """An Embedding's gradient (tf.IndexedSlices) densified by sparse_as_dense=True is compressed, as
    compressor.md says, and the replicas stay identical. (tf_keras's fit hands the compressor a dense
    gradient of static shape (None, 16), which went uncompressed, silently: it takes its variable's
    shape now.)"""
    rank = hvd.rank()
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(1000, 16),
                              keras.layers.Flatten(), keras.layers.Dense(4)])
    model.set_weights([np.random.default_rng(300).standard_normal(w.shape).astype(np.float32) * 0.1
                       for w in model.get_weights()])
    rng = np.random.default_rng(2000 + rank)
    x, y = rng.integers(0, 1000, (STEPS * BATCH, 3)), rng.integers(0, 4, STEPS * BATCH)
    c = hvd_qsgd.QSGD(4, seed=7)   # (default min_numel: the embedding, 16,000 elements, alone)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR), compression=c, sparse_as_dense=True),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    assert c.stats["tensors"] == STEPS, c.stats
    for i, w in enumerate(model.get_weights()):
        identical(w, f"trained weight {i}")


def run(case, fn, *args):
    try:
        fn(*args)
        print(f"RESULT {KERAS} {case} OK", flush=True)
    except Exception as e:  # a failed case is reported, and the others still run
        traceback.print_exc()
        print(f"RESULT {KERAS} {case} FAIL {type(e).__name__}: {str(e)[:300]!r}", flush=True)


if __name__ == "__main__":
    main()
