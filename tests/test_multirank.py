"""Payloads exchanged between real processes: horovodrun (Gloo and MPI controllers, Horovod's torch
allgather) and mpirun (mpi4py Allgatherv). Every rank must end with the single-process decode_sum of
every rank's payload divided by the world size, bit for bit. One launch per controller exchanges
every configuration of its rank count in turn."""
import os

import numpy as np
import pytest

from hvd_qsgd import codec
from tests.helpers import launch_once
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


HOROVOD_CONFIGS = [(2, 4, "fixed"), (2, 2, "elias")]
MPI4PY_CONFIGS = [(3, 8, "fixed"), (3, 3, "elias")]


def exchanged(controller, np_, configs, tmp_path_factory):
    """OUT_DIR of the one launch that exchanges every configuration of this rank count in turn."""
    out_dir = tmp_path_factory.getbasetemp() / f"exchange-{controller}-{np_}"
    out_dir.mkdir(exist_ok=True)
    backend = "mpi4py" if controller == "mpirun" else "horovod"
    mine = tuple(f"{b}:{c}" for n, b, c in configs if n == np_)
    launch_once(np_, controller, (WORKER, backend, str(out_dir), str(NUMEL)) + mine)
    return out_dir


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
@pytest.mark.parametrize("np_,bits,coding", HOROVOD_CONFIGS)
def test_horovod_allgather_of_payloads(tmp_path_factory, controller, np_, bits, coding):
    out_dir = exchanged(controller, np_, HOROVOD_CONFIGS, tmp_path_factory)
    _check(os.path.join(out_dir, f"{bits}-{coding}"), np_, bits, coding)


@pytest.mark.parametrize("np_,bits,coding", MPI4PY_CONFIGS)
def test_mpi4py_allgatherv_of_payloads(tmp_path_factory, np_, bits, coding):
    out_dir = exchanged("mpirun", np_, MPI4PY_CONFIGS, tmp_path_factory)
    _check(os.path.join(out_dir, f"{bits}-{coding}"), np_, bits, coding)
