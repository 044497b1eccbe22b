"""TensorFlow adapter: ``hvd_qsgd.tensorflow.QSGD``, a ``horovod.tensorflow.compression.Compressor``
built on the TensorFlow ops in ``hvd_qsgd/tensorflow/qsgd_ops.cc``."""
from hvd_qsgd.tensorflow.compressor import QSGD  # noqa: F401
