"""QSGD allreduce over mpi4py, on NumPy arrays: no Horovod and no framework needed.

    from mpi4py import MPI
    from hvd_qsgd.mpi import QSGDReducer
    reducer = QSGDReducer(MPI.COMM_WORLD, bits=4, reduction="scatter_allgather")
    average = reducer.allreduce(grad, name="layer1.weight")          # op="average" or "sum"

The reductions are the ones the Horovod adapters run, through the same exchange
(``hvd_qsgd.exchange``: its chains of stages and the CPU backend), with the same payloads and seeds:
the payload seed is ``payload_seed(seed, r, exchange, i)`` with exchange = ``hvd_qsgd.mpi.<name>``
and i the number of earlier calls with that name on this reducer. The collectives are mpi4py's
(``MpiCollectives``), which block; each learns the counts it needs from the ranks (an allgather of
the lengths, an alltoall of the splits), so variable-length Elias payloads need no padding.

MPI collectives are matched by call order, not by name, so before every exchange the ranks
allgather a small record (reduction, element count, fingerprint of name/shape/dtype, settings): every
rank checks the same records and raises the same ``MismatchError`` before any payload moves. Then
the exchange's stages run in order (``ExchangeRunner.run_in_order``: no presence or control vector,
no ``hvd.join``). Tensors of fewer than ``min_numel`` elements, and dtypes QSGD does not encode, go
through ``Allreduce`` uncompressed.
"""
import inspect
from typing import Any

import numpy as np

from hvd_qsgd import codec, protocol
from hvd_qsgd.exchange.collectives import BlockingCollectives
from hvd_qsgd.exchange.hierarchical import ranks_per_node_override
from hvd_qsgd.exchange.runner import ExchangeRunner
from hvd_qsgd.policy import FixedBits
from hvd_qsgd.settings import Settings
from hvd_qsgd.state import Route

_REDUCTION_CODES = {"allgather": 1, "scatter_allgather": 2, "hierarchical": 3}
_FLOATS = ("float32", "float16", "bfloat16")


class MpiCollectives(BlockingCollectives):
    """mpi4py's collectives on NumPy arrays over a communicator (the exchange's group)."""

    def run_allreduce(self, array, comm):
        from mpi4py import MPI
        out = np.empty_like(array)
        comm.Allreduce(np.ascontiguousarray(array), out, op=MPI.SUM)
        return out

    def run_allgather(self, array, comm):
        counts = [int(v) for v in comm.allgather(int(array.size))]
        gathered = np.empty(sum(counts), dtype=array.dtype)
        comm.Allgatherv(np.ascontiguousarray(array), [gathered, (counts, _offsets(counts))])
        return gathered

    def run_alltoall(self, array, splits, comm):
        received_splits = [int(v) for v in comm.alltoall(splits)]
        received = np.empty(sum(received_splits), dtype=array.dtype)
        # displacements given: mpi4py's own for counts with zeros in them do not place the pieces
        comm.Alltoallv([np.ascontiguousarray(array), (splits, _offsets(splits))],
                       [received, (received_splits, _offsets(received_splits))])
        return received, received_splits


def _offsets(counts):
    return [int(v) for v in np.cumsum([0] + list(counts[:-1]))]


class QSGDReducer:
    """QSGD allreduce of NumPy arrays among the ranks of an mpi4py communicator.

    ``comm``: the communicator (default ``MPI.COMM_WORLD``; the first allreduce learns which of its
    ranks share a node); then the settings of ``hvd_qsgd.QSGD``
    (``hvd_qsgd.settings.Settings.make``) by name; the reducer keeps no error feedback.
    ``stats`` counts like the Horovod adapters (``hvd_qsgd.settings.Stats``)."""

    def __init__(self, comm: Any = None, *args: Any, **settings: Any):
        if args or isinstance(comm, (bool, int, float, str, np.number)):
            raise TypeError(f"hvd_qsgd.mpi.QSGDReducer(comm=None, **settings): the first argument is the mpi4py "
                            f"communicator and the settings go by name (QSGDReducer(comm, bits=4, ...)), got "
                            f"{', '.join(map(repr, (comm,) + args))} positionally")
        self.settings = Settings.from_arguments("hvd_qsgd.mpi.QSGDReducer", (), settings)
        if self.settings.error_feedback or self.settings.server_error_feedback:
            raise ValueError("hvd_qsgd.mpi.QSGDReducer keeps no error feedback: pass error_feedback=False and "
                             "server_error_feedback=False (the Horovod compressors have it)")
        for name, off in (("fusion", False), ("overlap", False), ("fusion_mb", 0), ("join", True)):
            if getattr(self.settings, name) != off:
                raise ValueError(f"hvd_qsgd.mpi.QSGDReducer reduces one array a call, in call order: "
                                 f"{name}={getattr(self.settings, name)!r} (a Horovod compressor's) has nothing to "
                                 f"act on here; pass {name}={off}")
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        self.comm = comm
        self.collectives = MpiCollectives()
        self.runner = ExchangeRunner(self.collectives, 0, self.settings, FixedBits(self.settings), owner=repr(self))
        self.collectives.stats = self.runner.stats   # (the seconds its collectives block: wait_s)
        self._occurrences = {}
        self._node_size = None   # learnt by the first allreduce (a collective)

    def __repr__(self):
        return f"hvd_qsgd.mpi.QSGDReducer({self.settings})"

    @property
    def stats(self):
        return self.runner.stats.as_dict()

    def allreduce(self, x, name, op="average"):
        """The average (or sum) of ``x`` over the ranks, every rank bit-identical; same shape and dtype
        (an integer average: the sum times 1/n truncated toward zero, as Horovod's)."""
        x = np.asarray(x)
        if self._node_size is None:  # every rank's first exchange, whatever its tensor: the same call
            self._node_size = self._learn_node_size()
        if op not in ("average", "sum"):   # (after the other ranks' records: an op of one rank raises on all)
            self._agree(name, x, "raw", op)
            raise ValueError(f"hvd_qsgd.mpi: op must be 'average' or 'sum', got {op!r}")
        comm, s, n = self.comm, self.settings, self.comm.Get_size()
        alpha = 1.0 / n if op == "average" else 1.0
        if x.dtype.name not in _FLOATS or x.size < s.min_numel:
            self.runner.stats.add(raw_elements=x.size, raw_tensors=1)
            self._agree(name, x, "raw", op)
            out = self.collectives.run_allreduce(x, comm)
            if op != "average":
                return out
            # integers: the sum times 1/n, truncated toward zero, as Horovod scales an integer Average
            return out / n if np.issubdtype(x.dtype, np.floating) else (out * (1.0 / n)).astype(x.dtype)
        rank = comm.Get_rank()
        exchange = f"hvd_qsgd.mpi.{name}"
        occurrence = self._occurrences.get(name, 0)
        self._occurrences[name] = occurrence + 1
        ex = self.runner.open(name, x.size, x.dtype.name, x.shape, "cpu", comm, list(range(n)), rank, n,
                              route=Route(exchange, exchange, occurrence, 0, name, name, None),
                              where=f"hvd_qsgd.mpi: tensor {name!r}", ranks_per_node=self._ranks_per_node())
        self._agree(name, x, ex.tag_reduction(), op)
        if ex.fault is not None:  # alike on every rank: the layout agreed
            raise ex.fault
        self.runner.encode(ex, np.ascontiguousarray(x, dtype=np.float32).reshape(-1))
        out = self.runner.run_in_order(ex, alpha)
        return out.reshape(x.shape).astype(x.dtype, copy=False)

    def _ranks_per_node(self):
        """``HVD_QSGD_RANKS_PER_NODE``, else the ranks of this communicator sharing this rank's node,
        where they are consecutive (0, an error, where they are not)."""
        override = ranks_per_node_override()
        return self._node_size if override is None else override

    def _learn_node_size(self):
        """The ranks sharing this rank's node, where they are consecutive (else 0)."""
        from mpi4py import MPI
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        size, local = node.Get_size(), node.Get_rank()
        node.Free()
        return size if local == self.comm.Get_rank() % size else 0

    def _agree(self, name, x, red, op):
        """Allgather every rank's record of this exchange; raise on every rank if they differ."""
        s = self.settings
        head = (_REDUCTION_CODES.get(red.split("/")[0], 0), int(x.size), codec.tensor_fingerprint(name, x.shape, x.dtype.name),
                s.tag(red), op)
        records = self.comm.allgather(head)
        if any(rec != records[0] for rec in records):   # (named against the most ranks alike; ties: rank 0's)
            alike = max(([r for r, rec in enumerate(records) if rec == one] for one in records), key=len)
            base = records[alike[0]]
            differ = [r for r, rec in enumerate(records) if rec != base]
            what = ("tensor (name, shape or dtype)" if any(rec[2] != base[2] for rec in records) else
                    f"op (rank {alike[0]}: {base[4]!r}, rank {differ[0]}: {records[differ[0]][4]!r})"
                    if any(rec[4] != base[4] for rec in records) else "compressor settings or reduction")
            raise protocol.MismatchError(
                f"hvd_qsgd.mpi: tensor {name!r}: ranks {differ} disagree with ranks {alike} on the {what}: every "
                "rank must reduce the same tensors in the same order with the same settings")


QSGDReducer.__signature__ = inspect.Signature(
    [inspect.Parameter("comm", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in Settings.signature().parameters.values()])
