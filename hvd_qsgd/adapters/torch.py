"""QSGD as a Horovod PyTorch ``Compressor``: the glue between Horovod's calls and the exchange.

    compress(g):    the exchange of g (``hvd_qsgd.exchange.runner.ExchangeRunner``: route, settings,
                    reduction, backend), g flattened as its backend reads it, encoded (with error
                    feedback), the presence allreduce started; returns the control vector
                    (``hvd_qsgd.protocol``) for Horovod's allreduce
    decompress(r):  the runner's result once r, the reduced control vector, checked: the reduction's
                    remaining stages (``hvd_qsgd.exchange.chains``), as a tensor of g's shape, dtype
                    and device; where g requires a gradient (``hvd.allreduce`` in a model's forward
                    pass), differentiable as Horovod's allreduce is: its gradient is the allreduce of
                    the result's, uncompressed, with the same scale and process set

Every rank decodes the same bytes in the same order with the same kernel, so every rank ends with a
bit-identical gradient; E[decode(p_r)] = g_r, so the result is an unbiased estimate of the average.
With error feedback, e_r <- (g_r + e_r) - decode(p_r) after each encoding (Karimireddy et al.,
2019): what quantization dropped is sent in later steps.

What is this adapter's own: which process set and parameter name an exchange has (from Horovod's
calling frames, ``hvd_qsgd.horovod_caller``, or the compressor's ``named_parameters``; learned once
per tensor, ``hvd_qsgd.adapters.torch_places``), tensor conversion, Horovod's collectives
(``hvd_qsgd.adapters.torch_collectives``), learning-rate following from a ``torch.optim.Optimizer``,
and checkpoints as torch tensors.

Exchange names, slots and residual keys: ``hvd_qsgd.state`` (``ExchangeNames``); a known
parameter's gradient travels as ``hvd_qsgd.<k>.p.<name>``, any other tensor as
``hvd_qsgd.<k>.n<slot>``. Payload seeds: ``protocol.payload_seed(seed, set_rank, exchange_name,
i)`` where i counts the previous exchanges of that name on this rank.

Devices: ``hvd_qsgd.backends.choose`` picks each exchange's codec backend once. A CUDA tensor stays
on the device (payloads handed to Horovod as CUDA tensors where Horovod was built with NCCL) when
every step has a CUDA kernel; otherwise it goes through the host, and that is counted in
``stats["host_fallbacks"]`` and logged once per reason.
"""
from typing import Optional, Tuple

import numpy as np
import torch
import horovod.torch as hvd
from horovod.torch import mpi_ops
from horovod.torch.compression import Compressor

from hvd_qsgd import backends, error_feedback, errors, report, threads
from hvd_qsgd.adapters.torch_collectives import AS_ROW, HorovodTorchCollectives, uncompressed
from hvd_qsgd.adapters.torch_params import group_learning_rate, named_parameter_list
from hvd_qsgd.adapters.torch_places import TensorPlaces
from hvd_qsgd.exchange.chains import Exchange
from hvd_qsgd.exchange.runner import ExchangeRunner
from hvd_qsgd.horovod_caller import horovod_caller, horovod_frame
from hvd_qsgd.policy import FixedBits
from hvd_qsgd.settings import Settings, next_creation_index
from hvd_qsgd.state import checkpoint_origin, loadable, state_by_key

SOURCE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class TorchCompressor(errors.NotCopied, report.Summarized, Compressor):
    """QSGD compression for ``horovod.torch``: the parameters of ``hvd_qsgd.QSGD`` (the settings, as
    ``hvd_qsgd.settings.Settings.make``, then ``named_parameters`` and ``process_set`` by name), or
    ``settings=`` and a bits ``policy=`` (``hvd_qsgd.policy``; default: fixed bits)."""

    def __init__(self, *args, named_parameters=None, process_set=None, settings=None, policy=None,
                 creation_index=None, **kwargs):
        self.settings = settings = Settings.given("hvd_qsgd.torch.QSGD", settings, args, kwargs)
        self.policy = policy if policy is not None else FixedBits(settings)
        self._creation_index = next_creation_index() if creation_index is None else creation_index
        report.note_used(hvd.size)
        self.runner = ExchangeRunner(HorovodTorchCollectives(), self._creation_index, settings, self.policy,
                                     owner=repr(self))
        self._learning_rate = None   # residual key -> learning rate now, or None
        planned = SOURCE_DTYPES if settings.fusion_mb and type(self.policy) is FixedBits else None   # (buffer_plan)
        self._places = TensorPlaces(process_set, state_by_key(settings, self.policy.observes), planned)
        if named_parameters is not None:
            self.bind(named_parameters)

    PUBLIC_NAME = "hvd_qsgd.torch.QSGD"
    _horovod_rank = staticmethod(lambda: hvd.rank())

    def __repr__(self):
        return f"hvd_qsgd.torch.QSGD({self.settings}, {self.policy!r})"

    # the runner's state, by the names the elastic code and tests read
    names = property(lambda self: self.runner.names)
    residuals = property(lambda self: self.runner.residuals)
    driver = property(lambda self: self.runner.driver)
    _lock = property(lambda self: self.runner.lock)

    def bind(self, named_parameters):
        """Match payloads by parameter name (the pairs given to Horovod's optimizer)."""
        self._places.bind(named_parameter_list(named_parameters, "hvd_qsgd.torch.QSGD.bind", empty_ok=True))
        return self

    @property
    def bits_history(self):
        """(key, bits) of every exchange, with DQSGD's policy (``hvd_qsgd.policy.ScheduledBits``)."""
        return self.policy.bits_history

    # -- Compressor interface -----------------------------------------------------------------

    def compress(self, tensor: torch.Tensor = errors.NOT_GIVEN) -> Tuple[torch.Tensor, Optional[Exchange]]:
        if tensor is errors.NOT_GIVEN:   # (the class given as the compression: ``self`` is the tensor)
            raise errors.class_given()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"hvd_qsgd.torch.QSGD.compress: expected a torch.Tensor, got {type(tensor)} "
                            "(hvd_qsgd.QSGD serves PyTorch and TensorFlow; hvd_qsgd.tensorflow.QSGD, TensorFlow)")
        numel = tensor.numel()
        if tensor.layout != torch.strided or tensor.dtype not in SOURCE_DTYPES or numel < self.settings.min_numel:
            self.runner.stats.add(raw_elements=numel, raw_tensors=1)
            return uncompressed(tensor)
        if _horovod_session() is not self.runner.session:
            self._new_session()
        device = tensor.device
        ex, stepping = self._open(tensor, numel, device)
        try:
            if ex.fault is not None:  # the compressor's set or names disagree with Horovod's call
                raise ex.fault
            threads.share_cores(hvd.local_size)   # once per process: ranks on a node share its cores
            if ex.device_type not in ("cpu", "cuda"):
                raise ValueError(f"the tensor is on device {str(device)!r}: hvd_qsgd encodes tensors on "
                                 "the CPU or a CUDA device (move it there, or pass it uncompressed)")
            self.runner.encode(ex, self._backend_input(tensor, ex), self._current_lr(ex.route.residual_key, stepping))
        except Exception as e:  # reported through the control vector, raised on every rank
            ex.fault = e
        self.runner.start(ex)
        return torch.from_numpy(self.runner.control(ex)), ex

    def _open(self, tensor, numel, device):
        """The exchange of ``tensor`` (of ``numel`` elements on ``device``): its process set and name
        from Horovod's call and the compressor's (``hvd_qsgd.adapters.torch_places``); and Horovod's
        optimizer that hands it over, which applies the update (or None)."""
        caller, world, rank = horovod_caller(ours=2), hvd.size(), hvd.rank()   # (this one and ``compress``)
        shape, dtype = tensor.shape, tensor.dtype
        place = self._places.of(tensor, shape, dtype, device, caller, world, rank)
        ex = self.runner.open(place.param, numel, SOURCE_DTYPES[dtype], shape, device.type, place.ps, place.set_ranks,
                              rank, world, ranks_per_node=place.per_node, place=place, alone=place.alone,
                              call=horovod_frame(ours=2) if caller.name is None else None, order=place.order)
        # (the tensor, where the result must carry its gradient back to it)
        graph_input = tensor if tensor.requires_grad and torch.is_grad_enabled() else None
        ex.origin, ex.fault = (shape, dtype, device, graph_input), place.fault or ex.fault
        # its first collective waits for a decompress: none started here moves the handle numbers
        # that name unnamed collectives (an unnamed one's, even under overlap: its call is synchronous)
        ex.defer = "named" if caller.name is not None else "unnamed"
        return ex, caller.optimizer

    @staticmethod
    def _backend_input(tensor, ex):
        """The tensor flattened as its backend reads it: a float32 NumPy view on the host for the CPU
        backend (no copy for a contiguous float32 CPU tensor); the tensor itself, in its own dtype,
        for the CUDA backend."""
        if ex.backend is not backends.CPU:
            return tensor.detach().reshape(-1)
        if tensor.dtype is torch.float32 and ex.device_type == "cpu" and tensor.is_contiguous():
            a = (tensor.detach() if tensor.requires_grad else tensor).numpy()   # (a gradient needs no detach)
            return a if a.ndim == 1 else a.reshape(-1)   # (NumPy's reshape of a view: no dispatch)
        return tensor.detach().reshape(-1).cpu().float().contiguous().numpy()

    def decompress(self, tensor: torch.Tensor, ex: Optional[Exchange] = errors.NOT_GIVEN) -> torch.Tensor:
        if ex is None or ex is AS_ROW:
            return tensor if ex is None else tensor.squeeze(0)
        if ex is errors.NOT_GIVEN:
            raise errors.class_given()
        reduced = tensor.numpy() if tensor.is_cpu and not tensor.requires_grad else tensor.detach().cpu().numpy()
        out = self.runner.finish(ex, reduced)
        shape, dtype, device, graph_input = ex.origin
        if isinstance(out, np.ndarray):  # the host's float32 result
            out = torch.from_numpy(out.reshape(shape))
            if dtype is torch.float32 and device.type == "cpu" and graph_input is None:
                return out
        else:
            out = out.view(shape)
        if out.dtype != dtype or out.device != device:
            out = out.to(device=device, dtype=dtype)
        if graph_input is not None:
            out = _ReducedWithGradient.apply(graph_input, out, ex.alpha, ex.group)
        return out

    # -- error feedback (the store: hvd_qsgd.state.ResidualStore, kept by the runner) ----------

    def follow_learning_rate(self, optimizer):
        """See ``hvd_qsgd.QSGD.follow_learning_rate``."""
        error_feedback.check_learning_rate_source(optimizer)
        if optimizer is None:
            source = None
        elif callable(optimizer) and not hasattr(optimizer, "param_groups"):
            source = lambda key, stepping: optimizer(key)   # noqa: E731  (a function of the key)
        elif hasattr(optimizer, "param_groups"):
            source = group_learning_rate(optimizer, lambda: self._places.params)
        else:
            raise TypeError(f"follow_learning_rate: expected a torch.optim.Optimizer or a function of the "
                            f"residual key, got {type(optimizer).__name__}")
        with self._lock:
            self._learning_rate = source
        return self

    def _current_lr(self, residual_key, stepping=None):
        """The learning rate now applied to the update of the tensor of ``residual_key``: read from
        ``stepping`` (Horovod's optimizer that handed the gradient over) where the compressor follows
        an optimizer; Horovod's is made from the optimizer it wraps, and has groups of its own once
        its ``load_state_dict`` has run (a resume, an elastic restore)."""
        source = self._learning_rate
        return None if source is None else source(residual_key, stepping)

    def rescale_residuals(self, factor):
        """Multiply every error-feedback residual by ``factor``."""
        factor = float(factor)
        with self._lock:
            self.residuals.rescale(factor, lambda v, f: v * f)

    # -- state --------------------------------------------------------------------------------

    @property
    def stats(self):
        return self.runner.stats.as_dict()

    def load_stats(self, stats):
        """Set the statistics counters (those of ``stats``, as ``stats`` gives them)."""
        self.runner.stats.load(stats)

    def state_dict(self):
        """Error-feedback residuals (by parameter name or step position) as tensors where the
        residuals are (on the host, or the exchange's device), statistics, settings, the rank and job
        size that made it (residuals are that rank's: ``hvd_qsgd.state.residuals_belong_here``), the
        exchange counters that seed the next payloads (``exchange_counters``: a resumed run draws the
        streams an uninterrupted one would), and the bits policy's state (DQSGD: ``schedules``)."""
        with self._lock:
            state = self.residuals.state_dict(residual=_checkpointed, server=_checkpointed)
        state.update(stats=self.stats, settings=self.settings.as_dict(), counters=self.exchange_counters(),
                     **checkpoint_origin(hvd), **self.policy.state_dict())
        return state

    def load_state_dict(self, state):
        state = loadable(state, self.settings, hvd, "hvd_qsgd.torch.QSGD.load_state_dict")
        with self._lock:
            r = self.residuals
            r.residuals = {k: v.detach().float().cpu().clone() for k, v in state.get("residuals", {}).items()}
            positional = any(isinstance(k, int) for k in r.residuals)
            r.rates = {k: float(v) for k, v in state.get("residual_lr", {}).items()}
            r.server = {k: np.array(torch.as_tensor(v).float().cpu().numpy(), dtype=np.float32)
                        for k, v in state.get("server_residuals", {}).items()}
        self._places.positional(positional)
        if "counters" in state:  # (checkpoints of earlier releases have none: the counters stay)
            self.names.load_counters(state["counters"])
        self.runner.stats.load(state.get("stats", {}))
        self.policy.load_state_dict(state)

    # -- elastic training (hvd_qsgd.torch.elastic) --------------------------------------------

    def reset(self, residuals=True):
        """Forget every exchange in progress, and with ``residuals`` the error-feedback residuals
        (and the bits policy's state).

        For when no exchange this compressor started will be waited on: after Horovod was shut down
        and re-initialised (an elastic reset). A step interrupted by a failure leaves exchanges
        between compress and decompress, in different numbers on different ranks; left in place,
        they would route the next gradients of those parameters to numbered exchanges and shift the
        residual positions. The exchange counters (``exchange_counters``) are kept."""
        self.runner.reset(residuals)
        self._places.reset(holders=residuals)

    def _new_session(self):
        """Horovod was initialised (again: ``ExchangeRunner.new_session``)."""
        self.runner.new_session(_horovod_session(), also_reset=lambda: self._places.reset(holders=True))

    def exchange_counters(self):
        """What names and seeds the next exchanges: the numbered exchanges started so far and the
        exchanges started per parameter name (the payload seeds' occurrence)."""
        return self.names.counters()

    def load_exchange_counters(self, counters):
        """Set the counters of ``exchange_counters()`` (e.g. those of another rank)."""
        self.names.load_counters(counters)


def _horovod_session():
    """What ``horovod.torch.init()`` makes anew at every call (its table of handles): a Horovod
    session, compared by identity."""
    return getattr(mpi_ops, "_handle_map", None)


class _ReducedWithGradient(torch.autograd.Function):
    """A compressed allreduce's result (``reduced``) as a function of its input (``tensor``), as
    Horovod's ``HorovodAllreduce`` is: the gradient is the allreduce of the result's gradient over the
    same process set, scaled alike (``alpha``: 1/n for Average), uncompressed as Horovod's own."""

    @staticmethod
    def forward(ctx, tensor, reduced, alpha, process_set):
        ctx.alpha, ctx.process_set = alpha, process_set
        return reduced

    @staticmethod
    def backward(ctx, grad):
        return hvd.allreduce(grad, op=hvd.Sum, prescale_factor=ctx.alpha, process_set=ctx.process_set), None, None, None


def _checkpointed(v):
    """A residual as a checkpoint holds it: a tensor of its own (a NumPy residual as a CPU tensor)."""
    return torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else v.detach().clone()


TorchCompressor.__signature__ = Settings.signature(named_parameters=None, process_set=None, settings=None, policy=None,
                                        creation_index=None)
