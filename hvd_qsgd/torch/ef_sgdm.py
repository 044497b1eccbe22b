"""dist-EF-SGDM: distributed momentum SGD with two-way compression and error feedback
(Zheng, Huang & Kwok, NeurIPS 2019, Algorithm 1; the blockwise compressor of section 4).

With M ranks, learning rate eta_t, momentum mu, compressors C (workers) and C~ (server), from
m_{-1,i} = 0, e_{0,i} = 0, e~_0 = 0:

    worker i:   g_{t,i} = grad f(x_t; xi_{t,i})          (+ weight_decay * x_t)
                m_{t,i} = mu m_{t-1,i} + g_{t,i}
                p_{t,i} = eta_t (mu m_{t,i} + g_{t,i}) + e_{t,i}      (Nesterov)
                Delta_{t,i} = C(p_{t,i}),   e_{t+1,i} = p_{t,i} - Delta_{t,i}
    server:     Delta~_t = (1/M) sum_i Delta_{t,i} + e~_t
                Delta_t = C~(Delta~_t),     e~_{t+1} = Delta~_t - Delta_t
    every rank: x_{t+1} = x_t - Delta_t

C = C~ = ``hvd_qsgd.BlockSign``: per block G of the flattened tensor, C(v)_G = ||v_G||_1/|G| sign(v_G),
1 bit per coordinate plus one fp32 scale per block.

How it maps onto Horovod: ``EFSGDM`` is a ``torch.optim.Optimizer`` that runs the worker lines
itself and hands eta_t (mu m + g) of every parameter to the compressor, whose error feedback adds
e_{t,i} and keeps e_{t+1,i} (``error_feedback=True``; the residual is in update units, so a
learning-rate change needs no rescaling). The server is scatter_allgather's reduce step: rank j
holds chunk j of every tensor, decodes and sums the ranks' Delta_{t,i} of it, adds its residual,
re-quantizes with C~ and keeps e~ (``server_error_feedback=True``; ``hvd_qsgd.error_feedback``);
the allgather of the re-quantized chunks is the server's broadcast, so Delta_t is bit-identical on
every rank and so are the parameters. Tensors smaller than the compressor's ``min_numel`` are
averaged exactly by Horovod's allreduce (for them Delta_t = (1/M) sum_i p_{t,i} and e = e~ = 0).

Use it in place of ``hvd.DistributedOptimizer`` (it already averages; do not wrap it again)::

    opt = hvd_qsgd.torch.EFSGDM(model.named_parameters(), lr=0.1, momentum=0.9,
                                compression=hvd_qsgd.BlockSign(block_size=512))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ...; loss.backward(); opt.step(); opt.zero_grad()

``state_dict()`` holds the momentum buffers and the compressor's residuals (worker and server).
Horovod's ``hvd.broadcast_optimizer_state`` (a resume where rank 0 loads the checkpoint; Horovod's
elastic ``TorchState``) fills an empty state by calling ``step()`` on the ranks that hold none: that
step makes the momentum buffers (zeros) and exchanges nothing, which the others would never join.
"""
from typing import Any, Iterable, Optional, Tuple

import torch
import horovod.torch as hvd

import hvd_qsgd
from hvd_qsgd.adapters.torch_params import average_named, claim_compressor, named_parameter_list
from hvd_qsgd.block_sign import efsgdm_compression
from hvd_qsgd.horovod_caller import in_horovod_state_broadcast


class EFSGDM(torch.optim.Optimizer):
    """dist-EF-SGDM over Horovod (see the module docstring).

    named_parameters: (name, parameter) pairs (``model.named_parameters()``): exchange names
    lr, momentum:     eta and mu of the algorithm (lr may be changed by a scheduler)
    weight_decay:     added to the gradient before the momentum (0 by default)
    compression:      a ``hvd_qsgd.BlockSign`` (default ``BlockSign()``) or any compressor of the
                      package; it must keep worker error feedback (``error_feedback=True``)
    process_set:      Horovod process set (default: all ranks)
    """

    def __init__(self, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]], lr: float, momentum: float = 0.9,
                 weight_decay: float = 0.0, compression: Optional["hvd_qsgd.QSGD"] = None, process_set: Any = None):
        named = named_parameter_list(named_parameters, "EFSGDM")
        compression = efsgdm_compression("EFSGDM", dict(lr=lr, momentum=momentum, weight_decay=weight_decay),
                                         compression)
        self._names = {id(p): n for n, p in named}
        super().__init__([p for _, p in named], dict(lr=float(lr), momentum=float(momentum),
                                                     weight_decay=float(weight_decay)))
        self.compression = compression
        claim_compressor(compression, self, "EFSGDM")
        self.process_set = process_set if process_set is not None else hvd.global_process_set

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if in_horovod_state_broadcast():   # (filling an empty state, on some ranks only: no exchange)
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            return loss
        params, updates = [], []
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                name = self._names[id(p)]
                g = torch.zeros_like(p) if p.grad is None else p.grad.detach()
                if g.is_sparse:
                    raise ValueError(f"EFSGDM: parameter {name!r} has a sparse gradient; dist-EF-SGDM "
                                     "compresses dense updates")
                if wd:
                    g = g.add(p, alpha=wd)
                state = self.state[p]
                m = state.get("momentum_buffer")
                m = state["momentum_buffer"] = g.clone() if m is None else m.mul_(mu).add_(g)
                params.append(p)
                updates.append((name, (g + mu * m) * lr))   # eta_t (mu m_t + g_t); e_t is added by the compressor
        for p, (_, delta) in zip(params, average_named(self.compression, updates, "hvd_qsgd.efsgdm",
                                                       self.process_set)):
            p.sub_(delta)
        return loss

    def state_dict(self):
        state = super().state_dict()
        state["compression"] = self.compression.state_dict()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        compression = state_dict.pop("compression", None)
        super().load_state_dict(state_dict)
        if compression is not None:
            self.compression.load_state_dict(compression)
