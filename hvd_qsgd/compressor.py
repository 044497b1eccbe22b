"""``hvd_qsgd.QSGD``: the one object a user passes as ``compression=`` to Horovod.

It holds the settings, checks them once, and hands each tensor to the adapter of its framework
(``hvd_qsgd.torch.QSGD`` for PyTorch tensors), created on first use. Everything a framework adapter
shares that is not framework API lives here and in ``hvd_qsgd.protocol``: the settings and their
defaults, the statistics, and the creation index that names a compressor's exchanges.

Defaults follow the QSGD paper's experiments (section 5): max-norm scaling, bucket size 512 for
4 and 8 bits and 128 for 2 bits or fewer, and tensors of fewer than 10,000 elements left
unquantized (they go through Horovod's own allreduce, with the same Sum/Average semantics).
"""
import itertools
import threading
from dataclasses import asdict, dataclass

from hvd_qsgd import codec, cost_model, protocol

REDUCTIONS = ("allgather", "scatter_allgather", "auto")
_creation_counter = itertools.count()
_creation_lock = threading.Lock()


def next_creation_index():
    """Compressors are numbered in creation order; the number is part of their exchange names, so
    every rank must create its compressors in the same order (a mismatch is detected, not hung on)."""
    with _creation_lock:
        return next(_creation_counter)


def set_ranks(process_set, world_size):
    """The global ranks of a Horovod process set, ascending (the global set: all ``world_size``)."""
    if process_set.process_set_id == 0:
        return list(range(world_size))
    if process_set.ranks is None:
        raise ValueError("hvd_qsgd: the compressor's process set was not registered with Horovod "
                         "(hvd.init(process_sets=...) or hvd.add_process_set)")
    return sorted(process_set.ranks)


def init_adapter(adapter, settings, settings_args, creation_index, process_set, global_process_set):
    """The state every framework adapter starts with: its settings (given, or made from the
    constructor's arguments), creation index, process set, settings tag and lock."""
    adapter.settings = settings or Settings.make(*settings_args)
    adapter._creation_index = next_creation_index() if creation_index is None else creation_index
    adapter._process_set = process_set if process_set is not None else global_process_set
    adapter._lock = threading.Lock()


def default_bucket_size(bits):
    return 128 if bits <= 2 else 512


@dataclass(frozen=True)
class Settings:
    """Compressor settings. Those in ``tag()`` must agree on every rank; ``seed``, ``checksum``,
    ``error_feedback`` and ``server_error_feedback`` are each rank's own choice."""

    bits: int = 4
    bucket_size: int = 512
    norm: str = "max"
    coding: str = "fixed"
    min_numel: int = 10000
    seed: int = 0
    error_feedback: bool = False
    checksum: bool = True
    reduction: str = "allgather"
    server_error_feedback: bool = False

    @classmethod
    def make(cls, bits=4, bucket_size=None, norm="max", coding="fixed", min_numel=10000, seed=0,
             error_feedback=False, checksum=True, reduction="allgather", server_error_feedback=False):
        """Settings with every parameter checked (ValueError naming the parameter)."""
        if bucket_size is None:
            bucket_size = default_bucket_size(codec._check_bits(bits))
        codec.make_config(bits, bucket_size, norm, seed, coding)  # checks bits, bucket, norm, coding, seed
        if not codec.is_integer(min_numel) or min_numel < 1:
            raise ValueError(f"min_numel must be a positive integer, got {min_numel!r}")
        if not isinstance(reduction, str) or reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        for name, flag in (("error_feedback", error_feedback), ("checksum", checksum),
                           ("server_error_feedback", server_error_feedback)):
            if not codec.is_bool(flag):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        return cls(int(bits), int(bucket_size), norm, coding, int(min_numel), int(seed),
                   bool(error_feedback), bool(checksum), reduction, bool(server_error_feedback))

    def replace(self, **changes):
        """These settings with some fields changed (checked as ``make`` checks them)."""
        return Settings.make(**{**asdict(self), **changes})

    def tag(self, reduction=None):
        """The settings every rank must share, hashed into a control-vector tag; ``reduction`` is the
        reduction an exchange resolved to (``exchange_reduction``), so ranks that resolve "auto"
        differently are told apart too."""
        return protocol.small_hash(f"{self.bits}|{self.bucket_size}|{self.norm}|{self.coding}|"
                                   f"{self.min_numel}|{self.reduction}|{reduction or self.reduction}")

    def exchange_reduction(self, n, numel):
        """The reduction of one exchange of a numel-element tensor among n ranks: the setting, or for
        "auto" the faster by ``cost_model.choose`` (the same on every rank: it depends on n, numel and
        the settings only)."""
        if self.reduction == "auto":
            return cost_model.choose(n, numel, self.bits, self.bucket_size)
        return self.reduction

    def as_dict(self):
        return asdict(self)


class Stats:
    """Cumulative counters of one rank, safe to update from several threads.

    elements:       elements of the tensors this rank compressed
    bytes_sent:     payload bytes this rank put on the wire (its own payloads)
    bytes_received: payload bytes this rank took off the wire (the other ranks' payloads)
    ratio:          4 * elements / bytes_sent, the size of fp32 over what was sent
    tensors:        compressed exchanges; raw_elements / raw_tensors: those sent uncompressed
    """

    FIELDS = ("elements", "bytes_sent", "bytes_received", "tensors", "raw_elements", "raw_tensors")

    def __init__(self):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)

    def add(self, **counts):
        with self._lock:
            for k, v in counts.items():
                self._values[k] += int(v)

    def as_dict(self):
        with self._lock:
            d = dict(self._values)
        d["ratio"] = protocol.ratio(d["elements"], d["bytes_sent"])
        return d

    def load(self, values):
        with self._lock:
            for k in self.FIELDS:
                self._values[k] = int(values.get(k, 0))

    @staticmethod
    def merge(dicts):
        total = dict.fromkeys(Stats.FIELDS, 0)
        for d in dicts:
            for k in Stats.FIELDS:
                total[k] += d[k]
        total["ratio"] = protocol.ratio(total["elements"], total["bytes_sent"])
        return total


def _framework(tensor):
    module = type(tensor).__module__ or ""
    if module.startswith("torch"):
        return "torch"
    if module.startswith(("tensorflow", "keras", "tf_keras")):
        return "tensorflow"
    raise TypeError(f"hvd_qsgd.QSGD: cannot compress a {type(tensor).__module__}.{type(tensor).__name__}; "
                    "it compresses PyTorch tensors (and TensorFlow tensors where supported)")


class QSGD:
    """QSGD gradient compression for Horovod (Alistarh et al., NeurIPS 2017).

    ``hvd.DistributedOptimizer(opt, named_parameters=..., compression=hvd_qsgd.QSGD(4))``.

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
    reduction:       "allgather" (every rank receives every payload: (n-1) P bytes), "scatter_allgather"
                     (alltoall of chunks, reduce, allgather of the re-quantized chunks: 2 (n-1)/n P
                     bytes, flat in n; see ``hvd_qsgd.reduction``) or "auto" (per tensor, the faster
                     by the latency/bandwidth model of ``hvd_qsgd.cost_model``)
    named_parameters: (name, parameter) pairs, as given to Horovod's optimizer: payloads are then
                     matched by parameter name, so ranks may hand gradients over in any order
    process_set:     Horovod process set of the reduction (default: all ranks)
    server_error_feedback: with scatter_allgather, the rank that reduces chunk j keeps the residual
                     of its re-quantization and adds it to chunk j's sum next time (two-way error
                     feedback, as dist-EF-SGDM's server; ``hvd_qsgd.error_feedback``)

    ``stats`` is a dict of cumulative counters (see ``Stats``).
    """

    def __init__(self, bits=4, bucket_size=None, norm="max", coding="fixed", min_numel=10000, seed=0,
                 error_feedback=False, checksum=True, reduction="allgather", named_parameters=None,
                 process_set=None, server_error_feedback=False):
        self.settings = Settings.make(bits, bucket_size, norm, coding, min_numel, seed, error_feedback,
                                      checksum, reduction, server_error_feedback)
        self._named_parameters = None if named_parameters is None else list(named_parameters)
        self._process_set = process_set
        self._creation_index = next_creation_index()
        self._adapters = {}
        self._lock = threading.Lock()
        self._learning_rate = None

    def __repr__(self):
        s = self.settings
        return (f"hvd_qsgd.{type(self).__name__}(bits={s.bits}, bucket_size={s.bucket_size}, norm={s.norm!r}, "
                f"coding={s.coding!r}, min_numel={s.min_numel}, error_feedback={s.error_feedback}, "
                f"reduction={s.reduction!r}, server_error_feedback={s.server_error_feedback})")

    def _adapter_options(self):
        """Keyword arguments a subclass adds to its framework adapters."""
        return {}

    def _torch_adapter_class(self):
        from hvd_qsgd.torch import QSGD as TorchQSGD
        return TorchQSGD

    def _tensorflow_adapter_class(self):
        from hvd_qsgd.tensorflow import QSGD as TensorFlowQSGD
        return TensorFlowQSGD

    def _adapter(self, framework):
        with self._lock:
            adapter = self._adapters.get(framework)
            if adapter is None:
                if framework == "torch":
                    adapter = self._torch_adapter_class()(
                        settings=self.settings, named_parameters=self._named_parameters,
                        process_set=self._process_set, creation_index=self._creation_index,
                        **self._adapter_options())
                else:
                    if self._named_parameters is not None:
                        raise ValueError(f"hvd_qsgd.{type(self).__name__}: named_parameters are PyTorch "
                                         "parameters; TensorFlow gradients are matched in the order they "
                                         "are traced")
                    adapter = self._tensorflow_adapter_class()(
                        settings=self.settings, process_set=self._process_set,
                        creation_index=self._creation_index, **self._adapter_options())
                if self._learning_rate is not None:
                    adapter.follow_learning_rate(self._learning_rate)
                self._adapters[framework] = adapter
            return adapter

    def compress(self, tensor):
        return self._adapter(_framework(tensor)).compress(tensor)

    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        return self._adapter(_framework(tensor)).decompress(tensor, ctx)

    def bind(self, named_parameters):
        """Match payloads by these parameter names (see ``named_parameters``); returns self."""
        self._named_parameters = list(named_parameters)
        for adapter in self._adapters.values():
            adapter.bind(self._named_parameters)
        return self

    @property
    def stats(self):
        with self._lock:
            adapters = list(self._adapters.values())
        if not adapters:
            return Stats().as_dict()
        if len(adapters) == 1:  # TensorFlow graph mode returns counter tensors: pass them through
            return adapters[0].stats
        return Stats.merge(a.stats for a in adapters)

    def follow_learning_rate(self, optimizer):
        """Rescale error-feedback residuals when the learning rate changes (see
        ``hvd_qsgd.error_feedback``). ``optimizer``: the framework's optimizer (a
        ``torch.optim.Optimizer``, the one wrapped by Horovod, or a Keras optimizer), or a function
        of the residual's key (parameter name or position) returning the learning rate now applied
        to that tensor's update. Returns self."""
        with self._lock:
            self._learning_rate = optimizer
            adapters = list(self._adapters.values())
        for adapter in adapters:
            adapter.follow_learning_rate(optimizer)
        return self

    def rescale_residuals(self, factor):
        """Multiply every error-feedback residual by ``factor`` (e.g. old_lr / new_lr)."""
        with self._lock:
            adapters = list(self._adapters.values())
        for adapter in adapters:
            adapter.rescale_residuals(factor)

    def state_dict(self):
        """Error-feedback residuals and statistics of each framework adapter."""
        with self._lock:
            return {fw: a.state_dict() for fw, a in self._adapters.items()}

    def load_state_dict(self, state):
        for fw, sub in state.items():
            self._adapter(fw).load_state_dict(sub)
