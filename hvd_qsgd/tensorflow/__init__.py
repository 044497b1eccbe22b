"""``hvd_qsgd.tensorflow``: what TensorFlow users import. The compressor ``QSGD`` (the TensorFlow
adapter, ``hvd_qsgd.adapters.tensorflow``, a ``horovod.tensorflow.compression.Compressor`` built on
the TensorFlow ops in ``hvd_qsgd/tensorflow/qsgd_ops.cc``); ``DistributedGradientTape`` (Horovod's
tape, taking Keras 3 variables too) and ``tf_variables`` (``hvd_qsgd.tensorflow.tape``). Keras 3
``model.fit``: ``hvd_qsgd.tensorflow.keras`` (``DistributedOptimizer``, ``BroadcastInitialState``,
``MetricAverage``), imported on its own; elastic training: ``hvd_qsgd.tensorflow.elastic``."""
from hvd_qsgd.adapters.tensorflow import QSGD  # noqa: F401
from hvd_qsgd.tensorflow.tape import DistributedGradientTape, tf_variables  # noqa: F401
