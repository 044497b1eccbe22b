"""hvd_qsgd.QSGD's settings, defaults and statistics, without a Horovod job."""
import numpy as np
import pytest

import hvd_qsgd
from hvd_qsgd.settings import Settings, Stats


def test_defaults_follow_the_paper():
    assert hvd_qsgd.QSGD(4).settings.bucket_size == 512
    assert hvd_qsgd.QSGD(8).settings.bucket_size == 512
    assert hvd_qsgd.QSGD(2).settings.bucket_size == 128
    s = hvd_qsgd.QSGD().settings
    assert (s.bits, s.norm, s.coding, s.min_numel, s.checksum, s.error_feedback) == (4, "max", "fixed", 10000,
                                                                                      True, False)


@pytest.mark.parametrize("kwargs,name", [
    (dict(bits=0), "bits"), (dict(bits=9), "bits"), (dict(bits=4.0), "bits"), (dict(bits=True), "bits"),
    (dict(bucket_size=0), "bucket_size"), (dict(bucket_size=-5), "bucket_size"),
    (dict(seed=-1), "seed"), (dict(norm="l1"), "norm"), (dict(coding="huffman"), "coding"),
    (dict(min_numel=0), "min_numel"), (dict(min_numel=1.5), "min_numel"),
    (dict(reduction="ring"), "reduction"), (dict(bits=1, coding="elias"), "elias"),
])
def test_invalid_settings_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        hvd_qsgd.QSGD(**kwargs)


def test_settings_tag_covers_what_ranks_must_share_and_only_that():
    base = Settings.make(4)
    for changed in (dict(bits=8), dict(bucket_size=256), dict(norm="l2"), dict(coding="elias"),
                    dict(min_numel=5000)):
        assert Settings.make(**{"bits": 4, **changed}).tag() != base.tag(), changed
    for local in (dict(seed=3), dict(error_feedback=True), dict(checksum=False)):
        assert Settings.make(4, **local).tag() == base.tag(), local


def test_stats_have_the_same_keys_before_and_after_use():
    c = hvd_qsgd.QSGD(4)
    st = c.stats
    assert {"elements", "bytes_sent", "bytes_received", "ratio"} <= set(st)
    assert st["ratio"] == 0.0 and st["bytes_sent"] == 0
    s = Stats()
    s.add(elements=1000, bytes_sent=600, bytes_received=1200, tensors=1)
    d = s.as_dict()
    assert d["ratio"] == pytest.approx(4000 / 600)
    merged = Stats.merge([d, d])
    assert merged["elements"] == 2000 and merged["ratio"] == pytest.approx(4000 / 600)


def test_only_framework_tensors_are_accepted():
    with pytest.raises(TypeError, match="numpy"):
        hvd_qsgd.QSGD(4).compress(np.zeros(20000, dtype=np.float32))


def test_compressors_are_hashable_and_numbered_in_creation_order():
    a, b = hvd_qsgd.QSGD(4), hvd_qsgd.QSGD(4)
    assert b._creation_index == a._creation_index + 1
    assert len({a, b}) == 2
    assert "bits=4" in repr(a)
