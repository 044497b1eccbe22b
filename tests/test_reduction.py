"""The scatter_allgather algorithm in one process (hvd_qsgd.reduction): the kernels' chunk steps
against a re-statement with the codec's encode/decode_sum, unbiasedness, Elias/fixed agreement,
the traffic the reduction needs per rank, and its errors."""
import math

import numpy as np
import pytest

from hvd_qsgd import _native, codec, cost_model, reduction
from hvd_qsgd.codec import PayloadError
from hvd_qsgd.settings import Settings


def step_seed(base, k):
    return int(_native.load().qsgd_step_seed(base, k))


@pytest.mark.parametrize("numel,bucket,n", [(20000, 512, 3), (100000, 512, 4), (1000, 512, 4), (513, 512, 3),
                                            (0, 512, 2), (7, 1, 16), (10**6, 128, 5)])
def test_chunks_are_whole_buckets_covering_the_tensor_in_order(numel, bucket, n):
    ranges = reduction.chunk_ranges(numel, bucket, n)
    assert len(ranges) == n and ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    nb = math.ceil(numel / bucket)
    sizes = [math.ceil((e - b) / bucket) for b, e in ranges]
    assert all(b % bucket == 0 for b, _ in ranges) and max(sizes) - min(sizes) <= 1 and sum(sizes) == nb
    assert sum(s == 0 for s in sizes) == max(0, n - nb)


@pytest.mark.parametrize("coding", ["fixed", "elias"])
@pytest.mark.parametrize("n,numel", [(3, 20000), (4, 1000)])
def test_the_chunk_steps_are_encode_and_decode_sum_of_the_chunks(coding, n, numel):
    """Re-state both phases with codec.encode / codec.decode_sum and the documented seeds
    (chunk_seed(sigma, j, phase) = qsgd_step_seed(sigma, 2j + phase)): the same bytes, the same result."""
    s = Settings.make(4, coding=coding)
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(numel).astype(np.float32) for _ in range(n)]
    seeds = [1000 + r for r in range(n)]
    out, sent, reduced = reduction.simulate(xs, s, seeds, 1.0 / n, fingerprint=42)
    ranges = reduction.chunk_ranges(numel, 512, n)
    expected = np.empty(numel, np.float32)
    for j, (b, e) in enumerate(ranges):
        assert reduction.chunk_seed(seeds[j], j, 1) == step_seed(seeds[j], 2 * j + 1)
        mine = [codec.encode(xs[r][b:e], 4, 512, "max", step_seed(seeds[r], 2 * j), coding, 42) for r in range(n)]
        for r in range(n):
            assert np.array_equal(sent[r][j], mine[r]), (r, j)
        q = codec.encode(codec.decode_sum(mine, 1.0), 4, 512, "max", step_seed(seeds[j], 2 * j + 1), coding, 42)
        assert np.array_equal(reduced[j], q), j
        expected[b:e] = codec.decode_sum([q], 1.0 / n)
    assert np.array_equal(out, expected)


def test_elias_and_fixed_reduce_to_the_same_values():
    """The Elias coding quantizes to the same levels as the fixed coding with the same seed."""
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal(30000).astype(np.float32) * (r + 1) for r in range(3)]
    fixed = reduction.simulate(xs, Settings.make(4), [1, 2, 3], 1 / 3)[0]
    elias = reduction.simulate(xs, Settings.make(4, coding="elias"), [1, 2, 3], 1 / 3)[0]
    assert np.array_equal(fixed, elias)


def test_unbiased_with_the_variance_the_two_quantizations_allow():
    """E[result] = mean of the inputs. Per element, Var = (1/n^2) (sum_r Var Q(g_r) + Var Q(S)), and a
    stochastic rounding with step delta has variance <= delta^2 / 4, with delta = scale / s; the phase-1
    scale is the bucket's max |g_r|, the phase-2 scale at most sum_r of those (|S| <= sum_r |Q(g_r)|).
    Over T trials the mean's error divided by sqrt(bound / T) must stay under z = 6.5 for all d
    elements (family-wise false alarm < d * 2 Phi(-6.5) < 2e-7)."""
    n, d, T, bits, bucket = 3, 1500, 600, 3, 512
    s = Settings.make(bits, bucket_size=bucket)
    levels = codec.levels(bits)
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(d).astype(np.float32) * (r + 1) for r in range(n)]
    truth = np.mean(np.stack(xs).astype(np.float64), axis=0)
    total = np.zeros(d)
    for t in range(T):
        total += reduction.simulate(xs, s, [10 * t + r for r in range(n)], 1.0 / n)[0]
    scales = [np.repeat([np.abs(x[b:b + bucket]).max() for b in range(0, d, bucket)], bucket)[:d] for x in xs]
    bound = (sum((sc / levels) ** 2 / 4 for sc in scales) + (sum(scales) / levels) ** 2 / 4) / n ** 2
    z = np.abs(total / T - truth) / np.sqrt(bound / T)
    assert z.max() < 6.5, z.max()
    assert np.abs(total / T - truth).max() > 0  # it is random


def test_traffic_per_rank_is_flat_in_n_for_scatter_allgather_and_linear_for_allgather():
    """Bytes a rank receives for a 4-bit tensor of d elements, counted from the payloads both phases
    produce (8-byte frame lengths included): within 1.2x of 2 (n-1)/n * d/2 for n = 2..16."""
    d, s = 1 << 20, Settings.make(4)
    x = np.random.default_rng(8).standard_normal(d).astype(np.float32)
    for n in (2, 3, 4, 8, 16):
        buf, lens = reduction.encode_chunks(x, s, 1, n)
        q = [reduction.reduce_chunk([p] * n, j, s, 2) for j, p in enumerate(reduction.split_by(buf, lens))]
        rank = n - 1
        received = (n - 1) * lens[rank] + sum(8 + q[j].size for j in range(n) if j != rank)
        model = 2 * (n - 1) / n * d / 2
        assert model <= received <= 1.2 * model, (n, received, model)
        assert (n - 1) * codec.payload_nbytes(d, 4, 512) == cost_model.received_bytes(
            "allgather", n, codec.payload_nbytes(d, 4, 512))


def test_an_empty_reduced_chunk_names_the_rank_and_a_corrupt_payload_is_refused():
    s = Settings.make(4)
    xs = [np.ones(5000, np.float32) * (r + 1) for r in range(3)]
    _, sent, reduced = reduction.simulate(xs, s, [1, 2, 3], 1 / 3)
    with pytest.raises(PayloadError, match=r"rank\(s\) \[1\] sent no reduced chunk"):
        reduction.decode_chunks([reduced[0], np.zeros(0, np.uint8), reduced[2]], 1.0, 5000, 512)
    bad = sent[2][0].copy()
    bad[-1] ^= 0xFF
    with pytest.raises(PayloadError, match="payload 2"):
        reduction.reduce_chunk([sent[0][0], sent[1][0], bad], 0, s, 9)
    with pytest.raises(PayloadError, match=r"reduced chunks have .* elements, expected"):
        reduction.decode_chunks([reduced[2], reduced[1], reduced[0]], 1.0, 5000, 512)


def test_auto_chooses_by_the_cost_model():
    assert cost_model.choose(2, 10**7, 4, 512) == "allgather"
    # P > alpha beta n / (n - 2): at n = 4, 50 us and 10 Gbit/s, P > 125 kB
    assert cost_model.choose(4, 200000, 4, 512) == "allgather"       # P ~ 101 kB
    assert cost_model.choose(4, 300000, 4, 512) == "scatter_allgather"  # P ~ 152 kB
    assert cost_model.choose(16, 300000, 4, 512, bandwidth_bps=1e12) == "allgather"
    assert Settings.make(4, reduction="auto").exchange_reduction(4, 300000) == "scatter_allgather"
    with pytest.raises(ValueError, match="reduction must be one of"):
        Settings.make(4, reduction="ring")


# ---- error feedback on the reducing rank (reduce_chunk(..., residual=r)) ---------------------------
def _ef_restated(sent_j, j, s, seed, residual, fingerprint=0):
    """v = sum(decode) + r (fp32, rank order); q = encode(v) with the plain reduce step's seed;
    r' = v - decode(q) where finite, else r."""
    with np.errstate(over="ignore", invalid="ignore"):
        v = (codec.decode_sum(sent_j, 1.0) + residual).astype(np.float32)
        q = codec.encode(v, s.bits, s.bucket_size, s.norm, reduction.chunk_seed(seed, j, 1), s.coding, fingerprint)
        diff = (v - codec.decode(q)).astype(np.float32)
    return q, np.where(np.isfinite(diff), diff, residual).astype(np.float32)


@pytest.mark.parametrize("bits,norm,bucket", [(1, "sign", 512), (1, "sign", 100), (4, "max", 512), (2, "l2", 256)])
def test_reduce_chunk_with_a_residual_is_error_feedback(bits, norm, bucket):
    n, numel = 3, 20011
    s = Settings.make(bits, bucket_size=bucket, norm=norm)
    rng = np.random.default_rng(9)
    r0 = {j: (rng.standard_normal(e - b) * 0.1).astype(np.float32)
          for j, (b, e) in enumerate(reduction.chunk_ranges(numel, bucket, n))}
    res = {j: r.copy() for j, r in r0.items()}
    for step in range(3):  # the residual carries over
        xs = [rng.standard_normal(numel).astype(np.float32) for _ in range(n)]
        sent = [reduction.split_by(*reduction.encode_chunks(x, s, 100 * step + r, n, 7)) for r, x in enumerate(xs)]
        for j in range(n):
            chunk = [sent[r][j] for r in range(n)]
            want_q, want_r = _ef_restated(chunk, j, s, 5 + step, res[j], 7)
            got_q = reduction.reduce_chunk(chunk, j, s, 5 + step, 7, residual=res[j])  # updated in place
            np.testing.assert_array_equal(got_q, want_q)
            np.testing.assert_array_equal(res[j], want_r)
            if step == 0:
                # without the residual: the plain step; with a zero residual: the same payload
                plain = reduction.reduce_chunk(chunk, j, s, 5 + step, 7)
                assert np.array_equal(plain, reduction.reduce_chunk(chunk, j, s, 5 + step, 7,
                                                                    residual=np.zeros_like(res[j])))
    assert not np.array_equal(res[0], r0[0])


def test_error_feedback_residual_is_kept_where_the_sum_is_not_finite():
    s = Settings.make(1, norm="sign", bucket_size=128)
    xs = [np.random.default_rng(r).standard_normal(1000).astype(np.float32) for r in range(2)]
    xs[1][5], xs[0][300] = np.nan, np.inf
    xs[0][640:768] = xs[1][640:768] = 2e38  # finite inputs whose decoded sum overflows to +Inf
    sent = [reduction.split_by(*reduction.encode_chunks(x, s, r, 1)) for r, x in enumerate(xs)]
    r = np.full(1000, 0.25, np.float32)
    chunk = [sent[0][0], sent[1][0]]
    q = reduction.reduce_chunk(chunk, 0, s, 3, residual=r)
    y = codec.decode(q)
    # the non-finite buckets propagate ...
    assert np.all(np.isnan(y[:128])) and np.all(y[256:384] == np.inf) and np.all(y[640:768] == np.inf)
    # ... but do not enter the residual, which keeps its value there
    bad = np.r_[0:128, 256:384, 640:768]
    assert np.all(r[bad] == 0.25) and np.all(np.isfinite(r))
    assert np.all(np.delete(r, bad) != 0.25)
    want_q, want_r = _ef_restated(chunk, 0, s, 3, np.full(1000, 0.25, np.float32))
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(r, want_r)


def test_error_feedback_residual_errors():
    s = Settings.make(1, norm="sign")
    sent = reduction.split_by(*reduction.encode_chunks(np.ones(1000, np.float32), s, 1, 2))
    for bad in (np.zeros(999, np.float32), np.zeros(sent[0].size, np.float64), np.zeros((2, 1000), np.float32)[:, 0],
                [0.0] * 512):
        with pytest.raises(ValueError, match="residual must be a C-contiguous, writeable float32"):
            reduction.reduce_chunk([sent[0]], 0, s, 1, residual=bad)
    numel = codec.read_header(sent[0]).numel
    r = np.full(numel, 2.0, np.float32)
    corrupt = sent[0].copy()
    corrupt[-1] ^= 0x40
    with pytest.raises(PayloadError, match="payload 1"):
        reduction.reduce_chunk([sent[0], corrupt], 0, s, 1, residual=r)
    assert np.all(r == 2.0)  # untouched on failure
