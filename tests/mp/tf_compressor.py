"""Worker for tests/test_tf_compressor.py: TensorFlow scenarios under horovodrun.

Every rank prints ``OK <scenario>`` when its checks pass, or ``RAISED <type>: <message> (scenario
<scenario>)`` for the mismatch scenarios. References are computed independently: every rank's local gradient is gathered,
re-encoded with ``hvd_qsgd.codec`` from the documented seed
(``protocol.payload_seed(seed, rank, "hvd_qsgd_<k>_s<seq>", occurrence)``) and decoded with
``codec.decode_sum(payloads, 1/n)``; the synchronized gradient must equal it exactly. The
scatter_allgather scenarios regenerate every rank's input from the seed and the rank
(``rank_input``) and compare with ``hvd_qsgd.reduction.simulate`` of all ranks' inputs.
"""
import argparse
import os
import sys

import numpy as np

if "keras" in sys.argv:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
import tensorflow as tf  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

import hvd_qsgd  # noqa: E402
from hvd_qsgd import codec, cost_model, protocol, reduction  # noqa: E402
from tests.mp.tf_graphs import foldable_collectives  # noqa: E402

SEED = 11
SHAPES = [(64, 200), (200,), (200, 100), (100,), (100, 10), (10,)]  # 12800, 20000 and 1000 elements


def make_vars():
    rng = np.random.default_rng(0)
    return [tf.Variable(rng.standard_normal(s).astype(np.float32) * 0.1) for s in SHAPES]


def batch(rank, step=0):
    rng = np.random.default_rng(1000 * step + rank)
    return rng.standard_normal((16, 64)).astype(np.float32), rng.integers(0, 10, 16)


def loss_fn(vs, x, y):
    h = tf.nn.relu(x @ vs[0] + vs[1])
    h = tf.nn.relu(h @ vs[2] + vs[3])
    logits = h @ vs[4] + vs[5]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def local_grads(vs, rank, step=0):
    x, y = batch(rank, step)
    with tf.GradientTape() as tape:
        loss = loss_fn(vs, x, y)
    return [g.numpy() for g in tape.gradient(loss, vs)]


def gather_np(a):
    return [x for x in hvd.allgather(tf.constant(a[None])).numpy()]


def reference(per_rank, exchange, occurrence, bits=4, bucket=512, dtype="float32"):
    n = len(per_rank)
    shape = per_rank[0].shape
    payloads = [codec.encode(g.astype(np.float32).reshape(-1), bits, bucket, "max",
                             protocol.payload_seed(SEED, r, exchange, occurrence), "fixed",
                             codec.tensor_fingerprint("", shape, dtype), True, source_dtype=dtype)
                for r, g in enumerate(per_rank)]
    return codec.decode_sum(payloads, 1.0 / n).reshape(shape)


def check_identical(a, what):
    copies = gather_np(np.asarray(a, dtype=np.float32))
    for r, c in enumerate(copies):
        assert np.array_equal(c, copies[0]), f"{what}: rank {r} differs from rank 0"


def scenario_tape():
    """DistributedGradientTape in a tf.function, two steps: each equals the reference exactly."""
    rank = hvd.rank()
    vs = make_vars()
    c = hvd_qsgd.QSGD(4, seed=SEED)
    traces = []

    @tf.function
    def reduced_grads(x, y):
        traces.append(1)
        with tf.GradientTape() as tape:
            loss = loss_fn(vs, x, y)
        tape = hvd.DistributedGradientTape(tape, compression=c)
        return tape.gradient(loss, vs)

    times = [c.stats]
    for step in range(2):
        mine = local_grads(vs, rank, step)
        grads = [g.numpy() for g in reduced_grads(*batch(rank, step))]
        times.append(c.stats)
        names = [name for name, _ in c._adapters["tensorflow"].traced_exchanges[-2:]]  # the last trace
        k = 0
        for i, g in enumerate(grads):
            if g.size >= 10000:
                ref = reference(gather_np(mine[i]), names[k], step)
                k += 1
                assert np.array_equal(g, ref), f"var {i} step {step}: max diff {np.abs(g - ref).max()}"
            else:
                assert np.allclose(g, np.mean(gather_np(mine[i]), axis=0), rtol=1e-5, atol=1e-7), i
            check_identical(g, f"var {i}")
    # traced once: the compressor's variables, made in the first trace, do not make TensorFlow trace
    # the step again (state.state_variable); its two exchanges numbered from s0
    assert len(traces) == 1, f"the step was traced {len(traces)} times"
    assert [name for name, _ in c._adapters["tensorflow"].traced_exchanges] == names, names
    assert names[0].endswith("_s0") and names[1].endswith("_s1"), names
    x, y = batch(rank)
    gd = reduced_grads.get_concrete_function(tf.constant(x), tf.constant(y)).graph.as_graph_def()
    types = {n.op for n in gd.node} | {n.op for f in gd.library.function for n in f.node_def}
    for op in ("QsgdEncode", "QsgdControlVector", "QsgdCheckControl", "QsgdDecodeSum", "HorovodAllgather",
               "HorovodAllreduce"):
        assert op in types, (op, sorted(types))
    assert not foldable_collectives(gd), foldable_collectives(gd)  # every collective runs at every step
    st = c.stats
    assert st["tensors"] == 4 and st["elements"] == 2 * 32800, st
    assert st["bytes_sent"] == 2 * sum(codec.payload_nbytes(k, 4, 512) for k in (12800, 20000)), st
    assert st["bytes_received"] == (hvd.size() - 1) * st["bytes_sent"], st
    n = hvd.size()
    assert st["allreduce_bytes"] == 2 * sum(int(2 * (n - 1) / n * 4 * k) for k in (12800, 20000)), st
    for before, after in zip(times, times[1:]):  # time in stats: non-negative, growing with every step
        for k in ("encode_s", "decode_s", "wait_s"):
            assert after[k] >= before[k] >= 0.0, (k, before, after)
        assert after["encode_s"] > before["encode_s"] and after["decode_s"] > before["decode_s"], (before, after)
    s = c.summary((1.0,))
    assert s["bytes_saved"] == st["allreduce_bytes"] - st["bytes_received"] > 0, s
    print("graph ops:", " ".join(sorted(t for t in types if t.startswith(("Qsgd", "Horovod")))), flush=True)


def scenario_allreduce():
    rank = hvd.rank()
    c = hvd_qsgd.QSGD(4, seed=SEED)
    t = np.random.default_rng(rank).standard_normal((3, 10000)).astype(np.float32)
    out = hvd.allreduce(tf.constant(t), compression=c, name="eager_t")   # eager: exchange s0
    assert np.array_equal(out.numpy(), reference(gather_np(t), f"hvd_qsgd_{c._creation_index}_s0", 0))
    out = hvd.allreduce(tf.constant(t), compression=c, op=hvd.Sum, name="eager_sum")   # s1, alpha 1
    per = gather_np(t)
    payloads = [codec.encode(g.reshape(-1), 4, 512, "max",
                             protocol.payload_seed(SEED, r, f"hvd_qsgd_{c._creation_index}_s1", 0), "fixed",
                             codec.tensor_fingerprint("", t.shape, "float32"))
                for r, g in enumerate(per)]
    assert np.array_equal(out.numpy(), codec.decode_sum(payloads, 1.0).reshape(t.shape))
    for i, dt in enumerate((tf.float16, tf.bfloat16)):
        x = tf.cast(tf.constant(t), dt)
        o = hvd.allreduce(x, compression=c, name=f"eager_{i}")
        assert o.dtype == dt and o.shape == x.shape
        ref = reference(gather_np(tf.cast(x, tf.float32).numpy()), f"hvd_qsgd_{c._creation_index}_s{2 + i}", 0,
                        dtype=dt.name)
        assert np.array_equal(tf.cast(o, tf.float32).numpy(), tf.cast(tf.cast(ref, dt), tf.float32).numpy()), dt
    outs = hvd.grouped_allreduce([tf.constant(t), tf.constant(t[0, :50])], compression=c)
    assert np.array_equal(outs[0].numpy(), reference(gather_np(t), f"hvd_qsgd_{c._creation_index}_s4", 0))
    assert np.allclose(outs[1].numpy(), np.mean(per, axis=0)[0, :50], rtol=1e-5)


def scenario_keras():
    """tf_keras model.fit with horovod.tensorflow.keras.DistributedOptimizer: one step of SGD(0.5)
    moves every weight by exactly -0.5 * the reference average gradient."""
    import tf_keras as keras
    import horovod.tensorflow.keras as hvdk
    rank = hvd.rank()
    model = keras.Sequential([keras.layers.Dense(200, activation="relu", input_shape=(64,)),
                              keras.layers.Dense(100, activation="relu"), keras.layers.Dense(10)])
    rng = np.random.default_rng(0)
    model.set_weights([rng.standard_normal(w.shape).astype(np.float32) * 0.1 for w in model.get_weights()])
    c = hvd_qsgd.QSGD(4, seed=SEED)
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.5), compression=c)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.copy() for w in model.get_weights()]
    x, y = batch(rank)
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(x, training=True))
    mine = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    after = model.get_weights()
    names = [name for name, _ in c._adapters["tensorflow"].traced_exchanges[-2:]]  # the last trace
    k = 0
    for i, (w0, w1) in enumerate(zip(before, after)):
        per = gather_np(mine[i])
        if w0.size >= 10000:
            g = reference(per, names[k], 0)
            k += 1
            want = (tf.constant(w0) - 0.5 * tf.constant(g)).numpy()
            assert np.array_equal(w1, want), f"weight {i}: max diff {np.abs(w1 - want).max()}"
        else:
            assert np.allclose(w1, w0 - 0.5 * np.mean(per, axis=0), rtol=1e-5, atol=1e-6), i
        check_identical(w1, f"weight {i}")
    assert c.stats["tensors"] == 2, c.stats


def scenario_keras3():
    """Keras 3 (not tf_keras): a tf.function step with DistributedGradientTape over the model's
    tf.Variables (hvd_qsgd.tensorflow.tf_variables): every rank ends bit-identical, and the first
    step's kernel gradient equals the reference."""
    import keras
    import hvd_qsgd.tensorflow as qtf
    assert keras.__version__.startswith("3"), keras.__version__
    rank = hvd.rank()
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(200, activation="relu"), keras.layers.Dense(10)])
    opt = keras.optimizers.SGD(0.5)
    c = hvd_qsgd.QSGD(4, seed=SEED)
    variables = qtf.tf_variables(model.trainable_variables)
    hvd.broadcast_variables(qtf.tf_variables(model.variables), root_rank=0)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
        grads = hvd.DistributedGradientTape(tape, compression=c).gradient(loss, variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads[0]

    x, y = batch(rank)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
    mine = tape.gradient(loss, variables)[0].numpy()
    g = step(x, y).numpy()
    ref = reference(gather_np(mine), c._adapters["tensorflow"].traced_exchanges[-1][0], 0)
    assert np.array_equal(g, ref), f"max diff {np.abs(g - ref).max()}"
    for i in range(2):
        step(*batch(rank, i + 1))
    for v in model.trainable_variables:
        check_identical(v.numpy(), v.name)
    assert c.stats["tensors"] == 3, c.stats


def keras3_model(seed):
    """A Keras 3 MLP (12800-, 20000- and 1000-element kernels) with weights drawn from ``seed``."""
    import keras
    assert keras.__version__.startswith("3"), keras.__version__
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(200, activation="relu"),
                              keras.layers.Dense(100, activation="relu"), keras.layers.Dense(10)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.standard_normal(w.shape).astype(np.float32) * 0.1 for w in model.get_weights()])
    return model


def keras3_loss(model, x, y):
    import keras
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))


def keras3_compression(kind):
    return hvd_qsgd.QSGD(4, seed=SEED) if kind == "qsgd" else hvd.Compression.none


def reduced_reference(mine, c, occurrence=0):
    """[(reference, exact)] for every rank's gradients ``mine``: with QSGD, the compressed ones
    (>= 10,000 elements, in the order of the last trace's exchanges) are the single-process decode
    (exact); the others, and all of them uncompressed, the mean (up to rounding)."""
    compressed = [i for i, g in enumerate(mine) if g.size >= 10000] if isinstance(c, hvd_qsgd.QSGD) else []
    names = ([name for name, _ in c._adapters["tensorflow"].traced_exchanges[-len(compressed):]]
             if compressed else [])
    out = []
    for i, m in enumerate(mine):
        per = gather_np(m)
        if i in compressed:
            out.append((reference(per, names[compressed.index(i)], occurrence), True))
        else:
            out.append((np.mean(per, axis=0), False))
    return out


def check_reduced(got, mine, c, what, occurrence=0):
    """The reduced gradients ``got`` against ``reduced_reference``; all bit-identical across ranks."""
    for i, (g, (ref, exact)) in enumerate(zip(got, reduced_reference(mine, c, occurrence))):
        if exact:
            assert np.array_equal(g, ref), f"{what} {i}: max diff {np.abs(g - ref).max()}"
        else:
            assert np.allclose(g, ref, rtol=1e-5, atol=1e-7), f"{what} {i}"
        check_identical(g, f"{what} {i}")


def scenario_keras3_tape(kind):
    """hvd_qsgd.tensorflow.DistributedGradientTape over a Keras 3 model's own variables (no
    tf_variables, no legacy flag), in a tf.function, two steps: the reduced gradients equal the
    single-process decode of every rank's payloads (QSGD) or the mean (no compression). Eagerly:
    nested sources come back in their structure, and a registered local source keeps its own
    gradient (scaled by 1/n, as Horovod's tape does)."""
    import hvd_qsgd.tensorflow as qtf
    rank, n = hvd.rank(), hvd.size()
    model = keras3_model(0)
    c = keras3_compression(kind)
    variables = model.trainable_variables
    assert not hasattr(variables[0], "ref")  # Keras 3 variables, which Horovod's own tape cannot take

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras3_loss(model, x, y)
        return qtf.DistributedGradientTape(tape, compression=c).gradient(loss, variables)

    for s in range(2):
        x, y = batch(rank, s)
        with tf.GradientTape() as tape:
            loss = keras3_loss(model, x, y)
        mine = [g.numpy() for g in tape.gradient(loss, variables)]
        check_reduced([g.numpy() for g in step(x, y)], mine, c, f"step {s} gradient", occurrence=s)
    if kind == "none":
        x, y = batch(rank, 5)
        with tf.GradientTape() as tape:
            loss = keras3_loss(model, x, y)
        mine = [g.numpy() for g in tape.gradient(loss, variables)]
        with tf.GradientTape() as tape:
            loss = keras3_loss(model, x, y)
        tape = qtf.DistributedGradientTape(tape, compression=c)
        tape.register_local_source(variables[-1])
        got = tape.gradient(loss, {"first": variables[0], "rest": list(variables[1:])})
        assert set(got) == {"first", "rest"} and len(got["rest"]) == len(variables) - 1
        flat = [got["first"].numpy()] + [g.numpy() for g in got["rest"]]
        check_reduced(flat[:-1], mine[:-1], c, "eager gradient")
        assert np.allclose(flat[-1], mine[-1] / n, rtol=1e-6), "the local source's gradient"


def scenario_keras3_fit(kind):
    """Keras 3 model.fit with hvd_qsgd.tensorflow.keras.DistributedOptimizer(SGD(0.5)),
    BroadcastInitialState and MetricAverage: the ranks start from different weights, and after one
    step every weight is rank 0's initial weight minus 0.5 times the reduced gradient computed at
    rank 0's weights (QSGD: the single-process decode, exactly; none: the mean), bit-identical
    across ranks; the loss fit reports is the mean of the ranks' losses."""
    import keras
    import hvd_qsgd.tensorflow.keras as hqk
    rank = hvd.rank()
    model = keras3_model(100 + rank)  # different on every rank: the broadcast makes them alike
    root = [hvd.broadcast(tf.constant(w), root_rank=0, name=f"root_weight_{i}").numpy()
            for i, w in enumerate(model.get_weights())]
    at_root = keras3_model(0)
    at_root.set_weights(root)
    x, y = batch(rank)
    with tf.GradientTape() as tape:
        loss = keras3_loss(at_root, x, y)
    mine = [g.numpy() for g in tape.gradient(loss, at_root.trainable_variables)]
    c = keras3_compression(kind)
    opt = hqk.DistributedOptimizer(keras.optimizers.SGD(0.5), compression=c)
    assert isinstance(opt, keras.optimizers.SGD) and type(opt).__name__ == "SGD"
    try:
        hqk.DistributedOptimizer(opt, compression=c)
        raise AssertionError("a twice-distributed optimizer was accepted")
    except ValueError as e:
        assert "already wrapped" in str(e), e
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
                        callbacks=[hqk.BroadcastInitialState(0), hqk.MetricAverage()])
    after = model.get_weights()
    for i, (w0, w1, (g, exact)) in enumerate(zip(root, after, reduced_reference(mine, c))):
        want = (tf.constant(w0) - 0.5 * tf.constant(g)).numpy()  # SGD: w <- w - 0.5 g, in float32
        if exact:
            assert np.array_equal(w1, want), f"weight {i}: max diff {np.abs(w1 - want).max()}"
        else:
            assert np.allclose(w1, want, rtol=1e-5, atol=1e-6), f"weight {i}"
        check_identical(w1, f"weight {i}")
    losses = gather_np(np.float32(loss.numpy()).reshape(1))
    assert np.isclose(history.history["loss"][0], np.mean(losses), rtol=1e-5), (history.history, losses)
    if kind == "qsgd":
        assert c.stats["tensors"] == 2, c.stats
        # XLA (jit_compile=True) cannot run the collectives: a clear error, not a compiler's
        xla = keras3_model(0)
        xla.compile(optimizer=hqk.DistributedOptimizer(keras.optimizers.SGD(0.5), compression=c),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
        try:
            xla.fit(x, y, batch_size=16, epochs=1, verbose=0)
            raise AssertionError("an XLA-compiled step was accepted")
        except ValueError as e:
            assert "jit_compile=False" in str(e), e


def scenario_keras3_pqasgd():
    """hvd_qsgd.tensorflow.keras.PeriodicQuantizedAveraging(SGD(0.1), period=2, QSGD(2)) in a
    tf.function step, 4 steps, against its re-statement from the model's own state: a local step is
    x - 0.1 g (this rank's gradient); at steps 2 and 4, x^ <- x^ + decode_sum of every rank's
    Q(x - x^) (exactly, for the compressed variables; the mean for the others) and x <- x^ on every
    rank. Then the momentum modes (the state after a sync: local differs across ranks, average is
    alike, reset is zero) and model.fit."""
    import keras
    import hvd_qsgd.tensorflow.keras as hqk
    rank, lr, period = hvd.rank(), np.float32(0.1), 2
    model = keras3_model(0)
    variables = model.trainable_variables
    c = hvd_qsgd.QSGD(2, seed=SEED)
    opt = hqk.PeriodicQuantizedAveraging(keras.optimizers.SGD(0.1), period=period, compression=c)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras3_loss(model, x, y)
        opt.apply(tape.gradient(loss, variables), variables)

    compressed = [i for i, v in enumerate(variables) if np.prod(v.shape) >= 10000]
    for s in range(4):
        x, y = batch(rank, s)
        before = [v.numpy() for v in variables]
        with tf.GradientTape() as tape:
            loss = keras3_loss(model, x, y)
        g = [t.numpy() for t in tape.gradient(loss, variables)]
        anchors = [a.numpy() for a in opt._pqasgd_anchors] if s else before
        step(x, y)
        want = [(tf.constant(b) - tf.constant(gi) * lr).numpy() for b, gi in zip(before, g)]  # SGD: x - g lr
        if (s + 1) % period == 0:
            names = [n for n, _ in c._adapters["tensorflow"].traced_exchanges[-len(compressed):]]
            for i, (w, a) in enumerate(zip(want, anchors)):
                per = gather_np((tf.constant(w) - tf.constant(a)).numpy())
                if i in compressed:
                    avg = reference(per, names[compressed.index(i)], s // period, bits=2, bucket=c.settings.bucket_size)
                else:
                    avg = np.mean(per, axis=0)
                want[i] = (tf.constant(a) + tf.constant(avg)).numpy()
        for i, (v, w) in enumerate(zip(variables, want)):
            if i in compressed or (s + 1) % period:
                assert np.array_equal(v.numpy(), w), f"step {s} variable {i}: max diff {np.abs(v.numpy() - w).max()}"
            else:
                assert np.allclose(v.numpy(), w, rtol=1e-5, atol=1e-7), f"step {s} variable {i}"
            if (s + 1) % period == 0:
                check_identical(v.numpy(), f"step {s} variable {i}")
                assert np.array_equal(v.numpy(), opt._pqasgd_anchors[i].numpy())
    assert c.stats["tensors"] == 2 * len(compressed), c.stats
    for mode in ("local", "average", "reset"):
        m = keras3_model(0)
        o = hqk.PeriodicQuantizedAveraging(keras.optimizers.SGD(0.1, momentum=0.9), period=1,
                                           compression=hvd.Compression.none, momentum=mode)
        x, y = batch(rank, 7)
        with tf.GradientTape() as tape:
            loss = keras3_loss(m, x, y)
        o.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)  # eager, a sync
        buf = o.momentums[0].numpy()
        copies = gather_np(buf)
        if mode == "reset":
            assert not buf.any(), mode
        elif mode == "average":
            assert all(np.array_equal(b, copies[0]) for b in copies), mode
        else:
            assert not np.array_equal(copies[0], copies[1]), mode
    m = keras3_model(0)
    c2 = hvd_qsgd.QSGD(2, seed=SEED)
    m.compile(optimizer=hqk.PeriodicQuantizedAveraging(keras.optimizers.SGD(0.1), period=2, compression=c2),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    x, y = batch(rank)
    m.fit(np.concatenate([x] * 4), np.concatenate([y] * 4), batch_size=16, epochs=1, verbose=0, shuffle=False,
          callbacks=[hqk.BroadcastInitialState(0)])
    for v in m.trainable_variables:
        check_identical(v.numpy(), "fit " + v.path)
    assert c2.stats["tensors"] == 2 * len(compressed), c2.stats


def scenario_error_feedback():
    """With error_feedback, after one step each compressed tensor's residual variable holds
    g - decode(encode(g)) for this rank's own gradient g and payload; the statistics and residuals
    round-trip through state_dict. A new compressor (a resumed run) that loads them before its first
    step starts from them: its first step's residual is (g + e) - decode(encode(g + e)); one of other
    bits refuses them. The checkpoint's occurrence counters seed the resumed step's payloads as the
    next step's would have been. Rank 0's checkpoint loaded on every rank loads its residuals on rank
    0 alone."""
    rank = hvd.rank()
    vs = make_vars()
    c = hvd_qsgd.QSGD(2, seed=SEED, error_feedback=True)
    traces = []

    @tf.function
    def reduced_grads(x, y):
        traces.append(1)
        with tf.GradientTape() as tape:
            loss = loss_fn(vs, x, y)
        return hvd.DistributedGradientTape(tape, compression=c).gradient(loss, vs)

    mine = local_grads(vs, rank)
    reduced_grads(*batch(rank))
    assert len(traces) == 1, f"the step was traced {len(traces)} times (its residuals were made in the trace)"
    adapter = c._adapters["tensorflow"]
    names = [name for name, _ in adapter.traced_exchanges[-2:]]
    residuals = list(adapter.residuals.residuals.values())
    assert len(residuals) == 2, adapter.residuals.residuals.keys()
    for g, name, e in zip([m for m in mine if m.size >= 10000], names, residuals):
        p = codec.encode(g.reshape(-1), 2, 128, "max", protocol.payload_seed(SEED, rank, name, 0), "fixed",
                         codec.tensor_fingerprint("", g.shape, "float32"))
        assert np.array_equal(e.numpy(), g.reshape(-1) - codec.decode(p)), name
    state = adapter.state_dict()
    for e in residuals:
        e.assign(tf.zeros_like(e))
    adapter.load_state_dict(state)
    assert all(np.array_equal(e.numpy(), state["residuals"][k]) for k, e in adapter.residuals.residuals.items())
    assert state["stats"]["tensors"] == 2 and c.stats["tensors"] == 2

    try:
        hvd_qsgd.QSGD(4, seed=SEED, error_feedback=True).load_state_dict({"tensorflow": state})
        raise AssertionError("a checkpoint of 2 bits was loaded by a compressor of 4")
    except ValueError as e:
        assert ("checkpoint was made with different settings (bits=2, bucket_size=128; this compressor's: bits=4, "
                "bucket_size=512)") in str(e), e
    resumed = hvd_qsgd.QSGD(2, seed=SEED, error_feedback=True)
    resumed.load_state_dict({"tensorflow": state})
    loaded = dict(resumed._adapters["tensorflow"].residuals.residuals)
    assert sorted(loaded) == sorted(state["residuals"]), (sorted(loaded), sorted(state["residuals"]))
    assert all(any(v is e for v in resumed.variables) for e in loaded.values())

    @tf.function
    def reduced_grads(x, y):   # (the same function name: the same state keys)
        with tf.GradientTape() as tape:
            loss = loss_fn(vs, x, y)
        return hvd.DistributedGradientTape(tape, compression=resumed).gradient(loss, vs)

    mine = local_grads(vs, rank)
    reduced_grads(*batch(rank))
    names = [name for name, _ in resumed._adapters["tensorflow"].traced_exchanges[-2:]]
    for g, name, (k, e) in zip([m for m in mine if m.size >= 10000], names, loaded.items()):
        assert resumed._adapters["tensorflow"].residuals.residuals[k] is e, k
        x = g.reshape(-1) + state["residuals"][k]
        occurrence = state["counters"]["occurrences"][k]   # the stream the next step would have drawn
        assert occurrence == 1, state["counters"]
        p = codec.encode(x, 2, 128, "max", protocol.payload_seed(SEED, rank, name, occurrence), "fixed",
                         codec.tensor_fingerprint("", g.shape, "float32"))
        assert np.allclose(e.numpy(), x - codec.decode(p), rtol=1e-6, atol=1e-7), name
    # rank 0's checkpoint on every rank: the residuals are rank 0's, the other ranks' start from zero
    # (no residual made from it); the counters load everywhere
    assert (state["rank"], state["size"]) == (rank, hvd.size()), state
    root = hvd.broadcast_object(state, root_rank=0)
    other = hvd_qsgd.QSGD(2, seed=SEED, error_feedback=True)
    other.load_state_dict({"tensorflow": root})
    adapter = other._adapters["tensorflow"]
    assert adapter.exchange_counters()["occurrences"] == root["counters"]["occurrences"], adapter.exchange_counters()
    assert sorted(adapter.residuals.residuals) == (sorted(root["residuals"]) if rank == 0 else []), rank


def scenario_error_feedback_lr():
    """follow_learning_rate(Keras optimizer): a residual made at lr 0.1 is added at lr 0.05 rescaled
    by lr_made / lr_now = 2 (hvd_qsgd.error_feedback), in-graph: after the second step the residual
    is (g1 + 2 e0) - decode(encode(g1 + 2 e0)), with occurrence 1's seed; the learning rate it was
    made at is kept and checkpointed."""
    rank = hvd.rank()
    vs = make_vars()
    opt = tf.keras.optimizers.SGD(learning_rate=0.1)
    c = hvd_qsgd.QSGD(2, seed=SEED, error_feedback=True).follow_learning_rate(opt)

    @tf.function
    def reduced_grads(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(vs, x, y)
        return hvd.DistributedGradientTape(tape, compression=c).gradient(loss, vs)

    big = [i for i, sh in enumerate(SHAPES) if int(np.prod(sh)) >= 10000]
    g0 = [local_grads(vs, rank, 0)[i].reshape(-1) for i in big]
    g1 = [local_grads(vs, rank, 1)[i].reshape(-1) for i in big]
    reduced_grads(*batch(rank, 0))
    opt.learning_rate.assign(0.05)
    reduced_grads(*batch(rank, 1))
    adapter = c._adapters["tensorflow"]
    names = [name for name, _ in adapter.traced_exchanges[-2:]]
    residuals = list(adapter.residuals.residuals.values())
    for a, b, shape, name, e in zip(g0, g1, [SHAPES[i] for i in big], names, residuals):
        fp = codec.tensor_fingerprint("", shape, "float32")
        p0 = codec.encode(a, 2, 128, "max", protocol.payload_seed(SEED, rank, name, 0), "fixed", fp)
        e0 = a - codec.decode(p0)
        x = b + e0 * np.float32(2.0)
        p1 = codec.encode(x, 2, 128, "max", protocol.payload_seed(SEED, rank, name, 1), "fixed", fp)
        assert np.allclose(e.numpy(), x - codec.decode(p1), rtol=1e-6, atol=1e-7), name
        assert not np.allclose(e.numpy(), (b + e0) - codec.decode(codec.encode(
            b + e0, 2, 128, "max", protocol.payload_seed(SEED, rank, name, 1), "fixed", fp)), atol=1e-4), name
    state = adapter.state_dict()
    assert sorted(state["residual_lr"].values()) == [np.float32(0.05)] * 2, state["residual_lr"]


def scenario_v1():
    """tf.compat.v1 graph mode: hvd.DistributedOptimizer on a v1 optimizer, in a Session."""
    tf.compat.v1.disable_eager_execution()
    rank = hvd.rank()
    rng = np.random.default_rng(0)
    w = tf.compat.v1.Variable(rng.standard_normal((64, 200)).astype(np.float32) * 0.1)
    x, y = batch(rank)
    loss = tf.reduce_sum(tf.matmul(x, w) ** 2) / 100.0
    c = hvd_qsgd.QSGD(4, seed=SEED)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5), compression=c)
    train = opt.minimize(loss)
    local = tf.gradients(loss, [w])[0]
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        w0, g = sess.run([w, local])
        sess.run(train)
        w1 = sess.run(w)
        per = sess.run(hvd.allgather(tf.constant(g[None])))
        stats = sess.run(c.stats)
    ref = reference(list(per), c._adapters["tensorflow"].traced_exchanges[-1][0], 0)
    want = w0 - np.float32(0.5) * ref
    assert np.array_equal(w1, want), f"max diff {np.abs(w1 - want).max()}"
    assert stats["tensors"] == 1, stats


# -- scatter_allgather (and auto) ---------------------------------------------------------------

def rank_input(r, shape, step=0, tensor=0, zeros=0.0):
    """Rank r's input, the same in every worker: a normal sample scaled by 1 + r, with a fraction
    ``zeros`` of its entries zeroed (sparser tensors give shorter Elias payloads)."""
    rng = np.random.default_rng([SEED, r, step, tensor])
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(1 + r)
    if zeros:
        x[rng.random(shape) < zeros] = 0
    return x


class Expected:
    """The reference of one exchange, computed in this worker from every rank's input."""

    def __init__(self, c, per, name, occurrence, alpha, dtype="float32", settings=None):
        s = settings or c.settings
        n, me = len(per), hvd.rank()
        shape, numel = per[0].shape, per[0].size
        fp = codec.tensor_fingerprint("", shape, dtype)
        seeds = [protocol.payload_seed(SEED, r, name, occurrence) for r in range(n)]
        xs = [np.asarray(x, np.float32).reshape(-1) for x in per]
        self.reduction = (cost_model.choose(n, numel, s.bits, s.bucket_size) if s.reduction == "auto"
                          else s.reduction)
        if self.reduction == "scatter_allgather":
            out, sent, reduced = reduction.simulate(xs, s, seeds, alpha, fp, dtype)
            self.sent_chunks = sent[me]
            self.own = [np.concatenate([codec.decode(p) for p in sent[r]]) for r in range(n)]
            chunks = reduction.chunk_ranges(numel, s.bucket_size, n)
            self.lengths = {"phase 1": [sum(len(p) for p in sent[r]) for r in range(n)],   # (empty chunks: header only)
                            "reduced": [len(q) for q, (b, e) in zip(reduced, chunks) if e > b]}
            self.bytes_sent = sum(len(sent[me][j]) for j in range(n) if j != me) + len(reduced[me])
            self.bytes_received = (sum(len(sent[r][me]) for r in range(n) if r != me)
                                   + sum(len(reduced[j]) for j in range(n) if j != me))
        else:
            ps = [codec.encode(x, s.bits, s.bucket_size, s.norm, seeds[r], s.coding, fp, s.checksum, source_dtype=dtype)
                  for r, x in enumerate(xs)]
            out = codec.decode_sum(ps, alpha)
            self.own = [codec.decode(p) for p in ps]
            self.lengths = {"payload": [len(p) for p in ps]}
            self.bytes_sent = len(ps[me])
            self.bytes_received = sum(len(p) for p in ps) - len(ps[me])
        self.out = out.reshape(shape)


def check_exact(got, want, what):
    assert np.array_equal(got, want), f"{what}: max diff {np.abs(np.float32(got) - np.float32(want)).max()}"
    check_identical(got, what)


def tape_step(c, shapes):
    """A tf.function step: DistributedGradientTape (Average) over loss = sum_i sum(v_i * t_i), whose
    gradient with respect to v_i is exactly the target t_i; returns the reduced gradients."""
    vs = [tf.Variable(tf.zeros(sh)) for sh in shapes]

    @tf.function
    def reduced_grads(targets):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * t) for v, t in zip(vs, targets)])
        return hvd.DistributedGradientTape(tape, compression=c).gradient(loss, vs)

    return reduced_grads


def run_tape_steps(c, shapes, steps, zeros=lambda r, i: 0.0):
    """``tape_step`` with rank r's targets t_i = rank_input(r, ...); each compressed gradient must
    equal the reference of its exchange bit for bit on every rank. Returns the references."""
    n, rank = hvd.size(), hvd.rank()
    reduced_grads = tape_step(c, shapes)
    adapter, expected = None, []
    compressed = [i for i, sh in enumerate(shapes) if int(np.prod(sh)) >= c.settings.min_numel]
    for k in range(steps):
        per = [[rank_input(r, sh, k, i, zeros(r, i)) for i, sh in enumerate(shapes)] for r in range(n)]
        grads = [g.numpy() for g in reduced_grads([tf.constant(t) for t in per[rank]])]
        adapter = c._adapters["tensorflow"]
        names = [name for name, _ in adapter.traced_exchanges[-len(compressed):]]  # the (only) trace
        for i, g in enumerate(grads):
            if i in compressed:
                e = Expected(c, [per[r][i] for r in range(n)], names[compressed.index(i)], k, 1.0 / n)
                check_exact(g, e.out, f"tensor {i} {shapes[i]} step {k} ({e.reduction})")
                expected.append(e)
            else:
                assert np.allclose(g, np.mean([per[r][i] for r in range(n)], axis=0), rtol=1e-5, atol=1e-6), i
    graph = reduced_grads.get_concrete_function([tf.TensorSpec(sh, tf.float32) for sh in shapes]).graph
    gd = graph.as_graph_def()
    assert not foldable_collectives(gd), foldable_collectives(gd)  # every collective runs at every step
    types = {nd.op for nd in gd.node} | {nd.op for f in gd.library.function for nd in f.node_def}
    return expected, types


def check_stats(c, expected):
    st = c.stats
    assert st["tensors"] == len(expected), st
    assert st["bytes_sent"] == sum(e.bytes_sent for e in expected), (st, [e.bytes_sent for e in expected])
    assert st["bytes_received"] == sum(e.bytes_received for e in expected), st


def scenario_scatter_tape():
    """scatter_allgather in a tf.function step, two steps: uneven chunks (20000 = 39 buckets of 512
    and one of 32), a tensor of fewer than n buckets (1000 elements: some chunks are empty), one
    uncompressed tensor; then error feedback."""
    n = hvd.size()
    shapes = [(20000,), (40, 25), (10,), (100, 123)]
    assert [e - b for b, e in reduction.chunk_ranges(1000, 512, n)].count(0) >= 1
    assert len({e - b for b, e in reduction.chunk_ranges(20000, 512, n)}) > 1
    c = hvd_qsgd.QSGD(4, seed=SEED, min_numel=500, reduction="scatter_allgather")
    expected, types = run_tape_steps(c, shapes, 2)
    assert all(e.reduction == "scatter_allgather" for e in expected)
    for op in ("QsgdEncodeChunks", "QsgdCheckControl", "QsgdReduceChunk", "QsgdDecodeChunks", "HorovodAlltoall",
               "HorovodAllgather", "HorovodAllreduce"):
        assert op in types, (op, sorted(types))
    assert "QsgdEncode" not in types and "QsgdDecodeSum" not in types, sorted(types)
    check_stats(c, expected)

    # error feedback: the residual is this rank's input minus the decode of its own phase-1 chunks
    c = hvd_qsgd.QSGD(2, seed=SEED, min_numel=500, reduction="scatter_allgather", error_feedback=True)
    expected, _ = run_tape_steps(c, [(20000,), (40, 25)], 1)
    residuals = list(c._adapters["tensorflow"].residuals.residuals.values())
    assert len(residuals) == 2
    for i, (sh, e, res) in enumerate(zip([(20000,), (40, 25)], expected, residuals)):
        own = np.concatenate([codec.decode(p) for p in e.sent_chunks])
        assert np.array_equal(res.numpy(), rank_input(hvd.rank(), sh, 0, i).reshape(-1) - own), sh


def scenario_scatter_eager():
    """Eager hvd.allreduce with scatter_allgather: Average, Sum (alpha 1) and an fp16 tensor."""
    n, rank = hvd.size(), hvd.rank()
    c = hvd_qsgd.QSGD(4, seed=SEED, reduction="scatter_allgather")
    k = c._creation_index
    per = [rank_input(r, (3, 10001), tensor=7) for r in range(n)]
    expected = []
    out = hvd.allreduce(tf.constant(per[rank]), compression=c, name="sa_avg")   # exchange s0
    expected.append(Expected(c, per, f"hvd_qsgd_{k}_s0", 0, 1.0 / n))
    check_exact(out.numpy(), expected[-1].out, "average")
    out = hvd.allreduce(tf.constant(per[rank]), compression=c, op=hvd.Sum, name="sa_sum")   # s1
    expected.append(Expected(c, per, f"hvd_qsgd_{k}_s1", 0, 1.0))
    check_exact(out.numpy(), expected[-1].out, "sum")
    half = [x.astype(np.float16) for x in per]
    out = hvd.allreduce(tf.constant(half[rank]), compression=c, name="sa_fp16")   # s2
    assert out.dtype == tf.float16 and out.shape == half[rank].shape
    expected.append(Expected(c, [h.astype(np.float32) for h in half], f"hvd_qsgd_{k}_s2", 0, 1.0 / n, "float16"))
    check_exact(out.numpy(), expected[-1].out.astype(np.float16), "fp16")
    assert all(e.reduction == "scatter_allgather" for e in expected)
    check_stats(c, expected)


DQSGD_SCALES = [1.0, 8.0, 0.5, 4.0, 1.0, 0.1]   # gradient size per step: DQSGD's bits vary


def scenario_dqsgd():
    """hvd_qsgd.DynamicQSGD(3.0) in a tf.function tape step, against the NumPy re-statement step by
    step: step k's bits b_k come from the rule (tests.references.dqsgd_bits) applied to the norms of
    the tensor's previous reduced gradients, and the reduced gradient equals the single-process
    reference with b_k bits (bucket 128 for 2 bits, else 512) exactly, on every rank. First with the
    default reduction (6 steps; the bits must vary), then scatter_allgather with error feedback (the
    input of step k is rank r's gradient plus its residual, the residual that input minus the
    decode of r's own phase-1 chunks). Also: model.fit with a Keras 3 DistributedOptimizer runs it."""
    import keras
    import hvd_qsgd.tensorflow.keras as hqk
    from hvd_qsgd.settings import default_bucket_size
    from tests.references import dqsgd_bits
    n, rank = hvd.size(), hvd.rank()
    for kwargs, steps, shapes in (({}, 6, [(20000,), (40, 25), (10,)]),
                                  ({"reduction": "scatter_allgather", "error_feedback": True}, 3, [(20000,)])):
        c = hvd_qsgd.DynamicQSGD(3.0, seed=SEED, min_numel=500, **kwargs)
        reduced_grads = tape_step(c, shapes)
        compressed = [i for i, sh in enumerate(shapes) if int(np.prod(sh)) >= 500]
        norms = {i: [] for i in compressed}
        residual = {i: [np.zeros(int(np.prod(shapes[i])), np.float32) for _ in range(n)] for i in compressed}
        for k in range(steps):
            per = [[rank_input(r, sh, k, i) * np.float32(DQSGD_SCALES[k]) for i, sh in enumerate(shapes)]
                   for r in range(n)]
            grads = [g.numpy() for g in reduced_grads([tf.constant(t) for t in per[rank]])]
            adapter = c._adapters["tensorflow"]
            names = [name for name, _ in adapter.traced_exchanges[-len(compressed):]]
            for i, g in enumerate(grads):
                if i not in compressed:
                    assert np.allclose(g, np.mean([per[r][i] for r in range(n)], axis=0), rtol=1e-5, atol=1e-6), i
                    continue
                b = dqsgd_bits(3.0, norms[i])[k]
                xs = [per[r][i] + residual[i][r].reshape(shapes[i]) for r in range(n)]
                e = Expected(c, xs, names[compressed.index(i)], k, 1.0 / n,
                             settings=c.settings.replace(bits=b, bucket_size=default_bucket_size(b)))
                check_exact(g, e.out, f"dqsgd {kwargs}, tensor {i} step {k} ({b} bits, {e.reduction})")
                norms[i].append(float(np.sqrt(np.sum(e.out.astype(np.float64) ** 2))))
                if kwargs.get("error_feedback"):
                    residual[i] = [xs[r].reshape(-1) - e.own[r] for r in range(n)]
        for i in compressed:
            bits = dqsgd_bits(3.0, norms[i])[:steps]
            if steps == 6:
                assert len(set(bits)) > 1, bits
            state = list(adapter.schedules().values())[compressed.index(i)]   # in trace order
            assert state["steps"] == steps and state["carry"] == sum(3.0 - b for b in bits), (state, bits)
        if kwargs.get("error_feedback"):
            mine = list(adapter.residuals.residuals.values())[0].numpy()
            assert np.array_equal(mine, residual[0][rank]), "dqsgd: this rank's residual"
        assert len(adapter.variables) > len(adapter.schedules()) > 0   # the schedules are checkpointed

    # model.fit: the bits chosen in the graph, the same on every rank, two steps
    model = keras3_model(0)
    c = hvd_qsgd.DynamicQSGD(3.0, seed=SEED)
    model.compile(optimizer=hqk.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=c),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = batch(rank)
    model.fit(np.concatenate([x, x]), np.concatenate([y, y]), batch_size=16, epochs=1, verbose=0, shuffle=False)
    states = c._adapters["tensorflow"].schedules()
    assert len(states) == 2 and all(st["steps"] == 2 for st in states.values()), states
    for i, w in enumerate(model.get_weights()):
        check_identical(w, f"dqsgd fit: weight {i}")


def scenario_keras3_efsgdm():
    """hvd_qsgd.tensorflow.keras.EFSGDM(0.1, momentum 0.9, BlockSign(256)) on a Keras 3 model in a
    tf.function step, 3 steps, against Algorithm 1 of dist-EF-SGDM in float64 from every rank's
    gradient at the (common) weights (the re-statement the PyTorch optimizer is tested against):
        m_r = mu m_r + g_r;  p_r = lr (mu m_r + g_r) + e_r;  D_r = C(p_r);  e_r = p_r - D_r
        server (scatter_allgather, two-way): D~ = (1/n) sum_r D_r + e~;  D = C(D~);  e~ = D~ - D
        one-way (allgather):                 D = (1/n) sum_r D_r
        w <- w - D;  uncompressed (under 10,000 elements): w <- w - (1/n) sum_r lr (mu m_r + g_r).
    Then model.fit with it: bit-identical weights on every rank."""
    import keras
    import hvd_qsgd.tensorflow.keras as hqk
    from tests.references import block_sign
    n, rank = hvd.size(), hvd.rank()
    block, mu, lr = 256, 0.9, 0.1
    for red in ("scatter_allgather", "allgather"):
        model = keras3_model(0)
        variables = model.trainable_variables
        c = hvd_qsgd.BlockSign(block_size=block, reduction=red)
        opt = hqk.EFSGDM(lr, momentum=mu, compression=c)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = keras3_loss(model, x, y)
            opt.apply(tape.gradient(loss, variables), variables)

        w = [v.numpy().astype(np.float64) for v in variables]
        m = [[np.zeros_like(x) for x in w] for _ in range(n)]
        e = [[np.zeros(x.size) for x in w] for _ in range(n)]
        server = [np.zeros(x.size) for x in w]
        for t in range(3):
            x, y = batch(rank, t)
            with tf.GradientTape() as tape:
                loss = keras3_loss(model, x, y)
            per = [gather_np(g.numpy()) for g in tape.gradient(loss, variables)]
            step(x, y)
            for i, v in enumerate(variables):
                compressed = w[i].size >= 10000
                sent = []
                for r in range(n):
                    g = per[i][r].astype(np.float64)
                    m[r][i] = mu * m[r][i] + g
                    p = lr * (mu * m[r][i] + g)
                    if compressed:
                        p = p.reshape(-1) + e[r][i]
                        q = block_sign(p, block)
                        e[r][i] = p - q
                        p = q.reshape(w[i].shape)
                    sent.append(p)
                delta = np.mean(sent, axis=0)
                if compressed and red == "scatter_allgather":
                    avg = delta.reshape(-1) + server[i]
                    q = block_sign(avg, block)
                    server[i] = avg - q
                    delta = q.reshape(w[i].shape)
                w[i] = w[i] - delta
                got = v.numpy()
                scale = float(np.abs(delta).max())
                assert np.allclose(got, w[i], rtol=1e-5, atol=1e-5 * scale), \
                    f"efsgdm ({red}) step {t} variable {i}: max diff {np.abs(got - w[i]).max()} (scale {scale})"
                check_identical(got, f"efsgdm ({red}) step {t} variable {i}")
        adapter = c._adapters["tensorflow"]
        assert len(adapter.residuals.residuals) == 2, adapter.residuals.residuals.keys()
        assert len(adapter.residuals.server) == (2 if red == "scatter_allgather" else 0), adapter.residuals.server
        assert c.stats["tensors"] == 6, c.stats

    # model.fit, ranks started from different weights: BroadcastInitialState, then identical steps
    model = keras3_model(100 + rank)
    model.compile(optimizer=hqk.EFSGDM(lr, momentum=mu, compression=hvd_qsgd.BlockSign(block_size=block)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    x, y = batch(rank)
    model.fit(np.concatenate([x, x]), np.concatenate([y, y]), batch_size=16, epochs=1, verbose=0, shuffle=False,
              callbacks=[hqk.BroadcastInitialState(0)])
    for i, wt in enumerate(model.get_weights()):
        check_identical(wt, f"efsgdm fit: weight {i}")


def scenario_elias():
    """Elias coding under both reductions in a tf.function step: ranks' inputs are sparse to
    different degrees, so their payloads differ in length; the results are still exact."""
    n = hvd.size()
    for red in ("allgather", "scatter_allgather"):
        c = hvd_qsgd.QSGD(4, seed=SEED, coding="elias", min_numel=500, reduction=red)
        expected, types = run_tape_steps(c, [(30000,), (1000,)], 2, zeros=lambda r, i: r / n)
        for e in expected:
            assert e.reduction == red
            for what, lens in e.lengths.items():
                assert len(set(lens)) == len(lens) > 1, (red, what, lens)
        check_stats(c, expected)
        assert ("HorovodAlltoall" in types) == (red == "scatter_allgather"), sorted(types)


def scenario_auto():
    """reduction="auto": each tensor takes the reduction cost_model.choose predicts."""
    n = hvd.size()
    shapes = [(400000,), (20000,)]
    want = [cost_model.choose(n, int(np.prod(sh)), 4, 512) for sh in shapes]
    assert want == ["scatter_allgather", "allgather"], want   # at n = 3 and 4 with the default link model
    c = hvd_qsgd.QSGD(4, seed=SEED, reduction="auto")
    expected, types = run_tape_steps(c, shapes, 1)
    assert [e.reduction for e in expected] == want
    for op in ("QsgdEncodeChunks", "QsgdEncode", "HorovodAlltoall", "QsgdDecodeSum", "QsgdDecodeChunks"):
        assert op in types, (op, sorted(types))
    check_stats(c, expected)


def mismatch(kind):
    rank = hvd.rank()
    t = tf.constant(np.ones(20000, np.float32))
    if kind == "bits":
        c = hvd_qsgd.QSGD(8 if rank == 1 else 4)
    elif kind == "order":
        c = hvd_qsgd.QSGD(4)
        a = tf.constant(np.ones(20000, np.float32))
        b = tf.constant(np.ones(30000, np.float32))

        @tf.function
        def step():
            # rank 1 traces its two tensors in the other order
            first, second = (a, b) if rank == 0 else (b, a)
            return hvd.grouped_allreduce([first, second], compression=c)
        return step()
    elif kind == "reduction":
        c = hvd_qsgd.QSGD(4, reduction="allgather" if rank == 0 else "scatter_allgather")
    elif kind == "no-compression":
        # rank 1 allreduces the float32 tensor, rank 0 the compressor's float64 control vector
        c = hvd_qsgd.QSGD(4) if rank == 0 else hvd.Compression.none
    elif kind == "fingerprint":
        # the same number of elements in another shape: the control check passes, every rank's
        # reduce finds the payloads' fingerprints disagree and sends an empty reduced chunk
        c = hvd_qsgd.QSGD(4, reduction="scatter_allgather")
        t = tf.constant(np.ones((20000,) if rank == 0 else (200, 100), np.float32))
    elif kind == "creation-order":
        # rank 0 makes one compressor more first: Horovod names its graph allreduce of the control
        # vector after that tensor's name, which held the compressor's number (every rank waited
        # forever); rank 1 makes one after, so that later scenarios' numbers agree again
        extra = hvd_qsgd.QSGD(8) if rank == 0 else None
        c = hvd_qsgd.QSGD(4)
        try:
            @tf.function
            def traced():   # (no name=: Horovod names it after the tensor, as the tape does)
                return hvd.allreduce(t, compression=c)
            return traced()
        finally:
            extra = extra or hvd_qsgd.QSGD(8)
    elif kind == "join-off":
        return join_off(rank)
    else:
        raise SystemExit(f"unknown mismatch {kind}")

    @tf.function
    def step():
        return hvd.allreduce(t, compression=c, name="t")
    return step()


def join_off(rank):
    """join=False gives hvd.join() up: a tf.function step that both ranks take gives their mean (a
    constant bucket quantizes exactly), with no conditional around the chain; then rank 1 joins while
    rank 0 steps again, and rank 0's step fails saying why (the joined rank is stopped by Horovod
    when rank 0's process ends)."""
    c = hvd_qsgd.QSGD(4, seed=SEED, join=False)

    @tf.function
    def step(x):
        return hvd.allreduce(x, compression=c, name="join_off")
    got = step(tf.constant(np.full(20000, rank + 1.0, np.float32))).numpy()
    assert np.array_equal(got, np.full(20000, (hvd.size() + 1) / 2, np.float32)), got[:4]
    assert int(c.stats["tensors"]) == 1 and int(c.stats["joined_exchanges"]) == 0, c.stats
    if rank == 0:
        step(tf.constant(np.full(20000, 1.0, np.float32)))
    hvd.join()


def scenario_join():
    """Rank 1 has no data and joins at once; rank 0's eager compressed exchanges, allgather and
    scatter_allgather, are carried through the join as Horovod's own allreduce would be: the
    stepping rank's payload dequantized (exact for a constant bucket), reduced by Horovod's allreduce
    with the joined rank adding zeros, Average still dividing by the set's size. Then rank 0 joins
    too and both return from hvd.join() as without compression."""
    n = hvd.size()
    compressors = [hvd_qsgd.QSGD(4, seed=SEED, reduction=r) for r in ("allgather", "scatter_allgather")]
    if hvd.rank() == 0:
        x = tf.constant(np.full(20000, 3.0, np.float32))
        for c in compressors:
            got = hvd.allreduce(x, compression=c, name=f"join_{c.settings.reduction}").numpy()
            assert np.array_equal(got, np.full(20000, 3.0 / n, np.float32)), (c, got[:4])
            st = c.stats
            assert st["joined_exchanges"] == 1 and st["raw_tensors"] == 1 and st["tensors"] == 0, st
            assert st["allreduce_bytes"] == 0, st   # (nothing compressed: no bytes saved to count)
    assert hvd.join() == 0


def scenario_join_traced():
    """In a tf.function, after steps that every rank took: rank 1 runs out of data after two steps
    and joins; rank 0's third step is carried through the join: allgather (Average and Sum),
    scatter_allgather and error feedback give Horovod's joined allreduce of rank 0's dequantized
    payloads (exact for a constant bucket; the residual stays zero), each counted as a joined
    exchange; then rank 0 joins too. The control vector is reduced at every step: were it a constant,
    its allreduce would be evaluated once, when the function is optimized, the joined rank would count
    as present, and the payload allgather would reach Horovod with a joined rank (whose background
    loop dies of it)."""
    plain, scatter = hvd_qsgd.QSGD(4, seed=SEED), hvd_qsgd.QSGD(4, seed=SEED, reduction="scatter_allgather")
    fed_back = hvd_qsgd.QSGD(4, seed=SEED, error_feedback=True)

    @tf.function
    def step(x):
        return (hvd.allreduce(x, compression=plain, name="join_traced_t"),
                hvd.allreduce(x, compression=plain, op=hvd.Sum, name="join_traced_sum"),
                hvd.allreduce(x, compression=scatter, name="join_traced_scatter"),
                hvd.allreduce(x, compression=fed_back, name="join_traced_ef"))

    n, rank = hvd.size(), hvd.rank()
    for k in range(3 if rank == 0 else 2):
        x = tf.constant(np.full(20000, rank + 1 + 10 * k, np.float32))
        # a constant bucket quantizes exactly: the ranks' mean (sum) while all step; after rank 1 has
        # joined, rank 0's value over n (Average, as Horovod's joined allreduce divides) or itself (Sum)
        mean, total = ((n + 1) / 2 + 10 * k, n * (n + 1) / 2 + 10 * k * n) if k < 2 else ((1 + 10 * k) / n, 1 + 10 * k)
        got = [t.numpy() for t in step(x)]
        for name, value, want in zip(("average", "sum", "scatter", "error feedback"), got, (mean, total, mean, mean)):
            assert np.array_equal(value, np.full(20000, want, np.float32)), (k, name, value[:4], want)
    joined = 1 if rank == 0 else 0
    assert int(plain.stats["joined_exchanges"]) == 2 * joined, plain.stats
    for c in (scatter, fed_back):
        st = c.stats
        assert int(st["joined_exchanges"]) == joined and int(st["tensors"]) == 2 and int(st["raw_tensors"]) == joined, st
        # the compressed exchanges' fp32 allreduce, not the joined one's (it overstated bytes_saved)
        assert int(st["allreduce_bytes"]) == 2 * int(2 * (n - 1) / n * 4 * 20000), st
    residuals = fed_back._adapters["tensorflow"].residuals.residuals
    assert len(residuals) == 1 and all(not np.any(v.numpy()) for v in residuals.values()), residuals
    assert hvd.join() == 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", nargs="+")
    args = p.parse_args()
    hvd.init()
    for s in args.scenario:
        if s.startswith("mismatch-"):
            try:
                mismatch(s[len("mismatch-"):])
            except Exception as e:
                text = " ".join(str(e).split())
                for start in ("hvd_qsgd:", "Mismatched", "Horovod has been shut down"):  # skip TF's preamble
                    if start in text:
                        text = text[text.find(start):]
                        break
                print(f"RAISED {type(e).__name__}: {text[:400]} (scenario {s})", flush=True)
                continue
            print("NOT RAISED", flush=True)
            sys.exit(1)
        else:
            {"tape": scenario_tape, "allreduce": scenario_allreduce, "keras": scenario_keras,
             "keras3": scenario_keras3, "v1": scenario_v1,
             "keras3-tape": lambda: scenario_keras3_tape("qsgd"),
             "keras3-tape-none": lambda: scenario_keras3_tape("none"),
             "keras3-fit": lambda: scenario_keras3_fit("qsgd"),
             "keras3-fit-none": lambda: scenario_keras3_fit("none"),
             "keras3-pqasgd": scenario_keras3_pqasgd, "dqsgd": scenario_dqsgd,
             "keras3-efsgdm": scenario_keras3_efsgdm, "error-feedback": scenario_error_feedback,
             "error-feedback-lr": scenario_error_feedback_lr,
             "scatter-tape": scenario_scatter_tape, "scatter-eager": scenario_scatter_eager,
             "elias": scenario_elias, "auto": scenario_auto, "join": scenario_join,
             "join-traced": scenario_join_traced}[s]()
        print(f"OK {s}", flush=True)


if __name__ == "__main__":
    main()
