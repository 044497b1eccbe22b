"""hvd_qsgd.report: the summary's arithmetic and the two warnings, without a Horovod job (the
multi-rank checks are tests/test_torch_compressor.py::test_stats_time_summary_and_warnings)."""
import logging

import pytest

import hvd_qsgd
from hvd_qsgd import report
from hvd_qsgd.settings import Stats


def stats(**kw):
    d = Stats().as_dict()
    d.update(kw)
    return d


def test_summary_states_bytes_saved_and_the_projection_per_link():
    # 10 MB an fp32 allreduce would receive, 2 MB received: 8 MB saved, 0.01 s of codec time
    s = report.summary(stats(tensors=4, bytes_received=2_000_000, allreduce_bytes=10_000_000, encode_s=0.006,
                             decode_s=0.004, wait_s=0.5), (1.0, 10.0, 100.0))
    assert s["bytes_saved"] == 8_000_000 and s["codec_s"] == pytest.approx(0.01)
    # change = codec - saved / beta: 1 Gbit/s -> 0.01 - 0.064; 10 -> 0.01 - 0.0064; 100 -> 0.01 - 0.00064
    assert s["projected_change_s"][1.0] == pytest.approx(0.01 - 0.064)
    assert s["projected_change_s"][10.0] == pytest.approx(0.01 - 0.0064)
    assert s["projected_change_s"][100.0] == pytest.approx(0.01 - 0.00064)
    assert s["break_even_gbps"] == pytest.approx(8e6 * 8e-9 / 0.01)  # 6.4 Gbit/s
    text = report.format_summary(s, "q")
    assert "6.40 Gbit/s" in text and "faster" in text and "slower" in text
    with pytest.raises(ValueError, match="positive"):
        report.summary(stats(), (0,))


def test_the_cross_node_bytes_are_said_as_counted_or_not():
    """PyTorch and mpi4py count the bytes to and from other nodes; TensorFlow's stats have no such
    keys, and its summary says they were not counted rather than "sent 0 bytes"."""
    counted = report.format_summary(report.summary(stats(cross_bytes_sent=1234, cross_bytes_received=56)))
    assert "to and from other nodes: sent 1,234 bytes, received 56" in counted
    tf_stats = {k: v for k, v in stats().items() if not k.startswith("cross_")}
    text = report.format_summary(report.summary(tf_stats))
    assert "to and from other nodes: not counted" in text and "sent 0" not in text


def test_a_fresh_compressor_summarises_to_zeros():
    s = hvd_qsgd.QSGD(4).summary()
    assert s["bytes_saved"] == 0 and s["codec_s"] == 0 and s["break_even_gbps"] is None
    assert set(s["projected_change_s"]) == set(report.DEFAULT_LINKS_GBPS)


def test_the_framework_compressors_summarise_as_hvd_qsgd_qsgd_does():
    """hvd_qsgd.torch.QSGD, which the docs offer as the same compressor as a Horovod Compressor
    subclass, has summary() too (it had none)."""
    import hvd_qsgd.torch
    c = hvd_qsgd.torch.QSGD(4)
    assert c.summary() == hvd_qsgd.QSGD(4).summary()
    c.runner.stats.add(tensors=2, bytes_received=1000, allreduce_bytes=9000, encode_s=0.01)
    s = c.summary()
    assert s["bytes_saved"] == 8000 and s["tensors"] == 2 and s["codec_s"] == 0.01


def test_time_fields_are_floats_that_add_and_merge():
    st = Stats()
    st.add(encode_s=0.25, tensors=1)
    st.add(encode_s=0.5, wait_s=1e-6)
    d = st.as_dict()
    assert d["encode_s"] == 0.75 and d["wait_s"] == 1e-6 and d["decode_s"] == 0.0 and d["tensors"] == 1
    assert Stats.merge([d, d])["encode_s"] == 1.5
    other = Stats()
    other.load(d)
    assert other.as_dict() == d


def test_slowdown_warns_once_when_codec_time_exceeds_the_wire_time_saved(caplog):
    busy = stats(tensors=report.MIN_EXCHANGES, allreduce_bytes=1_250_000, bytes_received=0, encode_s=0.2)
    # 1.25 MB saved at 10 Gbit/s is 1 ms of wire time, far below 0.2 s of codec time
    w = report.SlowdownWatch(10e9 / 8)
    with caplog.at_level(logging.WARNING, logger="hvd_qsgd"):
        assert not w.check({**busy, "tensors": report.MIN_EXCHANGES - 1}, "q")  # too early to tell
        assert w.check(busy, "q")
        assert not w.check(busy, "q")  # once
    assert len([r for r in caplog.records if "slows the job down" in r.getMessage()]) == 1
    # at 1 Mbit/s the same bytes take 10 s: compression pays, nothing is said
    assert not report.SlowdownWatch(1e6 / 8).check(busy, "q")


def test_the_slowdown_watch_reads_the_stats_at_the_minimum_and_then_every_check_every_exchanges():
    reads = []

    def stats_of():
        reads.append(len(reads))
        return stats(tensors=0)   # too few to warn: every read is a check that stays quiet

    w = report.SlowdownWatch(10e9 / 8)
    calls = report.MIN_EXCHANGES + 3 * report.CHECK_EVERY
    assert not any(w.observe(stats_of, "q") for _ in range(calls))
    assert len(reads) == 4   # the MIN_EXCHANGES-th exchange, then every CHECK_EVERY-th
    busy = stats(tensors=report.MIN_EXCHANGES, allreduce_bytes=1_250_000, bytes_received=0, encode_s=0.2)
    warned = [w.observe(lambda: busy, "q") for _ in range(2 * report.CHECK_EVERY)]
    assert warned.count(True) == 1 and warned.index(True) == report.CHECK_EVERY - 1   # at the next check, once


def test_a_compressor_called_every_period_steps_is_not_warned_about_before_its_first_call(caplog):
    """PQASGD calls its compressor at syncs only: with period p the warning waits p - 1 more steps."""
    with caplog.at_level(logging.WARNING, logger="hvd_qsgd"):
        periodic = report.NeverCalledWatch()
        periodic.expect_calls_every(4)
        assert not any(periodic.step(0, "periodic") for _ in range(3))  # steps 1-3: local steps
        assert not periodic.step(4, "periodic")                         # step 4: the first sync
        idle = report.NeverCalledWatch()
        idle.expect_calls_every(4)
        warned = [idle.step(0, "idle") for _ in range(10)]
        assert warned.index(True) == 4 - 1 + report.NEVER_CALLED_STEPS - 1
    assert [r.getMessage().split(" has")[0] for r in caplog.records] == ["idle"]


def test_pqasgd_tells_its_compressor_how_often_it_is_called():
    import torch
    import hvd_qsgd.torch
    model = torch.nn.Linear(3, 2)
    q = hvd_qsgd.QSGD(2)
    hvd_qsgd.torch.PeriodicQuantizedAveraging(torch.optim.SGD(model.parameters(), lr=0.1),
                                              list(model.named_parameters()), period=6, compression=q,
                                              broadcast=False)
    assert q._never_called.patience == 6 - 1 + report.NEVER_CALLED_STEPS


def test_never_called_warns_after_steps_without_calls_and_not_otherwise(caplog):
    with caplog.at_level(logging.WARNING, logger="hvd_qsgd"):
        used, idle = report.NeverCalledWatch(), report.NeverCalledWatch()
        for _ in range(2 * report.NEVER_CALLED_STEPS):
            assert not used.step(5, "used")
        warned = [idle.step(0, "idle") for _ in range(2 * report.NEVER_CALLED_STEPS)]
        assert warned.count(True) == 1 and warned.index(True) == report.NEVER_CALLED_STEPS - 1
        assert not idle.at_exit(0, "idle")  # once
        assert report.NeverCalledWatch().at_exit(0, "late")
        assert not report.NeverCalledWatch().at_exit(3, "called")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("idle has not been called in 3 optimizer steps" in m for m in messages) == 1
    assert sum("late was created in this Horovod job but never called" in m for m in messages) == 1
    assert not any("used" in m or "called was" in m for m in messages)


def test_a_compressor_handed_only_small_tensors_warns_that_it_compresses_none(caplog):
    """A model whose every tensor is below min_numel goes uncompressed: said once, after
    NEVER_CALLED_STEPS optimizer steps (a global hook counts them), naming min_numel; not where one
    tensor was compressed, nor where the count is not known (PQASGD's calls)."""
    import torch
    import hvd_qsgd
    model = torch.nn.Linear(50, 10)   # 500 + 10 elements, below the default min_numel
    small, opt = hvd_qsgd.QSGD(4), torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="hvd_qsgd"):
        for _ in range(2 * report.NEVER_CALLED_STEPS):
            for p in model.parameters():
                assert small.compress(torch.ones_like(p))[1] is None   # (passed through as it is)
            opt.step()
        assert not report.NeverCalledWatch().step(4, "unknown")
        assert not any(report.NeverCalledWatch().step(4, "some", compressed=1) for _ in range(5))
    messages = [m for m in map(logging.LogRecord.getMessage, caplog.records) if m.startswith(f"{small!r} was handed")]
    assert len(messages) == 1, messages
    assert f"was handed {2 * report.NEVER_CALLED_STEPS} tensors in {report.NEVER_CALLED_STEPS} optimizer steps and " \
           "compressed none of them" in messages[0] and "min_numel" in messages[0], messages


def test_the_compressor_that_makes_many_in_a_multi_rank_process_warns_once(caplog, monkeypatch):
    """The MANY_COMPRESSORS-th compressor used in a process of a multi-rank job warns, once, saying to
    make a compressor once; not in a one-rank process or before Horovod is initialised. Each
    framework adapter, made where the front compressor is first used or by the user, counts."""
    def not_initialised():
        raise ValueError("Horovod has not been initialized; use hvd.init().")

    monkeypatch.setattr(report, "_used", report.MANY_COMPRESSORS - 2)
    with caplog.at_level(logging.WARNING, logger="hvd_qsgd"):
        assert [report.note_used(lambda: 2) for _ in range(3)] == [False, True, False]
        for size in (lambda: 1, not_initialised):
            monkeypatch.setattr(report, "_used", report.MANY_COMPRESSORS - 1)
            assert not report.note_used(size)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and f"{report.MANY_COMPRESSORS} compressors have been used" in messages[0] \
        and "Make each compressor once and keep it" in messages[0], messages
    import torch
    import tensorflow as tf
    import hvd_qsgd.tensorflow
    import hvd_qsgd.torch
    counted = []
    monkeypatch.setattr(report, "note_used", counted.append)
    front = hvd_qsgd.QSGD(4)
    assert counted == []
    front.compress(torch.ones(4))
    front.compress(torch.ones(4))
    hvd_qsgd.torch.QSGD(4)
    hvd_qsgd.tensorflow.QSGD(4).compress(tf.ones(4))
    assert len(counted) == 3, counted


AT_EXIT = r'''
import sys
import horovod.torch as hvd
import hvd_qsgd
hvd.init()
compression = hvd_qsgd.QSGD(4)
if sys.argv[1] == "fails":
    raise RuntimeError("the job's own error, before any exchange")
'''


@pytest.mark.parametrize("ending", ["returns", "fails"])
def test_the_at_exit_warning_is_for_a_process_that_ends_well(ending):
    """A compressor never called warns as its Horovod process exits, but not when the process ends
    on an unhandled error: the job failed before its first exchange, and the warning would point at
    the wrong cause."""
    import sys
    from tests.helpers import run_bounded
    code, out = run_bounded([sys.executable, "-c", AT_EXIT, ending], timeout=120)
    assert code == (0 if ending == "returns" else 1), out[-2000:]
    warned = "was created in this Horovod job but never called" in out
    assert warned == (ending == "returns"), out[-2000:]
    assert ("the job's own error" in out) == (ending == "fails"), out[-2000:]
