"""``hvd_qsgd.tensorflow.keras`` as a drop-in for ``horovod.tensorflow.keras`` (and ``hvd_qsgd.tensorflow``
for ``horovod.tensorflow`` in a tape pipeline), on TensorFlow 2.21 with tf_keras and Keras 3.

* Without a launch: every public name of Horovod 0.28.1's Keras module, its ``callbacks`` and its
  ``elastic`` is in the drop-in, taking (at least) Horovod's parameters; the tape names are in
  ``hvd_qsgd.tensorflow``; callbacks become callbacks of their model's Keras; the arguments that mean
  nothing on Keras 3 are accepted with one warning.
* Two launches under ``horovodrun -np 2`` (Gloo) of tests/mp/keras_dropin.py, one with tf_keras
  (``TF_USE_LEGACY_KERAS=1``, set by the worker before TensorFlow is imported) and one with Keras 3:
  ``model.fit`` through the drop-in with every callback, uncompressed, fp16 and ``hvd_qsgd.QSGD(4,
  min_numel=1)``: broadcast (ranks start from rank 0's weights), warm-up then schedule (the learning
  rate at every batch, as Horovod documents), metric averaging (the mean of the ranks' different
  values), replicas identical after training; ``load_model``; the collectives and process sets; the
  package's earlier callback names; a tape step through ``hvd_qsgd.tensorflow``
  (``broadcast_variables``, ``PartialDistributedGradientTape`` with QSGD, ``DistributedOptimizer``).
  The worker reports the names it used; every name of ``USED`` must be among them. About 30 s a
  launch on the 2-core machine (50 s beside other jobs).
"""
import inspect
import re
import warnings

import pytest

from tests.helpers import launch_once

WORKER = "tests/mp/keras_dropin.py"
KERAS = ["tf_keras", "keras3"]
CASES = ["none", "fp16", "qsgd", "warnings", "tape", "load_model", "collectives", "aliases", "sparse_as_dense"]
# names of Horovod's modules that are its own imports, not its API
NOT_API = {"K", "keras", "tf", "inspect", "warnings", "version", "is_version_greater_equal_than"}
# Horovod's Spark estimators' checkpoint (a ModelCheckpoint whose filepath they set later); Keras 3's
# ModelCheckpoint cannot be built without a filepath
NOT_OFFERED = {"BestModelCheckpoint"}
# every name a Horovod Keras pipeline uses, which the launches must call
USED = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
        "Compression", "DistributedOptimizer", "broadcast_variables", "broadcast_global_variables", "allreduce",
        "allgather", "broadcast", "reducescatter", "Average", "Sum", "Adasum", "load_model", "add_process_set",
        "remove_process_set", "global_process_set", "ProcessSet", "BroadcastInitialState", "MetricAverage",
        "callbacks.BroadcastGlobalVariablesCallback", "callbacks.MetricAverageCallback",
        "callbacks.LearningRateWarmupCallback", "callbacks.LearningRateScheduleCallback", "elastic.KerasState",
        "elastic.CommitStateCallback", "elastic.UpdateBatchStateCallback", "elastic.UpdateEpochStateCallback"]
TAPE_NAMES = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
              "cross_size", "allreduce", "grouped_allreduce", "allgather", "broadcast", "broadcast_variables",
              "broadcast_object", "allgather_object", "alltoall", "reducescatter", "join", "DistributedGradientTape",
              "PartialDistributedGradientTape", "DistributedOptimizer", "Compression", "Average", "Sum", "Adasum",
              "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "QSGD"]


def public(module):
    return {n for n in dir(module) if not n.startswith("_") and not inspect.ismodule(getattr(module, n))} - NOT_API


def parameters(obj):
    """The names of the parameters a function, or a class's ``__init__``, takes (None if unknown)."""
    try:
        sig = inspect.signature(obj.__init__ if isinstance(obj, type) else obj)
    except (TypeError, ValueError):
        return None
    return {n for n, p in sig.parameters.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def test_the_dropin_has_every_public_name_of_horovods_keras_module_with_its_parameters():
    import horovod.tensorflow.keras as theirs
    import hvd_qsgd.tensorflow.keras as ours
    pairs = [(theirs, ours), (theirs.callbacks, ours.callbacks), (theirs.elastic, ours.elastic)]
    assert ours.callbacks.__name__ == "hvd_qsgd.tensorflow.keras_callbacks"
    assert ours.elastic.__name__ == "hvd_qsgd.tensorflow.keras_elastic"
    for their_module, our_module in pairs:
        missing = sorted(public(their_module) - NOT_OFFERED - set(dir(our_module)))
        assert missing == [], f"{our_module.__name__} lacks {missing}"
        for name in sorted(public(their_module) - NOT_OFFERED):
            theirs_obj, ours_obj = getattr(their_module, name), getattr(our_module, name)
            if not callable(theirs_obj):  # Average, Sum, global_process_set: Horovod's own
                assert ours_obj is theirs_obj, name
                continue
            wanted = parameters(theirs_obj)
            if wanted is None:  # a C function: Horovod's own object is re-exported
                assert ours_obj is theirs_obj, name
                continue
            assert wanted <= parameters(ours_obj), f"{name}: lacks {sorted(wanted - parameters(ours_obj))}"
    # the package's own objects where Horovod's do not work on TensorFlow 2.21, Horovod's elsewhere
    for name in ["DistributedOptimizer", "load_model", "allreduce", "broadcast_variables"]:
        assert getattr(ours, name).__module__.startswith("hvd_qsgd"), name
    for name in ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
                 "LearningRateScheduleCallback"]:
        assert getattr(ours.callbacks, name) is not getattr(theirs.callbacks, name)
    assert ours.init is theirs.init and ours.Compression is theirs.Compression


def test_hvd_qsgd_tensorflow_has_the_names_of_a_tape_pipeline():
    import horovod.tensorflow as theirs
    import hvd_qsgd.tensorflow as ours
    assert [n for n in TAPE_NAMES if not hasattr(ours, n)] == []
    for name in ["init", "rank", "size", "allreduce", "Compression", "ProcessSet", "alltoall"]:
        assert getattr(ours, name) is getattr(theirs, name), name
    assert ours.DistributedGradientTape.__module__ == "hvd_qsgd.tensorflow.tape"  # as before
    assert ours.QSGD.__module__ == "hvd_qsgd.adapters.tensorflow.compressor"


def test_callbacks_become_callbacks_of_their_models_keras():
    import keras
    import tf_keras
    import hvd_qsgd.tensorflow.keras as hvd
    cb = hvd.callbacks.MetricAverageCallback()
    assert isinstance(cb, keras.callbacks.Callback)  # tf.keras is Keras 3 here (no TF_USE_LEGACY_KERAS)
    legacy_model = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1)])
    cb.set_model(legacy_model)
    assert isinstance(cb, tf_keras.callbacks.Callback) and isinstance(cb, hvd.callbacks.MetricAverageCallback)
    assert cb.model is legacy_model and cb._implements_train_batch_hooks() is False
    warm = hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2, steps_per_epoch=4)
    warm.set_model(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    assert isinstance(warm, keras.callbacks.Callback) and warm.model is not None
    assert isinstance(hvd.BroadcastInitialState(0), hvd.callbacks.BroadcastGlobalVariablesCallback)
    assert isinstance(hvd.MetricAverage(), hvd.callbacks.MetricAverageCallback)
    with pytest.raises(ValueError, match="initial_lr"):
        hvd.callbacks.LearningRateScheduleCallback(None, 0.5)


def test_keras3_optimizer_takes_horovods_arguments_and_says_which_mean_nothing():
    import keras
    import hvd_qsgd.tensorflow.keras as hvd
    from hvd_qsgd.tensorflow import keras_base
    keras_base._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), name="dist", device_dense="/cpu:0",
                                       groups=2, backward_passes_per_step=3, average_aggregated_gradients=True)
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), num_groups=2)
    said = [str(w.message) for w in caught]
    assert sum("groups/num_groups have no effect" in m for m in said) == 1, said
    assert sum("gradient_accumulation_steps" in m for m in said) == 1, said
    assert isinstance(opt, keras.optimizers.SGD) and opt.gradient_accumulation_steps == 3
    assert callable(opt.register_local_var)
    with pytest.raises(ValueError, match="hvd.Average or hvd.Sum"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)


def test_wrapping_a_keras3_optimizer_a_compiled_model_has_stepped_with_says_to_compile_again():
    """Keras keeps the training function it built with the optimizer, which the wrapper (the same
    object) does not reach: fit went on training locally, silently. It warns; compiled again, the
    optimizer reduces through the compressor."""
    import numpy as np
    import keras
    import horovod.tensorflow as hvd
    import hvd_qsgd
    import hvd_qsgd.tensorflow.keras as hqk
    hvd.init()
    x, y = np.ones((8, 6), np.float32), np.ones((8, 2), np.float32)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    opt = keras.optimizers.SGD(0.1)
    model.compile(loss="mse", optimizer=opt)
    model.fit(x, y, batch_size=8, verbose=0)
    c = hvd_qsgd.QSGD(4, min_numel=1)
    with pytest.warns(UserWarning, match=r"has taken 1 step\(s\) already: a model compiled with it keeps the "
                                         r"training function .* compile the model again"):
        hqk.DistributedOptimizer(opt, compression=c)
    model.fit(x, y, batch_size=8, verbose=0)
    assert c.stats["tensors"] == 0   # (what the warning is about)
    model.compile(loss="mse", optimizer=opt)
    model.fit(x, y, batch_size=8, verbose=0)
    assert c.stats["tensors"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hqk.DistributedOptimizer(keras.optimizers.SGD(0.1))   # a fresh one: nothing to say


def test_the_elastic_state_finds_the_compressor_of_the_keras3_optimizer():
    """As hvd_qsgd.torch.elastic.TorchState finds Horovod's optimizer's: not passed, it is carried
    all the same (counters rolled back, residuals dropped at a reset); passed, it is carried once."""
    import keras
    import horovod.tensorflow as hvd
    import hvd_qsgd
    import hvd_qsgd.tensorflow.keras as hqk
    from hvd_qsgd.tensorflow import elastic
    hvd.init()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    c = hvd_qsgd.QSGD(4)
    opt = hqk.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=c)
    assert [s.name for s in elastic.TensorFlowKerasState(model, opt, step=0)._compressors] == ["optimizer.compression"]
    assert [s.name for s in elastic.TensorFlowKerasState(model, opt, compression=c)._compressors] == ["compression"]
    plain = hqk.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert elastic.TensorFlowKerasState(model, plain)._compressors == []


@pytest.mark.parametrize("keras,case", [(k, c) for k in KERAS for c in CASES] + [("keras3", "loss_scaler")])
def test_fit_through_the_dropin_with_every_callback(keras, case):
    out = launch_once(2, "gloo", (WORKER, keras), timeout=240)
    lines = re.findall(rf"^\[\d+\]<stdout>:RESULT {keras} {case} (.*)$", out, flags=re.M)
    assert lines == ["OK", "OK"], f"{keras} {case}: {lines}\n{out[-4000:]}"


@pytest.mark.parametrize("keras", KERAS)
def test_the_launches_call_every_name_of_the_dropin(keras):
    out = launch_once(2, "gloo", (WORKER, keras), timeout=240)
    called = re.findall(r"^\[\d+\]<stdout>:CALLED (.*)$", out, flags=re.M)
    assert len(called) == 2, out[-3000:]
    for line in called:
        assert [n for n in USED if n not in line.split(",")] == []


def test_broadcast_callback_waits_for_the_weights_of_a_model_built_at_its_first_batch():
    """Horovod's Keras MNIST example builds its Sequential at the first batch: before it, tf_keras
    raises on reading the weights; the broadcast then comes after that batch (one process)."""
    import numpy as np
    import tf_keras
    import hvd_qsgd.tensorflow.keras as hvd
    hvd.init()
    model = tf_keras.Sequential([tf_keras.layers.Dense(1)])  # no input shape: built by the first batch
    assert not model.built
    model.compile(optimizer=hvd.DistributedOptimizer(tf_keras.optimizers.SGD(0.1)), loss="mse")
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    model.fit(np.ones((8, 3), np.float32), np.zeros((8, 1), np.float32), batch_size=4, epochs=1, verbose=0,
              callbacks=[callback])
    assert model.built and callback.broadcast_done
