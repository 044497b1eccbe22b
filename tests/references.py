"""Reference statements of the codec's documented arithmetic (docs/wire-format.md) and payload
helpers, shared by the test modules that check the CPU and the CUDA kernels against them
(tests/test_codec_format.py, tests/test_codec_validation.py, tests/test_cuda.py,
tests/test_error_feedback_encode.py, tests/test_encoder_v2_stats.py, tests/test_cpu_isa.py)."""
import math

import numpy as np

from hvd_qsgd import _native, codec

M64 = 2 ** 64 - 1
GOLDEN64 = 0x9E3779B97F4A7C15


def mix64(z):
    """qsgd_mix64 (kernels/qsgd_math.h) on a Python integer, mod 2^64, or elementwise on a NumPy
    array of uint64 (whose arithmetic wraps mod 2^64)."""
    if isinstance(z, np.ndarray):
        z = z.astype(np.uint64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def checksum(p: bytes) -> int:
    """docs/wire-format.md's checksum, word by word: the little-endian 64-bit words (the last one
    zero-padded), the checksum field (bytes 48..55, word 6) read as 0, each word's term added mod
    2^64, then mix64 of the sum plus the length."""
    c = 0xD6E8FEB86659FD93
    padded = p + bytes(-len(p) % 8)
    total = 0
    for k in range(len(padded) // 8):
        w = 0 if k == 6 else int.from_bytes(padded[8 * k:8 * k + 8], "little")
        y = ((w ^ ((k + 1) * GOLDEN64 & M64)) * c) & M64
        total += ((y ^ (y >> 32)) * c) & M64
    return mix64(total + len(p))


def fold_order_bucket():
    """A 32-element bucket whose L2 scale depends on the summation order of the squares.

    The squares are 1, 2^-24 (twice), 2^-48 and eight of 2^-54. Their exact sum is m^2 + 2^-51 with
    m = 1 + 2^-24, the midpoint between 1 and the next float. Summed one by one in fp64 each 2^-54
    is lost (below half an ulp of 1), the sum is m^2, sqrt is m, and the float rounds to even: 1.0.
    In the documented order -- lane j holds element j, lanes folded j += j+16, 8, 4, 2, 1 -- the
    eight 2^-54 (elements 1, 5, 9, 13, 17, 21, 25, 29) meet first and survive as 2^-51, sqrt is
    m + 2^-52 in fp64, and the scale rounds up to 1 + 2^-23."""
    x = np.zeros(32, np.float32)
    x[0] = 1.0
    x[[1, 5, 9, 13, 17, 21, 25, 29]] = 2.0 ** -27
    x[[2, 3]] = 2.0 ** -12
    x[4] = 2.0 ** -24
    return x


def l1_fold_order_bucket():
    """A 32-element bucket whose sign-norm scale depends on the summation order of |x|.

    |x| is 1 (element 0), 2^-24 (element 4) and eight of 2^-54 (elements 1, 5, ..., 29). Added one by
    one in fp64 each 2^-54 is lost (a quarter ulp of 1), the sum is 1 + 2^-24, exactly the midpoint
    between two floats once divided by 32, and the mean rounds to even: 1/32. In the documented order
    the eight 2^-54 meet first (lanes 1, 5, 9, 13 after the first fold, then 1 and 5, then 1) and
    survive as 2^-51, so the sum lies above the midpoint and the mean rounds up to (1 + 2^-23) / 32."""
    x = np.zeros(32, np.float32)
    x[0] = -1.0
    x[[1, 5, 9, 13, 17, 21, 25, 29]] = np.float32(2.0 ** -54) * np.array([1, -1] * 4, np.float32)
    x[4] = 2.0 ** -24
    return x


def documented_sign_scales(x, bucket):
    """The sign norm's bucket scales as docs/wire-format.md states them: sum |x| in float64 in 32 lanes
    (lane j: elements j, j+32, ... of the bucket, in order), lanes folded j += j+16, 8, 4, 2, 1, the
    sum divided in float64 by the bucket's own length and rounded to float32."""
    x = np.asarray(x, np.float32).reshape(-1)
    out = []
    for b in range(0, x.size, bucket):
        v = np.abs(x[b:b + bucket].astype(np.float64))
        rows = -(-v.size // 32)
        a = np.zeros(rows * 32)  # zero padding adds +0.0: no change to a lane's sum
        a[:v.size] = v
        a = a.reshape(rows, 32)
        lane = np.zeros(32)
        for r in range(rows):  # in order, lane by lane
            lane = lane + a[r]
        off = 16
        while off:
            lane[:off] = lane[:off] + lane[off:2 * off]
            off //= 2
        if np.isnan(v).any():
            out.append(np.float32(np.nan))
        elif np.isinf(v).any():
            out.append(np.float32(np.inf))
        else:
            out.append(np.float32(lane[0] / v.size))
    return np.array(out, np.float32)


def documented_sign_decode(x, bucket):
    """decode(encode(x, bits=1, norm="sign")) re-stated: +scale where x >= 0 (+0 and -0 included),
    -scale where x < 0; a bucket whose scale is 0, NaN or Inf has all-zero codes, decoding to +scale
    (+0.0, NaN, +Inf) in every element."""
    x = np.asarray(x, np.float32).reshape(-1)
    s = np.repeat(documented_sign_scales(x, bucket), bucket)[:x.size]
    quantizes = (s > 0) & np.isfinite(s)
    return np.where(quantizes & (x < 0), -s, s).astype(np.float32)


def reseal(p):
    """Recompute the checksum so that corruption reaches the checks behind it."""
    p = p.copy()
    p[48:56] = np.frombuffer(int(_native.load().qsgd_checksum_cpu(p.ctypes.data, p.size)).to_bytes(8, "little"), np.uint8)
    return p


def expected_nonfinite(xs, bucket, bits):
    """(NaN mask, +Inf mask) of the documented result of decoding/summing the payloads of xs."""
    n = xs[0].size
    nan, inf = np.zeros(n, bool), np.zeros(n, bool)
    for lo in range(0, n, bucket):
        sl = slice(lo, min(n, lo + bucket))
        any_nan = any(np.isnan(x[sl]).any() for x in xs)
        any_inf = any(np.isinf(x[sl]).any() for x in xs)
        if any_nan or (any_inf and bits >= 2):
            nan[sl] = True
        elif any_inf:
            inf[sl] = True
    return nan, inf


def check_nonfinite(y, xs, bucket, bits, clean):
    """y is the documented result for inputs xs; outside the non-finite buckets it equals ``clean``
    (the same computation with the non-finite values replaced by 0)."""
    nan, inf = expected_nonfinite(xs, bucket, bits)
    assert nan.any() or inf.any()
    assert np.array_equal(np.isnan(y), nan)
    assert np.array_equal(np.isposinf(y), inf)
    assert not np.isneginf(y).any()
    good = ~(nan | inf)
    assert np.array_equal(y[good], clean[good])


def cleaned(x):
    return np.where(np.isfinite(x), x, 0).astype(x.dtype)


def dqsgd_bits(budget, norms, lo=2, hi=8):
    """The DQSGD rule re-stated (hvd_qsgd.dynamic's docstring, discount 1): b_0 = round(budget); then
    r_t = log2 ||previous reduced gradient||, target = budget + r_t - mean(r_1..r_t), and the budget
    left unspent so far is added before rounding and clamping."""
    bits, unspent, rs = [], 0.0, []
    for t in range(len(norms) + 1):
        target = budget
        if t > 0:
            rs.append(math.log2(norms[t - 1]))
            target += rs[-1] - sum(rs) / len(rs)
        b = int(min(hi, max(lo, math.floor(target + unspent + 0.5))))
        unspent += budget - b
        bits.append(b)
    return bits


def block_sign(v, block):
    """C(v): per block, mean |v| times sign(v) (sign(0) = +1)."""
    out = np.empty_like(v)
    for i in range(0, v.size, block):
        blk = v[i: i + block]
        out[i: i + block] = np.where(blk >= 0, 1.0, -1.0) * np.mean(np.abs(blk))
    return out


def hierarchical(xs, settings, step_seeds, per_node, alpha, fingerprint=0, dtype="float32", residuals=None,
                 cross_stage=None):
    """The hierarchical reduction (``hvd_qsgd.exchange.hierarchical``) of the n ranks' inputs xs in
    one process: nodes of ``per_node`` consecutive ranks; shard i of node k summed in local-rank
    order (plus, with ``residuals``, a dict updated in place keyed (k, i), the residual of the rank
    encoding it: e <- v - decode(what it sent) where finite) and exchanged among the c nodes by the
    cross stage's reduction (``cross_reduction``, or ``cross_stage`` where given):
      allgather: encoded with rank k*per_node+i's step seed; shard i = decode_sum of the c payloads;
      scatter_allgather: encoded as c chunk payloads with that seed; chunk q re-quantized by the rank
      of node q (``reduction.reduce_chunk`` with its step seed); shard i = the decoded reduced chunks.
    Returns (alpha times the shards back to back, cross) with cross[i][k] the bytes rank
    k*per_node+i sends to other nodes (payloads, chunks and 8-byte-framed reduced chunks)."""
    import numpy as np
    from hvd_qsgd import reduction
    from hvd_qsgd.exchange.hierarchical import cross_reduction
    s, n = settings, len(xs)
    nodes = n // per_node
    flat = [np.asarray(x).astype(np.float32).reshape(-1) for x in xs]
    shards, cross = [], []
    for i, (b, e) in enumerate(reduction.chunk_ranges(flat[0].size, s.bucket_size, per_node)):
        if e == b:
            cross.append([0] * nodes)
            continue
        scatter = (cross_stage or cross_reduction(s, per_node, nodes, e - b)) == "scatter_allgather"
        sent, own = [], []
        for k in range(nodes):
            v = flat[k * per_node][b:e].copy()
            for j in range(1, per_node):
                v = v + flat[k * per_node + j][b:e]
            if residuals is not None and (k, i) in residuals:
                v = v + residuals[(k, i)]
            seed = step_seeds[k * per_node + i]
            if scatter:
                buf, lens = reduction.encode_chunks(v, s, seed, nodes, fingerprint, dtype)
                sent.append(reduction.split_by(buf, lens))
                own.append(reduction.decode_chunks(sent[-1], 1.0, e - b, s.bucket_size))
            else:
                sent.append(codec.encode(v, s.bits, s.bucket_size, s.norm, seed, s.coding, fingerprint, s.checksum,
                                         source_dtype=dtype, encoder=s.encoder))
                own.append(codec.decode(sent[-1]))
            if residuals is not None:
                with np.errstate(invalid="ignore", over="ignore"):
                    d = v - own[-1]
                residuals[(k, i)] = np.where(np.isfinite(d), d, residuals.get((k, i), np.float32(0)))
        if scatter:
            reduced = [reduction.reduce_chunk([sent[k][q] for k in range(nodes)], q, s, step_seeds[q * per_node + i],
                                              fingerprint, dtype) for q in range(nodes)]
            shards.append(reduction.decode_chunks(reduced, 1.0, e - b, s.bucket_size))
            cross.append([sum(c.size for c in sent[k]) - sent[k][k].size + (8 + reduced[k].size) * (nodes - 1)
                          for k in range(nodes)])
        else:
            shards.append(codec.decode_sum(sent, 1.0))
            cross.append([p.size * (nodes - 1) for p in sent])
    out = np.concatenate(shards)
    return (out * alpha if alpha != 1.0 else out), cross


def error_feedback_steps(x32, residual, valid, **kw):
    """Error feedback's steps one by one on the CPU, what the fused encodes must equal: v = x (+ r),
    q = codec.encode(v, **kw), r' = v - decode(q) where that is finite (else r, or 0 when not valid)."""
    v = x32 + residual if valid else x32.copy()
    q = codec.encode(v, **kw)
    with np.errstate(invalid="ignore"):
        d = v - codec.decode(q)
    keep = residual if valid else np.zeros_like(residual)
    return q, np.where(np.isfinite(d), d, keep).astype(np.float32)
