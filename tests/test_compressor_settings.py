"""hvd_qsgd.QSGD's settings, defaults and statistics, without a Horovod job."""
import inspect

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
    (dict(link_gbps=0), "link_gbps"), (dict(link_gbps=-1.0), "link_gbps"), (dict(link_gbps=float("inf")), "link_gbps"),
    (dict(link_gbps="10"), "link_gbps"), (dict(link_gbps=True), "link_gbps"), (dict(fusion=1), "fusion"),
    (dict(overlap="yes"), "overlap"), (dict(join=0), "join"), (dict(encoder=0), "encoder"), (dict(encoder=3), "encoder"),
    (dict(encoder="2"), "encoder"), (dict(encoder=True), "encoder"), (dict(encoder=2.0), "encoder"),
    (dict(fusion_mb=-1), "fusion_mb"), (dict(fusion_mb=True), "fusion_mb"), (dict(fusion_mb="64"), "fusion_mb"),
    (dict(fusion_mb=float("nan")), "fusion_mb"), (dict(fusion_mb=0.01), "fusion_mb=0.01 holds 2621 .* min_numel=10000"),
    (dict(fusion_mb=64, fusion=True), "fusion_mb and fusion=True"),
    (dict(fusion_mb=64, server_error_feedback=True), "fusion_mb and server_error_feedback"),
    (dict(server_error_feedback=True, reduction="allgather"), "server_error_feedback=True needs reduction="),
    (dict(server_error_feedback=True, reduction="hierarchical"), "server_error_feedback=True needs reduction="),
])
def test_invalid_settings_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        hvd_qsgd.QSGD(**kwargs)


def test_the_default_reduction_is_auto_and_resolves_by_the_cost_model():
    """"auto" by default: allgather on 2 ranks and for small tensors; from 3 ranks on, a tensor whose
    payload P exceeds alpha beta n / (n - 2) (62.5 kB n / (n - 2) at 50 us and 10 Gbit/s) goes by
    scatter_allgather, whose bytes per rank stay 2 (n-1)/n P."""
    s = hvd_qsgd.QSGD(4).settings
    assert s.reduction == "auto" and s.link_gbps is None
    assert s.exchange_reduction(2, 10**7) == "allgather"
    for n in (8, 16):
        assert s.exchange_reduction(n, 10**6) == "scatter_allgather"
        assert s.exchange_reduction(n, 20000) == "allgather"
    # 150,000 elements at 4 bits: P ~ 76 kB, above the 71 kB threshold at 16 ranks; at 1000 Gbit/s
    # the threshold is 100x higher, so the latency of scatter_allgather's extra messages wins
    assert s.exchange_reduction(16, 150000) == "scatter_allgather"
    fast = hvd_qsgd.QSGD(4, link_gbps=1000).settings
    assert fast.link_gbps == 1000.0 and fast.exchange_reduction(16, 150000) == "allgather"
    assert "link_gbps=1000" in repr(hvd_qsgd.QSGD(4, link_gbps=1000))


def test_link_gbps_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("HVD_QSGD_BANDWIDTH_GBITS", "1000")
    assert Settings.make(4).exchange_reduction(16, 150000) == "allgather"
    assert Settings.make(4, link_gbps=10).exchange_reduction(16, 150000) == "scatter_allgather"


def test_settings_tag_covers_what_ranks_must_share_and_only_that():
    base = Settings.make(4)
    for changed in (dict(bits=8), dict(bucket_size=256), dict(norm="l2"), dict(coding="elias"),
                    dict(min_numel=5000), dict(fusion=True), dict(overlap=True), dict(encoder=1), dict(fusion_mb=64),
                    dict(join=False)):
        assert Settings.make(**{"bits": 4, **changed}).tag() != base.tag(), changed
    assert Settings.make(4, fusion_mb=64).tag() != Settings.make(4, fusion_mb=32).tag()
    both = Settings.make(4, fusion_mb=64, overlap=True)   # buffers whose collectives start once full
    assert both.overlap and both.tag() not in (Settings.make(4, fusion_mb=64).tag(), Settings.make(4, overlap=True).tag())
    assert Settings.make(4, fusion_mb=64).fusion_elements() == 16 * 2 ** 20 and base.fusion_elements() == 0
    for local in (dict(seed=3), dict(error_feedback=True), dict(checksum=False)):
        assert Settings.make(4, **local).tag() == base.tag(), local


def test_encoder_is_a_shared_setting_2_by_default_1_with_the_tag_of_earlier_releases():
    """encoder (1 or 2, default 2) is accepted by every compressor that takes the settings, and is in
    the tag: ranks on different encoders fail the control-vector check. With encoder=1 the tag is the
    one earlier releases computed (their string, without an encoder term), as their payloads are."""
    import hvd_qsgd.mpi
    import hvd_qsgd.tensorflow
    import hvd_qsgd.torch
    from hvd_qsgd import protocol
    assert Settings().encoder == Settings.make().encoder == hvd_qsgd.QSGD(4).settings.encoder == 2
    makers = {
        "QSGD": lambda **kw: hvd_qsgd.QSGD(4, **kw).settings,
        "DynamicQSGD": lambda **kw: hvd_qsgd.DynamicQSGD(3.0, **kw).settings,
        "BlockSign": lambda **kw: hvd_qsgd.BlockSign(**kw).settings,
        "torch.QSGD": lambda **kw: hvd_qsgd.torch.QSGD(4, **kw).settings,
        "tensorflow.QSGD": lambda **kw: hvd_qsgd.tensorflow.QSGD(4, **kw).settings,
        "mpi.QSGDReducer": lambda **kw: hvd_qsgd.mpi.QSGDReducer(comm=object(), **kw).settings,
    }
    for name, make in makers.items():
        assert make().encoder == 2, name
        for encoder in (1, 2, np.int64(1)):
            made = make(encoder=encoder)
            assert made.encoder == encoder and type(made.encoder) is int, name
        with pytest.raises(ValueError, match="encoder must be 1 or 2"):
            make(encoder=3)
    assert hvd_qsgd.QSGD(4, 64, "max", "fixed", 1, 0, False, True, "auto", False, None, False, False,
                         1).settings == Settings.make(4, 64, min_numel=1, encoder=1)   # the last, by position
    one, two = Settings.make(4, encoder=1), Settings.make(4)
    assert one.tag() != two.tag() and one.tag("allgather") != two.tag("allgather")
    assert one.tag() == protocol.small_hash("4|512|max|fixed|10000|auto|auto")
    assert one.replace(bits=8).encoder == 1 and one.as_dict()["encoder"] == 1
    dqsgd = hvd_qsgd.DynamicQSGD(3.0, encoder=1)._policy("torch")   # the settings of each step's bits
    assert [dqsgd.settings_of_bits(b).encoder for b in dqsgd.bits_range()] == [1] * len(dqsgd.bits_range())
    assert "encoder=1" in repr(hvd_qsgd.QSGD(4, encoder=1)) and "encoder" not in repr(hvd_qsgd.QSGD(4))


def test_each_compressor_class_shows_the_parameters_it_takes_and_every_setting_that_is_not_the_default():
    """inspect/help show DynamicQSGD's and BlockSign's own parameters (not QSGD's, which they would
    inherit), and every parameter shown is taken; the repr names every setting off its default, so
    two compressors that differ never print alike."""
    dqsgd, block = inspect.signature(hvd_qsgd.DynamicQSGD), inspect.signature(hvd_qsgd.BlockSign)
    assert list(dqsgd.parameters)[0] == "budget_bits_per_coord" and "bits" not in dqsgd.parameters
    assert list(block.parameters)[0] == "block_size" and "bits" not in block.parameters and "norm" not in block.parameters
    for cls, sig in ((hvd_qsgd.DynamicQSGD, dqsgd), (hvd_qsgd.BlockSign, block)):
        cls(**{name: p.default for name, p in sig.parameters.items()})   # every parameter shown is taken
    with pytest.raises(TypeError):
        hvd_qsgd.BlockSign(norm="l2")
    plain = repr(hvd_qsgd.QSGD(4))
    for extra in (dict(seed=3), dict(checksum=False), dict(fusion_mb=64), dict(overlap=True)):
        shown = repr(hvd_qsgd.QSGD(4, **extra))
        assert shown != plain and all(f"{k}=" in shown for k in extra), shown
        assert all(f"{k}=" in repr(hvd_qsgd.DynamicQSGD(3.0, **extra)) for k in extra)
    assert "coding='elias'" in repr(hvd_qsgd.DynamicQSGD(3.0, coding="elias"))
    assert "checksum=False" in repr(hvd_qsgd.BlockSign(checksum=False)) and "norm" not in repr(hvd_qsgd.BlockSign())


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


# ---- two links: nodes of several ranks (hvd_qsgd.cost_model, the module docstring) -----------------
def test_two_links_on_nodes_of_one_rank_are_the_flat_model():
    from hvd_qsgd import codec, cost_model
    for n in (3, 4, 8, 16):
        for numel in (1000, 150000, 10**6):
            payload = codec.payload_nbytes(numel, 4, 512)
            for red in ("allgather", "scatter_allgather"):
                assert cost_model.seconds_in_nodes(red, 1, n, numel, 4, 512) == pytest.approx(
                    cost_model.seconds(red, n, payload)), (n, numel, red)
            assert cost_model.choose_in_nodes(1, n, numel, 4, 512) == cost_model.choose(n, numel, 4, 512)
            assert cost_model.choose_in_nodes(n, 1, numel, 4, 512) == cost_model.choose(n, numel, 4, 512)


def test_node_link_bytes_at_2_nodes_of_8_are_those_of_the_derivation():
    """QSGD(4) on 2 x 8 ranks, P the payload of d = 2^20 elements: the ring allgather's edge out of a
    node carries 15 P; scatter_allgather's alltoall 8 * 8 * P / 16 and its ring allgather 15 P / 16;
    the hierarchical reduction one payload per shard, 8 shards of d/8: P plus 7 more headers."""
    from hvd_qsgd import codec, cost_model
    d = 1 << 20
    payload, shard = codec.payload_nbytes(d, 4, 512), codec.payload_nbytes(d // 8, 4, 512)
    assert cost_model.node_costs("allgather", 8, 2, d, 4, 512) == (15, 15 * payload, 0.0)
    assert cost_model.node_costs("scatter_allgather", 8, 2, d, 4, 512) == (30, pytest.approx((4 + 15 / 16) * payload), 0.0)
    messages, cross, inside = cost_model.node_costs("hierarchical", 8, 2, d, 4, 512)
    assert (messages, cross, inside) == (15, 8 * shard, 2 * 7 / 8 * 4 * d)
    assert payload < cross < 1.001 * payload


def test_auto_weighs_the_hierarchical_reduction_on_nodes_of_several_ranks(monkeypatch):
    from hvd_qsgd import cost_model
    s = hvd_qsgd.QSGD(4).settings
    flat = s.exchange_reduction(16, 10**6)
    assert flat == "scatter_allgather"
    assert s.exchange_reduction(16, 10**6, 8, "cuda") == "hierarchical"          # 2 x 8 GPUs at 10 Gbit/s
    for layout in (None, 0, 1, 16, 5):  # unknown, nodes of one rank, one node, nodes that do not divide 16
        assert s.exchange_reduction(16, 10**6, layout, "cuda") == flat, layout
    # host tensors: 10 Gbit/s inside the node by default, as fast as this node link, where the 7d bytes
    # of float32 node stages cost more than the 2d the node link saves: flat; over a 1 Gbit/s node
    # link the saving pays
    assert cost_model.intra_link(device="cpu") == cost_model.HOST_INTRA_BANDWIDTH_BPS == 10e9 / 8
    assert s.exchange_reduction(16, 10**6, 8, "cpu") == flat == s.exchange_reduction(16, 10**6, 8)
    assert hvd_qsgd.QSGD(4, link_gbps=1).settings.exchange_reduction(16, 10**6, 8, "cpu") == "hierarchical"
    # not where it cannot run, nor where the setting names a reduction
    assert hvd_qsgd.QSGD(4, server_error_feedback=True).settings.exchange_reduction(16, 10**6, 8, "cuda") != \
        "hierarchical"
    assert hvd_qsgd.QSGD(4, reduction="allgather").settings.exchange_reduction(16, 10**6, 8, "cuda") == "allgather"
    # a 400 Gbit/s node link with the default 200 Gbit/s inside: the node's float32 stages cost more
    # than the bytes they save on the node link
    assert hvd_qsgd.QSGD(4, link_gbps=400).settings.exchange_reduction(16, 10**6, 8, "cuda") == "allgather"
    monkeypatch.setenv("HVD_QSGD_INTRA_GBITS", "1")  # a slow link inside the node: flat again
    assert s.exchange_reduction(16, 10**6, 8, "cuda") == flat
    monkeypatch.setenv("HVD_QSGD_INTRA_GBITS", "200")  # and fast: hierarchical for host tensors too
    assert s.exchange_reduction(16, 10**6, 8, "cpu") == "hierarchical"
    monkeypatch.setenv("HVD_QSGD_INTRA_GBITS", "0")
    with pytest.raises(ValueError, match="HVD_QSGD_INTRA_GBITS"):
        s.exchange_reduction(16, 10**6, 8, "cuda")


@pytest.mark.parametrize("variable,value", [("HVD_QSGD_BANDWIDTH_GBITS", "abc"), ("HVD_QSGD_BANDWIDTH_GBITS", "10gbit"),
                                            ("HVD_QSGD_BANDWIDTH_GBITS", "nan"), ("HVD_QSGD_BANDWIDTH_GBITS", "inf"),
                                            ("HVD_QSGD_BANDWIDTH_GBITS", "0"), ("HVD_QSGD_INTRA_GBITS", "fast"),
                                            ("HVD_QSGD_LATENCY_US", "-1"), ("HVD_QSGD_LATENCY_US", "50us")])
def test_a_malformed_link_variable_is_refused_where_the_compressor_is_made(monkeypatch, variable, value):
    """The link variables are read by "auto" and by the slowdown report, the latter first at the 50th
    exchange: a value that is not a finite positive number (latency: >= 0) is refused at construction,
    naming the variable and the value (it failed at step 50 with float()'s bare message)."""
    import hvd_qsgd.tensorflow
    monkeypatch.setenv(variable, value)
    for make in (hvd_qsgd.QSGD, hvd_qsgd.tensorflow.QSGD):
        with pytest.raises(ValueError, match=f"^{variable}={value!r}: expected a finite number of "):
            make(4)
    monkeypatch.setenv(variable, "")   # (empty: the default)
    hvd_qsgd.QSGD(4)
    monkeypatch.setenv("HVD_QSGD_LATENCY_US", "0")
    hvd_qsgd.QSGD(4)


def test_fusion_and_overlap_are_refused_where_they_do_not_run():
    """fusion=True, overlap=True and fusion_mb run in PyTorch; the TensorFlow compressor and the mpi4py
    reducer say so."""
    import hvd_qsgd.mpi
    import hvd_qsgd.tensorflow
    for name, on in (("fusion", True), ("overlap", True), ("fusion_mb", 64.0)):
        with pytest.raises(ValueError, match=f"{name}={on!r} runs in PyTorch"):
            hvd_qsgd.tensorflow.QSGD(4, **{name: on})
        with pytest.raises(ValueError, match=f"{name}={on!r}"):
            hvd_qsgd.mpi.QSGDReducer(comm=object(), **{name: on})
    # join=False (a Horovod compressor's: no hvd.join() in the job) has nothing to act on over mpi4py
    with pytest.raises(ValueError, match="join=False .* nothing to act on"):
        hvd_qsgd.mpi.QSGDReducer(comm=object(), join=False)


def test_join_is_on_by_default_and_off_only_when_asked():
    """join=True by default (hvd.join() works as without compression), so today's tag is unchanged;
    join=False is shown, in the tag (ranks that disagree fail the settings check) and accepted by both
    frameworks' compressors."""
    import hvd_qsgd.tensorflow
    assert hvd_qsgd.QSGD(4).settings.join is True and "join" not in repr(hvd_qsgd.QSGD(4))
    off = hvd_qsgd.QSGD(4, join=False)
    assert off.settings.join is False and "join=False" in repr(off)
    assert hvd_qsgd.tensorflow.QSGD(4, join=False).settings.join is False
    assert Settings.make(4, join=False).tag() != Settings.make(4).tag()


def test_tensorflow_refuses_a_malformed_node_layout_where_the_compressor_is_made(monkeypatch):
    """TensorFlow reads HVD_QSGD_RANKS_PER_NODE where each rank traces its step: malformed on one rank,
    that rank raised alone there and the others waited for it. Refused at construction instead
    (PyTorch reports it through the control vector, on every rank: tests/test_hierarchical.py)."""
    import hvd_qsgd.tensorflow
    monkeypatch.setenv("HVD_QSGD_RANKS_PER_NODE", "two")
    with pytest.raises(ValueError, match="HVD_QSGD_RANKS_PER_NODE must be a positive integer, got 'two'"):
        hvd_qsgd.tensorflow.QSGD(4)
    monkeypatch.setenv("HVD_QSGD_RANKS_PER_NODE", "8")
    hvd_qsgd.tensorflow.QSGD(4)


@pytest.mark.parametrize("args", [(4,), (4, 512, "max"), (np.int64(4),), ("4",)])
def test_the_mpi_reducer_refuses_settings_in_place_of_its_communicator(args):
    """QSGDReducer(4) took 4 for the communicator, and failed at the first allreduce with an
    AttributeError about Split_type; settings given positionally gave Python's bare TypeError."""
    import hvd_qsgd.mpi
    with pytest.raises(TypeError, match=r"QSGDReducer\(comm=None, \*\*settings\): the first argument is the mpi4py "
                                        r"communicator and the settings go by name"):
        hvd_qsgd.mpi.QSGDReducer(*args)
    assert hvd_qsgd.mpi.QSGDReducer(object(), bits=4).settings.bits == 4
