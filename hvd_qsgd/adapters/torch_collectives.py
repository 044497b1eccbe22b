"""The exchange's collectives (``hvd_qsgd.exchange.collectives``) over ``horovod.torch``.

Arrays come in as the exchange's backend holds them and go back the same: a NumPy array travels as
a tensor sharing its memory and comes back as a NumPy array; a CUDA tensor travels as it is where
Horovod was built with NCCL, else through the host (Horovod's CPU collectives), and comes back on
its device.
"""
import numpy as np
import torch
import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from hvd_qsgd.exchange.collectives import Collectives


class _AsRow:
    """The context of an uncompressed float64 vector, which Horovod reduces with a leading axis of
    length 1 (``uncompressed``)."""

    uncompressed = True   # (not counted as compressed: ``hvd_qsgd.QSGD.compress``)

    def __repr__(self):
        return "hvd_qsgd: uncompressed float64 vector, sent as one row"


AS_ROW = _AsRow()


def uncompressed(tensor):
    """(what Horovod reduces, the context) for a tensor the compressor does not quantize: the tensor
    itself, but a float64 vector as a row (shape ``(1, n)``), so that it never has a control vector's
    shape (float64, one axis): where ranks disagree on a tensor (one rank's of 15 float64 elements,
    another's compressed), Horovod's shape check then fails on every rank, where the two were
    summed, silently (the TensorFlow adapter's ``uncompressed`` sends every floating tensor so)."""
    if tensor.dtype is torch.float64 and tensor.dim() == 1 and tensor.layout == torch.strided:
        return tensor.unsqueeze(0), AS_ROW
    return tensor, None


class _Handle:
    __slots__ = ("horovod", "like")

    def __init__(self, horovod, like):
        self.horovod, self.like = horovod, like


def _tensor(array):
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    if array.is_cuda and not hvd.nccl_built():
        return array.cpu()
    return array


def _back(result, like):
    if isinstance(like, np.ndarray):
        return result.numpy()
    return result if result.device == like.device else result.to(like.device)


class HorovodTorchCollectives(Collectives):
    """Horovod's asynchronous PyTorch collectives over a process set (the exchange's group)."""

    interrupts = (HorovodInternalError, HostsUpdatedInterrupt)

    def allreduce(self, array, name, group):
        return _Handle(hvd.allreduce_async(_tensor(array), op=hvd.Sum, name=name, process_set=group), array)

    def allgather(self, array, name, group):
        return _Handle(hvd.allgather_async(_tensor(array), name=name, process_set=group), array)

    def alltoall(self, array, splits, name, group):
        return _Handle(hvd.alltoall_async(_tensor(array), splits=torch.tensor(splits, dtype=torch.int32), name=name,
                                          process_set=group), array)

    def poll(self, handle):
        return hvd.poll(handle.horovod)

    def wait(self, handle):
        result = hvd.synchronize(handle.horovod)
        if isinstance(result, tuple):  # alltoall: (received, received splits)
            received, splits = result
            return _back(received, handle.like), [int(v) for v in splits]
        return _back(result, handle.like)
