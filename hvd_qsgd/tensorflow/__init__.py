"""``hvd_qsgd.tensorflow``: what TensorFlow users import. The compressor ``QSGD`` (the TensorFlow
adapter, ``hvd_qsgd.adapters.tensorflow``, a ``horovod.tensorflow.compression.Compressor`` built on
the TensorFlow ops in ``hvd_qsgd/tensorflow/qsgd_ops.cc``) and ``tf_variables``."""
from typing import Any, Iterable, List

from hvd_qsgd.adapters.tensorflow import QSGD  # noqa: F401


def tf_variables(variables: Iterable[Any]) -> List[Any]:
    """The ``tf.Variable`` behind each Keras 3 variable (others are returned as they are).

    Horovod 0.28.1's ``DistributedGradientTape.gradient`` keys sources by ``Variable.ref()``, which
    Keras 3 variables lack; ``tape.gradient(loss, tf_variables(model.trainable_variables))`` gives
    it the TensorFlow variables the Keras 3 model reads, and the gradients apply to the Keras 3
    variables unchanged (same order)."""
    out = []
    for v in variables:
        inner = getattr(v, "value", None) if not hasattr(v, "ref") else None
        out.append(inner if inner is not None and hasattr(inner, "ref") else v)
    return out
