"""Statistical properties of the quantizer, with fixed seeds and bounds derived from the math.

For an element x of a bucket with scale S and s levels (b >= 2), let d = S/s (the level spacing),
t = |x|/d and f = t - floor(t). Q(x) is sign(x)*d*floor(t) with probability 1-f and
sign(x)*d*(floor(t)+1) with probability f, so

    E[Q(x)] = x,    Var[Q(x)] = d^2 f (1 - f) <= d^2 / 4.

For b = 1, Q(x) = +-S with P(+S) = (1 + x/S)/2: E[Q(x)] = x, Var[Q(x)] = S^2 - x^2.
The random stream resolves probabilities to 2^-24, which shifts a mean by at most 2^-24 * d: far
below every tolerance used here.
"""
import math

import numpy as np
import pytest

from hvd_qsgd import codec

TRIALS = 1500
D = 2048
BUCKET = 512


def _vector(seed=0):
    rng = np.random.default_rng(seed)
    # a mix of magnitudes, exact zeros and both signs, like a real gradient
    x = rng.standard_normal(D).astype(np.float32) * rng.choice([1e-3, 1.0, 10.0], size=D).astype(np.float32)
    x[::97] = 0.0
    return x


def _exact_moments(x, bits, norm, bucket):
    """Per-element scale S, E[Q] (= x), Var[Q], and the support of Q, from the definitions."""
    s = codec.levels(bits)
    xb = x.astype(np.float64).reshape(-1, bucket)
    if norm == "max":
        S = np.abs(xb).max(axis=1, keepdims=True)
    else:
        S = np.sqrt((xb ** 2).sum(axis=1, keepdims=True))
    S = np.broadcast_to(S, xb.shape).reshape(-1)
    xf = x.astype(np.float64)
    if bits == 1:
        var = S ** 2 - xf ** 2
        return S, np.maximum(var, 0.0), S  # spacing: 2S between the two points
    d = S / s
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(S > 0, np.abs(xf) / d, 0.0)
    f = t - np.floor(t)
    return S, d * d * f * (1 - f), d


def _decodes(x, bits, norm, trials=TRIALS, bucket=BUCKET):
    out = np.empty((trials, x.size), dtype=np.float64)
    for k in range(trials):
        out[k] = codec.decode(codec.encode(x, bits=bits, bucket_size=bucket, norm=norm, seed=1000 + k))
    return out


# family-wise false-alarm probability of each statistical assertion
ALPHA = 1e-6


def _z_crit(m):
    """Two-sided Bonferroni critical value for m normal z-scores at family-wise ALPHA."""
    from statistics import NormalDist
    return NormalDist().inv_cdf(1 - ALPHA / (2 * max(m, 1)))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("norm", ["max", "l2"])
def test_unbiased_per_coordinate_z(bits, norm):
    x = _vector()
    Q = _decodes(x, bits, norm)
    S, var, spacing = _exact_moments(x, bits, norm, BUCKET)
    mean = Q.mean(axis=0)
    # coordinates with deterministic rounding decode to the grid point itself
    det = var == 0
    assert np.allclose(mean[det], x[det], rtol=1e-6, atol=1e-30)
    # z-test where the normal approximation of a mean of TRIALS Bernoulli draws holds
    # (TRIALS * p * (1 - p) >= 10, the usual rule for the binomial's normal approximation)
    p = var / np.where(spacing > 0, spacing ** 2, 1.0) if bits > 1 else var / (4 * S ** 2 + (S == 0))
    ok = (~det) & (TRIALS * p >= 10)
    assert ok.sum() > D // 4, "the test vector must exercise many random coordinates"
    z = (mean[ok] - x[ok]) / np.sqrt(var[ok] / TRIALS)
    assert np.max(np.abs(z)) < _z_crit(ok.sum()), f"max |z| = {np.max(np.abs(z)):.2f}"
    # all random coordinates, rigorously: Hoeffding for a mean of TRIALS draws in a range of width w
    w = spacing if bits > 1 else 2 * S
    rnd = ~det
    eps = w[rnd] * math.sqrt(math.log(2 * D / ALPHA) / (2 * TRIALS))
    assert np.all(np.abs(mean[rnd] - x[rnd]) <= eps + 1e-6 * np.abs(x[rnd]))
    # and the whole vector: the standardized total error is N(0, 1) by the CLT
    ztot = (mean - x).sum() / math.sqrt(var.sum() / TRIALS)
    assert abs(ztot) < _z_crit(1)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_l2_variance_within_lemma_3_1(bits):
    """QSGD Lemma 3.1: E||Q(v) - v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2 per bucket (L2 scaling)."""
    x = _vector(1)
    s = codec.levels(bits)
    Q = _decodes(x, bits, "l2", trials=400)
    _, var, d_el = _exact_moments(x, bits, "l2", BUCKET)
    err2 = ((Q - x.astype(np.float64)) ** 2).reshape(Q.shape[0], -1, BUCKET).sum(axis=2)  # trials x buckets
    norm2 = (x.astype(np.float64).reshape(-1, BUCKET) ** 2).sum(axis=1)
    bound = min(BUCKET / s ** 2, math.sqrt(BUCKET) / s) * norm2
    expected = var.reshape(-1, BUCKET).sum(axis=1)
    # the exact variance respects the lemma ...
    assert np.all(expected <= bound * (1 + 1e-9))
    # ... and the implementation's empirical variance is that exact variance: per bucket, the mean of
    # 400 draws of ||Q-v||^2 is within 6 standard errors (the 4th moment of each term is known exactly)
    f_var = _var_of_sq_error(x, bits, "l2").reshape(-1, BUCKET).sum(axis=1)
    se = np.sqrt(f_var / Q.shape[0])
    assert np.all(np.abs(err2.mean(axis=0) - expected) <= 6 * se + 1e-12)
    assert np.all(err2.mean(axis=0) <= bound + 6 * se)


def _var_of_sq_error(x, bits, norm):
    """Var[(Q(x) - x)^2] per element: (Q-x)^2 is (f d)^2 w.p. 1-f and ((1-f) d)^2 w.p. f."""
    S, var, d = _exact_moments(x, bits, norm, BUCKET)
    with np.errstate(invalid="ignore", divide="ignore"):
        f = np.where(d > 0, var / np.where(d > 0, d * d, 1), 0.0)  # f(1-f)
    # E[(Q-x)^4] = d^4 f(1-f) ((1-f)^3 + f^3) = d^4 f(1-f)(1 - 3 f(1-f))
    m4 = d ** 4 * f * (1 - 3 * f)
    return np.maximum(m4 - var ** 2, 0.0)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_max_norm_variance_per_coordinate(bits):
    """With max scaling each coordinate lands on one of the two grid points around it, so
    |Q(x) - x| <= S/s always and Var[Q(x)] = (S/s)^2 f(1-f) <= (S/s)^2 / 4."""
    x = _vector(2)
    Q = _decodes(x, bits, "max", trials=400)
    S, var, d = _exact_moments(x, bits, "max", BUCKET)
    assert np.all(np.abs(Q - x) <= d * (1 + 1e-6) + 1e-30)
    assert np.all(var <= d * d / 4 + 1e-30)
    emp = ((Q - x) ** 2).mean(axis=0)
    se = np.sqrt(_var_of_sq_error(x, bits, "max") / Q.shape[0])
    # per coordinate: Chebyshev with the exact 4th moment, family-wise ALPHA over D coordinates
    # (plus the float32 rounding of a decoded grid point, a few ulps of S)
    k = math.sqrt(D / ALPHA)
    assert np.all(np.abs(emp - var) <= k * se + (4 * np.finfo(np.float32).eps * S) ** 2)
    # aggregate: CLT over all coordinates
    assert abs(emp.sum() - var.sum()) <= 6 * math.sqrt((se ** 2).sum())


def test_one_bit_variance_is_exact():
    x = _vector(3)
    Q = _decodes(x, 1, "max", trials=400)
    S, var, _ = _exact_moments(x, 1, "max", BUCKET)
    assert np.all(np.isin(np.abs(Q), [0.0]) | np.isclose(np.abs(Q), S, rtol=1e-6))
    emp = ((Q - x) ** 2).mean(axis=0).sum()
    # (Q-x)^2 is (S-x)^2 or (S+x)^2; its variance per coordinate is 4 x^2 (S^2 - x^2)
    se = math.sqrt((4 * x.astype(np.float64) ** 2 * var).sum() / Q.shape[0])
    assert abs(emp - var.sum()) <= 6 * se


@pytest.mark.parametrize("bucket", [1, 100, 512])
def test_scaled_sign_error_is_the_contraction_of_dist_ef_sgdm(bucket):
    """norm="sign" (bits=1) is deterministic and biased: per bucket v of d elements, C(v) = mean|v| sign(v)
    and ||C(v) - v||^2 = ||v||^2 - ||v||_1^2 / d <= (1 - 1/d) ||v||^2 exactly (Zheng, Huang & Kwok 2019);
    the kernel's scale is that mean rounded to float32, so the identity holds to float32 rounding."""
    x = _vector(4)
    y = codec.decode(codec.encode(x, bits=1, bucket_size=bucket, norm="sign", seed=1)).astype(np.float64)
    np.testing.assert_array_equal(y, codec.decode(codec.encode(x, bits=1, bucket_size=bucket, norm="sign", seed=2)))
    for b in range(0, D, bucket):  # bucket 100: the last bucket has 48 elements, d is its own length
        v, c = x[b:b + bucket].astype(np.float64), y[b:b + bucket]
        d = v.size
        err2, norm2 = ((c - v) ** 2).sum(), (v ** 2).sum()
        identity = norm2 - np.abs(v).sum() ** 2 / d
        # the mean minimizes ||m sign(v) - v||^2: its float32 rounding changes err2 only to second order
        assert abs(err2 - identity) <= 1e-5 * err2 + 1e-9 * norm2, (b, err2, identity)
        assert err2 <= (1 - 1 / d) * norm2 * (1 + 1e-6) + 1e-30
    if bucket == 1:
        np.testing.assert_array_equal(y, x)  # a bucket of one element is exact
    else:
        assert not np.allclose(y, x)  # biased: E[C(v)] = C(v) != v
