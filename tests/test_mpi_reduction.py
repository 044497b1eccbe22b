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
    out = launch(3, "mpirun", [WORKER, "mismatch-bits", "mismatch-reduction", "mismatch-name"], timeout=120)
    raised = re.findall(r"RAISED MismatchError: (.*?)(?=RAISED|OK|\n|$)", out)
    assert len(raised) == 9, out[-3000:]
    assert sum("compressor settings or reduction" in m for m in raised) == 6
    assert sum("on the tensor (name, shape or dtype)" in m for m in raised) == 3
