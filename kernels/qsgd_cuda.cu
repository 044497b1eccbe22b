/*
 * CUDA implementation of the fixed-width codec: the same per-element functions as the CPU library
 * (qsgd_math.h), compiled with --fmad=false, so payloads are bit-identical to qsgd_encode_cpu and
 * decode_sum results to qsgd_decode_sum_cpu. Everything is stream-ordered on the caller's stream.
 *
 *   encode:     header kernel -> bucket scales (one warp per bucket, the L2 / L1 lane order of
 *               qsgd_math.h) -> quantize (or the sign norm's sign) + pack (one thread per group of 8 elements, which owns
 *               exactly `bits` bytes of the stream) -> checksum (order-free integer sum).
 *   decode_sum: verify (checksums, scales, padding -> *d_status) -> decode-and-accumulate, one
 *               thread per group of 8 output elements, payloads summed in order p = 0, 1, ...
 */
#include <cuda_runtime.h>
#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

#include <map>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "qsgd.h"
#include "qsgd_math.h"

/* Kernel launch; a host emulation of the CUDA runtime (tests/cuda_emu) replaces it. */
#ifndef QSGD_LAUNCH
#define QSGD_LAUNCH(kernel, grid, block, stream) kernel<<<(grid), (block), 0, (stream)>>>
#endif

namespace {

constexpr int kThreads = 256;
/* Blocks per SM the encoder's register budget is set for. 4 (64 registers a thread) holds a bucket's
 * groups in registers between its two passes without spilling; with 6 (40 registers) the held groups
 * spilled and encode ran at half the speed (H100, 2026-11-27: 4-bit encode at 256M 79% of the copy
 * with 4, 34% with 6; docs/gpu.md). The scaled-sign encoder holds nothing and keeps 6, where it ran
 * faster (70% against 62%). */
#ifndef QSGD_ENCODE_MIN_BLOCKS
#define QSGD_ENCODE_MIN_BLOCKS 4
#endif
#ifndef QSGD_SIGN_ENCODE_MIN_BLOCKS
#define QSGD_SIGN_ENCODE_MIN_BLOCKS 6
#endif
constexpr uint64_t kMaxBlocks = 1u << 20; /* grid-stride kernels: enough blocks to fill any GPU */

__host__ __device__ __forceinline__ uint64_t umin64(uint64_t a, uint64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ uint64_t umax64(uint64_t a, uint64_t b) { return a > b ? a : b; }

/* A decode's verdict in *status (QSGD_OK until a check fails): of the failures its kernels find, the
 * one that docs/wire-format.md's validation order checks first, as the CPU reports it, whichever
 * kernel or thread finds it first: a payload's header before its checksum, the checksum before the
 * scales, the scales before the stream (whose checks run per segment, on the CPU too: any
 * segment's first). */
__device__ __forceinline__ int check_rank(int32_t code) {
  switch (code) {
    case QSGD_E_MAGIC: return 1;
    case QSGD_E_VERSION: return 2;
    case QSGD_E_HEADER: return 3;
    case QSGD_E_LENGTH: return 4;
    case QSGD_E_MISMATCH: return 5;
    case QSGD_E_CHECKSUM: return 6;
    case QSGD_E_SCALE: return 7;
    default: return 8;
  }
}
__device__ __forceinline__ void report(int32_t* status, int32_t code) {
  int32_t seen = *(volatile int32_t*)status;
  while (seen == QSGD_OK || check_rank(code) < check_rank(seen)) {
    const int32_t was = atomicCAS(status, seen, code);
    if (was == seen) return;
    seen = was;
  }
}

#define QSGD_CUDA_TRY(expr)                \
  do {                                     \
    if ((expr) != cudaSuccess) {           \
      (void)cudaGetLastError();            \
      return QSGD_E_CUDA;                  \
    }                                      \
  } while (0)

/* A payload's header as the kernels write it: header_kernel, or the fused encoder's first thread
 * (so that no launch stands ahead of the encoder's). */
struct Opening {
  uint8_t* out;
  qsgd_config cfg;
  uint64_t numel, len;
  uint32_t segment_buckets;
};

__device__ __forceinline__ void write_opening(const Opening& o) {
  qsgd_write_header(o.out, &o.cfg, o.numel, o.len, o.segment_buckets);
}

__global__ void header_kernel(const Opening o) { write_opening(o); }

/* ---- the input of the encoder: fp32, fp16 or bf16 elements read natively, + an fp32 residual ---- */
struct f16_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};
/* Exact conversions to fp32 (every fp16 and bf16 value is an fp32 value). */
__host__ __device__ __forceinline__ float to_f32(float v) { return v; }
__host__ __device__ __forceinline__ float to_f32(bf16_t v) { return qsgd_u2f((uint32_t)v.bits << 16); }
__host__ __device__ __forceinline__ float to_f32(f16_t v) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(v.bits));
#else
  const uint32_t sign = (uint32_t)(v.bits & 0x8000u) << 16, e = (v.bits >> 10) & 0x1Fu, m = v.bits & 0x3FFu;
  if (e == 0x1F) return qsgd_u2f(sign | 0x7F800000u | (m << 13));     /* Inf, NaN */
  if (e == 0) {                                                       /* zero, subnormal: m * 2^-24 */
    const float f = (float)m * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  return qsgd_u2f(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

/* Eight consecutive elements of x from one 16-byte aligned address, as fp32. */
__device__ __forceinline__ void load8_vec(const float* x, float* v) {
  const float4 a = reinterpret_cast<const float4*>(x)[0];
  const float4 b = reinterpret_cast<const float4*>(x)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
template <typename H>
__device__ __forceinline__ void load8_vec(const H* x, float* v) { /* fp16, bf16: one 16-byte load */
  const uint4 w = *reinterpret_cast<const uint4*>(x);
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = to_f32(H{(uint16_t)(words[k] & 0xFFFFu)});
    v[2 * k + 1] = to_f32(H{(uint16_t)(words[k] >> 16)});
  }
}

/* What the encoder quantizes: v[i] = x[i] (as fp32), or with error feedback (EF) v[i] = x[i] + r[i]
 * in fp32 when the residual r is valid (else v[i] = x[i] and the residual counts as 0). vec: x and r
 * are 16-byte aligned, so whole groups of 8 are read in 16-byte loads. */
template <typename T, bool EF>
struct Source {
  const T* __restrict__ x;
  float* __restrict__ r;
  bool valid;
  bool vec;
  __device__ __forceinline__ float at(uint64_t i) const {
    const float v = to_f32(x[i]);
    return EF && valid ? v + r[i] : v;
  }
  /* v[0 .. n) of the group at i0 (i0 a multiple of 8) */
  __device__ __forceinline__ void load8(uint64_t i0, int n, float* v) const {
    if (vec && n == 8) {
      load8_vec(x + i0, v);
      if (EF && valid) {
        float e[8];
        load8_vec(r + i0, e);
        for (int j = 0; j < 8; ++j) v[j] = v[j] + e[j];
      }
    } else {
      for (int j = 0; j < n; ++j) v[j] = at(i0 + j);
    }
  }
};

/* The largest m of the warp's 32 lanes, on every lane. The whole warp must call it. */
__device__ __forceinline__ uint32_t warp_max(uint32_t m) {
  for (int off = 16; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  return m;
}

/* The sum of v over the warp's 32 lanes, folded lane j += lane j ^ off for off = 16, 8, 4, 2, 1 (the
 * same value on every lane). The whole warp must call it. */
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int off = 16; off > 0; off /= 2) v = v + __shfl_xor_sync(0xFFFFFFFFu, v, off);
  return v;
}

/* The scale of bucket [lo, hi), computed by the 32 lanes of one warp (lane j reads elements lo + j,
 * lo + j + 32, ... in order; the sums fold lane j += lane j ^ off, off = 16, 8, 4, 2, 1, which is the
 * fold of qsgd_math.h on lane 0 and, the additions being commutative, the same value on every lane).
 * Every lane returns the scale. The whole warp must call it. */
template <class Src>
__device__ __forceinline__ float warp_bucket_scale(const Src& src, uint64_t lo, uint64_t hi, int norm, int lane) {
  uint32_t m = 0;
  for (uint64_t i = lo + lane; i < hi; i += 32) m = max(m, __float_as_uint(src.at(i)) & 0x7FFFFFFFu);
  m = warp_max(m);
  if (norm == QSGD_NORM_MAX) return qsgd_scale_from_absmax_bits(m);
  double acc = 0.0;
  for (uint64_t i = lo + lane; i < hi; i += 32) acc += qsgd_lane_term(src.at(i), norm);
  acc = warp_sum(acc);
  return norm == QSGD_NORM_SIGN ? qsgd_scale_from_l1(acc, hi - lo, m) : qsgd_scale_from_sumsq(acc, m);
}

/* One warp per bucket (the general path: any bucket size; fp32 input). */
__global__ void scales_kernel(const float* __restrict__ x, uint64_t numel, uint32_t B, int norm,
                              uint64_t nb, float* __restrict__ scales) {
  const uint64_t b = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (b >= nb) return; /* whole warps exit together: b is uniform in a warp */
  const uint64_t lo = b * B;
  const Source<float, false> src{x, nullptr, false, false};
  const float scale = warp_bucket_scale(src, lo, umin64(numel, lo + B), norm, lane);
  if (lane == 0) scales[b] = scale;
}

/* i / B: a 32-bit division where i fits (the 64-bit one is several times dearer on the GPU). */
__device__ __forceinline__ uint64_t div_bucket(uint64_t i, uint32_t B) {
  return i <= 0xFFFFFFFFull ? (uint64_t)((uint32_t)i / B) : i / B;
}

template <int BITS>
__device__ __forceinline__ void store_group(uint8_t* dst, uint64_t v) {
  if (BITS == 1) *dst = (uint8_t)v;
  else if (BITS == 2) *reinterpret_cast<uint16_t*>(dst) = (uint16_t)v;
  else if (BITS == 4) *reinterpret_cast<uint32_t*>(dst) = (uint32_t)v;
  else if (BITS == 8) {
    reinterpret_cast<uint32_t*>(dst)[0] = (uint32_t)v;
    reinterpret_cast<uint32_t*>(dst)[1] = (uint32_t)(v >> 32);
  } else qsgd_store_le(dst, v, BITS);
}

template <int BITS>
__device__ __forceinline__ uint64_t load_group(const uint8_t* src) {
  if (BITS == 1) return *src;
  if (BITS == 2) return *reinterpret_cast<const uint16_t*>(src);
  if (BITS == 4) return *reinterpret_cast<const uint32_t*>(src);
  if (BITS == 8)
    return (uint64_t)reinterpret_cast<const uint32_t*>(src)[0] |
           ((uint64_t)reinterpret_cast<const uint32_t*>(src)[1] << 32);
  return qsgd_load_le(src, BITS);
}

/* The quantizer of qsgd_math.h (b >= 2), written for the fewest GPU instructions: |x| as fabsf (a
 * free operand modifier) where the shared code compares and negates. The codes are the same: the two
 * differ only for x = -0, where t is a zero either way, frac * 2^24 is a zero that no u24 is below,
 * and x < 0 is false. (The emulated build runs this function against the CPU library.) */
__host__ __device__ __forceinline__ uint32_t quantize_dev(float x, float scale, float s, uint32_t u24, int bits) {
  if (bits == 1) return qsgd_quantize(x, scale, s, u24, bits);
  float t = fabsf(x) / scale * s;
  t = t < s ? t : s;
  uint32_t l = (uint32_t)t; /* t in [0, s]: truncation is floor */
  const float frac = t - (float)l;
  l += (float)u24 < frac * 16777216.0f ? 1u : 0u;
  return (x < 0.0f && l != 0u) ? l | (1u << (bits - 1)) : l;
}

/* Encoder 2's quantizer (qsgd_quantize2), b >= 2, with fabsf as above; the codes are the same. PRE:
 * the bucket's pre is not 1 (a scale below 2^-96); otherwise the multiplication by 1 is left out
 * (it is exact). The rounding add, the integer add of u and the removal of 2^23's bits fold into
 * one three-input integer add. */
template <bool PRE>
__host__ __device__ __forceinline__ uint32_t quantize2_dev(float x, float pre, float rq, float s, uint32_t u16,
                                                           int bits) {
  if (bits == 1) return qsgd_quantize2(x, pre, rq, s, u16, bits);
  const float cap = s * 65536.0f;
  float t = (PRE ? fabsf(x) * pre : fabsf(x)) * rq;
  t = t < cap ? t : cap;
  const uint32_t l = (qsgd_f2u(t + QSGD_V2_ROUND) + u16 - QSGD_V2_ROUND_BITS) >> 16;
  return (x < 0.0f && l != 0u) ? l | (1u << (bits - 1)) : l;
}

/* A bucket's quantizer: its scale, and for encoder 2 its pre and reciprocal (qsgd_math.h), computed
 * once per bucket. */
struct Quant {
  float scale, pre, rq;
  bool v2;
  __host__ __device__ __forceinline__ Quant(float scale_, float s, int bits, bool v2_) : scale(scale_), v2(v2_) {
    pre = v2 ? qsgd_v2_pre(scale) : 1.0f;
    rq = v2 ? qsgd_v2_recip(scale, pre, s, bits) : 0.0f;
  }
  /* the code of element i (low 32 bits i_lo) of the page whose key is key */
  __host__ __device__ __forceinline__ uint32_t code(float x, float s, uint64_t key, uint32_t i_lo, int bits) const {
    return v2 ? quantize2_dev<true>(x, pre, rq, s, qsgd_u16(key, i_lo), bits)
              : quantize_dev(x, scale, s, qsgd_u24(key, i_lo), bits);
  }
};

/* qsgd_dequantize: the negation as a flip of the sign bit (which is what -v is). */
template <int BITS>
__host__ __device__ __forceinline__ float dequantize_dev(uint32_t code, float step) {
  if (BITS == 1) return code ? -step : step; /* level 1: 1 * step == step */
  const float v = (float)(code & ((1u << (BITS - 1)) - 1u)) * step;
  return qsgd_u2f(qsgd_f2u(v) ^ ((code >> (BITS - 1)) << 31));
}

/* The codes of a group of n <= 8 elements starting at element index i0 (low 32 bits i_lo, a multiple
 * of 8), all in one bucket whose scale quantizes, packed little-endian. A whole group is unrolled;
 * encoder 2 hashes once per pair. */
template <int BITS, bool SIGN, bool V2>
__device__ __forceinline__ uint64_t quantize_group(const float* v, int n, uint32_t i_lo, const Quant& q, uint64_t key) {
  constexpr int N = 8;
  const float s = (float)qsgd_levels_of(BITS);
  typedef typename std::conditional<(BITS <= 4), uint32_t, uint64_t>::type Codes;
  Codes codes = 0;
  if (n == N) {
    if (SIGN) {
#pragma unroll
      for (int j = 0; j < N; ++j) codes |= (Codes)qsgd_sign_code(v[j]) << (j * BITS);
    } else if (V2) {
      const bool pre = q.pre != 1.0f; /* the same for the whole bucket */
#pragma unroll
      for (int j = 0; j < N; j += 2) {
        const uint32_t y = qsgd_pair_hash(key, i_lo + j);
        const uint32_t c0 = pre ? quantize2_dev<true>(v[j], q.pre, q.rq, s, y & 0xFFFFu, BITS)
                                : quantize2_dev<false>(v[j], q.pre, q.rq, s, y & 0xFFFFu, BITS);
        const uint32_t c1 = pre ? quantize2_dev<true>(v[j + 1], q.pre, q.rq, s, y >> 16, BITS)
                                : quantize2_dev<false>(v[j + 1], q.pre, q.rq, s, y >> 16, BITS);
        codes |= (Codes)c0 << (j * BITS) | (Codes)c1 << ((j + 1) * BITS);
      }
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j)
        codes |= (Codes)quantize_dev(v[j], q.scale, s, qsgd_u24(key, i_lo + j), BITS) << (j * BITS);
    }
  } else {
    for (int j = 0; j < n; ++j) {
      const uint32_t c = SIGN ? qsgd_sign_code(v[j]) : q.code(v[j], s, key, i_lo + j, BITS);
      codes |= (Codes)c << (j * BITS);
    }
  }
  return codes;
}

/* The group's codes into the packed stream: data + (i0 / 8) * BITS holds exactly its BITS bytes. */
template <int BITS>
__device__ __forceinline__ void store_codes(uint8_t* __restrict__ data, uint64_t i0, int n, uint64_t codes) {
  uint8_t* dst = data + (i0 / 8) * BITS;
  if (n == 8) store_group<BITS>(dst, codes);
  else qsgd_store_le(dst, codes, (n * BITS + 7) / 8);
}

/* One group of the fast path: its codes from v (the group's v[0 .. n) as Source::load8 gives them),
 * stored, and with error feedback its new residual written. */
template <int BITS, bool SIGN, typename T, bool EF>
__device__ __forceinline__ void encode_group(const Source<T, EF>& src, uint64_t i0, int n, const float* v, bool q,
                                             const Quant& quant, float step, uint64_t seed, uint64_t key0,
                                             uint8_t* __restrict__ data) {
  uint64_t codes = 0;
  if (q) {
    const uint64_t key = i0 >> 32 ? qsgd_page_key(seed, i0) : key0; /* a group never crosses a 2^32 page */
    codes = quant.v2 ? quantize_group<BITS, SIGN, true>(v, n, (uint32_t)i0, quant, key)
                     : quantize_group<BITS, SIGN, false>(v, n, (uint32_t)i0, quant, key);
  }
  store_codes<BITS>(data, i0, n, codes);
  if (EF) {
    float e[8];
    for (int j = 0; j < n; ++j) {
      const float d = v[j] - 1.0f * (0.0f + dequantize_dev<BITS>((uint32_t)(codes >> (j * BITS)) & ((1u << BITS) - 1u), step));
      /* a non-finite d keeps the residual's value (not yet rewritten: the group's stores follow) */
      e[j] = (qsgd_f2u(d) & 0x7F800000u) != 0x7F800000u ? d : (src.valid ? src.r[i0 + j] : 0.0f);
    }
    if (src.vec && n == 8) {
      reinterpret_cast<float4*>(src.r + i0)[0] = make_float4(e[0], e[1], e[2], e[3]);
      reinterpret_cast<float4*>(src.r + i0)[1] = make_float4(e[4], e[5], e[6], e[7]);
    } else {
      for (int j = 0; j < n; ++j) src.r[i0 + j] = e[j];
    }
  }
}

/* The little-endian 64-bit word at p (4-byte aligned: every payload is): two 32-bit loads. */
__device__ __forceinline__ uint64_t load_word(const uint8_t* p) {
  const uint32_t* q = reinterpret_cast<const uint32_t*>(p);
  return (uint64_t)q[0] | ((uint64_t)q[1] << 32);
}

/* The payload's checksum (qsgd_math.h), summed (mod 2^64) into kChecksumSlots partial sums, each on
 * a 128-byte line of its own, warp w adding into slot w % kChecksumSlots; checksum_store_kernel (one
 * warp) adds the slots, stores the final value in its place and leaves the slots zero for the
 * stream's next payload (checksum_slots). With one sum every warp's atomic waited for the one before:
 * the checksum kernel took 18 us for the 34 MB payload of 64M elements at 4 bits on an H200, where
 * reading it takes about 7; with 32 slots 13.7 us.
 *
 * With QSGD_FUSED_CHECKSUM the fused encoder adds the terms of the words that lie whole in each
 * bucket's data but the last (it has just stored them), and checksum_kernel the others: the
 * header, the scales, the words across two buckets and the last bucket's (ChecksumRest). */
#ifndef QSGD_FUSED_CHECKSUM
#define QSGD_FUSED_CHECKSUM 0
#endif
constexpr bool kFusedChecksum = QSGD_FUSED_CHECKSUM != 0;
constexpr int kChecksumSlots = 256;
constexpr int kChecksumSlotWords = 16;
constexpr uint64_t kChecksumSlotBytes = 8ull * kChecksumSlots * kChecksumSlotWords;

/* The words of a payload the checksum kernel takes: with buckets of P data bytes (P a multiple of 8)
 * starting at byte D, of which the encoder summed the words whole in the first `fused` buckets, the
 * words [0, n0) (header and scales), the word across buckets b and b + 1 at floor((D + (b + 1) P) / 8)
 * for b + 1 = 1 .. n1 (when D is not a multiple of 8), and the words from s2 on. Without fused
 * buckets (n0 = n1 = s2 = 0): every word. */
struct ChecksumRest {
  uint64_t n0, n1, s2, D, P;
  /* how many words of a len-byte payload it names */
  __host__ __device__ uint64_t count(uint64_t len) const { return n0 + n1 + ((len + 7) / 8 - s2); }
};

inline ChecksumRest checksum_rest(uint64_t D, uint64_t P, uint64_t fused) {
  if (!fused) return ChecksumRest{0, 0, 0, D, P};
  return ChecksumRest{(D + 7) / 8, D % 8 ? fused - 1 : 0, (D + fused * P) / 8, D, P};
}

/* The words of bucket b's data that lie whole in it, [first, end): what the fused encoder adds. */
__host__ __device__ __forceinline__ void bucket_words(uint64_t D, uint64_t P, uint64_t b, uint64_t* first,
                                                      uint64_t* end) {
  *first = (D + b * P + 7) / 8;
  *end = (D + (b + 1) * P) / 8;
}

/* Word k's term: the checksum field reads as zero, the last word is zero-padded. */
__device__ __forceinline__ uint64_t checksum_word_term(const uint8_t* p, uint64_t len, uint64_t k) {
  uint64_t w = 8 * k + 8 <= len ? load_word(p + 8 * k) : qsgd_load_le(p + 8 * k, (int)(len - 8 * k));
  if (k == QSGD_CHECKSUM_OFFSET / 8) w = 0;
  return qsgd_checksum_term(w, k);
}

/* A warp's sum into its slot (all 32 lanes call it). */
__device__ __forceinline__ void checksum_add(unsigned long long* __restrict__ slots, uint64_t acc, uint64_t warp) {
  acc = warp_sum(acc);
  if ((threadIdx.x & 31) == 0 && acc) atomicAdd(&slots[warp % kChecksumSlots * kChecksumSlotWords], (unsigned long long)acc);
}

/* QSGD_FUSED_CHECKSUM: the terms of the words whole in bucket b's data (of the payload out, nb
 * buckets of B elements), once the warp's stores of them are visible to it, added into the warp's
 * slot. Not inlined: the encoder's registers (the held groups) stay as they are without it. */
template <int BITS>
__device__ __noinline__ void bucket_checksum(const uint8_t* out, uint64_t nb, uint32_t B, uint64_t b,
                                             unsigned long long* slots) {
  __syncwarp();
  uint64_t first, end, acc = 0;
  bucket_words(QSGD_HEADER_BYTES + 4 * nb, (uint64_t)B * BITS / 8, b, &first, &end);
  for (uint64_t k = first + (threadIdx.x & 31); k < end; k += 32) acc += qsgd_checksum_term(load_word(out + 8 * k), k);
  checksum_add(slots, acc, b);
}

/* Buckets of at most kHeldGroups * 256 elements under the max norm keep each lane's groups in
 * registers from the scale's pass to the quantizer's: x (and the residual) are read once, all of a
 * lane's loads are in flight together, and the second pass loads nothing. */
constexpr int kHeldGroups = 2;

/* The fast path, for bucket sizes that are multiples of 8 (every group lies in one bucket): one warp
 * per bucket computes the scale and then quantizes and packs the bucket's groups (lane j takes
 * groups j, j + 32, ...). A bucket of up to kHeldGroups * 256 elements under the max norm is held in
 * registers between the two passes (above); a larger one, or the L2 and sign norms (which keep the
 * lane order of warp_bucket_scale), re-read x from the L1 cache. The max norm reads the bucket in the
 * groups' 16-byte loads (a maximum is the same in any order). (Measured on an H200: lanes taking
 * quads of 4, so that a warp's loads cover whole sectors, ran 1.6x slower: quads double the
 * per-group work; docs/gpu.md.) With error feedback (EF) each element's new residual is written in
 * the same pass: v - 1 * (0 + decode(code)), exactly what decode_sum of the payload gives, where that
 * is finite (else the residual keeps its value; 0 where none was valid). Grid-stride over the
 * buckets; warps stay whole, as the shuffles need. */
template <int BITS, bool SIGN, typename T, bool EF>
__global__ void __launch_bounds__(kThreads, SIGN ? QSGD_SIGN_ENCODE_MIN_BLOCKS : QSGD_ENCODE_MIN_BLOCKS)
    encode_buckets_kernel(const Source<T, EF> src, uint64_t numel, uint32_t B, uint64_t seed, int v2, int norm,
                          uint64_t nb, float* __restrict__ scales, uint8_t* __restrict__ data, const Opening opening,
                          unsigned long long* __restrict__ ck_slots) {
  if (blockIdx.x == 0 && threadIdx.x == 0) write_opening(opening); /* one launch fewer ahead of this one */
  const uint64_t warps = (uint64_t)gridDim.x * blockDim.x / 32;
  /* QSGD_FUSED_CHECKSUM, given slots: the words whole in every bucket's data but the last */
  const bool fuse_ck = kFusedChecksum && ck_slots != nullptr;
  const int lane = threadIdx.x & 31;
  const uint64_t key0 = qsgd_page_key(seed, 0); /* the key of the first 2^32 elements */
  const float s = (float)qsgd_levels_of(BITS);
  const bool held = !SIGN && norm == QSGD_NORM_MAX && src.vec && B <= 256u * kHeldGroups;
  for (uint64_t b = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; b < nb; b += warps) {
    const uint64_t lo = b * B, hi = umin64(numel, lo + B);
    if (held && (hi - lo) % 8 == 0) { /* whole groups only (a tail bucket's last group takes the path below) */
      float v[kHeldGroups][8];
      bool in[kHeldGroups];
      uint32_t m = 0;
#pragma unroll
      for (int k = 0; k < kHeldGroups; ++k) {
        in[k] = lo + 8 * (uint64_t)lane + 256 * k < hi;
        if (in[k]) src.load8(lo + 8 * (uint64_t)lane + 256 * k, 8, v[k]);
      }
#pragma unroll
      for (int k = 0; k < kHeldGroups; ++k)
#pragma unroll
        for (int j = 0; j < 8; ++j) /* static indices keep v in registers */
          if (in[k]) m = max(m, __float_as_uint(v[k][j]) & 0x7FFFFFFFu);
      m = warp_max(m);
      const float scale = qsgd_scale_from_absmax_bits(m);
      if (lane == 0) scales[b] = scale;
      const Quant quant(scale, s, BITS, v2 != 0);
      const bool q = qsgd_scale_quantizes(scale); /* else all-zero codes */
#pragma unroll
      for (int k = 0; k < kHeldGroups; ++k)
        if (in[k])
          encode_group<BITS, SIGN, T, EF>(src, lo + 8 * (uint64_t)lane + 256 * k, 8, v[k], q, quant,
                                          qsgd_step_of(scale, s), seed, key0, data);
      if (fuse_ck && b + 1 < nb) bucket_checksum<BITS>(opening.out, nb, B, b, ck_slots);
      continue;
    }
    float scale;
    if (norm == QSGD_NORM_MAX && src.vec) {
      uint32_t m = 0;
      for (uint64_t i0 = lo + 8 * (uint64_t)lane; i0 < hi; i0 += 256) {
        const int n = (int)umin64(8, hi - i0);
        float v[8];
        src.load8(i0, n, v);
        for (int j = 0; j < n; ++j) m = max(m, __float_as_uint(v[j]) & 0x7FFFFFFFu);
      }
      m = warp_max(m);
      scale = qsgd_scale_from_absmax_bits(m);
    } else {
      scale = warp_bucket_scale(src, lo, hi, norm, lane);
    }
    if (lane == 0) scales[b] = scale;
    const bool q = qsgd_scale_quantizes(scale); /* else all-zero codes */
    const float step = qsgd_step_of(scale, s);  /* EF: the decoder's step */
    const Quant quant(scale, s, BITS, v2 != 0);
    for (uint64_t i0 = lo + 8 * (uint64_t)lane; i0 < hi; i0 += 256) {
      const int n = (int)umin64(8, hi - i0);
      float v[8];
      if (q || EF) src.load8(i0, n, v);
      encode_group<BITS, SIGN, T, EF>(src, i0, n, v, q, quant, step, seed, key0, data);
    }
    if (fuse_ck && b + 1 < nb) bucket_checksum<BITS>(opening.out, nb, B, b, ck_slots);
  }
}

/* The general path: one thread per group of 8 elements, after scales_kernel. A group may span
 * buckets when the bucket size is not a multiple of 8. data is 4-byte aligned (56 + 4 * nb bytes from
 * a 4-byte aligned payload), so the group stores of 1, 2, 4 and 8 bits are aligned. */
template <int BITS>
__global__ void pack_kernel(const float* __restrict__ x, uint64_t numel, uint32_t B, uint64_t seed, int v2, int norm,
                            const float* __restrict__ scales, uint8_t* __restrict__ data) {
  const uint64_t g = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t i0 = 8 * g;
  if (i0 >= numel) return;
  const uint64_t key = qsgd_page_key(seed, i0); /* a group never crosses a 2^32 page */
  const float s = (float)qsgd_levels_of(BITS);
  const int n = (int)umin64(8, numel - i0);
  uint64_t b = div_bucket(i0, B);
  uint32_t r = (uint32_t)(i0 - b * B); /* position of element i0 + j in its bucket */
  Quant q(scales[b], s, BITS, v2 != 0);
  uint64_t v = 0;
  for (int j = 0; j < n; ++j, ++r) {
    if (r == B) q = Quant(scales[++b], s, BITS, v2 != 0), r = 0;
    const uint64_t i = i0 + j;
    uint32_t code = 0u;
    if (qsgd_scale_quantizes(q.scale))
      code = norm == QSGD_NORM_SIGN ? qsgd_sign_code(x[i]) : q.code(x[i], s, key, (uint32_t)i, BITS);
    v |= (uint64_t)code << (j * BITS);
  }
  store_codes<BITS>(data, i0, n, v);
}

struct PayloadJob {
  const uint8_t* ptr;
  uint64_t len;
  uint64_t checksum;
  uint64_t nb;
  uint32_t flags;
  uint32_t own_header; /* 1: flags and checksum are read from the payload's header on the device
                        * (qsgd_decode_sum_cuda with d_heads; checked by expect_headers_kernel) */
  __device__ __forceinline__ uint32_t flags_now() const { return own_header ? ptr[9] : flags; }
  __device__ __forceinline__ uint64_t checksum_now() const { return own_header ? qsgd_load_le(ptr + QSGD_CHECKSUM_OFFSET, 8) : checksum; }
};

/* The payloads of one decode_sum, passed to its kernels by value (in the launch's parameters) up to
 * kInlineJobs of them, so that a decode needs no host-to-device copy; more go through device memory. */
constexpr int kInlineJobs = 48;
struct Jobs {
  const PayloadJob* dev; /* null: the payloads are in inl */
  PayloadJob inl[kInlineJobs];
  __host__ __device__ __forceinline__ const PayloadJob& operator[](int p) const { return dev ? dev[p] : inl[p]; }
};

/* sum of the checksum terms of payload p (blockIdx.y) into sums[p] */
__global__ void verify_terms_kernel(const Jobs jobs,
                                    unsigned long long* __restrict__ sums,
                                    int32_t* __restrict__ status) {
  const PayloadJob job = jobs[blockIdx.y];
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  uint64_t sum = 0;
  const uint64_t t0 = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (job.flags_now() & QSGD_FLAG_CHECKSUM)
    for (uint64_t k = t0; k < (job.len + 7) / 8; k += stride) sum += checksum_word_term(job.ptr, job.len, k);
  for (uint64_t b = t0; b < job.nb; b += stride) {
    const uint32_t u = (uint32_t)qsgd_load_le(job.ptr + QSGD_HEADER_BYTES + 4 * b, 4);
    if ((u & 0x80000000u) && (u & 0x7FFFFFFFu) <= 0x7F800000u) report(status, QSGD_E_SCALE);
  }
  sum = warp_sum(sum);
  if ((threadIdx.x & 31) == 0 && sum) atomicAdd(&sums[blockIdx.y], (unsigned long long)sum);
}

__global__ void verify_final_kernel(const Jobs jobs, int count, uint64_t numel,
                                    int bits, int elias, const unsigned long long* __restrict__ sums,
                                    int32_t* __restrict__ status) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= count) return;
  const PayloadJob job = jobs[p];
  if ((job.flags_now() & QSGD_FLAG_CHECKSUM) && qsgd_checksum_final(sums[p], job.len) != job.checksum_now())
    report(status, QSGD_E_CHECKSUM);
  const uint64_t used_bits = (numel % 8) * (uint64_t)bits % 8;
  if (!elias && used_bits && (job.ptr[job.len - 1] >> used_bits)) report(status, QSGD_E_PADDING);
}

/* The headers of a decode that expects their fields (d_heads: qsgd_decode_sum_cuda), before any other
 * of its kernels: thread p copies payload p's header to heads (for the host to name what differs)
 * and checks it against want (qsgd_header_against); a failure goes to *status (report). */
__global__ void expect_headers_kernel(const Jobs jobs, int count, const qsgd_header want,
                                      uint8_t* __restrict__ heads, int32_t* __restrict__ status) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= count) return;
  const uint8_t* h = jobs[p].ptr;
  for (int k = 0; k < QSGD_HEADER_BYTES; ++k) heads[(uint64_t)QSGD_HEADER_BYTES * p + k] = h[k];
  const int32_t st = qsgd_header_against(h, &want);
  if (st != QSGD_OK) report(status, st);
}

/* One thread per group of 8 output elements; the payloads are added in order p = 0, 1, ... The
 * bucket of element i0 is found with one division per group, the step scale / s once per bucket. */
template <int BITS>
__global__ void decode_sum_kernel(const Jobs jobs, int count, uint64_t numel,
                                  uint32_t B, float alpha, float* __restrict__ out, int accumulate,
                                  const int32_t* __restrict__ status, bool vec) {
  const bool aligned = B % 8 == 0; /* every group in one bucket */
  if (*status != QSGD_OK) return;
  const uint64_t g = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t i0 = 8 * g;
  if (i0 >= numel) return;
  const int n = (int)umin64(8, numel - i0);
  const uint64_t nb = qsgd_num_buckets(numel, B);
  const float s = (float)qsgd_levels_of(BITS);
  const uint32_t mask = (1u << BITS) - 1u;
  const uint64_t b0 = div_bucket(i0, B);
  const uint32_t r0 = (uint32_t)(i0 - b0 * B);
  float acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
  for (int p = 0; p < count; ++p) {
    const uint8_t* scales = jobs[p].ptr + QSGD_HEADER_BYTES;
    const uint8_t* src = scales + 4 * nb + g * BITS;
    const uint64_t v = n == 8 ? load_group<BITS>(src) : qsgd_load_le(src, (n * BITS + 7) / 8);
    const float* fscales = reinterpret_cast<const float*>(scales);
    if (n == 8 && aligned) { /* the whole group in bucket b0 */
      const float step = qsgd_step_of(fscales[b0], s);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += dequantize_dev<BITS>((uint32_t)(v >> (j * BITS)) & mask, step);
      continue;
    }
    uint64_t b = b0;
    uint32_t r = r0;
    float step = qsgd_step_of(fscales[b], s);
    for (int j = 0; j < n; ++j, ++r) {
      if (r == B) step = qsgd_step_of(fscales[++b], s), r = 0;
      acc[j] += dequantize_dev<BITS>((uint32_t)(v >> (j * BITS)) & mask, step);
    }
  }
  if (vec && n == 8) {
    float4* o = reinterpret_cast<float4*>(out + i0);
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), c = a;
    if (accumulate) a = o[0], c = o[1];
    if (accumulate) {
      o[0] = make_float4(a.x + alpha * acc[0], a.y + alpha * acc[1], a.z + alpha * acc[2], a.w + alpha * acc[3]);
      o[1] = make_float4(c.x + alpha * acc[4], c.y + alpha * acc[5], c.z + alpha * acc[6], c.w + alpha * acc[7]);
    } else {
      o[0] = make_float4(alpha * acc[0], alpha * acc[1], alpha * acc[2], alpha * acc[3]);
      o[1] = make_float4(alpha * acc[4], alpha * acc[5], alpha * acc[6], alpha * acc[7]);
    }
    return;
  }
  for (int j = 0; j < n; ++j)
    out[i0 + j] = accumulate ? out[i0 + j] + alpha * acc[j] : alpha * acc[j];
}

__global__ void checksum_kernel(const uint8_t* __restrict__ p, uint64_t len, const ChecksumRest r,
                                unsigned long long* __restrict__ slots) {
  const uint64_t count = r.count(len);
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  const uint64_t t0 = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint64_t acc = 0;
  for (uint64_t t = t0; t < count; t += stride) {
    const uint64_t k = t < r.n0 ? t : t < r.n0 + r.n1 ? (r.D + (t - r.n0 + 1) * r.P) / 8 : r.s2 + (t - r.n0 - r.n1);
    acc += checksum_word_term(p, len, k);
  }
  checksum_add(slots, acc, t0 / 32);
}

__global__ void checksum_store_kernel(uint8_t* p, uint64_t len, unsigned long long* slots) {
  uint64_t acc = 0;
  for (int j = threadIdx.x; j < kChecksumSlots; j += 32) {
    acc += slots[j * kChecksumSlotWords];
    slots[j * kChecksumSlotWords] = 0;
  }
  acc = warp_sum(acc);
  if (threadIdx.x == 0) qsgd_store_le(p + QSGD_CHECKSUM_OFFSET, qsgd_checksum_final(acc, len), 8);
}

/* v[i] = v[i] + r[i] (fp32): error feedback's v = S + residual in the reduce step. */
__global__ void add_kernel(float* __restrict__ v, const float* __restrict__ r, uint64_t n) {
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) v[i] = v[i] + r[i];
}

/* residual[i] = d[i] where d[i] is finite (the rest keep their value); nothing when *status reports a
 * failure, so that a failed step leaves the residual as it was. */
__global__ void keep_finite_kernel(const float* __restrict__ d, float* __restrict__ residual, uint64_t n,
                                   const int32_t* __restrict__ status) {
  if (*status != QSGD_OK) return;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    if ((qsgd_f2u(d[i]) & 0x7F800000u) != 0x7F800000u) residual[i] = d[i];
}

/* ---- the Elias coding (docs/wire-format.md; the CPU library's qsgd_elias_cpu.cc) ----------------
 * Encode: the codes (the fixed coding's levels: same scales, same random stream) one byte per
 * element; then one thread per segment writes the segment's bit stream into a slot of its own (the
 * segments are independent by the format's design), counting its bytes; a scan makes the segment
 * table; the slots are copied into place. Decode: one thread per segment parses it, payload after
 * payload, adding into an fp32 scratch sum; a last pass writes out only when every check passed. */

/* The codes of elements [8g, 8g + 8), one byte each (any bucket size: the bucket is tracked per
 * element, as in pack_kernel). */
template <int BITS>
__global__ void codes_kernel(const float* __restrict__ x, uint64_t numel, uint32_t B, uint64_t seed, int v2,
                             const float* __restrict__ scales, uint8_t* __restrict__ codes) {
  const uint64_t g = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t i0 = 8 * g;
  if (i0 >= numel) return;
  const uint64_t key = qsgd_page_key(seed, i0);
  const float s = (float)qsgd_levels_of(BITS);
  const int n = (int)umin64(8, numel - i0);
  uint64_t b = div_bucket(i0, B);
  uint32_t r = (uint32_t)(i0 - b * B);
  Quant q(scales[b], s, BITS, v2 != 0);
  for (int j = 0; j < n; ++j, ++r) {
    if (r == B) q = Quant(scales[++b], s, BITS, v2 != 0), r = 0;
    const uint64_t i = i0 + j;
    codes[i] = qsgd_scale_quantizes(q.scale) ? (uint8_t)q.code(x[i], s, key, (uint32_t)i, BITS) : 0;
  }
}

/* Bits written least-significant first, flushed as whole 64-bit little-endian words into an 8-byte
 * aligned slot owned by one thread. */
struct DevBitWriter {
  uint64_t* p;
  uint64_t acc = 0;
  int n = 0;
  uint64_t total = 0;
  __host__ __device__ __forceinline__ void bit(uint32_t b) {
    acc |= (uint64_t)b << n;
    ++total;
    if (++n == 64) *p++ = acc, acc = 0, n = 0;
  }
  __host__ __device__ __forceinline__ void omega(uint64_t k) { qsgd_write_omega(*this, k); }
  __host__ __device__ __forceinline__ void flush() {
    if (n) *p = acc;
  }
};

/* One thread per segment: its stream into slot sg (slot_words 64-bit words), its byte count. */
__global__ void elias_write_kernel(const uint8_t* __restrict__ codes, uint64_t numel, uint32_t B, int bits,
                                   uint64_t seg_buckets, uint64_t nb, uint64_t nseg, uint64_t* __restrict__ slots,
                                   uint64_t slot_words, uint64_t* __restrict__ seg_bytes) {
  const uint64_t sg = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (sg >= nseg) return;
  DevBitWriter w{slots + sg * slot_words};
  const uint32_t lmask = (1u << (bits - 1)) - 1u;
  const uint64_t b1 = umin64(nb, (sg + 1) * seg_buckets);
  for (uint64_t b = sg * seg_buckets; b < b1; ++b) {
    const uint64_t lo = b * B, hi = umin64(numel, lo + B);
    uint64_t nnz = 0;
    for (uint64_t i = lo; i < hi; ++i) nnz += (codes[i] & lmask) != 0;
    w.omega(nnz + 1);
    int64_t prev = -1;
    for (uint64_t i = lo; i < hi; ++i) {
      const uint32_t c = codes[i], l = c & lmask;
      if (!l) continue;
      const int64_t idx = (int64_t)(i - lo);
      w.omega((uint64_t)(idx - prev));
      w.bit((c >> (bits - 1)) & 1u);
      w.omega(l);
      prev = idx;
    }
  }
  w.flush();
  seg_bytes[sg] = (w.total + 7) / 8;
}

/* The segment table (cumulative end offsets, little-endian uint64 at a 4-byte aligned address) and the
 * streams' total length, from the segments' byte counts: one thread (the table is nseg entries). */
__global__ void elias_table_kernel(const uint64_t* __restrict__ seg_bytes, uint64_t nseg, uint8_t* __restrict__ table,
                                   uint64_t* __restrict__ total) {
  uint64_t end = 0;
  for (uint64_t k = 0; k < nseg; ++k) {
    end += seg_bytes[k];
    qsgd_store_le(table + 8 * k, end, 8);
  }
  *total = end;
}

/* Block sg copies segment sg's bytes from its slot to its place among the streams. */
__global__ void elias_place_kernel(const uint64_t* __restrict__ slots, uint64_t slot_words,
                                   const uint64_t* __restrict__ seg_bytes, const uint8_t* __restrict__ table,
                                   uint8_t* __restrict__ streams) {
  const uint64_t sg = blockIdx.x;
  const uint64_t begin = sg ? qsgd_load_le(table + 8 * (sg - 1), 8) : 0;
  const uint8_t* src = reinterpret_cast<const uint8_t*>(slots + sg * slot_words);
  for (uint64_t k = threadIdx.x; k < seg_bytes[sg]; k += blockDim.x) streams[begin + k] = src[k];
}

/* One thread per segment: parse the segment of every payload, in payload order, adding the decoded
 * values into acc (qsgd_math.h's qsgd_elias_parse_segment, as the CPU does); a failure goes
 * to *status. */
__global__ void elias_decode_kernel(const Jobs jobs, int count, uint64_t numel, uint32_t B, int bits,
                                    uint64_t seg_buckets, uint64_t nb, uint64_t nseg, float* __restrict__ acc,
                                    int32_t* __restrict__ status) {
  const uint64_t sg = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (sg >= nseg || *status != QSGD_OK) return;
  const uint64_t b0 = sg * seg_buckets, b1 = umin64(nb, b0 + seg_buckets);
  for (int p = 0; p < count; ++p) {
    const PayloadJob& job = jobs[p];
    const uint8_t* scales = job.ptr + QSGD_HEADER_BYTES;
    const uint8_t* table = scales + 4 * nb;
    const uint8_t* streams = table + 8 * nseg;
    const uint64_t streams_len = job.len - (uint64_t)(streams - job.ptr);
    const uint64_t begin = sg ? qsgd_load_le(table + 8 * (sg - 1), 8) : 0, end = qsgd_load_le(table + 8 * sg, 8);
    if (end < begin || end > streams_len) {
      report(status, QSGD_E_STREAM);
      return;
    }
    if (sg == nseg - 1 && end != streams_len) {
      report(status, QSGD_E_LENGTH);
      return;
    }
    const int32_t st = qsgd_elias_parse_segment(streams + begin, end - begin, scales, b0, b1, numel, B, bits,
                                                acc + b0 * B);
    if (st != QSGD_OK) {
      report(status, st);
      return;
    }
  }
}

/* out = [out +] alpha * acc, only when every check passed (the CPU library's finish). */
__global__ void finish_kernel(float* __restrict__ out, const float* __restrict__ acc, uint64_t n, float alpha,
                              int accumulate, const int32_t* __restrict__ status) {
  if (*status != QSGD_OK) return;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = accumulate ? out[i] + alpha * acc[i] : alpha * acc[i];
}

inline unsigned blocks_for(uint64_t threads) {
  const uint64_t b = (threads + kThreads - 1) / kThreads;
  return (unsigned)(b ? b : 1);
}

template <int BITS>
void launch_pack(const float* x, uint64_t numel, uint32_t B, uint64_t seed, int v2, int norm, const float* scales,
                 uint8_t* data, cudaStream_t st) {
  const uint64_t groups = (numel + 7) / 8;
  if (groups) QSGD_LAUNCH(pack_kernel<BITS>, blocks_for(groups), kThreads, st)(x, numel, B, seed, v2, norm, scales, data);
}

template <int BITS, typename T, bool EF>
void launch_encode_buckets(const Source<T, EF>& src, uint64_t numel, uint32_t B, uint64_t seed, int v2, int norm,
                           uint64_t nb, float* scales, uint8_t* data, const Opening& opening,
                           unsigned long long* ck_slots, cudaStream_t st) {
  const unsigned blocks = (unsigned)umin64(blocks_for(nb * 32), kMaxBlocks);
  if (BITS == 1 && norm == QSGD_NORM_SIGN)
    QSGD_LAUNCH((encode_buckets_kernel<BITS, true, T, EF>), blocks, kThreads, st)(src, numel, B, seed, v2, norm, nb,
                                                                                 scales, data, opening, ck_slots);
  else
    QSGD_LAUNCH((encode_buckets_kernel<BITS, false, T, EF>), blocks, kThreads, st)(src, numel, B, seed, v2, norm, nb,
                                                                                  scales, data, opening, ck_slots);
}

#define QSGD_BITS_DISPATCH(bits, fn, ...)   \
  switch (bits) {                           \
    case 1: fn<1>(__VA_ARGS__); break;      \
    case 2: fn<2>(__VA_ARGS__); break;      \
    case 3: fn<3>(__VA_ARGS__); break;      \
    case 4: fn<4>(__VA_ARGS__); break;      \
    case 5: fn<5>(__VA_ARGS__); break;      \
    case 6: fn<6>(__VA_ARGS__); break;      \
    case 7: fn<7>(__VA_ARGS__); break;      \
    default: fn<8>(__VA_ARGS__); break;     \
  }

/* The Elias encoder's codes kernel for BITS (QSGD_BITS_DISPATCH calls it). */
template <int BITS>
void launch_codes(const float* x, uint64_t numel, uint32_t B, uint64_t seed, int v2, const float* scales,
                  uint8_t* codes, cudaStream_t st) {
  QSGD_LAUNCH(codes_kernel<BITS>, blocks_for((numel + 7) / 8), kThreads, st)(x, numel, B, seed, v2, scales, codes);
}

/* The fused encoder on x of element type T, with (EF) or without error feedback. */
template <typename T, bool EF>
void launch_fused(const void* x, float* residual, bool valid, bool vec, uint64_t numel, const qsgd_config* cfg,
                  uint64_t nb, float* scales, uint8_t* data, const Opening& opening, unsigned long long* ck_slots,
                  cudaStream_t st) {
  const Source<T, EF> src{static_cast<const T*>(x), residual, valid, vec};
  QSGD_BITS_DISPATCH(cfg->bits, launch_encode_buckets, src, numel, cfg->bucket_size, cfg->seed,
                     qsgd_encoder_of(cfg->flags) == 2, cfg->norm, nb, scales, data, opening, ck_slots, st);
}

/* out[i] = to_f32(x[i]) (+ r[i] when r is not null): the general path's fp32 input. */
template <typename T>
__global__ void to_f32_kernel(const T* __restrict__ x, const float* __restrict__ r, float* __restrict__ out, uint64_t n) {
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = to_f32(x[i]);
    out[i] = r ? v + r[i] : v;
  }
}

template <int BITS>
void launch_decode(const Jobs& jobs, int count, uint64_t numel, uint32_t B, float alpha,
                   float* out, int accumulate, const int32_t* status, bool vec, cudaStream_t st) {
  const uint64_t groups = (numel + 7) / 8;
  if (groups)
    QSGD_LAUNCH(decode_sum_kernel<BITS>, blocks_for(groups), kThreads, st)(jobs, count, numel, B, alpha, out,
                                                                      accumulate, status, vec);
}


inline uint64_t fixed_nbytes(uint64_t numel, int bits, uint32_t B) {
  return QSGD_HEADER_BYTES + 4 * qsgd_num_buckets(numel, B) + qsgd_packed_bytes(numel, bits);
}

}  // namespace

extern "C" int32_t qsgd_cuda_abi_version(void) { return QSGD_ABI_VERSION; }

extern "C" int32_t qsgd_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

static int32_t decode_sum_impl(const uint8_t* const* d_payloads, const qsgd_header* headers, int32_t count,
                               float alpha, float* out, uint64_t n, int32_t accumulate, int32_t* d_status,
                               bool reset_status, cudaStream_t s, uint8_t* d_heads = nullptr);

/* The checksum's slots of each device and stream, zero between payloads (checksum_store_kernel
 * leaves them so): kChecksumSlotBytes a stream, allocated at its first checksum and kept, so that no
 * allocation stands before the encoder's launch (an allocation from the stream-ordered pool, trimmed
 * at every synchronisation, cost the fused encoder a third of its speed at 64M elements on an H200).
 * A stream whose checksum launches failed has its slots dropped (they may not be zero). */
class ChecksumSlots {
 public:
  unsigned long long* get(cudaStream_t s) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    unsigned long long*& slots = kept_[{device, s}];
    if (!slots) {
      void* p = nullptr;
      if (cudaMalloc(&p, kChecksumSlotBytes) != cudaSuccess) return nullptr;
      if (cudaMemsetAsync(p, 0, kChecksumSlotBytes, s) != cudaSuccess) {
        (void)cudaFree(p);
        return nullptr;
      }
      slots = static_cast<unsigned long long*>(p);
    }
    return slots;
  }
  void drop(cudaStream_t s) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = kept_.find({device, s});
    if (it == kept_.end()) return;
    (void)cudaFree(it->second);
    kept_.erase(it);
  }

 private:
  std::mutex mu_;
  std::map<std::pair<int, cudaStream_t>, unsigned long long*> kept_;
};
/* never destroyed: the slots stay reachable until the process ends (they are the device's to free then) */
static ChecksumSlots& checksum_slots = *new ChecksumSlots;

/* The checksum of the len-byte payload at out (its header written) into its place, on stream s:
 * the words rest names (the others the fused encoder added), then the slots' sum. */
static cudaError_t launch_checksum(uint8_t* out, uint64_t len, const ChecksumRest& rest, unsigned long long* slots,
                                   cudaStream_t s) {
  QSGD_LAUNCH(checksum_kernel, (unsigned)umin64(blocks_for(rest.count(len)), 1024), kThreads, s)(out, len, rest, slots);
  QSGD_LAUNCH(checksum_store_kernel, 1, 32, s)(out, len, slots);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) checksum_slots.drop(s);
  return e;
}

/* The payload of x (x_dtype elements, read natively) and, with a residual, error feedback
 * (qsgd_encode_ex_cuda in qsgd.h). Bucket sizes that are multiples of 8 take the fused kernel; the
 * others the general path, composed of the same steps (conversion, scales, pack, decode, keep). */
static int32_t encode_core(const void* x, int32_t x_dtype, uint64_t numel, const qsgd_config* cfg, float* residual,
                           bool valid, uint8_t* out, uint64_t cap, cudaStream_t s) {
  const int32_t st = qsgd_check_config(cfg);
  if (st != QSGD_OK) return st;
  if (cfg->coding != QSGD_CODING_FIXED) return QSGD_E_ARG; /* Elias coding is CPU only */
  if (x_dtype != QSGD_DTYPE_F32 && x_dtype != QSGD_DTYPE_F16 && x_dtype != QSGD_DTYPE_BF16) return QSGD_E_ARG;
  if (!out || ((uintptr_t)out & 3) || (numel && !x) || numel > (1ull << 56)) return QSGD_E_ARG;
  if (residual && ((uintptr_t)residual & 3)) return QSGD_E_ARG;
  const uint64_t len = fixed_nbytes(numel, cfg->bits, cfg->bucket_size);
  if (cap < len) return QSGD_E_CAPACITY;
  const uint64_t nb = qsgd_num_buckets(numel, cfg->bucket_size);
  float* scales = reinterpret_cast<float*>(out + QSGD_HEADER_BYTES);
  uint8_t* data = out + QSGD_HEADER_BYTES + 4 * nb;
  const bool ef = residual != nullptr && numel;
  valid = valid && ef;
  const Opening opening{out, *cfg, numel, len, 0u};
  /* the checksum: the fused encoder adds the words whole in its buckets' data (QSGD_FUSED_CHECKSUM;
   * data in whole words: bucket_size * bits a multiple of 64), checksum_kernel the rest */
  unsigned long long* slots = nullptr;
  if (cfg->flags & QSGD_FLAG_CHECKSUM) {
    slots = checksum_slots.get(s);
    if (!slots) return QSGD_E_CUDA;
  }
  const uint64_t P = (uint64_t)cfg->bucket_size * cfg->bits / 8;
  const bool fuse_ck = kFusedChecksum && slots && cfg->bucket_size % 8 == 0 && P % 8 == 0 && nb > 1;
  unsigned long long* fused_slots = fuse_ck ? slots : nullptr;
  uint8_t* tmp = nullptr; /* the general path's fp32 copy of v, then its new residual, then a status */
  if (cfg->bucket_size % 8 == 0) {
    const bool vec = ((uintptr_t)x & 15) == 0 && (!ef || ((uintptr_t)residual & 15) == 0);
    if (x_dtype == QSGD_DTYPE_F32)
      ef ? launch_fused<float, true>(x, residual, valid, vec, numel, cfg, nb, scales, data, opening, fused_slots, s)
         : launch_fused<float, false>(x, residual, valid, vec, numel, cfg, nb, scales, data, opening, fused_slots, s);
    else if (x_dtype == QSGD_DTYPE_F16)
      ef ? launch_fused<f16_t, true>(x, residual, valid, vec, numel, cfg, nb, scales, data, opening, fused_slots, s)
         : launch_fused<f16_t, false>(x, residual, valid, vec, numel, cfg, nb, scales, data, opening, fused_slots, s);
    else
      ef ? launch_fused<bf16_t, true>(x, residual, valid, vec, numel, cfg, nb, scales, data, opening, fused_slots, s)
         : launch_fused<bf16_t, false>(x, residual, valid, vec, numel, cfg, nb, scales, data, opening, fused_slots, s);
  } else {
    QSGD_LAUNCH(header_kernel, 1, 1, s)(opening);
    const float* x32 = static_cast<const float*>(x);
    if (x_dtype != QSGD_DTYPE_F32 || ef) {
      const unsigned blocks = (unsigned)umin64(blocks_for(numel), 4096);
      const float* r = valid ? residual : nullptr;
      QSGD_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&tmp), 4 * numel + 16, s));
      float* v = reinterpret_cast<float*>(tmp);
      if (x_dtype == QSGD_DTYPE_F16)
        QSGD_LAUNCH(to_f32_kernel<f16_t>, blocks, kThreads, s)(static_cast<const f16_t*>(x), r, v, numel);
      else if (x_dtype == QSGD_DTYPE_BF16)
        QSGD_LAUNCH(to_f32_kernel<bf16_t>, blocks, kThreads, s)(static_cast<const bf16_t*>(x), r, v, numel);
      else
        QSGD_LAUNCH(to_f32_kernel<float>, blocks, kThreads, s)(static_cast<const float*>(x), r, v, numel);
      x32 = v;
    }
    if (nb) QSGD_LAUNCH(scales_kernel, blocks_for(nb * 32), kThreads, s)(x32, numel, cfg->bucket_size, cfg->norm, nb, scales);
    QSGD_BITS_DISPATCH(cfg->bits, launch_pack, x32, numel, cfg->bucket_size, cfg->seed,
                       qsgd_encoder_of(cfg->flags) == 2, cfg->norm, scales, data, s);
  }
  if (slots)
    QSGD_CUDA_TRY(launch_checksum(out, len, checksum_rest(QSGD_HEADER_BYTES + 4 * nb, P, fuse_ck ? nb - 1 : 0), slots, s));
  if (tmp && ef) { /* the general path's error feedback: tmp = v + (-1) * decode(q), kept where finite */
    float* v = reinterpret_cast<float*>(tmp);
    int32_t* d_status = reinterpret_cast<int32_t*>(tmp + (4 * numel + 15) / 16 * 16);
    qsgd_header h{};
    h.magic = QSGD_MAGIC;
    h.version = QSGD_WIRE_VERSION;
    h.coding = QSGD_CODING_FIXED;
    h.bits = (uint8_t)cfg->bits;
    h.norm = (uint8_t)cfg->norm;
    h.dtype = (uint8_t)cfg->dtype;
    h.flags = (uint8_t)(cfg->flags & ~(uint32_t)QSGD_FLAG_CHECKSUM);
    h.bucket_size = cfg->bucket_size;
    h.numel = numel;
    h.payload_len = len;
    h.fingerprint = cfg->fingerprint;
    const uint8_t* q = out;
    int32_t st2 = decode_sum_impl(&q, &h, 1, -1.0f, v, numel, 1, d_status, true, s);
    if (st2 != QSGD_OK) return st2;
    if (!valid) QSGD_CUDA_TRY(cudaMemsetAsync(residual, 0, 4 * numel, s));
    QSGD_LAUNCH(keep_finite_kernel, (unsigned)umin64(blocks_for(numel), 4096), kThreads, s)(v, residual, numel, d_status);
  }
  if (tmp) QSGD_CUDA_TRY(cudaFreeAsync(tmp, s));
  QSGD_CUDA_TRY(cudaGetLastError());
  return QSGD_OK;
}

static int32_t encode_impl(const float* x, uint64_t numel, const qsgd_config* cfg, uint8_t* out, uint64_t cap,
                           cudaStream_t s) {
  return encode_core(x, QSGD_DTYPE_F32, numel, cfg, nullptr, false, out, cap, s);
}

/* qsgd_decode_sum_cuda; reset_status false keeps *d_status as it is (a failure already there stays, and
 * makes the decode write nothing), for the steps that decode more than once. */
static int32_t decode_sum_impl(const uint8_t* const* d_payloads, const qsgd_header* headers, int32_t count,
                               float alpha, float* out, uint64_t n, int32_t accumulate, int32_t* d_status,
                               bool reset_status, cudaStream_t s, uint8_t* d_heads) {
  if (count < 1 || !d_payloads || !headers || !d_status || (n && !out)) return QSGD_E_ARG;
  const qsgd_header& h0 = headers[0];
  if (d_heads && h0.coding != QSGD_CODING_FIXED) return QSGD_E_ARG; /* (the headers checked on the device) */
  for (int p = 0; p < count; ++p) {
    const qsgd_header& h = headers[p];
    if (h.numel != n || h.fingerprint != h0.fingerprint || h.bits != h0.bits || h.coding != h0.coding ||
        h.bucket_size != h0.bucket_size || h.norm != h0.norm || h.dtype != h0.dtype)
      return QSGD_E_MISMATCH;
    if (h.coding == QSGD_CODING_FIXED && h.payload_len != fixed_nbytes(h.numel, h.bits, h.bucket_size))
      return QSGD_E_LENGTH;
    if (!d_payloads[p] || ((uintptr_t)d_payloads[p] & 3)) return QSGD_E_ARG;
  }
  const uint64_t nb = qsgd_num_buckets(n, h0.bucket_size);
  Jobs jobs;
  std::vector<PayloadJob> host_jobs(count);
  for (int p = 0; p < count; ++p)
    host_jobs[p] = PayloadJob{d_payloads[p], headers[p].payload_len, headers[p].checksum, nb, headers[p].flags,
                              d_heads ? 1u : 0u};
  /* one device allocation: the checksum sums, then (beyond kInlineJobs payloads) the jobs */
  const size_t sums_bytes = 8 * (size_t)count;
  const size_t jobs_off = (sums_bytes + 15) / 16 * 16;
  const bool inline_jobs = count <= kInlineJobs;
  uint8_t* scratch = nullptr;
  QSGD_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&scratch),
                                jobs_off + (inline_jobs ? 0 : sizeof(PayloadJob) * count), s));
  unsigned long long* d_sums = reinterpret_cast<unsigned long long*>(scratch);
  if (inline_jobs) {
    jobs.dev = nullptr;
    for (int p = 0; p < count; ++p) jobs.inl[p] = host_jobs[p];
  } else {
    PayloadJob* d_jobs = reinterpret_cast<PayloadJob*>(scratch + jobs_off);
    jobs.dev = d_jobs;
    QSGD_CUDA_TRY(cudaMemcpyAsync(d_jobs, host_jobs.data(), sizeof(PayloadJob) * count, cudaMemcpyHostToDevice, s));
  }
  QSGD_CUDA_TRY(cudaMemsetAsync(d_sums, 0, sums_bytes, s));
  if (reset_status) QSGD_CUDA_TRY(cudaMemsetAsync(d_status, 0, sizeof(int32_t), s));
  if (d_heads) QSGD_LAUNCH(expect_headers_kernel, blocks_for(count), kThreads, s)(jobs, count, h0, d_heads, d_status);
  const uint64_t work = umax64((h0.payload_len + 7) / 8, nb);
  dim3 grid((unsigned)umin64(blocks_for(work), 1024), (unsigned)count);
  QSGD_LAUNCH(verify_terms_kernel, grid, kThreads, s)(jobs, d_sums, d_status);
  const int elias = h0.coding == QSGD_CODING_ELIAS;
  QSGD_LAUNCH(verify_final_kernel, blocks_for(count), kThreads, s)(jobs, count, n, h0.bits, elias, d_sums, d_status);
  if (elias) {
    const uint64_t seg_buckets = h0.segment_buckets, nseg = (nb + seg_buckets - 1) / seg_buckets;
    float* acc = nullptr;
    QSGD_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&acc), 4 * n + 4, s));
    QSGD_CUDA_TRY(cudaMemsetAsync(acc, 0, 4 * n, s));
    if (nseg)
      QSGD_LAUNCH(elias_decode_kernel, blocks_for(nseg), kThreads, s)(jobs, count, n, h0.bucket_size, h0.bits,
                                                                     seg_buckets, nb, nseg, acc, d_status);
    if (n)
      QSGD_LAUNCH(finish_kernel, (unsigned)umin64(blocks_for(n), 4096), kThreads, s)(out, acc, n, alpha, accumulate,
                                                                                    d_status);
    QSGD_CUDA_TRY(cudaFreeAsync(acc, s));
    QSGD_CUDA_TRY(cudaFreeAsync(scratch, s));
    QSGD_CUDA_TRY(cudaGetLastError());
    return QSGD_OK;
  }
  const bool vec = ((uintptr_t)out & 15) == 0;
  QSGD_BITS_DISPATCH(h0.bits, launch_decode, jobs, count, n, h0.bucket_size, alpha, out, accumulate,
                     d_status, vec, s);
  QSGD_CUDA_TRY(cudaFreeAsync(scratch, s));
  QSGD_CUDA_TRY(cudaGetLastError());
  return QSGD_OK;
}
extern "C" int32_t qsgd_encode_cuda(const float* x, uint64_t numel, const qsgd_config* cfg,
                                    uint8_t* out, uint64_t cap, void* stream) {
  return encode_impl(x, numel, cfg, out, cap, static_cast<cudaStream_t>(stream));
}


extern "C" int32_t qsgd_decode_sum_cuda(const uint8_t* const* d_payloads, const qsgd_header* headers,
                                        int32_t count, float alpha, float* out, uint64_t n,
                                        int32_t accumulate, int32_t* d_status, uint8_t* d_heads, void* stream) {
  return decode_sum_impl(d_payloads, headers, count, alpha, out, n, accumulate, d_status, true,
                         static_cast<cudaStream_t>(stream), d_heads);
}

extern "C" int32_t qsgd_encode_ex_cuda(const void* x, int32_t x_dtype, uint64_t numel, const qsgd_config* cfg,
                                       float* residual, int32_t residual_valid, uint8_t* out, uint64_t cap,
                                       void* stream) {
  return encode_core(x, x_dtype, numel, cfg, residual, residual_valid != 0, out, cap, static_cast<cudaStream_t>(stream));
}

extern "C" int32_t qsgd_encode_elias_cuda(const void* x, int32_t x_dtype, uint64_t numel, const qsgd_config* cfg,
                                          uint8_t* out, uint64_t cap, uint64_t* out_len, void* stream) {
  int32_t st = qsgd_check_config(cfg);
  if (st != QSGD_OK) return st;
  if (cfg->coding != QSGD_CODING_ELIAS || !out_len) return QSGD_E_ARG;
  if (x_dtype != QSGD_DTYPE_F32 && x_dtype != QSGD_DTYPE_F16 && x_dtype != QSGD_DTYPE_BF16) return QSGD_E_ARG;
  if (!out || ((uintptr_t)out & 3) || (numel && !x) || numel > (1ull << 56)) return QSGD_E_ARG;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uint32_t B = cfg->bucket_size;
  const uint64_t nb = qsgd_num_buckets(numel, B);
  const uint64_t seg_buckets = B >= 32768u ? 1u : 32768u / B;
  const uint64_t nseg = (nb + seg_buckets - 1) / seg_buckets;
  const uint64_t fixed_part = QSGD_HEADER_BYTES + 4 * nb + 8 * nseg;
  /* a segment's stream is at most (bits bound) per element + 64 per bucket: its slot, in words */
  const uint64_t slot_words = (seg_buckets * B * qsgd_elias_bits_bound(cfg->bits) + 64 * seg_buckets) / 64 + 2;
  *out_len = QSGD_HEADER_BYTES + 4 * nb + 8 * nseg + (numel * qsgd_elias_bits_bound(cfg->bits) + 64 * nb) / 8 + 1 + nseg;
  if (cap < fixed_part) return QSGD_E_CAPACITY;
  /* scratch: the fp32 input (when x is not), the codes, the slots, the byte counts, the total */
  const uint64_t x32_bytes = x_dtype == QSGD_DTYPE_F32 ? 0 : (4 * numel + 15) / 16 * 16;
  const uint64_t codes_bytes = (numel + 15) / 16 * 16;
  const uint64_t slots_bytes = 8 * slot_words * nseg;
  uint8_t* scratch = nullptr;
  QSGD_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&scratch), x32_bytes + codes_bytes + slots_bytes + 8 * nseg + 8, s));
  const float* x32 = static_cast<const float*>(x);
  if (x32_bytes) {
    float* v = reinterpret_cast<float*>(scratch);
    const unsigned blocks = (unsigned)umin64(blocks_for(numel), 4096);
    if (x_dtype == QSGD_DTYPE_F16)
      QSGD_LAUNCH(to_f32_kernel<f16_t>, blocks, kThreads, s)(static_cast<const f16_t*>(x), nullptr, v, numel);
    else
      QSGD_LAUNCH(to_f32_kernel<bf16_t>, blocks, kThreads, s)(static_cast<const bf16_t*>(x), nullptr, v, numel);
    x32 = v;
  }
  uint8_t* codes = scratch + x32_bytes;
  uint64_t* slots = reinterpret_cast<uint64_t*>(codes + codes_bytes);
  uint64_t* seg_bytes = slots + slot_words * nseg;
  uint64_t* d_total = seg_bytes + nseg;
  float* scales = reinterpret_cast<float*>(out + QSGD_HEADER_BYTES);
  uint8_t* table = out + QSGD_HEADER_BYTES + 4 * nb;
  uint8_t* streams = table + 8 * nseg;
  if (nb) QSGD_LAUNCH(scales_kernel, blocks_for(nb * 32), kThreads, s)(x32, numel, B, cfg->norm, nb, scales);
  if (numel) {
    QSGD_BITS_DISPATCH(cfg->bits, launch_codes, x32, numel, B, cfg->seed, qsgd_encoder_of(cfg->flags) == 2, scales,
                       codes, s);
  }
  if (nseg)
    QSGD_LAUNCH(elias_write_kernel, blocks_for(nseg), kThreads, s)(codes, numel, B, cfg->bits, seg_buckets, nb, nseg,
                                                                  slots, slot_words, seg_bytes);
  QSGD_LAUNCH(elias_table_kernel, 1, 1, s)(seg_bytes, nseg, table, d_total);
  /* the one wait: the payload's length decides where it ends (and whether it fits) */
  uint64_t total = 0;
  QSGD_CUDA_TRY(cudaMemcpyAsync(&total, d_total, 8, cudaMemcpyDeviceToHost, s));
  QSGD_CUDA_TRY(cudaStreamSynchronize(s));
  const uint64_t len = fixed_part + total;
  *out_len = len;
  if (len > cap) {
    QSGD_CUDA_TRY(cudaFreeAsync(scratch, s));
    return QSGD_E_CAPACITY;
  }
  QSGD_LAUNCH(header_kernel, 1, 1, s)(Opening{out, *cfg, numel, len, (uint32_t)seg_buckets});
  if (nseg) QSGD_LAUNCH(elias_place_kernel, (unsigned)nseg, kThreads, s)(slots, slot_words, seg_bytes, table, streams);
  if (cfg->flags & QSGD_FLAG_CHECKSUM) {
    unsigned long long* slots = checksum_slots.get(s);
    if (!slots) {
      QSGD_CUDA_TRY(cudaFreeAsync(scratch, s));
      return QSGD_E_CUDA;
    }
    QSGD_CUDA_TRY(launch_checksum(out, len, checksum_rest(0, 0, 0), slots, s));
  }
  QSGD_CUDA_TRY(cudaFreeAsync(scratch, s));
  QSGD_CUDA_TRY(cudaGetLastError());
  return QSGD_OK;
}

/* ---- the chunk steps of scatter_allgather (qsgd.h; the CPU library's qsgd_chunks.cc) ---------- */

extern "C" int32_t qsgd_encode_chunks_cuda(const float* x, uint64_t numel, const qsgd_config* cfg, int32_t n,
                                           uint8_t* out, uint64_t cap, uint64_t* lens, void* stream) {
  int32_t st = qsgd_check_config(cfg);
  if (st != QSGD_OK) return st;
  if (cfg->coding != QSGD_CODING_FIXED || !out || !lens || n < 1 || (numel && !x)) return QSGD_E_ARG;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  uint64_t total = 0, b, e;
  for (int32_t j = 0; j < n; ++j) { /* every length first: nothing is launched when out is too small */
    if ((st = qsgd_chunk_bounds(numel, cfg->bucket_size, n, j, &b, &e)) != QSGD_OK) return st;
    lens[j] = fixed_nbytes(e - b, cfg->bits, cfg->bucket_size);
    total += lens[j];
  }
  if (cap < total) return QSGD_E_CAPACITY;
  uint64_t off = 0;
  for (int32_t j = 0; j < n; ++j) {
    qsgd_chunk_bounds(numel, cfg->bucket_size, n, j, &b, &e);
    qsgd_config c = *cfg;
    c.seed = qsgd_seed_of_chunk(cfg->seed, j, 0);
    uint8_t* dst = out + off;
    if ((uintptr_t)dst & 3) { /* a chunk after one of odd length: encode aligned, then copy into place */
      uint8_t* tmp = nullptr;
      QSGD_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&tmp), lens[j], s));
      if ((st = encode_impl(x + b, e - b, &c, tmp, lens[j], s)) != QSGD_OK) return st;
      QSGD_CUDA_TRY(cudaMemcpyAsync(dst, tmp, lens[j], cudaMemcpyDeviceToDevice, s));
      QSGD_CUDA_TRY(cudaFreeAsync(tmp, s));
    } else if ((st = encode_impl(x + b, e - b, &c, dst, lens[j], s)) != QSGD_OK) {
      return st;
    }
    off += lens[j];
  }
  return QSGD_OK;
}

extern "C" int32_t qsgd_reduce_chunk_cuda(const uint8_t* const* d_payloads, const qsgd_header* headers,
                                          int32_t count, const qsgd_config* cfg, int32_t j, float* scratch,
                                          uint64_t scratch_n, uint8_t* out, uint64_t cap, uint64_t* out_len,
                                          float* residual, uint64_t residual_n, int32_t* d_status, uint8_t* d_heads,
                                          void* stream) {
  if (!d_payloads || !headers || count < 1 || !cfg || j < 0 || !out || ((uintptr_t)out & 3) || !out_len || !d_status)
    return QSGD_E_ARG;
  int32_t st = qsgd_check_config(cfg);
  if (st != QSGD_OK) return st;
  if (cfg->coding != QSGD_CODING_FIXED) return QSGD_E_ARG;
  const uint64_t n = headers[0].numel;
  if (residual && residual_n != n) return QSGD_E_ARG;
  if (n > scratch_n || (n && !scratch)) return QSGD_E_CAPACITY;
  const uint64_t len = fixed_nbytes(n, cfg->bits, cfg->bucket_size);
  if (cap < len) return QSGD_E_CAPACITY;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  /* scratch = S, the sum of the payloads in rank order; with feedback v = S + residual */
  if ((st = decode_sum_impl(d_payloads, headers, count, 1.0f, scratch, n, 0, d_status, true, s, d_heads)) != QSGD_OK)
    return st;
  const unsigned blocks = (unsigned)umin64(blocks_for(n), 4096);
  if (residual && n) QSGD_LAUNCH(add_kernel, blocks, kThreads, s)(scratch, residual, n);
  qsgd_config c = *cfg;
  c.seed = qsgd_seed_of_chunk(cfg->seed, j, 1);
  if ((st = encode_impl(scratch, n, &c, out, cap, s)) != QSGD_OK) return st;
  *out_len = len;
  if (!residual) return QSGD_OK;
  /* scratch = v + (-1) * decode(q), then residual = scratch where finite. q is this step's own
   * payload: its header is known here, and its checksum need not be verified. */
  qsgd_header h{};
  h.magic = QSGD_MAGIC;
  h.version = QSGD_WIRE_VERSION;
  h.coding = QSGD_CODING_FIXED;
  h.bits = (uint8_t)c.bits;
  h.norm = (uint8_t)c.norm;
  h.dtype = (uint8_t)c.dtype;
  h.flags = (uint8_t)(c.flags & ~(uint32_t)QSGD_FLAG_CHECKSUM);
  h.bucket_size = c.bucket_size;
  h.numel = n;
  h.payload_len = len;
  h.fingerprint = c.fingerprint;
  const uint8_t* q = out;
  if ((st = decode_sum_impl(&q, &h, 1, -1.0f, scratch, n, 1, d_status, false, s)) != QSGD_OK) return st;
  if (n) QSGD_LAUNCH(keep_finite_kernel, blocks, kThreads, s)(scratch, residual, n, d_status);
  QSGD_CUDA_TRY(cudaGetLastError());
  return QSGD_OK;
}

extern "C" int32_t qsgd_decode_chunks_cuda(const uint8_t* const* d_payloads, const qsgd_header* headers, int32_t n,
                                           float alpha, float* out, uint64_t numel, uint32_t bucket_size,
                                           int32_t* d_status, uint8_t* d_heads, void* stream) {
  if (!d_payloads || !headers || n < 1 || (numel && !out) || !d_status) return QSGD_E_ARG;
  uint64_t b, e;
  int32_t st;
  for (int32_t j = 0; j < n; ++j) { /* every header first: nothing is launched on a mismatch */
    if ((st = qsgd_chunk_bounds(numel, bucket_size, n, j, &b, &e)) != QSGD_OK) return st;
    if (headers[j].numel != e - b || headers[j].bucket_size != bucket_size) return QSGD_E_MISMATCH;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  QSGD_CUDA_TRY(cudaMemsetAsync(d_status, 0, sizeof(int32_t), s));
  for (int32_t j = 0; j < n; ++j) {
    qsgd_chunk_bounds(numel, bucket_size, n, j, &b, &e);
    uint8_t* heads = d_heads ? d_heads + (uint64_t)QSGD_HEADER_BYTES * j : nullptr;
    if ((st = decode_sum_impl(d_payloads + j, headers + j, 1, alpha, out + b, e - b, 0, d_status, false, s, heads)) !=
        QSGD_OK)
      return st;
  }
  return QSGD_OK;
}
