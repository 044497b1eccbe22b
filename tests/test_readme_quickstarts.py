"""The README's quickstart code blocks run as written under ``horovodrun -np 2`` (Gloo).

tests/mp/readme_quickstarts.py takes each block from README.md by its section and order, fills in
only the README's literal placeholders (``loss=...``, ``# ... the usual loop; then:``), runs it with
``exec`` over a tiny model, optimizer, loss and per-rank data, and checks it: PyTorch, bytes sent and
the averaged gradients identical on both ranks (and near the ranks' exact mean); Keras 3 ``fit``
from weights that differ per rank, and the custom ``tf.function`` step, weights identical on both
ranks afterwards; tf_keras (``TF_USE_LEGACY_KERAS=1``) the same after its ``fit``.

* Without a launch: the four blocks are where the worker looks, with their placeholders, and compile.
* Two launches: the PyTorch, Keras 3 and custom-step blocks in one job (torch and TensorFlow, each with
  its own ``hvd.init()``, share the process), about 25 s on the 2-core machine; tf_keras in its own
  job, since Keras is chosen when TensorFlow is imported, about 15 s.
"""
import re

import pytest

from tests.helpers import launch_once
from tests.mp import readme_quickstarts

WORKER = "tests/mp/readme_quickstarts.py"
SHARED = ("pytorch", "keras3-fit", "custom-step")       # one job, Keras 3
BLOCKS = list(SHARED) + ["tf_keras"]
# A block that does not run as written today, the start of the error it stops with, and why: the test
# is an expected failure while exactly that error is what every rank reports, and passes once the
# README is fixed (then remove the entry). Any other failure fails the test.
KNOWN_README_DEFECTS = {}  # block -> (the error's start, why): a README defect being fixed


def output(block):
    if block == "tf_keras":
        return launch_once(2, "gloo", (WORKER, "tf_keras"), timeout=180, env=(("TF_USE_LEGACY_KERAS", "1"),))
    return launch_once(2, "gloo", (WORKER, *SHARED), timeout=240)


@pytest.mark.parametrize("block", BLOCKS)
def test_the_readme_holds_the_quickstart_block_with_its_placeholder(block):
    start, code = readme_quickstarts.runnable(block)
    compile("\n" * (start - 1) + code, readme_quickstarts.README, "exec")


@pytest.mark.parametrize("block", BLOCKS)
def test_the_quickstart_block_runs_as_written_on_two_ranks(block):
    out = output(block)
    failed = re.findall(rf"^\[(\d+)\]<stdout>:FAIL {re.escape(block)} (.*)$", out, flags=re.M)
    if failed and block in KNOWN_README_DEFECTS:
        error, why = KNOWN_README_DEFECTS[block]
        if sorted(int(r) for r, _ in failed) == [0, 1] and all(msg.startswith(error) and "hvd.init()" in msg
                                                                for _, msg in failed):
            pytest.xfail(why)
    assert not failed, f"the {block} block failed: {failed}\n{out[-6000:]}"
    ok = sorted(int(r) for r in re.findall(rf"^\[(\d+)\]<stdout>:OK {re.escape(block)}$", out, flags=re.M))
    assert ok == [0, 1], f"OK {block} from ranks {ok}, expected [0, 1]:\n{out[-6000:]}"
