"""Single-process checks of the algorithms' parts: the DQSGD bit schedule, the learning-rate
rescaling of error feedback, and the arguments every entry point refuses."""
import math

import numpy as np
import pytest

import hvd_qsgd
from hvd_qsgd import error_feedback
from hvd_qsgd.settings import Settings
from hvd_qsgd.dynamic import Schedule


def run(schedule, norms):
    bits = []
    for x in norms:
        bits.append(schedule.next_bits())
        schedule.observe(x)
    return np.array(bits)


@pytest.mark.parametrize("budget", [2.0, 2.5, 3.0, 4.25, 7.0])
@pytest.mark.parametrize("kind", ["decaying", "spiky", "lognormal"])
def test_schedule_keeps_the_budget_within_a_few_bits(budget, kind):
    """While the clamp does not bind, sum_t b_t - t b_bar stays within the repayment of one step's
    deviation: |log2 of the norm's swing| + 1 bit of rounding."""
    rng = np.random.default_rng(1)
    norms = {"decaying": [10 * 0.98 ** t for t in range(400)],
             "spiky": [1 + 15 * (t % 25 == 0) for t in range(400)],
             "lognormal": list(rng.lognormal(0, 0.5, 400))}[kind]
    bits = run(Schedule(budget), norms)
    assert bits.min() >= 2 and bits.max() <= 8
    swing = max(abs(math.log2(a / b)) for a in norms for b in norms[:1]) if kind != "lognormal" else 4.0
    drift = np.abs(np.cumsum(bits - budget))
    assert drift.max() <= swing + 2, (drift.max(), swing)
    assert abs(bits.mean() - budget) <= (swing + 2) / len(norms)


def test_schedule_gives_large_gradients_more_bits():
    """b_t = budget + log2 ||g_t|| - mean: a step whose gradient is 2^k times the usual gets about k
    more bits (then repays them)."""
    norms = [1.0] * 30 + [16.0] + [1.0] * 30
    bits = run(Schedule(3.0), norms)
    assert bits[31] - 3 >= 3, bits[25:40]       # the step after the large norm was observed
    assert bits[:31].tolist() == [3] * 31
    assert abs(bits.sum() - 3 * len(norms)) <= 1


def test_schedule_horizon_term_moves_bits_to_late_steps():
    """With discount 1 - alpha mu < 1: h_t - h_bar = (T-1-t)/2 log2(discount) - (T-1)/4 log2(discount)."""
    T = 200
    bits = run(Schedule(4.0, discount=0.98, total_steps=T), [1.0] * T)
    assert bits[:20].mean() < 4 < bits[-20:].mean()
    expected_late = 4.0 - 0.5 * math.log2(0.98) * (T - 1) / 2
    assert abs(bits[-20:].mean() - expected_late) < 0.6
    assert abs(bits.mean() - 4.0) < 2 / T


def test_schedule_state_round_trip_continues_identically():
    a = Schedule(3.0)
    run(a, [1, 4, 0.5, 2])
    b = Schedule(3.0)
    b.load(a.state())
    more = [3, 0.1, 8, 1]
    assert run(a, more).tolist() == run(b, more).tolist()


def test_schedule_ignores_non_finite_norms():
    s = Schedule(3.0)
    run(s, [2.0])
    s.observe(float("nan"))
    assert s.norm == 2.0


@pytest.mark.parametrize("args, match", [
    (dict(budget_bits_per_coord=9), "budget_bits_per_coord must lie in"),
    (dict(budget_bits_per_coord="3"), "budget_bits_per_coord must be a number"),
    (dict(budget_bits_per_coord=float("nan")), "budget_bits_per_coord must be a number"),
    (dict(min_bits=1), "min_bits must be an integer in 2..8"),
    (dict(min_bits=5, max_bits=4, budget_bits_per_coord=4), "must not exceed"),
    (dict(discount=0), "discount must be in"),
    (dict(discount=0.9), "total_steps must be a positive integer"),
    (dict(total_steps=0), "total_steps must be a positive integer"),
])
def test_dynamic_qsgd_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        hvd_qsgd.DynamicQSGD(**args)


def test_rescale_factor():
    assert error_feedback.rescale_factor(0.1, 0.05) == pytest.approx(2.0)
    for made, now in [(None, 0.1), (0.1, None), (0.0, 0.1), (0.1, 0.0), (float("inf"), 0.1), (0.1, float("nan"))]:
        assert error_feedback.rescale_factor(made, now) == 1.0


def test_server_error_feedback_setting():
    assert Settings.make(server_error_feedback=True).server_error_feedback is True
    with pytest.raises(ValueError, match="server_error_feedback must be True or False"):
        Settings.make(server_error_feedback=1)
    # a rank's own choice: not part of the settings every rank must share
    assert Settings.make(server_error_feedback=True).tag() == Settings.make().tag()


def test_block_sign_defaults():
    c = hvd_qsgd.BlockSign()
    s = c.settings
    assert (s.bits, s.norm, s.bucket_size, s.error_feedback, s.server_error_feedback, s.reduction) == \
        (1, "sign", 512, True, True, "scatter_allgather")
    assert "BlockSign(block_size=512" in repr(c)
    assert hvd_qsgd.BlockSign(block_size=hvd_qsgd.BlockSign.PER_TENSOR).settings.bucket_size == 2 ** 31 - 1


def _named():
    import torch
    return [("w", torch.nn.Parameter(torch.zeros(4)))]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(lr=-1.0), ValueError, "lr must be a number >= 0"),
    (dict(lr=0.1, momentum=1.0), ValueError, "momentum must be < 1"),
    (dict(lr=0.1, compression="blocksign"), TypeError, "must be a hvd_qsgd compressor"),
    (dict(lr=0.1, compression=hvd_qsgd.BlockSign(error_feedback=False)), ValueError, "worker error feedback"),
])
def test_efsgdm_refuses_bad_arguments(kwargs, error, match):
    from hvd_qsgd.torch import EFSGDM
    with pytest.raises(error, match=match):
        EFSGDM(_named(), **kwargs)


def test_averaging_optimizers_refuse_a_compressor_with_state_that_another_one_holds():
    """EFSGDM and PeriodicQuantizedAveraging hand the compressor their updates keyed by place in the
    step: a second optimizer on the same compressor with error feedback (or DQSGD's schedules) would
    share the first's residuals, silently; refused, naming the cause. Without such state, or once
    the first optimizer is gone, it may be shared."""
    import gc
    import torch
    from hvd_qsgd.torch import EFSGDM, PeriodicQuantizedAveraging
    shared = hvd_qsgd.BlockSign(256)
    first = EFSGDM(_named(), lr=0.1, compression=shared)
    with pytest.raises(ValueError, match=r"EFSGDM: this compressor already serves another averaging optimizer "
                                         r"\(EFSGDM\) and keeps error-feedback residuals"):
        EFSGDM(_named(), lr=0.1, compression=shared)
    named = _named()
    with pytest.raises(ValueError, match="PeriodicQuantizedAveraging: this compressor already serves"):
        PeriodicQuantizedAveraging(torch.optim.SGD([p for _, p in named], lr=0.1), named, period=2,
                                   compression=shared)
    del first
    gc.collect()
    EFSGDM(_named(), lr=0.1, compression=shared)   # (the first is gone)
    stateless = hvd_qsgd.QSGD(2)
    for _ in range(2):
        named = _named()
        PeriodicQuantizedAveraging(torch.optim.SGD([p for _, p in named], lr=0.1), named, period=2,
                                   compression=stateless, broadcast=False)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(period=0), ValueError, "period must be an integer >= 1"),
    (dict(period=2.0), ValueError, "period must be an integer >= 1"),
    (dict(period=2, momentum="global"), ValueError, "momentum must be one of"),
])
def test_periodic_averaging_refuses_bad_arguments(kwargs, error, match):
    import torch
    from hvd_qsgd.torch import PeriodicQuantizedAveraging
    named = _named()
    with pytest.raises(error, match=match):
        PeriodicQuantizedAveraging(torch.optim.SGD([p for _, p in named], lr=0.1), named, **kwargs)


def test_periodic_averaging_does_not_broadcast_in_elastic_training(monkeypatch):
    """A worker that joins an elastic job makes it while the others train: a broadcast there would
    wait for them. broadcast=True is refused before any collective; the default is False there."""
    import torch
    from hvd_qsgd.torch import PeriodicQuantizedAveraging
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    named = _named()
    with pytest.raises(ValueError, match=r"broadcast=True in elastic training .*hvd_qsgd.torch.elastic.TorchState"):
        PeriodicQuantizedAveraging(torch.optim.SGD([p for _, p in named], lr=0.1), named, period=2, broadcast=True)
    periodic = PeriodicQuantizedAveraging(torch.optim.SGD([p for _, p in named], lr=0.1), named, period=2)
    assert periodic.local_steps == 0 and set(periodic.anchor) == {n for n, _ in named}


def test_tensorflow_says_what_it_does_not_run():
    """DQSGD and BlockSign's error feedback need a tf.function step in TensorFlow (their state is
    kept per traced tensor): eagerly a clear error, not a silent fallback."""
    import tensorflow as tf
    import horovod.tensorflow as hvd
    hvd.init()
    with pytest.raises(ValueError, match="DynamicQSGD in TensorFlow needs a tf.function training step"):
        hvd_qsgd.DynamicQSGD(3.0).compress(tf.ones([20000]))
    with pytest.raises(ValueError, match=r"error_feedback=True\) needs a tf.function training step"):
        hvd_qsgd.BlockSign().compress(tf.ones([20000]))


def test_block_sign_keeps_server_residuals_where_a_rank_reduces():
    """BlockSign's server error feedback defaults to on under scatter_allgather and auto, off under
    allgather (one-way: no rank reduces); asked for there, it is refused."""
    assert hvd_qsgd.BlockSign().settings.server_error_feedback is True
    assert hvd_qsgd.BlockSign(reduction="auto").settings.server_error_feedback is True
    assert hvd_qsgd.BlockSign(reduction="allgather").settings.server_error_feedback is False
    with pytest.raises(ValueError, match="server_error_feedback=True needs reduction="):
        hvd_qsgd.BlockSign(reduction="allgather", server_error_feedback=True)
