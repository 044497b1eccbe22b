"""The drop-in: Horovod pipelines with only the compression changed (tests/mp/dropin_torch.py,
tests/mp/dropin_tf.py), under real horovodrun jobs, one launch per rank count and framework.

* PyTorch: ``hvd.DistributedOptimizer(..., compression=hvd_qsgd.QSGD(4), process_set=...)`` with the
  compressor told nothing: it takes the process set and the parameter names from Horovod's optimizer
  (``hvd_qsgd.horovod_caller``). Over the even/odd process sets, and with ranks whose unused
  branches differ, both reductions and fusion buffers (planned from the optimizer's parameters, also
  with overlap), the same parameters are updated as uncompressed and the replicas are identical
  within each set. A compressor given another set, or other names, than the
  optimizer's fails the step on every rank, naming both; so does one with error feedback handed to
  two models whose parameters have the same names (their residuals would mix). Residuals
  checkpointed by position, loaded into a compressor that now takes the optimizer's names, restart
  from zero, said once on the log. Layers frozen after the first step, whose gradients Horovod hands
  over in an order that differs between ranks, work with fusion and fusion buffers. A compressed
  ``hvd.allreduce`` in the autograd graph gives the uncompressed gradient.
* TensorFlow: the compressor built inside the ``tf.function`` step and retraced is one compressor
  (``hvd_qsgd.step_built``), step by step identical to the one built outside; the tape over a
  process set takes Horovod's set; a compressed ``hvd.allreduce`` under a gradient tape gives the
  uncompressed gradient; a step traced again on one rank alone (a smaller batch there) still meets
  the other ranks' exchanges; a compressor with error feedback handed to the steps of two models
  raises rather than mix their residuals.
"""
import re

import pytest

from tests.helpers import launch_once, raised_in

ENV = (("HOROVOD_DYNAMIC_PROCESS_SETS", "1"),)
TORCH = ["process-set-allgather", "process-set-scatter", "branches-allgather", "branches-scatter", "branches-buffers",
         "branches-buffers_overlap", "process-set-buffers", "positional-checkpoint", "late-fusion", "differentiable"]
DISAGREE = ["disagree-set", "disagree-names", "disagree-shared", "disagree-unused-fusion"]


def torch_launch(np_):
    return launch_once(np_, "gloo", ("tests/mp/dropin_torch.py", *TORCH, *DISAGREE, "reinit"), timeout=240, env=ENV)


def tf_launch():
    return launch_once(3, "gloo", ("tests/mp/dropin_tf.py", *TF), timeout=300, env=ENV)


def ok_count(out, scenario):
    return len(re.findall(rf"<stdout>:OK {re.escape(scenario)}$", out, flags=re.M))


@pytest.mark.parametrize("np_", [2, 4])
def test_torch_optimizer_over_a_process_set_and_with_unused_branches_needs_no_compressor_arguments(np_):
    out = torch_launch(np_)
    for s in TORCH + ["reinit"]:
        assert ok_count(out, s) == np_, f"{s}:\n{out[-4000:]}"


@pytest.mark.parametrize("np_", [2, 4])
def test_a_compressor_told_another_set_or_names_than_the_optimizer_or_shared_by_two_models_fails_on_every_rank(np_):
    out = torch_launch(np_)
    patterns = {
        "disagree-set": r"MismatchError: hvd_qsgd: tensor '[\w.]+': the compressor was given the global process set \[[0-9, ]+\], but "
                        r"horovod\.torch\.optimizer\._allreduce_grad_async reduces over process set \d+ \(ranks \[",
        "disagree-names": r"MismatchError: hvd_qsgd: tensor '[\w.]+': the compressor's named_parameters call this gradient 'other\.fc\d\.\w+', "
                          r"Horovod's optimizer 'fc\d\.\w+'",
        "disagree-shared": r"MismatchError: hvd_qsgd: tensor 'generator\.fc\d\.\w+': two parameters named 'generator\.fc\d\.\w+' "
                           r"\(of two models, or of two optimizers\) hand their gradients to one compressor, which keeps "
                           r"error-feedback residuals by parameter name",
        # a parameter used on some ranks only, with fusion=True (places taken in order; fusion buffers
        # are planned from the optimizer's parameters: branches-buffers)
        "disagree-unused-fusion": r"MismatchError: hvd_qsgd: .*every parameter must get a gradient (in the backward "
                                  r"pass )?on every rank or on none.*fusion=False, or fusion_mb with Horovod's optimizer",
    }
    for s, pattern in patterns.items():
        raised = raised_in(out, s)
        assert sorted(r for r, _ in raised) == list(range(np_)), f"{s}:\n{out[-4000:]}"
        for _, msg in raised:
            assert re.search(pattern, msg), msg


# the TensorFlow scenarios (tests/mp/dropin_tf.py), one launch for all, and what each shows
TF = {
    "step-built": "the compressor built in the tf.function step is one compressor across traces",
    "process-set": "the tape over a process set needs no compressor arguments",
    "v1-init-first": "a v1 session that ran its initializer before the tape was built steps, exact",
    "differentiable": "a compressed hvd.allreduce under a tape gives Horovod's gradient",
    "one-rank-retrace": "a step traced again on one rank alone meets the other ranks' exchanges",
    "shared-state": "a compressor with error feedback handed to two models refuses to mix their residuals",
}


@pytest.mark.parametrize("scenario", list(TF), ids=list(TF))
def test_tf_pipeline(scenario):
    """Each of ``TF``: every rank of the 3-rank launch prints its OK."""
    out = tf_launch()
    assert ok_count(out, scenario) == 3, f"{scenario} ({TF[scenario]}):\n{out[-4000:]}"
