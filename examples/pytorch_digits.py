"""Data-parallel training of a small MLP on scikit-learn's digits with Horovod and QSGD compression.

Run under Horovod (Gloo or MPI controller alike), e.g.::

    horovodrun -np 4 --gloo -H localhost:4 .venv/bin/python examples/pytorch_digits.py \
        --compression qsgd --bits 4 --json /tmp/qsgd.json

With ``--method sgd`` (the default) the training loop is the stock Horovod one:
``hvd.DistributedOptimizer(opt, named_parameters=..., compression=...)`` averages the gradients over
all ranks, with

* ``none``: ``hvd.Compression.none`` (float32 allreduce);
* ``fp16``: ``hvd.Compression.fp16`` (float16 allreduce);
* ``qsgd``: ``hvd_qsgd.QSGD(bits, bucket_size=..., min_numel=..., error_feedback=...,
  named_parameters=...)``. Gradients with at least ``--min-numel`` elements (here fc1.weight, 32,768,
  and fc2.weight, 262,144) are quantized; every rank's payload travels by allgather and every rank
  decodes and sums all of them in rank order, so all ranks apply a bit-identical averaged gradient.
  Smaller gradients (the biases and fc3) go through Horovod's float32 allreduce. With
  ``--error-feedback`` the compressor also follows the optimizer's learning rate
  (``compression.follow_learning_rate(optimizer)``).

The other methods (``--method``) train the same model from the same start:

* ``dqsgd``: ``hvd.DistributedOptimizer`` with ``hvd_qsgd.DynamicQSGD(--budget-bits)`` (default 3.0
  bits per quantized coordinate on average; each step's bits follow the gradient norm);
* ``pqasgd``: ``hvd_qsgd.torch.PeriodicQuantizedAveraging`` over a plain momentum SGD: local steps,
  and every ``--period`` (default 4) steps the ranks average their model differences quantized with
  ``hvd_qsgd.QSGD(--bits)`` (default 2); ``--pqasgd-momentum local|average|reset``. If the run does
  not end on a sync, one more sync follows the last step, so the ranks end alike. The test accuracy
  during training is that of the last synchronized model (the same on every rank);
* ``efsgdm``: ``hvd_qsgd.torch.EFSGDM`` (dist-EF-SGDM: momentum, then the update compressed with
  ``hvd_qsgd.BlockSign(--block-size)``, default 512, by scatter_allgather with worker and server
  error feedback), in place of ``hvd.DistributedOptimizer``.

The model is a 64-512-512-10 MLP. The train/test split is fixed (stratified, 25% test, independent of
``--seed``); each rank trains on its own equal shard of the training set. Rank 0's initial parameters
and optimizer state are broadcast to all ranks (``hvd.broadcast_parameters``,
``hvd.broadcast_optimizer_state``); ranks initialise differently on purpose, so the broadcast is what
makes them start alike.

Rank 0 shows a progress bar (``--no-progress``: none) and prints, and with ``--json`` writes, the
test accuracy, the bytes this rank sends per step, the wall time of the training loop, and whether
all ranks end with bit-identical parameters (a checksum of the parameters gathered from every rank;
a mismatch is an error), and a curve: after every epoch the epoch, the step, the bytes rank 0 has
sent so far and the test accuracy (the JSON key ``curve``; ``bytes_sent_total`` is the last point's
bytes). Bytes sent per step is the size of this rank's own contribution to the gradient exchange:
``4 * numel`` of every gradient for ``none``, ``2 * numel`` for ``fp16``, and for ``qsgd`` (and the
other methods) the compressor's payload bytes plus ``4 * numel`` of the tensors it left
uncompressed, taken from ``compression.stats`` and divided by the number of steps (``pqasgd`` sends
at its syncs only, plus ``4 * numel`` a sync with ``--pqasgd-momentum average``, whose momentum
buffers are averaged in fp32; ``dqsgd``'s bits vary by step: for them it is a mean; ``efsgdm``
counts both phases of scatter_allgather). It is not link traffic: a ring allreduce moves about
2 (n - 1) / n times its input through each rank's link, an allgather about (n - 1) times each rank's
payload. The QSGD control vectors (a few float64 per compressed tensor, reduced by Horovod's
allreduce) are reported apart as ``control_bytes_per_step``.

The flags, the data split and shards, and the end-of-run reporting (bytes per step, summary line,
JSON results) are shared with the TensorFlow and Keras examples in ``examples/digits_common.py``.
"""
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd

import hvd_qsgd.torch
from hvd_qsgd import codec

import digits_common as common  # examples/digits_common.py: flags, data, reporting


def parse_args(argv=None):
    return common.parse_args(argv, __doc__.split("\n\n")[0],
                             "torch and codec threads per rank (default 1: ranks share few cores)",
                             methods=common.METHODS)


def load_data(rank, size):
    """The fixed split and this rank's shard (``digits_common.load_data``) as torch tensors."""
    (x_tr, y_tr), (x_te, y_te), n_train = common.load_data(rank, size)
    shard = (torch.from_numpy(x_tr), torch.from_numpy(y_tr))
    test = (torch.from_numpy(x_te), torch.from_numpy(y_te))
    return shard, test, n_train


class MLP(nn.Module):
    def __init__(self, n_in=64, hidden=512, n_out=10):
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, n_out)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def make_compression(args, model):
    # Gradients are matched by parameter name; PQASGD's model differences and EFSGDM's updates are
    # not any parameter's .grad: they are exchanged in their fixed order.
    named = {"named_parameters": model.named_parameters()} if args.method in ("sgd", "dqsgd") else {}
    return common.make_compression(args, hvd.Compression, **named)


def make_optimizer(args, model, compression):
    """The optimizer the loop steps, with rank 0's parameters (and optimizer state) on every rank."""
    named = list(model.named_parameters())
    if args.method == "efsgdm":
        opt = hvd_qsgd.torch.EFSGDM(named, lr=args.lr, momentum=args.momentum, compression=compression)
        # Its momentum buffers start empty on every rank; Horovod's broadcast_optimizer_state would
        # take a (compressed) step with zero gradients to create them.
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return opt
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    if args.method == "pqasgd":
        # It broadcasts rank 0's parameters and optimizer state itself.
        return hvd_qsgd.torch.PeriodicQuantizedAveraging(base, named, period=args.period, compression=compression,
                                                         momentum=args.pqasgd_momentum)
    if common.uses_compressor(args) and compression.settings.error_feedback:
        compression.follow_learning_rate(base)
    opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return opt


def method_info(args, opt):
    """The method's own settings for the JSON results."""
    if args.method == "dqsgd":
        return {"budget_bits_per_coord": args.budget_bits}
    if args.method == "pqasgd":
        return {"period": args.period, "pqasgd_momentum": args.pqasgd_momentum, "syncs": opt.syncs}
    if args.method == "efsgdm":
        return {"block_size": args.block_size}
    return {}


def param_checksum(model):
    """A 63-bit digest of every parameter's bytes, in named_parameters() order."""
    return common.checksum((name, p.detach().cpu().contiguous().numpy()) for name, p in model.named_parameters())


@torch.no_grad()
def accuracy(model, data, params=None):
    """Test accuracy of ``model``, or of the model with ``params`` (name -> tensor) in its place."""
    x, y = data
    model.eval()
    logits = model(x) if params is None else torch.func.functional_call(model, params, (x,))
    model.train()
    return float((logits.argmax(dim=1) == y).float().mean())


def state_bytes(args, opt, numel):
    """Bytes this rank sent outside the compressor so far: with ``--pqasgd-momentum average``, the
    fp32 allreduce of SGD's momentum buffers (one per parameter) at every sync."""
    if args.method == "pqasgd" and args.pqasgd_momentum == "average" and args.momentum > 0:
        return 4 * numel * opt.syncs
    return 0


def evaluated_params(args, opt):
    """What the curve evaluates: the parameters, or for pqasgd the last synchronized model (x^, the
    same on every rank; between syncs each rank's own parameters have moved apart)."""
    return opt.anchor if args.method == "pqasgd" else None


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(max(1, args.threads))
    codec.set_num_threads(max(1, args.threads))

    (x_tr, y_tr), test, n_train = load_data(rank, size)

    # Each rank initialises differently on purpose: the broadcast is what makes them agree.
    torch.manual_seed(args.seed + rank)
    model = MLP(hidden=args.hidden)
    compression = make_compression(args, model)
    opt = make_optimizer(args, model, compression)

    _, total_steps, epochs = common.schedule(args, len(x_tr))
    rng = np.random.default_rng([args.seed, rank])  # this rank's shuffling of its own shard

    if rank == 0:
        common.announce(args, compression, None, size, n_train, len(x_tr), len(test[0]), total_steps)
    bar = common.progress_bar(args, compression, total_steps) if rank == 0 else None

    numel = sum(p.numel() for p in model.parameters())
    curve = []
    eval_time = 0.0
    hvd.allreduce(torch.zeros(1), name="start")  # line the ranks up before timing
    t0 = time.perf_counter()
    step = 0
    for epoch, idx, end in common.minibatches(rng, len(x_tr), args.batch_size, total_steps):
        idx = torch.from_numpy(idx)
        opt.zero_grad()
        loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
        loss.backward()
        opt.step()
        step += 1
        if step == total_steps and args.method == "pqasgd" and opt.local_steps % opt.period:
            opt.synchronize()  # end on a sync: the ranks' parameters are then bit-identical
        if end and rank == 0:  # the curve: rank 0's bytes so far, and the test accuracy (not timed)
            t_eval = time.perf_counter()
            sent = common.bytes_so_far(args, numel, common.compressor_stats(args, compression), step,
                                       extra=state_bytes(args, opt, numel))
            curve.append(dict(epoch=epoch + 1, step=step, bytes_sent_so_far=sent,
                              test_accuracy=accuracy(model, test, evaluated_params(args, opt))))
            eval_time += time.perf_counter() - t_eval
        if bar is not None:
            bar.update(1)
            if end:
                bar.set_postfix_str(f"ep {epoch + 1} loss {loss.item():.3f}", refresh=False)
    train_time = time.perf_counter() - t0 - eval_time
    if bar is not None:
        bar.close()

    # Every rank must end with bit-identical parameters.
    mine = torch.tensor([param_checksum(model)], dtype=torch.int64)
    sums = hvd.allgather(mine, name="param_checksum").tolist()

    named_sizes = [(n, p.numel()) for n, p in model.named_parameters()]
    stats = common.compressor_stats(args, compression)
    # Uncompressed tensors travel as float32 here: 4 bytes an element.
    extra = state_bytes(args, opt, numel)
    per_step, control_per_step = common.bytes_sent(args, numel, stats, step, size, raw_bytes=4, extra=extra)
    result = None
    if rank == 0:
        result = common.results(
            args, compression, named_sizes, size=size, epochs=epochs, steps=step,
            test_accuracy=accuracy(model, test), per_step=per_step,
            control_per_step=control_per_step, train_time=train_time, checksums=sums, stats=stats,
            method_info=method_info(args, opt), bytes_total=common.bytes_so_far(args, numel, stats, step, extra=extra),
            curve=curve)
        common.report(args, result)
    hvd.shutdown()
    return result


if __name__ == "__main__":
    main()
