"""What the package's Keras 3 optimizers share: telling a Keras 3 optimizer from a tf_keras one,
refusing XLA, and turning an optimizer object into one of a subclass of its own class.

The optimizers are made by replacing the object's class with a subclass of it (same name, same
config, same state, ``isinstance`` of the original class), whose ``apply`` adds what the package
does around the optimizer's own: Keras 3's ``apply_gradients`` calls ``apply``, and so does
``model.fit``'s step. A mark on the subclass names the wrapper, so that two of them are never
stacked on one optimizer (gradients reduced twice, or averaged inside local steps).
"""
import re

import keras
import tensorflow as tf

MARK = "_hvd_qsgd_wrapper"


def is_keras3_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is a Keras 3 optimizer (not a tf_keras or TF1 one)."""
    return int(keras.__version__.split(".")[0]) >= 3 and isinstance(optimizer, keras.optimizers.Optimizer)


def in_xla_context() -> bool:
    """Whether the function being traced is XLA-compiled (``jit_compile=True``)."""
    from tensorflow.python.ops import control_flow_util
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def refuse_xla(who: str, optimizer) -> None:
    if in_xla_context():
        raise ValueError(
            f"{who}: optimizer {optimizer.name!r} is applied in an XLA-compiled function, where Horovod's "
            "collectives and hvd_qsgd's ops cannot run; compile the model with jit_compile=False "
            "(Keras 3's default 'auto' turns XLA on where a GPU is)")


def wrap(optimizer, who: str, methods: dict):
    """Give ``optimizer`` (a Keras 3 optimizer no wrapper of the package holds) a subclass of its
    class with ``methods``, marked ``who``; the same object."""
    if not is_keras3_optimizer(optimizer):
        raise TypeError(f"{who}: expected a Keras 3 optimizer (keras.optimizers.Optimizer), got {optimizer!r}")
    held = getattr(optimizer, MARK, None)
    if held is not None:
        raise ValueError(f"{who}: optimizer {optimizer.name!r} is already wrapped by {held} (gradients would "
                         "be reduced twice, or averaged inside local steps)")
    base = type(optimizer)
    optimizer.__class__ = type(base.__name__, (base,), {**methods, MARK: who, "__module__": base.__module__})
    return optimizer


def op_name(text: str) -> str:
    """``text`` with the characters Horovod's collective names refuse replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", text)


def variable_name(i: int, variable) -> str:
    """``<i>_<path>``: a collective's name for the i-th variable, the same on every rank that builds
    the same model."""
    return op_name(f"{i}_" + (getattr(variable, "path", None) or getattr(variable, "name", "") or "var"))
