"""``hvd_qsgd.torch``: what PyTorch users import. The compressor ``QSGD`` (the PyTorch adapter,
``hvd_qsgd.adapters.torch``, a ``horovod.torch.compression.Compressor``) and the optimizers of the
algorithms built on it: ``EFSGDM`` (dist-EF-SGDM) and ``PeriodicQuantizedAveraging`` (PQASGD);
``hvd_qsgd.torch.elastic`` carries compressors through Horovod's elastic training."""
from hvd_qsgd.adapters.torch import TorchCompressor as QSGD  # noqa: F401  (the public name)
from hvd_qsgd.policy import ScheduledBits
from hvd_qsgd.settings import Settings
from hvd_qsgd.torch.ef_sgdm import EFSGDM  # noqa: F401
from hvd_qsgd.torch.periodic import PeriodicQuantizedAveraging  # noqa: F401


def DynamicQSGD(*args, schedule_args, fixed_bucket_size=None, **kwargs):
    """The PyTorch adapter with DQSGD's bits policy (``hvd_qsgd.DynamicQSGD`` makes it for you):
    the settings as for ``QSGD``, the ``Schedule``'s arguments, and the bucket size of every bit
    width (None: the paper's per bit width)."""
    settings = kwargs.pop("settings", None)
    if settings is None:
        settings = Settings.from_arguments("hvd_qsgd.torch.DynamicQSGD", args, {
            k: kwargs.pop(k) for k in list(kwargs) if k in Settings.signature().parameters})
    return QSGD(settings=settings, policy=ScheduledBits(settings, schedule_args, fixed_bucket_size), **kwargs)
