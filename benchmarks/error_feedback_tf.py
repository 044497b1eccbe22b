"""``python -m benchmarks error-feedback --framework tensorflow``: TensorFlow's error-feedback encode,
as graph ops composed against the one op that fuses them.

In a ``tf.function`` over a float32 tensor and a residual variable, side by side in one run:

- composed: what the TensorFlow adapter built until 2026-11-29: v = x + e (e the variable times
  the learning-rate factor), ``QsgdEncode(v)``, ``QsgdDecodeSum`` of the payload, the difference, a
  ``tf.where`` on its finiteness and the assignment;
- fused: ``QsgdEncodeEf(x, e, factor)`` (the C ABI's ``qsgd_encode_ef_cpu``), which updates the
  variable in place;
- encode: ``QsgdEncode(x)`` alone.

Before timing, the two are checked to give the same payload and residual bits (finite inputs: the
rules differ only where a difference is not finite). The op library picks its CPU variant once, when
it loads (``HVD_QSGD_ISA``, else the widest this CPU runs): one variant a run, named in the output.
"""
import numpy as np

from hvd_qsgd import codec
from benchmarks import kernels


def _graphs(n, bits, bucket, coding):
    import tensorflow as tf
    from hvd_qsgd.tensorflow import ops
    o = ops.load()
    attrs = dict(bits=bits, bucket_size=bucket, coding=codec.CODINGS[coding], seed=7)
    factor = tf.constant(1.0)
    occ = tf.constant(0, tf.int64)

    def composed(x, e):
        v = x + e * factor
        q = o.qsgd_encode(v, occ, **attrs)
        own = o.qsgd_decode_sum(q, tf.constant(1.0), count=1, numel=n, bits=bits, bucket_size=bucket,
                                coding=attrs["coding"])
        d = v - own
        e.assign(tf.where(tf.math.is_finite(d), d, e))
        return q

    def fused(x, e):
        return o.qsgd_encode_ef(x, occ, e.handle, factor, **attrs)

    return tf.function(composed), tf.function(fused), tf.function(lambda x: o.qsgd_encode(x, occ, **attrs))


def measure(n, bits, bucket, coding, repeats):
    import tensorflow as tf
    rng = np.random.default_rng(n)
    x = tf.constant(rng.standard_normal(n, dtype=np.float32))
    e0 = (0.1 * rng.standard_normal(n)).astype(np.float32)
    composed, fused, encode = _graphs(n, bits, bucket, coding)
    e_a, e_b = tf.Variable(e0), tf.Variable(e0)
    q_a, q_b = composed(x, e_a).numpy(), fused(x, e_b).numpy()
    if not (np.array_equal(q_a, q_b) and np.array_equal(e_a.numpy().view(np.uint32), e_b.numpy().view(np.uint32))):
        raise SystemExit(f"self-check FAILED at {n} elements, {bits} bits: QsgdEncodeEf differs from the ops composed")

    def timed(fn, *args):   # .numpy(): the step's result read, as a training step waits for it
        return lambda: fn(*args).numpy()
    t_comp, _ = kernels.median_time(timed(composed, x, e_a), repeats)
    t_fused, _ = kernels.median_time(timed(fused, x, e_b), repeats)
    t_enc, _ = kernels.median_time(timed(encode, x), repeats)
    ratio = kernels.paired_ratio(timed(composed, x, e_a), timed(fused, x, e_b), repeats)
    return dict(n=n, bits=bits, composed_us=1e6 * t_comp, fused_us=1e6 * t_fused, encode_us=1e6 * t_enc,
                composed_over_fused=ratio)

