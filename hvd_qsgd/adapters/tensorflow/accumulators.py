"""The TensorFlow adapter's statistics variables are accumulators, which TensorFlow need not order.

Every exchange of a step adds to the same few variables (a compressor's counters and times).
Inside a ``tf.function``, TensorFlow's automatic control dependencies order the stateful operations
by the resources they touch, and Horovod's ``DistributedGradientTape`` runs each gradient's
compress, allreduce and decompress in a ``tf.cond`` of its own: every such branch wrote those
variables, so each waited for the one before, and a step's exchanges ran one after another, each
paying its collectives' negotiation rounds alone (64 gradients of 20,000 elements on 2 ranks: 107
ms a step, 10.9 ms without that order; docs/performance.md, "TensorFlow: a step's exchanges one
after another").

``register`` marks a variable as an accumulator, and ``_unordered_accumulators`` (a resolver
TensorFlow asks, for every operation it orders, which resources the operation touches) takes the
marked variables out of an operation's resources wherever the operation touches another resource
as well (then its own order holds: a branch keeps its exchange's occurrence counter). Adding to a
resource variable is atomic, so the sums are what they were; a read of a counter in the same
``tf.function`` as the step is no longer ordered after its updates (``stats`` is meant to be read
between steps). Where TensorFlow has no such resolver, the order stays, logged once.
"""
import logging
import threading
import weakref

log = logging.getLogger("hvd_qsgd")
_handles = weakref.WeakValueDictionary()   # id(handle) -> the variable, for each accumulator
_lock = threading.Lock()
_registered = []   # [whether the resolver is registered], decided once


def register(variables):
    """Mark ``variables`` (resource variables that are only ever added to) as accumulators."""
    with _lock:
        if not _registered:
            _registered.append(_register_resolver())
        for v in variables:
            _handles[id(v.handle)] = v


def _register_resolver():
    try:
        from tensorflow.python.framework import auto_control_deps
        auto_control_deps.register_acd_resource_resolver(_unordered_accumulators)
        return True
    except (ImportError, AttributeError) as e:
        log.warning("hvd_qsgd.tensorflow: this TensorFlow has no resolver of automatic control dependencies "
                    "(%s): the exchanges of a tf.function step run one after another, as every one adds to "
                    "the compressor's statistics counters", e)
        return False


def _unordered_accumulators(op, reads, writes):
    """TensorFlow's resolver hook: drop the accumulators from ``op``'s resources where it has others."""
    if not _handles:
        return False
    ours = [t for t in list(reads) + list(writes) if _is_accumulator(t)]
    if not ours or len(ours) == len(reads) + len(writes):
        return False
    for t in ours:
        reads.discard(t)
        writes.discard(t)
    return True


def _is_accumulator(t, depth=16):
    """Whether the resource tensor ``t`` is an accumulator's handle, or a function's capture of one
    (followed out through the enclosing functions' captures)."""
    for _ in range(depth):
        v = _handles.get(id(t))
        if v is not None and v.handle is t:
            return True
        try:
            graph, kind = t.graph, t.op.type
        except AttributeError:   # an eager tensor (not an accumulator's handle)
            return False
        if kind != "Placeholder" or not hasattr(graph, "captures"):
            return False
        t = next((external for external, internal in graph.captures if internal is t), None)
        if t is None:
            return False
    return False
