"""The TensorFlow compressor's uncompressed tensors: what it hands Horovod for a tensor it does not
quantize (fewer than ``min_numel`` elements, another dtype, a size unknown where the step is traced),
and what it gives back.

A floating-point tensor goes as float64, so that a grouped allreduce (one dtype per group in
TensorFlow) can hold it with the compressed tensors' control vectors, which are float64 too; and with
a leading axis of length 1 (shape ``(1, *shape)``, at least two axes for a tensor of one or more), so
that it never has a control vector's shape (one axis): where ranks disagree on a tensor (one rank's
of 15 elements, another's compressed), Horovod's shape check then fails on every rank, where a
float64 vector the length of a control vector was summed with one, silently.

A tensor whose size is not known where the step is traced (a gradient Horovod densified from
``tf.IndexedSlices`` with ``sparse_as_dense=True``, of static shape ``(None, d)``) takes its
variable's static shape where its variable is known (``horovod_caller.traced_variable``) and fits;
otherwise it goes uncompressed, and the compressor says so (logged at every trace).
"""
import logging
from typing import Any, NamedTuple

import tensorflow as tf

from hvd_qsgd.horovod_caller import traced_variable

log = logging.getLogger("hvd_qsgd")


class Raw(NamedTuple):
    """The context of an uncompressed floating-point tensor (sent as float64, with a leading axis)."""

    dtype: Any
    uncompressed = True   # (not counted as compressed: ``hvd_qsgd.QSGD.compress``)


def with_static_shape(tensor, owner):
    """``tensor`` (of a shape not fully defined) with its variable's shape where that is known and
    fits (checked when the step runs: ``tf.ensure_shape``); else ``tensor``, logged as going
    uncompressed."""
    variable = traced_variable()
    shape = getattr(variable, "shape", None)
    if shape is not None and shape.is_fully_defined() and tensor.shape.is_compatible_with(shape):
        return tf.ensure_shape(tensor, shape)
    log.warning("hvd_qsgd: %s: a %s tensor of shape %s, whose size is not known where the step is traced, goes "
                "uncompressed (Horovod's allreduce); give it a static shape (tf.ensure_shape, a tf.function "
                "without None in its input_signature, reduce_retracing=False) to have it compressed",
                owner, tensor.dtype.name, tensor.shape)
    return tensor


def send(run, tensor):
    """(what Horovod reduces, the context ``received`` takes) for an uncompressed tensor, counted in
    the compressor's statistics (``run``: its ``GraphRun``)."""
    n = tensor.shape.num_elements()
    if n is None:
        n = tf.size(tensor)
    with run.collecting() as counted:
        run.add(raw_elements=n, raw_tensors=1)
    with tf.control_dependencies(counted):
        if tensor.dtype.is_floating:
            return tf.expand_dims(tf.cast(tensor, tf.float64), 0), Raw(tensor.dtype)
        return tf.identity(tensor), None


def received(tensor, ctx: Raw):
    """The reduced tensor of ``send``'s, in its own shape and dtype."""
    return tf.cast(tf.squeeze(tensor, 0), ctx.dtype)
