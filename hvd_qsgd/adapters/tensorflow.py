"""QSGD as a Horovod TensorFlow ``Compressor``, reduced in-graph by an allgather of payloads or by
the scatter_allgather reduction of ``hvd_qsgd.reduction``.

The same exchange as the PyTorch adapter (``hvd_qsgd/adapters/torch.py``), built from TensorFlow
ops so it runs inside ``tf.function`` training steps and ``tf.compat.v1`` graphs. Each exchange
resolves its reduction with ``settings.exchange_reduction(n, numel)`` ("auto" picks per tensor by
``hvd_qsgd.cost_model``, alike on every rank); the resolved reduction is part of the settings tag
of the control vector, so ranks that resolve differently fail the check instead of hanging.

allgather (every rank receives every payload)::

    compress(g):    payload = QsgdEncode(g [+ e], occurrence)           (the kernels' CPU encoder)
                    return the control vector (a float64 constant) for Horovod's allreduce
    decompress(r):  alpha = QsgdCheckControl(r)                          (fails on every rank alike)
                    gathered = hvd.allgather(payload), after alpha          (control dependency)
                    return cast(QsgdDecodeSum(gathered, alpha), g.dtype)

scatter_allgather (rank j reduces chunk j; ``hvd_qsgd.reduction`` states the algorithm)::

    compress(g):    payloads, splits = QsgdEncodeChunks(g [+ e], occurrence)   (n chunk payloads)
                    return the control vector
    decompress(r):  alpha = QsgdCheckControl(r)
                    received, rsplits = hvd.alltoall(payloads, splits), after alpha   ("<exchange>_scatter")
                    reduced, error = QsgdReduceChunk(received, rsplits, occurrence)
                    gathered = hvd.allgather(reduced)                        ("<exchange>_gather")
                    lengths = hvd.allgather([len(reduced)])                  ("<exchange>_gather_splits")
                    return cast(QsgdDecodeChunks(gathered, lengths, alpha, error), g.dtype)

The phase-2 lengths travel by a second, int32 allgather of each rank's reduced-payload length (4
bytes a rank), not inside the payload bytes: the decode then knows every rank's slot, including an
empty one, without parsing headers, and the payloads on the wire are exactly the codec's. Payloads
are never padded: Elias-coded (variable-length) chunks travel at their own lengths in both phases.
QsgdReduceChunk never fails the step: a rank whose received payloads fail their checks sends an
empty reduced payload (and keeps its reason in ``error``), so every rank still joins the phase-2
allgathers, sees the empty slot and raises ``InvalidArgumentError`` naming the ranks that could not
reduce (with this rank's own reason, when it is one of them).

A collective is ordered after the control check, so a rank never waits on a collective another rank
did not start: a mismatch fails the step with ``InvalidArgumentError`` on every rank. Exchanges are
numbered in the order ``compress`` is called (``hvd_qsgd_<k>_s<seq>``; under ``tf.function`` that
is while tracing), which is the same on every rank that runs the same program; a different order is
detected, not hung on. Per-exchange variables are keyed by the enclosing function's name and the
position within its trace, so a retrace reuses what the first trace created.

State lives in ``tf.Variable``s created outside the traced function (``tf.init_scope``): for each
traced exchange an int64 occurrence counter (the payload seed is
``protocol.payload_seed(seed, rank, exchange, occurrence)``, computed by the op; scatter_allgather
derives its chunk seeds from it as ``reduction.chunk_seed``) and, with ``error_feedback``, the
float32 residual ``e <- (g + e) - decode(own payload(s))`` (scatter_allgather: the decode of this
rank's n phase-1 chunk payloads); and the statistics counters. ``bytes_sent`` counts this rank's
payload bytes put on the wire once each: its payload (allgather), or its phase-1 chunks for the other
ranks plus its reduced chunk (scatter_allgather); ``bytes_received`` counts the other ranks'
payloads this rank received, in both phases (its own slots excluded; the 4-byte phase-2 lengths are
not payload and are not counted). In eager execution (no ``tf.function``) every call is a new
exchange, seeded as occurrence 0 of ``hvd_qsgd_<k>_s<seq>``; error feedback needs a ``tf.function``
step (its residual must persist per traced tensor).

DQSGD (a ``ScheduledBits`` policy): the codec ops take their bits as attrs, so compress and
decompress are each a ``tf.switch_case`` over the bit widths ``min_bits..max_bits``, every branch
the exchange above with that width's settings (``policy.settings_of_bits``); the step's bits, from
the tensor's schedule variable (``hvd_qsgd.adapters.tf_schedule``), pick the branch, and the control
vector is that width's row of a constant table, so ranks that chose different bits fail the check.
After the exchange the norm of the reduced result is recorded for the next choice. Graph mode only.

In eager execution the ops run as they are called, and TensorFlow's eager runtime keeps a kernel for
every distinct set of attrs an op was called with, for the life of the process (about 40 KB each).
So nothing that differs from call to call may be an attr: an eager exchange travels as
``hvd_qsgd_<k>_n<slot>`` (the lowest slot no unfinished eager exchange holds, free again after its
decompress), its messages name that slot, and its payload seed, still
``protocol.payload_seed(seed, rank, "hvd_qsgd_<k>_s<seq>", 0)``, reaches the op through the
occurrence input (``_occurrence_for``) with the seed attr 0. The names repeat from call to call,
as Horovod's response cache expects.
"""
import itertools
import threading
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph
import horovod.tensorflow as hvd
from horovod.tensorflow.compression import Compressor

from hvd_qsgd import _tf_ops as qops, codec, protocol, reduction, report, step_built
from hvd_qsgd.adapters import tf_schedule
from hvd_qsgd.adapters.tf_state import TensorFlowState, usable_rate
from hvd_qsgd.horovod_caller import exchange_process_set, horovod_caller
from hvd_qsgd.policy import FixedBits, ScheduledBits
from hvd_qsgd.settings import (Settings, next_creation_index, process_set_key,
                               set_ranks as process_set_ranks)
from hvd_qsgd.state import ExchangeNames, ResidualStore, numbered_key

SOURCE_DTYPES = {tf.float32: "float32", tf.float16: "float16", tf.bfloat16: "bfloat16"}
_GOLDEN = 0x9E3779B97F4A7C15   # the increment of qsgd_step_seed (kernels/qsgd_control.cc)


def _occurrence_for(base):
    """The occurrence o with qsgd_step_seed(0, o) == qsgd_step_seed(base, 0): the step seed mixes
    base + (o + 1) * GOLDEN, so o = base / GOLDEN (mod 2^64; GOLDEN is odd)."""
    return qops.as_int64_attr(base * pow(_GOLDEN, -1, 2 ** 64))


class _Raw:
    """The context of an uncompressed floating-point tensor sent as float64."""

    __slots__ = ("dtype",)

    def __init__(self, dtype):
        self.dtype = dtype


class _Exchange:
    """The context of one compressed tensor between compress and decompress."""

    __slots__ = ("name", "where", "payload", "splits", "x32", "residual", "shape", "dtype", "numel", "set_ranks",
                 "set_rank", "fingerprint", "occurrence", "seed", "slot", "lr", "residual_lr",
                 "timing", "variants", "index", "schedule", "key", "process_set")


class TensorFlowCompressor(TensorFlowState, Compressor):
    """QSGD compression for ``horovod.tensorflow`` (see ``hvd_qsgd.QSGD`` for the parameters).

    Hashable by identity: Horovod caches traced functions by compressor."""

    def __init__(self, *args, process_set=None, settings=None, policy=None, creation_index=None, **kwargs):
        settings = Settings.given("hvd_qsgd.tensorflow.QSGD", settings, args, kwargs)
        if policy is None and creation_index is None:  # built by the user, maybe in a traced step
            first = step_built.first_built(self, ("hvd_qsgd.tensorflow.QSGD", settings, process_set_key(process_set)))
            if first is not None:  # a retrace of the step that built it: that step's compressor
                self.__dict__ = first.__dict__
                return
        for name in ("fusion", "overlap"):
            if getattr(settings, name):
                raise ValueError(f"hvd_qsgd.tensorflow.QSGD: {name}=True runs in PyTorch so far (TensorFlow builds "
                                 f"each exchange in the step's graph); pass {name}=False in TensorFlow")
        if settings.reduction == "hierarchical":
            raise ValueError("hvd_qsgd.tensorflow.QSGD: reduction='hierarchical' runs in PyTorch and hvd_qsgd.mpi "
                             "so far; pass reduction='scatter_allgather' (or 'auto') in TensorFlow")
        self.settings = settings
        self.policy = policy if policy is not None else FixedBits(settings)
        if type(self.policy) not in (FixedBits, ScheduledBits):
            raise TypeError(f"hvd_qsgd.tensorflow.QSGD: a {type(self.policy).__name__} policy is not one the "
                            "TensorFlow adapter knows (FixedBits, ScheduledBits)")
        self._creation_index = next_creation_index() if creation_index is None else creation_index
        self._given_process_set = process_set   # None: Horovod's call says (hvd_qsgd.horovod_caller)
        self._lock = threading.Lock()
        self._learning_rate = None
        self.names = ExchangeNames(self._creation_index, "_")   # seq: every compress; slots: eager exchanges
        self._positions = weakref.WeakKeyDictionary()   # traced function graph -> exchanges so far
        self.traced_exchanges = []                      # (exchange name, function) of every trace
        self._counters = None
        self._timing = None
        self._slowdown = report.SlowdownWatch(self.settings.link_bps())
        self._eager_exchanges = itertools.count(1)
        self.residuals = ResidualStore()                # tf.Variables by state key (rates: tf.Variables too)
        self._schedules = {}                            # DQSGD: schedule variables by state key
        self._occurrences = {}

    def __repr__(self):
        return f"hvd_qsgd.tensorflow.QSGD({self.settings})"

    def _next_exchange(self):
        """(sequence number, state key) of the next exchange.

        Sequence numbers name exchanges; they count every compress call of this compressor, which
        every rank running the same program makes in the same order. The state key names the
        exchange's variables: ``<function>:<position>`` within the current trace of the nearest
        enclosing tf.function (tf.cond/while branches are part of their function), so that a retrace
        finds the variables its first trace created. None in eager execution."""
        seq = self.names.next_seq()
        with self._lock:
            if tf.executing_eagerly():
                return seq, None
            g = tf.compat.v1.get_default_graph()
            while isinstance(g, ControlFlowFuncGraph):
                g = g.outer_graph
            position = self._positions.get(g, 0)
            self._positions[g] = position + 1
            self.traced_exchanges.append((self.names.name(f"s{seq}"), getattr(g, "name", "graph")))
            return seq, f"{getattr(g, 'name', 'graph')}:{position}"

    # -- Compressor interface -----------------------------------------------------------------

    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor):
        if isinstance(tensor, tf.IndexedSlices):
            return tensor, None
        tensor = tf.convert_to_tensor(tensor)
        if (tensor.dtype not in SOURCE_DTYPES or not tensor.shape.is_fully_defined()
                or tensor.shape.num_elements() < self.settings.min_numel):
            return self._raw(tensor)
        caller = horovod_caller()
        ps = self._exchange_process_set(caller)
        seq, state_key = self._next_exchange()
        set_ranks = process_set_ranks(ps, hvd.size())
        grank = hvd.rank()
        if grank not in set_ranks and caller.process_set is not None:
            # Horovod reduces over a set this rank is not in, and hands it its own tensor back: so does
            # the compressor (the exchange is numbered all the same, as on the set's ranks)
            return tensor, None
        if grank not in set_ranks:
            raise ValueError(f"hvd_qsgd: this rank (global rank {grank}) is not in the compressor's process "
                             f"set {set_ranks}; pass the optimizer's process_set= to the compressor")
        ctx = self._open(tensor, ps, seq, state_key, set_ranks, set_ranks.index(grank))
        return self._encode(ctx, self._input(ctx, tensor), seq)

    def _raw(self, tensor):
        """An uncompressed tensor, counted: floating point as float64, so that a grouped allreduce
        (one dtype per group in TensorFlow) can hold it with the control vectors; cast back in
        decompress."""
        n = tensor.shape.num_elements()
        if n is None:
            n = tf.size(tensor)
        with tf.control_dependencies(self._count(raw_elements=n, raw_tensors=1)):
            if tensor.dtype.is_floating and tensor.dtype != tf.float64:
                return tf.cast(tensor, tf.float64), _Raw(tensor.dtype)
            return tf.identity(tensor), None

    def _open(self, tensor, ps, seq, state_key, set_ranks, set_rank):
        """The context of exchange ``seq``: its name (eager: a slot), messages, and occurrence (the
        payload seed's counter: a variable per traced exchange)."""
        s = self.settings
        ctx = _Exchange()
        ctx.process_set = ps
        eager = tf.executing_eagerly()
        ctx.slot = self.names.take_slot() if eager else None
        label = f"s{seq}" if ctx.slot is None else f"n{ctx.slot}"
        ctx.name = self.names.name(label)
        ctx.where = f"hvd_qsgd: compressed tensor {label} (shape {tuple(tensor.shape.as_list())})"
        ctx.shape, ctx.dtype = tensor.shape, tensor.dtype
        ctx.numel, ctx.set_ranks = tensor.shape.num_elements(), set_ranks
        ctx.fingerprint = codec.tensor_fingerprint("", tensor.shape.as_list(), SOURCE_DTYPES[tensor.dtype])
        if eager:  # the seed of "hvd_qsgd_<k>_s<seq>", through the input (see the module docstring);
            # a NumPy scalar, as TensorFlow keeps every eager tensor made from a Python number
            ctx.occurrence = tf.constant(np.int64(_occurrence_for(protocol.exchange_seed(
                s.seed, set_rank, self.names.name(f"s{seq}")))))
        else:
            counter = self._state(self._occurrences, state_key, lambda: tf.Variable(
                0, dtype=tf.int64, trainable=False, name=f"{ctx.name}_occurrence"))
            ctx.occurrence = counter.assign_add(1) - 1
        ctx.residual = ctx.lr = ctx.residual_lr = None
        ctx.variants, ctx.index, ctx.schedule, ctx.key = [s], None, None, state_key
        ctx.set_rank = set_rank
        ctx.seed = 0 if eager else qops.as_int64_attr(protocol.exchange_seed(s.seed, set_rank, ctx.name))
        return ctx

    def _input(self, ctx, tensor):
        """What is encoded: the tensor (+ its residual, rescaled, with error feedback); DQSGD's bits
        of this step chosen from the tensor's schedule (``ctx.index``)."""
        s, eager, state_key = self.settings, tf.executing_eagerly(), ctx.key
        if isinstance(self.policy, ScheduledBits):
            if eager:
                raise ValueError("hvd_qsgd.DynamicQSGD in TensorFlow needs a tf.function training step: the bits "
                                 "schedule is kept per traced tensor")
            ctx.schedule = self._state(self._schedules, state_key, lambda: tf_schedule.new_state(f"{ctx.name}_schedule"))
            bits, advance = tf_schedule.next_bits(ctx.schedule, self.policy.schedule_args)
            ctx.variants = [self.policy.settings_of_bits(b) for b in self.policy.bits_range()]
            with tf.control_dependencies([advance]):
                ctx.index = tf.identity(bits - self.policy.bits_range()[0])
        if not s.error_feedback:
            return tensor
        if eager:
            raise ValueError("hvd_qsgd.tensorflow.QSGD(error_feedback=True) needs a tf.function training "
                             "step: residuals are kept per traced tensor")
        ctx.residual = self._state(self.residuals.residuals, state_key, lambda: tf.Variable(
            tf.zeros([ctx.numel], tf.float32), trainable=False, name=f"{ctx.name}_residual"))
        if ctx.residual.shape.num_elements() != ctx.numel:
            raise ValueError(f"{ctx.where}: its error-feedback residual ({state_key}) has "
                             f"{ctx.residual.shape.num_elements()} elements: the function handed the "
                             "compressor other tensors in this position when it was first traced")
        return tf.reshape(tf.cast(tensor, tf.float32), [-1]) + ctx.residual * self._rescale_factor(ctx, state_key)

    def _encode(self, ctx, x, seq):
        """(the control vector for Horovod's allreduce, ctx): the payload(s) of x, timed."""
        ctx.x32 = x
        occurrence, set_ranks = ctx.occurrence, ctx.set_ranks
        s, world, grank, set_rank = self.settings, hvd.size(), hvd.rank(), ctx.set_rank

        def encode(v, uniform):
            """The payload(s) with settings v; ``uniform``: (payload, splits) for every reduction."""
            attrs = self._encode_attrs(ctx, v)
            if self._reduction(ctx, v) == "scatter_allgather":
                return tuple(qops.load().qsgd_encode_chunks(x, occurrence, **attrs))
            attrs.pop("world")
            payload = qops.load().qsgd_encode(x, occurrence, **attrs)
            return payload, (tf.zeros([len(set_ranks)], tf.int32) if uniform else None)

        if ctx.index is None:
            (ctx.payload, ctx.splits), encode_time = self._timed("encode_s", [x, occurrence], lambda: encode(s, False))
        else:  # DQSGD: the bits of this step pick the branch (every branch's attrs are fixed)
            (ctx.payload, ctx.splits), encode_time = self._timed("encode_s", [x, occurrence, ctx.index], lambda: tuple(
                tf.switch_case(ctx.index, [lambda v=v: encode(v, True) for v in ctx.variants])))
        ctx.timing = [encode_time]
        key = numbered_key(seq if ctx.slot is None else ctx.slot)
        vectors = [protocol.control_vector(world, grank, set_rank, protocol.exchange_tags(
            len(set_ranks), self._creation_index, v.tag(self._reduction(ctx, v)), key)) for v in ctx.variants]
        if ctx.index is None:
            control = tf.constant(vectors[0], dtype=tf.float64, name=f"{ctx.name}_control")
        else:  # the settings tag of the bits chosen: ranks that chose differently fail the check
            control = tf.gather(tf.constant(np.stack(vectors), dtype=tf.float64), ctx.index,
                                name=f"{ctx.name}_control")
        return control, ctx

    def _exchange_process_set(self, caller):
        """The process set of an exchange (``horovod_caller.exchange_process_set``); a set given that is
        not Horovod's is an error, raised where every rank of the set traces (or calls) alike."""
        ps, disagreement = exchange_process_set(caller, self._given_process_set, hvd.global_process_set, hvd.size())
        if disagreement is not None:
            raise ValueError(f"hvd_qsgd: {disagreement}")
        return ps

    def _reduction(self, ctx, v):
        """The reduction of the exchange ``ctx`` with settings v (alike on every rank)."""
        return v.exchange_reduction(len(ctx.set_ranks), ctx.numel)

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        if isinstance(ctx, _Raw):
            return tf.cast(tensor, ctx.dtype)
        ops = qops.load()
        try:
            alpha = ops.qsgd_check_control(tf.cast(tensor, tf.float64), world=hvd.size(), set_ranks=ctx.set_ranks,
                                           tag_names=list(protocol.TAG_NAMES), where=ctx.where)
            if ctx.index is None:
                out, deps = self._reduce(ctx, alpha, self.settings)
            else:  # DQSGD: the exchange with the bits chosen in compress; its norm chooses the next bits
                def branch(v):
                    out, deps = self._reduce(ctx, alpha, v)
                    with tf.control_dependencies(deps):
                        return tf.identity(out)
                out = tf.switch_case(ctx.index, [lambda v=v: branch(v) for v in ctx.variants])
                deps = [tf_schedule.observe(ctx.schedule, out)]
            with tf.control_dependencies(deps):
                result = tf.cast(tf.reshape(out, ctx.shape), ctx.dtype)
            # in a graph the counters are tensors (summary() reports instead); eagerly, reading them
            # costs a dozen variable reads, so every 64th exchange looks
            if tf.executing_eagerly() and next(self._eager_exchanges) % 64 == 0:
                self._slowdown.check(self.stats, repr(self))
            return result
        finally:  # eager: the exchange's collectives have run (or, after a failed check, never started)
            self.names.release_slot(ctx.slot)

    def _reduce(self, ctx, alpha, v):
        """(alpha * the reduced gradient, the statistics and residual updates) with settings v."""
        if self._reduction(ctx, v) == "scatter_allgather":
            return self._scatter_allgather(ctx, alpha, v)
        return self._allgather(ctx, alpha, v)

    @staticmethod
    def _codec_attrs(ctx, s):
        """The attrs the codec ops of one exchange with settings s share."""
        return dict(bits=s.bits, bucket_size=s.bucket_size, norm=codec.NORMS[s.norm], coding=codec.CODINGS[s.coding],
                    dtype_code=codec.DTYPES[SOURCE_DTYPES[ctx.dtype]],
                    fingerprint=qops.as_int64_attr(ctx.fingerprint), world=len(ctx.set_ranks), where=ctx.where)

    @classmethod
    def _encode_attrs(cls, ctx, s):
        """The attrs of the ops that encode (the shared ones, and the checksum, encoder version and seed)."""
        return dict(cls._codec_attrs(ctx, s), checksum=s.checksum, encoder=s.encoder, seed=ctx.seed)

    def _allgather(self, ctx, alpha, v):
        """(alpha * the decoded sum of every rank's payload, the statistics and residual updates)."""
        ops = qops.load()
        with tf.control_dependencies([alpha]):
            payload = tf.identity(ctx.payload)
        gathered, wait_time = self._timed("wait_s", [payload], lambda: hvd.allgather(
            payload, name=ctx.name, ignore_name_scope=True, process_set=ctx.process_set))
        attrs = self._codec_attrs(ctx, v)
        attrs.pop("world")
        out, decode_time = self._timed("decode_s", [gathered], lambda: ops.qsgd_decode_sum(
            gathered, alpha, count=len(ctx.set_ranks), numel=ctx.numel, **attrs))
        sent = tf.size(ctx.payload, out_type=tf.int64)
        deps = self._count(elements=ctx.numel, bytes_sent=sent, tensors=1,
                           bytes_received=tf.size(gathered, out_type=tf.int64) - sent)
        deps += ctx.timing + [wait_time, decode_time, self._count_allreduce_bytes(ctx)]
        if ctx.residual is not None:
            own = ops.qsgd_decode_sum(ctx.payload, tf.constant(1.0), count=1, numel=ctx.numel, **attrs)
            deps.append(self._assign_residual(ctx, own))
        return out, deps

    def _scatter_allgather(self, ctx, alpha, v):
        """(alpha * the decoded reduced chunks, the statistics and residual updates)."""
        ops, ps, j = qops.load(), ctx.process_set, ctx.set_rank
        attrs, encode_attrs = self._codec_attrs(ctx, v), self._encode_attrs(ctx, v)
        with tf.control_dependencies([alpha]):
            payloads, splits = tf.identity(ctx.payload), tf.identity(ctx.splits)
        (received, received_splits), wait1 = self._timed("wait_s", [payloads, splits], lambda: tuple(hvd.alltoall(
            payloads, splits=splits, name=f"{ctx.name}_scatter", ignore_name_scope=True, process_set=ps)))
        if v.server_error_feedback:   # rank j's residual of its chunk j (two-way error feedback)
            server = self._server_residual(ctx, v)

            def reduce_step():
                reduced, error, new = ops.qsgd_reduce_chunk_ef(received, received_splits, ctx.occurrence, server,
                                                               chunk=j, numel=ctx.numel, **encode_attrs)
                with tf.control_dependencies([server.assign(new)]):
                    return tf.identity(reduced), tf.identity(error)
        else:
            def reduce_step():
                return tuple(ops.qsgd_reduce_chunk(received, received_splits, ctx.occurrence, chunk=j,
                                                   numel=ctx.numel, **encode_attrs))
        (reduced, error), reduce_time = self._timed("decode_s", [received, received_splits], reduce_step)

        def gather_both():
            return (hvd.allgather(reduced, name=f"{ctx.name}_gather", ignore_name_scope=True, process_set=ps),
                    hvd.allgather(tf.reshape(tf.size(reduced, out_type=tf.int32), [1]),
                                  name=f"{ctx.name}_gather_splits", ignore_name_scope=True, process_set=ps))
        (gathered, gathered_splits), wait2 = self._timed("wait_s", [reduced, error], gather_both)
        out, decode_time = self._timed("decode_s", [gathered, gathered_splits], lambda: ops.qsgd_decode_chunks(
            gathered, gathered_splits, alpha, error, numel=ctx.numel, **attrs))

        def others(lengths):  # bytes in the other ranks' slots
            lengths = tf.cast(lengths, tf.int64)
            return tf.reduce_sum(lengths) - lengths[j]

        deps = self._count(elements=ctx.numel, tensors=1,
                           bytes_sent=others(splits) + tf.size(reduced, out_type=tf.int64),
                           bytes_received=others(received_splits) + others(gathered_splits))
        deps += ctx.timing + [wait1, reduce_time, wait2, decode_time, self._count_allreduce_bytes(ctx)]
        if ctx.residual is not None:
            own = ops.qsgd_decode_chunks(ctx.payload, ctx.splits, tf.constant(1.0), tf.constant(""), numel=ctx.numel,
                                         **attrs)
            deps.append(self._assign_residual(ctx, own))
        return out, deps

    def _server_residual(self, ctx, v):
        """This rank's server residual of the exchange ``ctx`` (its chunk's elements, zero at first)."""
        if ctx.key is None:
            raise ValueError("hvd_qsgd.tensorflow: server_error_feedback=True needs a tf.function training step: "
                             "the reducing rank's residual is kept per traced tensor")
        begin, end = reduction.chunk_ranges(ctx.numel, v.bucket_size, len(ctx.set_ranks))[ctx.set_rank]
        server = self._state(self.residuals.server, ctx.key, lambda: tf.Variable(
            tf.zeros([end - begin], tf.float32), trainable=False, name=f"{ctx.name}_server_residual"))
        if server.shape.num_elements() != end - begin:
            raise ValueError(f"{ctx.where}: its server error-feedback residual has {server.shape.num_elements()} "
                             f"elements, this rank's chunk {end - begin}: the tensor, the bucket size or the "
                             "number of ranks changed since it was made")
        return server

    @staticmethod
    def _assign_residual(ctx, own):
        """residual <- x32 - own, except where that is not finite (a bucket that held a NaN or an Inf
        decodes to NaN): there the previous residual stays, so one overflowing step (skipped by loss
        scaling) does not make every later gradient non-finite."""
        new = ctx.x32 - own
        assign = ctx.residual.assign(tf.where(tf.math.is_finite(new), new, ctx.residual))
        if ctx.lr is None:
            return assign
        with tf.control_dependencies([assign]):
            return ctx.residual_lr.assign(tf.where(usable_rate(ctx.lr), ctx.lr, ctx.residual_lr))

TensorFlowCompressor.__signature__ = Settings.signature(process_set=None, settings=None, policy=None, creation_index=None)
