"""Worker for tests/test_multirank.py: every rank encodes its own tensor, the payloads are exchanged
with an allgather (Horovod's torch allgather, or mpi4py's Allgatherv), and every rank decodes the
average, for each configuration in turn. Each rank saves what it sent, what it received and what it
computed, per configuration, under OUT_DIR/<bits>-<coding>/.

usage: exchange_payloads.py {horovod,mpi4py} OUT_DIR NUMEL BITS:CODING [BITS:CODING ...]
"""
import os
import sys

import numpy as np

from hvd_qsgd import codec


def rank_tensor(rank, numel):
    x = np.random.default_rng(100 + rank).standard_normal(numel).astype(np.float32) * (rank + 1)
    if rank % 2:
        x[::5] = 0  # ranks' Elias payloads then differ in length
    return x


def main():
    backend, out_dir, numel = sys.argv[1], sys.argv[2], int(sys.argv[3])
    configs = [(int(b), c) for b, c in (a.split(":") for a in sys.argv[4:])]
    if backend == "horovod":
        import horovod.torch as hvd
        import torch
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    else:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
    fp = codec.tensor_fingerprint("layer.weight", (numel,), "float32")
    for bits, coding in configs:
        payload = codec.encode(rank_tensor(rank, numel), bits=bits, coding=coding, bucket_size=512,
                               seed=rank + 1, fingerprint=fp)
        if backend == "horovod":
            gathered = hvd.allgather(torch.from_numpy(payload), name=f"qsgd.layer.weight.{bits}.{coding}").numpy()
        else:
            counts = np.array(comm.allgather(payload.size), dtype=np.int64)
            gathered = np.empty(int(counts.sum()), dtype=np.uint8)
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
            comm.Allgatherv(payload, [gathered, counts, displs, MPI.BYTE])
        payloads = codec.split_payloads(gathered, count=size)
        avg = codec.decode_sum(payloads, scale=1.0 / size)
        sub = os.path.join(out_dir, f"{bits}-{coding}")
        os.makedirs(sub, exist_ok=True)
        np.savez(os.path.join(sub, f"rank{rank}.npz"), sent=payload, gathered=gathered, avg=avg,
                 size=np.array(size))
    if backend == "horovod":
        hvd.shutdown()


if __name__ == "__main__":
    main()
