"""hvd_qsgd: QSGD gradient compression for Horovod.

The codec (``hvd_qsgd.codec``) encodes a tensor into a self-describing payload of b-bit stochastic
levels scaled per bucket (QSGD, Alistarh et al., NeurIPS 2017) and decodes and sums many payloads
in one fused pass. Its kernels live in ``kernels/`` (CPU and CUDA, one C ABI); the framework
adapters are thin bindings on top.

``hvd_qsgd.QSGD(bits)`` is the compressor users pass to Horovod as ``compression=``; so are
``hvd_qsgd.DynamicQSGD`` (DQSGD: bits chosen per step under a budget) and ``hvd_qsgd.BlockSign``
(dist-EF-SGDM's blockwise scaled sign). ``hvd_qsgd.torch.EFSGDM`` (dist-EF-SGDM) and
``hvd_qsgd.torch.PeriodicQuantizedAveraging`` (PQASGD) are optimizers; ``hvd_qsgd.error_feedback``
states the error-feedback rules they share. docs/algorithms.md says what runs where;
docs/architecture.md how the package is layered. Every error about payloads and exchanges derives
from ``hvd_qsgd.Error``. ``hvd_qsgd.diagnose()`` (or ``python -m hvd_qsgd``) says what this installation
can do: kernels, CUDA, TensorFlow ops, Horovod's build, the reduction ``auto`` picks.
"""
__version__ = "0.1.0"

from hvd_qsgd.codec import (  # noqa: F401
    Header,
    decode,
    decode_sum,
    encode,
    levels,
    payload_nbytes,
    read_header,
    split_payloads,
)
from hvd_qsgd.errors import EncodeError, Error, MismatchError, PayloadError  # noqa: F401,E402
from hvd_qsgd.settings import Settings  # noqa: F401,E402
from hvd_qsgd.compressor import DynamicQSGD, QSGD  # noqa: F401,E402
from hvd_qsgd.block_sign import BlockSign  # noqa: F401,E402
from hvd_qsgd.install_check import diagnose  # noqa: F401,E402
