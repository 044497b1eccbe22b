"""Worker for tests/test_mpi_reduction.py (under plain mpirun): hvd_qsgd.mpi.QSGDReducer.

Every rank regenerates every rank's input from (seed, rank), so it can compute the single-process
reference itself: ``reduction.simulate`` for scatter_allgather, ``codec.decode_sum`` of independently
re-encoded payloads for allgather. Prints ``OK <scenario>`` or ``RAISED <type>: <message>``.
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hvd_qsgd import codec, cost_model, protocol, reduction
from hvd_qsgd.mpi import QSGDReducer
from tests import references

SEED = 11


def inputs(numel, n, dtype=np.float32, skew=False):
    out = []
    for r in range(n):
        x = np.random.default_rng(100 + r).standard_normal(numel).astype(np.float32)
        if skew:  # different magnitudes per rank: Elias payload lengths differ
            x *= np.linspace(0, 1, numel, dtype=np.float32) ** (r + 1)
        out.append(x.astype(dtype))
    return out


def reference(reducer, xs, name, occurrence, alpha):
    s, n = reducer.settings, len(xs)
    exchange = f"hvd_qsgd.mpi.{name}"
    fp = codec.tensor_fingerprint(name, xs[0].shape, xs[0].dtype.name)
    seeds = [protocol.payload_seed(s.seed, r, exchange, occurrence) for r in range(n)]
    if s.exchange_reduction(n, xs[0].size) == "scatter_allgather":
        out, sent, _ = reduction.simulate([x.astype(np.float32) for x in xs], s, seeds, alpha, fp, xs[0].dtype.name)
        return out, [sum(p.size for p in row) for row in sent]
    payloads = [codec.encode(x.astype(np.float32), s.bits, s.bucket_size, s.norm, seeds[r], s.coding, fp, s.checksum,
                             source_dtype=x.dtype.name) for r, x in enumerate(xs)]
    return codec.decode_sum(payloads, alpha), [p.size for p in payloads]


def numel_of_shard(numel, bucket_size, i, per_node=2):
    b, e = reduction.chunk_ranges(numel, bucket_size, per_node)[i]
    return e - b


def identical(comm, a):
    copies = comm.allgather(a.tobytes())
    assert all(c == copies[0] for c in copies), "ranks differ"


def scenario(comm, name):
    n, rank = comm.Get_size(), comm.Get_rank()
    if name in ("allgather", "scatter_allgather", "auto"):
        r = QSGDReducer(comm, bits=4, seed=SEED, reduction=name, min_numel=1)
        for i, (numel, op, dtype) in enumerate(((20000, "average", np.float32), (1000, "sum", np.float32),
                                                 (30000, "average", np.float16), (400000, "average", np.float32))):
            xs = inputs(numel, n, dtype)
            for occurrence in range(2):
                out = r.allreduce(xs[rank], f"t{i}", op=op)
                ref, _ = reference(r, xs, f"t{i}", occurrence, 1.0 / n if op == "average" else 1.0)
                assert out.dtype == dtype and out.shape == xs[rank].shape
                assert np.array_equal(out, ref.astype(dtype)), f"{name} t{i}: max diff {np.abs(out - ref).max()}"
                identical(comm, out)
        # counted as the Horovod adapters count: what an fp32 ring allreduce would have received, and
        # the seconds the blocking collectives took as waiting
        fp32 = sum(2 * cost_model.fp32_allreduce_bytes(n, numel) for numel in (20000, 1000, 30000, 400000))
        assert r.stats["allreduce_bytes"] == fp32 and r.stats["wait_s"] > 0, r.stats
        small = r.allreduce(np.arange(5, dtype=np.float64) * rank, "raw")   # float64: uncompressed
        assert np.array_equal(small, np.arange(5) * (n - 1) / 2)
        # integers go uncompressed; an Average is the sum times 1/n truncated toward zero, as Horovod's
        # (ranks hold r^2 - 5: at 3 and 4 ranks a negative sum that n does not divide, where truncating
        # and flooring differ)
        for dtype in (np.int32, np.int64):
            x = np.full(20000, rank * rank - 5, dtype)
            total = (n - 1) * n * (2 * n - 1) // 6 - 5 * n
            assert np.array_equal(r.allreduce(x, f"int-sum-{dtype.__name__}", op="sum"), np.full(20000, total))
            got = r.allreduce(x, f"int-average-{dtype.__name__}")
            assert got.dtype == dtype and np.array_equal(got, np.full(20000, np.trunc(total / n))), (got[:3], total, n)
    elif name.startswith("elias-"):
        red = name[len("elias-"):]
        r = QSGDReducer(comm, bits=4, seed=SEED, reduction=red, coding="elias")
        xs = inputs(50000, n, skew=True)
        out = r.allreduce(xs[rank], "e")
        ref, lengths = reference(r, xs, "e", 0, 1.0 / n)
        assert len(set(lengths)) == n, f"payload lengths per rank {lengths}"
        assert np.array_equal(out, ref)
        identical(comm, out)
    elif name == "hierarchical":
        # nodes of 2 consecutive ranks; odd lengths, shards of unequal size, a tensor of one bucket
        # (fewer buckets than the node has ranks: one shard is empty), half precision
        os.environ["HVD_QSGD_RANKS_PER_NODE"] = "2"
        r = QSGDReducer(comm, bits=4, seed=SEED, reduction="hierarchical", min_numel=1)
        for i, (numel, op, dtype) in enumerate(((20000, "average", np.float32), (1001, "sum", np.float32),
                                                 (300, "average", np.float32), (30001, "average", np.float16))):
            xs = inputs(numel, n, dtype)
            for occurrence in range(2):
                before = r.stats
                out = r.allreduce(xs[rank], f"h{i}", op=op)
                exchange = f"hvd_qsgd.mpi.h{i}"
                seeds = [protocol.payload_seed(r.settings.seed, q, exchange, occurrence) for q in range(n)]
                fp = codec.tensor_fingerprint(f"h{i}", xs[0].shape, xs[0].dtype.name)
                ref, sent = references.hierarchical(xs, r.settings, seeds, 2, 1.0 / n if op == "average" else 1.0,
                                                    fp, xs[0].dtype.name)
                assert out.dtype == dtype and out.shape == xs[rank].shape
                assert np.array_equal(out, ref.astype(dtype)), f"hierarchical h{i}: max diff {np.abs(out - ref).max()}"
                identical(comm, out)
                # what left this rank's node: its shard's payload, once to each other node
                cross = sent[rank % 2][rank // 2]
                inside = 4 * (numel - numel_of_shard(numel, r.settings.bucket_size, rank % 2))
                got = r.stats["bytes_sent"] - before["bytes_sent"]
                assert got == cross + inside + 4 * (numel_of_shard(numel, r.settings.bucket_size, rank % 2)), \
                    (got, cross, inside)
    elif name == "hierarchical-layouts-differ":
        os.environ["HVD_QSGD_RANKS_PER_NODE"] = "2" if rank else "1"
        try:
            QSGDReducer(comm, reduction="hierarchical").allreduce(inputs(20000, n)[rank], "w")
        except protocol.MismatchError as e:
            print(f"RAISED {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
            return
        print("NOT RAISED", flush=True)
        sys.exit(1)
    elif name.startswith("mismatch-"):
        kind = name[len("mismatch-"):]
        try:
            if kind == "bits":
                QSGDReducer(comm, bits=8 if rank == 1 else 4).allreduce(inputs(20000, n)[rank], "w")
            elif kind == "reduction":
                QSGDReducer(comm, reduction="scatter_allgather" if rank == 1 else "allgather").allreduce(
                    inputs(20000, n)[rank], "w")
            elif kind == "name":
                QSGDReducer(comm).allreduce(inputs(20000, n)[rank], "w" if rank else "v")
            elif kind in ("op", "op-raw"):   # (each rank scaled its own result: they differed, silently)
                numel = 20000 if kind == "op" else 100
                QSGDReducer(comm).allreduce(inputs(numel, n)[rank], "w", op="sum" if rank == 1 else "average")
            elif kind == "op-invalid":   # (rank 1's op is refused on every rank, after the records' allgather)
                QSGDReducer(comm).allreduce(inputs(20000, n)[rank], "w", op="max" if rank == 1 else "average")
        except protocol.MismatchError as e:
            print(f"RAISED {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
            return
        print("NOT RAISED", flush=True)
        sys.exit(1)
    else:
        raise SystemExit(f"unknown scenario {name}")
    print(f"OK {name}", flush=True)


if __name__ == "__main__":
    for s in sys.argv[1:]:
        scenario(MPI.COMM_WORLD, s)
