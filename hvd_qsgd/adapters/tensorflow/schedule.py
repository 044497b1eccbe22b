"""DQSGD's bits schedule (``hvd_qsgd.dynamic.Schedule``) as TensorFlow graph ops, for the TensorFlow
adapter: the bits of an exchange are chosen inside the training step, from a variable, so one trace
serves every step.

The state of one tensor is a float64 variable of ``FIELDS``:
``[steps, observed, sum_r, carry, norm, has_norm]`` (``Schedule``'s fields, with ``has_norm`` for its
``norm is None``). ``next_bits`` is ``Schedule.next_bits`` step for step, in float64 and in the same
order of operations:

    a_t  = b_bar + 1/2 log2(discount) ((T-1-t) - (T-1)/2),   t = min(steps, T-1)   (b_bar if discount = 1)
    with a previous norm:  r = log2 max(norm, 1e-30),  observed += 1,  sum_r += r,
                           p_t = a_t + (r - sum_r / observed);        else  p_t = a_t
    b_t  = clamp(floor(p_t + carry + 1/2), min_bits, max_bits),  carry += a_t - b_t,  steps += 1

``observe`` keeps the norm of the exchange's reduced result when it is finite, as ``Schedule.observe``.
The reduced result is bit-identical on every rank, and every rank reduces it to its norm with the
same op, so every rank picks the same bits; if two ranks ever rounded a norm differently, their
settings tags would differ and the control check would fail the step on every rank, not mix
payloads. ``log2`` is ``ln(x) / ln(2)`` here and ``math.log2`` in ``Schedule``: they may differ in
the last bit, which moves a bit choice only when ``p_t + carry + 1/2`` lies within that of a whole
number.
"""
import math

import tensorflow as tf

FIELDS = ("steps", "observed", "sum_r", "carry", "norm", "has_norm")
_LN2 = math.log(2.0)


def initial_state():
    """The value of one tensor's schedule variable when it is made (``FIELDS``, all zero)."""
    return tf.zeros([len(FIELDS)], tf.float64)


def next_bits(state, schedule_args):
    """(b_t as an int32 scalar, the op that advances ``state``); ``schedule_args`` as ``Schedule``'s."""
    a = schedule_args
    steps, observed, sum_r, carry, norm, has = tf.unstack(state.read_value())
    budget = tf.constant(float(a["budget"]), tf.float64)
    if a["discount"] < 1.0:
        total = float(a["total_steps"])
        t = tf.minimum(steps, total - 1.0)
        budget = budget + 0.5 * math.log2(a["discount"]) * ((total - 1.0 - t) - (total - 1.0) / 2)
    r = tf.math.log(tf.maximum(norm, 1e-30)) / _LN2
    seen = has > 0
    observed = tf.where(seen, observed + 1.0, observed)
    sum_r = tf.where(seen, sum_r + r, sum_r)
    target = tf.where(seen, budget + (r - sum_r / tf.maximum(observed, 1.0)), budget)
    bits = tf.clip_by_value(tf.floor(target + carry + 0.5), float(a["min_bits"]), float(a["max_bits"]))
    advance = state.assign(tf.stack([steps + 1.0, observed, sum_r, carry + (budget - bits), norm, has]))
    return tf.cast(bits, tf.int32), advance


def observe(state, reduced):
    """The op recording ||reduced|| (float64) as the norm of the next choice, if it is finite."""
    x = tf.cast(tf.reshape(reduced, [-1]), tf.float64)
    norm = tf.sqrt(tf.reduce_sum(x * x))
    ok = tf.math.is_finite(norm)
    old = state.read_value()
    return state.assign(tf.concat([old[:4], tf.where(ok, tf.stack([norm, 1.0]), old[4:])], 0))


def as_dict(state):
    """The fields of one schedule variable as Python numbers (eager execution)."""
    return dict(zip(FIELDS, (float(v) for v in state.numpy())))
