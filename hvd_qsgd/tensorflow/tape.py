"""Horovod's ``DistributedGradientTape`` for the variables users have now: ``tf.Variable``s and Keras 3
variables alike.

Horovod 0.28.1's tape keys its sources by ``Variable.ref()``, which Keras 3 variables lack, so
``hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)`` fails on a Keras 3
model with ``AttributeError: 'Variable' object has no attribute 'ref'`` (Horovod's issue 4290). A
Keras 3 variable of the TensorFlow backend holds a ``tf.Variable`` (its ``value``), which is what the
model's ops read and what the tape watches. So the gradient with respect to the Keras 3 variable is
the gradient with respect to that ``tf.Variable``, and the tape here hands Horovod's the
``tf.Variable``s (``tf_variables``) and returns the reduced gradients in the caller's structure, in
the caller's order. Nothing else changes: Horovod's own tape reduces them, with any ``compression``
(``hvd_qsgd.QSGD``, ``hvd.Compression.none``, ``hvd.Compression.fp16``), in ``tf.function`` or eager.
"""
from typing import Any, Iterable, List

import tensorflow as tf
import horovod.tensorflow as hvd


def tf_variables(variables: Iterable[Any]) -> List[Any]:
    """The ``tf.Variable`` behind each Keras 3 variable (others are returned as they are).

    ``tape.gradient(loss, tf_variables(model.trainable_variables))`` gives Horovod's tape the
    TensorFlow variables the Keras 3 model reads; the gradients apply to the Keras 3 variables
    unchanged (same order)."""
    out = []
    for v in variables:
        inner = getattr(v, "value", None) if not hasattr(v, "ref") else None
        out.append(inner if inner is not None and hasattr(inner, "ref") else v)
    return out


def DistributedGradientTape(gradtape: tf.GradientTape, compression=None, **kwargs) -> tf.GradientTape:
    """``horovod.tensorflow.DistributedGradientTape(gradtape, compression=..., **kwargs)`` whose
    ``gradient``, ``register_local_source`` and ``get_local_and_global_gradients`` also take Keras 3
    variables (and nested structures of sources, as ``tf.GradientTape.gradient`` does).

    ``compression``: any Horovod TensorFlow compressor (default ``hvd.Compression.none``);
    ``kwargs``: Horovod's (``op``, ``sparse_as_dense``, ``gradient_predivide_factor``, ``groups``,
    ``process_set``, ...), passed on unchanged. Horovod's ``groups`` given as lists of variables
    take the ``tf.Variable``s (``tf_variables``)."""
    if compression is None:
        compression = hvd.Compression.none
    groups = kwargs.get("groups")
    if isinstance(groups, list):
        kwargs["groups"] = [tf_variables(g) for g in groups]
    tape = hvd.DistributedGradientTape(gradtape, compression=compression, **kwargs)
    # Horovod's methods, bound to this tape; the wrappers below are set on the instance (Horovod's
    # class calls super(self.__class__, self), so it cannot be subclassed)
    reduce_gradient = tape.gradient
    register = tape.register_local_source
    local_and_global = tape.get_local_and_global_gradients

    def gradient(target, sources, output_gradients=None, use_generic_names=False):
        flat = tf.nest.flatten(sources)
        grads = reduce_gradient(target, tf_variables(flat), output_gradients, use_generic_names)
        return tf.nest.pack_sequence_as(sources, list(grads))

    def register_local_source(source):
        return register(tf_variables([source])[0])

    def get_local_and_global_gradients(target, sources, output_gradients=None, use_generic_names=False):
        flat = list(sources)
        inner = tf_variables(flat)
        by_id = {id(t): s for s, t in zip(flat, inner)}
        local, global_ = local_and_global(target, inner, output_gradients, use_generic_names)
        return ([(by_id[id(t)], g) for t, g in local], [(by_id[id(t)], g) for t, g in global_])

    tape.gradient = gradient
    tape.register_local_source = register_local_source
    tape.get_local_and_global_gradients = get_local_and_global_gradients
    return tape
