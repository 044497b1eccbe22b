"""Compressors built inside a traced TensorFlow step are one compressor across its traces.

Horovod's TensorFlow 2 examples build their compression inside the ``tf.function`` step::

    @tf.function
    def step(first_batch):
        compression = hvd_qsgd.QSGD(4)
        tape = hvd.DistributedGradientTape(tape, compression=compression)

and TensorFlow traces the step more than once (a new Python argument, a new input signature, and
always twice when the first trace creates variables). Each trace runs the constructor again, but a
compressor's state (statistics counters, occurrence counters, error-feedback and server residuals,
DQSGD's schedules) are ``tf.Variable``s that only the first trace of a function may create. So a
compressor built while a function is traced is matched to the one its first trace built:

    the k-th compressor of a class and settings (and process set) built while tracing the
    ``tf.function`` F is, in every later trace of F, that same compressor (the new instance shares
    its state).

Matching is by place, never by value: two compressors built in the same trace are two compressors
(ordinal k), and a compressor built outside any ``tf.function`` (eagerly, or in a
``tf.compat.v1`` graph) is always its own. A user who wants two independent compressors with the
same settings inside one step builds two (or builds them outside the step). F is the nearest
``tf.function`` whose trace is running (a decorated method: its function of that object); where
none is found on the stack, the function graph's name stands for it (``tf.cond``/``tf.while_loop``
branches belong to their function).

Nothing here imports TensorFlow: a process that never imported it never traces.
"""
import sys
import threading
import weakref
from typing import Any, Dict, Hashable, Optional, Tuple

_lock = threading.Lock()
# the traced function (its tf.function object, or its name where none is found) -> {(identity, k): compressor}
_first: "weakref.WeakKeyDictionary[Any, Dict[Tuple[Hashable, int], Any]]" = weakref.WeakKeyDictionary()
_first_by_name: Dict[str, Dict[Tuple[Hashable, int], Any]] = {}
_built: "weakref.WeakKeyDictionary[Any, Dict[Hashable, int]]" = weakref.WeakKeyDictionary()  # trace -> counts
_STACK = 256   # frames looked through for the tf.function being traced


def _tracing_graph() -> Optional[Any]:
    """The function graph being traced now (outside control-flow branches), or None."""
    tf = sys.modules.get("tensorflow")
    if tf is None or tf.executing_eagerly():
        return None
    from tensorflow.python.framework.func_graph import FuncGraph
    from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph
    graph = tf.compat.v1.get_default_graph()
    while isinstance(graph, ControlFlowFuncGraph):
        graph = graph.outer_graph
    return graph if isinstance(graph, FuncGraph) else None


def _traced_function() -> Optional[Any]:
    """The nearest ``tf.function`` on the stack whose trace is running (its ``Function`` object: one
    per decorated function, and one per object for a decorated method), or None."""
    from tensorflow.python.eager.polymorphic_function.polymorphic_function import Function
    frame = sys._getframe(2)
    for _ in range(_STACK):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Function):
            return owner
        frame = frame.f_back
    return None


def first_built(compressor: Any, identity: Hashable) -> Optional[Any]:
    """The compressor an earlier trace built in the place ``compressor`` is being built now, or None
    (then ``compressor`` is the first, and later traces get it)."""
    graph = _tracing_graph()
    if graph is None:
        return None
    function = _traced_function()
    with _lock:
        counts = _built.setdefault(graph, {})
        k = counts.get(identity, 0)
        counts[identity] = k + 1
        built = (_first.setdefault(function, {}) if function is not None
                 else _first_by_name.setdefault(graph.name, {}))
        first = built.get((identity, k))
        if first is None:
            built[(identity, k)] = compressor
        return first
