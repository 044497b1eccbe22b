"""The codec backends: one interface, the device chosen once per exchange, and every trip of a CUDA
tensor through the host counted and logged (never silent)."""
import inspect
import logging

import numpy as np
import pytest

from hvd_qsgd import backends, codec, cuda, reduction
from hvd_qsgd.settings import Settings, Stats

METHODS = ("encode", "decode", "split", "read_headers", "decode_sum", "encode_chunks", "split_by", "reduce_chunk",
           "reduce_received", "decode_chunks", "encodes_members")


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


@pytest.mark.parametrize("encoder", [None, 1, 2])
def test_the_cpu_backend_encodes_with_the_encoder_of_the_settings(encoder):
    """Settings(encoder=...) reaches every encode of the CPU backend (encode, encode_chunks and the
    reduce step, with and without error feedback): each payload's header records it (2 by default),
    and the bytes are the codec's with that encoder."""
    want = 2 if encoder is None else encoder
    s = Settings.make(bits=4, bucket_size=128, **({} if encoder is None else {"encoder": encoder}))
    assert s.encoder == want
    x = np.random.default_rng(1).standard_normal(3000).astype(np.float32)
    p = backends.CPU.encode(x, s, 42, 7, "float32", "x")
    assert codec.read_header(p).encoder == want
    assert np.array_equal(p, codec.encode(x, 4, 128, "max", 42, "fixed", 7, True, encoder=want))
    residual = np.zeros_like(x)
    p_ef = backends.CPU.encode(x, s, 42, 7, "float32", "x", residual=residual)
    assert codec.read_header(p_ef).encoder == want and np.array_equal(p_ef, p)
    assert np.array_equal(residual, x - codec.decode(p))   # the error-feedback path decodes it too
    for res in (None, np.zeros(3000, np.float32)):
        buf, lens = backends.CPU.encode_chunks(x, s, 42, 3, 7, "float32", "x", residual=res)
        chunks = backends.CPU.split_by(buf, lens)
        assert [codec.read_header(c).encoder for c in chunks] == [want] * 3
        for j in range(3):
            q = backends.CPU.reduce_chunk([chunks[j]] * 2, j, s, 9, 7, "float32", "x",
                                          residual=None if res is None else np.zeros(codec.read_header(
                                              chunks[j]).numel, np.float32))
            assert codec.read_header(q).encoder == want


def test_the_two_encoders_give_different_payloads_of_one_layout():
    """What the setting changes: the encoder version, in the header, and the quantized bytes; not the
    payload's length. The codec decodes both within QSGD's bound."""
    x = np.random.default_rng(2).standard_normal(5000).astype(np.float32)
    one, two = (backends.CPU.encode(x, Settings.make(bits=4, encoder=e), 42, 7, "float32", "x") for e in (1, 2))
    assert one.size == two.size == codec.payload_nbytes(5000, 4, 512)
    assert (codec.read_header(one).encoder, codec.read_header(two).encoder) == (1, 2)
    assert not np.array_equal(one[codec.HEADER_BYTES:], two[codec.HEADER_BYTES:])
    for p in (one, two):   # both decode within QSGD's bound: at most scale / s per coordinate
        scale = np.abs(np.pad(x, (0, -x.size % 512))).reshape(-1, 512).max(axis=1)
        assert np.all(np.abs(codec.decode(p) - x) <= np.repeat(scale / codec.levels(4), 512)[:x.size] * (1 + 1e-5))


def _gathered(coding, count, numel=3000, fingerprint=7):
    x = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    payloads = [codec.encode(x * (r + 1), bits=4, bucket_size=128, coding=coding, seed=r, fingerprint=fingerprint)
                for r in range(count)]
    expect = codec.read_header(payloads[0])
    return payloads, np.concatenate(payloads), expect


def _host_path(gathered, count, own_len, alpha, expect):
    return backends.HostCountedBackend.decode_gathered(backends.CPU, gathered, count, own_len, alpha, expect, "t")


@pytest.mark.parametrize("coding", ["fixed", "elias"])
@pytest.mark.parametrize("count", [1, 2, 5])
def test_the_cpu_backends_one_call_decode_of_gathered_payloads_is_the_split_check_and_sum(coding, count):
    payloads, gathered, expect = _gathered(coding, count)
    out, lens = backends.CPU.decode_gathered(gathered, count, payloads[0].size, 0.25, expect, "t")
    ref, ref_lens = _host_path(gathered, count, payloads[0].size, 0.25, expect)
    assert out.tobytes() == ref.tobytes()
    assert lens == ref_lens == [p.size for p in payloads] and all(type(v) is int for v in lens)


def _renamed(payload, **fields):
    """``payload`` re-encoded from its own values with other header fields (a rank with other settings)."""
    return codec.encode(codec.decode(payload), **dict(dict(bits=4, bucket_size=128, seed=9, fingerprint=7), **fields))


@pytest.mark.parametrize("case, says", [
    ("bits", "disagree on bits"),
    ("fingerprint", "disagree on fingerprint (rank 0: 7, rank 1: 7, rank 2: 8); the ranks' tensors have the same "
                    "number of elements and dtype but not the same shape"),
    ("truncated", "payload"),
    ("extra byte", "expected 3 payloads filling"),
    ("corrupted", "checksum"),
])
def test_gathered_payloads_that_fail_a_check_are_named_as_by_the_host_path(case, says):
    payloads, _, expect = _gathered("fixed", 3)
    if case == "bits":
        payloads[1] = _renamed(payloads[1], bits=2)
    elif case == "fingerprint":
        payloads[2] = _renamed(payloads[2], fingerprint=8)
    gathered = np.concatenate(payloads)
    if case == "truncated":
        gathered = gathered[:-5]
    elif case == "extra byte":
        gathered = np.append(gathered, np.uint8(0))
    elif case == "corrupted":
        gathered[payloads[0].size + codec.HEADER_BYTES + 40] ^= 0xFF
    with pytest.raises(codec.PayloadError):   # the native call finds it
        codec.decode_gathered(gathered, 3, expect)
    with pytest.raises(Exception) as native:
        backends.CPU.decode_gathered(gathered, 3, payloads[0].size, 1.0, expect, "t")
    with pytest.raises(Exception) as host:
        _host_path(gathered, 3, payloads[0].size, 1.0, expect)
    assert type(native.value) is type(host.value) and str(native.value) == str(host.value)
    assert says in str(native.value)


@pytest.mark.parametrize("case", ["ok", "bits", "cut elsewhere", "one missing", "corrupted"])
def test_the_cpu_backends_decode_report_is_the_host_paths_in_result_and_error(case):
    """A hierarchical shard's decode (the cross peers' payloads, cut at the alltoall's splits, zeros
    where no peer sent): one native call where it passes, the host path's result or error where not."""
    payloads, _, expect = _gathered("elias", 3)
    if case == "bits":
        payloads[2] = _renamed(payloads[2], bits=2, coding="elias")
    gathered = np.concatenate(payloads)
    lens = [payloads[0].size, 0, payloads[1].size, payloads[2].size]
    if case == "cut elsewhere":
        lens[2], lens[3] = lens[2] - 1, lens[3] + 1
    elif case == "one missing":
        gathered, lens = gathered[:-payloads[2].size], lens[:3] + [0]
    elif case == "corrupted":
        gathered[codec.HEADER_BYTES + 40] ^= 0xFF
    out, error = backends.CPU.decode_report(gathered, lens, 3, expect, "t")
    ref, ref_error = backends.HostCountedBackend.decode_report(backends.CPU, gathered, lens, 3, expect, "t")
    assert out.tobytes() == ref.tobytes()
    assert type(error) is type(ref_error) and str(error) == str(ref_error)
    assert (error is None) == (case == "ok") and (case != "ok" or out.size == expect.numel)
