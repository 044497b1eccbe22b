"""``hvd_qsgd.tensorflow.ops``: the codec's TensorFlow ops (``hvd_qsgd._tf_ops``, the binding below the
adapters; this name is kept for callers of the op module)."""
from hvd_qsgd._tf_ops import as_int64_attr, load  # noqa: F401
