"""What Horovod knows about a tensor it hands to a compressor, read from Horovod's own call.

Horovod calls ``compression.compress(tensor)`` from its collectives (``allreduce``,
``grouped_allreduce``, in ``horovod.torch`` and ``horovod.tensorflow``) and from its PyTorch
optimizer (``_allreduce_grad_async``, ``_grouped_allreduce_grad_async``), and then reduces what
``compress`` returned over a process set the compressor is never told. The compressor's own
collectives must run over that same set (or a rank outside it waits forever), and its payloads are
best matched by the name Horovod's optimizer gives the parameter (ranks whose unused branches
differ hand gradients over in different orders). So ``horovod_caller()`` looks at the calling
frames, Horovod's and nothing else's:

* frames of this package are passed over (the compressor's own ``compress`` calls), and so are
  TensorFlow's between them (the wrapper of a function autograph leaves unconverted) and any
  function named ``compress`` (a user's subclass or wrapper of the compressor, which calls its
  ``compress``);
* then, while the frames are Horovod's modules (``horovod.*``, at most ``DEPTH`` of them), the first
  ``process_set`` argument of a collective (or ``self.process_set`` of Horovod's optimizer) is the set
  of the exchange, and ``self._parameter_names[p]`` of Horovod's PyTorch optimizer is the name of
  the parameter ``p`` whose gradient is compressed; a gradient its ``synchronize()`` hands over (one
  no hook handed over: a parameter without a gradient this step) is ``late``: those come in the
  order of a Python set, which differs between ranks;
* a call from anywhere else (a user calling ``compress`` directly) learns nothing: the compressor
  uses what it was given (``process_set=``, ``named_parameters=``) or the global set.

A compressor given a process set or names checks them against what Horovod says, and a
disagreement is an error on every rank that calls (``hvd_qsgd.adapters``).

``traced_variable()`` finds, for TensorFlow, the variable whose gradient is compressed where
Horovod's tape or Keras optimizer reduces a list of gradients (``allreduce_grads(grads, vars)``),
through the frames of TensorFlow's ``tf.cond`` between them; it runs as a step is traced.
"""
import contextlib
import sys
import threading
from typing import Any, NamedTuple, Optional, Tuple

from hvd_qsgd.settings import set_ranks

DEPTH = 6   # Horovod frames looked at: collective <- comprehension <- optimizer method <- hook, at most
# the frames between Horovod's call and this module: the compressor's, and TensorFlow's wrapper of an
# op it leaves unconverted (tf.autograph.experimental.do_not_convert)
_PASSED_OVER = ("hvd_qsgd.", "tensorflow.")


class Caller(NamedTuple):
    """What Horovod's call says about the tensor being compressed."""

    process_set: Any          # the Horovod ProcessSet the result is reduced over, or None (not learned)
    name: Optional[str]       # the parameter's name in Horovod's PyTorch optimizer, or None
    where: str                # the Horovod function that called ("horovod.torch.optimizer._allreduce_grad_async")
    parameter: Any = None     # the parameter whose gradient it is, where ``name`` was learned
    late: bool = False        # handed over by the optimizer's ``synchronize()``, not by its gradient hook
    optimizer: Any = None     # Horovod's optimizer that hands the gradient over (it applies the update)


NOT_LEARNED = Caller(None, None, "")


def _module(frame) -> str:
    return frame.f_globals.get("__name__") or ""


# what a frame is to the walk, by its code object (a function's code runs in its module's globals):
# PASSED_OVER, OTHER, or for Horovod's frames the name ``Caller.where`` gives them
PASSED_OVER, OTHER = object(), object()
# the frame of Horovod's PyTorch optimizer that compresses a gradient (``p``, named by ``self``)
OPTIMIZER_HOOK = "horovod.torch.optimizer._allreduce_grad_async"
# the optimizer's method that hands over, after the backward pass, the gradients no hook handed over
# (parameters without a gradient this step), in the order of a Python set: it differs between ranks
OPTIMIZER_SYNCHRONIZE = "synchronize"
_KINDS: dict = {}
KINDS_KEPT = 4096
# process-set types by type (``_is_process_set``'s duck test, once per type)
_SET_TYPES: dict = {}


def _kind(frame) -> Any:
    """What ``frame`` is to the walk (see ``_KINDS``), worked out once per code object."""
    code = frame.f_code
    kind = _KINDS.get(code)
    if kind is None:
        module = _module(frame)
        kind = (PASSED_OVER if module.startswith(_PASSED_OVER) or code.co_name == "compress" else
                f"{module}.{code.co_name}" if module.startswith("horovod.") else OTHER)
        if len(_KINDS) >= KINDS_KEPT:
            _KINDS.clear()
        _KINDS[code] = kind
    return kind


def _is_process_set(value: Any) -> bool:
    if value is None:
        return False
    kind = type(value)
    known = _SET_TYPES.get(kind)
    if known is None:
        known = _SET_TYPES[kind] = hasattr(value, "process_set_id") and hasattr(value, "ranks")
    return known


def horovod_caller(ours: int = 0) -> Caller:
    """The process set and parameter name Horovod's calling frames hold (see the module docstring);
    ``ours``: how many frames from the caller's up are known to be this package's (not looked at)."""
    try:
        frame, kinds, kind = sys._getframe(1 + ours), _KINDS, OTHER
    except ValueError:   # (no frame above ours: not called from Python)
        return NOT_LEARNED
    while frame is not None:
        kind = kinds.get(frame.f_code) or _kind(frame)   # (every kind is truthy)
        if kind is not PASSED_OVER:
            break
        frame = frame.f_back
    if kind == OPTIMIZER_HOOK:   # (the usual caller, read directly: what the walk below reads there)
        local = frame.f_locals
        owner = local.get("self")
        if owner is not None and "p" in local and "process_set" not in local:
            process_set, names = getattr(owner, "process_set", None), getattr(owner, "_parameter_names", None)
            if _is_process_set(process_set) and isinstance(names, dict):
                parameter = local["p"]
                name = names.get(parameter)
                if name is not None:
                    back = frame.f_back
                    late = back is not None and back.f_code.co_name == OPTIMIZER_SYNCHRONIZE
                    return Caller(process_set, name, kind, parameter, late, owner)
    process_set, name, where, parameter, late, optimizer = None, None, "", None, False, None
    for _ in range(DEPTH):
        if frame is None or kind is OTHER or kind is PASSED_OVER:
            break
        local = frame.f_locals
        owner = local.get("self")
        if process_set is None:
            candidate = local.get("process_set")
            if not _is_process_set(candidate) and owner is not None:
                candidate = getattr(owner, "process_set", None)
            if _is_process_set(candidate):
                process_set, where = candidate, kind
        if name is None and owner is not None and "p" in local:
            names = getattr(owner, "_parameter_names", None)
            if isinstance(names, dict):
                parameter, optimizer = local["p"], owner
                name = names.get(parameter)
                where = where or kind
                late = kind == OPTIMIZER_HOOK and frame.f_back is not None and (
                    frame.f_back.f_code.co_name == OPTIMIZER_SYNCHRONIZE)
        if process_set is not None and name is not None:  # all there is to learn (f_locals costs)
            break
        frame = frame.f_back
        if frame is not None:
            kind = kinds.get(frame.f_code) or _kind(frame)
    if process_set is None and name is None:
        return NOT_LEARNED
    if name is None:
        return Caller(process_set, None, where)
    return Caller(process_set, name, where, parameter, late, optimizer)


def horovod_frame(ours: int = 0) -> Any:
    """The frame of the Horovod function that called the compressor (past this package's frames and
    a user's ``compress`` wrapping it; ``ours`` as ``horovod_caller``'s), or None where the caller is
    not Horovod's: what tells one unnamed Horovod call from the next (``hvd_qsgd.exchange.deferred``)."""
    try:
        frame = sys._getframe(1 + ours)
    except ValueError:
        return None
    while frame is not None:
        kind = _KINDS.get(frame.f_code) or _kind(frame)
        if kind is not PASSED_OVER:
            break
        frame = frame.f_back
    if frame is None or kind is OTHER:
        return None
    while frame.f_code.co_name.startswith("<") and frame.f_back is not None:   # a comprehension's: its function's,
        frame = frame.f_back   # which runs on while the call decompresses (Python 3.11's comprehensions have frames)
    return frame


def call_tensor_name(frame: Any, index: int) -> Optional[str]:
    """The name Horovod's unnamed call running in ``frame`` (``horovod_frame``) gives its ``index``-th
    tensor: ``name=`` of ``hvd.allreduce``, ``name=[index]`` of ``hvd.grouped_allreduce``; None where
    it was given none."""
    name = frame.f_locals.get("name")
    if not isinstance(name, str) or not name:
        return None
    return f"{name}[{index}]" if frame.f_code.co_name.startswith("grouped") else name


def _describe(process_set: Any, ranks) -> str:
    """A process set as messages name it."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return f"the global process set {list(ranks)}"
    return f"process set {process_set.process_set_id} (ranks {list(ranks)})"


def exchange_process_set(caller: Caller, given: Any, global_set: Any, world_size: int) -> Tuple[Any, Optional[str]]:
    """(the process set of an exchange, why it disagrees with the one given, or None): the set Horovod
    reduces over where its call says, else the one given, else the global set. Each adapter raises
    the disagreement its own way (PyTorch: through the control vector; TensorFlow: where it traces)."""
    if caller.process_set is None:
        return (given if given is not None else global_set), None
    if given is not None:
        ours, theirs = set_ranks(given, world_size), set_ranks(caller.process_set, world_size)
        if ours != theirs:
            return caller.process_set, (f"the compressor was given {_describe(given, ours)}, but {caller.where} "
                                        f"reduces over {_describe(caller.process_set, theirs)}: give the compressor "
                                        "the same set, or none (it takes Horovod's)")
    return caller.process_set, None


# Horovod's TensorFlow function that reduces a list of gradients of a list of variables (as written,
# or as autograph converts it), each gradient in a comprehension over ``enumerate(grads)``
_TF_GRADIENTS = ("allreduce_grads", "tf__allreduce_grads")
TRACED_DEPTH = 96   # frames looked at: TensorFlow's tf.cond and autograph between Horovod's calls


_REDUCING = threading.local()   # the variable whose gradient the package's own optimizer hands over


@contextlib.contextmanager
def reducing_gradient_of(variable: Any):
    """Within: the gradient compressed is ``variable``'s (the package's Keras 3 optimizer says so
    around its ``hvd.allreduce``, as ``traced_variable`` finds it in Horovod's frames)."""
    _REDUCING.variable = variable
    try:
        yield
    finally:
        _REDUCING.variable = None


def traced_variable() -> Any:
    """The variable whose gradient the calling compress is handed by the package's optimizer
    (``reducing_gradient_of``) or Horovod's ``allreduce_grads`` (``vars[i]``, where the gradient is
    ``grads[i]`` of the comprehension that hands it over), or None where another call compresses."""
    variable = getattr(_REDUCING, "variable", None)
    if variable is not None:
        return variable
    frame, each = sys._getframe(1), None
    for _ in range(TRACED_DEPTH):
        if frame is None:
            return None
        if _module(frame) == "horovod.tensorflow":
            local = frame.f_locals
            if each is None and "i" in local and "grad" in local:
                each = local   # (the comprehension's, or the function's own where it is inlined)
            if frame.f_code.co_name in _TF_GRADIENTS:
                variables, grads = local.get("vars"), local.get("grads")
                i, grad = (None, None) if each is None else (each["i"], each["grad"])
                if isinstance(i, int) and isinstance(variables, (list, tuple)) and isinstance(grads, (list, tuple)) \
                        and 0 <= i < min(len(variables), len(grads)) and grads[i] is grad:
                    return variables[i]
                return None
        frame = frame.f_back
    return None


# Horovod's function that broadcasts an optimizer's state; it calls ``optimizer.step()`` where that
# state is empty, to fill it (only there: on ranks whose state is not, it calls nothing)
BROADCAST_OPTIMIZER_STATE = "broadcast_optimizer_state"
FRAMES_TO_BROADCAST = 8   # (step's wrappers: torch's no_grad and its optimizer hooks)


def in_horovod_state_broadcast() -> bool:
    """Whether the caller runs inside Horovod's ``broadcast_optimizer_state`` (PyTorch), within a few
    frames: an optimizer that exchanges in ``step()`` must then fill its state without a collective,
    which the ranks whose state is not empty would never join."""
    frame = sys._getframe(2)
    for _ in range(FRAMES_TO_BROADCAST):
        if frame is None:
            return False
        if frame.f_code.co_name == BROADCAST_OPTIMIZER_STATE and _module(frame).startswith("horovod."):
            return True
        frame = frame.f_back
    return False
