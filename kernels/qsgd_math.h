/*
 * The per-element math of the codec, compiled into both the CPU and the CUDA library so that the
 * two cannot drift apart: the random stream, the bucket scale, the quantizer, the code layout,
 * the checksum, the Elias stream's omega writer and its parse. Everything here is exact integer
 * arithmetic or single IEEE-754 operations in a fixed order (both libraries are built without FMA
 * contraction, -ffp-contract=off / --fmad=false), which is what makes CPU and CUDA payloads
 * bit-identical for the same seed.
 */
#ifndef HVD_QSGD_MATH_H_
#define HVD_QSGD_MATH_H_

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qsgd.h"

#if defined(__CUDACC__)
#define QSGD_HD __host__ __device__ __forceinline__
#else
#define QSGD_HD static inline
#endif

/* ---- the counter-based random stream ----------------------------------------------------
 * u24(seed, i) for element i of a tensor:
 *   key = mix64(seed + G * (floor(i / 2^32) + 1))            (G = 0x9E3779B97F4A7C15)
 *   y   = hash32(hash32(lo32(i) XOR lo32(key)) + hi32(key))  (mod 2^32)
 *   u24 = y >> 8                                              uniform on 0 .. 2^24 - 1
 * mix64 is the SplitMix64 finalizer and hash32 Wellons' "lowbias32"; both are bijections, so
 * distinct elements of one page of 2^32 always hash distinct inputs. No state is carried. */
#define QSGD_GOLDEN64 0x9E3779B97F4A7C15ull

QSGD_HD uint64_t qsgd_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

QSGD_HD uint32_t qsgd_hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

/* The key of the page of 2^32 elements holding element i. */
QSGD_HD uint64_t qsgd_page_key(uint64_t seed, uint64_t i) {
  return qsgd_mix64(seed + QSGD_GOLDEN64 * ((i >> 32) + 1));
}

QSGD_HD uint32_t qsgd_u24(uint64_t key, uint32_t i_lo) {
  uint32_t y = qsgd_hash32(i_lo ^ (uint32_t)key);
  y = qsgd_hash32(y + (uint32_t)(key >> 32));
  return y >> 8;
}

/* ---- encoder version 2's stream (docs/wire-format.md, "Encoders") ----------------------------
 * One hash per pair of elements, two 16-bit uniforms from it: element i of a tensor, in the page
 * of 2^32 elements whose key is qsgd_page_key(seed, i) (as version 1), draws
 *   y   = triple32(((lo32(i) >> 1) XOR lo32(key)) + hi32(key))   (mod 2^32)
 *   u16 = y AND 0xFFFF for even i, y >> 16 for odd i                uniform on 0 .. 2^16 - 1
 * triple32 is Wellons' three-round 32-bit hash (a bijection; one round of lowbias32 was measured to
 * leave the halves of neighbouring pairs' hashes dependent at byte resolution). The input is a
 * bijection of the pair index for each key, so no two pairs of a page share a hash; a page holds
 * whole pairs (2^32 is even). Both halves of the 64-bit key select the stream. */
QSGD_HD uint32_t qsgd_triple32(uint32_t x) {
  x ^= x >> 17;
  x *= 0xED5AD4BBu;
  x ^= x >> 11;
  x *= 0xAC4C1B51u;
  x ^= x >> 15;
  x *= 0x31848BABu;
  x ^= x >> 14;
  return x;
}

QSGD_HD uint32_t qsgd_pair_hash_of(uint32_t pair, uint32_t key_lo, uint32_t key_hi) {
  return qsgd_triple32((pair ^ key_lo) + key_hi);
}

QSGD_HD uint32_t qsgd_pair_hash(uint64_t key, uint32_t i_lo) {
  return qsgd_pair_hash_of(i_lo >> 1, (uint32_t)key, (uint32_t)(key >> 32));
}

QSGD_HD uint32_t qsgd_u16_of_pair(uint32_t y, uint32_t i_lo) { return (i_lo & 1u) ? y >> 16 : y & 0xFFFFu; }

QSGD_HD uint32_t qsgd_u16(uint64_t key, uint32_t i_lo) { return qsgd_u16_of_pair(qsgd_pair_hash(key, i_lo), i_lo); }

/* ---- levels and codes ----------------------------------------------------------------------
 * A b-bit code holds the sign in its top bit (1 = negative) and the level l in the b-1 bits
 * below; the sign bit is 0 whenever l == 0. For b == 1 the code is the sign alone, level 1. */
QSGD_HD int32_t qsgd_levels_of(int32_t bits) {
  return bits == 1 ? 1 : (bits >= 2 && bits <= 8 ? (1 << (bits - 1)) - 1 : 0);
}

/* ---- bucket scale ----------------------------------------------------------------------------
 * max norm: the largest |x| of the bucket, found as the largest (bits(x) & 0x7fffffff) read as
 * an unsigned integer (that order is the order of |x|, and NaN > Inf > finite), so it is exact and
 * independent of the order of evaluation; any NaN gives NaN, else any Inf gives Inf.
 * L2 norm: sqrt of the sum of x^2 in double (each square is exact), accumulated in 32 lanes --
 * lane j sums elements j, j+32, j+64, ... of the bucket in increasing order -- and the 32 lane sums
 * folded pairwise (lane j += lane j+16, then j+8, j+4, j+2, j+1): one fixed order for both
 * libraries. Rounded to float; NaN if any element is NaN, else Inf if any is infinite. A NaN
 * scale is stored as the canonical quiet NaN 0x7fc00000.
 * sign norm (the mean |x|): the L1 sum of |x| in double (each |x| exact), in the same 32 lanes and
 * the same fold as the L2 sum, then divided in double by the bucket's own length n (exact in
 * double: n < 2^31) and rounded to float: scale = (float)(l1 / (double)n). NaN if any element is
 * NaN, else +Inf if any is infinite (as for the other norms); finite data gives a finite scale
 * (the mean is at most max |x|). */
#define QSGD_L2_LANES 32
#define QSGD_CANONICAL_NAN_BITS 0x7FC00000u

QSGD_HD uint32_t qsgd_f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
QSGD_HD float qsgd_u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* The stored scale from the bucket's largest |x| bit pattern. */
QSGD_HD float qsgd_scale_from_absmax_bits(uint32_t m) {
  return qsgd_u2f(m > 0x7F800000u ? QSGD_CANONICAL_NAN_BITS : m);
}

/* The stored scale from the folded L2 sum of squares and the bucket's largest |x| bit pattern.
 * A bucket of finite values whose L2 norm exceeds the fp32 range stores its max-norm instead: any
 * scale >= max |x| keeps the quantizer unbiased, and the decoder only reads the stored scale. */
QSGD_HD float qsgd_scale_from_sumsq(double sumsq, uint32_t absmax_bits) {
  if (absmax_bits >= 0x7F800000u) return qsgd_scale_from_absmax_bits(absmax_bits); /* NaN / Inf */
  const float f = (float)sqrt(sumsq);
  return f > 3.40282347e38f ? qsgd_u2f(absmax_bits) : f;
}

/* The stored scale of the sign norm from the folded L1 sum, the bucket length n and the bucket's
 * largest |x| bit pattern. */
QSGD_HD float qsgd_scale_from_l1(double l1, uint64_t n, uint32_t absmax_bits) {
  if (absmax_bits >= 0x7F800000u) return qsgd_scale_from_absmax_bits(absmax_bits); /* NaN / Inf */
  return (float)(l1 / (double)n);
}

/* The lane term of a bucket's L2 (x^2) or L1 (|x|) sum, in double: exact either way. */
QSGD_HD double qsgd_lane_term(float x, int norm) {
  const double d = (double)x;
  return norm == QSGD_NORM_SIGN ? (d < 0.0 ? -d : d) : d * d;
}

/* A scale is usable for quantizing when it is finite and positive; a zero bucket and a bucket with
 * a non-finite scale get all-zero codes (and decode to 0, respectively to NaN/Inf, since the decoder
 * multiplies by the scale). */
QSGD_HD int qsgd_scale_quantizes(float scale) {
  return scale > 0.0f && scale <= 3.40282347e38f;
}

/* ---- the quantizer -------------------------------------------------------------------------
 * b >= 2:  t = min(|x| / scale * s, s);  l = floor(t) + [u24 < (t - floor(t)) * 2^24]
 *          E[l] = t up to 2^-24 (the resolution of u24), so E[Q(x)] = x.
 * b == 1:  p = 0.5 + 0.5 * (x / scale);  positive iff u24 < p * 2^24
 * Requires qsgd_scale_quantizes(scale). */
QSGD_HD uint32_t qsgd_quantize(float x, float scale, float s, uint32_t u24, int bits) {
  const float r = (float)u24; /* exact: u24 < 2^24 */
  if (bits == 1) {
    const float p = 0.5f + 0.5f * (x / scale);
    return r < p * 16777216.0f ? 0u : 1u;
  }
  float t = (x < 0.0f ? -x : x) / scale * s;
  t = t < s ? t : s;
  uint32_t l = (uint32_t)(int32_t)t; /* t >= 0: truncation is floor */
  const float frac = t - (float)l;
  l += r < frac * 16777216.0f ? 1u : 0u;
  const uint32_t neg = (x < 0.0f && l != 0u) ? 1u : 0u;
  return (neg << (bits - 1)) | l;
}

/* ---- encoder version 2's quantizer -----------------------------------------------------------
 * In integers of 2^-16 of a level. Per bucket, once: pre = 2^96 if scale < 2^-96 else 1 (so that the
 * reciprocal below is finite for every scale that quantizes, subnormal ones included; |x| * pre and
 * scale * pre are exact), and the reciprocal, a single IEEE division rounded to float:
 *   rq = (s * 2^16) / (scale * pre)      (b >= 2)        rq = 2^15 / (scale * pre)      (b == 1)
 * Per element, with u = u16 and R(f) = bits(f) - 0x4B000000 (f a float in [2^23, 2^24): the integer
 * f - 2^23, so R(t + 2^23) is t rounded to the nearest integer, ties to even):
 * b >= 2:  T = R(min((|x| * pre) * rq, s * 2^16) + 2^23)        (an integer, 0 .. s * 2^16)
 *          l = (T + u) >> 16                 P(l = floor(T / 2^16) + 1) = (T mod 2^16) / 2^16
 * b == 1:  T = R((x * pre) * rq + (2^23 + 2^15));   positive iff u < T
 * Single IEEE operations in that order, no FMA. E[l] = T / 2^16, within 2^-17 of a level of the
 * t = (|x| * pre) * rq / 2^16 that the roundings of rq and of the products give (2^-23 relative
 * each); for b == 1, P(positive) = T / 2^16, within 2^-17 of 1/2 + x / (2 scale). docs/wire-format.md
 * states the bound. Requires qsgd_scale_quantizes(scale). */
#define QSGD_V2_TINY 0x1p-96f
#define QSGD_V2_PRE 0x1p96f
#define QSGD_V2_ROUND 8388608.0f          /* 2^23 */
#define QSGD_V2_ROUND_HALF 8421376.0f     /* 2^23 + 2^15 */
#define QSGD_V2_ROUND_BITS 0x4B000000u    /* bits of 2^23 */

QSGD_HD float qsgd_v2_pre(float scale) { return scale < QSGD_V2_TINY ? QSGD_V2_PRE : 1.0f; }

QSGD_HD float qsgd_v2_recip(float scale, float pre, float s, int bits) {
  return (bits == 1 ? 32768.0f : s * 65536.0f) / (scale * pre);
}

QSGD_HD uint32_t qsgd_quantize2(float x, float pre, float rq, float s, uint32_t u16, int bits) {
  if (bits == 1) return u16 < qsgd_f2u((x * pre) * rq + QSGD_V2_ROUND_HALF) - QSGD_V2_ROUND_BITS ? 0u : 1u;
  const float cap = s * 65536.0f; /* exact */
  float t = ((x < 0.0f ? -x : x) * pre) * rq;
  t = t < cap ? t : cap;
  const uint32_t l = (qsgd_f2u(t + QSGD_V2_ROUND) - QSGD_V2_ROUND_BITS + u16) >> 16;
  const uint32_t neg = (x < 0.0f && l != 0u) ? 1u : 0u;
  return (neg << (bits - 1)) | l;
}

/* The encoder version a configuration asks for (QSGD_FLAG_ENCODER2: 2, else 1). */
QSGD_HD int qsgd_encoder_of(uint32_t flags) { return (flags & QSGD_FLAG_ENCODER2) ? 2 : 1; }

/* The sign norm's code of x: the sign alone, deterministic: 1 (decodes to -scale) iff x < 0, so
 * +0 and -0 both give 0 (+scale). Like every code, only used where qsgd_scale_quantizes(scale);
 * a bucket whose scale is 0, NaN or Inf gets all-zero codes. */
QSGD_HD uint32_t qsgd_sign_code(float x) { return x < 0.0f ? 1u : 0u; }

/* The decoded value of a code, given step = scale / s (computed once per bucket as scale / s). */
QSGD_HD float qsgd_dequantize(uint32_t code, float step, int bits) {
  const uint32_t sign_bit = 1u << (bits - 1);
  const uint32_t level = bits == 1 ? 1u : (code & (sign_bit - 1u));
  const float v = (float)level * step;
  return (code & sign_bit) ? -v : v;
}

QSGD_HD float qsgd_step_of(float scale, float s) { return scale / s; }

/* ---- the checksum ---------------------------------------------------------------------------
 * Over the payload read as little-endian 64-bit words w_k (the last one zero-padded), with the
 * checksum field (bytes 48..55) read as zero:
 *   h_k = g(w_k XOR (k+1)*G),  g(z) = let y = z * C in (y XOR (y >> 32)) * C   (C odd)
 *   checksum = mix64((sum_k h_k mod 2^64) + len)
 * g is a bijection for each k, so changing any one word always changes the sum; the sum is order
 * independent, so the CPU and CUDA libraries may add the terms in any order. */
#define QSGD_CHECKSUM_C 0xD6E8FEB86659FD93ull
#define QSGD_CHECKSUM_OFFSET 48

QSGD_HD uint64_t qsgd_checksum_term(uint64_t w, uint64_t k) {
  uint64_t y = (w ^ ((k + 1) * QSGD_GOLDEN64)) * QSGD_CHECKSUM_C;
  return (y ^ (y >> 32)) * QSGD_CHECKSUM_C;
}
QSGD_HD uint64_t qsgd_checksum_final(uint64_t sum, uint64_t len) { return qsgd_mix64(sum + len); }

/* ---- little-endian field access -------------------------------------------------------- */
QSGD_HD uint64_t qsgd_load_le(const uint8_t* p, int nbytes) {
  uint64_t v = 0;
  for (int i = 0; i < nbytes; ++i) v |= (uint64_t)p[i] << (8 * i);
  return v;
}
QSGD_HD void qsgd_store_le(uint8_t* p, uint64_t v, int nbytes) {
  for (int i = 0; i < nbytes; ++i) p[i] = (uint8_t)(v >> (8 * i));
}

/* ---- sizes ---------------------------------------------------------------------------------- */
QSGD_HD uint64_t qsgd_num_buckets(uint64_t numel, uint32_t bucket) {
  return bucket ? (numel + bucket - 1) / bucket : 0;
}
QSGD_HD uint64_t qsgd_packed_bytes(uint64_t numel, int bits) {
  /* ceil(numel * bits / 8) without overflowing numel * bits */
  return (numel / 8) * (uint64_t)bits + ((numel % 8) * (uint64_t)bits + 7) / 8;
}

/* ---- Elias omega code (the Elias coding; docs/wire-format.md) -------------------------------- */
/* floor(log2 k) + 1 for k >= 1 */
QSGD_HD int qsgd_bit_width(uint64_t k) {
#if defined(__CUDA_ARCH__)
  return 64 - __clzll((long long)k);
#else
  return 64 - __builtin_clzll(k);
#endif
}
/* |omega(k)| for k >= 1 */
QSGD_HD int qsgd_omega_len(uint64_t k) {
  int len = 1;
  while (k > 1) {
    const int nb = qsgd_bit_width(k);
    len += nb;
    k = (uint64_t)(nb - 1);
  }
  return len;
}
#ifdef __cplusplus
/* omega(k) for k >= 1 into the bit sink w (w.bit(b) appends bit b of 0 or 1 to the stream): the
 * groups k, floor(log2 k), ... down to the last above 1, each most significant bit first, from the
 * last group found to k itself; then a 0. The CPU and the CUDA writers differ only in where their
 * bits go. */
template <typename BitSink>
QSGD_HD void qsgd_write_omega(BitSink& w, uint64_t k) {
  uint64_t groups[8];
  int ng = 0;
  while (k > 1) {
    groups[ng++] = k;
    k = (uint64_t)(qsgd_bit_width(k) - 1);
  }
  while (ng--) {
    const uint64_t v = groups[ng];
    for (int i = qsgd_bit_width(v) - 1; i >= 0; --i) w.bit((uint32_t)(v >> i) & 1u);
  }
  w.bit(0);
}
#endif

/* Bits per element a b-bit Elias stream can take: omega(gap) <= 3 * gap and the gaps of a bucket sum
 * to at most its length, so <= 3 per element; plus a sign bit and the longest omega(level). */
QSGD_HD uint64_t qsgd_elias_bits_bound(int bits) {
  const int s = qsgd_levels_of(bits);
  int lmax = 0;
  for (int l = 1; l <= s; ++l) lmax = qsgd_omega_len((uint64_t)l) > lmax ? qsgd_omega_len((uint64_t)l) : lmax;
  return 3 + 1 + (uint64_t)lmax;
}

/* Bits read least-significant first from one segment's bytes (the stream's bit order). */
typedef struct {
  const uint8_t* p;
  uint64_t pos, nbits;
} qsgd_bit_reader;

/* the next bit into *b; 0 past the segment's end */
QSGD_HD int qsgd_read_bit(qsgd_bit_reader* r, uint32_t* b) {
  if (r->pos >= r->nbits) return 0;
  *b = (r->p[r->pos >> 3] >> (r->pos & 7)) & 1u;
  ++r->pos;
  return 1;
}

/* omega-decode into *k; 0 on overrun or a value above 2^40 (never valid here) */
QSGD_HD int qsgd_read_omega(qsgd_bit_reader* r, uint64_t* k) {
  uint64_t n = 1;
  for (;;) {
    uint32_t b;
    if (!qsgd_read_bit(r, &b)) return 0;
    if (!b) {
      *k = n;
      return 1;
    }
    if (n > 40) return 0;
    uint64_t v = 1;
    for (uint64_t i = 0; i < n; ++i) {
      if (!qsgd_read_bit(r, &b)) return 0;
      v = (v << 1) | b;
    }
    n = v;
  }
}

/* Parse one segment of an Elias stream: its nbytes bytes at `stream` hold buckets b0 .. b1-1 of a
 * tensor of numel elements in buckets of B (scales: the payload's bucket scales). When acc is not
 * null, acc[k] += the decoded element b0 * B + k (a bucket whose scale is not finite adds the
 * non-finite value to all its elements). The CPU and CUDA decoders both parse with this, one
 * segment per thread. Returns QSGD_OK, QSGD_E_STREAM (a malformed or overrun stream, or one that
 * does not end in its last byte) or QSGD_E_PADDING (that byte's unused bits not zero). */
QSGD_HD int32_t qsgd_elias_parse_segment(const uint8_t* stream, uint64_t nbytes, const uint8_t* scales, uint64_t b0,
                                         uint64_t b1, uint64_t numel, uint64_t B, int bits, float* acc) {
  qsgd_bit_reader r = {stream, 0, 8 * nbytes};
  const float s = (float)qsgd_levels_of(bits);
  for (uint64_t b = b0; b < b1; ++b) {
    const uint64_t lo = b * B, len = (numel < lo + B ? numel : lo + B) - lo;
    float* bacc = acc ? acc + (lo - b0 * B) : 0;
    const float step = qsgd_step_of(qsgd_u2f((uint32_t)qsgd_load_le(scales + 4 * b, 4)), s);
    if (bacc && !(step - step == 0.0f)) /* non-finite scale: every element decodes non-finite */
      for (uint64_t k = 0; k < len; ++k) bacc[k] += qsgd_dequantize(0, step, bits);
    uint64_t cnt1;
    if (!qsgd_read_omega(&r, &cnt1) || cnt1 - 1 > len) return QSGD_E_STREAM;
    int64_t prev = -1;
    for (uint64_t j = 0; j + 1 < cnt1; ++j) {
      uint64_t gap, level;
      uint32_t sign;
      if (!qsgd_read_omega(&r, &gap) || gap > len) return QSGD_E_STREAM;
      const int64_t idx = prev + (int64_t)gap;
      if (idx >= (int64_t)len || !qsgd_read_bit(&r, &sign) || !qsgd_read_omega(&r, &level) || level > (uint64_t)s)
        return QSGD_E_STREAM;
      if (bacc) bacc[idx] += qsgd_dequantize((sign << (bits - 1)) | (uint32_t)level, step, bits);
      prev = idx;
    }
  }
  /* the stream must end in its last byte, and the rest of that byte must be zero */
  if ((r.pos + 7) / 8 != nbytes) return QSGD_E_STREAM;
  for (uint64_t q = r.pos; q < r.nbits; ++q)
    if ((stream[q >> 3] >> (q & 7)) & 1u) return QSGD_E_PADDING;
  return QSGD_OK;
}

/* ---- the seeds and chunks of the scatter_allgather reduction (hvd_qsgd/reduction.py) -------------
 * step seed:  SplitMix64 of base + (occurrence + 1) * G, which is qsgd_mix64 of that sum;
 * chunk seed: the step seed's occurrence 2j + phase (phase 0: a rank's share, 1: the reduced chunk);
 * chunk j of n: the whole buckets floor(j * nb / n) .. floor((j + 1) * nb / n) - 1, nb the bucket count,
 * as elements clamped to numel (computed in 128 bits: nb * n never overflows). Host code of both
 * libraries (the CUDA library launches per chunk). */
QSGD_HD uint64_t qsgd_seed_of_occurrence(uint64_t base, uint64_t occurrence) {
  return qsgd_mix64(base + (occurrence + 1) * QSGD_GOLDEN64);
}
QSGD_HD uint64_t qsgd_seed_of_chunk(uint64_t step_seed, int32_t j, int32_t phase) {
  return qsgd_seed_of_occurrence(step_seed, 2 * (uint64_t)(uint32_t)j + (phase ? 1u : 0u));
}
static inline int32_t qsgd_chunk_bounds(uint64_t numel, uint32_t bucket_size, int32_t n, int32_t j, uint64_t* begin,
                                        uint64_t* end) {
  if (bucket_size == 0 || bucket_size > QSGD_MAX_BUCKET || n < 1 || j < 0 || j >= n || !begin || !end)
    return QSGD_E_ARG;
  const unsigned __int128 nb = (numel + bucket_size - 1) / bucket_size;
  const uint64_t b0 = (uint64_t)(nb * (unsigned)j / (unsigned)n);
  const uint64_t b1 = (uint64_t)(nb * (unsigned)(j + 1) / (unsigned)n);
  const uint64_t e0 = b0 * bucket_size, e1 = b1 * bucket_size;
  *begin = e0 < numel ? e0 : numel;
  *end = e1 < numel ? e1 : numel;
  return QSGD_OK;
}

/* Write the 56-byte header (checksum field zero). */
QSGD_HD void qsgd_write_header(uint8_t* out, const qsgd_config* cfg, uint64_t numel,
                               uint64_t payload_len, uint32_t segment_buckets) {
  qsgd_store_le(out + 0, QSGD_MAGIC, 4);
  out[4] = QSGD_WIRE_VERSION;
  out[5] = (uint8_t)cfg->coding;
  out[6] = (uint8_t)cfg->bits;
  out[7] = (uint8_t)cfg->norm;
  out[8] = (uint8_t)cfg->dtype;
  out[9] = (uint8_t)cfg->flags;
  qsgd_store_le(out + 10, 0, 2);
  qsgd_store_le(out + 12, cfg->bucket_size, 4);
  qsgd_store_le(out + 16, numel, 8);
  qsgd_store_le(out + 24, payload_len, 8);
  qsgd_store_le(out + 32, cfg->fingerprint, 8);
  qsgd_store_le(out + 40, segment_buckets, 4);
  qsgd_store_le(out + 44, 0, 4);
  qsgd_store_le(out + 48, 0, 8);
}

/* A fixed-coding payload's header (the QSGD_HEADER_BYTES at p) against the header its decoder expects
 * (want: qsgd_decode_sum_cuda with d_heads), every field but flags and checksum, which are each payload's
 * own: QSGD_OK, or QSGD_E_MAGIC, QSGD_E_VERSION, QSGD_E_HEADER (a flag, reserved or segment field
 * that no fixed-coding header has), QSGD_E_MISMATCH (another coding, bits, norm, dtype, bucket size,
 * numel or fingerprint), QSGD_E_LENGTH (another length). */
QSGD_HD int32_t qsgd_header_against(const uint8_t* p, const qsgd_header* want) {
  if ((uint32_t)qsgd_load_le(p, 4) != QSGD_MAGIC) return QSGD_E_MAGIC;
  if (p[4] != QSGD_WIRE_VERSION) return QSGD_E_VERSION;
  if ((p[9] & ~(QSGD_FLAG_CHECKSUM | QSGD_FLAG_ENCODER2)) || qsgd_load_le(p + 10, 2) || qsgd_load_le(p + 40, 8))
    return QSGD_E_HEADER;
  if (p[5] != want->coding || p[6] != want->bits || p[7] != want->norm || p[8] != want->dtype ||
      (uint32_t)qsgd_load_le(p + 12, 4) != want->bucket_size || qsgd_load_le(p + 16, 8) != want->numel ||
      qsgd_load_le(p + 32, 8) != want->fingerprint)
    return QSGD_E_MISMATCH;
  if (qsgd_load_le(p + 24, 8) != want->payload_len) return QSGD_E_LENGTH;
  return QSGD_OK;
}

/* The combinations of bits, coding and norm the format defines, beyond each field's own range:
 * the Elias coding needs bits >= 2 (QSGD(1) has no zero level to skip), the sign norm bits == 1
 * and the fixed coding. Configs (qsgd_check_config) and headers (qsgd_parse_header) both obey it. */
QSGD_HD int qsgd_combination_ok(int32_t bits, int32_t coding, int32_t norm) {
  if (coding == QSGD_CODING_ELIAS && bits < 2) return 0;
  if (norm == QSGD_NORM_SIGN && (bits != 1 || coding != QSGD_CODING_FIXED)) return 0;
  return 1;
}

/* Check an encoder configuration. */
QSGD_HD int32_t qsgd_check_config(const qsgd_config* cfg) {
  if (!cfg) return QSGD_E_ARG;
  if (cfg->bits < 1 || cfg->bits > 8) return QSGD_E_ARG;
  if (cfg->bucket_size < 1 || cfg->bucket_size > QSGD_MAX_BUCKET) return QSGD_E_ARG;
  if (cfg->norm != QSGD_NORM_MAX && cfg->norm != QSGD_NORM_L2 && cfg->norm != QSGD_NORM_SIGN)
    return QSGD_E_ARG;
  if (cfg->coding != QSGD_CODING_FIXED && cfg->coding != QSGD_CODING_ELIAS) return QSGD_E_ARG;
  if (!qsgd_combination_ok(cfg->bits, cfg->coding, cfg->norm)) return QSGD_E_ARG;
  if (cfg->dtype < QSGD_DTYPE_F32 || cfg->dtype > QSGD_DTYPE_BF16) return QSGD_E_ARG;
  if (cfg->flags & ~(uint32_t)(QSGD_FLAG_CHECKSUM | QSGD_FLAG_ENCODER2)) return QSGD_E_ARG;
  return QSGD_OK;
}

#endif /* HVD_QSGD_MATH_H_ */
