"""Elastic Horovod training with TensorFlow (Keras 3 models) and the QSGD compressor.

    compression = hvd_qsgd.QSGD(4, error_feedback=True)
    optimizer = hvd_qsgd.tensorflow.keras.DistributedOptimizer(keras.optimizers.SGD(...),
                                                               compression=compression)
    state = hvd_qsgd.tensorflow.elastic.TensorFlowKerasState(model, optimizer,
                                                             compression=compression, step=0)

    @hvd_qsgd.tensorflow.elastic.run
    def train(state):
        train_step = tf.function(step)   # traced anew after every reset (see below)
        ...                              # the steps; state.commit() between two steps

``run``: Horovod's elastic loop (``horovod.common.elastic.run_fn``: sync, call, on a failure restore,
then reset and sync again) with a TensorFlow error filter that works here. Horovod 0.28.1's own
``horovod.tensorflow.elastic.run`` turns a ``tf.errors.UnknownError`` into ``HorovodInternalError``
only when its message contains ``HorovodAllreduce``, ``HorovodAllgather`` or ``HorovodBroadcast``,
and otherwise returns None: the error is swallowed. TensorFlow 2.21 reports a collective that failed
inside a ``tf.function`` as "Graph execution error ... horovod_allreduce ... Horovod has been shut
down ... [[{{node ...}}]]", naming the node, not the op type, so with Horovod's decorator the
survivors of a killed worker leave the training function at the failed step as if training had
ended. Nor does the message always say Horovod was shut down: a collective that was
under way when the peer died carries Gloo's error ("[.../gloo/transport/tcp/pair.cc:589] Read error
... Connection reset by peer"). ``run`` treats a ``tf.errors.OpError`` whose message says Horovod was
shut down, holds a Gloo error or names a Horovod collective op (alltoall included) as
``HorovodInternalError``, and re-raises every other error as it is (the codec's own errors, such as
a failed control check, included). A reset is ``hvd.shutdown()`` then ``hvd.init()``.

``TensorFlowKerasState(model, optimizer, **kwargs)``: the model's and the optimizer's variables
(Keras 3, or tf.Variables; the optimizer is built for the model's trainable variables if it is not
yet, so that a new worker has the same variables before its first step), the QSGD compressors among
``kwargs`` (``hvd_qsgd.QSGD`` or ``hvd_qsgd.tensorflow.QSGD``, kept as attributes of those names;
the compressor of the package's Keras 3 ``DistributedOptimizer`` given as ``optimizer`` is found
even when it is not passed), and any other keyword as a Python value (Horovod's ``ObjectState``). What happens, for the variables:
commit copies them to host memory, restore assigns the copy back, sync assigns rank 0's values
(``hvd.broadcast_variables``). For each compressor:

    commit:   its statistics and exchange counters are saved (a few integers; the residuals are not
              copied). The exchange counters are the number of exchanges traced so far (``seq``,
              which names them) and the occurrence counter of each traced exchange, by state key
              (``<function name>:<position>``; the payload seeds' occurrence)
    restore:  (a collective failed, ``HorovodInternalError``) statistics and exchange counters go
              back to the last commit, as the model and optimizer do
    reset:    (after every reset: a failure, or hosts added or removed) exchanges in flight are
              forgotten and every error-feedback residual is zeroed, on every rank; the exchange
              counters are those of the last commit
    sync:     every rank checks that its compressor has rank 0's creation index (the ``k`` of
              ``hvd_qsgd_<k>_s<seq>``), creates the occurrence counters and residuals (zero) rank 0
              has and it lacks, and takes rank 0's exchange counters

Residuals are zeroed, not rolled back. Rank r's residual is the part of its own gradients that
quantization has not yet delivered, owed to an average over the n ranks of the old world. After a
reset that debt cannot be settled: a failed rank's residual died with it, the survivors' residuals
would be paid at 1/n' instead of 1/n, ranks and data shards are reassigned, and a new worker has no
residual. Zero on every rank is the state a newly started job has, and every rank, new or old, reaches
it without exchanging per-rank data: training goes on as an error-feedback run started from the
committed model. What is lost is bounded: each residual element is at most one quantization step of
its bucket, the error plain QSGD leaves in every step. The residual variables stay (zeroed), so the
traced functions that read them stay valid.

Trace the training step anew after every reset: create its ``tf.function`` inside the function
``run`` wraps. A trace holds the world size, this rank's rank and the exchange names as constants; a
step traced for the old world would fail the control check. The new trace has the same function
name, so it finds its state keys' variables (residuals, occurrence counters) again; on every rank its
exchanges are numbered from the same ``seq`` (a trace that makes the compressor's variables is
traced once: ``state.state_variable``). A new worker creates rank 0's variables at the sync, before
its first trace, where its residual layout is checked against rank 0's.

Statistics are per process: a survivor's are rolled back to the commit (the undone steps are done
again and counted then), a new worker's start at zero. Commit between steps. Elastic training needs
the global process set, in eager execution (TensorFlow 2), with a fixed-bits compressor (a bits
schedule, ``DynamicQSGD``, is not carried and is refused, and so is server error feedback).
"""
import tensorflow as tf
import horovod.tensorflow as hvd
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HorovodInternalError
from horovod.tensorflow.functions import broadcast_object

import hvd_qsgd
from hvd_qsgd import protocol
from hvd_qsgd.adapters.tensorflow.compressor import TensorFlowCompressor as TensorFlowQSGD
from hvd_qsgd.policy import FixedBits
from hvd_qsgd.tensorflow.tape import tf_variables

WHO = "hvd_qsgd.tensorflow.elastic"

# what the message of a failed Horovod collective holds: the shutdown notice, or Gloo's own error (a
# collective that was under way when a peer died: "[.../gloo/transport/tcp/pair.cc:589] Read error",
# "Timed out waiting ..."), or, from an eager op, the op type
HOROVOD_FAILURE = ("Horovod has been shut down", "/gloo/", "HorovodAllreduce", "HorovodGroupedAllreduce",
                   "HorovodAllgather", "HorovodBroadcast", "HorovodAlltoall", "HorovodReducescatter")


def is_horovod_failure(error) -> bool:
    """Whether ``error`` is a TensorFlow op error raised by a failed Horovod collective."""
    return isinstance(error, tf.errors.OpError) and any(s in (error.message or "") for s in HOROVOD_FAILURE)


def _reinit():
    hvd.shutdown()
    hvd.init()


def run(func):
    """Decorator of the elastic training function (see the module docstring)."""

    def attempt(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as e:
            if is_horovod_failure(e):
                raise HorovodInternalError(e) from e
            raise

    return run_fn(attempt, _reinit)


def is_qsgd(obj) -> bool:
    """Whether ``obj`` is a QSGD compressor (``hvd_qsgd.QSGD`` or ``hvd_qsgd.tensorflow.QSGD``)."""
    return isinstance(obj, (hvd_qsgd.QSGD, TensorFlowQSGD))


def tf_adapter(compression):
    """The ``hvd_qsgd.tensorflow.QSGD`` that compresses TensorFlow tensors for ``compression`` (created
    now for an ``hvd_qsgd.QSGD`` that has not compressed any yet, as its first tensor would)."""
    if isinstance(compression, TensorFlowQSGD):
        adapter = compression
    elif isinstance(compression, hvd_qsgd.QSGD):
        adapter = compression._adapter("tensorflow")
    else:
        raise TypeError(f"{WHO}: expected an hvd_qsgd.QSGD or hvd_qsgd.tensorflow.QSGD, "
                        f"got {type(compression).__name__}")
    if type(adapter.policy) is not FixedBits:
        raise ValueError(f"{WHO}: the compressor's {type(adapter.policy).__name__} policy keeps state the "
                         "elastic state does not carry (it would not be rolled back or synchronised); use a "
                         "fixed-bits QSGD")
    if adapter.settings.server_error_feedback and adapter.settings.reduction != "allgather":
        raise ValueError(f"{WHO}: server error feedback (server_error_feedback=True) is not carried by the "
                         "elastic state yet (its residuals belong to a chunk of the old world); pass "
                         "server_error_feedback=False")
    return adapter


class Variables:
    """A list of tf.Variables: a host copy (commit), assigned back (restore), rank 0's values (sync)."""

    def __init__(self, variables):
        self.variables = tf_variables(variables)
        self._saved = None
        self.save()

    def save(self):
        self._saved = [v.numpy() for v in self.variables]

    def restore(self):
        for v, value in zip(self.variables, self._saved):
            v.assign(value)

    def sync(self):
        if self.variables:
            hvd.broadcast_variables(self.variables, root_rank=0)
        self.save()


class CompressorState:
    """The elastic state of one QSGD compressor (see the module docstring)."""

    def __init__(self, compression, name):
        self.compression, self.name = compression, name
        tf_adapter(compression)  # a TypeError now rather than at the first commit
        self._saved = None
        self.save()

    def save(self):
        adapter = tf_adapter(self.compression)
        self._saved = {"stats": adapter.stats, "counters": adapter.exchange_counters()}

    def restore(self):
        adapter = tf_adapter(self.compression)
        adapter.load_stats(self._saved["stats"])
        adapter.load_exchange_counters(self._saved["counters"])

    def reset(self):
        adapter = tf_adapter(self.compression)
        adapter.reset(residuals=True)
        adapter.load_exchange_counters(self._saved["counters"])

    def sync(self):
        adapter = tf_adapter(self.compression)
        mine = {"creation_index": adapter._creation_index, "counters": adapter.exchange_counters(),
                "layout": adapter.residual_layout()}
        root = broadcast_object(mine, root_rank=0, name=f"hvd_qsgd.elastic.{self.name}")
        if root["creation_index"] != mine["creation_index"]:
            raise protocol.MismatchError(
                f"{WHO}: the compressor {self.name!r} has creation index {mine['creation_index']} on this "
                f"worker and {root['creation_index']} on rank 0: create the compressors once, in the same "
                "order on every worker, before the elastic training function")
        adapter.create_residuals(root["layout"])
        adapter.load_exchange_counters(root["counters"])
        self._saved["counters"] = root["counters"]


class TensorFlowKerasState(ObjectState):
    """Elastic state of a Keras 3 model, its optimizer and QSGD compressors (module docstring).

    model: a built Keras model; optimizer: its optimizer (default ``model.optimizer``), built for the
    model's trainable variables if it is not yet; kwargs: QSGD compressors (attributes of those
    names, carried as the module docstring says) and other values (Horovod's ``ObjectState``)."""

    def __init__(self, model, optimizer=None, **kwargs):
        if not getattr(model, "built", True):
            raise ValueError(f"{WHO}: the model is not built; build it (an Input, or model.build(shape)) "
                             "before creating the state, so that every worker has the same variables")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is not None and not getattr(optimizer, "built", True):
            optimizer.build(model.trainable_variables)
        if not tf.executing_eagerly():
            raise RuntimeError(f"{WHO}: needs eager execution (TensorFlow 2)")
        self.model, self.optimizer = model, optimizer
        own = list(model.variables) + (list(optimizer.variables) if optimizer is not None else [])
        self._variables = Variables(own)
        self._compressors = []
        for k in [k for k, v in kwargs.items() if is_qsgd(v)]:
            compression = kwargs.pop(k)
            self._compressors.append(CompressorState(compression, k))
            setattr(self, k, compression)
        inner = getattr(optimizer, "compression", None)   # (the package's Keras 3 DistributedOptimizer's)
        if is_qsgd(inner) and all(tf_adapter(inner) is not tf_adapter(c.compression) for c in self._compressors):
            self._compressors.append(CompressorState(inner, "optimizer.compression"))
        super().__init__(bcast_object=broadcast_object, get_rank=hvd.rank, **kwargs)

    def save(self):
        self._variables.save()
        for c in self._compressors:
            c.save()
        super().save()

    def restore(self):
        self._variables.restore()
        for c in self._compressors:
            c.restore()
        super().restore()

    def reset(self):
        for c in self._compressors:
            c.reset()
        super().reset()

    def sync(self):
        self._variables.sync()
        for c in self._compressors:
            c.sync()
        super().sync()
