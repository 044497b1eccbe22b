"""What the package's Keras pieces share: telling Keras 3 from tf_keras, refusing XLA, turning an
optimizer object into one of a subclass of its own class, warnings given once, and the Keras 3
distributed optimizer itself (``distributed_optimizer``), which ``hvd_qsgd.tensorflow`` and
``hvd_qsgd.tensorflow.keras`` both hand out.

The optimizers are made by replacing the object's class with a subclass of it (same name, same
config, same state, ``isinstance`` of the original class), whose ``apply`` adds what the package
does around the optimizer's own: Keras 3's ``apply_gradients`` calls ``apply``, and so does
``model.fit``'s step. A mark on the subclass names the wrapper, so that two of them are never
stacked on one optimizer (gradients reduced twice, or averaged inside local steps).

This module imports no other module of ``hvd_qsgd.tensorflow`` and imports Keras 3 only when it is
asked about a Keras 3 object, so ``hvd_qsgd.tensorflow`` can import it without loading Keras.
"""
import os
import re
import sys
import warnings

import tensorflow as tf
import horovod.tensorflow as hvd

from hvd_qsgd.adapters.tensorflow.compressor import in_xla_context
from hvd_qsgd.horovod_caller import reducing_gradient_of

MARK = "_hvd_qsgd_wrapper"
TF_KERAS, KERAS3 = "tf_keras", "keras"
_warned = set()


def warn_once(key: str, message: str) -> None:
    """``warnings.warn(message)`` the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def keras_flavor(obj):
    """``"tf_keras"`` or ``"keras"`` (Keras 3): the Keras that defines ``obj``'s class (or one of its
    bases: a model class written by the user is found by its Keras base); None for neither."""
    for cls in type(obj).__mro__:
        root = (cls.__module__ or "").split(".")[0]
        if root in (TF_KERAS, KERAS3):
            return root
    return None


def default_flavor() -> str:
    """The Keras that ``tf.keras`` is in this process: tf_keras where ``TF_USE_LEGACY_KERAS`` is set
    (as TensorFlow reads it), Keras 3 otherwise."""
    return TF_KERAS if os.environ.get("TF_USE_LEGACY_KERAS") in ("1", "true", "True") else KERAS3


def keras_module(flavor: str):
    """The top module of that Keras (imported)."""
    if flavor == TF_KERAS:
        import tf_keras
        return tf_keras
    import keras
    return keras


def is_keras3_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is a Keras 3 optimizer (not a tf_keras or TF1 one)."""
    keras = sys.modules.get("keras")
    return (keras is not None and int(keras.__version__.split(".")[0]) >= 3
            and isinstance(optimizer, keras.optimizers.Optimizer))


def optimizer_variables(optimizer) -> list:
    """An optimizer's variables: a property on Keras 3 and tf_keras, a method on tf_keras's legacy
    optimizers."""
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def refuse_xla(who: str, optimizer) -> None:
    if in_xla_context():
        raise ValueError(
            f"{who}: optimizer {optimizer.name!r} is applied in an XLA-compiled function, where Horovod's "
            "collectives and hvd_qsgd's ops cannot run; compile the model with jit_compile=False "
            "(Keras 3's default 'auto' turns XLA on where a GPU is)")


def _loss_scaler_of(optimizer, depth: int = 64):
    """The optimizer (a Keras ``LossScaleOptimizer``) applying ``optimizer`` as its inner optimizer,
    found among the callers on the stack, or None."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not optimizer and getattr(owner, "inner_optimizer", None) is optimizer:
            return owner
        frame = frame.f_back
    return None


def refuse_inner_of_loss_scaler(optimizer) -> None:
    """A loss scaler checks the gradients it is given for overflow before it applies its inner
    optimizer; wrapped around the distributed optimizer, those are each rank's own gradients, so a
    rank whose gradients overflow skips the step, and the reduction the other ranks wait in (a hang,
    compressed or not; steps paired with the wrong steps before it). Refused where the step is
    traced, on every rank alike."""
    scaler = _loss_scaler_of(optimizer)
    if scaler is not None:
        raise ValueError(
            f"{WHO}: optimizer {optimizer.name!r} is the inner optimizer of {type(scaler).__name__} "
            f"{scaler.name!r} (model.compile makes one under a mixed_float16 policy), which checks each rank's "
            "own gradients for overflow before they are reduced: a rank whose gradients overflow would skip the "
            "step and leave the other ranks waiting for it. Wrap the other way round, so that the scaler checks "
            "the reduced gradients, the same on every rank: DistributedOptimizer("
            "keras.optimizers.LossScaleOptimizer(optimizer), ...) (model.compile keeps a LossScaleOptimizer)")


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


WHO = "hvd_qsgd.tensorflow.keras.DistributedOptimizer"


def _scaled(g, factor):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
    return g * factor


def distributed_optimizer(optimizer, name=None, device_dense="", device_sparse="", compression=None,
                          sparse_as_dense=False, gradient_predivide_factor=1.0, op=None,
                          backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                          groups=None, process_set=None, scale_local_gradients=True, **tf_only):
    """Horovod's ``DistributedOptimizer`` for the optimizer it is given: a Keras 3 optimizer is wrapped
    here (``apply`` reduces every gradient first; the same object); a tf_keras one goes to Horovod's
    ``horovod.tensorflow.keras.DistributedOptimizer`` and any other (``tf.compat.v1``) to Horovod's
    ``horovod.tensorflow.DistributedOptimizer``, with the same arguments (``tf_only``:
    ``use_locking``, which only the latter has)."""
    compression = hvd.Compression.none if compression is None else compression
    op = hvd.Average if op is None else op
    process_set = hvd.global_process_set if process_set is None else process_set
    common = dict(name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
                  sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
                  backward_passes_per_step=backward_passes_per_step,
                  average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
                  groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
    if not is_keras3_optimizer(optimizer):
        if keras_flavor(optimizer) == TF_KERAS:
            import horovod.tensorflow.keras as hvd_keras
            return hvd_keras.DistributedOptimizer(optimizer, **common)
        return hvd.DistributedOptimizer(optimizer, **common, **tf_only)
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"{WHO}: op must be hvd.Average or hvd.Sum (as Horovod's Keras optimizer), got {op}")
    if getattr(optimizer, "built", False) and int(optimizer.iterations) > 0:
        warnings.warn(f"{WHO}: this optimizer has taken {int(optimizer.iterations)} step(s) "
                      "already: a model compiled with it keeps the training function Keras built then, which "
                      "would go on training locally, unreduced; compile the model again with it (model.compile"
                      "(optimizer=...)) after wrapping, or wrap it before compiling", UserWarning, stacklevel=3)
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError(f"{WHO}: gradient_predivide_factor {gradient_predivide_factor} needs op=hvd.Average")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"{WHO}: gradient_predivide_factor {gradient_predivide_factor} must be positive")
    if num_groups or groups is not None:
        warn_once("groups", f"{WHO}: groups/num_groups have no effect on a Keras 3 optimizer: each gradient is "
                  "reduced by its own hvd.allreduce (which Horovod's tensor fusion batches); the result is the same")
    prescale, postscale = ((1.0 / gradient_predivide_factor, gradient_predivide_factor) if op == hvd.Average
                           else (1.0, 1.0))
    if backward_passes_per_step > 1:
        held = getattr(optimizer, "gradient_accumulation_steps", None)
        if held not in (None, backward_passes_per_step) or (getattr(optimizer, "built", False) and not held):
            raise ValueError(f"{WHO}: backward_passes_per_step={backward_passes_per_step} needs an unbuilt Keras 3 "
                             f"optimizer without another gradient_accumulation_steps (it has {held})")
        optimizer.gradient_accumulation_steps = backward_passes_per_step
        if not average_aggregated_gradients:  # Keras divides the accumulated sum by the steps
            postscale *= backward_passes_per_step
        warn_once("backward_passes", f"{WHO}: on a Keras 3 optimizer backward_passes_per_step="
                  f"{backward_passes_per_step} becomes Keras 3's gradient_accumulation_steps: the same update "
                  "as Horovod's, but every backward pass's gradients are reduced (no communication is saved), and "
                  "optimizer.iterations counts updates, where Horovod's counts backward passes (a learning-rate "
                  f"schedule of iterations advances {backward_passes_per_step} times slower: scale its steps)")
    prefix = (name or "DistributedOptimizer") + "_Allreduce/"
    local = {}  # id -> variable, for register_local_var (the variables are kept, so ids stay theirs)

    def reduce(grads, variables):
        out = []
        for i, (g, v) in enumerate(zip(grads, variables)):
            if g is not None and id(v) in local:
                out.append(_scaled(g, 1.0 / process_set.size()) if scale_local_gradients else g)
                continue
            if g is None:
                out.append(None)
                continue
            if sparse_as_dense and isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            with reducing_gradient_of(v):   # (a compressor keeping state by place checks who holds it)
                out.append(hvd.allreduce(g, device_dense=device_dense, device_sparse=device_sparse, op=op,
                                         compression=compression, name=prefix + variable_name(i, v),
                                         prescale_factor=prescale, postscale_factor=postscale,
                                         process_set=process_set))
        return out

    base = type(optimizer)

    def apply(self, grads, trainable_variables=None):
        refuse_xla(WHO, self)
        refuse_inner_of_loss_scaler(self)
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        if len(grads) == len(variables):  # otherwise Keras raises its own error: they do not pair up
            grads = reduce(grads, variables)
        return base.apply(self, grads, trainable_variables)

    def register_local_var(self, var):
        """Keep ``var``'s gradient local (not reduced; divided by the set's size when
        ``scale_local_gradients``), as Horovod's optimizer does."""
        for v in (var, getattr(var, "value", None)):
            if v is not None:
                local[id(v)] = v

    return wrap(optimizer, WHO, {"apply": apply, "register_local_var": register_local_var,
                                 "process_set": process_set, "compression": compression})
