"""``hvd_qsgd.tensorflow.keras.elastic``: Horovod's ``horovod.tensorflow.keras.elastic`` names for
elastic ``model.fit``, for tf_keras and Keras 3 models.

* ``KerasState(model, optimizer=None, **kwargs)``: the package's ``TensorFlowKerasState``
  (``hvd_qsgd.tensorflow.elastic``: model and optimizer variables, Keras 3 or ``tf.Variable``s, and
  the QSGD compressors given among ``kwargs``);
* ``run``: the package's elastic loop (``hvd_qsgd.tensorflow.elastic.run``, whose error filter sees the
  failures TensorFlow 2.21 reports);
* ``CommitStateCallback(state, batches_per_commit=1)``: ``state.commit()`` every ``batches_per_commit``
  batches and at every epoch's end; ``UpdateBatchStateCallback(state)``: ``state.batch`` is the last
  finished batch (0 after an epoch), and after a reset the first epoch is shortened by the batches
  already done; ``UpdateEpochStateCallback(state)``: ``state.epoch`` counts the epochs done across
  resets. Horovod's semantics; callbacks of the model's Keras (``hvd_qsgd.tensorflow.keras_callbacks``).
"""
from hvd_qsgd.tensorflow import elastic as _elastic
from hvd_qsgd.tensorflow.elastic import run  # noqa: F401
from hvd_qsgd.tensorflow.keras_base import warn_once
from hvd_qsgd.tensorflow.keras_callbacks import KerasCallback

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class TensorFlowKerasState(_elastic.TensorFlowKerasState):
    """The package's state with Horovod's signature: ``backend`` (Horovod's: the Keras backend whose TF1
    session it would use) has no use in eager TensorFlow 2 (a warning, once, where it is given)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if backend is not None:
            warn_once("elastic.backend", "hvd_qsgd.tensorflow.keras.elastic.TensorFlowKerasState: backend is "
                      "not used (the state is read and written eagerly, without a TF1 session)")
        super().__init__(model, optimizer=optimizer, **kwargs)


class KerasState(TensorFlowKerasState):
    """State of a Keras model (tf_keras or Keras 3) and its optimizer (default ``model.optimizer``);
    ``kwargs``: QSGD compressors and other values to sync."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(KerasCallback):
    """``state.commit()`` every ``batches_per_commit`` batches and at the end of every epoch."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # the same on every rank after a sync

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(KerasCallback):
    """``state.batch``: the last finished batch of the epoch (0 at an epoch's end)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params and self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params["steps"]
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(KerasCallback):
    """``state.epoch``: the number of epochs done, across resets."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
