"""Payloads exchanged between real processes: horovodrun (Gloo and MPI controllers, Horovod's torch
allgather) and mpirun (mpi4py Allgatherv). Every rank must end with the single-process decode_sum of
every rank's payload divided by the world size, bit for bit. One launch per controller exchanges
every configuration of its rank count in turn."""
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


HOROVOD_CONFIGS = [(2, 4, "fixed"), (2, 2, "elias")]
MPI4PY_CONFIGS = [(3, 8, "fixed"), (3, 3, "elias")]
_launched = {}


def exchanged(controller, np_, configs, tmp_path_factory):
    """OUT_DIR of one launch that exchanges every configuration of this rank count in turn."""
    key = (controller, np_)
    if key not in _launched:
        out_dir = tmp_path_factory.mktemp(f"exchange-{controller}-{np_}")
        worker = [WORKER, "mpi4py" if controller == "mpirun" else "horovod", str(out_dir), str(NUMEL)]
        launch(np_, controller, worker + [f"{b}:{c}" for n, b, c in configs if n == np_])
        _launched[key] = out_dir
    return _launched[key]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
@pytest.mark.parametrize("np_,bits,coding", HOROVOD_CONFIGS)
def test_horovod_allgather_of_payloads(tmp_path_factory, controller, np_, bits, coding):
    out_dir = exchanged(controller, np_, HOROVOD_CONFIGS, tmp_path_factory)
    _check(os.path.join(out_dir, f"{bits}-{coding}"), np_, bits, coding)


@pytest.mark.parametrize("np_,bits,coding", MPI4PY_CONFIGS)
def test_mpi4py_allgatherv_of_payloads(tmp_path_factory, np_, bits, coding):
    out_dir = exchanged("mpirun", np_, MPI4PY_CONFIGS, tmp_path_factory)
    _check(os.path.join(out_dir, f"{bits}-{coding}"), np_, bits, coding)
