"""The codec backends: one interface, the device chosen once per exchange, and every trip of a CUDA
tensor through the host counted and logged (never silent)."""
import inspect
import logging

import numpy as np
import pytest

from hvd_qsgd import backends, codec, cuda, reduction
from hvd_qsgd.settings import Settings, Stats

METHODS = ("encode", "decode", "split", "read_headers", "decode_sum", "encode_chunks", "split_by", "reduce_chunk",
           "reduce_received", "decode_chunks")


def test_both_backends_have_the_same_methods_and_signatures():
    for name in METHODS:
        cpu, gpu = getattr(backends.CpuBackend, name), getattr(backends.CudaBackend, name)
        names = [(q.name, q.kind, q.default) for q in inspect.signature(cpu).parameters.values()]
        assert names == [(q.name, q.kind, q.default) for q in inspect.signature(gpu).parameters.values()], name


def test_cpu_tensors_use_the_cpu_backend_with_no_fallback():
    for coding in ("fixed", "elias"):
        for red in ("allgather", "scatter_allgather"):
            s = Settings.make(bits=4, coding=coding, reduction=red)
            assert backends.choose("cpu", s, red) == (backends.CPU, None)


@pytest.mark.parametrize("coding, red, server_ef, reason", [
    ("elias", "scatter_allgather", False, "the elias coding's chunk steps have no CUDA kernel"),
])
def test_a_cuda_tensor_without_a_kernel_for_a_step_goes_through_the_host_with_the_reason(coding, red, server_ef,
                                                                                          reason, monkeypatch):
    monkeypatch.setattr(cuda, "available", lambda: True)
    s = Settings.make(bits=4, coding=coding, reduction=red, server_error_feedback=server_ef)
    backend, why = backends.choose("cuda", s, red)
    assert backend is backends.CPU and why == reason


@pytest.mark.parametrize("coding, red, server_ef", [("fixed", "allgather", False),
                                                    ("elias", "allgather", False),
                                                    ("elias", "hierarchical", False),
                                                    ("fixed", "scatter_allgather", False),
                                                    ("fixed", "scatter_allgather", True)])
def test_a_cuda_tensor_stays_on_the_device_when_every_step_has_a_kernel(coding, red, server_ef, monkeypatch):
    monkeypatch.setattr(cuda, "available", lambda: True)
    s = Settings.make(bits=4, coding=coding, reduction=red, server_error_feedback=server_ef)
    assert backends.choose("cuda", s, red) == (backends.CUDA, None)


def test_without_the_cuda_library_the_reason_says_which_is_missing(monkeypatch):
    monkeypatch.setattr(cuda, "available", lambda: False)
    for built, says in ((True, "no CUDA device is visible"), (False, "the CUDA library was not built")):
        monkeypatch.setattr(cuda, "built", lambda b=built: b)
        backend, why = backends.choose("cuda", Settings.make(bits=4), "allgather")
        assert backend is backends.CPU and says in why


def test_fallbacks_are_counted_every_time_and_logged_once_per_reason(caplog, monkeypatch):
    monkeypatch.setattr(backends, "_logged", set())
    stats = Stats()
    with caplog.at_level(logging.WARNING, logger="hvd_qsgd"):
        for _ in range(3):
            backends.note_fallback("reason A", stats)
        backends.note_fallback("reason B", stats)
    assert stats.as_dict()["host_fallbacks"] == 4
    logged = [r.getMessage() for r in caplog.records if r.name == "hvd_qsgd"]
    assert len(logged) == 2 and "reason A" in logged[0] and "reason B" in logged[1]
    assert all("host_fallbacks" in m for m in logged)


def test_the_cpu_backend_gives_the_codec_bytes():
    x = np.random.default_rng(0).standard_normal(3000).astype(np.float32)
    s = Settings.make(bits=3, bucket_size=256, norm="l2", coding="elias")
    p = backends.CPU.encode(x, s, 42, 7, "float16", "x")
    assert np.array_equal(p, codec.encode(x, 3, 256, "l2", 42, "elias", 7, True, source_dtype="float16"))
    buf, lens = backends.CPU.encode_chunks(x, s, 42, 3, 7, "float32", "x")
    ref_buf, ref_lens = reduction.encode_chunks(x, s, 42, 3, 7, "float32")
    assert np.array_equal(buf, ref_buf) and lens == ref_lens
    payloads = backends.CPU.split(np.concatenate([p, p]), 2, p.size, "x")
    assert [h.numel for h in backends.CPU.read_headers(payloads, "x")] == [3000, 3000]
    assert np.array_equal(backends.CPU.decode_sum(payloads, 0.5, "x"), codec.decode_sum([p, p], 0.5))
