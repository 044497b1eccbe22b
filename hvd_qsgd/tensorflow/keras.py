"""``hvd_qsgd.tensorflow.keras``: a drop-in for ``horovod.tensorflow.keras`` on TensorFlow 2.16+, for
tf_keras (``TF_USE_LEGACY_KERAS=1``) and Keras 3 models alike: ``import hvd_qsgd.tensorflow.keras as
hvd`` in place of ``import horovod.tensorflow.keras as hvd`` is the whole change to a Horovod Keras
script, compressed (``compression=hvd_qsgd.QSGD(4)``) or not (``hvd.Compression.none``/``fp16``).

Horovod's names, as Horovod's module has them: ``init``, ``shutdown``, ``is_initialized``, ``size``,
``local_size``, ``cross_size``, ``rank``, ``local_rank``, ``cross_rank``, the ``*_built``/``*_enabled``
queries, timelines, process sets (``ProcessSet``, ``global_process_set``, ``add_process_set``,
``remove_process_set``), ``Average``/``Sum`` (and ``Adasum``, for the collectives), ``Compression``;
and, working on both Keras:

* ``DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=...,
  sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
  average_aggregated_gradients=False, num_groups=0, groups=None, process_set=..., scale_local_gradients=True)``:
  a tf_keras optimizer goes to Horovod's own (which works on tf_keras); a Keras 3 optimizer (where
  Horovod's silently does not average) is distributed by the package: the same object, its class
  replaced by a subclass (same name, config and state) whose ``apply`` first reduces every gradient
  with ``horovod.tensorflow.allreduce(g, compression=..., op=...)``, named
  ``<name or DistributedOptimizer>_Allreduce/<i>_<path>``; ``gradient_predivide_factor`` f: prescale 1/f,
  postscale f; ``register_local_var`` as Horovod's. On Keras 3, ``groups``/``num_groups`` have no effect
  (a warning, once), and ``backward_passes_per_step`` becomes Keras 3's ``gradient_accumulation_steps``
  (same update; a warning says that nothing is saved in communication). An ``apply`` traced for XLA
  (``jit_compile=True``) is refused: Horovod's collectives have no XLA kernels.
* ``broadcast_variables`` (Keras 3 variables too), ``broadcast_global_variables`` (Horovod's: graph
  mode only), ``allreduce``/``allgather``/``broadcast``/``reducescatter`` of a tensor-compatible value.
* ``callbacks``: ``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``,
  ``LearningRateScheduleCallback``, ``LearningRateWarmupCallback`` (``hvd_qsgd.tensorflow.keras_callbacks``);
  ``elastic``: ``KerasState``, ``CommitStateCallback``, ``UpdateBatchStateCallback``,
  ``UpdateEpochStateCallback``, ``run`` (``hvd_qsgd.tensorflow.keras_elastic``).
* ``load_model(filepath, custom_optimizers=None, custom_objects=None, compression=..., legacy_opts=False)``:
  the model of ``tf.keras`` (tf_keras where ``TF_USE_LEGACY_KERAS`` is set), its optimizer distributed.

The package's earlier names stay: ``BroadcastInitialState(root_rank=0, process_set=None)`` and
``MetricAverage(process_set=None)`` are the two callbacks above; and PQASGD
(``PeriodicQuantizedAveraging``, ``hvd_qsgd.tensorflow.periodic``) and dist-EF-SGDM (``EFSGDM``,
``hvd_qsgd.tensorflow.ef_sgdm``) for Keras 3.
"""
import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow import (  # noqa: F401  Horovod's names, as horovod.tensorflow.keras has them
    Adasum, Average, Compression, ProcessSet, Sum, add_process_set, ccl_built, cross_rank, cross_size,
    cuda_built, ddl_built, global_process_set, gloo_built, gloo_enabled, init, is_initialized, local_rank,
    local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, remove_process_set,
    rocm_built, shutdown, size, start_timeline, stop_timeline)

from hvd_qsgd.tensorflow import broadcast_global_variables, broadcast_variables  # noqa: F401
from hvd_qsgd.tensorflow import keras_callbacks as callbacks, keras_elastic as elastic  # noqa: F401
from hvd_qsgd.tensorflow.keras_base import (TF_KERAS, default_flavor, distributed_optimizer, keras_flavor,
                                            keras_module, warn_once)
from hvd_qsgd.tensorflow.keras_callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback
from hvd_qsgd.tensorflow.ef_sgdm import EFSGDM  # noqa: F401
from hvd_qsgd.tensorflow.periodic import PeriodicQuantizedAveraging  # noqa: F401
from hvd_qsgd.tensorflow.tape import tf_variables

WHO = "hvd_qsgd.tensorflow.keras"


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Horovod's Keras ``DistributedOptimizer`` for a tf_keras or a Keras 3 optimizer (module docstring)."""
    return distributed_optimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step, average_aggregated_gradients=average_aggregated_gradients,
        num_groups=num_groups, groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


def _tensor(value):
    if isinstance(value, (list, tuple)):
        return tf.convert_to_tensor(value)
    return tf.convert_to_tensor(tf_variables([value])[0])


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none, process_set=global_process_set):
    """The reduction (default: average) of a tensor-compatible value over the ranks (Horovod's)."""
    return _hvd.allreduce(_tensor(value), average=average, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, op=op, compression=compression, name=name,
                          process_set=process_set)


def allgather(value, name=None, process_set=global_process_set):
    """The ranks' values concatenated on the first dimension (Horovod's)."""
    return _hvd.allgather(_tensor(value), name=name, process_set=process_set)


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s value, on every rank (Horovod's)."""
    return _hvd.broadcast(_tensor(value), root_rank, name=name, process_set=process_set)


def reducescatter(value, name=None, op=Average, process_set=global_process_set):
    """The reduction of a value over the ranks, split on the first dimension among them (Horovod's)."""
    return _hvd.reducescatter(_tensor(value), name=name, op=op, process_set=process_set)


def _distributed_class(cls, compression):
    """What deserializes an optimizer saved as ``cls`` into its ``DistributedOptimizer`` (Keras calls
    ``from_config`` of what it finds in ``custom_objects``, in the .keras and the HDF5 format alike)."""
    def from_config(_, config, custom_objects=None):
        return DistributedOptimizer(cls.from_config(config), compression=compression)
    return type(cls.__name__, (), {"from_config": classmethod(from_config)})


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """Load a saved Keras model with ``tf.keras``'s Keras and distribute its optimizer (Horovod's).

    tf_keras: every optimizer class (``tf_keras.optimizers.legacy`` ones with ``legacy_opts``) and
    ``custom_optimizers`` are deserialized as their ``DistributedOptimizer``, so the saved optimizer state
    loads into it. Keras 3: the model is loaded as saved and its optimizer distributed in place (same
    object, same state); ``legacy_opts`` has no meaning there (a warning, once)."""
    flavor = default_flavor()
    keras = keras_module(flavor)
    objects = {}
    if flavor == TF_KERAS:
        base = keras.optimizers.legacy.Optimizer if legacy_opts else keras.optimizers.Optimizer
        for cls in base.__subclasses__():  # Keras's own optimizers (Horovod's: the direct subclasses)
            objects[cls.__name__.lower()] = objects[cls.__name__] = _distributed_class(cls, compression)
        for cls in custom_optimizers or []:
            objects[cls.__name__] = _distributed_class(cls, compression)
    else:
        if legacy_opts:
            warn_once("legacy_opts", f"{WHO}.load_model: legacy_opts has no meaning for Keras 3 models "
                      "(Keras 3 has no legacy optimizers); the model is loaded as saved")
        objects.update({cls.__name__: cls for cls in custom_optimizers or []})
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and keras_flavor(optimizer) != TF_KERAS:
        DistributedOptimizer(optimizer, compression=compression)
    elif optimizer is not None and not hasattr(optimizer, "_allreduce_grads"):
        raise ValueError(f"{WHO}.load_model: the optimizer of {filepath!r} ({type(optimizer).__name__}) was not "
                         "loaded as a DistributedOptimizer; name its class in custom_optimizers")
    return model


class BroadcastInitialState(BroadcastGlobalVariablesCallback):
    """``callbacks.BroadcastGlobalVariablesCallback`` under the package's earlier name."""

    def __init__(self, root_rank: int = 0, process_set=None):
        super().__init__(root_rank, process_set=process_set)


class MetricAverage(MetricAverageCallback):
    """``callbacks.MetricAverageCallback`` under the package's earlier name."""

    def __init__(self, process_set=None):
        super().__init__(process_set=process_set)
