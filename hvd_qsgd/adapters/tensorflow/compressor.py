"""QSGD as a Horovod TensorFlow ``Compressor``: the glue between Horovod's calls and the exchange's
chains (``hvd_qsgd.exchange.chains``), built as TensorFlow ops (``hvd_qsgd.adapters.tensorflow.graph``)
so that they run in ``tf.function`` steps, ``tf.compat.v1`` graphs and eagerly::

    compress(g):    the chain's encode of g [+ e] (QsgdEncode, or QsgdEncodeChunks for
                    scatter_allgather; their Ef ops with error feedback); returns the control
                    vector (QsgdControlVector: float64, stateful, so never folded into a
                    constant and reduced at every step)
    decompress(r):  alpha, joined = QsgdCheckControl(r)           (fails on every rank alike)
                    the chain's stages, the first collective after alpha (control dependency);
                    where ranks have called hvd.join(), Horovod's Sum of the stepping ranks'
                    dequantized payloads instead (``hvd_qsgd.adapters.tensorflow.verdict``)
                    return cast(alpha * the reduced tensor, g.dtype)   (``verdict.with_gradient``)

Each exchange resolves its reduction with ``settings.exchange_reduction(n, numel)``; the resolved
reduction is part of the control vector's settings tag, so ranks that resolve differently fail the
check instead of hanging, as a rank never waits on a collective another rank did not start.

Exchanges are numbered in the order ``compress`` is called (``hvd_qsgd_<k>_s<seq>``, under
``tf.function`` while tracing: their seeds' and variables' names). A traced exchange is keyed by the
enclosing function's name and its position within the trace: its collectives travel as
``hvd_qsgd_<k>_f<function>.<position>`` (one rank's retrace, a smaller batch there, meets the
others'), and a retrace reuses the variables the first trace made (``adapters.tensorflow.state``):
an int64 occurrence counter (the payload seed is ``protocol.payload_seed(seed, rank, exchange,
occurrence)``, computed by the op), the error-feedback residual ``e <- (g + e) - decode(own
payload(s))``, and the statistics counters (``bytes_sent``: this rank's payload bytes put on the wire
once each; ``bytes_received``: the other ranks' payloads received, in every phase).

DQSGD (a ``ScheduledBits`` policy): the ops take their bits as attrs, so compress and decompress are
each a ``tf.switch_case`` over the bit widths, every branch the chain with that width's settings;
the tensor's schedule variable (``hvd_qsgd.adapters.tensorflow.schedule``) picks the branch, and the control
vector is that width's row of the table QsgdControlVector holds. Graph mode only, as error feedback is.

Eagerly, TensorFlow keeps a kernel for every distinct set of attrs an op was called with, for the
life of the process: so an eager exchange travels as ``hvd_qsgd_<k>_n<slot>`` (the lowest slot no
unfinished eager exchange holds), and its payload seed, still that of ``hvd_qsgd_<k>_s<seq>``,
reaches the op through the occurrence input (``protocol.occurrence_seeding``) with the seed attr 0.
"""
import threading
import weakref
from types import SimpleNamespace

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd
from horovod.tensorflow.compression import Compressor

from hvd_qsgd import _tf_ops as qops, codec, errors, protocol, report, step_built
from hvd_qsgd.adapters.tensorflow import schedule as tf_schedule
from hvd_qsgd.adapters.tensorflow.graph import GraphRun, TensorFlowOps
from hvd_qsgd.adapters.tensorflow import uncompressed, verdict
from hvd_qsgd.adapters.tensorflow.state import TensorFlowState, state_variable
from hvd_qsgd.exchange.chains import CHAINS, Exchange, expectation
from hvd_qsgd.exchange.hierarchical import horovod_ranks_per_node, ranks_per_node_override, node_layout
from hvd_qsgd.horovod_caller import exchange_process_set, horovod_caller, horovod_frame
from hvd_qsgd.policy import FixedBits, ScheduledBits
from hvd_qsgd.settings import (Settings, next_creation_index, process_set_key,
                               set_ranks as process_set_ranks)
from hvd_qsgd.state import ExchangeNames, ResidualStore, StateHolders, numbered_key, traced_key, traced_label

SOURCE_DTYPES = {tf.float32: "float32", tf.float16: "float16", tf.bfloat16: "bfloat16"}


def in_xla_context() -> bool:
    """Whether the function being traced is XLA-compiled (``jit_compile=True``)."""
    from tensorflow.python.ops import control_flow_util
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


class _Tensor:
    """The adapter's side of one compressed tensor between compress and decompress (each exchange's
    ``origin``): its names, shape, variables, DQSGD schedule, and the exchange of each bit width."""

    __slots__ = ("name", "where", "shape", "dtype", "numel", "set_ranks", "set_rank", "fingerprint", "occurrence",
                 "seed", "slot", "per_node", "index", "schedule", "key", "process_set", "variants", "exchanges",
                 "deps", "sum_join", "graph_input", "alpha", "wire")


class TensorFlowCompressor(errors.NotCopied, report.Summarized, TensorFlowState, Compressor):
    """QSGD compression for ``horovod.tensorflow`` (see ``hvd_qsgd.QSGD`` for the parameters).

    Hashable by identity: Horovod caches traced functions by compressor."""

    def __init__(self, *args, process_set=None, settings=None, policy=None, creation_index=None, **kwargs):
        settings = Settings.given("hvd_qsgd.tensorflow.QSGD", settings, args, kwargs)
        if policy is None and creation_index is None:  # built by the user, maybe in a traced step
            first = step_built.first_built(self, ("hvd_qsgd.tensorflow.QSGD", settings, process_set_key(process_set)))
            if first is not None:  # a retrace of the step that built it: that step's compressor
                self.__dict__ = first.__dict__
                return
        for name, off in (("fusion", False), ("overlap", False), ("fusion_mb", 0)):
            if getattr(settings, name):
                raise ValueError(f"hvd_qsgd.tensorflow.QSGD: {name}={getattr(settings, name)!r} runs in PyTorch so "
                                 f"far (TensorFlow builds each exchange in the step's graph); pass {name}={off} in "
                                 "TensorFlow")
        ranks_per_node_override()   # (malformed: refused here, not where one rank traces a step)
        self.settings = settings
        self.policy = policy if policy is not None else FixedBits(settings)
        if type(self.policy) not in (FixedBits, ScheduledBits):
            raise TypeError(f"hvd_qsgd.tensorflow.QSGD: a {type(self.policy).__name__} policy is not one the "
                            "TensorFlow adapter knows (FixedBits, ScheduledBits)")
        self._creation_index = next_creation_index() if creation_index is None else creation_index
        report.note_used(hvd.size)
        self._given_process_set = process_set   # None: Horovod's call says (hvd_qsgd.horovod_caller)
        self._lock, self._learning_rate = threading.Lock(), None
        self.names = ExchangeNames(self._creation_index, "_")   # seq: every compress; slots: eager exchanges
        self._positions = weakref.WeakKeyDictionary()   # traced function graph -> exchanges so far
        self.traced_exchanges = []                      # (exchange name, function) of every trace
        self._counters = self._timing = None
        self._slowdown = report.SlowdownWatch(self.settings.link_bps())
        self.residuals = ResidualStore()                # tf.Variables by state key (rates: tf.Variables too)
        self._schedules = {}                            # DQSGD: schedule variables by state key
        self._occurrences, self._holders = {}, StateHolders()   # (the variable that holds each state key)
        self.run = GraphRun(self)                       # what the chains call (hvd_qsgd.adapters.tensorflow.graph)

    PUBLIC_NAME, _horovod_rank = "hvd_qsgd.tensorflow.QSGD", staticmethod(lambda: hvd.rank())

    def __repr__(self):
        return f"hvd_qsgd.tensorflow.QSGD({self.settings})"

    # -- Compressor interface -----------------------------------------------------------------

    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor=errors.NOT_GIVEN):
        if tensor is errors.NOT_GIVEN:   # (the class given as the compression: ``self`` is the tensor)
            raise errors.class_given()
        if isinstance(tensor, tf.IndexedSlices):
            return tensor, None
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype in SOURCE_DTYPES and not tensor.shape.is_fully_defined():
            tensor = uncompressed.with_static_shape(tensor, self)
        if (tensor.dtype not in SOURCE_DTYPES or not tensor.shape.is_fully_defined()
                or tensor.shape.num_elements() < self.settings.min_numel):
            return uncompressed.send(self.run, tensor)
        if not tf.executing_eagerly() and in_xla_context():   # (at trace time, on every rank alike)
            raise ValueError(f"hvd_qsgd: a {tensor.dtype.name} tensor of shape {tuple(tensor.shape.as_list())} is "
                             "compressed in an XLA-compiled function (jit_compile=True), where hvd_qsgd's ops "
                             "have no kernels: compile the step with jit_compile=False")
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
        ctx.sum_join = caller.process_set is not None   # Horovod's own set: ranks missing from a Sum joined
        return self._encode(ctx, self._input(ctx, tensor), seq)

    def _open(self, tensor, ps, seq, state_key, set_ranks, set_rank):
        """The context of exchange ``seq``: its names (``wire``: its collectives'), messages, and
        occurrence (the payload seed's counter: a variable per traced exchange)."""
        s = self.settings
        ctx = _Tensor()
        ctx.process_set = ps
        eager = tf.executing_eagerly()
        ctx.slot = self.names.take_call_slot(horovod_frame()) if eager else None
        label = f"s{seq}" if ctx.slot is None else f"n{ctx.slot}"
        ctx.name = self.names.name(label)
        ctx.wire = ctx.name if eager else self.names.name(traced_label(state_key))
        ctx.where = f"hvd_qsgd: compressed tensor {label} (shape {tuple(tensor.shape.as_list())})"
        ctx.shape, ctx.dtype, ctx.graph_input = tensor.shape, tensor.dtype, verdict.taped(tensor)
        ctx.numel, ctx.set_ranks = tensor.shape.num_elements(), set_ranks
        ctx.per_node = horovod_ranks_per_node(hvd) if len(set_ranks) == hvd.size() else None
        ctx.fingerprint = codec.tensor_fingerprint("", tensor.shape.as_list(), SOURCE_DTYPES[tensor.dtype])
        if eager:  # the seed of "hvd_qsgd_<k>_s<seq>", through the input (see the module docstring);
            # a NumPy scalar, as TensorFlow keeps every eager tensor made from a Python number
            ctx.occurrence = tf.constant(np.int64(qops.as_int64_attr(protocol.occurrence_seeding(
                protocol.exchange_seed(s.seed, set_rank, self.names.name(f"s{seq}"))))))
        else:
            counter = self._state(self._occurrences, state_key, lambda: state_variable(
                0, dtype=tf.int64, name=f"{ctx.name}_occurrence"))
            ctx.occurrence = counter.assign_add(1) - 1
        ctx.deps = []
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
            ctx.schedule = self._state(self._schedules, state_key, lambda: state_variable(
                tf_schedule.initial_state(), name=f"{ctx.name}_schedule"))
            bits, advance = tf_schedule.next_bits(ctx.schedule, self.policy.schedule_args)
            ctx.variants = [self.policy.settings_of_bits(b) for b in self.policy.bits_range()]
            with tf.control_dependencies([advance]):
                ctx.index = tf.identity(bits - self.policy.bits_range()[0])
        if s.error_feedback and eager:  # (the residual: made by the chain's encode, GraphRun.worker_residual)
            raise ValueError("hvd_qsgd.tensorflow.QSGD(error_feedback=True) needs a tf.function training "
                             "step: residuals are kept per traced tensor")
        return tensor

    def _encode(self, ctx, x, seq):
        """(the control vector for Horovod's allreduce, ctx): the payload(s) of x (``encode`` of the
        reduction's chain), timed; DQSGD: the chain of the bits of this step, in a tf.switch_case."""
        s, world, grank, set_rank = self.settings, hvd.size(), hvd.rank(), ctx.set_rank
        ctx.exchanges = [self._exchange(ctx, v) for v in ctx.variants]
        inputs = [x, ctx.occurrence] + ([] if ctx.index is None else [ctx.index])
        with self.run.collecting() as deps:
            if ctx.index is None:
                ex = ctx.exchanges[0]
                self.run.timed("encode_s", lambda: ex.chain.encode(self.run, ex, x) or ex.payload, *inputs)
            else:  # every branch's attrs are fixed: the bits of this step pick the branch
                def encode(ex):
                    ex.chain.encode(self.run, ex, x)
                    splits = tf.zeros([len(ctx.set_ranks)], tf.int64) if ex.splits is None else ex.splits
                    return ex.payload, splits, ex.own_len
                encoded = self.run.timed("encode_s", lambda: tuple(self.run.switch(
                    ctx.index, [lambda ex=ex: encode(ex) for ex in ctx.exchanges])), *inputs)
                for ex in ctx.exchanges:
                    ex.payload, ex.splits, ex.own_len = encoded
        ctx.deps = deps
        key = traced_key(ctx.key) if ctx.slot is None else numbered_key(ctx.slot)
        vectors = [protocol.control_vector(world, grank, set_rank, protocol.exchange_tags(
            len(ctx.set_ranks), self._creation_index, ex.settings.tag(ex.tag_reduction()), key))
            for ex in ctx.exchanges]
        # DQSGD: the settings tag of the bits chosen (ranks that chose differently fail the check).
        # Through a stateful op: an allreduce of a constant would be folded when the function is
        # optimized, reduced once for every step, and a rank's hvd.join() would go unseen
        index = tf.zeros([], tf.int32) if ctx.index is None else tf.cast(ctx.index, tf.int32)
        control = qops.load().qsgd_control_vector(tf.constant(np.stack(vectors), dtype=tf.float64), index,
                                                  where=ctx.where, name=control_name(ctx.wire))
        return control, ctx

    def _exchange(self, ctx, v):
        """The exchange of the tensor ``ctx`` with settings v: its chain, over TensorFlow ops."""
        red, n = self._reduction(ctx, v), len(ctx.set_ranks)
        dtype = SOURCE_DTYPES[ctx.dtype]
        ex = Exchange(route=SimpleNamespace(exchange=ctx.wire), where=ctx.where, settings=v,
                      expect=expectation(v, ctx.numel, dtype, ctx.fingerprint),
                      reduction=red, chain=CHAINS[red], group=ctx.process_set, set_ranks=ctx.set_ranks,
                      set_rank=ctx.set_rank, world=hvd.size(), global_rank=hvd.rank(), origin=ctx,
                      step_seed=(ctx.seed, ctx.occurrence),
                      backend=TensorFlowOps(self.run, v, dtype, ctx.fingerprint, ctx.where, ctx.numel, n))
        if red == "hierarchical":  # a layout that cannot run fails here, where every rank traces alike
            ex.layout, fault = node_layout(ctx.per_node, ctx.set_ranks, hvd.size(), ctx.where)
            if fault is not None:
                raise fault
            ex.nodes = [g // ctx.per_node for g in ctx.set_ranks]
        return ex

    def _exchange_process_set(self, caller):
        """The process set of an exchange (``horovod_caller.exchange_process_set``); a set given that is
        not Horovod's is an error, raised where every rank of the set traces (or calls) alike."""
        ps, disagreement = exchange_process_set(caller, self._given_process_set, hvd.global_process_set, hvd.size())
        if disagreement is not None:
            raise ValueError(f"hvd_qsgd: {disagreement}")
        return ps

    def _reduction(self, ctx, v):
        """The reduction of the exchange ``ctx`` with settings v (alike on every rank; "auto" weighs
        the hierarchical reduction where the set is the job on nodes of several ranks)."""
        return v.exchange_reduction(len(ctx.set_ranks), ctx.numel, ctx.per_node, "cpu")

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor, ctx=errors.NOT_GIVEN):
        if ctx is None:
            return tensor
        if ctx is errors.NOT_GIVEN:
            raise errors.class_given()
        if isinstance(ctx, uncompressed.Raw):
            return uncompressed.received(tensor, ctx)
        try:
            with self.run.collecting() as deps:
                out = verdict.reduced(self.run, ctx, tensor)   # the chain's, or the joined ranks' result
                if ctx.index is not None:  # DQSGD: the result's norm chooses the next bits
                    deps.append(tf_schedule.observe(ctx.schedule, out))
            with tf.control_dependencies(ctx.deps + deps):
                result = tf.cast(tf.reshape(out, ctx.shape), ctx.dtype)
            result = verdict.with_gradient(ctx, result)
            # in a graph the counters are tensors (summary() reports instead); eagerly, reading them
            # costs a dozen variable reads, which the watch does only now and then (report.SlowdownWatch)
            if tf.executing_eagerly():
                self._slowdown.observe(lambda: self.stats, repr(self))
            return result
        finally:  # eager: the exchange's collectives have run (or, after a failed check, never started)
            self.names.release_slot(ctx.slot)


def control_name(wire):
    """The control vector op's name: ``wire`` without the compressor's number. Horovod names its
    graph allreduce of what compress returns after that tensor's name, so a number that differs
    between ranks (compressors made in different orders) left their allreduces under different
    names, and every rank waited forever; this way they meet, and the control check says why."""
    return "hvd_qsgd_control_" + wire.split("_", 3)[3]   # (hvd_qsgd_<k>_<label>)


TensorFlowCompressor.__signature__ = Settings.signature(process_set=None, settings=None, policy=None, creation_index=None)
