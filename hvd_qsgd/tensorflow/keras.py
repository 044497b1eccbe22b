"""Keras 3 ``model.fit`` with Horovod: a distributed optimizer and the two callbacks a ``fit`` needs
around it, built on Horovod's TensorFlow collectives; and PQASGD (``PeriodicQuantizedAveraging``,
``hvd_qsgd.tensorflow.periodic``) and dist-EF-SGDM (``EFSGDM``, ``hvd_qsgd.tensorflow.ef_sgdm``).

``DistributedOptimizer(optimizer, compression=...)`` returns the Keras 3 optimizer, its class
replaced by a subclass (same name, same config, same state) whose ``apply`` first reduces every
gradient over the process set with ``horovod.tensorflow.allreduce(g, compression=..., op=...)``::

    apply(grads, variables):  g_i <- allreduce(g_i)  for every gradient that is not None
                              then the optimizer's own apply (apply_gradients calls apply)

so ``model.fit``'s step (``tape.gradient``, then ``optimizer.apply_gradients``) averages the
gradients before the update, in its ``tf.function`` or eagerly (``run_eagerly=True``), with any
Horovod compressor: ``hvd_qsgd.QSGD``, ``hvd.Compression.none``, ``hvd.Compression.fp16``. Each
allreduce is named after the variable's position and path (``DistributedOptimizer_Allreduce/<i>_<path>``),
the same on every rank that builds the same model. ``gradient_predivide_factor`` f splits the
average as Horovod's does: prescale 1/f, postscale f (the allreduce's average divides by n).

A tf_keras optimizer (``TF_USE_LEGACY_KERAS=1``) is handed to Horovod's own
``horovod.tensorflow.keras.DistributedOptimizer``, which works there; a Keras 3 optimizer that is
already wrapped by one of the package's optimizers is refused (``hvd_qsgd.tensorflow.keras_base``), and so is an ``apply`` traced
for XLA (``jit_compile=True``; Keras 3's ``"auto"`` turns it on where a GPU is): Horovod's collectives
and the codec's ops have no XLA kernels, so the error says to compile with ``jit_compile=False``.

``BroadcastInitialState(root_rank)``: at the start of ``fit``, rank ``root_rank``'s model and
optimizer variables are broadcast to every rank, and once more after the first batch when that batch
created variables (Keras 3 builds a model without an ``Input``, and the optimizer's slots, on the
first step). ``MetricAverage``: at the end of every epoch each numeric entry of ``logs`` is replaced
by its average over the ranks (keys in sorted order, the same on every rank).
"""
from typing import Optional

import keras
import tensorflow as tf
import horovod.tensorflow as hvd

from hvd_qsgd.tensorflow.keras_base import is_keras3_optimizer, op_name, refuse_xla, variable_name, wrap
from hvd_qsgd.tensorflow.ef_sgdm import EFSGDM  # noqa: F401
from hvd_qsgd.tensorflow.periodic import PeriodicQuantizedAveraging  # noqa: F401
from hvd_qsgd.tensorflow.tape import tf_variables

WHO = "hvd_qsgd.tensorflow.keras.DistributedOptimizer"


def _reducer(compression, op, sparse_as_dense, gradient_predivide_factor, process_set):
    if op == hvd.Average:
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    else:
        prescale = postscale = 1.0

    def reduce(grads, variables):
        out = []
        for i, (g, v) in enumerate(zip(grads, variables)):
            if g is None:
                out.append(None)
                continue
            if sparse_as_dense and isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            out.append(hvd.allreduce(g, op=op, compression=compression,
                                     name="DistributedOptimizer_Allreduce/" + variable_name(i, v),
                                     prescale_factor=prescale, postscale_factor=postscale,
                                     process_set=process_set))
        return out

    return reduce


def DistributedOptimizer(optimizer, compression=None, op=None, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, process_set=None):
    """The Keras 3 ``optimizer``, distributed (module docstring); a tf_keras optimizer goes to
    Horovod's ``horovod.tensorflow.keras.DistributedOptimizer`` with the same arguments.

    ``compression``: a Horovod TensorFlow compressor (default ``hvd.Compression.none``); ``op``:
    ``hvd.Average`` (default) or ``hvd.Sum``; ``gradient_predivide_factor``: with ``hvd.Average``
    only; ``process_set``: default the global one."""
    compression = hvd.Compression.none if compression is None else compression
    op = hvd.Average if op is None else op
    process_set = hvd.global_process_set if process_set is None else process_set
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError(f"{WHO}: gradient_predivide_factor "
                         f"{gradient_predivide_factor} needs op=hvd.Average")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"{WHO}: gradient_predivide_factor "
                         f"{gradient_predivide_factor} must be positive")
    if not is_keras3_optimizer(optimizer):
        import horovod.tensorflow.keras as hvd_keras  # tf_keras (TF_USE_LEGACY_KERAS=1)
        return hvd_keras.DistributedOptimizer(optimizer, compression=compression, op=op,
                                              sparse_as_dense=sparse_as_dense,
                                              gradient_predivide_factor=gradient_predivide_factor,
                                              process_set=process_set)
    reduce = _reducer(compression, op, sparse_as_dense, gradient_predivide_factor, process_set)
    base = type(optimizer)

    def apply(self, grads, trainable_variables=None):
        refuse_xla(WHO, self)
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        if len(grads) == len(variables):  # otherwise Keras raises its own error: they do not pair up
            grads = reduce(grads, variables)
        return base.apply(self, grads, trainable_variables)

    return wrap(optimizer, WHO, {"apply": apply})


def broadcast_variables(variables, root_rank: int = 0, process_set=None):
    """Assign rank ``root_rank``'s values to ``variables`` (Keras 3 or ``tf.Variable``s) on every rank."""
    process_set = hvd.global_process_set if process_set is None else process_set
    variables = tf_variables(list(variables))
    if variables:
        hvd.broadcast_variables(variables, root_rank=root_rank, process_set=process_set)


class BroadcastInitialState(keras.callbacks.Callback):
    """Broadcast rank ``root_rank``'s model and optimizer variables at the start of ``fit`` (and after
    the first batch, when that batch created variables): every rank starts from the same state."""

    def __init__(self, root_rank: int = 0, process_set=None):
        super().__init__()
        self.root_rank, self.process_set = root_rank, process_set
        self._count: Optional[int] = None

    def _variables(self):
        optimizer = getattr(self.model, "optimizer", None)
        return list(self.model.variables) + (list(optimizer.variables) if optimizer is not None else [])

    def on_train_begin(self, logs=None):
        variables = self._variables()
        broadcast_variables(variables, self.root_rank, self.process_set)
        self._count = len(variables)

    def on_train_batch_end(self, batch, logs=None):
        if self._count is None:
            return
        variables = self._variables()
        if len(variables) != self._count:
            broadcast_variables(variables, self.root_rank, self.process_set)
        self._count = None  # only after the first batch


class MetricAverage(keras.callbacks.Callback):
    """At the end of every epoch, each numeric entry of ``logs`` becomes its average over the ranks."""

    def __init__(self, process_set=None):
        super().__init__()
        self.process_set = hvd.global_process_set if process_set is None else process_set

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        for key in sorted(logs):
            value = logs[key]
            if isinstance(value, (int, float)) or (hasattr(value, "shape") and tuple(value.shape) == ()):
                mean = hvd.allreduce(tf.constant(float(value), tf.float64), op=hvd.Average,
                                     name=op_name(f"hvd_qsgd.metric.{key}"),
                                     process_set=self.process_set)
                logs[key] = float(mean.numpy())
