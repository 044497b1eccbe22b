"""Elastic Horovod training (``horovod.torch.elastic``) with the QSGD compressor.

    compression = hvd_qsgd.QSGD(4, error_feedback=True, named_parameters=model.named_parameters())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    state = hvd_qsgd.torch.elastic.TorchState(model=model, optimizer=optimizer,
                                              compression=compression, epoch=0, step=0)

    @hvd.elastic.run
    def train(state):
        ...              # the steps; state.commit() between two steps

``TorchState`` is Horovod's ``hvd.elastic.TorchState`` that also carries the compressor through
Horovod's resets: every keyword argument that is an ``hvd_qsgd.QSGD`` or ``hvd_qsgd.torch.QSGD``,
and the compressor of the Horovod ``DistributedOptimizer`` given as ``optimizer`` (found even when
it is not passed). What happens to the compressor's state:

    commit:   its statistics and exchange counters are saved with the model (a few integers; the
              residuals are not copied)
    restore:  (a collective failed, ``HorovodInternalError``) statistics and exchange counters go
              back to the last commit, as the model and optimizer do
    reset:    (after every reset: a failure, or hosts added or removed) the exchanges in flight are
              forgotten and the error-feedback residuals dropped, on every rank; the exchange
              counters are those of the last commit
    sync:     every rank takes rank 0's exchange counters, so a new worker names and seeds its
              exchanges as the survivors do, and checks that its compressor has rank 0's creation
              index (the ``k`` of ``hvd_qsgd.<k>.p.<name>``)

Residuals are dropped, not rolled back. Rank r's residual is the part of its own gradients that
quantization has not yet delivered, owed to an average over the n ranks of the old world. After a
reset that debt cannot be settled: a failed rank's residual died with it, the survivors' residuals
would be paid at 1/n' instead of 1/n, ranks and data shards are reassigned, and a new worker has no
residual. Zero on every rank is the state a newly started job has, and every rank, new or old, can
reach it without exchanging per-rank data: training continues as an error-feedback run started
from the committed model, the case the error-feedback analysis covers. What is lost is bounded: each
residual element is at most one quantization step of its bucket, the error plain QSGD leaves in
every step.

A ``PeriodicQuantizedAveraging`` (PQASGD) given as the optimizer (or as any keyword argument) is
carried with its averaging state: its optimizer's state as Horovod carries an optimizer's, x^ and
its step counts beside it (saved at a commit, restored after a failure, rank 0's taken at a sync,
so a worker that joins averages the same x^ at the same steps as the others), and its compressor
as above. Make it with ``broadcast=False`` (its default in elastic training).

Statistics are per process: a survivor's are rolled back to the commit (the undone steps are done
again and counted then), a new worker's start at zero. Commit between steps, when no exchange of
the compressor is pending. Elastic training needs the global process set.
"""
from horovod.torch.elastic import TorchState as _HorovodTorchState
from horovod.torch.elastic.state import OptimizerStateHandler, StateHandler
from horovod.torch.functions import broadcast_object, broadcast_parameters

import hvd_qsgd
from hvd_qsgd import protocol
from hvd_qsgd.adapters.torch import TorchCompressor as TorchQSGD
from hvd_qsgd.torch.periodic import PeriodicQuantizedAveraging


def is_qsgd(obj):
    """Whether ``obj`` is a QSGD compressor (``hvd_qsgd.QSGD`` or ``hvd_qsgd.torch.QSGD``)."""
    return isinstance(obj, (hvd_qsgd.QSGD, TorchQSGD))


def torch_adapter(compression):
    """The ``hvd_qsgd.torch.QSGD`` that compresses PyTorch tensors for ``compression`` (created now
    for an ``hvd_qsgd.QSGD`` that has not compressed any yet, as its first tensor would)."""
    if isinstance(compression, TorchQSGD):
        return compression
    if isinstance(compression, hvd_qsgd.QSGD):
        return compression._adapter("torch")
    raise TypeError(f"hvd_qsgd.torch.elastic: expected an hvd_qsgd.QSGD or hvd_qsgd.torch.QSGD, "
                    f"got {type(compression).__name__}")


class CompressorStateHandler(StateHandler):
    """Horovod elastic state handler of one QSGD compressor (see the module docstring)."""

    def __init__(self, compression, name):
        self._name = name
        self._saved = None
        super().__init__(compression)
        torch_adapter(compression)  # a TypeError now rather than at the first commit
        self.save()

    def save(self):
        adapter = torch_adapter(self.value)
        self._saved = {"stats": adapter.stats, "counters": adapter.exchange_counters()}

    def restore(self):
        adapter = torch_adapter(self.value)
        adapter.load_stats(self._saved["stats"])
        adapter.load_exchange_counters(self._saved["counters"])

    def reset(self):
        adapter = torch_adapter(self.value)
        adapter.reset(residuals=True)
        adapter.load_exchange_counters(self._saved["counters"])

    def sync(self):
        adapter = torch_adapter(self.value)
        mine = {"creation_index": adapter._creation_index, "counters": adapter.exchange_counters()}
        root = broadcast_object(mine, root_rank=0, name=f"hvd_qsgd.elastic.{self._name}")
        if root["creation_index"] != mine["creation_index"]:
            raise protocol.MismatchError(
                f"hvd_qsgd.torch.elastic: the compressor {self._name!r} has creation index "
                f"{mine['creation_index']} on this worker and {root['creation_index']} on rank 0: create "
                "the compressors once, in the same order on every worker, before hvd.elastic.run")
        adapter.load_exchange_counters(root["counters"])
        self._saved["counters"] = root["counters"]


class PeriodicStateHandler(StateHandler):
    """Horovod elastic state handler of a ``PeriodicQuantizedAveraging``: its optimizer's state (by
    Horovod's own handler) and its averaging state, x^ and the step counts (see the module docstring)."""

    def __init__(self, periodic, name):
        self._name = name
        self._optimizer = OptimizerStateHandler(periodic.optimizer)
        super().__init__(periodic)
        self.save()

    def set_value(self, value):
        self._optimizer = OptimizerStateHandler(value.optimizer)
        super().set_value(value)

    def save(self):
        self._optimizer.save()
        p = self.value
        self._saved = ({n: t.clone() for n, t in p.anchor.items()}, p.local_steps, p.syncs)

    def restore(self):
        self._optimizer.restore()
        anchor, self.value.local_steps, self.value.syncs = self._saved
        for n, t in anchor.items():
            self.value.anchor[n].copy_(t)

    def sync(self):
        self._optimizer.sync()
        p = self.value
        broadcast_parameters([(f"hvd_qsgd.elastic.{self._name}.anchor.{n}", t) for n, t in p.anchor.items()],
                             root_rank=0)
        p.local_steps, p.syncs = broadcast_object((p.local_steps, p.syncs), root_rank=0,
                                                  name=f"hvd_qsgd.elastic.{self._name}.steps")


class TorchState(_HorovodTorchState):
    """``hvd.elastic.TorchState`` that also carries QSGD compressors (see the module docstring).

    model, optimizer: as in Horovod; kwargs: further state. A QSGD compressor or a
    ``PeriodicQuantizedAveraging`` among them (or as ``optimizer``) is kept as an attribute of that
    name; any other value is handled by Horovod."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        ours = {k: v for k, v in dict(kwargs, optimizer=optimizer).items()
                if is_qsgd(v) or isinstance(v, PeriodicQuantizedAveraging)}
        for k in ours:
            kwargs.pop(k, None)
        super().__init__(model=model, optimizer=None if "optimizer" in ours else optimizer, **kwargs)
        if "optimizer" in ours:
            self._saved_state.pop("optimizer", None)   # (Horovod's: a None to restore)
        compressors = {k: v for k, v in ours.items() if is_qsgd(v)}
        for k, v in ours.items():
            self._handlers[k] = CompressorStateHandler(v, k) if is_qsgd(v) else PeriodicStateHandler(v, k)
            setattr(self, k, v)
        inner = {f"{k}.compression": getattr(v, "_compression", getattr(v, "compression", None))
                 for k, v in dict(ours, optimizer=optimizer).items() if not is_qsgd(v)}
        for k, c in inner.items():
            if is_qsgd(c) and all(torch_adapter(c) is not torch_adapter(other) for other in compressors.values()):
                self._handlers[k] = CompressorStateHandler(c, k)
                compressors[k] = c

    def reset(self):
        for handler in self._handlers.values():
            if isinstance(handler, CompressorStateHandler):
                handler.reset()
        super().reset()
