"""The TensorFlow training examples under horovodrun: examples/tensorflow2_digits.py
(``hvd.DistributedGradientTape(tape, compression=hvd_qsgd.QSGD(...))`` in a ``tf.function`` step) and
examples/keras_digits.py (Keras 3: ``hvd_qsgd.tensorflow.keras.DistributedOptimizer(SGD,
compression=hvd_qsgd.QSGD(...))`` and ``model.fit``; with ``--tf-keras``, tf_keras and Horovod's own
``horovod.tensorflow.keras.DistributedOptimizer``): byte accounting against the codec's payload
sizes, bit-identical replicas, and training parity with the uncompressed run.

Measured on the 2-core development machine: 154 s for the file when it had the machine to itself
(7 launches of 14-35 s, most of it horovodrun's and TensorFlow's start-up and tracing), 264 s beside
another test suite (load average ~9)."""
import pytest

from hvd_qsgd import codec, protocol
from tests.digits_checks import RAW, check_parity, check_qsgd_stats, run_example as run, steps

TF2 = "examples/tensorflow2_digits.py"
KERAS = "examples/keras_digits.py"
# 64-512-512-10 MLP: fc1/kernel and fc2/kernel reach min_numel=10000 and are quantized; the biases
# and fc3 (512 + 512 + 5120 + 10 elements) go through Horovod's allreduce uncompressed -- as float64
# with the TensorFlow adapter (so that a grouped allreduce can hold them with the float64 control
# vectors), hence 8 bytes per element in the examples' byte counts.
QUANTIZED = {"fc1/kernel": 64 * 512, "fc2/kernel": 512 * 512}   # TensorFlow's names of the layers
RAW_BYTES = 8
ALL = sum(QUANTIZED.values()) + RAW


@pytest.mark.parametrize("script, controller, bits, bucket_args, bucket", [
    (TF2, "gloo", 4, [], 512),                             # the defaults
    (KERAS, "mpi", 8, ["--bucket-size", "256"], 256),      # flags reach the compressor; MPI controller
    (KERAS, "gloo", 4, ["--tf-keras"], 512),               # Keras 2 (tf_keras), Horovod's Keras wrapper
], ids=["tensorflow2", "keras3", "tf_keras"])
def test_qsgd_bytes_match_the_payload_sizes(tmp_path, script, controller, bits, bucket_args, bucket):
    r = run(tmp_path, 2, script, "qsgd", ["--compression", "qsgd", "--bits", str(bits), "--epochs", "3"]
            + bucket_args, controller=controller)
    assert r["params_identical"] and len(r["param_checksums"]) == 2, "replicas drifted apart"
    assert (r["bits"], r["bucket_size"], r["min_numel"]) == (bits, bucket, 10000)
    assert r["quantized"] == list(QUANTIZED)
    n = r["steps"]
    assert n == steps(2, 3) == 66

    payload = sum(codec.payload_nbytes(numel, bits, bucket) for numel in QUANTIZED.values())
    assert r["raw_bytes_per_element"] == RAW_BYTES
    assert r["bytes_per_step"] == payload + RAW_BYTES * RAW
    assert r["bytes_per_step_none"] == 4 * ALL
    assert r["control_bytes_per_step"] == len(QUANTIZED) * 8 * protocol.control_length(2)

    check_qsgd_stats(r["stats"], QUANTIZED.values(), RAW, n, payload)
    # 66 steps of SGD with momentum: far above chance (0.1); measured 0.96-0.97 with QSGD(4)
    assert r["test_accuracy"] > 0.85, r


def check_runs(none, compressed, np_, epochs):
    for r in [none] + compressed:
        assert r["params_identical"] and len(set(r["param_checksums"])) == 1, r
        assert r["np"] == np_ and r["steps"] == steps(np_, epochs)
    assert none["bytes_per_step"] == none["bytes_per_step_none"] == 4 * ALL
    for r in compressed:
        # QSGD was really in the loop: its stochastic rounding moved the trajectory off float32's
        # (the parameters, and the test loss, differ even where the test accuracy ties).
        assert r["param_checksums"][0] != none["param_checksums"][0]
        assert r["test_loss"] != none["test_loss"]
        assert r["stats"]["tensors"] == len(QUANTIZED) * r["steps"]
        payload = sum(codec.payload_nbytes(n, r["bits"], 512) for n in QUANTIZED.values())
        assert r["bytes_per_step"] == payload + RAW_BYTES * RAW


def test_tensorflow2_qsgd_reaches_the_uncompressed_accuracy(tmp_path):
    # reduction="allgather": check_runs' byte identity is allgather's (at 4 ranks the default, auto,
    # sends the 262,144-element gradient by scatter_allgather)
    common = ["--epochs", "10", "--seed", "42", "--reduction", "allgather"]
    # QSGD(4) only: QSGD(8)'s variance bound is below QSGD(4)'s (Lemma 3.1), and its parity is
    # tests/test_demo.py's (PyTorch); a third TensorFlow launch of 4 ranks took 50 s of the suite
    none = run(tmp_path, 4, TF2, "none", ["--compression", "none"] + common)
    q4 = run(tmp_path, 4, TF2, "qsgd4", ["--compression", "qsgd", "--bits", "4"] + common)
    check_runs(none, [q4], 4, 10)
    check_parity(none, [q4])


def test_keras3_qsgd4_reaches_the_uncompressed_accuracy(tmp_path):
    # reduction="allgather": check_runs' byte identity is allgather's (at 4 ranks the default, auto,
    # sends the 262,144-element gradient by scatter_allgather)
    common = ["--epochs", "10", "--seed", "42", "--reduction", "allgather"]
    none = run(tmp_path, 4, KERAS, "none", ["--compression", "none"] + common)
    q4 = run(tmp_path, 4, KERAS, "qsgd4", ["--compression", "qsgd", "--bits", "4"] + common)
    check_runs(none, [q4], 4, 10)
    check_parity(none, [q4])
