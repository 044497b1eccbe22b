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
