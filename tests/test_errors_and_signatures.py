"""One exception base, and the settings parameters written out once (``Settings.make``)."""
import inspect

import numpy as np
import pytest

import hvd_qsgd
from hvd_qsgd import codec, errors, protocol, reduction
from hvd_qsgd.settings import Settings


def test_every_error_of_the_package_derives_from_one_base_and_keeps_its_builtin_parent():
    assert issubclass(hvd_qsgd.PayloadError, hvd_qsgd.Error) and issubclass(hvd_qsgd.PayloadError, ValueError)
    assert issubclass(hvd_qsgd.MismatchError, hvd_qsgd.Error) and issubclass(hvd_qsgd.MismatchError, RuntimeError)
    assert issubclass(hvd_qsgd.EncodeError, hvd_qsgd.Error) and issubclass(hvd_qsgd.EncodeError, RuntimeError)
    assert codec.PayloadError is errors.PayloadError and protocol.MismatchError is errors.MismatchError


def test_a_bad_payload_and_a_refused_encode_are_package_errors():
    with pytest.raises(hvd_qsgd.Error, match="payload"):
        codec.read_header(np.zeros(8, np.uint8), "payload")
    with pytest.raises(hvd_qsgd.EncodeError) as info:  # the buffer is too small for the chunks' payloads
        reduction.encode_chunks(np.zeros(0, np.float32), Settings.make(), 1, 0)
    assert isinstance(info.value, RuntimeError) and info.value.status != 0


def _settings_parameters():
    return list(inspect.signature(Settings.make).parameters)


@pytest.mark.parametrize("owner, extra", [
    ("hvd_qsgd.QSGD", ["named_parameters", "process_set"]),
    ("hvd_qsgd.torch.QSGD", ["named_parameters", "process_set", "settings", "policy", "creation_index"]),
])
def test_compressors_show_the_settings_signature_of_make(owner, extra):
    import hvd_qsgd.torch
    cls = {"hvd_qsgd.QSGD": hvd_qsgd.QSGD, "hvd_qsgd.torch.QSGD": hvd_qsgd.torch.QSGD}[owner]
    params = list(inspect.signature(cls).parameters)
    assert params == _settings_parameters() + extra


def test_front_and_positional_settings_agree_with_make():
    by_position = hvd_qsgd.QSGD(2, 64, "l2", "elias", 5, 3, True, False, "scatter_allgather").settings
    assert by_position == Settings.make(2, 64, "l2", "elias", 5, 3, True, False, "scatter_allgather")
    assert hvd_qsgd.QSGD(bits=8).settings == Settings.make(bits=8)


def test_unknown_or_repeated_settings_are_type_errors_naming_the_compressor():
    with pytest.raises(TypeError, match=r"hvd_qsgd.QSGD: .*unexpected keyword argument 'bitz'"):
        hvd_qsgd.QSGD(bitz=4)
    with pytest.raises(TypeError, match=r"hvd_qsgd.QSGD: .*multiple values for argument 'bits'"):
        hvd_qsgd.QSGD(4, bits=4)
    with pytest.raises(TypeError, match="hvd_qsgd.DynamicQSGD: the bits are chosen per step"):
        hvd_qsgd.DynamicQSGD(3.0, bits=4)
    with pytest.raises(ValueError, match="bits must be an integer"):
        hvd_qsgd.QSGD(bits=9)


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_compressor_class_given_as_the_compression_says_to_make_one(framework):
    """``compression=hvd_qsgd.QSGD`` (the class, where Horovod's own ``hvd.Compression.fp16`` is an
    object): Horovod's ``compression.compress(tensor)`` and ``decompress(tensor, ctx)`` say what to do,
    for every compressor class of the package, where they were a missing-argument TypeError."""
    if framework == "torch":
        import torch
        from hvd_qsgd.adapters.torch import TorchCompressor as adapter
        tensor = torch.zeros(3)
    else:
        tf = pytest.importorskip("tensorflow")
        from hvd_qsgd.adapters.tensorflow.compressor import TensorFlowCompressor as adapter
        tensor = tf.zeros(3)
    for cls in (hvd_qsgd.QSGD, hvd_qsgd.DynamicQSGD, hvd_qsgd.BlockSign, adapter):
        for call in (lambda: cls.compress(tensor), lambda: cls.decompress(tensor, object())):
            with pytest.raises(TypeError, match=r"the compression given is a class .*not a compressor: make one "
                                                r"from it with its settings, e\.g\. compression=hvd_qsgd\.QSGD\(4\)"):
                call()


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_compressor_is_not_copied_or_pickled_and_says_how_to_make_another(framework):
    """``copy.deepcopy`` or ``pickle`` of a compressor (an optimizer that holds it, copied or saved
    whole) says what to do instead, where it failed on a lock; what it says to do works."""
    import copy
    import pickle
    if framework == "torch":
        from hvd_qsgd.adapters.torch import TorchCompressor as adapter
    else:
        pytest.importorskip("tensorflow")
        from hvd_qsgd.adapters.tensorflow.compressor import TensorFlowCompressor as adapter
    front = hvd_qsgd.QSGD(4, error_feedback=True, bucket_size=256)
    for compressor in (front, adapter(4, error_feedback=True), hvd_qsgd.BlockSign(), hvd_qsgd.DynamicQSGD()):
        for copying in (copy.deepcopy, copy.copy, pickle.dumps):
            with pytest.raises(TypeError, match=r"a compressor is not copied or pickled .*make another with the same "
                                                r"settings, hvd_qsgd\.QSGD\(\*\*compressor\.settings\.as_dict\(\)\)"):
                copying(compressor)
    another = hvd_qsgd.QSGD(**front.settings.as_dict())
    assert another.settings == front.settings
    another.load_state_dict(front.state_dict())


def test_follow_learning_rate_refuses_what_it_cannot_read_a_rate_from_when_given():
    """A scheduler, a model or a number is refused at the call, saying what to pass (it used to fail
    at the first exchange, inside Horovod's hook, or call the model with a parameter name); an
    optimizer, a function of the key and None are taken."""
    import torch
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    import hvd_qsgd.torch
    for c in (hvd_qsgd.QSGD(4, error_feedback=True), hvd_qsgd.torch.QSGD(4, error_feedback=True)):
        for wrong, hint in ((torch.optim.lr_scheduler.StepLR(optimizer, 2), "StepLR: pass the optimizer it schedules"),
                            (model, "Linear: pass its optimizer"), (0.1, "builtins.float")):
            with pytest.raises(TypeError, match=f"follow_learning_rate: expected the optimizer .* got .*{hint}"):
                c.follow_learning_rate(wrong)
        for right in (optimizer, lambda key: 0.1, None):
            assert c.follow_learning_rate(right) is c


def test_rescale_residuals_takes_a_finite_factor_of_at_least_zero():
    c = hvd_qsgd.QSGD(4, error_feedback=True)
    for wrong in (float("nan"), float("inf"), -0.5, "2", True):
        with pytest.raises(ValueError, match="rescale_residuals: factor must be a finite number >= 0"):
            c.rescale_residuals(wrong)
    c.rescale_residuals(0)
    c.rescale_residuals(0.5)


def test_load_state_dict_takes_the_compressors_state_dict_and_names_what_it_got_otherwise():
    """Not a compressor's state_dict() (a whole training checkpoint, say): a ValueError naming the
    keys it got, before any adapter is made (one for an unknown key imported another framework)."""
    c = hvd_qsgd.QSGD(4)
    for wrong, got in (({"model": {}, "torch": {}}, r"got keys \['model', 'torch'\]"), ({"torch": 1}, "got keys"),
                       ([("torch", {})], "got a list")):
        with pytest.raises(ValueError, match=r"load_state_dict: expected this compressor's state_dict\(\) .*" + got):
            c.load_state_dict(wrong)
    assert c._adapters == {}
