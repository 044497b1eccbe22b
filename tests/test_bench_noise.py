"""``python -m benchmarks noise``: the quantization error it measures is the codec's (within the
deterministic bound of one stochastic rounding), and its noise estimates obey their definitions on a
tiny model. No timing assertions."""
import argparse
import os
import sys

import numpy as np
import pytest

from benchmarks import noise
from hvd_qsgd import codec
from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "examples"))
import lm_common as lm  # noqa: E402


def rounding_bound(g, bits, bucket, norm):
    """sum_i (scale_B / s)^2: one stochastic rounding moves a coordinate by less than one level gap,
    scale_B / s, with scale_B the bucket's max |x| (norm "max") or its L2 norm ("l2")."""
    s = codec.levels(bits)
    total = 0.0
    for i in range(0, g.size, bucket):
        b = g[i:i + bucket].astype(np.float64)
        scale = np.abs(b).max() if norm == "max" else np.sqrt(np.sum(b ** 2))
        total += b.size * (scale / s) ** 2
    return total


@pytest.mark.parametrize("label", sorted(noise.CONFIGS))
def test_quantization_error_is_the_codecs_and_within_one_rounding(label):
    bits, bucket, norm = noise.CONFIGS[label]
    rng = np.random.default_rng(3)
    # heavy-tailed, with a small tensor that must stay exact
    grads = [rng.standard_t(3, size=(64, 300)).astype(np.float32), rng.normal(size=50).astype(np.float32)]
    err = noise.quantization_error(grads, bits, bucket, norm, seed=5, min_numel=1000)
    g = grads[0].ravel()
    q = codec.decode(codec.encode(g, bits=bits, bucket_size=bucket, norm=norm, seed=5 * 1000))
    assert err == pytest.approx(float(np.sum((q.astype(np.float64) - g) ** 2)), rel=1e-12)
    assert 0 < err <= rounding_bound(g, bits, bucket, norm)


def test_noise_estimates_on_a_tiny_model():
    import torch
    args = argparse.Namespace(ranks=2, batch_size=2, samples=4, draws=2, min_numel=1000, seed=1)
    corpus = lm.Corpus(0.2, 0.05)
    torch.manual_seed(1)
    model = lm.make_model(32, 1, 2, 16, 512, (2, 3))
    r = noise.measure(args, model, 16, corpus, 0, noise.CONFIGS)
    assert r["minibatch_noise"] > 0 and r["grad_norm_sq"] > 0
    assert r["noise_scale_windows"] == pytest.approx(r["tr_sigma1"] / r["grad_norm_sq"])
    c = r["configs"]
    for v in c.values():
        assert v["rho"] == pytest.approx(v["quantization_noise"] / r["minibatch_noise"])
        # (1 / R^2) sum_r E||Q(g_r) - g_r||^2 against E||g_r||^2: rho = q E||g_r||^2 / (R minibatch)
        assert v["rho"] == pytest.approx(v["relative_variance_q"] * r["per_rank_grad_sq"] / (2 * r["minibatch_noise"]))
    # more bits, less noise; a larger bucket, more (max norm); L2 scaling far more than max at 8192
    q = {k: v["relative_variance_q"] for k, v in c.items()}
    assert q["QSGD(8)"] < q["QSGD(4)"] < q["QSGD(4), bucket 8192"] < q["QSGD(4), bucket 8192, L2 norm"]
    assert q["QSGD(2), bucket 64"] < q["QSGD(2), bucket 128"]
