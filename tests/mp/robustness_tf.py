"""Worker for tests/test_robustness_mp.py: bad inputs through Horovod's TensorFlow API, under horovodrun.

Every rank runs every case in order and prints ``OK <case>`` when its checks pass (an exception ends
the job). Compressed exchanges run in ``tf.function``s (``hvd.allreduce`` and
``DistributedGradientTape``); each result is compared bit for bit (NaN equal to NaN) with a
reference computed on every rank from every rank's input and the documented seeds
(``protocol.payload_seed(seed, rank, "hvd_qsgd_<k>_s<seq>", occurrence)``): ``codec.decode_sum``
for allgather, ``reduction.simulate`` for scatter_allgather. The documented non-finite rule is
checked by ``check_nonfinite`` (tests/references.py).
"""
import argparse
import itertools

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import hvd_qsgd
from hvd_qsgd import codec, protocol, reduction
from tests.mp.log_capture import logged
from tests.mp.nonfinite import bad_input
from tests.references import check_nonfinite, cleaned

SEED = 17
REDUCTIONS = ("allgather", "scatter_allgather")


def f32(a):
    return np.asarray(a).astype(np.float32)


def gather(a):
    """Every rank's copy of a (as float32, which holds float16/bfloat16 exactly), in rank order."""
    return list(hvd.allgather(tf.constant(f32(a)[None])).numpy())


def same(a, b):
    return np.asarray(a).dtype == np.asarray(b).dtype and np.shape(a) == np.shape(b) and \
        np.array_equal(f32(a), f32(b), equal_nan=True)


def check_identical(a, what):
    copies = gather(a)
    for r, c in enumerate(copies):
        assert np.array_equal(c, copies[0], equal_nan=True), f"{what}: rank {r} differs from rank 0"


def reference(c, xs, exchange, occurrence, shape, dtype, alpha):
    """The result every rank must get for these per-rank inputs, in ``dtype`` (a NumPy dtype)."""
    s = c.settings
    name = np.dtype(dtype).name
    fp = codec.tensor_fingerprint("", list(shape), name)
    seeds = [protocol.payload_seed(SEED, r, exchange, occurrence) for r in range(len(xs))]
    xs = [f32(x).reshape(-1) for x in xs]
    if s.reduction == "scatter_allgather":
        out = reduction.simulate(xs, s, seeds, alpha, fp, name)[0]
    else:
        out = codec.decode_sum([codec.encode(x, s.bits, s.bucket_size, s.norm, seeds[r], s.coding, fp, s.checksum,
                                             source_dtype=name) for r, x in enumerate(xs)], alpha)
    return out.reshape(shape).astype(dtype)


def check_exchange(c, xs, out, exchange, alpha, what, occurrence=0):
    out = np.asarray(out)
    want = reference(c, xs, exchange, occurrence, out.shape, out.dtype, alpha)
    assert same(out, want), f"{what}: differs from the reference"
    xs32 = [f32(x).reshape(-1) for x in xs]
    if not all(np.isfinite(x).all() for x in xs32):
        clean = reference(c, [cleaned(x) for x in xs32], exchange, occurrence, out.shape, out.dtype, alpha)
        check_nonfinite(f32(out).reshape(-1), xs32, c.settings.bucket_size, c.settings.bits, f32(clean).reshape(-1))
    check_identical(out, what)


def last_exchange(c):
    return c._adapters["tensorflow"].traced_exchanges[-1][0]


def allreduce_fn(c, x, op=None, name="rb"):
    """hvd.allreduce(x, compression=c) in a new tf.function; (result, exchange name)."""
    kwargs = {} if op is None else {"op": op}

    @tf.function
    def step(t):
        return hvd.allreduce(t, compression=c, name=name, **kwargs)
    out = step(tf.constant(x)).numpy()
    return out, last_exchange(c)


def case_nonfinite_allreduce(n, rank):
    for red, bits in itertools.product(REDUCTIONS, (4, 1)):
        for dtype, op, alpha in ((np.float32, hvd.Average, 1.0 / n), (np.float16, hvd.Average, 1.0 / n),
                                 (np.float32, hvd.Sum, 1.0)):
            c = hvd_qsgd.QSGD(bits, seed=SEED, reduction=red)
            bucket = c.settings.bucket_size
            xs = [bad_input(r, 100 * bucket, bucket, dtype) for r in range(n)]
            out, exchange = allreduce_fn(c, xs[rank], op)
            assert out.dtype == dtype
            check_exchange(c, xs, out, exchange, alpha, f"{red} bits={bits} {np.dtype(dtype).name} {op}")
            assert not np.isfinite(out[:bucket]).any() and np.isfinite(out[bucket:3 * bucket]).all()


def tape_fn(c, variables, sparse_as_dense=False):
    """A tf.function: DistributedGradientTape gradients of sum_i sum(v_i * t_i) (= every rank's t_i)."""
    @tf.function
    def step(targets):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * t) for v, t in zip(variables, targets)])
        return hvd.DistributedGradientTape(tape, compression=c, sparse_as_dense=sparse_as_dense).gradient(
            loss, variables)
    return step


def case_nonfinite_tape(n, rank):
    for red in REDUCTIONS:
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red)
        v = tf.Variable(tf.zeros([40, 512]))
        xs = [bad_input(r, 40 * 512, 512).reshape(40, 512) for r in range(n)]
        g = tape_fn(c, [v])([tf.constant(xs[rank])])[0].numpy()
        check_exchange(c, xs, g, last_exchange(c), 1.0 / n, f"tape {red}")


def case_nonfinite_error_feedback(n, rank):
    """Step 1 holds NaN/Inf: its output has them; the residual stays finite (0 where this rank's
    bucket was non-finite). Step 2 is finite: its output is finite and equals the reference of every
    rank's g2 + residual (occurrence 1 of the same traced exchange)."""
    for red in REDUCTIONS:
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red, error_feedback=True)
        s = c.settings
        v = tf.Variable(tf.zeros([30 * 512]))
        step = tape_fn(c, [v])
        xs = [bad_input(r, 30 * 512, 512) for r in range(n)]
        out = step([tf.constant(xs[rank])])[0].numpy()
        exchange = last_exchange(c)
        check_exchange(c, xs, out, exchange, 1.0 / n, f"error feedback step 1 {red}")
        (e1,) = [r.numpy() for r in c._adapters["tensorflow"].residuals.residuals.values()]
        seed, fp = protocol.payload_seed(SEED, rank, exchange, 0), codec.tensor_fingerprint("", [30 * 512], "float32")
        if red == "scatter_allgather":
            buf, lens = reduction.encode_chunks(xs[rank], s, seed, n, fp)
            own = reduction.decode_chunks(reduction.split_by(buf, lens), 1.0, xs[rank].size, s.bucket_size)
        else:
            own = codec.decode(codec.encode(xs[rank], s.bits, s.bucket_size, s.norm, seed, s.coding, fp))
        new = xs[rank] - own
        assert not np.isfinite(new).all() and np.array_equal(e1, np.where(np.isfinite(new), new, 0)), red
        g2 = np.random.default_rng([SEED, rank, 2]).standard_normal(30 * 512).astype(np.float32)
        out = step([tf.constant(g2)])[0].numpy()
        assert np.isfinite(out).all(), red
        assert last_exchange(c) == exchange   # the same trace: occurrence 1
        check_exchange(c, gather(g2 + e1), out, exchange, 1.0 / n, f"error feedback step 2 {red}", occurrence=1)
        (e2,) = [r.numpy() for r in c._adapters["tensorflow"].residuals.residuals.values()]
        assert np.isfinite(e2).all()


def case_zeros(n, rank):
    for red, bits in itertools.product(REDUCTIONS, (1, 4)):
        c = hvd_qsgd.QSGD(bits, seed=SEED, reduction=red)
        x = np.zeros((100, 200), np.float32)
        out, _ = allreduce_fn(c, x)
        assert np.array_equal(out, x) and not np.signbit(out).any() and c.stats["tensors"] == 1, red


def case_empty(n, rank):
    for red in REDUCTIONS:
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red, min_numel=1)
        for i, x in enumerate((np.zeros(0, np.float32), np.zeros((0, 5), np.float32), np.zeros((3, 0), np.float16))):
            eager = hvd.allreduce(tf.constant(x), compression=c, name=f"empty_{i}")
            traced = tf.function(lambda t: hvd.allreduce(t, compression=c, name=f"empty_fn_{i}"))(tf.constant(x))
            for out in (eager.numpy(), traced.numpy()):
                assert out.shape == x.shape and out.dtype == x.dtype
        assert c.stats["tensors"] == 0 and c.stats["raw_tensors"] == 6, c.stats


def case_scalar(n, rank):
    x = np.float32(0.5 + rank)
    for red in REDUCTIONS:
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red, min_numel=1)
        out, exchange = allreduce_fn(c, x)
        assert out.shape == () and c.stats["tensors"] == 1
        check_exchange(c, gather(x), out, exchange, 1.0 / n, f"scalar {red}")
    c = hvd_qsgd.QSGD(4, seed=SEED)
    out = hvd.allreduce(tf.constant(x), compression=c, name="scalar_raw").numpy()
    assert out == hvd.allreduce(tf.constant(x), name="scalar_plain").numpy() and c.stats["raw_tensors"] == 1


def case_transposed(n, rank):
    """A transposed tensor (TensorFlow has no strided views: tf.transpose materializes it)."""
    base = np.random.default_rng([SEED, rank]).standard_normal((300, 200)).astype(np.float32)
    for red in REDUCTIONS:
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red)

        @tf.function
        def step(t):
            return hvd.allreduce(tf.transpose(t), compression=c, name="transposed")
        out = step(tf.constant(base)).numpy()
        assert out.shape == (200, 300)
        check_exchange(c, gather(np.ascontiguousarray(base.T)), out, last_exchange(c), 1.0 / n, f"transposed {red}")


def case_integers(n, rank):
    """Integer tensors go through Horovod's own allreduce, exactly as without compression; bool,
    which Horovod's TensorFlow allreduce refuses, raises Horovod's own error, as without compression."""
    c = hvd_qsgd.QSGD(4, seed=SEED, min_numel=1)
    for dtype in (tf.int32, tf.int64, tf.uint8, tf.int8):
        x = tf.cast(tf.range(20000) % 50 * (rank + 1), dtype)
        for op in (hvd.Sum, hvd.Average):
            out = hvd.allreduce(x, compression=c, op=op, name=f"int_{dtype.name}_{op}")
            want = hvd.allreduce(x, op=op, name=f"int_plain_{dtype.name}_{op}")
            assert out.dtype == dtype and np.array_equal(out.numpy(), want.numpy()), (dtype, op)
    x = tf.range(20000) % 50 * (rank + 1)

    @tf.function
    def step(t):
        return hvd.allreduce(t, compression=c, op=hvd.Sum, name="int_fn")
    assert np.array_equal(step(x).numpy(), (np.arange(20000) % 50 * (n * (n + 1) // 2)).astype(np.int32))
    assert c.stats["tensors"] == 0 and c.stats["raw_tensors"] == 9, c.stats
    errors = []
    for comp in (c, hvd.Compression.none):
        try:
            hvd.allreduce(tf.ones([20000], tf.bool), compression=comp, op=hvd.Sum, name="bool")
            errors.append(None)
        except Exception as e:
            errors.append((type(e), "Value for attr 'T' of bool is not in the list of allowed values" in str(e)))
    assert errors[0] == errors[1] == (tf.errors.InvalidArgumentError, True), errors


def case_unnamed_mismatch(n, rank):
    """An eager unnamed hvd.allreduce that rank 0 does not compress (int32) and the others do: Horovod's
    own error on every rank, as without compression, and the job goes on with the same compressor:
    the next unnamed calls (single and grouped) give the exact average of constants on every rank.
    (The compressing ranks' exchange never reached its decompress: its numbered name, held, made every
    later call's names differ between ranks, "ranks disagree on the exchange key".)"""
    c = hvd_qsgd.QSGD(4, seed=SEED)
    errors = []
    for comp in (c, hvd.Compression.none):
        try:
            hvd.allreduce(tf.ones([20000], tf.int32 if rank == 0 else tf.float32), compression=comp)
            errors.append(None)
        except tf.errors.FailedPreconditionError as e:
            errors.append("Mismatched data types" in str(e))
    assert errors == [True, True], errors
    for step in range(2):   # (a constant quantizes exactly)
        out = hvd.allreduce(tf.fill([20000], float(rank + 1)), compression=c)
        assert np.all(out.numpy() == (n + 1) / 2), (step, out.numpy()[:4])
        outs = hvd.grouped_allreduce([tf.ones([20000]), tf.fill([30000], 2.0)], compression=c)
        assert np.all(outs[0].numpy() == 1) and np.all(outs[1].numpy() == 2), step
    assert c.stats["tensors"] == 6, c.stats   # (counted at a decompress)


def case_low_precision(n, rank):
    for red in REDUCTIONS:
        for dtype in (tf.float16, tf.bfloat16):
            c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red)
            x = tf.cast(np.random.default_rng([SEED, rank]).standard_normal((150, 100)).astype(np.float32), dtype)
            out, exchange = allreduce_fn(c, x.numpy())
            assert out.dtype == dtype.as_numpy_dtype and out.shape == (150, 100)
            check_exchange(c, gather(x.numpy()), out, exchange, 1.0 / n, f"{dtype.name} {red}")


def case_indexed_slices(n, rank):
    """tf.IndexedSlices: Horovod's allgather path (indices and values; values / n for Average), the
    compressor is not called; DistributedGradientTape(sparse_as_dense=True) gives it the dense
    gradient, compressed like any other."""
    c = hvd_qsgd.QSGD(4, seed=SEED, min_numel=1)
    sl = tf.IndexedSlices(tf.fill([3, 4], float(rank + 1)), tf.constant([0, 2, 5]) + rank, tf.constant([10, 4]))
    for how in ("eager", "tf.function"):
        fn = (lambda s, comp, name: hvd.allreduce(s, compression=comp, name=name))
        if how == "tf.function":
            fn = tf.function(fn)
        got = fn(sl, c, f"slices_{how}")
        want = fn(sl, hvd.Compression.none, f"slices_plain_{how}")
        assert isinstance(got, tf.IndexedSlices), type(got)
        assert np.array_equal(got.values.numpy(), want.values.numpy())
        assert np.array_equal(got.indices.numpy(), want.indices.numpy())
        assert np.array_equal(got.values.numpy()[3 * rank], np.full(4, (rank + 1) / n, np.float32))
    assert c.stats["tensors"] == 0 and c.stats["raw_tensors"] == 0, c.stats

    idx = tf.constant(np.arange(10) + 10 * rank)
    dense = np.zeros((1000, 20), np.float32)
    dense[idx.numpy()] = 1.0
    for sad in (False, True):
        for red in REDUCTIONS if sad else REDUCTIONS[:1]:
            c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red)
            v = tf.Variable(tf.ones([1000, 20]))

            @tf.function
            def step():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.gather(v, idx))
                return hvd.DistributedGradientTape(tape, compression=c, sparse_as_dense=sad).gradient(loss, [v])[0]
            g = step()
            if not sad:
                assert isinstance(g, tf.IndexedSlices) and c.stats["tensors"] == 0, (type(g), c.stats)
                assert np.array_equal(tf.convert_to_tensor(g).numpy(), np.sum(gather(dense), axis=0) / n)
            else:
                assert not isinstance(g, tf.IndexedSlices) and c.stats["tensors"] == 1, c.stats
                check_exchange(c, gather(dense), g.numpy(), last_exchange(c), 1.0 / n, f"sparse_as_dense {red}")


def case_shape_collision(n, rank):
    """Ranks that disagree on a tensor's size, rank 0's compressed and the others' uncompressed with
    the length of a control vector (float32 or float64): Horovod's mismatch error on every rank,
    eagerly and traced, as without compression; the compressor works on after it. (An uncompressed
    floating tensor went as a float64 vector of its own shape, and was summed with rank 0's control
    vector, silently: now it has a leading axis of 1, which a control vector never has.)"""
    length = protocol.control_length(n)
    c = hvd_qsgd.QSGD(8, seed=SEED)
    for dtype, how in itertools.product((tf.float32, tf.float64), ("eager", "tf.function")):
        x = tf.ones([20000], tf.float32) if rank == 0 else tf.ones([length], dtype)
        errors = []
        for comp in (c, hvd.Compression.none):
            def fn(t, comp=comp):
                return hvd.allreduce(t, compression=comp, name=f"collide_{dtype.name}_{how}")
            try:
                (tf.function(fn) if how == "tf.function" else fn)(x)
                errors.append(None)
            except tf.errors.OpError as e:
                errors.append(str(e))
        # (Horovod's: shapes with compression, a control vector beside a float64 tensor; the
        # control's float32 beside float64 is a dtype mismatch)
        assert "Mismatched ALLREDUCE tensor shapes" in (errors[0] or ""), (dtype.name, how, errors[0])
        assert "Mismatched" in (errors[1] or ""), (dtype.name, how, errors[1])
    out = hvd.allreduce(tf.fill([20000], float(rank + 1)), compression=c, name="after_collide")
    assert np.all(out.numpy() == (n + 1) / 2), out.numpy()[:4]   # (a constant quantizes exactly)


def case_unknown_shape(n, rank):
    """A tensor whose size is unknown where the step is traced (None in the input_signature) goes
    through Horovod's allreduce uncompressed, counted, and the compressor says so; its result is
    exact and in its own shape."""
    c = hvd_qsgd.QSGD(4, seed=SEED)
    fn = tf.function(lambda t: hvd.allreduce(t, compression=c, name="unknown"),
                     input_signature=[tf.TensorSpec([None], tf.float32)])
    with logged() as messages:
        out = fn(tf.fill([20000], float(rank + 1)))
    assert out.shape == (20000,) and np.all(out.numpy() == (n + 1) / 2), out.numpy()[:4]
    assert c.stats["tensors"] == 0 and c.stats["raw_tensors"] == 1, c.stats
    assert any("whose size is not known where the step is traced, goes uncompressed" in m for m in messages), messages


CASES = {"nonfinite-allreduce": case_nonfinite_allreduce, "nonfinite-tape": case_nonfinite_tape,
         "nonfinite-error-feedback": case_nonfinite_error_feedback, "zeros": case_zeros, "empty": case_empty,
         "scalar": case_scalar, "transposed": case_transposed, "integers": case_integers,
         "low-precision": case_low_precision, "indexed-slices": case_indexed_slices,
         "unnamed-mismatch": case_unnamed_mismatch, "shape-collision": case_shape_collision,
         "unknown-shape": case_unknown_shape}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("case", nargs="*", default=list(CASES))
    args = p.parse_args()
    hvd.init()
    for name in args.case:
        CASES[name](hvd.size(), hvd.rank())
        print(f"OK {name}", flush=True)


if __name__ == "__main__":
    main()
