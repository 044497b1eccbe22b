"""PQASGD for Keras 3: local steps, and every ``period`` steps the ranks average the quantized
differences of their models (the PyTorch form and the paper: ``hvd_qsgd/torch/periodic.py``).

``PeriodicQuantizedAveraging(optimizer, period, compression=...)`` returns the Keras 3 ``optimizer``
(not distributed: the local steps average nothing), its class replaced by a subclass
(``hvd_qsgd.tensorflow.keras_base.wrap``) whose ``apply`` is::

    apply(grads, x):  if steps == 0:  x^ <- x                       (the start every rank shares)
                      the optimizer's own apply(grads, x)         (a local step on this rank's data)
                      steps <- steps + 1
                      if steps % period == 0:                     (every rank alike: same steps)
                          d_i = x - x^
                          x^  <- x^ + allreduce(d_i, op=Average, compression=Q)
                          x   <- x^
                          the optimizer state per ``momentum``

so it runs inside ``model.fit``'s ``tf.function`` (the sync is a ``tf.cond`` on the step count) or
eagerly. x^ (one variable per model variable, ``<path>_pqasgd_anchor``) and the step count
(``pqasgd_local_steps``) are optimizer variables: broadcast by
``hvd_qsgd.tensorflow.keras.BroadcastInitialState``, saved with the optimizer. Q is the compressor
(default ``hvd_qsgd.QSGD(2)``): unbiased, so x^ moves by the average of the local progress in
expectation, and it is bit-identical on every rank. The collectives are named
``hvd_qsgd.pqasgd.<i>_<path>``.

``momentum``: the optimizer's own variables other than its iteration count and learning rate (SGD's
momentums, Adam's moments) at a sync: "local" (default) keeps each rank's; "average" replaces them by
their exact average over the ranks; "reset" zeroes them. With plain SGD the three agree.
"""
import tensorflow as tf
import horovod.tensorflow as hvd

from hvd_qsgd.tensorflow.keras_base import refuse_xla, variable_name, wrap

WHO = "hvd_qsgd.tensorflow.keras.PeriodicQuantizedAveraging"
MOMENTUM_MODES = ("local", "average", "reset")


def PeriodicQuantizedAveraging(optimizer, period: int, compression=None, momentum: str = "local",
                               process_set=None):
    """PQASGD around the Keras 3 ``optimizer`` (module docstring).

    period:      local steps between syncs (an integer >= 1)
    compression: Q (default ``hvd_qsgd.QSGD(2)``); any Horovod TensorFlow compressor,
                 ``hvd.Compression.none`` for exact periodic averaging
    momentum:    "local" (default), "average" or "reset"
    process_set: Horovod process set (default: all ranks)"""
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"{WHO}: period must be an integer >= 1, got {period!r}")
    if momentum not in MOMENTUM_MODES:
        raise ValueError(f"{WHO}: momentum must be one of {MOMENTUM_MODES}, got {momentum!r}")
    if compression is None:
        import hvd_qsgd
        compression = hvd_qsgd.QSGD(2)
    process_set = hvd.global_process_set if process_set is None else process_set
    base = type(optimizer)

    def build(self, variables):
        if self.built:
            return
        base.build(self, variables)
        own = {id(self._iterations), id(getattr(self, "_learning_rate", None))}
        self._pqasgd_state = [v for v in self.variables if id(v) not in own]  # before the anchors
        self._pqasgd_anchors = [self.add_variable_from_reference(v, "pqasgd_anchor") for v in variables]
        self._pqasgd_steps = self.add_variable((), initializer="zeros", dtype="int64", name="pqasgd_local_steps")

    def synchronize(self):
        """x^ <- x^ + average(Q(x - x^)); x <- x^; then the state per ``momentum``."""
        for i, (v, a) in enumerate(zip(self._trainable_variables, self._pqasgd_anchors)):
            average = hvd.allreduce(tf.convert_to_tensor(v) - tf.convert_to_tensor(a), op=hvd.Average,
                                    compression=compression, name="hvd_qsgd.pqasgd." + variable_name(i, v),
                                    process_set=process_set)
            a.assign_add(tf.cast(average, a.dtype))
            v.assign(a)
        if momentum == "local":
            return
        for i, s in enumerate(self._pqasgd_state):
            value = tf.convert_to_tensor(s)
            if not value.dtype.is_floating:
                continue
            if momentum == "reset":
                s.assign(tf.zeros_like(value))
            else:
                s.assign(hvd.allreduce(value, op=hvd.Average, name="hvd_qsgd.pqasgd.state." + variable_name(i, s),
                                       process_set=process_set))

    def apply(self, grads, trainable_variables=None):
        refuse_xla(WHO, self)
        grads = list(grads)
        if not self.built and trainable_variables is not None:
            self.build(list(trainable_variables))
        if not self.built:  # Keras raises its own error (no variables to build on)
            return base.apply(self, grads, trainable_variables)

        def start():
            for v, a in zip(self._trainable_variables, self._pqasgd_anchors):
                a.assign(v)
            return tf.constant(0)

        tf.cond(tf.equal(tf.convert_to_tensor(self._pqasgd_steps), 0), start, lambda: tf.constant(0))
        base.apply(self, grads, trainable_variables)
        self._pqasgd_steps.assign_add(1)

        def sync():
            synchronize(self)
            return tf.constant(0)

        due = tf.equal(tf.math.floormod(tf.convert_to_tensor(self._pqasgd_steps), period), 0)
        tf.cond(due, sync, lambda: tf.constant(0))

    optimizer = wrap(optimizer, WHO, {"build": build, "apply": apply})
    watch = getattr(compression, "_never_called", None)
    if watch is not None:  # called at syncs only
        watch.expect_calls_every(period)
    return optimizer
