"""The collectives an exchange runs, behind one small interface each communication library
implements (``hvd_qsgd.adapters.torch_collectives`` over ``horovod.torch``; ``hvd_qsgd.mpi`` over
mpi4py).

Arrays go in as the exchange's backend holds them (NumPy arrays for the CPU backend, CUDA tensors
for the CUDA backend) and come back of the same kind: whatever a library needs on the way (a tensor
wrapped around a NumPy array, a device tensor through the host where the library cannot carry it)
is the implementation's business. Every collective is started over a ``group`` (a Horovod process
set, a communicator: opaque to the exchange) under a ``name`` every rank of the group derives
alike, returns a handle at once, and completes in the background:

    allreduce(array, name, group)           -> handle    sum over the group's ranks
    allgather(array, name, group)           -> handle    the ranks' arrays back to back, in rank order
    alltoall(array, splits, name, group)    -> handle    splits[j] elements go to rank j;
                                                          wait gives (received, received splits)
    poll(handle)                            -> bool      whether it has completed (never blocks)
    wait(handle)                            -> result    blocks until it has completed

``interrupts`` names the library's exceptions that must reach the caller unchanged (an elastic
run resets on them: Horovod's ``HorovodInternalError`` and ``HostsUpdatedInterrupt``).
"""
import time
from typing import Any, List, Sequence, Tuple


class Collectives:
    """The interface (see the module docstring); implementations override every method."""

    interrupts: Tuple[type, ...] = ()

    def allreduce(self, array: Any, name: str, group: Any) -> Any:
        raise NotImplementedError

    def allgather(self, array: Any, name: str, group: Any) -> Any:
        raise NotImplementedError

    def alltoall(self, array: Any, splits: Sequence[int], name: str, group: Any) -> Any:
        raise NotImplementedError

    def poll(self, handle: Any) -> bool:
        raise NotImplementedError

    def wait(self, handle: Any) -> Any:
        raise NotImplementedError


class Done:
    """The handle of a collective that completed when it was started (a blocking library)."""

    __slots__ = ("result",)

    def __init__(self, result: Any):
        self.result = result


class BlockingCollectives(Collectives):
    """A library whose collectives block: each runs when started and its handle is ``Done``.
    Subclasses implement ``run_allreduce``, ``run_allgather`` and ``run_alltoall`` (the latter
    returning (received, received splits)). ``stats``, where set (a ``Stats``), counts the seconds
    they block in ``wait_s``, as waiting on a handle counts them elsewhere."""

    stats = None

    def _blocking(self, run, *args):
        t0 = time.perf_counter()
        out = run(*args)
        if self.stats is not None:
            self.stats.add(wait_s=time.perf_counter() - t0)
        return Done(out)

    def allreduce(self, array, name, group):
        return self._blocking(self.run_allreduce, array, group)

    def allgather(self, array, name, group):
        return self._blocking(self.run_allgather, array, group)

    def alltoall(self, array, splits, name, group):
        return self._blocking(self.run_alltoall, array, [int(v) for v in splits], group)

    def poll(self, handle):
        return True

    def wait(self, handle):
        return handle.result

    def run_allreduce(self, array: Any, group: Any) -> Any:
        raise NotImplementedError

    def run_allgather(self, array: Any, group: Any) -> Any:
        raise NotImplementedError

    def run_alltoall(self, array: Any, splits: List[int], group: Any) -> Tuple[Any, List[int]]:
        raise NotImplementedError
