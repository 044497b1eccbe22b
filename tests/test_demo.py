"""The demo's training script under horovodrun: QSGD payloads through a real 2-rank training run."""
import json

from hvd_qsgd import codec
from tests.conftest import launch


def test_digits_training_with_qsgd_payloads(tmp_path):
    out = tmp_path / "qsgd.json"
    launch(2, "gloo", ["examples/pytorch_digits.py", "--compression", "qsgd", "--bits", "4", "--epochs", "3",
                       "--no-progress", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["params_identical"], "replicas drifted apart"
    # 64-512-512-10: fc1.weight (32768) and fc2.weight (262144) are quantized, the rest is fp32
    quantized = codec.payload_nbytes(64 * 512, 4, 512) + codec.payload_nbytes(512 * 512, 4, 512)
    plain = 4 * (512 + 512 + 512 * 10 + 10)
    assert r["bytes_per_step"] == quantized + plain
    assert r["bytes_per_step"] / r["bytes_per_step_none"] < 0.15
    # 3 epochs of SGD with momentum on digits: well above chance (0.1) whatever the rounding
    assert r["test_accuracy"] > 0.85, r
