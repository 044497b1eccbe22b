/*
 * The CPU codec's per-element loops -- bucket scale, quantizer, bit packing, unpacking with
 * dequantize-and-add, the decode's final scaling, the checksum terms -- compiled once per
 * instruction-set variant and chosen at run time (qsgd_cpu.cc: qsgd_cpu::active_kernels).
 *
 * The build compiles this file once per variant, each time with that variant's -march and
 * -DQSGD_ISA=<name> (setup.py: ISA_VARIANTS); QSGD_ISA names the namespace and the table
 * qsgd_cpu::kernels_<name>, so the copies never collide. Every variant computes the same bytes and
 * the same sums: the math is qsgd_math.h's, in the same IEEE single operations in the same order
 * (no FMA contraction, no reassociation), so the compiler's vector code, the hand-written AVX2 code
 * below and the scalar code agree bit for bit (tests/test_cpu_isa.py compares every variant the
 * machine can run against the baseline one).
 *
 *   baseline  -march=x86-64 (SSE2): the C++ loops, vectorised by the compiler where it can;
 *   sse4      -march=x86-64-v2: the same, with SSE4.1's 32-bit multiply for the hash (1.5-1.9x the
 *             baseline's encode);
 *   avx2      -march=x86-64-v3: the same loops plus hand-written AVX2 for the hot ones (the
 *             quantizer with its counter hash 8 lanes wide in 32-bit multiplies, the packing of
 *             byte codes into bits, the fused unpack-dequantize-add), and for encoder version 2
 *             the quantizer and the packing in one pass (quantize_packed);
 *   avx512    -march=x86-64-v4: the avx2 variant's loops (compiled for AVX-512) plus 16-lane loops
 *             for encoder version 2's hash and quantizer, and its quantize-and-pack 64 elements a
 *             pass (quantize_packed64);
 *   generic   (other architectures) the C++ loops for the compiler's default target.
 */
#include <math.h>
#include <string.h>

#include <algorithm>

#include "qsgd.h"
#include "qsgd_cpu_internal.h"
#include "qsgd_math.h"

/* The hand-written AVX2 loops are the avx2 and the avx512 variants'; the avx512 variant adds its own
 * 16-lane loops for encoder version 2 (the staged quantizer, and the one-pass quantize-and-pack).
 * `python -m benchmarks kernels --isa all` times every variant side by side. */
#if defined(__AVX2__)
#define QSGD_HAND_AVX2 1
#include <immintrin.h>
#else
#define QSGD_HAND_AVX2 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QSGD_HAND_AVX512 1
/* gcc 12's AVX-512 intrinsics pass an undefined vector as the unused merge source of their masked
 * builtins, which -Wmaybe-uninitialized reports at every use: a known false positive */
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#else
#define QSGD_HAND_AVX512 0
#endif

#ifndef QSGD_ISA
#error "compile with -DQSGD_ISA=<variant name> (setup.py does)"
#endif
#define QSGD_STR2(x) #x
#define QSGD_STR(x) QSGD_STR2(x)
#define QSGD_CAT2(a, b) a##b
#define QSGD_CAT(a, b) QSGD_CAT2(a, b)

namespace qsgd_cpu {
namespace QSGD_ISA {
namespace {

/* ---- bucket scale ---------------------------------------------------------------------------- */
/* The folded lane sum of qsgd_lane_term over a bucket (qsgd_math.h: 32 lanes, lane j holding
 * elements j, j+32, ... in order, folded j += j+16, 8, 4, 2, 1). */
template <int NORM>
double lane_sum(const float* x, uint64_t n) {
  double lane[QSGD_L2_LANES] = {0};
  const uint64_t full = n / QSGD_L2_LANES;
  for (uint64_t r = 0; r < full; ++r) {
    const float* p = x + r * QSGD_L2_LANES;
    for (int j = 0; j < QSGD_L2_LANES; ++j) lane[j] += qsgd_lane_term(p[j], NORM);
  }
  const float* p = x + full * QSGD_L2_LANES;
  for (uint64_t j = 0; j < n % QSGD_L2_LANES; ++j) lane[j] += qsgd_lane_term(p[j], NORM);
  for (int off = QSGD_L2_LANES / 2; off > 0; off /= 2)
    for (int j = 0; j < off; ++j) lane[j] = lane[j] + lane[j + off];
  return lane[0];
}

/* The largest (bits(x) & 0x7fffffff) of the bucket: the bit pattern of its largest |x|. */
uint32_t absmax_bits(const float* x, uint64_t n) {
  uint32_t m = 0;
  uint64_t k = 0;
#if QSGD_HAND_AVX2
  __m256i v0 = _mm256_setzero_si256(), v1 = v0;
  const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
  for (; k + 16 <= n; k += 16) {
    v0 = _mm256_max_epu32(v0, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + k)), mask));
    v1 = _mm256_max_epu32(v1, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + k + 8)), mask));
  }
  v0 = _mm256_max_epu32(v0, v1);
  __m128i h = _mm_max_epu32(_mm256_castsi256_si128(v0), _mm256_extracti128_si256(v0, 1));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xB1));
  m = (uint32_t)_mm_cvtsi128_si32(h);
#endif
  for (; k < n; ++k) m = std::max(m, qsgd_f2u(x[k]) & 0x7FFFFFFFu);
  return m;
}

float bucket_scale(const float* x, uint64_t n, int norm) {
  const uint32_t m = absmax_bits(x, n);
  if (norm == QSGD_NORM_MAX) return qsgd_scale_from_absmax_bits(m);
  if (norm == QSGD_NORM_SIGN) return qsgd_scale_from_l1(lane_sum<QSGD_NORM_SIGN>(x, n), n, m);
  return qsgd_scale_from_sumsq(lane_sum<QSGD_NORM_L2>(x, n), m);
}

/* ---- the quantizer ------------------------------------------------------------------------------ */
#if QSGD_HAND_AVX2
/* x >> 16 and x >> 8 in each 32-bit lane, as byte shuffles: they run on other execution ports
 * than the vector shifts and multiplies, which the hash has enough of */
inline __m256i srl16(__m256i x) {
  return _mm256_shuffle_epi8(x, _mm256_setr_epi8(2, 3, -1, -1, 6, 7, -1, -1, 10, 11, -1, -1, 14, 15, -1, -1,
                                                 2, 3, -1, -1, 6, 7, -1, -1, 10, 11, -1, -1, 14, 15, -1, -1));
}
inline __m256i srl8(__m256i x) {
  return _mm256_shuffle_epi8(x, _mm256_setr_epi8(1, 2, 3, -1, 5, 6, 7, -1, 9, 10, 11, -1, 13, 14, 15, -1,
                                                 1, 2, 3, -1, 5, 6, 7, -1, 9, 10, 11, -1, 13, 14, 15, -1));
}

/* qsgd_hash32 on 8 lanes */
inline __m256i hash32x8(__m256i x) {
  x = _mm256_xor_si256(x, srl16(x));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846CA68Bu));
  x = _mm256_xor_si256(x, srl16(x));
  return x;
}

/* qsgd_triple32 on 8 lanes */
inline __m256i triple32x8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 17));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0xED5AD4BBu));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 11));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0xAC4C1B51u));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x31848BABu));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 14));
  return x;
}

/* (float)qsgd_u24(key, idx) on 8 lanes (exact: u24 < 2^24) */
inline __m256 u24x8(__m256i idx, __m256i key_lo, __m256i key_hi) {
  __m256i y = hash32x8(_mm256_xor_si256(idx, key_lo));
  y = hash32x8(_mm256_add_epi32(y, key_hi));
  return _mm256_cvtepi32_ps(srl8(y));
}

/* qsgd_quantize on 8 lanes: the code in each 32-bit lane, the same operations in the same order */
template <int BITS>
inline __m256i quantize8(__m256 x, __m256 scale, __m256 s, __m256 r) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 two24 = _mm256_set1_ps(16777216.0f);
  if (BITS == 1) {
    const __m256 half = _mm256_set1_ps(0.5f);
    const __m256 p = _mm256_add_ps(half, _mm256_mul_ps(half, _mm256_div_ps(x, scale)));
    const __m256 positive = _mm256_cmp_ps(r, _mm256_mul_ps(p, two24), _CMP_LT_OQ);
    return _mm256_andnot_si256(_mm256_castps_si256(positive), _mm256_set1_epi32(1));
  }
  /* |x| as (x < 0 ? -x : x): the two differ only for -0, where both quantize to level 0 */
  const __m256 ax = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  __m256 t = _mm256_mul_ps(_mm256_div_ps(ax, scale), s);
  t = _mm256_min_ps(t, s); /* t < s ? t : s */
  __m256i l = _mm256_cvttps_epi32(t);
  const __m256 frac = _mm256_sub_ps(t, _mm256_cvtepi32_ps(l));
  const __m256 up = _mm256_cmp_ps(r, _mm256_mul_ps(frac, two24), _CMP_LT_OQ);
  l = _mm256_sub_epi32(l, _mm256_castps_si256(up)); /* + 1 where up (all ones = -1) */
  const __m256i xneg = _mm256_castps_si256(_mm256_cmp_ps(x, zero, _CMP_LT_OQ));
  const __m256i neg = _mm256_andnot_si256(_mm256_cmpeq_epi32(l, _mm256_setzero_si256()), xneg);
  return _mm256_or_si256(l, _mm256_and_si256(neg, _mm256_set1_epi32(1 << (BITS - 1))));
}

/* Encoder 2's quantizer on 8 lanes (qsgd_quantize2): the same operations in the same order; the
 * multiplication by pre is done always (by 1 it is exact). cap = s * 2^16, u the uniforms (int32). */
template <int BITS>
inline __m256i quantize8_v2(__m256 x, __m256 pre, __m256 rq, __m256 cap, __m256i u) {
  const __m256i rbits = _mm256_set1_epi32((int)QSGD_V2_ROUND_BITS);
  if (BITS == 1) {
    const __m256 p = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(x, pre), rq), _mm256_set1_ps(QSGD_V2_ROUND_HALF));
    const __m256i t = _mm256_sub_epi32(_mm256_castps_si256(p), rbits);
    return _mm256_andnot_si256(_mm256_cmpgt_epi32(t, u), _mm256_set1_epi32(1)); /* u < T: 0 */
  }
  const __m256 ax = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  const __m256 t = _mm256_min_ps(_mm256_mul_ps(_mm256_mul_ps(ax, pre), rq), cap);
  const __m256i r = _mm256_castps_si256(_mm256_add_ps(t, _mm256_set1_ps(QSGD_V2_ROUND)));
  const __m256i l = _mm256_srli_epi32(_mm256_add_epi32(_mm256_sub_epi32(r, rbits), u), 16);
  /* the sign bit where x < 0 (its bit pattern's sign: -0 has l == 0) and l != 0 */
  const __m256i xneg = _mm256_srai_epi32(_mm256_castps_si256(x), 31);
  const __m256i neg = _mm256_andnot_si256(_mm256_cmpeq_epi32(l, _mm256_setzero_si256()), xneg);
  return _mm256_or_si256(l, _mm256_and_si256(neg, _mm256_set1_epi32(1 << (BITS - 1))));
}

#if QSGD_HAND_AVX512
/* qsgd_triple32 on 16 lanes */
inline __m512i triple32x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 17));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0xED5AD4BBu));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 11));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0xAC4C1B51u));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x31848BABu));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 14));
  return x;
}

/* The 16 pairs (32 elements) from pair p0 on in the avx512 loops' lane order: lanes 4b..4b+3 of
 * 128-bit block b hold pairs 2b, 2b+1, 8+2b, 9+2b, so that interleaving each block's 16-bit halves
 * gives elements 0..15 (low halves of lanes 4b, 4b+1) and 16..31 (high: lanes 4b+2, 4b+3) in
 * element order */
inline __m512i pairs16(uint32_t p0) {
  return _mm512_add_epi32(_mm512_set1_epi32((int)p0),
                          _mm512_setr_epi32(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
}

/* qsgd_pair_hash on 16 lanes of pairs (key_lo, key_hi: the key's halves in every lane) */
inline __m512i pair_hash16(__m512i pair, __m512i key_lo, __m512i key_hi) {
  return triple32x16(_mm512_add_epi32(_mm512_xor_si512(pair, key_lo), key_hi));
}

/* Encoder 2's quantizer on 16 lanes, as quantize8_v2 */
template <int BITS>
inline __m512i quantize16_v2(__m512 x, __m512 pre, __m512 rq, __m512 cap, __m512i u) {
  const __m512i rbits = _mm512_set1_epi32((int)QSGD_V2_ROUND_BITS);
  if (BITS == 1) {
    const __m512 p = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(x, pre), rq), _mm512_set1_ps(QSGD_V2_ROUND_HALF));
    const __mmask16 positive = _mm512_cmplt_epi32_mask(u, _mm512_sub_epi32(_mm512_castps_si512(p), rbits));
    return _mm512_maskz_mov_epi32((__mmask16)~positive, _mm512_set1_epi32(1));
  }
  const __m512 ax = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
  const __m512 t = _mm512_min_ps(_mm512_mul_ps(_mm512_mul_ps(ax, pre), rq), cap);
  const __m512i r = _mm512_castps_si512(_mm512_add_ps(t, _mm512_set1_ps(QSGD_V2_ROUND)));
  const __m512i l = _mm512_srli_epi32(_mm512_add_epi32(_mm512_sub_epi32(r, rbits), u), 16);
  /* the sign bit where x's sign bit is set (-0 has l == 0) and l != 0 */
  const __mmask16 neg = _mm512_mask_test_epi32_mask(_mm512_movepi32_mask(_mm512_castps_si512(x)), l, l);
  return _mm512_mask_or_epi32(l, neg, l, _mm512_set1_epi32(1 << (BITS - 1)));
}
#endif

/* four vectors of 8 codes (32-bit lanes, values < 256) -> 32 bytes in element order */
inline __m256i codes_to_bytes(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  const __m256i a = _mm256_packus_epi32(c0, c1);
  const __m256i b = _mm256_packus_epi32(c2, c3);
  const __m256i p = _mm256_packus_epi16(a, b);
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

template <int BITS>
void quantize_page(const float* __restrict x, uint64_t n, uint64_t key, uint32_t lo, float scale,
                   uint8_t* __restrict codes) {
  const float s = (float)qsgd_levels_of(BITS);
  uint64_t k = 0;
#if QSGD_HAND_AVX2
  const __m256i key_lo = _mm256_set1_epi32((int)(uint32_t)key);
  const __m256i key_hi = _mm256_set1_epi32((int)(uint32_t)(key >> 32));
  const __m256 vscale = _mm256_set1_ps(scale), vs = _mm256_set1_ps(s);
  const __m256i step8 = _mm256_set1_epi32(8);
  __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)lo), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (; k + 32 <= n; k += 32) {
    __m256i c[4];
    for (int v = 0; v < 4; ++v) {
      const __m256 r = u24x8(idx, key_lo, key_hi);
      c[v] = quantize8<BITS>(_mm256_loadu_ps(x + k + 8 * v), vscale, vs, r);
      idx = _mm256_add_epi32(idx, step8);
    }
    _mm256_storeu_si256((__m256i*)(codes + k), codes_to_bytes(c[0], c[1], c[2], c[3]));
  }
#endif
  for (; k < n; ++k)
    codes[k] = (uint8_t)qsgd_quantize(x[k], scale, s, qsgd_u24(key, lo + (uint32_t)k), BITS);
}

/* Encoder 2: one hash per pair of elements (qsgd_pair_hash, triple32), its low half for the even
 * element and its high half for the odd one. The AVX2 loop hashes 16 pairs (32 elements) as two vectors of 8
 * whose lanes hold the pairs 0, 1, 4, 5 | 2, 3, 6, 7 of each 8, so that interleaving each vector's
 * 16-bit halves with zeros (within the 128-bit halves, as unpack does) puts the uniforms of elements
 * 0..7 in one vector and 8..15 in the other, in element order. */
template <int BITS>
void quantize_page_v2(const float* __restrict x, uint64_t n, uint64_t key, uint32_t lo, float scale,
                      uint8_t* __restrict codes) {
  const float s = (float)qsgd_levels_of(BITS);
  const float pre = qsgd_v2_pre(scale), rq = qsgd_v2_recip(scale, pre, s, BITS);
  uint64_t k = 0;
  if (n && (lo & 1u)) { /* an odd first element: the high half of its pair's hash */
    codes[0] = (uint8_t)qsgd_quantize2(x[0], pre, rq, s, qsgd_u16(key, lo), BITS);
    k = 1;
  }
#if QSGD_HAND_AVX512
  {
    /* 16 pairs (32 elements) a vector, in pairs16's lane order; their halves interleaved with zeros */
    const __m512i key_lo = _mm512_set1_epi32((int)(uint32_t)key);
    const __m512i key_hi = _mm512_set1_epi32((int)(uint32_t)(key >> 32));
    const __m512 vpre = _mm512_set1_ps(pre), vrq = _mm512_set1_ps(rq), vcap = _mm512_set1_ps(s * 65536.0f);
    const __m512i zero = _mm512_setzero_si512();
    __m512i pair = pairs16((lo + (uint32_t)k) >> 1);
    const __m512i step16 = _mm512_set1_epi32(16);
    for (; k + 32 <= n; k += 32) {
      const __m512i y = pair_hash16(pair, key_lo, key_hi);
      pair = _mm512_add_epi32(pair, step16);
      const __m512i c0 = quantize16_v2<BITS>(_mm512_loadu_ps(x + k), vpre, vrq, vcap, _mm512_unpacklo_epi16(y, zero));
      const __m512i c1 = quantize16_v2<BITS>(_mm512_loadu_ps(x + k + 16), vpre, vrq, vcap,
                                             _mm512_unpackhi_epi16(y, zero));
      _mm_storeu_si128((__m128i*)(codes + k), _mm512_cvtepi32_epi8(c0));
      _mm_storeu_si128((__m128i*)(codes + k + 16), _mm512_cvtepi32_epi8(c1));
    }
  }
#endif
#if QSGD_HAND_AVX2
  const __m256i key_lo = _mm256_set1_epi32((int)(uint32_t)key);
  const __m256i key_hi = _mm256_set1_epi32((int)(uint32_t)(key >> 32));
  const __m256 vpre = _mm256_set1_ps(pre), vrq = _mm256_set1_ps(rq), vcap = _mm256_set1_ps(s * 65536.0f);
  const __m256i zero = _mm256_setzero_si256();
  __m256i pair = _mm256_add_epi32(_mm256_set1_epi32((int)((lo + (uint32_t)k) >> 1)),
                                  _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
  const __m256i step8 = _mm256_set1_epi32(8);
  for (; k + 32 <= n; k += 32) {
    __m256i c[4];
    for (int h = 0; h < 2; ++h) {
      const __m256i y = triple32x8(_mm256_add_epi32(_mm256_xor_si256(pair, key_lo), key_hi));
      pair = _mm256_add_epi32(pair, step8);
      c[2 * h] = quantize8_v2<BITS>(_mm256_loadu_ps(x + k + 16 * h), vpre, vrq, vcap, _mm256_unpacklo_epi16(y, zero));
      c[2 * h + 1] = quantize8_v2<BITS>(_mm256_loadu_ps(x + k + 16 * h + 8), vpre, vrq, vcap,
                                        _mm256_unpackhi_epi16(y, zero));
    }
    _mm256_storeu_si256((__m256i*)(codes + k), codes_to_bytes(c[0], c[1], c[2], c[3]));
  }
#endif
  /* blocks of 2 * kPairs elements: the pairs' hashes first (a loop the compiler vectorizes), then
   * the quantizer reading them as 16-bit halves -- little-endian, so half k is element k's u16 */
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "u16 halves read in memory order");
  constexpr uint64_t kPairs = 64;
  uint32_t y[kPairs];
  const uint32_t klo = (uint32_t)key, khi = (uint32_t)(key >> 32);
  for (; k + 2 * kPairs <= n; k += 2 * kPairs) {
    const uint32_t p0 = (lo + (uint32_t)k) >> 1;
    for (uint32_t j = 0; j < kPairs; ++j) y[j] = qsgd_pair_hash_of(p0 + j, klo, khi);
    uint16_t u[2 * kPairs];
    memcpy(u, y, sizeof(y));
    for (uint64_t j = 0; j < 2 * kPairs; ++j) codes[k + j] = (uint8_t)qsgd_quantize2(x[k + j], pre, rq, s, u[j], BITS);
  }
  for (; k + 2 <= n; k += 2) {
    const uint32_t h = qsgd_pair_hash(key, lo + (uint32_t)k);
    codes[k] = (uint8_t)qsgd_quantize2(x[k], pre, rq, s, h & 0xFFFFu, BITS);
    codes[k + 1] = (uint8_t)qsgd_quantize2(x[k + 1], pre, rq, s, h >> 16, BITS);
  }
  if (k < n) codes[k] = (uint8_t)qsgd_quantize2(x[k], pre, rq, s, qsgd_u16(key, lo + (uint32_t)k), BITS);
}

void quantize(const float* x, uint64_t n, uint64_t key, uint32_t lo, float scale, int bits, int encoder,
              uint8_t* codes) {
  if (encoder == 2)
    dispatch_bits(bits, [&](auto b) { quantize_page_v2<b.value>(x, n, key, lo, scale, codes); });
  else
    dispatch_bits(bits, [&](auto b) { quantize_page<b.value>(x, n, key, lo, scale, codes); });
}

void sign(const float* __restrict x, uint64_t n, uint8_t* __restrict codes) {
  for (uint64_t k = 0; k < n; ++k) codes[k] = (uint8_t)qsgd_sign_code(x[k]);
}

/* ---- packing: m codes -> qsgd_packed_bytes(m, BITS) bytes, code j of a group of 8 at bit j*BITS */
template <int BITS>
void pack_scalar(const uint8_t* __restrict codes, uint64_t m, uint8_t* __restrict dst) {
  const uint64_t groups = m / 8;
  if (BITS == 8) {
    memcpy(dst, codes, m);
    return;
  } else if (BITS == 4 || BITS == 2 || BITS == 1) {
    const int per = 8 / BITS;
    const uint64_t nbytes = m / per;
    for (uint64_t k = 0; k < nbytes; ++k) {
      uint32_t v = 0;
      for (int j = 0; j < per; ++j) v |= (uint32_t)codes[k * per + j] << (j * BITS);
      dst[k] = (uint8_t)v;
    }
    const uint64_t rem = m - nbytes * per;
    if (rem) {
      uint32_t v = 0;
      for (uint64_t j = 0; j < rem; ++j) v |= (uint32_t)codes[nbytes * per + j] << (j * BITS);
      dst[nbytes] = (uint8_t)v;
    }
    return;
  }
  for (uint64_t g = 0; g < groups; ++g) {
    uint64_t v = 0;
    for (int j = 0; j < 8; ++j) v |= (uint64_t)codes[8 * g + j] << (j * BITS);
    qsgd_store_le(dst + g * BITS, v, BITS);
  }
  const uint64_t rem = m % 8;
  if (rem) {
    uint64_t v = 0;
    for (uint64_t j = 0; j < rem; ++j) v |= (uint64_t)codes[8 * groups + j] << (j * BITS);
    qsgd_store_le(dst + groups * BITS, v, (int)((rem * BITS + 7) / 8));
  }
}

#if QSGD_HAND_AVX2
/* 32 byte codes of BITS bits each -> each 64-bit lane holds its 8 codes' 8*BITS bits at its low
 * end (code j of the lane at bit j*BITS): merge neighbours in 16-, 32-, then 64-bit lanes. */
template <int BITS>
inline __m256i merge_codes(__m256i v) {
  const __m256i lo16 = _mm256_and_si256(v, _mm256_set1_epi16(0x00FF));
  v = _mm256_or_si256(lo16, _mm256_slli_epi16(_mm256_srli_epi16(v, 8), BITS));
  const __m256i lo32 = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
  v = _mm256_or_si256(lo32, _mm256_slli_epi32(_mm256_srli_epi32(v, 16), 2 * BITS));
  const __m256i lo64 = _mm256_and_si256(v, _mm256_set1_epi64x(0xFFFFFFFFll));
  return _mm256_or_si256(lo64, _mm256_slli_epi64(_mm256_srli_epi64(v, 32), 4 * BITS));
}

/* merge_codes' result with, in each 128-bit half, the low BITS bytes of both 64-bit lanes side by
 * side: 2 * BITS packed bytes a half */
template <int BITS>
struct MergeSelect {
  alignas(32) int8_t v[32];
  constexpr MergeSelect() : v() {
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 16; ++j) v[16 * h + j] = (int8_t)(j < BITS ? j : (j < 2 * BITS ? 8 + j - BITS : -1));
  }
};
template <int BITS>
inline constexpr MergeSelect<BITS> kMergeSelect{};   /* (built at compile time) */

template <int BITS>
inline __m256i merged_halves(__m256i codes) {
  return _mm256_shuffle_epi8(merge_codes<BITS>(codes), _mm256_load_si256((const __m256i*)kMergeSelect<BITS>.v));
}
#endif

template <int BITS>
void pack_t(const uint8_t* __restrict codes, uint64_t m, uint8_t* __restrict dst) {
#if QSGD_HAND_AVX2
  if (BITS != 8) {
    uint64_t k = 0;
    if (BITS == 1) {
      for (; k + 32 <= m; k += 32) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(codes + k));
        const uint32_t bitsv = (uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(v, 7));
        memcpy(dst + k / 8, &bitsv, 4);
      }
    } else {
      const uint64_t full_bytes = m / 8 * BITS;
      /* each block of 32 codes writes 4*BITS bytes, as two 16-byte stores at +0 and +2*BITS: a
       * store may run past the block but never past the m codes' bytes */
      for (; k + 32 <= m && k / 8 * BITS + 2 * BITS + 16 <= full_bytes; k += 32) {
        const __m256i v = merged_halves<BITS>(_mm256_loadu_si256((const __m256i*)(codes + k)));
        uint8_t* d = dst + k / 8 * BITS;
        if (BITS == 4) {
          _mm_storeu_si128((__m128i*)d, _mm256_castsi256_si128(_mm256_permute4x64_epi64(v, 0x08)));
        } else if (BITS == 2) {
          const __m256i q = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
          _mm_storel_epi64((__m128i*)d, _mm256_castsi256_si128(q));
        } else {
          _mm_storeu_si128((__m128i*)d, _mm256_castsi256_si128(v));
          _mm_storeu_si128((__m128i*)(d + 2 * BITS), _mm256_extracti128_si256(v, 1));
        }
      }
    }
    pack_scalar<BITS>(codes + k, m - k, dst + k / 8 * BITS);
    return;
  }
#endif
  pack_scalar<BITS>(codes, m, dst);
}

void pack(int bits, const uint8_t* codes, uint64_t m, uint8_t* dst) {
  dispatch_bits(bits, [&](auto b) { pack_t<b.value>(codes, m, dst); });
}

/* ---- encoder 2's quantizer and packing in one pass (the avx2 and avx512 variants) ----------
 * The packed codes of elements lo .. lo+n-1 of one page, written at dst (the payload's byte of element
 * lo; lo a multiple of 8): the bytes quantize (encoder 2) and pack would write, without staging the
 * byte codes. Per 32 elements: the levels as in quantize8_v2 (the multiplication by pre left out
 * where pre is 1, which is exact; the uniforms interleaved with 0xB500 instead of 0, which adds
 * 0xB5000000 = -QSGD_V2_ROUND_BITS mod 2^32 in the same instruction), narrowed to bytes; the sign
 * bits from x's own, narrowed the same way (signed saturation keeps the sign), set where the level
 * is not 0; then packed in registers. The last n mod 32 elements go through qsgd_quantize2 and
 * pack_scalar. The avx512 variant runs the same steps 64 elements a time on 16 lanes first
 * (quantize_packed64), the sign bits as mask registers. */
#if QSGD_HAND_AVX2
template <bool PRE>
inline __m256i level8_v2(const float* x, __m256 pre, __m256 rq, __m256 cap, __m256i u_minus_rbits) {
  __m256 ax = _mm256_and_ps(_mm256_loadu_ps(x), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  if (PRE) ax = _mm256_mul_ps(ax, pre);
  const __m256 t = _mm256_min_ps(_mm256_mul_ps(ax, rq), cap);
  const __m256i r = _mm256_castps_si256(_mm256_add_ps(t, _mm256_set1_ps(QSGD_V2_ROUND)));
  return _mm256_srli_epi32(_mm256_add_epi32(r, u_minus_rbits), 16);
}

/* 32 byte codes in element order -> their 4 * BITS packed bytes at d (as pack_t) */
template <int BITS>
inline void store_packed32(__m256i c, uint8_t* d) {
  if (BITS == 8) {
    _mm256_storeu_si256((__m256i*)d, c);
  } else if (BITS == 4) { /* byte k = c[2k] + 16 c[2k+1] */
    const __m256i m = _mm256_maddubs_epi16(c, _mm256_set1_epi16(0x1001));
    const __m256i b = _mm256_packus_epi16(m, m);
    _mm_storeu_si128((__m128i*)d, _mm256_castsi256_si128(_mm256_permute4x64_epi64(b, 0x08)));
  } else if (BITS == 2) { /* byte k = c[4k] + 4 c[4k+1] + 16 c[4k+2] + 64 c[4k+3] */
    const __m256i m = _mm256_madd_epi16(_mm256_maddubs_epi16(c, _mm256_set1_epi16(0x0401)), _mm256_set1_epi32(0x00100001));
    const __m256i w = _mm256_packus_epi32(m, m);
    const __m256i b = _mm256_packus_epi16(w, w);
    const __m256i q = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64((__m128i*)d, _mm256_castsi256_si128(q));
  } else { /* pack_t's merge: 2 * BITS bytes in each 128-bit half */
    const __m256i v = merged_halves<BITS>(c);
    alignas(32) uint8_t tmp[16 + 2 * BITS];
    _mm_storeu_si128((__m128i*)tmp, _mm256_castsi256_si128(v));
    _mm_storeu_si128((__m128i*)(tmp + 2 * BITS), _mm256_extracti128_si256(v, 1));
    memcpy(d, tmp, 4 * BITS);
  }
}

#if QSGD_HAND_AVX512
/* level8_v2 on 16 lanes; also x's lanes whose sign bit is set */
template <bool PRE>
inline __m512i level16_v2(const float* x, __m512 pre, __m512 rq, __m512 cap, __m512i u_minus_rbits, __mmask16* xneg) {
  const __m512i xi = _mm512_loadu_si512(x);
  *xneg = _mm512_movepi32_mask(xi);
  __m512 ax = _mm512_castsi512_ps(_mm512_and_si512(xi, _mm512_set1_epi32(0x7FFFFFFF)));
  if (PRE) ax = _mm512_mul_ps(ax, pre);
  const __m512 t = _mm512_min_ps(_mm512_mul_ps(ax, rq), cap);
  const __m512i r = _mm512_castps_si512(_mm512_add_ps(t, _mm512_set1_ps(QSGD_V2_ROUND)));
  return _mm512_srli_epi32(_mm512_add_epi32(r, u_minus_rbits), 16);
}

/* 64 byte codes in element order -> their 8 * BITS packed bytes at d (as pack_t) */
template <int BITS>
inline void store_packed64(__m512i c, uint8_t* d) {
  if (BITS == 8) {
    _mm512_storeu_si512(d, c);
  } else if (BITS == 4) { /* word k = c[2k] + 16 c[2k+1], narrowed to bytes in order */
    _mm256_storeu_si256((__m256i*)d, _mm512_cvtepi16_epi8(_mm512_maddubs_epi16(c, _mm512_set1_epi16(0x1001))));
  } else if (BITS == 2) { /* dword k = c[4k] + 4 c[4k+1] + 16 c[4k+2] + 64 c[4k+3] */
    const __m512i m = _mm512_madd_epi16(_mm512_maddubs_epi16(c, _mm512_set1_epi16(0x0401)), _mm512_set1_epi32(0x00100001));
    _mm_storeu_si128((__m128i*)d, _mm512_cvtepi32_epi8(m));
  } else {
    store_packed32<BITS>(_mm512_castsi512_si256(c), d);
    store_packed32<BITS>(_mm512_extracti64x4_epi64(c, 1), d + 4 * BITS);
  }
}

/* quantize_packed_t's steps 64 elements a time on 16 lanes: two hashes of 16 pairs (pairs16's lane
 * order, so unpacking a hash's 16-bit halves gives elements 0..15 and 16..31 in order); the four level vectors narrowed to bytes, whose dwords (4 elements each) come
 * out as level vector j's block b at dword 4b + j and are put back in element order by one
 * permutation; the sign bit added where x's sign bit is set and the level is not 0 (64 mask bits in
 * element order). Returns the elements done (n rounded down to 64). */
template <int BITS, bool PRE>
inline uint64_t quantize_packed64(const float* __restrict x, uint64_t n, uint64_t key, uint32_t lo, float pre,
                                  float rq, float s, uint8_t* __restrict dst) {
  const __m512i key_lo = _mm512_set1_epi32((int)(uint32_t)key);
  const __m512i key_hi = _mm512_set1_epi32((int)(uint32_t)(key >> 32));
  const __m512 vpre = _mm512_set1_ps(pre), vrq = _mm512_set1_ps(rq), vcap = _mm512_set1_ps(s * 65536.0f);
  const __m512i high = _mm512_set1_epi16((short)0xB500); /* (0xB500 << 16) + u = u - QSGD_V2_ROUND_BITS */
  const __m512i sign = _mm512_set1_epi8((char)(1 << (BITS - 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512i pair = pairs16(lo >> 1);
  const __m512i step16 = _mm512_set1_epi32(16);
  uint64_t k = 0;
  for (; k + 64 <= n; k += 64) {
    const float* xk = x + k;
    for (int line = 0; line < 4; ++line) _mm_prefetch((const char*)(xk + 1024 + 16 * line), _MM_HINT_T0);
    const __m512i y0 = pair_hash16(pair, key_lo, key_hi);
    const __m512i y1 = pair_hash16(_mm512_add_epi32(pair, step16), key_lo, key_hi);
    pair = _mm512_add_epi32(pair, _mm512_add_epi32(step16, step16));
    __mmask16 n0, n1, n2, n3;
    const __m512i l0 = level16_v2<PRE>(xk, vpre, vrq, vcap, _mm512_unpacklo_epi16(y0, high), &n0);
    const __m512i l1 = level16_v2<PRE>(xk + 16, vpre, vrq, vcap, _mm512_unpackhi_epi16(y0, high), &n1);
    const __m512i l2 = level16_v2<PRE>(xk + 32, vpre, vrq, vcap, _mm512_unpacklo_epi16(y1, high), &n2);
    const __m512i l3 = level16_v2<PRE>(xk + 48, vpre, vrq, vcap, _mm512_unpackhi_epi16(y1, high), &n3);
    const __m512i lv = _mm512_permutexvar_epi32(
        order, _mm512_packus_epi16(_mm512_packus_epi32(l0, l1), _mm512_packus_epi32(l2, l3)));
    const __mmask64 neg = _mm512_test_epi8_mask(lv, lv) &
                          ((uint64_t)n0 | (uint64_t)n1 << 16 | (uint64_t)n2 << 32 | (uint64_t)n3 << 48);
    store_packed64<BITS>(_mm512_mask_add_epi8(lv, neg, lv, sign), dst + k / 8 * BITS);
  }
  return k;
}
#endif

template <int BITS, bool PRE>
void quantize_packed_t(const float* __restrict x, uint64_t n, uint64_t key, uint32_t lo, float scale,
                       uint8_t* __restrict dst) {
  const float s = (float)qsgd_levels_of(BITS);
  const float pre = qsgd_v2_pre(scale), rq = qsgd_v2_recip(scale, pre, s, BITS);
  const __m256i key_lo = _mm256_set1_epi32((int)(uint32_t)key);
  const __m256i key_hi = _mm256_set1_epi32((int)(uint32_t)(key >> 32));
  const __m256 vpre = _mm256_set1_ps(pre), vrq = _mm256_set1_ps(rq), vcap = _mm256_set1_ps(s * 65536.0f);
  const __m256i high = _mm256_set1_epi16((short)0xB500); /* (0xB500 << 16) + u = u - QSGD_V2_ROUND_BITS */
  const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi8(1);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  /* pairs 0, 1, 4, 5 | 2, 3, 6, 7 of each 8 (quantize_page_v2) */
  uint64_t k = 0;
#if QSGD_HAND_AVX512
  k = quantize_packed64<BITS, PRE>(x, n, key, lo, pre, rq, s, dst);
#endif
  __m256i pair = _mm256_add_epi32(_mm256_set1_epi32((int)((lo + (uint32_t)k) >> 1)), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
  const __m256i step8 = _mm256_set1_epi32(8);
  for (; k + 32 <= n; k += 32) {
    const float* xk = x + k;
    /* x 1024 elements ahead (two cache lines per 32 elements), from this loop rather than a separate
     * one per bucket: measured 13-15% faster encode on an AVX2-only AMD EPYC (docs/performance.md);
     * a prefetch past the end of x does not fault */
    _mm_prefetch((const char*)(xk + 1024), _MM_HINT_T0);
    _mm_prefetch((const char*)(xk + 1040), _MM_HINT_T0);
    const __m256i y0 = triple32x8(_mm256_add_epi32(_mm256_xor_si256(pair, key_lo), key_hi));
    const __m256i y1 = triple32x8(_mm256_add_epi32(_mm256_xor_si256(_mm256_add_epi32(pair, step8), key_lo), key_hi));
    pair = _mm256_add_epi32(pair, _mm256_add_epi32(step8, step8));
    const __m256i l0 = level8_v2<PRE>(xk, vpre, vrq, vcap, _mm256_unpacklo_epi16(y0, high));
    const __m256i l1 = level8_v2<PRE>(xk + 8, vpre, vrq, vcap, _mm256_unpackhi_epi16(y0, high));
    const __m256i l2 = level8_v2<PRE>(xk + 16, vpre, vrq, vcap, _mm256_unpacklo_epi16(y1, high));
    const __m256i l3 = level8_v2<PRE>(xk + 24, vpre, vrq, vcap, _mm256_unpackhi_epi16(y1, high));
    /* levels and signs narrowed alike (before the one lane permutation) */
    const __m256i lv = _mm256_packus_epi16(_mm256_packus_epi32(l0, l1), _mm256_packus_epi32(l2, l3));
    const __m256i x0 = _mm256_loadu_si256((const __m256i*)xk), x1 = _mm256_loadu_si256((const __m256i*)(xk + 8));
    const __m256i x2 = _mm256_loadu_si256((const __m256i*)(xk + 16)), x3 = _mm256_loadu_si256((const __m256i*)(xk + 24));
    const __m256i sg = _mm256_packs_epi16(_mm256_packs_epi32(x0, x1), _mm256_packs_epi32(x2, x3));
    const __m256i neg = _mm256_and_si256(_mm256_cmpgt_epi8(zero, sg), _mm256_min_epu8(lv, one)); /* 1: x < 0, l > 0 */
    const __m256i codes = _mm256_or_si256(lv, _mm256_slli_epi16(neg, BITS - 1));
    store_packed32<BITS>(_mm256_permutevar8x32_epi32(codes, order), dst + k / 8 * BITS);
  }
  if (k < n) {
    uint8_t codes[32];
    for (uint64_t j = k; j < n; ++j)
      codes[j - k] = (uint8_t)qsgd_quantize2(x[j], pre, rq, s, qsgd_u16(key, lo + (uint32_t)j), BITS);
    pack_scalar<BITS>(codes, n - k, dst + k / 8 * BITS);
  }
}

void quantize_packed(const float* x, uint64_t n, uint64_t key, uint32_t lo, float scale, int bits, uint8_t* dst) {
  const bool pre = qsgd_v2_pre(scale) != 1.0f;
  dispatch_bits(bits, [&](auto b) {
    if constexpr (b.value >= 2) { /* (encode_fixed uses it for 2 to 8 bits) */
      if (pre) quantize_packed_t<b.value, true>(x, n, key, lo, scale, dst);
      else quantize_packed_t<b.value, false>(x, n, key, lo, scale, dst);
    }
  });
}
#define QSGD_QUANTIZE_PACKED QSGD_ISA::quantize_packed
#else
#define QSGD_QUANTIZE_PACKED nullptr
#endif

/* ---- unpacking: the inverse of pack ------------------------------------------------------------ */
template <int BITS>
void unpack_t(const uint8_t* __restrict src, uint64_t m, uint8_t* __restrict codes) {
  const uint32_t mask = (1u << BITS) - 1u;
  if (BITS == 8) {
    memcpy(codes, src, m);
    return;
  } else if (BITS == 4 || BITS == 2 || BITS == 1) {
    const int per = 8 / BITS;
    const uint64_t nbytes = m / per;
    for (uint64_t k = 0; k < nbytes; ++k)
      for (int j = 0; j < per; ++j) codes[k * per + j] = (uint8_t)((src[k] >> (j * BITS)) & mask);
    for (uint64_t j = 0; j < m - nbytes * per; ++j)
      codes[nbytes * per + j] = (uint8_t)((src[nbytes] >> (j * BITS)) & mask);
    return;
  }
  const uint64_t groups = m / 8;
  for (uint64_t g = 0; g < groups; ++g) {
    const uint64_t v = qsgd_load_le(src + g * BITS, BITS);
    for (int j = 0; j < 8; ++j) codes[8 * g + j] = (uint8_t)((v >> (j * BITS)) & mask);
  }
  const uint64_t rem = m % 8;
  if (rem) {
    const uint64_t v = qsgd_load_le(src + groups * BITS, (int)((rem * BITS + 7) / 8));
    for (uint64_t j = 0; j < rem; ++j) codes[8 * groups + j] = (uint8_t)((v >> (j * BITS)) & mask);
  }
}

template <int BITS>
void dequantize_add_t(const uint8_t* __restrict codes, uint64_t n, float step, float* __restrict acc) {
  for (uint64_t k = 0; k < n; ++k) acc[k] += qsgd_dequantize(codes[k], step, BITS);
}

#if QSGD_HAND_AVX2
/* qsgd_dequantize of 8 codes (32-bit lanes) */
template <int BITS>
inline __m256 dequantize8(__m256i code, __m256 step) {
  const __m256i level = BITS == 1 ? _mm256_set1_epi32(1)
                                  : _mm256_and_si256(code, _mm256_set1_epi32((1 << (BITS - 1)) - 1));
  const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(level), step);
  /* negation is the sign bit flipped */
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(code, BITS - 1), 31);
  return _mm256_xor_ps(v, _mm256_castsi256_ps(sign));
}

/* The 8 codes of BITS bits starting at byte p, one per 32-bit lane; reads 8 bytes at p. */
template <int BITS>
inline __m256i load_codes8(const uint8_t* p, __m256i gather, __m256i shifts) {
  const __m256i w = _mm256_broadcastsi128_si256(_mm_loadl_epi64((const __m128i*)p));
  const __m256i lanes = _mm256_srlv_epi32(_mm256_shuffle_epi8(w, gather), shifts);
  return _mm256_and_si256(lanes, _mm256_set1_epi32((1 << BITS) - 1));
}
#endif

/* out = alpha * acc, or out = out + alpha * acc */
void finish(float* __restrict out, const float* __restrict acc, uint64_t n, float alpha, int accumulate) {
  if (accumulate)
    for (uint64_t k = 0; k < n; ++k) out[k] = out[k] + alpha * acc[k];
  else
    for (uint64_t k = 0; k < n; ++k) out[k] = alpha * acc[k];
}

/* One payload's step of decode_sum over elements [lo, lo+n), fused: the sum runs in acc[0:n) from
 * 0.0f, payload after payload (qsgd.h), and each step does with the decoded value v of element k
 *   FIRST: s = 0 + v, else s = acc[k] + v;
 *   FIN == KEEP: acc[k] = s;  FIN == SET: out[k] = alpha * s;  FIN == ACCUMULATE: out[k] = out[k] + alpha * s
 *   FIN == STREAM: as SET, the values written with streaming stores (past the caches: out is
 *   16-byte aligned and larger than they hold, qsgd_set_stream_bytes)
 * -- the operations of "zero acc; acc += v for each payload; finish" in the same order, without the
 * passes that zero acc and finish it. */
enum { KEEP = FIN_KEEP, SET = FIN_SET, ACCUMULATE = FIN_ACCUMULATE, STREAM = FIN_STREAM };

template <int BITS, bool FIRST, int FIN>
void decode_t(const uint8_t* data, const uint8_t* data_end, const uint8_t* scales, uint64_t bucket,
              uint64_t lo, uint64_t n, uint8_t* codes, float* acc, float* out, float alpha) {
  const float s = (float)qsgd_levels_of(BITS);
#if QSGD_HAND_AVX2
  if (bucket % 8 == 0) {
    /* codes straight from the packed bytes into registers, 8 elements (BITS bytes) a time */
    alignas(32) int8_t g[32];
    alignas(32) int32_t sh[8];
    for (int j = 0; j < 8; ++j) {
      const int o = j * BITS / 8;
      for (int t = 0; t < 4; ++t) g[4 * j + t] = (int8_t)(o + t < 16 ? o + t : -1);
      sh[j] = j * BITS % 8;
    }
    /* lanes 4..7 are in the upper 128-bit half: pshufb indexes within each half, and the load
     * broadcasts the 8 bytes to both halves */
    const __m256i gather = _mm256_load_si256((const __m256i*)g);
    const __m256i shifts = _mm256_load_si256((const __m256i*)sh);
    const __m256 valpha = _mm256_set1_ps(alpha), zero = _mm256_setzero_ps();
    uint64_t i = lo;
    const uint64_t end = lo + n;
    while (i < end) {
      const uint64_t b = i / bucket, hi = std::min(end, (b + 1) * bucket);
      const float step = qsgd_step_of(load_scale(scales, b), s);
      const __m256 vstep = _mm256_set1_ps(step);
      float* a = acc + (i - lo);
      float* o = out + (i - lo);
      const uint8_t* p = data + i / 8 * BITS;
      const uint64_t m = hi - i;
      uint64_t k = 0;
      for (; k + 8 <= m && p + 8 <= data_end; k += 8, p += BITS) {
        const __m256 v = dequantize8<BITS>(load_codes8<BITS>(p, gather, shifts), vstep);
        const __m256 sum = _mm256_add_ps(FIRST ? zero : _mm256_loadu_ps(a + k), v);
        if (FIN == KEEP) {
          _mm256_storeu_ps(a + k, sum);
        } else {
          const __m256 t = _mm256_mul_ps(valpha, sum);
          if (FIN == STREAM) { /* (o + k is 16-byte aligned: k and the unit's start are multiples of 8) */
            _mm_stream_ps(o + k, _mm256_castps256_ps128(t));
            _mm_stream_ps(o + k + 4, _mm256_extractf128_ps(t, 1));
          } else {
            _mm256_storeu_ps(o + k, FIN == SET ? t : _mm256_add_ps(_mm256_loadu_ps(o + k), t));
          }
        }
      }
      if (k < m) { /* the bucket's last < 8 elements of the tensor */
        unpack_t<BITS>(data + (i + k) / 8 * BITS, m - k, codes);
        if (FIRST) memset(a + k, 0, sizeof(float) * (m - k));
        dequantize_add_t<BITS>(codes, m - k, step, a + k);
        if (FIN != KEEP) finish(o + k, a + k, m - k, alpha, FIN == ACCUMULATE);
      }
      i = hi;
    }
    if (FIN == STREAM) _mm_sfence(); /* the streamed values visible before the caller's threads join */
    return;
  }
#endif
  (void)data_end;
  if (FIRST) memset(acc, 0, sizeof(float) * n);
  unpack_t<BITS>(data + lo / 8 * BITS, n, codes);
  for (uint64_t i = lo; i < lo + n;) {
    const uint64_t b = i / bucket, hi = std::min(lo + n, (b + 1) * bucket);
    dequantize_add_t<BITS>(codes + (i - lo), hi - i, qsgd_step_of(load_scale(scales, b), s), acc + (i - lo));
    i = hi;
  }
  if (FIN != KEEP) finish(out, acc, n, alpha, FIN == ACCUMULATE);
}

void decode_step(int bits, const uint8_t* data, const uint8_t* data_end, const uint8_t* scales, uint64_t bucket,
                 uint64_t lo, uint64_t n, uint8_t* codes, float* acc, int first, int fin, float* out, float alpha) {
  /* decode_t of the bits, first and fin given: one instance per combination, picked by value */
  const auto run = [&](auto b, auto is_first, auto f) {
    decode_t<b.value, is_first.value, f.value>(data, data_end, scales, bucket, lo, n, codes, acc, out, alpha);
  };
  const auto with_fin = [&](auto b, auto is_first) {
    switch (fin) {
      case SET: run(b, is_first, std::integral_constant<int, SET>{}); break;
      case STREAM: run(b, is_first, std::integral_constant<int, STREAM>{}); break;
      case ACCUMULATE: run(b, is_first, std::integral_constant<int, ACCUMULATE>{}); break;
      default: run(b, is_first, std::integral_constant<int, KEEP>{}); break;
    }
  };
  dispatch_bits(bits, [&](auto b) {
    if (first) with_fin(b, std::true_type{});
    else with_fin(b, std::false_type{});
  });
}

/* sum over k in [k0, k1) of qsgd_checksum_term(word k of p, k), the checksum field read as zero.
 * The words up to the checksum field's one by one; the rest in a loop the compiler vectorises (64-bit
 * lanes: AVX2's 32-bit multiplies, AVX-512's vpmullq) with (k + 1) * QSGD_GOLDEN64 as a running sum
 * rather than a multiplication a word, and no masked load for the field: the same terms, summed mod
 * 2^64 in another order (avx2: 0.60 ns a word against 1.12, docs/performance.md) */
uint64_t checksum_terms(const uint8_t* p, uint64_t k0, uint64_t k1) {
  uint64_t sum = 0, k = k0;
  for (; k < k1 && k <= QSGD_CHECKSUM_OFFSET / 8; ++k) {
    uint64_t w;
    memcpy(&w, p + 8 * k, 8);
    if (k == QSGD_CHECKSUM_OFFSET / 8) w = 0;
    sum += qsgd_checksum_term(w, k);
  }
  const uint8_t* __restrict q = p + 8 * k;
  const uint64_t n = k1 > k ? k1 - k : 0;
  uint64_t g = (k + 1) * QSGD_GOLDEN64; /* qsgd_checksum_term's (k + 1) * QSGD_GOLDEN64, word by word */
  for (uint64_t i = 0; i < n; ++i, g += QSGD_GOLDEN64) {
    uint64_t w;
    memcpy(&w, q + 8 * i, 8);
    const uint64_t y = (w ^ g) * QSGD_CHECKSUM_C;
    sum += (y ^ (y >> 32)) * QSGD_CHECKSUM_C;
  }
  return sum;
}

}  // namespace
}  // namespace QSGD_ISA

extern const Kernels QSGD_CAT(kernels_, QSGD_ISA);
const Kernels QSGD_CAT(kernels_, QSGD_ISA) = {
    QSGD_STR(QSGD_ISA), QSGD_ISA::bucket_scale, QSGD_ISA::quantize, QSGD_QUANTIZE_PACKED, QSGD_ISA::sign,
    QSGD_ISA::pack, QSGD_ISA::decode_step, QSGD_ISA::finish,
    QSGD_ISA::checksum_terms,
};

}  // namespace qsgd_cpu
