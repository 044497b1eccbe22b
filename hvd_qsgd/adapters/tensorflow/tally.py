"""What one scope of a TensorFlow exchange counts and times, added to the compressor's statistics
variables by one op.

A scope is a compress, or a branch of the exchange's verdict (``GraphRun.collecting``). Its counts
(``elements``, ``bytes_sent``, ...) and timed intervals (``encode_s``, ``wait_s``, ``decode_s``) are
gathered here while the scope is built, and become one ``QsgdTally`` op at its end, which the
scope's result depends on. A compressed gradient's statistics are then three such ops (compress,
and each branch of the verdict) and the timestamps of its intervals, which share a stamp where one
interval ends and the next starts (7, against 8 before); they were twelve ``assign_add``s, with
their casts and the subtractions of timestamps (docs/performance.md, "A scope's statistics in one
op"). The counts are those the variables got before, added when the scope's operations have run;
the variables, their names and checkpoints are unchanged. Eagerly the op runs at the scope's end;
a scope that raised adds nothing.
"""
import numbers

import tensorflow as tf

from hvd_qsgd import _tf_ops as qops


class Tally:
    """The counts and intervals of one scope; ``variable(field)`` is the compressor's variable of a
    count (int64) or time (float64) field."""

    __slots__ = ("variable", "constants", "amounts", "intervals", "_stamps")

    def __init__(self, variable):
        self.variable = variable
        self.constants = {}   # count field -> the sum of its amounts known when the graph is built
        self.amounts = []     # (count field, int64 scalar tensor)
        self.intervals = []   # (time field, start stamp, end stamp)
        self._stamps = {}     # ids of the tensors a stamp follows -> (those tensors, the stamp)

    def count(self, **amounts):
        """Add each amount (a number, or an integer scalar tensor) to its count field."""
        for field, amount in amounts.items():
            if isinstance(amount, numbers.Integral):
                self.constants[field] = self.constants.get(field, 0) + int(amount)
            else:
                amount = tf.convert_to_tensor(amount)
                self.amounts.append((field, amount if amount.dtype == tf.int64 else tf.cast(amount, tf.int64)))
                self.constants.setdefault(field, 0)

    def stamp(self, after):
        """``tf.timestamp()`` once the tensors ``after`` exist: one per set of tensors in a scope, so
        that an interval that starts where another ends (a collective's wait, then its decode) shares
        its stamp. (Eagerly: the time now, ``after`` having been computed.)"""
        after = [t for t in tf.nest.flatten(after) if t is not None]
        key = tuple(id(t) for t in after)
        kept = self._stamps.get(key)
        if kept is None:
            with tf.control_dependencies(after):
                kept = self._stamps[key] = (after, tf.timestamp())
        return kept[1]

    def timed(self, field, after, make):
        """make(), its time from once ``after`` exist until its results exist added to ``field``."""
        start = self.stamp(after)
        with tf.control_dependencies([start]):
            result = make()
        self.intervals.append((field, start, self.stamp(result)))
        return result

    def op(self):
        """The QsgdTally op adding what the scope gathered (None where it gathered nothing, and
        eagerly, where it has run)."""
        if not self.constants and not self.intervals:
            return None
        counts = list(self.constants)
        times = list(dict.fromkeys(field for field, _, _ in self.intervals))
        stamps = [t for _, start, end in self.intervals for t in (start, end)]
        return qops.load().qsgd_tally(
            counters=[self.variable(f).handle for f in counts], amounts=[a for _, a in self.amounts],
            timers=[self.variable(f).handle for f in times], stamps=stamps,
            constants=[self.constants[f] for f in counts],
            amount_into=[counts.index(f) for f, _ in self.amounts],
            stamp_into=[times.index(f) for f, _, _ in self.intervals])
