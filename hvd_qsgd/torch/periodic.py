"""PQASGD: local SGD with periodic averaging of quantized model differences (Jiang & Agrawal,
"A Linear Speedup Analysis of Distributed Deep Learning with Sparse and Quantized Communication",
NeurIPS 2018).

M ranks start from the same model (Horovod broadcast from rank 0) and each runs the wrapped
optimizer on its own data; every ``period`` (p) local steps they average what they learnt, sending
only its quantization:

    local step (every step, each rank i):  x_i <- optimizer step of x_i on its own mini-batch
    every p steps:                         d_i = x_i - x^            (x^: the model of the last sync)
                                           x^ <- x^ + (1/M) sum_i Q(d_i)
                                           x_i <- x^                 (every rank)

Q is the compressor (default ``hvd_qsgd.QSGD(2)``, the 2-bit quantizer): unbiased, so E[x^] moves
by the average of the local progress, and x^ is bit-identical on every rank (the reduced average is).
Traffic: one quantized model every p steps instead of one full-precision gradient every step.
Tensors under the compressor's ``min_numel`` are averaged exactly.

Momentum buffers (``momentum=``): the optimizer's per-parameter state is local to each rank and,
by default, is kept as it is across a sync ("local": each rank's buffer carries on, as every
rank's optimizer did between syncs: the local steps are plain momentum SGD steps of that rank).
"average" replaces every floating-point buffer of the optimizer state by its exact average over the
ranks at each sync (an allreduce of the state, p times rarer than gradients), so the ranks restart
alike; "reset" zeroes the buffers at each sync. The paper's analysis is for plain SGD local steps;
with momentum=0 (or no momentum) the three agree.

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd_qsgd.torch.PeriodicQuantizedAveraging(opt, model.named_parameters(), period=4,
                                                    compression=hvd_qsgd.QSGD(2))
    ...; loss.backward(); opt.step(); opt.zero_grad()

The wrapped optimizer is a plain PyTorch optimizer, not Horovod's ``DistributedOptimizer`` (the
local steps average nothing). ``state_dict`` holds the optimizer's, x^, the step count and the
compressor's state.

Elastic training: pass it as the optimizer of ``hvd_qsgd.torch.elastic.TorchState``, which carries
x^ and the step counts with the optimizer's state (a worker that joins takes rank 0's, so that it
averages the same x^ at the same steps), and make it with ``broadcast=False`` (the default there,
``HOROVOD_ELASTIC=1``): a worker that joins runs the constructor while the others train, and the
state's sync broadcasts instead.
"""
import os
from typing import Any, Iterable, Optional, Tuple

import torch
import horovod.torch as hvd

import hvd_qsgd
from hvd_qsgd.adapters.torch_params import average_named, claim_compressor, named_parameter_list
from hvd_qsgd.horovod_caller import in_horovod_state_broadcast

MOMENTUM_MODES = ("local", "average", "reset")


class PeriodicQuantizedAveraging:
    """PQASGD over Horovod (see the module docstring).

    optimizer:        a PyTorch optimizer over the model's parameters
    named_parameters: (name, parameter) pairs of the parameters to average (exchange names)
    period:           p, local steps between syncs (>= 1)
    compression:      Q (default ``hvd_qsgd.QSGD(2)``); any compressor of the package, or
                      ``hvd.Compression.none`` for exact periodic averaging
    momentum:         "local" (default), "average" or "reset": the optimizer state at a sync
    broadcast:        broadcast rank 0's parameters and optimizer state to all ranks now (default: True,
                      except in elastic training, where it must be False)
    process_set:      Horovod process set (default: all ranks)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
                 period: int, compression: Optional["hvd_qsgd.QSGD"] = None, momentum: str = "local",
                 broadcast: Optional[bool] = None, process_set: Any = None):
        if type(optimizer).__name__ == "_DistributedOptimizer" or hasattr(optimizer, "_allreduce_delay"):
            raise TypeError("PeriodicQuantizedAveraging wraps a plain PyTorch optimizer, not Horovod's "
                            "DistributedOptimizer: the local steps must not average gradients")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"PeriodicQuantizedAveraging: expected a torch.optim.Optimizer, got {optimizer!r}")
        named = named_parameter_list(named_parameters, "PeriodicQuantizedAveraging")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"PeriodicQuantizedAveraging: period must be an integer >= 1, got {period!r}")
        if momentum not in MOMENTUM_MODES:
            raise ValueError(f"PeriodicQuantizedAveraging: momentum must be one of {MOMENTUM_MODES}, "
                             f"got {momentum!r}")
        elastic = os.environ.get("HOROVOD_ELASTIC", "0").strip() not in ("", "0")
        if broadcast is None:
            broadcast = not elastic
        elif broadcast and elastic:
            raise ValueError("PeriodicQuantizedAveraging: broadcast=True in elastic training (HOROVOD_ELASTIC=1): a "
                             "worker that joins would wait in the broadcast for ranks that are training; pass "
                             "broadcast=False and this object as the optimizer of hvd_qsgd.torch.elastic.TorchState, "
                             "whose sync broadcasts rank 0's model, optimizer state and averaging state")
        self.optimizer = optimizer
        self.named_parameters = named
        self.period = period
        self.compression = hvd_qsgd.QSGD(2) if compression is None else compression
        claim_compressor(self.compression, self, "PeriodicQuantizedAveraging")
        watch = getattr(self.compression, "_never_called", None)
        if watch is not None:  # called at syncs only: no no-op warning before the first one is due
            watch.expect_calls_every(period)
        self.momentum = momentum
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.local_steps = 0
        self.syncs = 0
        if broadcast:
            hvd.broadcast_parameters(named, root_rank=0)       # over all ranks
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        self.anchor = {n: p.detach().clone() for n, p in named}     # x^

    # -- the optimizer interface -----------------------------------------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One local step; every ``period``-th also synchronizes."""
        loss = self.optimizer.step(closure)
        self.local_steps += 1
        if self.local_steps % self.period == 0:
            self.synchronize()
        return loss

    @torch.no_grad()
    def synchronize(self):
        """x^ <- x^ + (1/M) sum_i Q(x_i - x^); x_i <- x^; then the optimizer state per ``momentum``."""
        diffs = [(name, p.detach() - self.anchor[name]) for name, p in self.named_parameters]
        averages = average_named(self.compression, diffs, "hvd_qsgd.pqasgd", self.process_set)
        for (name, p), (_, average) in zip(self.named_parameters, averages):
            self.anchor[name].add_(average)
            p.copy_(self.anchor[name])
        self._sync_state()
        self.syncs += 1

    def _sync_state(self):
        if self.momentum == "local":
            return
        handles = []
        for name, p in self.named_parameters:
            for key, buf in sorted(self.optimizer.state.get(p, {}).items()):
                if not (torch.is_tensor(buf) and buf.is_floating_point() and buf.dim() > 0):
                    continue
                if self.momentum == "reset":
                    buf.zero_()
                else:
                    handles.append(hvd.allreduce_async_(buf, op=hvd.Average, name=f"hvd_qsgd.pqasgd.state.{name}.{key}",
                                                        process_set=self.process_set))
        for h in handles:
            hvd.synchronize(h)

    def __reduce_ex__(self, protocol):
        raise TypeError("PeriodicQuantizedAveraging is not copied or pickled (its state_dict() is): in elastic "
                        "training pass it as the optimizer of hvd_qsgd.torch.elastic.TorchState, which carries its "
                        "state (Horovod's own TorchState pickles a value it has no handler for)")

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self):
        if in_horovod_state_broadcast():   # (on every rank: its collectives, and a KeyError, never start)
            raise TypeError("hvd.broadcast_optimizer_state takes a PyTorch optimizer, and a "
                            "PeriodicQuantizedAveraging holds more (its anchor and step counters): load its "
                            "checkpoint (state_dict()) on every rank, or in elastic training pass it to "
                            "hvd_qsgd.torch.elastic.TorchState, whose sync broadcasts all of it")
        return {"optimizer": self.optimizer.state_dict(), "anchor": {n: t.clone() for n, t in self.anchor.items()},
                "local_steps": self.local_steps, "syncs": self.syncs,
                "compression": self.compression.state_dict() if hasattr(self.compression, "state_dict") else None}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        for n, t in state["anchor"].items():
            self.anchor[n].copy_(t)
        self.local_steps, self.syncs = int(state["local_steps"]), int(state["syncs"])
        if state.get("compression") is not None and hasattr(self.compression, "load_state_dict"):
            self.compression.load_state_dict(state["compression"])
