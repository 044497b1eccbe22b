"""``hvd_qsgd.QSGD``: the one object a user passes as ``compression=`` to Horovod.

It holds the settings, checks them once, and hands each tensor to the adapter of its framework
(``hvd_qsgd.torch.QSGD`` for PyTorch tensors), created on first use. What the adapters share lives
below it (``hvd_qsgd.settings``, ``hvd_qsgd.protocol``): this module is the top of the package.
"""
import threading

from hvd_qsgd.settings import (  # noqa: F401  (Settings, Stats: part of this module's API)
    REDUCTIONS, Settings, Stats, default_bucket_size, next_creation_index)


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
