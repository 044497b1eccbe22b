"""The state of the TensorFlow adapter (``hvd_qsgd.adapters.tensorflow``), apart from the graph it
builds: its variables (statistics counters and times, occurrence counters, residuals and the
learning rates they were made at, DQSGD's schedules, server residuals), made outside any traced
function and initialized where a ``tf.compat.v1`` session already ran its initializer; learning-rate
following; checkpoints (``variables``, ``state_dict``); and what elastic training reads and sets
(eagerly). ``TensorFlowState`` is a base of ``TensorFlowCompressor``: it reads the compressor's
``settings``, ``names``, ``residuals``, ``_occurrences``, ``_schedules``, ``_positions``, ``_lock``
and ``_creation_index``. The names of an exchange's variables, its state key, come from
``_next_exchange``.
"""
import horovod.tensorflow as hvd
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

from hvd_qsgd import protocol, reduction
from hvd_qsgd.adapters.tensorflow import accumulators, schedule as tf_schedule
from hvd_qsgd.horovod_caller import traced_variable
from hvd_qsgd.settings import Stats
from hvd_qsgd.state import checkpoint_origin, loadable, state_by_key

# integer counts kept beside the time fields, outside ``variables`` (added after checkpoints held those)
UNCHECKPOINTED_COUNTS = ("allreduce_bytes", "joined_exchanges")


def _named(variable):
    """A variable as messages name it: its Keras 3 path (``dense_1/kernel``), else its name."""
    return getattr(variable, "path", None) or variable.name


class TensorFlowState:
    """Variables, statistics, learning-rate following, checkpoints and elastic state (see the
    module docstring)."""

    def _next_exchange(self):
        """(sequence number, state key) of the next exchange.

        Sequence numbers name exchanges; they count every compress call of this compressor, which
        every rank running the same program makes in the same order. The state key names the
        exchange's variables: ``<function>:<position>`` within the current trace of the nearest
        enclosing tf.function (tf.cond/while branches are part of their function), so that a retrace
        finds the variables its first trace created. None in eager execution."""
        self._check_home()
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
            key = f"{getattr(g, 'name', 'graph')}:{position}"
        self._check_holder(key)
        return seq, key

    def _check_home(self):
        """The compressor's variables live where its first exchange made them, wherever
        ``tf.init_scope`` lifts to: eager (tf.function steps included) or a ``tf.Graph`` of a v1
        program. Another is refused, naming both, where TensorFlow's own error named a counter
        variable "out of scope" or "from another graph"."""
        here = "eager execution"
        if not tf.executing_eagerly():   # (eagerly, no scope to lift out of: every eager exchange is here)
            with tf.init_scope():
                here = "eager execution" if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        home = self.__dict__.setdefault("_home", here)
        if home is not here:
            home, here = (f"tf.Graph {id(g):#x}" if isinstance(g, tf.Graph) else g for g in (home, here))
            raise ValueError(f"hvd_qsgd: compressor {self._creation_index} was used in {home}, where its TensorFlow "
                             f"state (counters, residuals) lives, and now in {here}: make one compressor for each "
                             "tf.Graph, and one for eager and tf.function steps")

    def _check_holder(self, key):
        """A state key is held by the variable whose gradient its exchange first carried: another
        live variable there (a second model's, in a step function of the same name) would mix their
        states, and is refused as the step is traced, on every rank alike. (Horovod's eager tape
        traces its reducing function once for every model of the same shapes: not seen here.)"""
        kept = state_by_key(self.settings, self.policy.observes)
        variable = None if kept is None else traced_variable()
        held = None if variable is None else self._holders.other(key, variable)
        if held is not None:
            raise ValueError(
                f"hvd_qsgd: the gradients of two variables ({_named(held)}, {_named(variable)}) reach one compressor at the "
                f"same place ({key}) of traced functions named alike, and it keeps {kept} by that place, where theirs "
                "would mix: give each model's training step (or tape) its own compressor (a hvd_qsgd.QSGD(...) each); "
                "where one model's trainable variables changed (a layer frozen, and the model compiled again with the "
                "same optimizer), the places moved: compile with a new DistributedOptimizer and a new compressor (the "
                "residuals of the old places are dropped)")

    def _server_residual(self, ctx, v):
        """This rank's server residual of the exchange ``ctx`` (its chunk's elements, zero at first)."""
        if ctx.key is None:
            raise ValueError("hvd_qsgd.tensorflow: server_error_feedback=True needs a tf.function training step: "
                             "the reducing rank's residual is kept per traced tensor")
        begin, end = reduction.chunk_ranges(ctx.numel, v.bucket_size, len(ctx.set_ranks))[ctx.set_rank]
        server = self._state(self.residuals.server, ctx.key, lambda: state_variable(
            tf.zeros([end - begin], tf.float32), name=f"{ctx.name}_server_residual"))
        if server.shape.num_elements() != end - begin:
            raise ValueError(f"{ctx.where}: its server error-feedback residual has {server.shape.num_elements()} "
                             f"elements, this rank's chunk {end - begin}: the tensor, the bucket size or the "
                             "number of ranks changed since it was made")
        return server

    def _counter_vars(self):
        if self._counters is None:
            with tf.init_scope():
                self._counters = {k: state_variable(0, dtype=tf.int64, name=f"hvd_qsgd_{self._creation_index}_{k}")
                                  for k in Stats.GRAPH_FIELDS}
                _initialize_in_session(self._counters.values())
                accumulators.register(self._counters.values())
        return self._counters

    def _timing_vars(self):
        """The time fields (``Stats.TIME_FIELDS``), allreduce_bytes and joined_exchanges: variables of
        their own, kept out of ``variables`` so that checkpoints hold what they held before."""
        if self._timing is None:
            with tf.init_scope():
                self._timing = {k: state_variable(0.0, dtype=tf.float64, name=f"hvd_qsgd_{self._creation_index}_{k}")
                                for k in Stats.TIME_FIELDS}
                for k in UNCHECKPOINTED_COUNTS:
                    self._timing[k] = state_variable(0, dtype=tf.int64, name=f"hvd_qsgd_{self._creation_index}_{k}")
                _initialize_in_session(self._timing.values())
                accumulators.register(self._timing.values())
        return self._timing

    def _state(self, store, name, make):
        """The variable ``name`` in ``store``, created outside any traced function on first use."""
        v = store.get(name)
        if v is None:
            with tf.init_scope():
                v = store[name] = make()
                _initialize_in_session(tf.nest.flatten(v))
        return v

    def _stat_variable(self, field):
        """The variable of a statistics field: a counter (``Stats.GRAPH_FIELDS``, int64), an
        uncheckpointed count (int64) or a time field (float64)."""
        counters = self._counter_vars()
        return counters[field] if field in counters else self._timing_vars()[field]

    # -- learning-rate following (hvd_qsgd.error_feedback) -----------------------------------------

    def follow_learning_rate(self, optimizer):
        """See ``hvd_qsgd.QSGD.follow_learning_rate``: a Keras optimizer, or a function returning the
        learning rate now (a number or a tensor; read when the training step is traced)."""
        if optimizer is not None and not callable(optimizer) and not hasattr(optimizer, "learning_rate"):
            raise TypeError(f"follow_learning_rate: expected a Keras optimizer or a function returning the "
                            f"learning rate, got {type(optimizer).__name__}")
        self._learning_rate = optimizer
        return self

    def _lr_now(self):
        source = self._learning_rate
        if not hasattr(source, "learning_rate"):
            return source()
        lr = source.learning_rate
        if callable(lr) and not isinstance(lr, (tf.Tensor, tf.Variable)):  # a schedule (Keras 2)
            lr = lr(source.iterations)
        return lr

    def _residual(self, ctx, size):
        """The error-feedback residual of what this rank encodes of the exchange ``ctx``, ``size``
        elements (a variable of its state key, made zero at first), rescaled by lr_made / lr_now (1
        without follow_learning_rate, or where either is not a finite positive number). Traced steps
        only: the adapter refuses error feedback eagerly before any chain runs."""
        variable = self._state(self.residuals.residuals, ctx.key, lambda: state_variable(
            tf.zeros([size], tf.float32), name=f"{ctx.name}_residual"))
        if variable.shape.num_elements() != size:
            raise ValueError(f"{ctx.where}: its error-feedback residual ({ctx.key}) has "
                             f"{variable.shape.num_elements()} elements: the function handed the "
                             "compressor other tensors in this position when it was first traced")
        if self._learning_rate is None:
            return GraphResidual(variable, tf.constant(1.0))
        lr = tf.cast(tf.convert_to_tensor(self._lr_now()), tf.float32)
        made = self._state(self.residuals.rates, ctx.key, lambda: state_variable(
            0.0, dtype=tf.float32, name=f"{ctx.name}_residual_lr"))
        ok = usable_rate(lr) & usable_rate(made)
        return GraphResidual(variable, tf.where(ok, made / tf.where(ok, lr, 1.0), 1.0), lr, made)

    def rescale_residuals(self, factor):
        """Multiply every error-feedback residual by ``factor`` (eager execution)."""
        for v in self.residuals.residuals.values():
            v.assign(v * float(factor))

    # -- state --------------------------------------------------------------------------------

    @property
    def stats(self):
        """Cumulative counters (see ``hvd_qsgd.settings.Stats``, less ``host_fallbacks`` and the cross-node
        bytes): numbers when executing eagerly,
        the counter tensors otherwise (evaluate them in a session)."""
        counters = self._counter_vars()
        if not tf.executing_eagerly():
            return {**counters, **self._timing_vars()}
        d = {k: int(v.numpy()) for k, v in counters.items()}
        for k, v in self._timing_vars().items():
            d[k] = int(v.numpy()) if k in UNCHECKPOINTED_COUNTS else float(v.numpy())
        d["ratio"] = protocol.ratio(d["elements"], d["bytes_sent"])
        return d

    @property
    def variables(self):
        """The compressor's tf.Variables (statistics, occurrence counters, error-feedback residuals,
        DQSGD's schedules, server residuals), for a ``tf.train.Checkpoint``."""
        return (list(self._counter_vars().values()) + list(self._occurrences.values())
                + list(self.residuals.residuals.values()) + list(self.residuals.rates.values())
                + list(self._schedules.values()) + list(self.residuals.server.values()))

    def schedules(self):
        """DQSGD: {state key: the schedule's fields (``tf_schedule.FIELDS``)}, eagerly."""
        return {k: tf_schedule.as_dict(v) for k, v in self._schedules.items()}

    def state_dict(self):
        """Statistics, residuals as NumPy values (eager execution), the settings, the rank and job
        size that made it (residuals are that rank's: ``hvd_qsgd.state.residuals_belong_here``), and
        the occurrence counters that seed the traced exchanges' next payloads (``counters``: a resumed
        run draws the streams an uninterrupted one would)."""
        return {"stats": self.stats, **self.residuals.state_dict(residual=lambda v: v.numpy(),
                                                                  rate=lambda v: float(v.numpy()),
                                                                  server=lambda v: v.numpy()),
                "settings": self.settings.as_dict(), **checkpoint_origin(hvd),
                "counters": {"occurrences": self.exchange_counters()["occurrences"]}}

    def load_state_dict(self, state):
        """Load ``state_dict()``'s (refused where made with other codec settings). A residual or
        occurrence counter of an exchange not traced yet (a new process, before its first step) is
        made now, from the checkpoint, and the trace finds it (a trace that hands over another tensor
        there says so)."""
        kept = loadable(state, self.settings, hvd, "hvd_qsgd.tensorflow.QSGD.load_state_dict")
        if "residuals" not in kept and "residuals" in state:   # (another rank's: this rank's start from zero)
            for v in (*self.residuals.residuals.values(), *self.residuals.rates.values(),
                      *self.residuals.server.values()):
                v.assign(tf.zeros_like(v))
        state = kept
        for k, v in state.get("stats", {}).items():
            if k in Stats.GRAPH_FIELDS:
                self._counter_vars()[k].assign(int(v))
        for field, store in (("residuals", self.residuals.residuals), ("residual_lr", self.residuals.rates),
                             ("server_residuals", self.residuals.server)):
            for k, v in state.get(field, {}).items():
                value = tf.convert_to_tensor(v, tf.float32)
                self._state(store, k, lambda: state_variable(value, name=f"{self.names.prefix}_{field}")).assign(value)
        for k, v in state.get("counters", {}).get("occurrences", {}).items():  # (none in earlier releases)
            self._state(self._occurrences, k, lambda: state_variable(
                0, dtype=tf.int64, name=f"{self.names.prefix}_occurrence")).assign(int(v))

    # -- elastic training (hvd_qsgd.tensorflow.elastic; eager execution) -------------------------

    def exchange_counters(self):
        """What names and seeds the next traced exchanges: the exchanges numbered so far (``seq``)
        and the occurrence counter of every traced exchange, by state key."""
        with self._lock:
            occurrences = dict(self._occurrences)
        return {"seq": self.names.counters()["seq"], "occurrences": {k: int(v.numpy()) for k, v in occurrences.items()}}

    def load_exchange_counters(self, counters):
        """Set the counters of ``exchange_counters()`` (e.g. another rank's): the occurrence counters
        this compressor has are assigned (0 where ``counters`` has none), the others are created."""
        occurrences = {str(k): int(v) for k, v in counters["occurrences"].items()}
        self.names.load_counters({"seq": counters["seq"], "occurrences": {}})
        for k in occurrences:
            self._state(self._occurrences, k, lambda: state_variable(
                0, dtype=tf.int64, name=f"{self.names.prefix}_occurrence"))
        for k, v in list(self._occurrences.items()):
            v.assign(occurrences.get(k, 0))

    def residual_layout(self):
        """{state key: elements} of the error-feedback residuals, and the keys of their learning rates."""
        return {"residuals": {k: int(v.shape.num_elements()) for k, v in self.residuals.residuals.items()},
                "rates": sorted(self.residuals.rates)}

    def create_residuals(self, layout):
        """Create the residuals (zero) and learning rates of ``residual_layout()`` this compressor lacks,
        so that a new worker has every rank's layout before its first trace (checked against it here)."""
        for k, n in layout["residuals"].items():
            v = self._state(self.residuals.residuals, k, lambda: state_variable(
                tf.zeros([n], tf.float32), name=f"{self.names.prefix}_residual"))
            if v.shape.num_elements() != n:
                raise protocol.MismatchError(f"hvd_qsgd: the error-feedback residual {k} has "
                                             f"{v.shape.num_elements()} elements here and {n} in the layout given")
        for k in layout["rates"]:
            self._state(self.residuals.rates, k, lambda: state_variable(
                0.0, dtype=tf.float32, name=f"{self.names.prefix}_residual_lr"))

    def load_stats(self, stats):
        """Set the statistics counters (those of ``stats``, as the eager ``stats`` gives them)."""
        for k, v in self._counter_vars().items():
            v.assign(int(stats[k]))
        for k, v in self._timing_vars().items():
            v.assign(int(stats.get(k, 0)) if k in UNCHECKPOINTED_COUNTS else float(stats.get(k, 0.0)))

    def reset(self, residuals=True):
        """Forget every exchange in progress (the slots of eager exchanges), and with ``residuals``
        zero every error-feedback residual and the learning rate it was made at (as when created).
        For after Horovod was shut down and re-initialised (an elastic reset); the exchange counters
        are kept. The variables stay: the traced functions that read them stay valid."""
        self.names.reset()
        if residuals:
            for v in self.residuals.residuals.values():
                v.assign(tf.zeros_like(v))
            for v in self.residuals.rates.values():
                v.assign(tf.zeros_like(v))
            # a server residual is the chunk of a world that is gone: dropped; the retrace of the
            # step makes one of the new chunk's size
            self.residuals.server = {}


def state_variable(initial_value, name, dtype=None):
    """A variable of the compressor's state (not trainable), made where its caller made it -- under
    ``tf.init_scope``, from a value known then -- without going through the variable creators of
    an enclosing ``tf.function``. ``tf.Variable`` would: the function then sees a variable made
    in its first trace and traces the whole step a second time, to lift the variable's initializer
    out (the step's first call took twice its trace for the compressor's counters alone). These
    variables are initialized as they are made, so nothing need be lifted."""
    return resource_variable_ops.ResourceVariable(initial_value, dtype=dtype, trainable=False, name=name)


def _initialize_in_session(variables):
    """In a ``tf.compat.v1`` graph, the compressor's variables are made when the training step is
    built, which may be after the session ran its initializer (Horovod's own graph-mode tests do
    so): they are initialized in the default session of their graph, if there is one, as they are
    made. Elsewhere (eager, ``tf.function``, no session yet) nothing is run."""
    variables = list(variables)
    if not variables or tf.executing_eagerly():
        return
    session = tf.compat.v1.get_default_session()
    if session is not None and session.graph is variables[0].graph:
        session.run([v.initializer for v in variables])


def usable_rate(lr):
    """Where a learning rate can rescale a residual: finite and positive."""
    return tf.math.is_finite(lr) & (lr > 0)


class GraphResidual:
    """An error-feedback residual kept in a variable, and what it is worth now: ``factor`` (lr_made /
    lr_now, 1 without learning-rate following). The encode ops with error feedback (QsgdEncodeEf,
    QsgdEncodeChunksEf) take the variable and the factor, encode ``x + residual * factor`` and update
    the variable in place to that minus its decoded payload(s), except where that is not finite (a
    bucket that held a NaN or an Inf decodes to NaN: there the rescaled residual stays, so one
    overflowing step skipped by loss scaling does not make every later gradient non-finite), as the
    PyTorch path keeps it (``hvd_qsgd.error_feedback``); ``keep`` records the learning rate it was
    made at."""

    def __init__(self, variable, factor, lr=None, lr_variable=None):
        self.variable, self.factor, self.lr, self.lr_variable = variable, factor, lr, lr_variable

    def keep(self, encoded):
        """The op that records the learning rate now as the one the residual was made at, once the
        encode op that updated it (``encoded``: its result) has run; a no-op without one."""
        with tf.control_dependencies([encoded]):
            if self.lr is None:
                return tf.no_op()
            return self.lr_variable.assign(tf.where(usable_rate(self.lr), self.lr, self.lr_variable))
