"""Worker for tests/test_elastic.py: elastic Horovod training of the digits MLP with
``hvd_qsgd.QSGD(4, error_feedback=True, named_parameters=...)`` and
``hvd_qsgd.torch.elastic.TorchState``, under ``horovodrun --host-discovery-script
tests/mp/discover_hosts.sh`` (localhost: ranks 0 and 1; 127.0.0.1: rank 2).

The run, in steps (``state.step``; ``state.commit()`` every --commit-every steps):

* step --kill-step: the worker on 127.0.0.1 SIGKILLs itself in its backward pass (a hook on
  fc1.weight's gradient, after fc2.weight's exchange started). The survivors' step fails with
  HorovodInternalError; they roll back to the last commit, Horovod blacklists 127.0.0.1 and they
  go on as 2 ranks.
* Horovod lets 127.0.0.1 back once its cooldown (``--blacklist-cooldown-range``) is over: the
  survivors' next commit raises HostsUpdatedInterrupt, a new worker starts there, and every rank
  is synchronised from rank 0. If that has not happened by step --rejoin-step, the workers wait
  there, committing every 0.5 s (at most 30 s).
* the last step: every rank reports its parameter checksum and test accuracy.

Data: step t trains on a fixed global batch of 96 samples (a slice of epoch t // 14's permutation
of the training set, 14 steps an epoch); rank r of n takes the r-th of n equal slices of it, so the averaged gradient
is the global batch's whatever n is. The uncompressed trajectory thus depends neither on the world
size nor on the failure, and ``--reference PATH`` computes it in one process.

Every rank prints ``ELASTIC {json}`` lines, ``event`` one of: start (entering the training function,
after Horovod's state sync), commit, kill (the victim, just before dying), failed (a step raised
HorovodInternalError: the state the reset has to repair), reset (Horovod's reset callbacks, after
the compressor's reset and before the sync), waiting, final. ``start`` also gives ``init_s``, the
seconds from the first line of this file to the return of ``hvd.init()``. Each holds the rank, size, step, the
compressor's exchange counters, exchanges in flight, residuals (name: [shape, norm]), statistics and
``digest``: a hash of the creation index, the counters and the residuals' names and shapes.
"""
import time

STARTED = time.time()  # before the imports: how long a joining worker takes to reach hvd.init()

import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import torch
import torch.nn.functional as F

import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError

import hvd_qsgd
import hvd_qsgd.torch.elastic
from hvd_qsgd import codec

from elastic_common import (LR, MOMENTUM, SEED, digest, global_batch, parse_args,  # noqa: E402  (tests/mp/)
                            rank_slice, reporter, steps, write_reference)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
import digits_common  # noqa: E402  (examples/: the digits split and the parameter checksum)
from pytorch_digits import MLP  # noqa: E402

def load_data():
    (x_tr, y_tr), (x_te, y_te), _ = digits_common.load_data(0, 1)
    return (torch.from_numpy(x_tr), torch.from_numpy(y_tr)), (torch.from_numpy(x_te), torch.from_numpy(y_te))


def new_model():
    torch.manual_seed(SEED)  # the same on every rank and in the reference (the sync makes sure)
    return MLP()


@torch.no_grad()
def accuracy(model, data):
    x, y = data
    model.eval()
    acc = float((model(x).argmax(dim=1) == y).float().mean())
    model.train()
    return acc


def param_checksum(model):
    return f"{digits_common.checksum((n, p.detach().numpy()) for n, p in model.named_parameters()):016x}"


def reference(args):
    """The uncompressed run: the same global batches, in one process."""
    torch.set_num_threads(1)
    (x, y), test = load_data()
    per_epoch, total = steps(len(x), args.epochs)
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(total):
        idx = torch.from_numpy(global_batch(step, len(x), per_epoch))
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    write_reference(args, total, accuracy(model, test))


def snapshot(adapter):
    """The compressor's state on this rank (reads its internals: a test's view)."""
    with adapter._lock:
        residuals = {str(k): [list(v.shape), round(float(torch.as_tensor(v).norm()), 6)]
                     for k, v in sorted(adapter.residuals.residuals.items(), key=lambda kv: str(kv[0]))}
        pending, in_flight, scattering = adapter.names.pending, sorted(adapter.names.in_flight), len(adapter.driver)
    counters = adapter.exchange_counters()
    layout = [adapter._creation_index, counters["seq"], sorted(counters["occurrences"].items()),
              [(k, v[0]) for k, v in residuals.items()]]
    return dict(creation_index=adapter._creation_index, seq=counters["seq"], occurrences=counters["occurrences"],
                pending=pending, in_flight=in_flight, scattering=scattering, residuals=residuals,
                stats=adapter.stats,
                digest=digest(layout))


def main(args):
    hvd.init()  # first: a joining worker's peers wait for it in Gloo's rendezvous
    init_s = round(time.time() - STARTED, 2)
    torch.set_num_threads(1)
    codec.set_num_threads(1)
    host = os.environ.get("HOROVOD_HOSTNAME")
    (x, y), test = load_data()
    per_epoch, total = steps(len(x), args.epochs)

    model = new_model()
    compression = hvd_qsgd.QSGD(4, error_feedback=True, reduction=args.reduction, seed=SEED,
                                named_parameters=model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                   named_parameters=model.named_parameters(), compression=compression)
    state = hvd_qsgd.torch.elastic.TorchState(model=model, optimizer=opt, compression=compression, step=0)
    adapter = hvd_qsgd.torch.elastic.torch_adapter(compression)
    marker = os.path.join(args.out, "killed")

    report = reporter(hvd, host, state, lambda: snapshot(adapter))

    def kill(grad):
        open(marker, "w").close()
        report("kill")
        os.kill(os.getpid(), signal.SIGKILL)

    state.register_reset_callbacks([lambda: report("reset")])

    @hvd.elastic.run
    def train(state):
        report("start", init_s=init_s)
        while state.step < total:
            if state.step == args.rejoin_step and hvd.size() < args.max_ranks:
                report("waiting")
                for _ in range(60):  # until a commit raises HostsUpdatedInterrupt
                    time.sleep(0.5)
                    state.commit()
            idx = torch.from_numpy(rank_slice(global_batch(state.step, len(x), per_epoch), hvd.rank(), hvd.size()))
            hook = None
            if state.step == args.kill_step and host == "127.0.0.1" and not os.path.exists(marker):
                hook = model.fc1.weight.register_hook(kill)
            try:
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
            except HorovodInternalError as e:
                report("failed", error=str(e)[:120])
                raise
            finally:
                if hook is not None:
                    hook.remove()
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()
                report("commit")

    train(state)
    report("final", checksum=param_checksum(model), test_accuracy=accuracy(model, test))


if __name__ == "__main__":
    a = parse_args(__doc__.split("\n\n")[0])
    reference(a) if a.reference else main(a)
