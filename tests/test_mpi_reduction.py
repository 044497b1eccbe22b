"""hvd_qsgd.mpi.QSGDReducer under real mpirun jobs (tests/mp/mpi_reduction.py): both reductions and
"auto" equal the single-process references bit-identically on every rank (uneven and empty chunks,
Average and Sum, fp16, repeated names), Elias payloads of different lengths per rank, and
mismatches raise on every rank."""
import re

import pytest

from tests.helpers import launch

WORKER = "tests/mp/mpi_reduction.py"
EXACT = ["allgather", "scatter_allgather", "auto", "elias-allgather", "elias-scatter_allgather"]


@pytest.mark.parametrize("np_", [3, 4])
def test_mpi4py_reductions_equal_the_single_process_references(np_):
    out = launch(np_, "mpirun", [WORKER] + EXACT, timeout=180)
    for s in EXACT:
        assert len(re.findall(rf"OK {re.escape(s)}(?![a-z_-])", out)) == np_, f"{s}:\n{out[-3000:]}"


def test_mpi4py_mismatches_raise_on_every_rank():
    out = launch(3, "mpirun", [WORKER, "mismatch-bits", "mismatch-reduction", "mismatch-name", "mismatch-op",
                               "mismatch-op-invalid", "mismatch-op-raw"], timeout=120)
    raised = re.findall(r"RAISED MismatchError: (.*?)(?=RAISED|OK|\n|$)", out)
    assert len(raised) == 18, out[-3000:]
    assert sum("compressor settings or reduction" in m for m in raised) == 6
    # (named against the most ranks alike: rank 0 is the one that differs)
    assert sum("ranks [0] disagree with ranks [1, 2] on the tensor (name, shape or dtype)" in m for m in raised) == 3
    assert sum("on the op (rank 0: 'average', rank 1: 'sum')" in m for m in raised) == 6
    # an op refused on one rank raises on every rank, and the next exchange (op-raw) still meets
    assert sum("ranks [1] disagree with ranks [0, 2] on the op (rank 0: 'average', rank 1: 'max')" in m
               for m in raised) == 3, out[-3000:]


@pytest.mark.parametrize("np_", [4, 6])
def test_mpi4py_hierarchical_equals_the_three_stage_reference(np_):
    """Nodes of 2 consecutive ranks (HVD_QSGD_RANKS_PER_NODE): 2 and 3 nodes; every rank equals the
    single-process reference of the three stages bit for bit, and counts the bytes it sent inside and
    across nodes; ranks that disagree on the layout raise on every rank."""
    scenarios = ["hierarchical"] + (["hierarchical-layouts-differ"] if np_ == 4 else [])
    out = launch(np_, "mpirun", [WORKER] + scenarios, timeout=180)
    assert len(re.findall(r"OK hierarchical(?![a-z_-])", out)) == np_, out[-3000:]
    if np_ == 4:
        raised = re.findall(r"RAISED MismatchError: (.*?)(?=RAISED|OK|\n|$)", out)
        assert len(raised) == np_ and all("compressor settings or reduction" in m for m in raised), out[-3000:]
