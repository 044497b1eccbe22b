"""``hvd_qsgd.QSGD``: the one object a user passes as ``compression=`` to Horovod.

It holds the settings, checks them once, and hands each tensor to the adapter of its framework
(``hvd_qsgd.torch.QSGD`` for PyTorch tensors), created on first use. What the adapters share lives
below it (``hvd_qsgd.settings``, ``hvd_qsgd.protocol``): this module is the top of the package.
"""
import atexit
import functools
import inspect
import math
import sys
import threading
import weakref
from typing import Any, Dict, Iterable, Optional, Tuple

from hvd_qsgd import codec, error_feedback, errors, report, step_built
from hvd_qsgd.dynamic import check_schedule_args
from hvd_qsgd.policy import FixedBits, ScheduledBits
from hvd_qsgd.settings import (  # noqa: F401  (REDUCTIONS, Stats, default_bucket_size: part of this module's API)
    REDUCTIONS, Settings, Stats, default_bucket_size, next_creation_index, process_set_key)


FRAMEWORKS = ("torch", "tensorflow")   # the adapters' names, the keys of ``state_dict()``


def _framework(tensor: Any) -> str:
    return _framework_of(type(tensor))


@functools.lru_cache(maxsize=64)
def _framework_of(kind: type) -> str:
    """The framework of a tensor type (looked up once per type: it is asked at every exchange)."""
    module = kind.__module__ or ""
    if module.startswith("torch"):
        return "torch"
    if module.startswith(("tensorflow", "keras", "tf_keras")):
        return "tensorflow"
    raise TypeError(f"hvd_qsgd.QSGD: cannot compress a {kind.__module__}.{kind.__name__}; "
                    "it compresses PyTorch tensors (and TensorFlow tensors where supported)")


class QSGD(errors.NotCopied, report.Summarized):
    """QSGD gradient compression for Horovod (Alistarh et al., NeurIPS 2017).

    ``hvd.DistributedOptimizer(opt, named_parameters=..., compression=hvd_qsgd.QSGD(4))``.

    The settings (``hvd_qsgd.settings.Settings.make``, positionally in this order or by name):

    bits:            bits per coordinate b (1..8); s = 2^(b-1) - 1 levels for b >= 2
    bucket_size:     elements per bucket (default 512, or 128 for bits <= 2)
    norm:            "max" (default) or "l2" bucket scale
    coding:          "fixed" (b bits per coordinate) or "elias" (variable length, CPU)
    min_numel:       tensors with fewer elements go through Horovod uncompressed (default 10,000)
    seed:            base seed; each rank and exchange draws its own stream from it
    error_feedback:  keep each tensor's quantization residual and add it before the next encoding
                     (``hvd_qsgd.error_feedback``; ``follow_learning_rate(optimizer)`` rescales the
                     residuals when the learning rate changes; ``state_dict`` checkpoints them)
    checksum:        add a checksum to every payload (verified by every receiver)
    reduction:       "auto" (default: per tensor, the faster by the latency/bandwidth model of
                     ``hvd_qsgd.cost_model``: allgather on 2 ranks and for small tensors,
                     scatter_allgather for large ones), "allgather" (every rank receives every
                     payload: (n-1) P bytes) or "scatter_allgather" (alltoall of chunks, reduce,
                     allgather of the re-quantized chunks: 2 (n-1)/n P bytes, flat in n; see
                     ``hvd_qsgd.reduction``) or "hierarchical" (reduce inside each node in float32,
                     compress only across nodes: (c-1) P bytes leave a node of the c by an
                     allgather among the nodes, about 2 (c-1)/c P by a scatter_allgather, which
                     PyTorch and mpi4py pick for 3 nodes or more and large shards;
                     ``hvd_qsgd.exchange.hierarchical``, docs/reduction.md)
    server_error_feedback: with scatter_allgather, the rank that reduces chunk j keeps the residual
                     of its re-quantization and adds it to chunk j's sum next time (two-way error
                     feedback, as dist-EF-SGDM's server; ``hvd_qsgd.error_feedback``)
    link_gbps:       the bandwidth between ranks, Gbit/s, that "auto" assumes (default None:
                     ``HVD_QSGD_BANDWIDTH_GBITS``, else 10); the same on every rank
    fusion:          PyTorch: the tensors whose reduction is allgather travel together, in one presence
                     allreduce and one allgather per step and process set instead of two collectives
                     each (each keeps its own payload, checks and result, bit for bit;
                     ``hvd_qsgd.exchange.fused``); the same on every rank (default False)
    overlap:         PyTorch: each tensor's payload collective starts in compress, during the backward
                     pass, instead of in decompress (allgather, and scatter_allgather's first phase),
                     and no presence allreduce precedes it; the cost: ``hvd.join()`` cannot be used
                     (Horovod cannot carry an allgather or alltoall through a join); the same on every
                     rank (default False; docs/compressor.md, "Overlap")
    fusion_mb:       PyTorch: gather the tensors into fusion buffers of up to this many MiB of float32,
                     each quantized as one payload and exchanged as one tensor (each tensor at a
                     bucket boundary of its buffer, with its own checks and residual, at the place
                     Horovod's optimizer's parameters plan for it; tensors of no plan in the order
                     they come; ``hvd_qsgd.exchange.buffers``; with overlap, a full buffer goes on
                     the wire during the backward pass); not with fusion or server_error_feedback;
                     the same on every rank (default 0: off)
    encoder:         the encoder version, 2 (default) or 1 (the payload bytes of earlier releases;
                     docs/wire-format.md, "Encoders"); receivers decode both; the same on every rank
    join:            whether ``hvd.join()`` can be used (default True): exchanges made while ranks
                     have joined go through Horovod's allreduce of the dequantized payloads. With
                     join=False a rank that joins fails the other ranks' step, saying so; in
                     exchange, a TensorFlow step holds no conditional a gradient (a faster trace
                     and step: docs/compressor.md, "Uneven data"); the same on every rank

    and, by name only:

    named_parameters: (name, parameter) pairs, as given to Horovod's optimizer: payloads are then
                     matched by parameter name, so ranks may hand gradients over in any order
    process_set:     Horovod process set of the reduction (default: all ranks)

    ``stats`` is a dict of cumulative counters (see ``hvd_qsgd.settings.Stats``); ``summary()`` what
    they mean for the job (``hvd_qsgd.report``). A compressor that is never called while optimizer
    steps happen, or whose codec time exceeds the wire time its bytes save at ``link_gbps``, says so
    once on the ``hvd_qsgd`` logger.
    """

    def __init__(self, *args: Any, named_parameters: Optional[Iterable[Tuple[str, Any]]] = None,
                 process_set: Any = None, **kwargs: Any):
        self._setup(Settings.from_arguments(f"hvd_qsgd.{type(self).__name__}", args, kwargs), named_parameters,
                    process_set)

    def _setup(self, settings: Settings, named_parameters: Any, process_set: Any) -> None:
        first = step_built.first_built(self, self._identity(settings, process_set))
        if first is not None:  # built again by a retrace of a tf.function step: that step's compressor
            self.__dict__ = first.__dict__
            return
        self.settings = settings
        self._named_parameters = None if named_parameters is None else list(named_parameters)
        self._process_set = process_set
        self._creation_index = next_creation_index()
        self._adapters: Dict[str, Any] = {}
        self._by_type: Dict[type, Any] = {}   # each tensor type's adapter, once asked
        self._lock = threading.Lock()
        self._learning_rate = None
        self._calls = self._compressed = 0   # tensors handed over; compressed (not passed through as they are)
        self._never_called = report.NeverCalledWatch()
        _watch(self)

    def _identity(self, settings: Settings, process_set: Any) -> Tuple[Any, ...]:
        """What makes two compressors built in one place of a traced step the same one
        (``hvd_qsgd.step_built``): class, settings and process set."""
        return (type(self).__qualname__, settings, process_set_key(process_set))

    def __repr__(self) -> str:
        return f"hvd_qsgd.{type(self).__name__}({self.settings.described(self.REPR_ALWAYS)})"

    def _policy(self, framework: str) -> FixedBits:
        """The bits policy of a new adapter (one per adapter: a policy holds per-tensor state)."""
        return FixedBits(self.settings)

    def _adapter(self, framework: str) -> Any:
        adapter = self._adapters.get(framework)   # (made once, then only read: no lock needed)
        if adapter is not None:
            return adapter
        with self._lock:
            adapter = self._adapters.get(framework)
            if adapter is None:
                common = dict(settings=self.settings, policy=self._policy(framework), process_set=self._process_set,
                              creation_index=self._creation_index)
                if framework == "torch":
                    from hvd_qsgd.adapters.torch import TorchCompressor as TorchQSGD
                    adapter = TorchQSGD(named_parameters=self._named_parameters, **common)
                else:
                    if self._named_parameters is not None:
                        raise ValueError(f"hvd_qsgd.{type(self).__name__}: named_parameters are PyTorch "
                                         "parameters; TensorFlow gradients are matched in the order they "
                                         "are traced")
                    from hvd_qsgd.adapters.tensorflow.compressor import TensorFlowCompressor as TensorFlowQSGD
                    adapter = TensorFlowQSGD(**common)
                if self._learning_rate is not None:
                    adapter.follow_learning_rate(self._learning_rate)
                self._adapters[framework] = adapter
            return adapter

    def _adapter_of(self, tensor: Any) -> Any:
        adapter = self._by_type.get(type(tensor))
        if adapter is None:
            adapter = self._by_type[type(tensor)] = self._adapter(_framework(tensor))
        return adapter

    def compress(self, tensor: Any = errors.NOT_GIVEN) -> Tuple[Any, Any]:
        if tensor is errors.NOT_GIVEN:   # (the class given as the compression: ``self`` is the tensor)
            raise errors.class_given()
        self._calls += 1
        out = self._adapter_of(tensor).compress(tensor)
        if out[1] is not None and not getattr(out[1], "uncompressed", False):   # (an uncompressed one's context)
            self._compressed += 1
        return out

    def decompress(self, tensor: Any, ctx: Any = errors.NOT_GIVEN) -> Any:
        if ctx is errors.NOT_GIVEN:
            raise errors.class_given()
        if ctx is None:
            return tensor
        return self._adapter_of(tensor).decompress(tensor, ctx)

    def bind(self, named_parameters: Iterable[Tuple[str, Any]]) -> "QSGD":
        """Match payloads by these parameter names (see ``named_parameters``); returns self."""
        self._named_parameters = list(named_parameters)
        for adapter in self._adapters.values():
            adapter.bind(self._named_parameters)
        return self

    @property
    def stats(self) -> Dict[str, Any]:
        with self._lock:
            adapters = list(self._adapters.values())
        if not adapters:
            return Stats().as_dict()
        if len(adapters) == 1:  # TensorFlow graph mode returns counter tensors: pass them through
            return adapters[0].stats
        return Stats.merge(a.stats for a in adapters)

    @property
    def PUBLIC_NAME(self) -> str:   # (``report.Summarized``)
        return f"hvd_qsgd.{type(self).__name__}"

    def _horovod_rank(self) -> int:
        return _rank(self._adapters)

    def follow_learning_rate(self, optimizer: Any) -> "QSGD":
        """Rescale error-feedback residuals when the learning rate changes (see
        ``hvd_qsgd.error_feedback``). ``optimizer``: the framework's optimizer (a
        ``torch.optim.Optimizer``, the one wrapped by Horovod, or a Keras optimizer), or a function
        of the residual's key (parameter name or position) returning the learning rate now applied
        to that tensor's update. Returns self."""
        error_feedback.check_learning_rate_source(optimizer)
        with self._lock:
            self._learning_rate = optimizer
            adapters = list(self._adapters.values())
        for adapter in adapters:
            adapter.follow_learning_rate(optimizer)
        return self

    def rescale_residuals(self, factor: float) -> None:
        """Multiply every error-feedback residual by ``factor`` (e.g. old_lr / new_lr; 0 drops them):
        a finite number >= 0, else ValueError (a NaN would poison every later gradient)."""
        if codec.is_bool(factor) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor >= 0):
            raise ValueError(f"rescale_residuals: factor must be a finite number >= 0 (0 drops the residuals), "
                             f"got {factor!r}")
        with self._lock:
            adapters = list(self._adapters.values())
        for adapter in adapters:
            adapter.rescale_residuals(factor)

    def state_dict(self) -> Dict[str, Any]:
        """Error-feedback residuals and statistics of each framework adapter."""
        with self._lock:
            return {fw: a.state_dict() for fw, a in self._adapters.items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load ``state_dict()``'s: {framework: its adapter's state} ("torch", "tensorflow")."""
        if not isinstance(state, dict) or not state.keys() <= set(FRAMEWORKS) or not all(
                isinstance(v, dict) for v in state.values()):
            got = f"keys {sorted(map(str, state))}" if isinstance(state, dict) else f"a {type(state).__name__}"
            raise ValueError(f"hvd_qsgd.{type(self).__name__}.load_state_dict: expected this compressor's "
                             f"state_dict() (a dict whose keys are {' and/or '.join(map(repr, FRAMEWORKS))}, each "
                             f"holding a dict), got {got} (a whole training checkpoint? pass the entry that holds "
                             "the compressor's state_dict())")
        for fw, sub in state.items():
            self._adapter(fw).load_state_dict(sub)

    @property
    def variables(self) -> list:
        """TensorFlow: the compressor's ``tf.Variable``s, for a ``tf.train.Checkpoint`` (those made so
        far: its exchanges make theirs as the training step is first traced)."""
        return self._adapter("tensorflow").variables


QSGD.__signature__ = Settings.signature(named_parameters=None, process_set=None)
QSGD.REPR_ALWAYS = ("bits", "bucket_size", "norm", "coding", "min_numel", "error_feedback", "reduction",
                    "server_error_feedback")   # (then every setting that is not its default)

# -- the no-op warning (hvd_qsgd.report.NeverCalledWatch) -------------------------------------------

_live: "weakref.WeakSet[QSGD]" = weakref.WeakSet()
_hooked = threading.Lock()
_hooks = {"torch": False, "atexit": False}


def _watch(compressor: QSGD) -> None:
    """Follow a new compressor: every PyTorch optimizer step counts towards its no-op warning (a
    global step hook, registered once), and at exit one that was never called in a Horovod job says
    so (TensorFlow offers no step hook)."""
    _live.add(compressor)
    with _hooked:
        optim = sys.modules.get("torch.optim.optimizer")
        if not _hooks["torch"] and hasattr(optim, "register_optimizer_step_post_hook"):
            optim.register_optimizer_step_post_hook(_on_optimizer_step)
            _hooks["torch"] = True
        if not _hooks["atexit"]:
            atexit.register(_at_exit)
            _hooks["atexit"] = True


def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    for c in list(_live):
        c._never_called.step(c._calls, repr(c), c._compressed)


def _at_exit() -> None:
    if not _horovod_initialized() or getattr(sys, "last_value", None) is not None:
        return   # (not a Horovod job; or the process ends on an unhandled error: the warning is not its cause)
    for c in list(_live):
        c._never_called.at_exit(c._calls, repr(c))


def _horovod_initialized() -> bool:
    for name in ("horovod.torch", "horovod.tensorflow"):
        module = sys.modules.get(name)
        try:
            if module is not None and module.is_initialized():
                return True
        except Exception:  # Horovod already shut down
            continue
    return False


def _rank(adapters: Dict[str, Any]) -> int:
    """This process's Horovod rank, through the framework of the first adapter (0 without one)."""
    for framework in adapters:
        module = sys.modules.get("horovod.torch" if framework == "torch" else "horovod.tensorflow")
        if module is not None:
            return int(module.rank())
    return 0


class DynamicQSGD(QSGD):
    """DQSGD: QSGD whose bits per coordinate are chosen per step and tensor from the error bound
    under a budget (``hvd_qsgd.dynamic`` states the rule; ``hvd_qsgd.policy.ScheduledBits`` runs it).

    ``hvd.DistributedOptimizer(opt, named_parameters=..., compression=hvd_qsgd.DynamicQSGD(3.0))``

    budget_bits_per_coord: b_bar, the average bits per quantized coordinate (in [min_bits, max_bits])
    min_bits, max_bits:    the range of a step's bits (default 2..8)
    discount, total_steps: 1 - alpha mu and T of the bound's horizon term (default 1: none)
    bucket_size:           elements per bucket; None (default): the QSGD paper's 128 for 2 bits and
                           512 for more, per step
    The other parameters are QSGD's, by name. ``bits_history`` of the torch adapter lists the bits
    each exchange used. In TensorFlow the schedule runs in the graph (``hvd_qsgd.adapters.tensorflow.schedule``)
    and needs a ``tf.function`` step; ``schedules()`` of the TensorFlow adapter shows its state.
    """

    def __init__(self, budget_bits_per_coord: float = 4.0, min_bits: int = 2, max_bits: int = 8,
                 discount: float = 1.0, total_steps: Optional[int] = None, bucket_size: Optional[int] = None,
                 *, named_parameters: Any = None, process_set: Any = None, **kwargs: Any):
        check_schedule_args(budget_bits_per_coord, min_bits, max_bits, discount, total_steps)
        if "bits" in kwargs:
            raise TypeError("hvd_qsgd.DynamicQSGD: the bits are chosen per step; set budget_bits_per_coord, "
                            "min_bits and max_bits instead of bits")
        self.schedule_args = dict(budget=float(budget_bits_per_coord), min_bits=int(min_bits),
                                  max_bits=int(max_bits), discount=float(discount), total_steps=total_steps)
        self.fixed_bucket_size = bucket_size
        start_bits = int(min(max_bits, max(min_bits, round(budget_bits_per_coord))))
        kwargs.update(bits=start_bits,
                      bucket_size=bucket_size if bucket_size is not None else default_bucket_size(start_bits))
        self._setup(Settings.from_arguments("hvd_qsgd.DynamicQSGD", (), kwargs), named_parameters, process_set)

    def _identity(self, settings: Settings, process_set: Any) -> Tuple[Any, ...]:
        return super()._identity(settings, process_set) + (tuple(sorted(self.schedule_args.items())),
                                                           self.fixed_bucket_size)

    def __repr__(self) -> str:
        a = self.schedule_args
        return (f"hvd_qsgd.DynamicQSGD(budget_bits_per_coord={a['budget']}, min_bits={a['min_bits']}, "
                f"max_bits={a['max_bits']}, discount={a['discount']}, total_steps={a['total_steps']}, "
                f"bucket_size={self.fixed_bucket_size}, "
                f"{self.settings.described(('norm', 'min_numel', 'error_feedback', 'reduction'), hidden=('bits',))})")

    def _policy(self, framework: str) -> ScheduledBits:
        return ScheduledBits(self.settings, self.schedule_args, self.fixed_bucket_size)


def _own_signature(cls: type, more: Optional[inspect.Signature] = None, taken: Tuple[str, ...] = ()) -> inspect.Signature:
    """What ``help()`` and ``inspect`` show for a subclass of QSGD with an ``__init__`` of its own
    (not QSGD's settings signature, which it would inherit): its parameters, then those of ``more``
    it passes on by name (keyword-only), but ``taken``."""
    own = [p for p in inspect.signature(cls.__init__).parameters.values()
           if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    names = {p.name for p in own} | set(taken)
    passed = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in (more.parameters.values() if more else ())
              if p.name not in names]
    return inspect.Signature(own + passed)


DynamicQSGD.__signature__ = _own_signature(DynamicQSGD, QSGD.__signature__, taken=("bits",))
