"""PyTorch adapter: ``hvd_qsgd.torch.QSGD``, a ``horovod.torch.compression.Compressor``, and the
optimizers of the algorithms built on it: ``EFSGDM`` (dist-EF-SGDM) and
``PeriodicQuantizedAveraging`` (PQASGD)."""
from hvd_qsgd.torch.compressor import QSGD  # noqa: F401
from hvd_qsgd.torch.dynamic import DynamicQSGD  # noqa: F401
from hvd_qsgd.torch.ef_sgdm import EFSGDM  # noqa: F401
from hvd_qsgd.torch.periodic import PeriodicQuantizedAveraging  # noqa: F401
