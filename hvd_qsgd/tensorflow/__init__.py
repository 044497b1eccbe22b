"""``hvd_qsgd.tensorflow``: what TensorFlow users import. The compressor ``QSGD`` (the TensorFlow
adapter, ``hvd_qsgd.adapters.tensorflow``, a ``horovod.tensorflow.compression.Compressor`` built on
the TensorFlow ops in ``hvd_qsgd/tensorflow/qsgd_ops.cc``); ``DistributedGradientTape`` (Horovod's
tape, taking Keras 3 variables too) and ``tf_variables`` (``hvd_qsgd.tensorflow.tape``).

It also stands in for ``horovod.tensorflow`` in a GradientTape pipeline: ``import
hvd_qsgd.tensorflow as hvd`` in place of ``import horovod.tensorflow as hvd`` gives Horovod's names
(``init``, ``rank``, ``size``, ``local_rank``, ``allreduce``, ``allgather``, ``broadcast``,
``Compression``, ``Average``/``Sum``/``Adasum``, process sets, ...) as they are, and these, made to
take Keras 3 variables and optimizers as well:

* ``broadcast_variables(variables, root_rank, process_set=...)``: Keras 3 variables or ``tf.Variable``s;
* ``DistributedOptimizer(optimizer, ...)``: Horovod's signature; a Keras 3 optimizer is distributed by
  the package (``hvd_qsgd.tensorflow.keras_base.distributed_optimizer``), a tf_keras or
  ``tf.compat.v1`` one by Horovod's own;
* ``DistributedGradientTape`` (above) and ``PartialDistributedGradientTape`` (its local layers' trainable
  variables registered as local sources).

Keras ``model.fit``: ``hvd_qsgd.tensorflow.keras`` (a drop-in for ``horovod.tensorflow.keras``),
imported on its own; elastic training: ``hvd_qsgd.tensorflow.elastic``, imported on its own."""
import horovod.tensorflow as _hvd
from horovod.tensorflow import (  # noqa: F401  Horovod's names, as they are
    Adasum, Average, Compression, Max, Min, ProcessSet, Product, Sum, add_process_set, allgather,
    allgather_object, allreduce, alltoall, broadcast, broadcast_, broadcast_object, broadcast_object_fn,
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, global_process_set, gloo_built, gloo_enabled,
    grouped_allgather, grouped_allreduce, grouped_reducescatter, init, is_homogeneous, is_initialized, join,
    local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, reducescatter,
    remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline)

from hvd_qsgd.adapters.tensorflow.compressor import TensorFlowCompressor as QSGD  # noqa: F401  (the public name)
from hvd_qsgd.tensorflow.keras_base import distributed_optimizer
from hvd_qsgd.tensorflow.tape import DistributedGradientTape, tf_variables  # noqa: F401


def broadcast_variables(variables, root_rank=0, process_set=global_process_set, inplace=False):
    """Horovod's ``broadcast_variables``: assign rank ``root_rank``'s values to ``variables`` on every
    rank of ``process_set``; Keras 3 variables are broadcast through the ``tf.Variable`` each holds."""
    process_set = global_process_set if process_set is None else process_set
    variables = tf_variables(list(variables))
    if not variables:
        return None
    return _hvd.broadcast_variables(variables, root_rank=root_rank, process_set=process_set, inplace=inplace)


def broadcast_global_variables(root_rank):
    """Horovod's (graph mode, ``tf.compat.v1``): in eager TensorFlow 2 Horovod refuses it and points to
    ``broadcast_variables``."""
    return _hvd.broadcast_global_variables(root_rank)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='', device_sparse='',
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Horovod's ``horovod.tensorflow.DistributedOptimizer`` (same arguments); a Keras 3 optimizer is
    distributed by the package (``hvd_qsgd.tensorflow.keras_base.distributed_optimizer``)."""
    return distributed_optimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step, average_aggregated_gradients=average_aggregated_gradients,
        num_groups=num_groups, groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
        use_locking=use_locking)


def PartialDistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """Horovod's ``PartialDistributedGradientTape``: ``DistributedGradientTape`` whose ``local_layers``'
    trainable variables (Keras 3 or tf_keras layers) keep their local gradients."""
    if local_layers is None:
        local_layers = []
    elif hasattr(local_layers, "trainable_weights"):
        local_layers = [local_layers]
    if not all(hasattr(layer, "trainable_weights") for layer in local_layers):
        raise ValueError("PartialDistributedGradientTape: every local layer must be a Keras layer")
    tape = DistributedGradientTape(gradtape, compression=compression, device_dense=device_dense,
                                   device_sparse=device_sparse, sparse_as_dense=sparse_as_dense, op=op,
                                   gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
                                   groups=groups, process_set=process_set,
                                   scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
