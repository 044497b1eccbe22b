"""``python -m benchmarks calibrate``: the least-squares fit of alpha and beta (exact on the model's
own times, within a derived bound under bounded relative noise), the crossover helpers, and a
smoke run of the real command at -np 2 with small sizes."""
import json
import math
import sys

import numpy as np
import pytest

from benchmarks import calibrate
from hvd_qsgd import cost_model
from tests.helpers import run_bounded

SIZES = calibrate.sizes_arg(calibrate.DEFAULT_SIZES)   # 1 KiB .. 64 MiB, powers of 4
LINKS = [(50e-6, 10e9 / 8), (1e-3, 3.2e9 / 8), (5e-6, 100e9 / 8)]  # (alpha s, beta B/s)


def _design(collective, n, sizes=SIZES):
    terms = [calibrate.model_terms(collective, n, calibrate.job_bytes(s, n)) for s in sizes]
    return np.array([t[0] for t in terms], float), np.array([t[1] for t in terms], float)


@pytest.mark.parametrize("reduction", ["allreduce", "allgather", "scatter_allgather"])
@pytest.mark.parametrize("n", [2, 3, 4, 16])
def test_model_terms_are_the_cost_models(reduction, n):
    alpha, beta = 50e-6, 10e9 / 8
    for size in (1024, 3 << 20):
        m, b = calibrate.model_terms(reduction, n, size)
        assert m * alpha + b / beta == pytest.approx(cost_model.seconds(reduction, n, size, alpha, beta), rel=1e-12)
    # alltoall: one of scatter_allgather's two phases (the other is an allgather of S/n)
    m, b = calibrate.model_terms("alltoall", n, 4096)
    m2, b2 = calibrate.model_terms("allgather", n, 4096 / n)
    assert (m + m2, b + b2) == pytest.approx(calibrate.model_terms("scatter_allgather", n, 4096))


@pytest.mark.parametrize("alpha,beta", LINKS)
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("collective", calibrate.COLLECTIVES)
@pytest.mark.parametrize("weighting", ["relative", "absolute"])
def test_fit_recovers_alpha_and_beta_from_the_models_own_times(alpha, beta, n, collective, weighting):
    m, b = _design(collective, n)
    f = calibrate.fit(m, b, m * alpha + b / beta, weighting=weighting)
    assert f["alpha_s"] == pytest.approx(alpha, rel=1e-9)
    assert f["beta_Bps"] == pytest.approx(beta, rel=1e-9)
    assert f["rms_rel_residual"] < 1e-9 and f["clamped"] is None and f["points"] == len(SIZES)


def _noise_bound(m, b, t, eps):
    """Per-parameter bound on |fitted - true| for times t_i = tau_i (1 + e_i), |e_i| <= eps.

    The relative fit minimises || A theta - 1 || with A_i = (m_i, b_i) / t_i, so theta_hat = A+ 1.
    The true theta gives A theta = tau / t = 1 / (1 + e), hence theta_hat - theta = A+ delta with
    delta_i = 1 - 1/(1 + e_i) = e_i / (1 + e_i), |delta_i| <= eps / (1 - eps); by Hoelder,
    |theta_hat_j - theta_j| <= ||row j of A+||_1 * eps / (1 - eps). A is built from the noisy times,
    as the fit builds it, so the bound holds for every noise draw (while no parameter is clamped)."""
    pinv = np.linalg.pinv(np.stack([m, b], axis=1) / t[:, None])
    return np.abs(pinv).sum(axis=1) * eps / (1 - eps)


@pytest.mark.parametrize("alpha,beta", LINKS[:2])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("collective", calibrate.COLLECTIVES)
def test_fit_under_bounded_relative_noise_stays_within_the_derived_bound(alpha, beta, n, collective):
    eps = 0.05
    m, b = _design(collective, n)
    tau = m * alpha + b / beta
    rng = np.random.default_rng(n * 1000 + calibrate.COLLECTIVES.index(collective))
    draws = [rng.uniform(-eps, eps, len(tau)) for _ in range(20)] + [np.full(len(tau), eps), np.full(len(tau), -eps)]
    # near-worst cases: every e_i at +-eps with the sign of the estimate's sensitivity to it
    pinv0 = np.linalg.pinv(np.stack([m, b], axis=1) / tau[:, None])
    draws += [eps * np.sign(pinv0[0]), -eps * np.sign(pinv0[0]), eps * np.sign(pinv0[1])]
    worst = [0.0, 0.0]
    for e in draws:
        t = tau * (1 + e)
        f = calibrate.fit(m, b, t)
        assert f["clamped"] is None
        bound = _noise_bound(m, b, t, eps)
        err = (abs(f["alpha_s"] - alpha), abs(f["inv_beta_s_per_B"] - 1 / beta))
        assert err[0] <= bound[0] * (1 + 1e-9) and err[1] <= bound[1] * (1 + 1e-9)
        # the sweep over four decades of sizes pins both parameters down: 5% noise moves each by < 10%
        assert bound[0] < 0.10 * alpha and bound[1] < 0.10 / beta
        worst = [max(worst[0], err[0] / bound[0]), max(worst[1], err[1] / bound[1])]
        assert f["max_rel_residual"] < 2 * eps
    # and the bound is not loose: the adversarial draws reach most of it
    assert worst[0] > 0.5 and worst[1] > 0.5


def test_per_op_overhead_is_told_apart_from_the_per_message_latency():
    """Times with a fixed cost per Horovod operation (k of them) besides the per-message latency: at
    one n the model-form fit folds it into alpha (alpha + k overhead / m, exactly); over several n
    the three-term fit separates them."""
    overhead, alpha, beta = 800e-6, 30e-6, 5e9 / 8
    cols = {k: [] for k in ("ops", "m", "b", "t")}
    for n in (2, 4, 8):
        for coll in calibrate.COLLECTIVES:
            m, b = _design(coll, n)
            k = calibrate.model_ops(coll)
            t = k * overhead + m * alpha + b / beta
            f = calibrate.fit(m, b, t)
            assert f["alpha_s"] == pytest.approx(alpha + k * overhead / m[0], rel=1e-9)
            assert f["beta_Bps"] == pytest.approx(beta, rel=1e-9)
            for key, v in (("ops", np.full(len(t), k)), ("m", m), ("b", b), ("t", t)):
                cols[key].extend(v)
    f = calibrate.fit(cols["m"], cols["b"], cols["t"], ops=cols["ops"])
    assert f["overhead_s"] == pytest.approx(overhead, rel=1e-9) and f["alpha_s"] == pytest.approx(alpha, rel=1e-9)
    assert f["beta_Bps"] == pytest.approx(beta, rel=1e-9) and f["rms_rel_residual"] < 1e-9
    # one n: the overhead and the latency cannot be told apart
    with pytest.raises(ValueError):
        calibrate.fit(m, b, t, ops=np.full(len(t), 1.0))
    # without an overhead in the times the three-term fit holds it at 0
    m, b = _design("allgather", 4)
    m2, b2 = _design("allgather", 8)
    f = calibrate.fit(np.r_[m, m2], np.r_[b, b2], np.r_[m, m2] * alpha + np.r_[b, b2] / beta, ops=np.ones(2 * len(m)))
    assert f["overhead_s"] == pytest.approx(0.0, abs=1e-12) and f["alpha_s"] == pytest.approx(alpha, rel=1e-9)


def test_fit_clamps_and_refuses():
    m = np.full(4, 2.0)
    b = np.array([1e3, 1e4, 1e5, 1e6])
    # times falling with size: no bandwidth term, beta infinite, alpha the (weighted) mean
    f = calibrate.fit(m, b, [4e-3, 3.9e-3, 3.8e-3, 3.7e-3])
    assert f["clamped"] == "inv_beta" and math.isinf(f["beta_Bps"]) and 1.8e-3 < f["alpha_s"] < 2e-3
    # a line through the origin with a negative intercept: alpha 0, beta from the slope
    f = calibrate.fit(m, b, 1e-9 * b - 1e-7 * (b < 5e3))
    assert f["clamped"] == "alpha" and f["alpha_s"] == 0.0 and f["beta_Bps"] > 0
    with pytest.raises(ValueError):
        calibrate.fit([2, 2], [1e3, 1e3], [1e-3, 1e-3])      # one size: alpha and beta not separable
    with pytest.raises(ValueError):
        calibrate.fit([2], [1e3], [1e-3])
    with pytest.raises(ValueError):
        calibrate.fit([2, 2], [1e3, 1e4], [1e-3, 0.0])
    with pytest.raises(ValueError):
        calibrate.fit([2, 2], [1e3, 1e4], [1e-3, 2e-3], weighting="log")


@pytest.mark.parametrize("n", [3, 4, 8, 16])
def test_crossovers_agree_with_the_cost_model(n):
    alpha, beta = 50e-6, 10e9 / 8
    p = calibrate.crossover_bytes(alpha, beta, n)
    assert p == pytest.approx(alpha * beta * n / (n - 2))
    # below it allgather is the faster by the library's model, above it scatter_allgather
    below, above = 0.99 * p, 1.01 * p
    def model(reduction, payload):
        return cost_model.seconds(reduction, n, payload, alpha, beta)

    assert model("allgather", below) < model("scatter_allgather", below)
    assert model("allgather", above) > model("scatter_allgather", above)
    same = dict(alpha_s=alpha, inv_beta_s_per_B=1 / beta)
    assert calibrate.lines_crossover(same, same, n) == pytest.approx(p)
    assert calibrate.crossover_bytes(alpha, beta, 2) is None
    assert calibrate.crossover_bytes(alpha, math.inf, n) is None


def test_measured_crossover():
    sizes = [1, 2, 3, 4]
    assert calibrate.measured_crossover(sizes, [1, 1, 1, 1], [2, 0.5, 2, 0.5]) == 4
    assert calibrate.measured_crossover(sizes, [1, 1, 1, 1], [2, 2, 0.5, 0.5]) == 3
    assert calibrate.measured_crossover(sizes, [1, 1, 1, 1], [0.5] * 4) == 1
    assert calibrate.measured_crossover(sizes, [1, 1, 1, 1], [0.5, 0.5, 0.5, 2]) is None


def test_analyse_synthetic_jobs():
    alpha, beta = 200e-6, 2e9 / 8
    jobs = []
    for n in (2, 4):
        points = []
        for coll in calibrate.COLLECTIVES:
            for s in SIZES:
                m, b = calibrate.model_terms(coll, n, calibrate.job_bytes(s, n))
                t = m * alpha + b / beta
                points.append(dict(collective=coll, size=s, bytes=calibrate.job_bytes(s, n), messages=m,
                                   bytes_received=b, median_s=t, min_s=t, times_s=[t]))
        jobs.append(dict(n=n, collectives=list(calibrate.COLLECTIVES), points=points))
    fits, crossovers = calibrate.analyse(jobs)
    # every collective and the joint fit at each n, and over both n without and with a per-op overhead
    assert sorted((str(f["n"]), f["collective"], f["per_op"]) for f in fits) == sorted(
        [(str(n), c, False) for n in (2, 4, "all") for c in calibrate.COLLECTIVES + ("joint",)]
        + [("all", c, True) for c in calibrate.COLLECTIVES + ("joint",)])
    for f in fits:
        assert f["alpha_s"] == pytest.approx(alpha, rel=1e-9) and f["beta_Bps"] == pytest.approx(beta, rel=1e-9)
        assert f["overhead_s"] == (pytest.approx(0.0, abs=1e-12) if f["per_op"] else None)
    (c,) = crossovers
    p = alpha * beta * 4 / 2
    assert c["n"] == 4 and c["joint_fit_bytes"] == pytest.approx(p) and c["fitted_lines_bytes"] == pytest.approx(p)
    assert p <= c["measured_bytes"] < 4 * p       # the first swept size (powers of 4) above it
    assert c["default_bytes"] == pytest.approx(cost_model.LATENCY_S * cost_model.BANDWIDTH_BPS * 2)
    assert "| 4 | joint |" in calibrate.table(fits, crossovers)


def test_size_arguments():
    assert calibrate.parse_size("1K") == 1024 and calibrate.parse_size("64M") == 64 << 20
    assert calibrate.parse_size("4096") == 4096 and calibrate.parse_size("1.5KB") == 1536
    assert SIZES == [1 << k for k in range(10, 27, 2)]
    for bad in ("1X", "", "-4K"):
        with pytest.raises(Exception):
            calibrate.parse_size(bad)
    with pytest.raises(Exception):
        calibrate.sizes_arg("4K,4096")          # one distinct size cannot separate alpha from beta
    assert calibrate.job_bytes(1000, 4) == 992 and calibrate.job_bytes(1, 3) == 12


@pytest.mark.multirank
def test_smoke_run_at_np_2(tmp_path):
    path = tmp_path / "calibrate.json"
    sizes = ["4K", "256K", "16M"]
    cmd = [sys.executable, "-m", "benchmarks", "calibrate", "--np", "2", "--sizes", ",".join(sizes), "--reps", "3",
           "--warmup", "1", "--stat", "min", "--inflight", "2", "--json", str(path)]
    status, out = run_bounded(cmd, timeout=90)
    assert status == 0, out[-4000:]
    assert "## Fitted alpha and beta" in out and "| 2 | joint |" in out
    r = json.loads(path.read_text())
    assert r["sizes"] == [4096, 256 << 10, 16 << 20] and r["stat"] == "min" and r["reps"] == 3 and r["inflight"] == 2
    (job,) = r["jobs"]
    assert job["n"] == 2 and job["sizes"] == r["sizes"] and job["bytes"] == r["sizes"]  # multiples of 8 kept
    assert {(p["collective"], p["size"]) for p in job["points"]} == {
        (c, s) for c in calibrate.COLLECTIVES for s in r["sizes"]}
    assert all(len(p["times_s"]) == 3 and 0 < p["min_s"] <= p["median_s"] for p in job["points"])
    fits = {f["collective"]: f for f in r["fits"] if f["n"] == 2}
    assert set(fits) == set(calibrate.COLLECTIVES) | {"joint"}
    for f in fits.values():
        assert f["alpha_s"] > 0 and f["beta_Bps"] is not None and f["beta_Bps"] > 0, (f, out[-3000:])
    assert r["crossovers"] == []        # none at n = 2: scatter_allgather is never chosen there
