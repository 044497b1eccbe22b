"""PyTorch adapter: ``hvd_qsgd.torch.QSGD``, a ``horovod.torch.compression.Compressor``."""
from hvd_qsgd.torch.compressor import QSGD  # noqa: F401
