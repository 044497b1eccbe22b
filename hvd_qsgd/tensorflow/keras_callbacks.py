"""``hvd_qsgd.tensorflow.keras.callbacks``: Horovod's Keras callbacks (``horovod.tensorflow.keras.callbacks``),
with Horovod's names, arguments and semantics, for tf_keras and Keras 3 models alike.

Horovod 0.28.1's own callbacks call the backend of Keras 3 (``keras.backend.constant``) whatever the
model is, and fail on a tf_keras model. Each callback here is a callback of the Keras its model uses:
it is built as one of ``tf.keras`` (tf_keras where ``TF_USE_LEGACY_KERAS`` is set, Keras 3 otherwise)
and, when ``fit`` hands it a model of the other Keras (``set_model``, before any other hook), it
becomes a callback of that one. Variables and learning rates are read and written through what both
Keras have (``variables``, ``learning_rate``), never through a backend module.

* ``BroadcastGlobalVariablesCallback(root_rank, device='', local_variables=None, process_set=None)``:
  rank ``root_rank``'s model and optimizer variables (all but ``local_variables``) to every rank at the
  end of the first batch, as Horovod's; and also at the start of ``fit`` when every rank has the same
  number of them, so that the first step already starts from one state.
* ``MetricAverageCallback(device='', process_set=None)``: at the end of every epoch, each numeric entry
  of ``logs`` becomes its average over the ranks (keys in sorted order).
* ``LearningRateScheduleCallback(initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
  momentum_correction=True, steps_per_epoch=None)``: in epochs ``[start_epoch, end_epoch)`` the
  learning rate is ``initial_lr * multiplier(epoch)`` (a number m means ``m ** (epoch - start_epoch)``),
  set at the first batch of each epoch (``staircase``) or at every batch with
  ``epoch + batch / steps_per_epoch``; ``logs['lr']`` at every epoch's end.
* ``LearningRateWarmupCallback(initial_lr, warmup_epochs=5, momentum_correction=True,
  steps_per_epoch=None, verbose=0)``: ``lr = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)``
  with ``e = epoch + (batch + 1) / steps_per_epoch``, at every batch of the first ``warmup_epochs``
  epochs: from about ``initial_lr / size`` to ``initial_lr`` at the last batch of the warm-up.

``momentum_correction`` (Horovod: while the learning rate changes, a batch runs with momentum scaled by
new_lr / old_lr) applies where the momentum is a variable (tf_keras's legacy optimizers). A Keras 3 or
tf_keras optimizer holds it as a Python number that its compiled step reads when it is traced, so
there it cannot mean anything: a warning says so once, and the learning rate is still set.
``device``: the ``tf.device`` the callback's collectives are placed on (Horovod's meaning).
``BroadcastInitialState`` and ``MetricAverage`` (``hvd_qsgd.tensorflow.keras``) are these callbacks
under the package's earlier names.
"""
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

from hvd_qsgd.tensorflow.keras_base import (KERAS3, TF_KERAS, default_flavor, keras_flavor, keras_module, op_name,
                                            optimizer_variables, warn_once)
from hvd_qsgd.tensorflow.tape import tf_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback"]

_classes = {}


def _flavored(origin, flavor):
    """``origin`` (a class below) joined to the ``Callback`` of Keras ``flavor``, made once."""
    key = (origin, flavor)
    if key not in _classes:
        base = keras_module(flavor).callbacks.Callback
        _classes[key] = type(origin.__name__, (origin, base),
                             {"__module__": origin.__module__, "_hvd_origin": origin, "_hvd_flavor": flavor,
                              "__qualname__": origin.__qualname__})
    return _classes[key]


class KerasCallback:
    """A callback of whichever Keras its model is (module docstring): instances are of a subclass
    joining the class to that Keras's ``Callback``."""

    def __new__(cls, *args, **kwargs):
        origin, flavor = getattr(cls, "_hvd_origin", cls), default_flavor()
        try:
            return object.__new__(_flavored(origin, flavor))
        except ImportError:  # that Keras is not installed: the other one
            return object.__new__(_flavored(origin, TF_KERAS if flavor == KERAS3 else KERAS3))

    def __init__(self):
        super().__init__()

    def set_model(self, model):
        flavor = keras_flavor(model)
        if flavor is not None and flavor != self._hvd_flavor:
            self.__class__ = _flavored(self._hvd_origin, flavor)
            keras_module(flavor).callbacks.Callback.__init__(self)  # that Keras's own attributes
        super().set_model(model)

    def __reduce__(self):  # copies and pickles rebuild through __new__
        return (_rebuild, (self._hvd_origin, self._hvd_flavor, self.__dict__))


def _rebuild(origin, flavor, state):
    obj = object.__new__(_flavored(origin, flavor))
    obj.__dict__.update(state)
    return obj


def _tf_variable_refs(variables):
    return {v.ref() for v in tf_variables(list(variables))}


class BroadcastGlobalVariablesCallback(KerasCallback):
    """Rank ``root_rank``'s model and optimizer variables to every rank (module docstring)."""

    def __init__(self, root_rank=0, device='', local_variables=None, process_set=None):
        super().__init__()
        self.root_rank, self.device = root_rank, device
        self.process_set = hvd.global_process_set if process_set is None else process_set
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple, set)):
            local_variables = [local_variables]
        self._local_refs = _tf_variable_refs(local_variables)
        self.broadcast_done = False

    def register_local_var(self, var):
        """Leave ``var`` out of the broadcast (Horovod's)."""
        self._local_refs |= _tf_variable_refs([var])

    def _variables(self):
        model = self.model
        # a model built at its first batch (a Sequential without an input shape) has no weights yet:
        # tf_keras raises on reading them; the broadcast then comes after the first batch
        weights = list(model.variables) if getattr(model, "built", True) else []
        own = tf_variables(weights + optimizer_variables(getattr(model, "optimizer", None)))
        return [v for v in own if v.ref() not in self._local_refs]

    def _broadcast(self, variables):
        if variables:
            with tf.device(self.device):
                hvd.broadcast_variables(variables, root_rank=self.root_rank, process_set=self.process_set)

    def on_train_begin(self, logs=None):
        self.broadcast_done = False
        variables = self._variables()
        counts = hvd.allgather(tf.constant([len(variables)], tf.int64), process_set=self.process_set,
                               name="hvd_qsgd.broadcast_callback.count").numpy()
        if len(set(counts.tolist())) == 1:  # ranks that built different variables wait for the first batch
            self._broadcast(variables)

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast(self._variables())
            self.broadcast_done = True


class MetricAverageCallback(KerasCallback):
    """Each numeric entry of an epoch's ``logs`` becomes its average over the ranks."""

    def __init__(self, device='', process_set=None):
        super().__init__()
        self.device = device
        self.process_set = hvd.global_process_set if process_set is None else process_set

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        for key in sorted(logs):
            value = logs[key]
            if isinstance(value, (int, float, np.number)) or (hasattr(value, "shape") and tuple(value.shape) == ()):
                with tf.device(self.device):
                    mean = hvd.allreduce(tf.constant(float(value), tf.float64), op=hvd.Average,
                                         name=op_name(f"hvd_qsgd.metric.{key}"), process_set=self.process_set)
                logs[key] = float(mean.numpy())


def _value(x) -> float:
    return float(x.numpy()) if hasattr(x, "numpy") else float(x)


class LearningRateScheduleCallback(KerasCallback):
    """``lr = initial_lr * multiplier(epoch)`` in epochs ``[start_epoch, end_epoch)`` (module docstring)."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))
        self.current_epoch = None
        self.restore_momentum = None

    def _steps(self):
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError("Could not autodetect the number of steps per epoch; give steps_per_epoch to "
                         f"{type(self).__name__}()")

    def _momentum_variable(self, optimizer):
        """The optimizer's momentum where a correction can reach the step (a variable), else None."""
        if not self.momentum_correction or not hasattr(optimizer, "momentum"):
            return None
        momentum = optimizer.momentum
        if hasattr(momentum, "assign"):
            return momentum
        if momentum:
            warn_once("momentum_correction",
                      f"{type(self).__name__}: momentum_correction has no effect on {type(optimizer).__name__}: "
                      "its momentum is a Python number the compiled training step reads when it is traced, so "
                      "it cannot follow the learning rate batch by batch (it can on tf_keras's legacy "
                      "optimizers); the learning rate is set as Horovod's callback sets it")
        return None

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _value(optimizer.learning_rate)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum = self._momentum_variable(optimizer)
        if momentum is not None and old_lr:
            self.restore_momentum = _value(momentum)
            momentum.assign(self.restore_momentum * new_lr / old_lr)

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._steps()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self.restore_momentum:
            self._momentum_variable(self.model.optimizer).assign(self.restore_momentum)
            self.restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _value(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """From ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` epochs, batch by batch
    (module docstring; Goyal et al., "Accurate, Large Minibatch SGD")."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch  # the warm-up ends at the last batch's end
            return 1.0 / hvd.size() * (epoch * (hvd.size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs, self.verbose = warmup_epochs, verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_value(self.model.optimizer.learning_rate):g}.")
