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
of settings and the scatter_allgather chunk steps. The same script, run on the code now with
``encoder=1`` (the encoder of those releases), must give the same digests, case by case.

Its "encoder2" key holds the same cases' digests with encoder version 2 (the default), recorded when
that encoder came, from the script's ``GOLDEN-ENCODER2`` lines of the same job: they must not change
either.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT, launch, run_bounded

GOLDEN = os.path.join(ROOT, "tests", "data", "golden_payloads.json")


def _digests(out, label):
    found = {}
    for line in out.splitlines():
        m = re.search(rf"{label} (\d+) (\{{.*\}})\s*$", line)
        if m:
            found[m.group(1)] = json.loads(m.group(2))
    return found


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_payload_bytes_match_the_recording(framework):
    with open(GOLDEN) as f:
        recorded = json.load(f)
    out = launch(2, "gloo", ["tests/mp/golden_payloads.py", framework], timeout=420)
    for label, expected in (("GOLDEN", recorded[framework]), ("GOLDEN-ENCODER2", recorded["encoder2"][framework])):
        got = _digests(out, label)
        assert sorted(got) == sorted(expected) == ["0", "1"], label
        for rank in expected:
            assert sorted(got[rank]) == sorted(expected[rank]), f"{label}, rank {rank}: cases differ"
            differ = [case for case in expected[rank] if got[rank][case] != expected[rank][case]]
            assert not differ, f"{label}, rank {rank}: bytes changed in {differ}"
    # the recordings of the two encoders differ in every case's payloads (their headers at least)
    for rank, cases in recorded[framework].items():
        same = [c for c in cases if _wire(cases[c]) == _wire(recorded["encoder2"][framework][rank][c])]
        assert not same, f"rank {rank}: encoders 1 and 2 recorded the same payloads in {same}"


def _wire(case):
    """A case's payload digest: "sent" of a compressor case; a codec case is one digest."""
    return case["sent"] if isinstance(case, dict) else case


def test_checkpoints_written_before_load_and_training_goes_on():
    """tests/data/checkpoint_a518ccf.pt: the state_dicts of QSGD (error feedback following the lr,
    scatter_allgather, server error feedback), DQSGD and BlockSign after three steps, saved by
    tests/mp/checkpoint_compat.py at a518ccf; they load into today's compressors unchanged."""
    code, out = run_bounded([sys.executable, "tests/mp/checkpoint_compat.py", "check",
                             os.path.join(ROOT, "tests", "data", "checkpoint_a518ccf.pt")], 120)
    assert code == 0 and "CHECKPOINT OK" in out, out[-3000:]


def record_encoder2():
    """Record the "encoder2" set anew from the code now (when encoder version 2's bytes change on
    purpose): ``python -m tests.test_golden_payloads record-encoder2``. The encoder-1 set is never
    rewritten: the recording stops unless the job reproduces it."""
    with open(GOLDEN) as f:
        recorded = json.load(f)
    new = {}
    for framework in ("torch", "tensorflow"):
        out = launch(2, "gloo", ["tests/mp/golden_payloads.py", framework], timeout=420)
        if _digests(out, "GOLDEN") != recorded[framework]:
            sys.exit(f"{framework}: the encoder-1 payloads differ from the recording; nothing recorded")
        new[framework] = _digests(out, "GOLDEN-ENCODER2")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    recorded["encoder2"] = {"command": "horovodrun -np 2 --gloo python tests/mp/golden_payloads.py "
                                       "torch|tensorflow (its GOLDEN-ENCODER2 lines)",
                            "recorded_at": f"{head} and the working tree's changes", **new}
    with open(GOLDEN, "w") as f:
        f.write(json.dumps(recorded, indent=1, sort_keys=True))   # the file's format: no final newline
    print(f"recorded the encoder-2 set in {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["record-encoder2"]:
        sys.exit("usage: python -m tests.test_golden_payloads record-encoder2")
    record_encoder2()
