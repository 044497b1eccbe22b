"""Statistics of encoder version 2's random stream and quantizer (kernels/qsgd_math.h, "encoder version
2's stream" and "encoder version 2's quantizer"), with fixed seeds and bounds derived from the math.

tests/test_codec_stats.py checks the moments of Q on a realistic vector through the default encoder;
this module pins version 2 exactly (a NumPy statement of its stream and quantizer reproduces the
library's codes bit for bit, and the library's uniforms are read back out of its codes) and tests what
is particular to it: the 16-bit resolution, the two uniforms per hash, and the seeds the adapters use.

The stream. Element i < 2^32 of a tensor draws y = triple32(((i >> 1) XOR lo32(key)) + hi32(key)),
key = mix64(seed + G), u = y AND 0xFFFF for even i and y >> 16 for odd i (triple32: Wellons' three-round
hash, mix64: SplitMix64's finalizer).

The quantizer, b >= 2 (s levels, scale S, step d = S/s, t = |x|/d). With R(f) = bits(f) - bits(2^23), the
integer f - 2^23 for a float f in [2^23, 2^24): T = R(min(t_f, s 2^16) + 2^23), t_f = fl(fl(|x| pre) rq),
rq = fl(s 2^16 / fl(S pre)), i.e. T is min(t_f, s 2^16) <= 127 2^16 < 2^23 rounded to the nearest integer
(ties to even), and l = (T + u) >> 16 = floor(T/2^16) + [u >= 2^16 - (T mod 2^16)]: for u uniform on
0..2^16-1 the level rounds up with probability exactly (T mod 2^16)/2^16, and E[l] = T/2^16. |x| pre and
S pre are exact (pre a power of 2); rq and the product are one rounding each (relative error <= 2^-24), so
t_f = 2^16 t (1 + e) with |e| <= (1 + 2^-24)^2 - 1 = 2^-23 + 2^-48 =: EPS; the cap s 2^16 >= 2^16 t only
clamps toward t, and the rounding to an integer moves by at most 1/2. Hence, in steps,

    (B2)   |E[l] - t|  <=  2^-17 + EPS t.

With S = s (step 1, rq = 2^16) and x of at most 24 significant bits every product is exact, and
E[l] = k + rne(2^16 f)/2^16 for t = k + f (rne: to nearest, ties to even): a bias within +-2^-17.
f = 2^-17 (a tie, to even 0) never rounds up; f = 1 - 2^-17 (a tie, to even 2^16) always does.

b == 1: T = R(fl(fl(x pre) rq) + (2^23 + 2^15)), rq = fl(2^15 / fl(S pre)), positive iff u < T; exactly,
c* = 2^16 p with p = (1 + x/S)/2. |fl(x pre rq) - 2^15 x/S| <= 2^15 EPS = 2^-8 + 2^-33 and the addition
rounds 2^15 + that to the nearest integer in [0, 2^16], so P(positive) = T/2^16 with

    (B1)   |P - p|  <=  (1/2 + EPS_C)/2^16,  EPS_C := 2^-8 + 2^-33,   and with S = 1 exactly P = rne(2^16 p)/2^16.

Statistical bounds: Bernstein's inequality for the mean of M independent terms with variance <= V and
|X - E X| <= c: P(|mean - E| >= a) <= 2 exp(-M a^2 / (2 (V + c a/3))), so at level alpha
a = (c L/3 + sqrt((c L/3)^2 + 2 M V L)) / M with L = ln(2/alpha) (for +-1 terms and M = 2^20 that is
5.7-6.2/sqrt(M) at the alphas below). Every test spends a family-wise ALPHA = 1e-6, split evenly
(Bonferroni) over its statistics. The terms are independent under the null hypothesis that the uniforms
are independent and uniform, which is the property under test.
"""
import math

import numpy as np
import pytest

from hvd_qsgd import _native, codec, protocol, reduction
from tests.references import GOLDEN64 as GOLDEN, M64, mix64

F32 = np.float32
ALPHA = 1e-6
EPS = 2.0 ** -23 + 2.0 ** -48          # two roundings, relative (B2)
EPS_C = 2.0 ** -8 + 2.0 ** -33         # the one-bit threshold's product rounding, absolute (B1)
ROUND, ROUND_BITS = F32(2.0 ** 23), np.uint32(0x4B000000)
M32 = 0xFFFFFFFF
BASE_SEED = 0                           # Settings.seed's default
EXCHANGE = "hvd_qsgd.0.p.fc1.weight"    # a parameter's exchange name (hvd_qsgd/state.py)
N = 2 ** 20


# ---- the stream and the quantizers in NumPy ------------------------------------------------------
def _page_key(seed, page=0):
    return mix64(seed + GOLDEN * (page + 1))


def _step_seed(base, occurrence):
    return mix64(base + (occurrence + 1) * GOLDEN)


# the two 32-bit hashes, each a chain of x ^= x >> shift, then x *= multiplier (none after the last shift)
LOWBIAS32 = ((16, 15, 16), (0x7FEB352D, 0x846CA68B))                      # version 1, twice per element
TRIPLE32 = ((17, 11, 15, 14), (0xED5AD4BB, 0xAC4C1B51, 0x31848BAB))       # version 2, once per pair


def _xorshift_multiply(x, hash32):
    shifts, multipliers = hash32
    x = np.asarray(x, np.uint32)
    for k, m in zip(shifts, multipliers + (1,)):
        x = (x ^ (x >> k)) * np.uint32(m)
    return x


def _unxorshift(y, k):
    """The x with x ^ (x >> k) == y (32 bits)."""
    x = y
    for _ in range(32 // k + 1):
        x = y ^ (x >> k)
    return x


def _xorshift_multiply_inv(y, hash32):
    shifts, multipliers = hash32
    y = np.asarray(y, np.uint32)
    for k, m in reversed(list(zip(shifts, multipliers + (1,)))):
        y = _unxorshift(y * np.uint32(pow(m, -1, 2 ** 32)), k)
    return y


def _hash32(x):
    return _xorshift_multiply(x, LOWBIAS32)


def _triple32(x):
    return _xorshift_multiply(x, TRIPLE32)


def _u16(seed, n):
    """Version 2's uniforms of elements 0..n-1 (page 0)."""
    assert n <= 2 ** 32
    k = _page_key(seed)
    i = np.arange(n, dtype=np.uint32)
    y = _triple32(((i >> 1) ^ np.uint32(k & M32)) + np.uint32(k >> 32))
    return np.where(i & 1, y >> 16, y & 0xFFFF).astype(np.uint32)


def _u24(seed, n):
    """Version 1's uniforms of elements 0..n-1 (page 0)."""
    k = _page_key(seed)
    i = np.arange(n, dtype=np.uint32)
    y = _hash32(i ^ np.uint32(k & M32))
    return _hash32(y + np.uint32(k >> 32)) >> 8


def _bucket_scales(x, scales, bucket):
    S = np.repeat(np.asarray(scales, F32), bucket)[: x.size]
    ok = np.isfinite(S) & (S > 0)
    return np.where(ok, S, F32(1)), ok, np.where(ok, x, F32(0)).astype(F32)


def _rne_int(f):
    """R(f + 2^23): float32 f in [0, 2^23) rounded to the nearest integer, ties to even, as qsgd_quantize2."""
    return (np.asarray(f, F32) + ROUND).view(np.uint32) - ROUND_BITS


def _ref2(x, scales, bucket, bits, u16):
    """Version 2's codes, and T, in float32 as qsgd_quantize2."""
    s = codec.levels(bits)
    S, ok, xq = _bucket_scales(np.asarray(x, F32), scales, bucket)
    pre = np.where(S < F32(2.0 ** -96), F32(2.0 ** 96), F32(1)).astype(F32)
    if bits == 1:
        rq = F32(32768) / (S * pre)
        T = ((xq * pre) * rq + F32(2.0 ** 23 + 2.0 ** 15)).view(np.uint32) - ROUND_BITS
        code = np.where(u16 < T, 0, 1).astype(np.uint32)
    else:
        rq = F32(s * 65536) / (S * pre)
        T = _rne_int(np.minimum((np.abs(xq) * pre) * rq, F32(s * 65536)))
        lv = (T + u16) >> 16
        code = np.where((xq < 0) & (lv != 0), np.uint32(1 << (bits - 1)), np.uint32(0)) | lv
    return np.where(ok, code, 0).astype(np.uint32), T


def _ref1(x, scales, bucket, bits, u24):
    """Version 1's codes, in float32 as qsgd_quantize."""
    s = F32(codec.levels(bits))
    S, ok, xq = _bucket_scales(np.asarray(x, F32), scales, bucket)
    r = u24.astype(F32)
    if bits == 1:
        p = F32(0.5) + F32(0.5) * (xq / S)
        code = np.where(r < p * F32(2 ** 24), 0, 1).astype(np.uint32)
    else:
        t = np.minimum((np.abs(xq) / S) * s, s)
        lv = t.astype(np.uint32)
        lv = lv + (r < (t - lv.astype(F32)) * F32(2 ** 24)).astype(np.uint32)
        code = np.where((xq < 0) & (lv != 0), np.uint32(1 << (bits - 1)), np.uint32(0)) | lv
    return np.where(ok, code, 0).astype(np.uint32)


# ---- payloads -----------------------------------------------------------------------------------
def _parse(p):
    """(header, scales, codes) of a fixed-coding payload (docs/wire-format.md, "Fixed coding")."""
    h = codec.read_header(p)
    assert h.coding == "fixed"
    n, b = h.numel, h.bits
    nb = -(-n // h.bucket_size)
    scales = np.frombuffer(p[56:56 + 4 * nb].tobytes(), "<f4")
    data = p[56 + 4 * nb:]
    if b == 8:
        codes = data[:n].astype(np.uint32)
    else:
        bits = np.unpackbits(data, bitorder="little")[: n * b].reshape(n, b).astype(np.uint32)
        codes = (bits << np.arange(b, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return h, scales, codes


def _levels(codes, bits):
    """(level, negative) of each code."""
    if bits == 1:
        return np.ones_like(codes), codes.astype(bool)
    return codes & ((1 << (bits - 1)) - 1), (codes >> (bits - 1)).astype(bool)


def _one_bucket(values, scale):
    """values then one element equal to scale: a single bucket whose max-norm scale is scale."""
    return np.append(np.asarray(values, F32), F32(scale))


def _encode_levels(x, bits, seed, encoder=2):
    p = codec.encode(x, bits=bits, bucket_size=x.size, norm="max", seed=seed, encoder=encoder)
    h, scales, codes = _parse(p)
    assert h.encoder == encoder
    lv, neg = _levels(codes, bits)
    return p, scales, codes, lv, neg


# ---- statistics ---------------------------------------------------------------------------------
def _bernstein(m, var, c, alpha):
    """Half-width a with P(|mean of m terms - E| >= a) <= alpha (variance <= var, |X - E X| <= c)."""
    L = math.log(2.0 / alpha)
    return (c * L / 3 + math.sqrt((c * L / 3) ** 2 + 2 * m * var * L)) / m


def _chi2_band(df, alpha):
    """[lo, hi] with P(X outside) <= alpha for X ~ chi^2(df): Laurent & Massart (2000), Lemma 1,
    P(X - df >= 2 sqrt(df y) + 2 y) <= e^-y and P(df - X >= 2 sqrt(df y)) <= e^-y, y = ln(2/alpha)."""
    y = math.log(2.0 / alpha)
    return df - 2 * math.sqrt(df * y), df + 2 * math.sqrt(df * y) + 2 * y


def _pearson(cells, ncells):
    counts = np.bincount(cells, minlength=ncells).astype(np.float64)
    e = cells.size / ncells
    return ((counts - e) ** 2 / e).sum()


def _seed(rank=0, occurrence=0):
    """The payload seed the adapters give rank ``rank``'s ``occurrence``-th exchange of EXCHANGE."""
    return protocol.payload_seed(BASE_SEED, rank, EXCHANGE, occurrence)


def _payload_seeds():
    """Named seeds the adapters derive: 4 ranks at one step, 4 steps of rank 0, and the chunk seeds of
    chunk 1 of a scatter_allgather step on 4 ranks (the ranks' shares and the reduced chunk)."""
    ranks = {f"rank{r}": _seed(r, 5) for r in range(4)}
    steps = {f"step{o}": _seed(0, o) for o in range(4)}
    chunks = {f"share{r}": reduction.chunk_seed(_seed(r, 5), 1, 0) for r in range(4)}
    chunks["reduced"] = reduction.chunk_seed(_seed(1, 5), 1, 1)
    return ranks, steps, chunks


def _pairs(group):
    names = list(group)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]


def _seed_pairs():
    ranks, steps, chunks = _payload_seeds()
    step_pairs = [(f"step{o}", f"step{o + 1}") for o in range(3)] + [("step0", "step2")]
    seeds = {**ranks, **steps, **chunks}
    return seeds, _pairs(ranks) + step_pairs + _pairs(chunks)


# ---- the seeds and the exact stream -------------------------------------------------------------
def test_the_adapters_seeds_are_the_documented_splitmix_steps():
    """The seed derivations the statistics below use are the library's: qsgd_step_seed(base, o) =
    mix64(base + (o + 1) G), payload_seed = step seed of exchange_seed, chunk_seed = occurrence 2j + phase."""
    lib = _native.load()
    for base in (0, 1, 12345, M64):
        for occ in (0, 1, 7, 2 ** 40):
            assert lib.qsgd_step_seed(base, occ) == _step_seed(base, occ)
    sigma = _seed(3, 5)
    assert sigma == _step_seed(protocol.exchange_seed(BASE_SEED, 3, EXCHANGE), 5)
    for j in range(4):
        for phase in (0, 1):
            assert reduction.chunk_seed(sigma, j, phase) == _step_seed(sigma, 2 * j + phase)
    seeds, _ = _seed_pairs()
    assert len(set(seeds.values())) == len(seeds)


def _mixed_tensor(bucket, n=100_003, seed=5):
    """Every kind of bucket, at bucket indices: 1 subnormal (pre = 2^96), 2 normal below 2^-96 (pre = 2^96),
    3 max exactly 2^-96 (pre = 1), 4 zeros, 6 an Inf, 7 a NaN, 9 ties at +-max, 10 near the fp32 max;
    the rest mixed magnitudes with zeros and negative zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(F32) * rng.choice(np.array([1e-3, 1.0, 10.0, 3e4], F32), n)
    x[::97] = 0.0
    x[5::101] = -0.0

    def b(k):
        return slice(k * bucket, (k + 1) * bucket)
    u = rng.uniform(-1, 1, bucket)
    x[b(1)] = (u * 2.0 ** -130).astype(F32)
    x[b(2)] = (u * 2.0 ** -97).astype(F32)
    x[b(3)] = (u * 2.0 ** -96).astype(F32)
    x[3 * bucket + 7] = 2.0 ** -96
    x[b(4)] = 0.0
    x[6 * bucket + 3] = np.inf
    x[7 * bucket + 11] = np.nan
    x[9 * bucket: 9 * bucket + 40: 3] = np.float32(-50.0)
    x[9 * bucket + 1: 9 * bucket + 40: 5] = np.float32(50.0)
    x[b(10)] = (u * 3.0e38).astype(F32)
    assert np.all(np.isfinite(x[b(10)]))
    return x


def _max_scales(x, bucket):
    """The max-norm scale of each bucket (docs/wire-format.md): max |x|, the canonical NaN for a NaN."""
    pad = (-x.size) % bucket
    a = np.abs(np.append(x, np.zeros(pad, F32))).reshape(-1, bucket)
    m = np.where(np.isnan(a).any(axis=1), F32(np.nan), np.nanmax(a, axis=1)).astype(F32)
    return m


@pytest.mark.parametrize("bits", range(1, 9))
def test_numpy_stream_and_quantizer_reproduce_the_codes_bit_for_bit(bits):
    """The NumPy statement above is the library's encoder 2 on every CPU ISA variant: same scales (max
    norm) and same codes, for odd and even bucket sizes, both norms, subnormal and sub-2^-96 scales,
    non-finite buckets, and the seeds the adapters derive (and 2^64 - 1, whose page key wraps)."""
    isas = [name for name, runs in codec.cpu_isas().items() if runs]
    seeds = (_seed(1, 0), reduction.chunk_seed(_seed(1, 0), 2, 1), M64)
    cases = []
    for bucket in (333, 4096):
        x = _mixed_tensor(bucket)
        for norm in ("max", "l2"):
            for seed in seeds:
                cases.append((x, bucket, norm, seed))
    want = {}
    try:
        for isa in isas:
            codec.set_cpu_isa(isa)
            for i, (x, bucket, norm, seed) in enumerate(cases):
                p = codec.encode(x, bits=bits, bucket_size=bucket, norm=norm, seed=seed)
                h, scales, codes = _parse(p)
                assert h.encoder == 2
                if norm == "max":
                    np.testing.assert_array_equal(scales.view(np.uint32), _max_scales(x, bucket).view(np.uint32))
                if i not in want:  # the reference, from the stored scales (the l2 sum's order is tested elsewhere)
                    want[i] = scales, _ref2(x, scales, bucket, bits, _u16(seed, x.size))[0]
                np.testing.assert_array_equal(scales.view(np.uint32), want[i][0].view(np.uint32))
                bad = np.nonzero(codes != want[i][1])[0]
                assert bad.size == 0, (isa, bucket, norm, seed, bad[:10], codes[bad[:10]], want[i][1][bad[:10]])
    finally:
        codec.set_cpu_isa("auto")
    assert len(isas) >= 1 and len(want) == len(cases)


def test_the_librarys_uniforms_read_back_from_its_codes_are_the_stream():
    """Read each element's u16 out of the library by bisection, independently of the NumPy stream: with
    b = 2 and S = 1, x = (2^16 - theta)/2^16 makes T = 2^16 - theta, so the level is 1 iff u >= theta;
    16 encodes with per-element thresholds pin u exactly. Then check it is the NumPy stream, and that
    (triple32^-1(y_p) - hi32(key)) XOR p is one constant over all pairs p -- lo32 of the page key -- i.e.
    the stream is triple32 of the keyed pair index, with the even element in y's low half."""
    seed = _seed(0, 0)
    lo = np.zeros(N, np.int64)
    hi = np.full(N, 65536, np.int64)
    for _ in range(16):
        mid = (lo + hi) // 2                       # >= 1 while hi - lo >= 2
        x = _one_bucket((65536 - mid) / 65536.0, 1.0)  # exact: 16 significant bits
        _, scales, _, lv, _ = _encode_levels(x, 2, seed)
        assert scales[0] == 1.0
        up = lv[:N] == 1
        lo, hi = np.where(up, mid, lo), np.where(up, hi, mid)
    assert np.all(hi - lo == 1)
    u = lo.astype(np.uint32)
    np.testing.assert_array_equal(u, _u16(seed, N))
    y = u[0::2] | (u[1::2] << 16)
    k = (_xorshift_multiply_inv(y, TRIPLE32) - np.uint32(_page_key(seed) >> 32)) ^ np.arange(N // 2, dtype=np.uint32)
    assert np.all(k == k[0]) and int(k[0]) == _page_key(seed) & M32
    v = np.random.default_rng(0).integers(0, 2 ** 32, 1000, dtype=np.uint64).astype(np.uint32)
    for hash32 in (TRIPLE32, LOWBIAS32):
        np.testing.assert_array_equal(_xorshift_multiply_inv(_xorshift_multiply(v, hash32), hash32), v)


def test_the_stream_depends_on_both_halves_of_the_page_key():
    """Both halves of the 64-bit page key select version 2's stream (as version 1's). Two seeds whose page
    keys share their low 32 bits -- among 2^18 consecutive seeds about C(2^18, 2)/2^32 = 8 such pairs are
    expected -- still draw independent streams: in both versions their levels differ at the rate of
    independent draws."""
    s = np.arange(2 ** 18, dtype=np.uint64)
    keys = mix64(s + np.uint64(GOLDEN))  # _page_key(seed) of every seed, page 0
    assert all(int(keys[i]) == _page_key(int(s[i])) for i in (0, 1, 2 ** 17, 2 ** 18 - 1))
    lo32 = keys & np.uint64(M32)
    order = np.argsort(lo32, kind="stable")
    dup = np.nonzero(lo32[order][1:] == lo32[order][:-1])[0]
    assert dup.size >= 1
    a, b = int(s[order[dup[0]]]), int(s[order[dup[0] + 1]])
    assert _page_key(a) != _page_key(b) and _page_key(a) & M32 == _page_key(b) & M32
    x = np.random.default_rng(1).standard_normal(10_001).astype(F32)
    codes = {(e, sd): _parse(codec.encode(x, bits=4, bucket_size=512, seed=sd, encoder=e))[2]
             for e in (1, 2) for sd in (a, b)}
    # two independent streams: the levels differ in a fraction mean(2 q(1-q)) (q the fractional part of
    # t), up to Bernstein's a (V = 1/4, c = 1, ALPHA/2 per version) and 2^-15 for the uniforms' resolution
    S = np.repeat(_parse(codec.encode(x, bits=4, bucket_size=512, seed=a, encoder=1))[1].astype(np.float64), 512)
    t = np.abs(x).astype(np.float64) * 7 / S[: x.size]
    q = t - np.floor(t)
    for e in (1, 2):
        diff = np.mean(_levels(codes[e, a], 4)[0] != _levels(codes[e, b], 4)[0])
        assert abs(diff - np.mean(2 * q * (1 - q))) <= _bernstein(x.size, 0.25, 1.0, ALPHA / 2) + 2.0 ** -15, e


# ---- 1. unbiasedness per level --------------------------------------------------------------------
FRACS = (2.0 ** -17, 2.0 ** -16, 3 * 2.0 ** -17, 0.25, 0.5, 0.75, 1 - 3 * 2.0 ** -17, 1 - 2.0 ** -16, 1 - 2.0 ** -17)


def _rne(v):
    """v rounded to the nearest integer, ties to even (Python's round)."""
    return round(v)


def _threshold(u, above):
    """The theta with above == (u >= theta) for every element, read off the codes against the stream:
    (theta_lo, theta_hi), the range the draws allow; theta_lo > theta_hi if no threshold fits."""
    theta_lo = int(u[~above].max()) + 1 if (~above).any() else 0
    theta_hi = int(u[above].min()) if above.any() else 65536
    return theta_lo, theta_hi


def _var_max(pmin, pmax):
    """The largest p(1-p) over [pmin, pmax]."""
    return max(q * (1 - q) for q in (pmin, pmax, min(max(0.5, pmin), pmax)))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_levels_round_up_with_probability_rne_f_2_16_over_2_16(bits):
    """S = s (step 1, exact products), every element at t = k + f (random signs), one f per encode.
    Exactly: l in {k, k+1}, the sign bit iff x < 0 and l > 0, decode gives +-l, and l = k+1 iff
    u >= theta for one threshold theta (read off the codes against the stream; 2^20 draws cover both
    neighbours of it), with 2^16 - theta = rne(2^16 f): the probability rne(2^16 f)/2^16, a bias within
    +-2^-17 (f = 2^-17 never rounds up, 1 - 2^-17 always does, 3 2^-17 and 1 - 3 2^-17 are ties to even
    too). Statistically: the fraction rounded up lies in [f - 2^-17, f + 2^-17] widened by Bernstein's a,
    with V the largest p(1-p) over that interval."""
    s = codec.levels(bits)
    ks = sorted({0, s // 2, s - 1})
    cases = [(k, f) for k in ks for f in FRACS]
    signs = np.where(np.random.default_rng(2).random(N) < 0.5, F32(-1), F32(1))
    alpha = ALPHA / len(cases)
    for idx, (k, f) in enumerate(cases):
        seed = _seed(0, 100 + idx)
        x = _one_bucket(signs * F32(k + f), s)
        assert np.all(np.abs(x[:N]).astype(np.float64) == k + f)
        p, scales, _, lv, neg = _encode_levels(x, bits, seed)
        assert scales[0] == s
        lv, neg, u = lv[:N], neg[:N], _u16(seed, N)
        assert np.all((lv == k) | (lv == k + 1)), (k, f)
        np.testing.assert_array_equal(neg, (x[:N] < 0) & (lv != 0))
        np.testing.assert_array_equal(codec.decode(p)[:N], np.where(neg, -1.0, 1.0) * lv)  # step = s/s = 1
        up = lv == k + 1
        theta_lo, theta_hi = _threshold(u, up)
        assert theta_lo <= theta_hi, f"k={k} f={f}: rounding up is not a threshold on u"
        assert theta_lo == theta_hi, "2^20 draws leave the threshold unresolved"
        assert 65536 - theta_lo == _rne(f * 65536), (k, f, theta_lo)
        pmin, pmax = max(f - 2.0 ** -17, 0.0), min(f + 2.0 ** -17, 1.0)
        a = _bernstein(N, _var_max(pmin, pmax), 1.0, alpha)
        assert pmin - a <= up.mean() <= pmax + a, (k, f, up.mean(), a)


def test_one_bit_probability_is_rne_p_2_16_over_2_16():
    """b = 1, S = 1 (exact products): positive iff u < theta for one threshold read off the codes, with
    theta = rne(2^16 p), so P(+S) = rne(2^16 p)/2^16, within +-2^-17 of p (p = 2^-17 is never positive,
    1 - 2^-17 always). Statistically the positive fraction is within Bernstein's a of [p - 2^-17, p + 2^-17]."""
    alpha = ALPHA / len(FRACS)
    for idx, pr in enumerate(FRACS):
        seed = _seed(0, 200 + idx)
        x = _one_bucket(np.full(N, 2 * pr - 1, F32), 1.0)
        assert np.all(x[:N].astype(np.float64) == 2 * pr - 1)
        p, scales, _, _, neg = _encode_levels(x, 1, seed)
        assert scales[0] == 1.0
        pos, u = ~neg[:N], _u16(seed, N)
        np.testing.assert_array_equal(codec.decode(p)[:N], np.where(pos, 1.0, -1.0))
        theta_lo, theta_hi = _threshold(u, ~pos)
        assert theta_lo <= theta_hi, f"p={pr}: positive is not a threshold on u"
        assert theta_lo == theta_hi, "2^20 draws leave the threshold unresolved"
        assert theta_lo == _rne(pr * 65536), (pr, theta_lo)
        pmin, pmax = max(pr - 2.0 ** -17, 0.0), min(pr + 2.0 ** -17, 1.0)
        a = _bernstein(N, _var_max(pmin, pmax), 1.0, alpha)
        assert pmin - a <= pos.mean() <= pmax + a, (pr, pos.mean(), a)


SCALES = (0.3, 1.7 * 2.0 ** -100, 2.5e-41)  # rq rounded; pre = 2^96 with a normal and a subnormal scale


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("scale", SCALES)
def test_unbiased_within_the_bias_bound_when_the_reciprocal_rounds(bits, scale):
    """Scales where rq and the products round, 2^20 elements spread over [0, s] (b = 1: over [-S, S]).
    Exactly, for every element: the library's codes are the reference's, and the reference's E[l] = T/2^16
    (b = 1: P = T/2^16) satisfies (B2) (resp. (B1)) against t = |x| s/S computed in float64 (its own error
    <= 2^-52 t). Statistically: the mean of l - E[l] is within Bernstein's a of 0 (V = mean q(1-q), c = 1),
    and the mean of l - t within a of (B2)'s (resp. (B1)'s) interval."""
    s = codec.levels(bits)
    S = F32(scale)
    rng = np.random.default_rng(3)
    if bits == 1:
        v = (rng.uniform(-1, 1, N) * np.float64(S)).astype(F32)
    else:
        v = (rng.uniform(0, s, N) * (np.float64(S) / s) * np.where(rng.random(N) < 0.5, -1, 1)).astype(F32)
    v = np.clip(v, -S, S)
    x = _one_bucket(v, S)
    seed = _seed(2, 300 + bits)
    _, scales, codes, lv, neg = _encode_levels(x, bits, seed)
    assert scales[0] == S
    want, T = _ref2(x, scales, x.size, bits, _u16(seed, x.size))
    np.testing.assert_array_equal(codes, want)
    x64, S64 = x[:N].astype(np.float64), np.float64(S)
    E = T[:N].astype(np.float64) / 65536
    alpha = ALPHA / 2
    tiny = 2.0 ** -52
    if bits == 1:
        pexact = (1 + x64 / S64) / 2
        assert np.all((T[:N] <= 65536) & (np.abs(E - pexact) <= (0.5 + EPS_C) / 65536 + tiny))
        pos = ~neg[:N]
        a = _bernstein(N, float(np.mean(E * (1 - E))), 1.0, alpha)
        assert abs(np.mean(pos - E)) <= a
        assert abs(np.mean(pos - pexact)) <= (0.5 + EPS_C) / 65536 + tiny + a
        return
    t = np.abs(x64) * s / S64
    assert np.all(np.abs(E - t) <= 2.0 ** -17 + (EPS + tiny) * t)
    q = E - np.floor(E)
    a = _bernstein(N, float(np.mean(q * (1 - q))), 1.0, alpha)
    lvf = lv[:N].astype(np.float64)
    assert abs(np.mean(lvf - E)) <= a
    assert abs(np.mean(lvf - t)) <= 2.0 ** -17 + (EPS + tiny) * float(np.mean(t)) + a


# ---- 2. variance ----------------------------------------------------------------------------------
def _delta_max(s):
    """|E[l] - t| <= 2^-17 + EPS s by (B2) (t <= s); plus 2^-52 s for t computed in float64."""
    return 2.0 ** -17 + EPS * s + 2.0 ** -52 * s


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_l2_variance_within_lemma_3_1_where_the_bound_is_nearly_tight(bits):
    """QSGD Lemma 3.1, E||Q(v) - v||^2 <= min(n/s^2, sqrt(n)/s) ||v||^2 per bucket (L2 norm), on buckets of
    n = 512 equal magnitudes (random signs): t = s/sqrt(n) in every element, so the exact variance
    n d^2 f(1-f) is 0.956 of the bound for s = 1 (0.69 for s = 7). 2048 buckets, 4 of rank 0's
    consecutive payload seeds. Per element, with d the step: E(Q - x)^2 = d^2 (q(1-q) + (m - t)^2) with
    m = E[l], which differs from d^2 f(1-f) by at most d^2 (delta + delta^2) (q(1-q) is 1-Lipschitz in m),
    delta = 2^-17 + EPS s; decoding rounds the step and the product (2^-23 relative of |Q| <= (s+1) d),
    which moves (Q - x)^2 by at most d^2 (2^-22 (s+1) + 2^-46 (s+1)^2). The mean of 2^22 element
    errors is within Bernstein's a of the exact per-element value (V = d^4 (f(1-f)(1-2f)^2 + 5 delta):
    the variance of a two-point (l - t)^2, Lipschitz 5 in m; c = 1.01 d^2), and the bucket sum within
    n a of the bound."""
    s = codec.levels(bits)
    n, nb = 512, N // 512
    rng = np.random.default_rng(4)
    x = np.where(rng.random(N) < 0.5, F32(-1), F32(1))
    seeds = [_seed(0, o) for o in range(4)]
    err = np.zeros(N)
    for seed in seeds:
        p = codec.encode(x, bits=bits, bucket_size=n, norm="l2", seed=seed)
        _, scales, _ = _parse(p)
        assert np.all(scales == scales[0])
        err += (codec.decode(p).astype(np.float64) - x) ** 2
    S = np.float64(scales[0])
    assert abs(S - math.sqrt(n)) <= 2.0 ** -24 * S      # fl(sqrt(512))
    d = S / s
    t = s / S
    f = t - math.floor(t)
    delta = _delta_max(s)
    per_el = d * d * f * (1 - f)
    allow = d * d * (delta + delta ** 2 + 2.0 ** -22 * (s + 1) + 2.0 ** -46 * (s + 1) ** 2)
    norm2 = float(n)                                    # ||v||^2 of a bucket of +-1
    bound = min(n / s ** 2, math.sqrt(n) / s) * norm2
    assert n * per_el <= bound                          # the lemma holds for the exact variance ...
    M = N * len(seeds)
    a = _bernstein(M, d ** 4 * (f * (1 - f) * (1 - 2 * f) ** 2 + 5 * delta), 1.01 * d * d, ALPHA / 2)
    emp = err.sum() / M
    assert abs(emp - per_el) <= a + allow, (emp, per_el, a)  # ... and the library's is that variance
    per_bucket = err.reshape(-1, n).sum(axis=1).mean() / len(seeds)
    assert per_bucket <= bound + n * (a + allow), (per_bucket, bound)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_per_element_variance_is_f_one_minus_f_step_squared(bits):
    """Max norm, S = 0.37 (rq rounds), 2^20 elements in 8 groups of 2^17 at t = k + f_g (k random in
    0..s-1, random signs, t recomputed from the float32 x). Per group the mean of (Q - x)^2/d^2 is within
    Bernstein's a (V = mean f(1-f)(1-2f)^2 + 5 delta, c = 1.01, family-wise ALPHA over the groups) of the
    mean f(1-f), allowing delta + delta^2 + 2^-22 (s+1) + 2^-46 (s+1)^2 for the quantizer's bias and the
    decoder's roundings (as in the Lemma 3.1 test)."""
    s = codec.levels(bits)
    fg = np.array([1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 15 / 16])
    G = fg.size
    rng = np.random.default_rng(5)
    S = F32(0.37)
    k = rng.integers(0, s, N)
    group = np.arange(N) % G
    sign = np.where(rng.random(N) < 0.5, -1.0, 1.0)
    v = (sign * (k + fg[group]) * (np.float64(S) / s)).astype(F32)
    x = _one_bucket(v, S)
    p = codec.encode(x, bits=bits, bucket_size=x.size, norm="max", seed=_seed(3, 7))
    assert _parse(p)[1][0] == S
    d = np.float64(S) / s
    e2 = ((codec.decode(p)[:N].astype(np.float64) - v) / d) ** 2
    t = np.abs(v.astype(np.float64)) / d
    f = t - np.floor(t)
    delta = _delta_max(s)
    allow = delta + delta ** 2 + 2.0 ** -22 * (s + 1) + 2.0 ** -46 * (s + 1) ** 2
    for g in range(G):
        sel = group == g
        fs = f[sel]
        assert np.all(np.abs(fs - fg[g]) < 1e-4)        # float32 x keeps t near k + f_g
        a = _bernstein(sel.sum(), float(np.mean(fs * (1 - fs) * (1 - 2 * fs) ** 2)) + 5 * delta, 1.01, ALPHA / G)
        want = float(np.mean(fs * (1 - fs)))
        assert abs(e2[sel].mean() - want) <= a + allow, (fg[g], e2[sel].mean(), want, a)


# ---- 3. no correlation of the rounding decisions ------------------------------------------------
N2 = 2 ** 21


def _half_decisions(seed, n=N2):
    """+-1 rounding decisions of n elements at t = 1/2 (b = 2, S = 1: T = 2^15, up iff u >= 2^15): each
    is Rademacher exactly if u is uniform."""
    x = _one_bucket(np.full(n, 0.5, F32), 1.0)
    _, scales, _, lv, _ = _encode_levels(x, 2, seed)
    assert scales[0] == 1.0
    return 2.0 * lv[:n].astype(np.float64) - 1.0


def _neighbour_products(e):
    """Products of disjoint neighbour pairs: same hash (2p, 2p+1), across hashes (2p+1, 2p+2), and the
    same half of neighbouring hashes (4q, 4q+2) and (4q+1, 4q+3)."""
    return {"same hash (even i, odd i+1)": e[0::2] * e[1::2],
            "across hashes (odd i, even i+1)": e[1:-1:2] * e[2::2],
            "even halves of hashes p, p+1": e[0::4] * e[2::4],
            "odd halves of hashes p, p+1": e[1::4] * e[3::4]}


def test_neighbouring_rounding_decisions_are_uncorrelated():
    """2^21 decisions at f = 1/2 under rank 0's payload seed: the mean decision and the mean product of
    each kind of neighbour pair are within Bernstein's a of 0 (Rademacher terms: V = 1, c = 1; about
    6/sqrt(M) at ALPHA/5, M = 2^20 or 2^19 pairs)."""
    e = _half_decisions(_seed(0, 0))
    stats = {"mean decision": e, **_neighbour_products(e)}
    for name, terms in stats.items():
        a = _bernstein(terms.size, 1.0, 1.0, ALPHA / len(stats))
        assert abs(terms.mean()) <= a, (name, terms.mean(), a, terms.size)


def test_rounding_decisions_are_uncorrelated_across_ranks_steps_and_chunks():
    """The same element index under the seeds the adapters derive (4 ranks at one step; rank 0 at
    consecutive steps; the 4 ranks' shares of chunk 1 and its reduced chunk in scatter_allgather):
    for each pair the mean product of the f = 1/2 decisions is within Bernstein's a of 0 (V = 1, c = 1,
    M = 2^21, ALPHA split over the 20 pairs)."""
    seeds, pairs = _seed_pairs()
    e = {name: _half_decisions(seed) for name, seed in seeds.items()}
    for a_name, b_name in pairs:
        terms = e[a_name] * e[b_name]
        a = _bernstein(terms.size, 1.0, 1.0, ALPHA / len(pairs))
        assert abs(terms.mean()) <= a, (a_name, b_name, terms.mean(), a)


# ---- 4. the uniforms themselves ------------------------------------------------------------------
N4 = 2 ** 22
SIGMA_U = math.sqrt((2.0 ** 32 - 1) / 12)  # sd of a uniform on 0..2^16-1


def _z(u):
    return (u.astype(np.float64) - 32767.5) / SIGMA_U


def test_the_uniforms_are_uniform():
    """2^22 uniforms of rank 0's payload seed (the library's: the tests above pin the stream bit for bit).
    Pearson's X^2 over 256 cells (df = 255, >= 8192 expected per cell, where X^2 is chi^2(255) to O(1/8192))
    lies in the Laurent-Massart band at ALPHA/3/8 for: the top and the low byte of the even uniforms; the
    joint top nibbles of the two uniforms of one hash, of (odd i, even i+1) across hashes, and the joint
    low nibbles of one hash; the top bytes of the even uniforms of the first and the second half of the
    tensor (no drift along it); and over 16 cells (df = 15) the top nibble of the odd uniforms. Too
    uniform fails as well as too uneven. (The odd uniforms at byte resolution: the pooled test below.)
    The empirical CDF of each half, F_n(theta) = #{u < theta}/n -- what the rounding decisions see -- is
    within the DKW-Massart bound sqrt(ln(2/alpha)/(2n)) of theta/2^16 (P(sup|F_n - F| > e) <=
    2 exp(-2 n e^2), any F), alpha = ALPHA/3/2. Each of the 32 bits of the even and odd uniforms is 1 with
    frequency within Bernstein's a of 1/2 (V = 1/4, c = 1/2, ALPHA/3/32)."""
    u = _u16(_seed(0, 0), N4)
    ev, od = u[0::2], u[1::2]
    h = ev.size // 2
    cells = {
        "even top byte": (ev >> 8, 256), "even low byte": (ev & 255, 256),
        "same hash top nibbles": ((ev >> 12) * 16 + (od >> 12), 256),
        "across hashes top nibbles": ((od[:-1] >> 12) * 16 + (ev[1:] >> 12), 256),
        "same hash low nibbles": ((ev & 15) * 16 + (od & 15), 256),
        "even top byte, first half": (ev[:h] >> 8, 256), "even top byte, second half": (ev[h:] >> 8, 256),
        "odd top nibble": (od >> 12, 16),
    }
    for name, (c, ncells) in cells.items():
        lo, hi = _chi2_band(ncells - 1, ALPHA / 3 / len(cells))
        x2 = _pearson(c.astype(np.int64), ncells)
        assert lo <= x2 <= hi, (name, x2, lo, hi)
    theta = np.arange(1, 65537) / 65536.0
    for name, w in (("even", ev), ("odd", od)):
        Fn = np.cumsum(np.bincount(w, minlength=65536)) / w.size
        eps = math.sqrt(math.log(2 / (ALPHA / 3 / 2)) / (2 * w.size))
        assert np.abs(Fn - theta).max() <= eps, (name, np.abs(Fn - theta).max(), eps)
    for name, w in (("even", ev), ("odd", od)):
        for b in range(16):
            freq = ((w >> b) & 1).mean()
            a = _bernstein(w.size, 0.25, 0.5, ALPHA / 3 / 32)
            assert abs(freq - 0.5) <= a, (name, b, freq, a)


def test_the_uniforms_are_iid_at_byte_resolution_pooled_over_seeds():
    """What iid uniforms satisfy at byte resolution (one round of lowbias32 per pair, an earlier draft of
    the stream, failed it: X^2 of the odd uniforms' top byte ~400 and of the joint low nibbles of one hash
    ~187 per seed, against 255; triple32 keyed by both halves of the key passes). For the 8 payload seeds of
    rank 0's occurrences 0..7, 2^21 pairs each, the sum of the 8 Pearson X^2 of the odd uniforms' top byte
    and that of the joint low nibbles of the two uniforms of one hash are chi^2(8 * 255) under the null:
    each must lie in the Laurent-Massart band at ALPHA/2."""
    sums = {"odd top byte": 0.0, "same hash low nibbles": 0.0}
    for o in range(8):
        u = _u16(_seed(0, o), N4).astype(np.int64)
        ev, od = u[0::2], u[1::2]
        sums["odd top byte"] += _pearson(od >> 8, 256)
        sums["same hash low nibbles"] += _pearson((ev & 15) * 16 + (od & 15), 256)
    lo, hi = _chi2_band(8 * 255, ALPHA / 2)
    bad = {name: round(x2, 1) for name, x2 in sums.items() if not lo <= x2 <= hi}
    assert not bad, (bad, lo, hi)


def test_the_uniforms_are_uncorrelated_between_neighbours_ranks_steps_and_chunks():
    """Standardized uniforms z = (u - 32767.5)/sigma (|z| <= 1.733): the mean products of neighbour pairs
    (the two uniforms of one hash, across hashes, same halves of neighbouring hashes) under rank 0's seed,
    and of the same index under every pair of the adapters' seeds, are within Bernstein's a of 0
    (independent z's: V = 1, |z z'| <= 3 = c; about 6/sqrt(M)), ALPHA split over the 4 + 20 statistics."""
    seeds, pairs = _seed_pairs()
    z = {name: _z(_u16(seed, N4)) for name, seed in seeds.items()}
    stats = {name: terms for name, terms in _neighbour_products(_z(_u16(_seed(0, 0), N4))).items()}
    stats.update({f"{a} x {b}": z[a] * z[b] for a, b in pairs})
    for name, terms in stats.items():
        a = _bernstein(terms.size, 1.0, 3.0, ALPHA / len(stats))
        assert abs(terms.mean()) <= a, (name, terms.mean(), a, terms.size)


# ---- 5. version 1 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 4])
def test_encoder_1_is_still_available_and_differs_from_2(bits):
    """encoder=1 writes header encoder 1 and version 1's codes (two rounds of lowbias32 per element, a
    24-bit uniform, a division per element: the NumPy reference reproduces them bit for bit); the
    default is version 2; both decode to +-l step. The levels of the two versions differ in a fraction
    within Bernstein's a (V = 1/4, c = 1) of mean(2 q(1-q)) -- the rate of two independent roundings --
    up to 2^-15 (each version's probability is within 2^-17 + EPS s of f, resp. 2^-24 + 2^-23 s)."""
    n, bucket = 2 ** 18, 512
    x = np.random.default_rng(6).standard_normal(n).astype(F32)
    seed = _seed(1, 1)
    p1 = codec.encode(x, bits=bits, bucket_size=bucket, seed=seed, encoder=1)
    p2 = codec.encode(x, bits=bits, bucket_size=bucket, seed=seed, encoder=2)
    pd = codec.encode(x, bits=bits, bucket_size=bucket, seed=seed)
    assert (codec.read_header(p1).encoder, codec.read_header(p2).encoder, codec.read_header(pd).encoder) == (1, 2, 2)
    np.testing.assert_array_equal(pd, p2)
    _, sc1, c1 = _parse(p1)
    _, sc2, c2 = _parse(p2)
    np.testing.assert_array_equal(sc1, sc2)
    np.testing.assert_array_equal(c1, _ref1(x, sc1, bucket, bits, _u24(seed, n)))
    np.testing.assert_array_equal(c2, _ref2(x, sc2, bucket, bits, _u16(seed, n))[0])
    s = codec.levels(bits)
    step = np.repeat(sc1 / F32(s), bucket)[:n]
    for p, c in ((p1, c1), (p2, c2)):
        lv, neg = _levels(c, bits)
        np.testing.assert_array_equal(codec.decode(p), np.where(neg, -1, 1) * (lv.astype(F32) * step))
    S = np.repeat(sc1.astype(np.float64), bucket)[:n]
    if bits == 1:
        q = (1 + x / S) / 2
        diff = c1 != c2
    else:
        t = np.abs(x).astype(np.float64) * s / S
        q = t - np.floor(t)
        diff = _levels(c1, bits)[0] != _levels(c2, bits)[0]
    want = float(np.mean(2 * q * (1 - q)))
    a = _bernstein(n, 0.25, 1.0, ALPHA)
    assert abs(diff.mean() - want) <= a + 2.0 ** -15, (diff.mean(), want, a)
