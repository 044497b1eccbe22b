"""QSGD as a Horovod TensorFlow ``Compressor``, reduced by an allgather of payloads, in-graph.

The same exchange as the PyTorch adapter (``hvd_qsgd/torch/compressor.py``), built from TensorFlow
ops so it runs inside ``tf.function`` training steps and ``tf.compat.v1`` graphs:

    compress(g):    payload = QsgdEncode(g [+ e], occurrence)           (the kernels' CPU encoder)
                    return the control vector (a float64 constant) for Horovod's allreduce
    decompress(r):  alpha = QsgdCheckControl(r)                          (fails on every rank alike)
                    gathered = hvd.allgather(payload), after alpha          (control dependency)
                    return cast(QsgdDecodeSum(gathered, alpha), g.dtype)

The allgather is ordered after the check, so a rank never waits on an allgather another rank did not
start: a mismatch fails the step with ``InvalidArgumentError`` on every rank. Exchanges are numbered
in the order ``compress`` is called (``hvd_qsgd_<k>_s<seq>``; under ``tf.function`` that is while
tracing), which is the same on every rank that runs the same program; a different order is
detected, not hung on. Per-exchange variables are keyed by the enclosing function's name and the
position within its trace, so a retrace reuses what the first trace created.

State lives in ``tf.Variable``s created outside the traced function (``tf.init_scope``): for each
traced exchange an int64 occurrence counter (the payload seed is
``protocol.payload_seed(seed, rank, exchange, occurrence)``, computed by the op) and, with
``error_feedback``, the float32 residual ``e <- (g + e) - decode(encode(g + e))``; and the statistics
counters. In eager execution (no ``tf.function``) every call is a new exchange with occurrence 0;
error feedback needs a ``tf.function`` step (its residual must persist per traced tensor).
"""
import weakref

import tensorflow as tf
from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph
import horovod.tensorflow as hvd
from horovod.tensorflow.compression import Compressor

from hvd_qsgd import codec, protocol
from hvd_qsgd.compressor import Stats, init_adapter, set_ranks as process_set_ranks
from hvd_qsgd.tensorflow import ops as qops

_SOURCE_DTYPES = {tf.float32: "float32", tf.float16: "float16", tf.bfloat16: "bfloat16"}


class _Raw:
    """The context of an uncompressed floating-point tensor sent as float64."""

    __slots__ = ("dtype",)

    def __init__(self, dtype):
        self.dtype = dtype


class _Exchange:
    """The context of one compressed tensor between compress and decompress."""

    __slots__ = ("name", "where", "payload", "x32", "residual", "shape", "dtype",
                 "numel", "set_ranks", "fingerprint")


class QSGD(Compressor):
    """QSGD compression for ``horovod.tensorflow`` (see ``hvd_qsgd.QSGD`` for the parameters).

    Hashable by identity: Horovod caches traced functions by compressor."""

    def __init__(self, bits=4, bucket_size=None, norm="max", coding="fixed", min_numel=10000, seed=0,
                 error_feedback=False, checksum=True, reduction="allgather", process_set=None, *,
                 settings=None, creation_index=None):
        init_adapter(self, settings, (bits, bucket_size, norm, coding, min_numel, seed, error_feedback, checksum,
                                      reduction), creation_index, process_set, hvd.global_process_set)
        self._seq = 0
        self._positions = weakref.WeakKeyDictionary()   # traced function graph -> exchanges so far
        self.traced_exchanges = []                      # (exchange name, function) of every trace
        self._counters = None
        self._residuals = {}
        self._occurrences = {}

    def __repr__(self):
        return f"hvd_qsgd.tensorflow.QSGD({self.settings})"

    def _counter_vars(self):
        if self._counters is None:
            with tf.init_scope():
                self._counters = {k: tf.Variable(0, dtype=tf.int64, trainable=False,
                                                 name=f"hvd_qsgd_{self._creation_index}_{k}")
                                  for k in Stats.FIELDS}
        return self._counters

    def _next_exchange(self):
        """(sequence number, state key) of the next exchange.

        Sequence numbers name exchanges; they count every compress call of this compressor, which
        every rank running the same program makes in the same order. The state key names the
        exchange's variables: ``<function>:<position>`` within the current trace of the nearest
        enclosing tf.function (tf.cond/while branches are part of their function), so that a retrace
        finds the variables its first trace created. None in eager execution."""
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
            if tf.executing_eagerly():
                return seq, None
            g = tf.compat.v1.get_default_graph()
            while isinstance(g, ControlFlowFuncGraph):
                g = g.outer_graph
            position = self._positions.get(g, 0)
            self._positions[g] = position + 1
            self.traced_exchanges.append((f"hvd_qsgd_{self._creation_index}_s{seq}", getattr(g, "name", "graph")))
            return seq, f"{getattr(g, 'name', 'graph')}:{position}"

    def _state(self, store, name, make):
        """The variable ``name`` in ``store``, created outside any traced function on first use."""
        v = store.get(name)
        if v is None:
            with tf.init_scope():
                v = store[name] = make()
        return v

    def _count(self, **amounts):
        counters = self._counter_vars()
        return [counters[k].assign_add(tf.cast(v, tf.int64)) for k, v in amounts.items()]

    # -- Compressor interface -----------------------------------------------------------------

    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor):
        if isinstance(tensor, tf.IndexedSlices):
            return tensor, None
        tensor = tf.convert_to_tensor(tensor)
        s = self.settings
        if (tensor.dtype not in _SOURCE_DTYPES or not tensor.shape.is_fully_defined()
                or tensor.shape.num_elements() < s.min_numel):
            n = tensor.shape.num_elements()
            if n is None:
                n = tf.size(tensor)
            with tf.control_dependencies(self._count(raw_elements=n, raw_tensors=1)):
                if tensor.dtype.is_floating and tensor.dtype != tf.float64:
                    # float64 like the control vectors, so that a grouped allreduce (one dtype per
                    # group in TensorFlow) can hold both; cast back in decompress
                    return tf.cast(tensor, tf.float64), _Raw(tensor.dtype)
                return tf.identity(tensor), None
        seq, state_key = self._next_exchange()
        ps = self._process_set
        set_ranks = process_set_ranks(ps, hvd.size())
        world, grank = hvd.size(), hvd.rank()
        if grank not in set_ranks:
            raise ValueError(f"hvd_qsgd: this rank (global rank {grank}) is not in the compressor's process "
                             f"set {set_ranks}; pass the optimizer's process_set= to the compressor")
        set_rank = set_ranks.index(grank)
        ctx = _Exchange()
        ctx.name = f"hvd_qsgd_{self._creation_index}_s{seq}"
        ctx.where = f"hvd_qsgd: compressed tensor s{seq} (shape {tuple(tensor.shape.as_list())})"
        ctx.shape, ctx.dtype = tensor.shape, tensor.dtype
        ctx.numel, ctx.set_ranks = tensor.shape.num_elements(), set_ranks
        ctx.fingerprint = codec.tensor_fingerprint("", tensor.shape.as_list(), _SOURCE_DTYPES[tensor.dtype])
        eager = tf.executing_eagerly()
        if eager:
            occurrence = tf.constant(0, tf.int64)
        else:
            counter = self._state(self._occurrences, state_key, lambda: tf.Variable(
                0, dtype=tf.int64, trainable=False, name=f"{ctx.name}_occurrence"))
            occurrence = counter.assign_add(1) - 1
        x = tensor
        ctx.residual = None
        if s.error_feedback:
            if eager:
                raise ValueError("hvd_qsgd.tensorflow.QSGD(error_feedback=True) needs a tf.function training "
                                 "step: residuals are kept per traced tensor")
            ctx.residual = self._state(self._residuals, state_key, lambda: tf.Variable(
                tf.zeros([ctx.numel], tf.float32), trainable=False, name=f"{ctx.name}_residual"))
            if ctx.residual.shape.num_elements() != ctx.numel:
                raise ValueError(f"{ctx.where}: its error-feedback residual ({state_key}) has "
                                 f"{ctx.residual.shape.num_elements()} elements: the function handed the "
                                 "compressor other tensors in this position when it was first traced")
            x = tf.reshape(tf.cast(tensor, tf.float32), [-1]) + ctx.residual
        ctx.x32 = x
        ctx.payload = qops.load().qsgd_encode(
            x, occurrence, bits=s.bits, bucket_size=s.bucket_size, norm=codec.NORMS[s.norm],
            coding=codec.CODINGS[s.coding], dtype_code=codec.DTYPES[_SOURCE_DTYPES[tensor.dtype]],
            checksum=s.checksum, seed=qops.as_int64_attr(protocol.exchange_seed(s.seed, set_rank, ctx.name)),
            fingerprint=qops.as_int64_attr(ctx.fingerprint), where=ctx.where)
        tags = protocol.exchange_tags(len(set_ranks), self._creation_index, self._settings_tag, 2 * seq)
        control = tf.constant(protocol.control_vector(world, grank, set_rank, tags), dtype=tf.float64,
                              name=f"{ctx.name}_control")
        return control, ctx

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        if isinstance(ctx, _Raw):
            return tf.cast(tensor, ctx.dtype)
        s, ops = self.settings, qops.load()
        alpha = ops.qsgd_check_control(tf.cast(tensor, tf.float64), world=hvd.size(), set_ranks=ctx.set_ranks,
                                       tag_names=list(protocol.TAG_NAMES), where=ctx.where)
        with tf.control_dependencies([alpha]):
            payload = tf.identity(ctx.payload)
        gathered = hvd.allgather(payload, name=ctx.name, ignore_name_scope=True, process_set=self._process_set)
        decode_attrs = dict(numel=ctx.numel, bits=s.bits, bucket_size=s.bucket_size, norm=codec.NORMS[s.norm],
                            coding=codec.CODINGS[s.coding],
                            dtype_code=codec.DTYPES[_SOURCE_DTYPES[ctx.dtype]],
                            fingerprint=qops.as_int64_attr(ctx.fingerprint), where=ctx.where)
        out = ops.qsgd_decode_sum(gathered, alpha, count=len(ctx.set_ranks), **decode_attrs)
        sent = tf.size(ctx.payload, out_type=tf.int64)
        deps = self._count(elements=ctx.numel, bytes_sent=sent, tensors=1,
                           bytes_received=tf.size(gathered, out_type=tf.int64) - sent)
        if ctx.residual is not None:
            own = ops.qsgd_decode_sum(ctx.payload, tf.constant(1.0), count=1, **decode_attrs)
            deps.append(ctx.residual.assign(ctx.x32 - own))
        with tf.control_dependencies(deps):
            return tf.cast(tf.reshape(out, ctx.shape), ctx.dtype)

    # -- state --------------------------------------------------------------------------------

    @property
    def stats(self):
        """Cumulative counters (see ``hvd_qsgd.compressor.Stats``): numbers when executing eagerly,
        the counter tensors otherwise (evaluate them in a session)."""
        counters = self._counter_vars()
        if not tf.executing_eagerly():
            return dict(counters)
        d = {k: int(v.numpy()) for k, v in counters.items()}
        d["ratio"] = protocol.ratio(d["elements"], d["bytes_sent"])
        return d

    @property
    def variables(self):
        """The compressor's tf.Variables (statistics, occurrence counters, error-feedback residuals),
        for a ``tf.train.Checkpoint``."""
        return (list(self._counter_vars().values()) + list(self._occurrences.values())
                + list(self._residuals.values()))

    def state_dict(self):
        """Statistics and residuals as NumPy values (eager execution)."""
        return {"stats": self.stats, "residuals": {k: v.numpy() for k, v in self._residuals.items()}}

    def load_state_dict(self, state):
        for k, v in state.get("stats", {}).items():
            if k in Stats.FIELDS:
                self._counter_vars()[k].assign(int(v))
        for k, v in state.get("residuals", {}).items():
            if k in self._residuals:
                self._residuals[k].assign(v)

