"""How many threads the CPU kernels of a rank use when several ranks share a node.

The CPU kernels run OpenMP loops over as many threads as OpenMP offers, by default every core of the
machine. Horovod starts one rank per GPU or per socket, several on a node, and each rank's kernels
would then run one thread per core of the whole node: the ranks' threads outnumber the cores, and a
parallel loop waits for its slowest thread, descheduled behind another rank's. Measured on 2 cores
with 2 ranks (docs/performance.md, "Per-tensor cost"): a step of 64 gradients in fusion buffers took
62 ms with each rank's kernels on 2 threads, 43 ms on 1.

So at its first exchange the PyTorch compressor calls ``share_cores`` with the ranks on its node
(Horovod's ``local_size``), once per process. The threads are, in this order:

* ``HVD_QSGD_NUM_THREADS``, where set (a positive integer; anything else is an error);
* left as they are where the user chose them: ``OMP_NUM_THREADS`` set, or ``codec.set_num_threads``
  called;
* the cores this rank may run on, where its launcher bound it to fewer than the machine has (the
  binding already shares the node);
* else the machine's cores divided among the node's ranks, at least 1.

The choice is logged once (INFO, logger ``hvd_qsgd``).
"""
import logging
import os
import threading
from typing import Callable, Optional

from hvd_qsgd import codec

ENV = "HVD_QSGD_NUM_THREADS"
log = logging.getLogger("hvd_qsgd")
_lock = threading.Lock()
_done = False


def threads_for(local_ranks: int, env=os.environ, cores: Optional[int] = None,
                usable: Optional[int] = None) -> Optional[int]:
    """The CPU kernels' threads for a rank with ``local_ranks`` ranks on its node (see the module
    docstring), or None to leave them as chosen. ``cores``: the machine's; ``usable``: this rank's."""
    given = env.get(ENV)
    if given is not None:
        if not given.strip().isdigit() or int(given) < 1:
            raise ValueError(f"{ENV} must be a positive integer (threads of this rank's CPU kernels), got {given!r}")
        return int(given)
    if env.get("OMP_NUM_THREADS") or codec._threads_chosen:
        return None
    cores = (os.cpu_count() or 1) if cores is None else cores
    usable = len(os.sched_getaffinity(0)) if usable is None and hasattr(os, "sched_getaffinity") else usable or cores
    if usable < cores:
        return max(1, usable)
    return max(1, cores // max(1, int(local_ranks)))


def share_cores(local_ranks: Callable[[], int]) -> None:
    """Set the CPU kernels' threads for the ranks on this node (``local_ranks()``, asked once), once
    per process (a malformed ``HVD_QSGD_NUM_THREADS`` raises at every call)."""
    global _done
    if _done:
        return
    local_ranks = local_ranks()
    threads = threads_for(local_ranks)
    with _lock:
        if _done:
            return
        _done = True
    if threads is not None:
        codec.set_num_threads(threads)
        log.info("hvd_qsgd: %d rank(s) on this node: the CPU kernels of this rank use %d thread(s) (%s to choose)",
                 local_ranks, threads, ENV)
