"""Payloads exchanged between real processes: horovodrun (Gloo and MPI controllers, Horovod's torch
allgather) and mpirun (mpi4py Allgatherv). Every rank must end with the single-process decode_sum of
every rank's payload divided by the world size, bit for bit."""
import os

import numpy as np
import pytest

from hvd_qsgd import codec
from tests.helpers import launch
from tests.mp.exchange_payloads import rank_tensor

WORKER = os.path.join("tests", "mp", "exchange_payloads.py")
NUMEL = 100_003


def _check(out_dir, np_, bits, coding):
    fp = codec.tensor_fingerprint("layer.weight", (NUMEL,), "float32")
    expected_payloads = [codec.encode(rank_tensor(r, NUMEL), bits=bits, coding=coding, bucket_size=512,
                                      seed=r + 1, fingerprint=fp) for r in range(np_)]
    expected = codec.decode_sum(expected_payloads, scale=1.0 / np_)
    for r in range(np_):
        got = np.load(os.path.join(out_dir, f"rank{r}.npz"))
        assert int(got["size"]) == np_
        np.testing.assert_array_equal(got["sent"], expected_payloads[r])
        np.testing.assert_array_equal(got["gathered"], np.concatenate(expected_payloads))
        np.testing.assert_array_equal(got["avg"], expected)  # bit-identical on every rank
    if coding == "elias":
        assert len({p.size for p in expected_payloads}) > 1, "ranks must send different lengths"


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
@pytest.mark.parametrize("np_,bits,coding", [(2, 4, "fixed"), (2, 2, "elias")])
def test_horovod_allgather_of_payloads(tmp_path, controller, np_, bits, coding):
    launch(np_, controller, [WORKER, "horovod", str(tmp_path), str(bits), coding, str(NUMEL)])
    _check(tmp_path, np_, bits, coding)


@pytest.mark.parametrize("np_,bits,coding", [(3, 8, "fixed"), (3, 3, "elias")])
def test_mpi4py_allgatherv_of_payloads(tmp_path, np_, bits, coding):
    launch(np_, "mpirun", [WORKER, "mpi4py", str(tmp_path), str(bits), coding, str(NUMEL)])
    _check(tmp_path, np_, bits, coding)
