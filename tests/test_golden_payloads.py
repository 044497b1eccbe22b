"""The restructured package puts the same bytes on the wire as the code before it, and loads its
checkpoints.

tests/data/golden_payloads.json holds SHA-256 digests recorded at commit a518ccf (before the layers,
state objects and codec backends) by tests/mp/golden_payloads.py under ``horovodrun -np 2 --gloo``:
for each case (QSGD with 2..8 bits, both norms, both codings, checksums on and off, fp32/fp16/bf16,
named and numbered exchanges, error feedback, both reductions, server error feedback, DQSGD,
BlockSign; PyTorch and TensorFlow), every payload each rank handed to Horovod's allgather and
alltoall (sorted, since the presence allreduces made their start order timing-dependent; the
"sent" digests were re-recorded so at a518ccf with the script of now), the results it decoded and
its bytes_sent; on rank 0 also the codec's payloads over a grid
of settings and the scatter_allgather chunk steps. The same script, run on the code now, must give
the same digests, case by case.
"""
import json
import os
import re
import sys

import pytest

from tests.helpers import ROOT, launch, run_bounded

GOLDEN = os.path.join(ROOT, "tests", "data", "golden_payloads.json")


def _digests(out):
    found = {}
    for line in out.splitlines():
        m = re.search(r"GOLDEN (\d+) (\{.*\})\s*$", line)
        if m:
            found[m.group(1)] = json.loads(m.group(2))
    return found


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_payload_bytes_match_the_recording(framework):
    with open(GOLDEN) as f:
        expected = json.load(f)[framework]
    got = _digests(launch(2, "gloo", ["tests/mp/golden_payloads.py", framework], timeout=240))
    assert sorted(got) == sorted(expected) == ["0", "1"]
    for rank in expected:
        assert sorted(got[rank]) == sorted(expected[rank]), f"rank {rank}: cases differ"
        differ = [case for case in expected[rank] if got[rank][case] != expected[rank][case]]
        assert not differ, f"rank {rank}: bytes changed in {differ}"


def test_checkpoints_written_before_load_and_training_goes_on():
    """tests/data/checkpoint_a518ccf.pt: the state_dicts of QSGD (error feedback following the lr,
    scatter_allgather, server error feedback), DQSGD and BlockSign after three steps, saved by
    tests/mp/checkpoint_compat.py at a518ccf; they load into today's compressors unchanged."""
    code, out = run_bounded([sys.executable, "tests/mp/checkpoint_compat.py", "check",
                             os.path.join(ROOT, "tests", "data", "checkpoint_a518ccf.pt")], 120)
    assert code == 0 and "CHECKPOINT OK" in out, out[-3000:]
