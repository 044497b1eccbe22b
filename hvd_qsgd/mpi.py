"""QSGD allreduce over mpi4py, on NumPy arrays: no Horovod and no framework needed.

    from mpi4py import MPI
    from hvd_qsgd.mpi import QSGDReducer
    reducer = QSGDReducer(MPI.COMM_WORLD, bits=4, reduction="scatter_allgather")
    average = reducer.allreduce(grad, name="layer1.weight")          # op="average" or "sum"

The reductions are the ones the Horovod adapters run, with the same payloads and seeds:

    allgather:          p_r = encode(g_r, seed payload_seed(seed, r, exchange, i));
                        Allgatherv of the payloads; result = alpha * decode_sum(p_0 .. p_{n-1})
    scatter_allgather:  hvd_qsgd.reduction: encode_chunks -> Alltoallv -> reduce_chunk ->
                        Allgatherv of the reduced chunks -> decode_chunks

with exchange = ``hvd_qsgd.mpi.<name>`` and i the number of earlier calls with that name on this
reducer. MPI collectives are matched by call order, not by name, so before every exchange the ranks
allgather a small record (reduction, element count, fingerprint of name/shape/dtype, settings,
payload lengths): every rank checks the same records and raises the same ``MismatchError`` before any
payload moves, and the payload collectives get their counts from it (variable-length Elias payloads
need no padding). Tensors of fewer than ``min_numel`` elements, and dtypes QSGD does not encode, go
through ``Allreduce`` uncompressed.
"""
import inspect
from types import SimpleNamespace
from typing import Any

import numpy as np

from hvd_qsgd import codec, protocol, reduction as chunks
from hvd_qsgd.settings import Settings, Stats

_REDUCTION_CODES = {"allgather": 1, "scatter_allgather": 2}
_FLOATS = ("float32", "float16", "bfloat16")


class QSGDReducer:
    """QSGD allreduce of NumPy arrays among the ranks of an mpi4py communicator.

    ``comm``: the communicator (default ``MPI.COMM_WORLD``); then the settings of ``hvd_qsgd.QSGD``
    (``hvd_qsgd.settings.Settings.make``) by name; the reducer keeps no error feedback.
    ``stats`` counts like the Horovod adapters (``hvd_qsgd.settings.Stats``)."""

    def __init__(self, comm: Any = None, **settings: Any):
        self.settings = Settings.from_arguments("hvd_qsgd.mpi.QSGDReducer", (), settings)
        if self.settings.error_feedback or self.settings.server_error_feedback:
            raise ValueError("hvd_qsgd.mpi.QSGDReducer keeps no error feedback: pass error_feedback=False and "
                             "server_error_feedback=False (the Horovod compressors have it)")
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        self.comm = comm
        self._stats = Stats()
        self._occurrences = {}

    @property
    def stats(self):
        return self._stats.as_dict()

    def allreduce(self, x, name, op="average"):
        """The average (or sum) of ``x`` over the ranks, every rank bit-identical; same shape and dtype."""
        from mpi4py import MPI
        if op not in ("average", "sum"):
            raise ValueError(f"hvd_qsgd.mpi: op must be 'average' or 'sum', got {op!r}")
        x = np.asarray(x)
        comm, s, n = self.comm, self.settings, self.comm.Get_size()
        alpha = 1.0 / n if op == "average" else 1.0
        if x.dtype.name not in _FLOATS or x.size < s.min_numel:
            self._stats.add(raw_elements=x.size, raw_tensors=1)
            self._agree(name, x, "raw", [])
            out = np.empty_like(x)
            comm.Allreduce(np.ascontiguousarray(x), out, op=MPI.SUM)
            return out / n if op == "average" and np.issubdtype(x.dtype, np.floating) else out
        rank = comm.Get_rank()
        exchange = f"hvd_qsgd.mpi.{name}"
        occurrence = self._occurrences.get(name, 0)
        self._occurrences[name] = occurrence + 1
        step_seed = protocol.payload_seed(s.seed, rank, exchange, occurrence)
        where = f"hvd_qsgd.mpi: tensor {name!r}"
        fingerprint = codec.tensor_fingerprint(name, x.shape, x.dtype.name)
        x32 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        red = s.exchange_reduction(n, x.size)
        if red == "scatter_allgather":
            buf, lens = chunks.encode_chunks(x32, s, step_seed, n, fingerprint, x.dtype.name, where)
        else:
            buf = codec.encode(x32, s.bits, s.bucket_size, s.norm, step_seed, s.coding, fingerprint, s.checksum,
                               name=where, source_dtype=x.dtype.name)
            lens = [buf.size]
        records = self._agree(name, x, red, lens)
        expect = SimpleNamespace(bits=s.bits, bucket_size=s.bucket_size, norm=s.norm, coding=s.coding,
                                 numel=x.size, dtype=x.dtype.name, fingerprint=fingerprint)
        if red == "allgather":
            counts = [int(r[-1]) for r in records]
            gathered = np.empty(sum(counts), dtype=np.uint8)
            comm.Allgatherv(buf, [gathered, counts])
            payloads = chunks.split_by(gathered, counts)
            protocol.check_payloads(payloads, expect, where)
            out = codec.decode_sum(payloads, alpha, where=where)
            self._stats.add(elements=x.size, bytes_sent=buf.size, tensors=1, bytes_received=gathered.size - buf.size)
        else:
            out = self._scatter_allgather(buf, lens, records, expect, step_seed, alpha, where)
        return out.reshape(x.shape).astype(x.dtype, copy=False)

    def _scatter_allgather(self, buf, lens, records, expect, step_seed, alpha, where):
        comm, s, n, j = self.comm, self.settings, self.comm.Get_size(), self.comm.Get_rank()
        numel = expect.numel
        recv_counts = [int(r[-n + j]) for r in records]          # what rank r sends to this rank
        received = np.empty(sum(recv_counts), dtype=np.uint8)
        comm.Alltoallv([buf, lens], [received, recv_counts])
        mine = chunks.split_by(received, recv_counts)
        try:
            chunks.check_chunk(mine, j, expect, where)
            q = chunks.reduce_chunk(mine, j, s, step_seed, expect.fingerprint, expect.dtype, where)
            error = None
        except Exception as exc:  # every rank sees the empty slot below and raises
            q, error = np.zeros(0, dtype=np.uint8), exc
        q_counts = [int(v) for v in comm.allgather(int(q.size))]
        gathered = np.empty(sum(q_counts), dtype=np.uint8)
        comm.Allgatherv(q, [gathered, q_counts])
        if error is not None:
            raise protocol.MismatchError(f"{where}: this rank could not reduce chunk {j}: {error}") from error
        out = chunks.decode_chunks(chunks.split_by(gathered, q_counts), alpha, numel, s.bucket_size,
                                   where=f"{where}: reduced chunks")
        self._stats.add(elements=numel, tensors=1, bytes_sent=sum(lens) - lens[j] + q.size,
                        bytes_received=received.size - recv_counts[j] + gathered.size - q.size)
        return out

    def _agree(self, name, x, red, lens):
        """Allgather every rank's record of this exchange; raise on every rank if they differ."""
        s = self.settings
        head = (_REDUCTION_CODES.get(red, 0), int(x.size), codec.tensor_fingerprint(name, x.shape, x.dtype.name),
                s.tag(red))
        records = self.comm.allgather(head + tuple(int(v) for v in lens))
        differ = [r for r, rec in enumerate(records) if rec[:4] != records[0][:4]]
        if differ:
            what = ("tensor (name, shape or dtype)" if any(rec[2] != records[0][2] for rec in records) else
                    "compressor settings or reduction")
            raise protocol.MismatchError(
                f"hvd_qsgd.mpi: tensor {name!r}: ranks {differ} disagree with rank 0 on the {what}: every rank "
                "must reduce the same tensors in the same order with the same settings")
        return records


QSGDReducer.__signature__ = inspect.Signature(
    [inspect.Parameter("comm", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in Settings.signature().parameters.values()])
