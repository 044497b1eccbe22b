"""The algorithms of the seed papers, each update rule step by step against a single-process NumPy
re-statement of its equations, under real horovodrun jobs (tests/mp/algorithms_torch.py):

* error feedback with learning-rate changes (QSGD(4) in hvd.DistributedOptimizer), and the
  property it exists for: what the applied updates still owe the summed gradients is exactly the
  scaled mean residual, bounded by G / (s - rho) elementwise at every step;
* DQSGD (``hvd_qsgd.DynamicQSGD``): the bits of every step and the resulting update;
* dist-EF-SGDM (``hvd_qsgd.torch.EFSGDM`` + ``hvd_qsgd.BlockSign``), two-way (scatter_allgather:
  server-side error feedback) and one-way (allgather);
* PQASGD (``hvd_qsgd.torch.PeriodicQuantizedAveraging``) with local and averaged momentum, and
  its averaging state through ``hvd_qsgd.torch.elastic.TorchState``'s sync and restore.
"""
import re

import pytest

from tests.helpers import launch

WORKER = "tests/mp/algorithms_torch.py"
SCENARIOS = ["error-feedback", "dqsgd", "efsgdm-two-way", "efsgdm-one-way", "pqasgd-local", "pqasgd-average",
             "pqasgd-elastic-state", "state-broadcast"]


def ok_lines(out, scenario):
    return len(re.findall(rf"<stdout>:OK {re.escape(scenario)}(?![\w-])", out))


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_update_rules_equal_the_numpy_restatement(controller):
    out = launch(2, controller, [WORKER] + SCENARIOS, timeout=300)
    for s in SCENARIOS:
        assert ok_lines(out, s) == 2, f"{s}:\n{out[-3000:]}"


def test_two_way_compression_at_three_ranks():
    """Uneven chunks: 47 blocks of 256 over 3 ranks, each reducing rank its own server residual."""
    out = launch(3, "gloo", [WORKER, "efsgdm-two-way"], timeout=300)
    assert ok_lines(out, "efsgdm-two-way") == 3, out[-3000:]
