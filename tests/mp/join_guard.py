"""Worker for tests/test_torch_compressor.py's join guard, at 7 ranks under horovodrun.

Horovod 0.28.1's coordinator writes past a buffer for a collective first negotiated after a join
where a joined rank's number is below a stepping one's (``hvd_qsgd.exchange.joined``): from 7 ranks
up the job crashed (``free(): invalid pointer``) or its memory was corrupted. Two scenarios, each
printing ``OK <scenario>`` on every rank:

* ``low-joins``: rank 0 joins after one step, the others take two: the second step is refused on
  every stepping rank (MismatchError naming Horovod's buffer), which then join too; no crash.
* ``high-joins``: the last rank joins after one step: every write is in bounds, the joined step runs
  (Horovod's joined result, replicas identical on the stepping ranks).
* ``buffered-low-joins``, ``buffered-high-joins``: the same with a fusion buffer (``fusion_mb``),
  which closes at the first decompress and makes no presence allreduce while every rank steps: its
  presence allreduce in the joined step was new since the join, and corrupted the coordinator's
  memory (a segmentation fault in the next scenario).
"""
import sys

import torch
import torch.nn as nn
import horovod.torch as hvd

import hvd_qsgd
from hvd_qsgd.protocol import MismatchError


def scenario(name, early, **settings):
    rank, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = nn.Linear(200, 100, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=hvd_qsgd.QSGD(4, seed=3, **settings))
    refused = []
    for step in range(1 if rank == early else 2):
        opt.zero_grad()
        model(torch.randn(8, 200, generator=torch.Generator().manual_seed(10 * step + rank))).pow(2).mean().backward()
        try:
            opt.step()
        except MismatchError as e:
            refused.append(str(e))
    hvd.join()
    flags = hvd.allgather(torch.tensor([float(len(refused))]), name=f"{name}.refused")
    if early == 0:   # (rank 0 joined)
        assert flags.tolist() == [0.0] + [1.0] * (n - 1), flags.tolist()
        if rank:
            assert "writes past a buffer on its coordinator" in refused[0], refused
            assert "1 rank(s) of the process set of 7 have joined" in refused[0], refused
    else:
        assert flags.sum().item() == 0, flags.tolist()
        w = hvd.allgather(model.weight.detach().reshape(1, -1), name=f"{name}.weights")
        assert all(torch.equal(w[0], w[r]) for r in range(n - 1)), "stepping replicas differ"
    print(f"OK {name}", flush=True)


def main():
    hvd.init()
    for name in sys.argv[1:]:
        joins = name.rsplit("-", 2)[-2]
        scenario(name, {"low": 0, "high": hvd.size() - 1}[joins], **({"fusion_mb": 1} if "buffered" in name else {}))


if __name__ == "__main__":
    main()
