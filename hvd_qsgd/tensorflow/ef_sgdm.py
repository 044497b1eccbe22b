"""dist-EF-SGDM as a Keras 3 optimizer: the algorithm of ``hvd_qsgd.torch.ef_sgdm`` (Zheng, Huang &
Kwok, NeurIPS 2019, Algorithm 1), whose module docstring states it; here for ``model.fit`` and
custom TensorFlow steps.

Per variable x with gradient g, on every rank i (learning rate eta_t, momentum mu)::

    g   <- g + weight_decay * x                           (coupled, as in the PyTorch optimizer)
    m   <- mu m + g                                       (a slot variable, zero at first)
    p   =  eta_t (mu m + g)                               (Nesterov)
    x   <- x - allreduce(p, Average, compression)         (horovod.tensorflow.allreduce)

The compressor adds the worker residual e to p and keeps e <- (p + e) - C(p + e)
(``error_feedback=True``, required); under ``reduction="scatter_allgather"`` with
``server_error_feedback=True`` (``hvd_qsgd.BlockSign``'s defaults) the rank that reduces chunk j adds
its server residual to the chunk's average, re-compresses it and keeps the new residual
(``QsgdReduceChunkEf``), and the allgather of the re-compressed chunks is the server's broadcast:
two-way compression, with the update bit-identical on every rank. Tensors under the compressor's
``min_numel`` are averaged exactly. The residuals are in update units (eta is inside p), so a
learning-rate schedule needs no rescaling.

Use it in place of ``DistributedOptimizer`` (it already averages; do not wrap it again), and start
every rank from the same weights (``hvd_qsgd.tensorflow.keras.BroadcastInitialState``)::

    opt = hvd_qsgd.tensorflow.keras.EFSGDM(0.1, momentum=0.9, compression=hvd_qsgd.BlockSign(512))
    model.compile(optimizer=opt, loss=..., jit_compile=False)

The update step needs a ``tf.function`` (``model.fit`` traces one; the compressor's residuals are
kept per traced tensor). Each allreduce is named ``EFSGDM_Allreduce/<i>_<path>`` after the
variable's index and path, the same on every rank that builds the same model.
"""
import keras
import tensorflow as tf
import horovod.tensorflow as hvd

from hvd_qsgd.block_sign import efsgdm_compression
from hvd_qsgd.tensorflow.keras_base import refuse_xla, variable_name

WHO = "hvd_qsgd.tensorflow.keras.EFSGDM"


class EFSGDM(keras.optimizers.Optimizer):
    """dist-EF-SGDM over Horovod (see the module docstring).

    learning_rate, momentum: eta (a number or a Keras schedule) and mu
    weight_decay:            added to the gradient before the momentum (0 by default)
    compression:             a ``hvd_qsgd.BlockSign`` (default ``BlockSign()``) or another compressor of
                             the package with worker error feedback (``error_feedback=True``)
    process_set:             Horovod process set (default: all ranks)
    Other keyword arguments go to ``keras.optimizers.Optimizer`` (its decoupled ``weight_decay`` is
    not used: the decay here is the algorithm's, in the gradient)."""

    def __init__(self, learning_rate=0.01, momentum=0.9, weight_decay=0.0, compression=None, process_set=None,
                 name="EFSGDM", **kwargs):
        compression = efsgdm_compression(WHO, dict(momentum=momentum, weight_decay=weight_decay), compression)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.momentum, self.coupled_weight_decay = float(momentum), float(weight_decay)
        self.compression = compression
        self.process_set = hvd.global_process_set if process_set is None else process_set

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.momentums = [self.add_variable_from_reference(v, "momentum") for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        refuse_xla(WHO, self)
        if isinstance(gradient, tf.IndexedSlices):   # dist-EF-SGDM compresses dense updates
            gradient = tf.convert_to_tensor(gradient)
        i = self._get_variable_index(variable)
        g = tf.cast(gradient, variable.dtype)
        if self.coupled_weight_decay:
            g = g + tf.cast(self.coupled_weight_decay, variable.dtype) * variable
        mu = tf.cast(self.momentum, variable.dtype)
        m = self.momentums[i]
        self.assign(m, mu * m + g)
        update = tf.cast(learning_rate, variable.dtype) * (mu * m + g)
        delta = hvd.allreduce(update, op=hvd.Average, compression=self.compression,
                              name="EFSGDM_Allreduce/" + variable_name(i, variable), process_set=self.process_set)
        self.assign_sub(variable, delta)

    def get_config(self):
        config = super().get_config()
        config.update(momentum=self.momentum, weight_decay=self.coupled_weight_decay)
        return config
