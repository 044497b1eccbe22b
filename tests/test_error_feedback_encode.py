"""The worker's error-feedback step on the CPU in one native call (``error_feedback.encode``, kernel
``qsgd_encode_ef_cpu``) against the same steps composed: v = x + e (x when e is not valid), q =
encode(v), e = v - decode(q) where that is finite (else e keeps its value, 0 when not valid).

The payload bytes and the residual's bits must be equal for every instruction-set variant this CPU
runs, on one thread and on two (the fixed coding's chunks run in parallel from 65,536 elements), every
bit width, norm, coding and encoder, buckets that are and are not multiples of 8, buckets too long
for the fused chunk (the composed native path), and inputs whose buckets decode non-finite (NaN, Inf)
or whose v overflows (x + e beyond float32). And scatter_allgather's phase 1 with error feedback
(``reduction.encode_chunks(..., residual)``, kernel ``qsgd_encode_chunks_ef_cpu``) against its steps.
"""
import numpy as np
import pytest

from hvd_qsgd import _native, backends, codec, codec_segments, error_feedback, reduction
from hvd_qsgd.settings import Settings
from tests.references import error_feedback_steps

# (elements, bucket): one element; buckets of 3 (chunks of 8 buckets' multiples), 8, 100, 512, 4072;
# 2^17 (one bucket a chunk), 100,001 (8 of them a chunk, 800,008 elements: still fused) and 2^21
# (longer than a fused chunk: the composed path)
SHAPES = [(1, 512), (7, 3), (100, 8), (5003, 100), (70001, 512), (140000, 3), (200003, 4072),
          (3 * 65536 + 5, 1 << 17), (300000, 100001), (50, 1 << 21)]
# (norm, coding, encoder, checksum)
KINDS = [("max", "fixed", 2, True), ("l2", "fixed", 1, False), ("max", "elias", 2, True), ("sign", "fixed", 2, True)]


def inputs(n, rng):
    x = rng.standard_normal(n).astype(np.float32)
    e = (0.1 * rng.standard_normal(n)).astype(np.float32)
    if n > 40:
        x[17], x[n // 2] = np.nan, np.inf   # their buckets decode non-finite: e keeps its value there
        x[n - 3] = e[n - 3] = 3e38          # x + e overflows to Inf
    return x, e


@pytest.fixture
def restore_cpu():
    isa, threads = codec.cpu_isa(), _native.load().qsgd_get_num_threads()
    yield
    codec.set_cpu_isa(isa)
    _native.load().qsgd_set_num_threads(threads)


@pytest.mark.parametrize("isa", [name for name, runs in codec.cpu_isas().items() if runs])
def test_the_fused_step_equals_the_steps_composed(isa, restore_cpu):
    codec.set_cpu_isa(isa)
    rng = np.random.default_rng(3)
    checked = 0
    for threads in (1, 2):
        _native.load().qsgd_set_num_threads(threads)
        for n, bucket in SHAPES:
            x, e0 = inputs(n, rng)
            for bits in range(1, 9):
                for norm, coding, encoder, checksum in KINDS:
                    if (norm == "sign" and bits != 1) or (coding == "elias" and (bits < 2 or n > 100000)):
                        continue
                    seed = 31 * bits + n
                    kw = dict(bits=bits, bucket_size=bucket, norm=norm, seed=seed, coding=coding, fingerprint=5,
                              checksum=checksum, encoder=encoder)
                    prepared = codec.prepare(n, bits, bucket, norm, coding, 5, checksum, "float32", encoder)
                    for valid in (True, False):
                        with np.errstate(over="ignore", invalid="ignore"):
                            want_q, want_e = error_feedback_steps(x, e0, valid, **kw)
                        e = e0.copy()
                        q = error_feedback.encode(prepared, x, seed, e, valid, "g")
                        where = f"{isa}, {threads} threads, n={n}, {kw}, valid={valid}"
                        np.testing.assert_array_equal(q, want_q, err_msg=where)
                        np.testing.assert_array_equal(e.view(np.uint32), want_e.view(np.uint32), err_msg=where)
                        checked += 1
    assert checked == 2 * 2 * (len(SHAPES) * (8 + 8 + 1) + 7 * sum(n <= 100000 for n, _ in SHAPES))


def test_the_residual_bounds_what_the_payload_dropped():
    """Each element of the new residual is v - decode(q): within one level spacing of its bucket
    (scale / s, QSGD's bound), and not finite nowhere."""
    rng = np.random.default_rng(4)
    x, e = rng.standard_normal(10000).astype(np.float32), np.zeros(10000, np.float32)
    error_feedback.encode(codec.prepare(10000, 4, 100), x, 9, e)   # the max norm: scale = max |x| of the bucket
    step = np.repeat(np.abs(x).reshape(-1, 100).max(axis=1), 100) / codec.levels(4)
    assert np.all(np.isfinite(e)) and np.all(np.abs(e) <= step * (1 + 1e-6))
    assert np.abs(e).max() > 0.5 * step.min()   # something was dropped


def test_bad_residuals_are_named_and_leave_everything_as_it_was():
    x = np.ones(1000, np.float32)
    prepared = codec.prepare(1000, 4, 512)
    for bad, what in ((np.zeros(999, np.float32), "999"), (np.zeros(1000, np.float64), "float64"),
                      (np.zeros(2000, np.float32)[::2], "(1000,)")):
        with pytest.raises(ValueError, match=f"grad.w: the error-feedback residual must be .*{what}"):
            error_feedback.encode(prepared, x, 1, bad, True, "grad.w")
    frozen = np.zeros(1000, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="grad.w: the error-feedback residual must be a writeable"):
        error_feedback.encode(prepared, x, 1, frozen, True, "grad.w")
    with pytest.raises(ValueError, match="grad.w: the error-feedback residual shares memory"):
        error_feedback.encode(prepared, x, 1, x, True, "grad.w")
    with pytest.raises(ValueError, match="grad.w: encode was prepared for 1000 elements, got 10"):
        error_feedback.encode(prepared, x[:10], 1, np.zeros(10, np.float32), True, "grad.w")


def test_the_cpu_backend_takes_the_fused_step():
    """``CpuBackend.encode`` with a residual is the fused call: the same payload and residual."""
    s = Settings.make(bits=3, bucket_size=256)
    x, e0 = inputs(5000, np.random.default_rng(5))
    for valid in (True, False):
        e_backend, e_fused = e0.copy(), e0.copy()
        q = backends.CPU.encode(x, s, 11, 7, "float32", "g", residual=e_backend, residual_valid=valid)
        want = error_feedback.encode(codec.prepare(5000, 3, 256, fingerprint=7, encoder=s.encoder), x, 11, e_fused,
                                     valid)
        np.testing.assert_array_equal(q, want)
        np.testing.assert_array_equal(e_backend.view(np.uint32), e_fused.view(np.uint32))


@pytest.mark.parametrize("coding", ["fixed", "elias"])
def test_the_chunk_payloads_with_error_feedback_equal_the_steps_composed(coding):
    """scatter_allgather's phase 1 with error feedback (``reduction.encode_chunks(..., residual)``, one
    native call) against v = x + e, the n chunk payloads of v, and e = v - their decode where finite."""
    rng = np.random.default_rng(6)
    for n_el, bucket, n in ((5003, 100, 3), (70001, 512, 4), (1000, 512, 4), (130000, 3, 2)):
        x, e0 = inputs(n_el, rng)
        for bits in (2, 4, 8) if coding == "elias" else (1, 3, 8):
            s = Settings.make(bits=bits, bucket_size=bucket, coding=coding)
            for valid in (True, False):
                with np.errstate(over="ignore", invalid="ignore"):
                    v = x + e0 if valid else x.copy()
                    want_buf, want_lens = reduction.encode_chunks(v, s, 77, n, 5)
                    own = reduction.decode_chunks(reduction.split_by(want_buf, want_lens), 1.0, n_el, bucket)
                    want_e = e0.copy()
                    error_feedback.keep_where_finite(want_e, v - own, valid)
                e = e0.copy()
                buf, lens = backends.CPU.encode_chunks(x, s, 77, n, 5, "float32", "g", residual=e, residual_valid=valid)
                where = f"n={n_el}, bucket={bucket}, {n} chunks, bits={bits}, valid={valid}"
                assert lens == want_lens, where
                np.testing.assert_array_equal(buf, want_buf, err_msg=where)
                np.testing.assert_array_equal(e.view(np.uint32), want_e.view(np.uint32), err_msg=where)
    with pytest.raises(ValueError, match="g: the error-feedback residual must be"):
        reduction.encode_chunks(x, s, 77, 2, 5, "float32", "g", np.zeros(3, np.float32))


def members_of(n, bucket, rng, gaps=True):
    """A fusion buffer's layout over n elements: parts at multiples of ``bucket`` (with gaps after
    some, an empty one), each with its residual, and the tensor and residual assembled."""
    parts, offsets, at = [], [], 0
    sizes = [n // 8 + 7, 1, 0, bucket * 2, n // 4 + bucket // 2, bucket, n // 3]
    for k, size in enumerate(sizes):
        if at + size > n:
            break
        offsets.append(at)
        parts.append(size)
        at = -(-(at + size) // bucket) * bucket if gaps or size % bucket else at + size
    x, e = inputs(at, rng)   # (its NaN and Inf at 17 and at // 2: inside members)
    x[20] = e[20] = 3e38     # x + e overflows to Inf, inside the first member
    xs = [x[o:o + size].copy() for o, size in zip(offsets, parts)]
    es = [e[o:o + size].copy() for o, size in zip(offsets, parts)]
    whole_x, whole_e = np.zeros(at, np.float32), np.zeros(at, np.float32)
    for o, p, r in zip(offsets, xs, es):
        whole_x[o:o + p.size], whole_e[o:o + p.size] = p, r
    return codec_segments.Members(xs, offsets, at), es, whole_x, whole_e


@pytest.mark.parametrize("isa", [name for name, runs in codec.cpu_isas().items() if runs])
def test_a_fusion_buffers_members_with_error_feedback_equal_the_buffer_assembled(isa, restore_cpu):
    """``error_feedback.encode_members`` (kernel ``qsgd_encode_segments_ef_cpu``: the members and their
    residuals read and updated where they are) gives the payload of ``error_feedback.encode`` of the
    tensor and residual assembled (zeros between the members), and each member's residual is that
    call's over its member, bit for bit: every bit width, both encoders, buckets that are and are not
    multiples of 8, one and two threads (parallel chunks from 65,536 elements), valid and not, inputs
    that decode non-finite or overflow."""
    codec.set_cpu_isa(isa)
    rng = np.random.default_rng(8)
    checked = 0
    for threads in (1, 2):
        _native.load().qsgd_set_num_threads(threads)
        for bucket in (3, 100, 512, 4096):
            members, es, x, e0 = members_of(1 << 20, bucket, rng)
            for bits in (1, 2, 4, 5, 8):
                for encoder in (1, 2):
                    prepared = codec.prepare(members.numel, bits, bucket, fingerprint=9, encoder=encoder)
                    for valid in (True, False):
                        want_e = e0.copy()
                        with np.errstate(over="ignore", invalid="ignore"):
                            want_q = error_feedback.encode(prepared, x, 21 + bits, want_e, valid)
                        got_es = [r.copy() for r in es]
                        q = error_feedback.encode_members(prepared, members, got_es, 21 + bits, valid, "buffer")
                        where = f"{isa}, {threads} threads, bucket {bucket}, {bits} bits, encoder {encoder}, {valid}"
                        np.testing.assert_array_equal(q, want_q, err_msg=where)
                        for o, r in zip(members.offsets, got_es):
                            np.testing.assert_array_equal(r.view(np.uint32), want_e[o:o + r.size].view(np.uint32),
                                                          err_msg=where)
                        checked += 1
    assert checked == 2 * 4 * 5 * 2 * 2


def test_a_fusion_buffers_chunk_payloads_with_error_feedback_equal_the_buffer_assembled():
    """scatter_allgather's phase 1 of a fusion buffer's members with their residuals
    (``reduction.encode_chunks(members, ..., residual=[each member's])``) against the same of the
    buffer and its residual assembled: the chunk payloads, their lengths and every member's residual."""
    rng = np.random.default_rng(9)
    for bucket, n in ((100, 3), (512, 4), (3, 2)):
        members, es, x, e0 = members_of(300000, bucket, rng)
        for bits in (1, 4, 8):
            s = Settings.make(bits=bits, bucket_size=bucket)
            for valid in (True, False):
                want_e = e0.copy()
                with np.errstate(over="ignore", invalid="ignore"):
                    want_buf, want_lens = reduction.encode_chunks(x, s, 77, n, 5, "float32", "b", want_e, valid)
                got_es = [r.copy() for r in es]
                buf, lens = backends.CPU.encode_chunks(members, s, 77, n, 5, "float32", "b", residual=got_es,
                                                       residual_valid=valid)
                where = f"bucket {bucket}, {n} chunks, {bits} bits, valid={valid}"
                assert lens == want_lens, where
                np.testing.assert_array_equal(buf, want_buf, err_msg=where)
                for o, r in zip(members.offsets, got_es):
                    np.testing.assert_array_equal(r.view(np.uint32), want_e[o:o + r.size].view(np.uint32),
                                                  err_msg=where)


def test_a_fusion_buffers_bad_residuals_are_named():
    members, es, _, _ = members_of(10000, 100, np.random.default_rng(10))
    prepared = codec.prepare(members.numel, 4, 100)
    with pytest.raises(ValueError, match=f"buffer b0: {len(es) - 1} error-feedback residuals for {len(es)} parts"):
        error_feedback.encode_members(prepared, members, es[:-1], 1, True, "buffer b0")
    short = list(es)
    short[0] = short[0][:-1]
    with pytest.raises(ValueError, match="buffer b0: the error-feedback residual must be .* float32 array of "
                                         f"{es[0].size} elements"):
        error_feedback.encode_members(prepared, members, short, 1, True, "buffer b0")
    shared = list(es)
    shared[0] = members.parts[0]
    with pytest.raises(ValueError, match="buffer b0: the error-feedback residual shares memory"):
        error_feedback.encode_members(prepared, members, shared, 1, True, "buffer b0")
