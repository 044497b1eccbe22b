"""Bad inputs through Horovod's PyTorch and TensorFlow APIs, under real ``horovodrun --gloo -np 2``
jobs: one launch per framework runs every case (tests/mp/robustness_torch.py,
tests/mp/robustness_tf.py), and every rank must print ``OK <case>`` for each.

The results asserted in the workers are those of docs/compressor.md ("What happens to a tensor"):
NaN/Inf propagate per bucket on every rank under both reductions (the other buckets finite and
exact), error feedback stays finite after a non-finite step, all-zero gives exact zeros, empty and
0-d tensors keep their shape, non-contiguous tensors give their contiguous copy's result,
integer/bool/sparse tensors get Horovod's own behaviour, fp16/bf16 keep their dtype and are exact,
a PyTorch tensor on the meta device is refused on every rank naming tensor and device, an
uncompressed float64 vector where another rank's tensor is compressed fails Horovod's shape check on
every rank (never summed with a control vector), so does a tensor of another shape or dtype under the
hierarchical reduction on one node, and tf.IndexedSlices take Horovod's allgather path.
"""
import re

import pytest

from tests.helpers import launch

TORCH_CASES = ["nonfinite-allreduce", "nonfinite-optimizer", "nonfinite-error-feedback", "zeros", "empty", "scalar",
               "noncontiguous", "integers", "sparse", "low-precision", "meta-device", "unnamed-mismatch",
               "unnamed-state", "threads-shared", "direct-decompress", "shape-collision",
               "hierarchical-shapes"]
TF_CASES = ["nonfinite-allreduce", "nonfinite-tape", "nonfinite-error-feedback", "zeros", "empty", "scalar",
            "transposed", "integers", "low-precision", "indexed-slices", "unnamed-mismatch", "shape-collision",
            "unknown-shape"]


def ok_ranks(out, case):
    """The ranks that printed ``OK <case>`` (Gloo prefixes each line with ``[rank]<stdout>:``)."""
    return sorted(int(r) for r in re.findall(rf"^\[(\d+)\]<stdout>:OK {re.escape(case)}$", out, flags=re.M))


@pytest.mark.parametrize("worker,cases", [("tests/mp/robustness_torch.py", TORCH_CASES),
                                          ("tests/mp/robustness_tf.py", TF_CASES)], ids=["torch", "tensorflow"])
def test_every_case_passes_on_every_rank(worker, cases):
    out = launch(2, "gloo", [worker] + cases, timeout=300)
    missing = [c for c in cases if ok_ranks(out, c) != [0, 1]]
    assert not missing, f"cases without OK on both ranks: {missing}\n{out[-4000:]}"
