"""The hierarchical reduction (hvd_qsgd.exchange.hierarchical) through Horovod's PyTorch allreduce,
nodes simulated by HVD_QSGD_RANKS_PER_NODE=2: exact against the single-process reference of its
three stages on every rank, bytes counted, node-link bytes within (c - 1) P, error feedback over
three steps, "auto" resolving to it on nodes of 2 ranks, and ranks that disagree on the layout raise
on every rank. (hvd_qsgd.mpi: tests/test_mpi_reduction.py; TensorFlow: the last test.)"""
import re

import pytest

from tests.helpers import launch

WORKER = "tests/mp/torch_hierarchical.py"


@pytest.mark.parametrize("np_, controller", [(4, "gloo"), (6, "gloo"), (4, "mpi")])
def test_hierarchical_equals_the_three_stage_reference_on_every_rank(np_, controller):
    scenarios = ["exact", "error-feedback", "auto"] + (["malformed-layout", "layouts-differ", "malformed-link"]
                                                       if (np_, controller) == (4, "gloo") else [])
    out = launch(np_, controller, [WORKER] + scenarios, timeout=300, env={"HVD_QSGD_RANKS_PER_NODE": "2"})
    for scenario in ("exact", "error-feedback", "auto") + (("malformed-link",) if "malformed-link" in scenarios else ()):
        assert len(re.findall(rf"OK {scenario}\b", out)) == np_, out[-3000:]
    if "layouts-differ" in scenarios:
        raised = re.findall(r"RAISED MismatchError: (.*?)(?=RAISED|OK|\n|$)", out)
        assert len(raised) == 2 * np_, out[-3000:]
        malformed = [m for m in raised if "disagree" not in m]
        differ = [m for m in raised if "ranks disagree on the compressor settings" in m]
        assert len(malformed) == len(differ) == np_, out[-3000:]
        # both name the variable: the layouts that differ, as what resolves the settings differently
        assert all("HVD_QSGD_RANKS_PER_NODE" in m for m in malformed + differ), out[-3000:]


def test_uneven_hosts_resolve_auto_alike_and_refuse_the_hierarchical_reduction():
    """Two hosts of 2 and 4 ranks (horovodrun -H localhost:2,127.0.0.1:4): "auto" flat on every rank
    (it failed every step where ranks 0-1 took their own local_size for a node size), and the
    hierarchical reduction refused on every rank, naming the hosts' different sizes."""
    out = launch(6, "gloo", [WORKER, "uneven-hosts"], timeout=240, hosts="localhost:2,127.0.0.1:4")
    assert len(re.findall(r"OK uneven-hosts\b", out)) == 6, out[-3000:]


def test_tensorflow_hierarchical_equals_the_reference_on_every_rank():
    """The same chain through Horovod's TensorFlow allreduce (its cross stage an allgather): exact
    eagerly, over three traced steps with error feedback, in a tape step of three gradients, and
    where "auto" resolves to it, bytes counted; layouts that differ fail the control check on every
    rank; with the last rank joined (hvd.join), the others' exchanges give Horovod's joined result."""
    out = launch(4, "gloo", ["tests/mp/tf_hierarchical.py", "exact", "traced-error-feedback", "tape-step", "auto",
                             "layouts-differ", "joined"], timeout=300, env={"HVD_QSGD_RANKS_PER_NODE": "2"})
    for scenario in ("exact", "traced-error-feedback", "tape-step", "auto", "joined"):
        assert len(re.findall(rf"OK {scenario}\b", out)) == 4, out[-3000:]
    raised = re.findall(r"RAISED InvalidArgumentError: (.*?)(?=RAISED|OK|\n|$)", out)
    assert len(raised) == 4 and all("disagree" in m or "settings" in m for m in raised), out[-3000:]
