/*
 * CPU implementation of the codec (fixed-width coding, header, checksum, decode-and-accumulate),
 * multi-threaded with OpenMP; the per-element loops are qsgd_cpu_isa.cc's, one copy per
 * instruction-set variant, chosen here at the first call (active_kernels).
 *
 * Work is split into chunks of whole buckets whose first element is a multiple of 8, so every
 * chunk owns whole bytes of the packed stream (8 codes of b bits are exactly b bytes) and threads
 * never share an output byte.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xmmintrin.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>

#include "qsgd.h"
#include "qsgd_cpu_internal.h"
#include "qsgd_math.h"

namespace qsgd_cpu {

static std::atomic<int> g_threads{0};
static const uint64_t kStage = 4096;          /* codes staged before packing (multiple of 8) */
static const uint64_t kChunkElems = 1 << 15;  /* target elements per parallel chunk */
static const uint64_t kParallelMin = 1 << 16; /* smaller jobs run on the calling thread */
static const uint64_t kPrefetch = 512;        /* encode: elements read ahead of the next bucket */

/* Decoded results of at least this many bytes are written with streaming stores (qsgd.h:
 * qsgd_set_stream_bytes); 0 until first asked: then the default */
static std::atomic<uint64_t> g_stream_bytes{0};

static uint64_t default_stream_bytes() {
  /* 3/8 of the last-level cache, as the C library's memcpy decides where to stream (a result larger
   * than that leaves the cache before it is read again, and writing it through the cache reads each
   * of its lines from memory first); 32 MiB where the size is unknown */
  long llc = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
  llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (llc <= 0) llc = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
  return llc > 0 ? (uint64_t)llc / 8 * 3 : (uint64_t)32 << 20;
}

static uint64_t stream_bytes() {
  uint64_t b = g_stream_bytes.load();
  if (b == 0) {
    b = default_stream_bytes();
    uint64_t unset = 0;
    g_stream_bytes.compare_exchange_strong(unset, b);
    b = g_stream_bytes.load();
  }
  return b;
}

int threads_for(uint64_t n) {
  if (n < kParallelMin) return 1;
  int t = g_threads.load();
  return t > 0 ? t : omp_get_max_threads();
}

IeeeFpScope::IeeeFpScope() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~0x8040u); }
IeeeFpScope::~IeeeFpScope() { _mm_setcsr(saved); }

/* ---- the instruction-set variants ------------------------------------------------------------
 * qsgd_cpu_isa.cc compiled once per variant (setup.py: ISA_VARIANTS), narrowest first. */
#if defined(__x86_64__) || defined(_M_X64)
extern const Kernels kernels_baseline, kernels_sse4, kernels_avx2, kernels_avx512;
static const Kernels* const kVariants[] = {&kernels_baseline, &kernels_sse4, &kernels_avx2, &kernels_avx512};

/* What the CPU and the OS support: CPUID for the instructions each variant's -march level may emit
 * (x86-64-v2 for sse4, v3 for avx2, v4 for avx512), XGETBV for the register state the OS saves. */
static bool variant_runs(int v) {
  if (v == 0) return true;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const unsigned c1 = c;
  /* x86-64-v2: SSE3, SSSE3, CX16, SSE4.1, SSE4.2, POPCNT; LAHF/SAHF in 64-bit mode */
  const unsigned v2 = (1u << 0) | (1u << 9) | (1u << 13) | (1u << 19) | (1u << 20) | (1u << 23);
  if ((c1 & v2) != v2) return false;
  if (!__get_cpuid(0x80000001, &a, &b, &c, &d) || !(c & 1u)) return false;
  const unsigned c81 = c;
  if (v == 1) return true;
  /* x86-64-v3: FMA, MOVBE, XSAVE, OSXSAVE, AVX, F16C; LZCNT; BMI1, AVX2, BMI2 */
  const unsigned v3 = (1u << 12) | (1u << 22) | (1u << 26) | (1u << 27) | (1u << 28) | (1u << 29);
  if ((c1 & v3) != v3 || !(c81 & (1u << 5))) return false;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 0, a, b, c, d);
  const unsigned b7 = b;
  if ((b7 & ((1u << 3) | (1u << 5) | (1u << 8))) != ((1u << 3) | (1u << 5) | (1u << 8))) return false;
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & 0x6u) != 0x6u) return false; /* XMM and YMM state */
  if (v == 2) return true;
  /* x86-64-v4: AVX512F, AVX512DQ, AVX512CD, AVX512BW, AVX512VL; opmask, ZMM_Hi256 and Hi16_ZMM state */
  const unsigned need7 = (1u << 16) | (1u << 17) | (1u << 28) | (1u << 30) | (1u << 31);
  return (b7 & need7) == need7 && (lo & 0xE0u) == 0xE0u;
}
#else
extern const Kernels kernels_generic;
static const Kernels* const kVariants[] = {&kernels_generic};
static bool variant_runs(int) { return true; }
#endif
static const int kNumVariants = (int)(sizeof(kVariants) / sizeof(kVariants[0]));

static int best_variant() {
  int best = 0;
  for (int v = 1; v < kNumVariants; ++v)
    if (variant_runs(v)) best = v;
  return best;
}

static int find_variant(const char* name) {
  for (int v = 0; v < kNumVariants; ++v)
    if (strcmp(name, kVariants[v]->name) == 0) return v;
  return -1;
}

/* HVD_QSGD_ISA=<name> forces a variant; unset, empty or "auto" is the best one. A name this
 * library does not have, or one this CPU cannot run, leaves the best one in use and makes
 * qsgd_cpu_isa_env_status() say so (the bindings turn that into an error). */
static int32_t g_env_status = QSGD_OK;
static std::atomic<const Kernels*> g_active{nullptr};

static const Kernels* initial_variant() {
  const char* env = getenv("HVD_QSGD_ISA");
  if (env && *env && strcmp(env, "auto") != 0) {
    const int v = find_variant(env);
    if (v < 0) g_env_status = QSGD_E_ARG;
    else if (!variant_runs(v)) g_env_status = QSGD_E_ISA;
    else return kVariants[v];
  }
  return kVariants[best_variant()];
}

const Kernels& active_kernels() {
  const Kernels* k = g_active.load(std::memory_order_acquire);
  if (k) return *k;
  static const Kernels* const first = initial_variant(); /* thread-safe, once */
  const Kernels* expected = nullptr;
  g_active.compare_exchange_strong(expected, first, std::memory_order_acq_rel);
  return *g_active.load(std::memory_order_acquire);
}

float bucket_scale(const float* x, uint64_t n, int norm) { return active_kernels().bucket_scale(x, n, norm); }

/* fn(offset, m, i) for the pieces [offset, offset + m) of elements i0 .. i0+n-1 that lie in one page
 * of 2^32 elements each (i = i0 + offset): the random stream is keyed per page, so no quantizer
 * call crosses one */
template <class F>
static void for_each_page(uint64_t n, uint64_t i0, F&& fn) {
  for (uint64_t off = 0; off < n;) {
    const uint64_t i = i0 + off, page_end = ((i >> 32) + 1) << 32;
    const uint64_t m = std::min<uint64_t>(n - off, page_end - i);
    fn(off, m, i);
    off += m;
  }
}

static void quantize_run_with(const Kernels& K, const float* x, uint64_t n, uint64_t i0, uint64_t seed,
                              float scale, int bits, int encoder, uint8_t* codes) {
  if (!qsgd_scale_quantizes(scale)) {
    memset(codes, 0, n);
    return;
  }
  for_each_page(n, i0, [&](uint64_t off, uint64_t m, uint64_t i) {
    K.quantize(x + off, m, qsgd_page_key(seed, i), (uint32_t)i, scale, bits, encoder, codes + off);
  });
}

/* quantize_run then pack, for a run starting at a multiple of 8 (Kernels::quantize_packed; pages
 * start at multiples of 8 too, so each piece's packed bytes start at a byte) */
static void quantize_packed_run(const Kernels& K, const float* x, uint64_t n, uint64_t i0, uint64_t seed,
                                float scale, int bits, uint8_t* dst) {
  if (!qsgd_scale_quantizes(scale)) {
    memset(dst, 0, qsgd_packed_bytes(n, bits));
    return;
  }
  for_each_page(n, i0, [&](uint64_t off, uint64_t m, uint64_t i) {
    K.quantize_packed(x + off, m, qsgd_page_key(seed, i), (uint32_t)i, scale, bits, dst + off / 8 * bits);
  });
}

void quantize_run(const float* x, uint64_t n, uint64_t i0, uint64_t seed, float scale, int bits, int encoder,
                  uint8_t* codes) {
  quantize_run_with(active_kernels(), x, n, i0, seed, scale, bits, encoder, codes);
}

static void sign_run_with(const Kernels& K, const float* x, uint64_t n, float scale, uint8_t* codes) {
  if (!qsgd_scale_quantizes(scale)) memset(codes, 0, n);
  else K.sign(x, n, codes);
}

int32_t check_scales(const uint8_t* scales, uint64_t nb) {
  for (uint64_t b = 0; b < nb; ++b) {
    const uint32_t u = (uint32_t)qsgd_load_le(scales + 4 * b, 4);
    /* the sign bit set on anything but a NaN is a negative scale (including -0) */
    if ((u & 0x80000000u) && (u & 0x7FFFFFFFu) <= 0x7F800000u) return QSGD_E_SCALE;
  }
  return QSGD_OK;
}

}  // namespace qsgd_cpu

using namespace qsgd_cpu;

extern "C" const char* qsgd_cpu_isa(void) { return active_kernels().name; }

extern "C" int32_t qsgd_cpu_isa_count(void) { return kNumVariants; }

extern "C" const char* qsgd_cpu_isa_name(int32_t i) {
  return i >= 0 && i < kNumVariants ? kVariants[i]->name : nullptr;
}

extern "C" int32_t qsgd_cpu_isa_supported(int32_t i) { return i >= 0 && i < kNumVariants && variant_runs(i); }

extern "C" int32_t qsgd_set_cpu_isa(const char* name) {
  active_kernels(); /* the first choice is made (and HVD_QSGD_ISA read) before any change */
  int v = -1;
  if (!name || !*name || strcmp(name, "auto") == 0) v = best_variant();
  else v = find_variant(name);
  if (v < 0) return QSGD_E_ARG;
  if (!variant_runs(v)) return QSGD_E_ISA;
  g_active.store(kVariants[v], std::memory_order_release);
  return QSGD_OK;
}

extern "C" int32_t qsgd_cpu_isa_env_status(void) {
  active_kernels();
  return g_env_status;
}

/* ---- sizes ------------------------------------------------------------------------------ */
extern "C" int32_t qsgd_abi_version(void) { return QSGD_ABI_VERSION; }

extern "C" int32_t qsgd_levels(int32_t bits) { return qsgd_levels_of(bits); }

extern "C" uint64_t qsgd_fixed_nbytes(uint64_t numel, int32_t bits, uint32_t bucket) {
  if (bits < 1 || bits > 8 || bucket < 1 || bucket > QSGD_MAX_BUCKET) return 0;
  return QSGD_HEADER_BYTES + 4 * qsgd_num_buckets(numel, bucket) + qsgd_packed_bytes(numel, bits);
}

extern "C" uint32_t qsgd_elias_segment_buckets(uint32_t bucket) {
  if (bucket < 1) return 0;
  return bucket >= 32768u ? 1u : 32768u / bucket;
}

extern "C" uint64_t qsgd_elias_max_nbytes(uint64_t numel, int32_t bits, uint32_t bucket) {
  if (bits < 2 || bits > 8 || bucket < 1 || bucket > QSGD_MAX_BUCKET) return 0;
  const uint64_t nb = qsgd_num_buckets(numel, bucket);
  const uint64_t seg = qsgd_elias_segment_buckets(bucket);
  const uint64_t nseg = (nb + seg - 1) / seg;
  /* per element <= elias_max_bits_per_element bits, per bucket <= 64 bits of count, and up to
   * 7 bits of padding per segment */
  const uint64_t stream_bits = numel * elias_max_bits_per_element(bits) + 64 * nb;
  return QSGD_HEADER_BYTES + 4 * nb + 8 * nseg + stream_bits / 8 + 1 + nseg;
}

/* ---- header ------------------------------------------------------------------------------- */
extern "C" int32_t qsgd_parse_header(const uint8_t* p, uint64_t len, qsgd_header* h) {
  if (!p || !h) return QSGD_E_ARG;
  if (len < QSGD_HEADER_BYTES) return QSGD_E_TRUNCATED;
  h->magic = (uint32_t)qsgd_load_le(p, 4);
  h->version = p[4], h->coding = p[5], h->bits = p[6], h->norm = p[7], h->dtype = p[8];
  h->flags = p[9];
  h->reserved0 = (uint16_t)qsgd_load_le(p + 10, 2);
  h->bucket_size = (uint32_t)qsgd_load_le(p + 12, 4);
  h->numel = qsgd_load_le(p + 16, 8);
  h->payload_len = qsgd_load_le(p + 24, 8);
  h->fingerprint = qsgd_load_le(p + 32, 8);
  h->segment_buckets = (uint32_t)qsgd_load_le(p + 40, 4);
  h->reserved1 = (uint32_t)qsgd_load_le(p + 44, 4);
  h->checksum = qsgd_load_le(p + 48, 8);
  if (h->magic != QSGD_MAGIC) return QSGD_E_MAGIC;
  if (h->version != QSGD_WIRE_VERSION) return QSGD_E_VERSION;
  if (h->coding > QSGD_CODING_ELIAS || h->bits < 1 || h->bits > 8 || h->norm > QSGD_NORM_SIGN ||
      h->dtype > QSGD_DTYPE_BF16 || (h->flags & ~(QSGD_FLAG_CHECKSUM | QSGD_FLAG_ENCODER2)) || h->reserved0 ||
      h->reserved1 || h->bucket_size < 1 || h->bucket_size > QSGD_MAX_BUCKET ||
      h->numel > (1ull << 56) || !qsgd_combination_ok(h->bits, h->coding, h->norm))
    return QSGD_E_HEADER;
  if (h->coding == QSGD_CODING_FIXED) {
    if (h->segment_buckets != 0) return QSGD_E_HEADER;
    if (h->payload_len != qsgd_fixed_nbytes(h->numel, h->bits, h->bucket_size)) return QSGD_E_LENGTH;
  } else {
    if (h->segment_buckets != qsgd_elias_segment_buckets(h->bucket_size)) return QSGD_E_HEADER;
    const uint64_t nb = qsgd_num_buckets(h->numel, h->bucket_size);
    const uint64_t nseg = (nb + h->segment_buckets - 1) / h->segment_buckets;
    const uint64_t min_len = QSGD_HEADER_BYTES + 4 * nb + 8 * nseg;
    if (h->payload_len < min_len ||
        h->payload_len > qsgd_elias_max_nbytes(h->numel, h->bits, h->bucket_size))
      return QSGD_E_LENGTH;
  }
  if (h->payload_len > len) return QSGD_E_TRUNCATED;
  return QSGD_OK;
}

/* The checksum's sum of terms over a whole payload, given per chunk c the sum of the terms of the
 * words [chunks[3c+1], chunks[3c+2]) in chunks[3c] (sorted, disjoint ranges of whole words): those
 * sums, the terms of the words between the ranges, and the zero-padded last partial word. */
static uint64_t checksum_with_chunks(const Kernels& K, const uint8_t* p, uint64_t len, const uint64_t* chunks,
                                     uint64_t nchunks) {
  const uint64_t words = len / 8;
  uint64_t sum = 0, k = 0;
  for (uint64_t c = 0; c < nchunks; ++c) {
    sum += K.checksum_terms(p, k, chunks[3 * c + 1]) + chunks[3 * c];
    k = chunks[3 * c + 2];
  }
  sum += K.checksum_terms(p, k, words);
  if (len % 8) sum += qsgd_checksum_term(qsgd_load_le(p + 8 * words, (int)(len % 8)), words);
  return sum;
}

extern "C" uint64_t qsgd_checksum_cpu(const uint8_t* p, uint64_t len) {
  const Kernels& K = active_kernels();
  const uint64_t words = len / 8, per = 1 << 14; /* words per parallel range */
  const uint64_t nranges = (words + per - 1) / per;
  uint64_t sum = 0;
  const int nt = threads_for(len / 4);
  if (nt <= 1 || nranges <= 1) { /* on the calling thread (see parallel_for_with_scratch) */
    for (uint64_t r = 0; r < nranges; ++r) sum += K.checksum_terms(p, r * per, std::min(words, (r + 1) * per));
  } else {
#pragma omp parallel for num_threads(nt) reduction(+ : sum) schedule(static)
    for (uint64_t r = 0; r < nranges; ++r) sum += K.checksum_terms(p, r * per, std::min(words, (r + 1) * per));
  }
  if (len % 8) sum += qsgd_checksum_term(qsgd_load_le(p + 8 * words, (int)(len % 8)), words);
  return qsgd_checksum_final(sum, len);
}

/* The tensor that qsgd_encode_segments_cpu encodes: segment i's counts[i] elements at offsets[i]
 * (sorted, apart), zeros elsewhere. */
struct Segments {
  const float* const* srcs;
  const uint64_t* offsets;
  const uint64_t* counts;
  int32_t n;
};
static const uint64_t kSegmentBucketMax = 1 << 16; /* the largest bucket a segmented encode pads */

/* Elements [lo, hi) of a segmented tensor, hi - lo <= the bucket size: a pointer into the segment
 * that holds them all, else padded[0:hi-lo) filled with them (zeros where no segment is). *s: the
 * first segment that may hold lo, advanced (buckets are asked for in order). */
static const float* segment_span(const Segments& g, int32_t* s, uint64_t lo, uint64_t hi, float* padded) {
  while (*s < g.n && g.offsets[*s] + g.counts[*s] <= lo) ++*s;
  if (*s < g.n && g.offsets[*s] <= lo && hi <= g.offsets[*s] + g.counts[*s]) return g.srcs[*s] + (lo - g.offsets[*s]);
  memset(padded, 0, sizeof(float) * (hi - lo));
  for (int32_t t = *s; t < g.n && g.offsets[t] < hi; ++t) {
    const uint64_t a = std::max(lo, g.offsets[t]), b = std::min(hi, g.offsets[t] + g.counts[t]);
    if (a < b) memcpy(padded + (a - lo), g.srcs[t] + (a - g.offsets[t]), sizeof(float) * (b - a));
  }
  return padded;
}

/* Buckets per parallel chunk of the fixed coding's encode: chunks of whole buckets starting at
 * multiples of 8 elements, about kChunkElems elements */
static uint64_t encode_chunk_buckets(uint64_t B) {
  uint64_t g = 1; /* g = 8 / gcd(B, 8): the fewest buckets spanning a multiple of 8 elements */
  while ((g * B) % 8) g *= 2;
  const uint64_t chunk_buckets = std::max<uint64_t>(1, kChunkElems / B);
  return (chunk_buckets + g - 1) / g * g;
}

/* The error feedback of an encode (qsgd_encode_ef_cpu): the residual added to x (when valid) and
 * replaced by v - decode(q) where that is finite. */
struct Feedback {
  float* residual;  /* float32[numel]; or, with segs, nullptr */
  bool valid;
  /* a segmented tensor's (qsgd_encode_segments_ef_cpu): x's segments, and segment i's residual
   * residuals[i] (float32[counts[i]]); the residual is 0 outside them and not kept there */
  const Segments* segs = nullptr;
  float* const* residuals = nullptr;
};
/* The most elements a fused error-feedback encode stages per chunk (a chunk is at least one bucket,
 * up to 8 of an odd size; longer chunks take the composed path, qsgd_encode_ef_cpu) */
static const uint64_t kFeedbackChunkMax = 1 << 20;

/* v[0:n) = x + residual (x alone when the residual is not valid), in fp32 */
static void feedback_add(const float* x, const Feedback& fb, uint64_t n, float* v) {
  if (!fb.valid) {
    if (n) memcpy(v, x, sizeof(float) * n); /* x may be null when n is 0 */
    return;
  }
  const float* r = fb.residual;
  for (uint64_t i = 0; i < n; ++i) v[i] = x[i] + r[i];
}

/* residual[0:n) = d where d is finite; elsewhere it keeps its value (0 when it was not valid) */
static void feedback_keep(const Feedback& fb, const float* d, uint64_t n) {
  float* r = fb.residual;
  if (fb.valid) {
    for (uint64_t i = 0; i < n; ++i) r[i] = std::isfinite(d[i]) ? d[i] : r[i];
  } else {
    for (uint64_t i = 0; i < n; ++i) r[i] = std::isfinite(d[i]) ? d[i] : 0.0f;
  }
}

/* The segments of g that hold elements of [lo, hi), as (segment t, its first element a and end b
 * inside [lo, hi)) to fn, in order; the first found by bisection (segments are sorted and apart). */
template <typename Fn>
static void segments_in(const Segments& g, uint64_t lo, uint64_t hi, Fn fn) {
  int32_t t = 0, n = g.n;
  while (n > 0) { /* the first segment that ends after lo */
    const int32_t half = n / 2;
    if (g.offsets[t + half] + g.counts[t + half] <= lo) t += half + 1, n -= half + 1;
    else n = half;
  }
  for (; t < g.n && g.offsets[t] < hi; ++t) {
    const uint64_t a = std::max(lo, g.offsets[t]), b = std::min(hi, g.offsets[t] + g.counts[t]);
    if (a < b) fn(t, a, b);
  }
}

/* v[0:e1-e0) = elements [e0, e1) of x + residual (feedback_add), x and the residual whole or
 * segmented (zeros outside the segments) */
static void feedback_add_range(const float* x, const Feedback& fb, uint64_t e0, uint64_t e1, float* v) {
  if (!fb.segs) {
    feedback_add(x + e0, Feedback{fb.residual + e0, fb.valid}, e1 - e0, v);
    return;
  }
  const Segments& g = *fb.segs;
  memset(v, 0, sizeof(float) * (e1 - e0));
  segments_in(g, e0, e1, [&](int32_t t, uint64_t a, uint64_t b) {
    const uint64_t at = a - g.offsets[t];
    feedback_add(g.srcs[t] + at, Feedback{fb.residuals[t] + at, fb.valid}, b - a, v + (a - e0));
  });
}

/* the residual of elements [e0, e1) from d[0:e1-e0) (feedback_keep), whole or segmented */
static void feedback_keep_range(const Feedback& fb, const float* d, uint64_t e0, uint64_t e1) {
  if (!fb.segs) {
    feedback_keep(Feedback{fb.residual + e0, fb.valid}, d, e1 - e0);
    return;
  }
  const Segments& g = *fb.segs;
  segments_in(g, e0, e1, [&](int32_t t, uint64_t a, uint64_t b) {
    feedback_keep(Feedback{fb.residuals[t] + (a - g.offsets[t]), fb.valid}, d + (a - e0), b - a);
  });
}

/* ---- encode (fixed) ------------------------------------------------------------------------
 * Parallel over chunks of whole buckets starting at multiples of 8 elements: per bucket the scale
 * (one read of x from memory; the bucket then sits in L1), the codes into a staging buffer in L1,
 * packed into the payload every kStage codes (or, where the variant has Kernels::quantize_packed,
 * quantized and packed straight into the payload). With the checksum, each chunk adds up the terms of
 * the payload words wholly inside its packed bytes while they are in cache; the header, the
 * scales and the words straddling two chunks are added at the end. */
static int32_t encode_fixed(const float* x, uint64_t numel, const qsgd_config* cfg, uint8_t* out,
                            uint64_t cap, uint64_t* out_len, const Segments* segs = nullptr,
                            const Feedback* fb = nullptr) {
  const uint64_t need = qsgd_fixed_nbytes(numel, cfg->bits, cfg->bucket_size);
  if (out_len) *out_len = need;
  if (cap < need) return QSGD_E_CAPACITY;
  if (numel && !x && !segs && !(fb && fb->segs)) return QSGD_E_ARG;
  const Kernels& K = active_kernels();
  qsgd_write_header(out, cfg, numel, need, 0);
  uint8_t* scales = out + QSGD_HEADER_BYTES;
  const uint64_t B = cfg->bucket_size, nb = qsgd_num_buckets(numel, cfg->bucket_size);
  uint8_t* data = scales + 4 * nb;
  const uint64_t data_off = (uint64_t)(data - out);
  const int bits = cfg->bits;
  const bool checksum = (cfg->flags & QSGD_FLAG_CHECKSUM) != 0;
  const int encoder = qsgd_encoder_of(cfg->flags);
  /* buckets of whole groups of 8 codes: each bucket's packed bytes are its own */
  const bool packed = K.quantize_packed && encoder == 2 && bits >= 2 && cfg->norm != QSGD_NORM_SIGN &&
                      cfg->bucket_size % 8 == 0;
  const uint64_t chunk_buckets = encode_chunk_buckets(B);
  const uint64_t nchunks = (nb + chunk_buckets - 1) / chunk_buckets;
  /* per chunk: the checksum terms of its whole words, and the word range they cover */
  uint64_t* sums = nullptr;
  if (checksum && nchunks) {
    sums = (uint64_t*)malloc(sizeof(uint64_t) * 3 * nchunks);
    if (!sums) return QSGD_E_NOMEM;
  }
  const int nt = threads_for(numel);
  /* per thread: the staged codes, then (segments) one bucket padded with zeros, or (feedback) the
   * chunk's v and a decode accumulator of kStage values */
  const uint64_t chunk_elems = chunk_buckets * B;
  const size_t scratch_bytes =
      kStage + (segs ? sizeof(float) * B : 0) + (fb ? sizeof(float) * (chunk_elems + kStage) : 0);
  const int32_t status = parallel_for_with_scratch(nt, nchunks, scratch_bytes, [&](uint64_t c, void* scratch) {
    uint8_t* stage = (uint8_t*)scratch;
    const uint64_t b0 = c * chunk_buckets, b1 = std::min(nb, b0 + chunk_buckets);
    uint64_t pos = b0 * B, staged = 0;
    int32_t seg = 0;
    /* feedback: v of elements [e0, e1), encoded from here, then v - decode(q) */
    const uint64_t e0 = b0 * B, e1 = std::min(numel, b1 * B);
    float* v = fb ? (float*)(stage + kStage) : nullptr;
    if (fb) feedback_add_range(x, *fb, e0, e1, v);
    for (uint64_t b = b0; b < b1; ++b) {
      const uint64_t lo = b * B, hi = std::min(numel, lo + B);
      /* x a bucket and kPrefetch elements ahead on its way from memory while this bucket is worked
       * on (measured: encode ~8% faster; long buckets are left to the hardware prefetcher); the
       * one-pass quantize_packed prefetches from its own loop instead */
      if (B <= kStage && !packed && !segs && !fb)
        for (uint64_t i = hi + kPrefetch; i < std::min(numel, hi + B + kPrefetch); i += 16) __builtin_prefetch(x + i);
      /* xb[k]: element lo + k */
      const float* xb = fb ? v + (lo - e0) : segs ? segment_span(*segs, &seg, lo, hi, (float*)(stage + kStage)) : x + lo;
      const float scale = K.bucket_scale(xb, hi - lo, cfg->norm);
      store_scale(scales, b, scale);
      if (packed) { /* quantized and packed in one pass (encoder 2; the avx2 and avx512 variants) */
        quantize_packed_run(K, xb, hi - lo, lo, cfg->seed, scale, bits, data + lo / 8 * bits);
        continue;
      }
      if (bits == 8) { /* 8-bit codes are their own packing: straight into the payload */
        quantize_run_with(K, xb, hi - lo, lo, cfg->seed, scale, bits, encoder, data + lo);
        continue;
      }
      for (uint64_t i = lo; i < hi;) {
        const uint64_t take = std::min(hi - i, kStage - staged);
        if (cfg->norm == QSGD_NORM_SIGN) sign_run_with(K, xb + (i - lo), take, scale, stage + staged);
        else quantize_run_with(K, xb + (i - lo), take, i, cfg->seed, scale, bits, encoder, stage + staged);
        staged += take, i += take;
        if (staged == kStage) {
          K.pack(bits, stage, kStage, data + pos / 8 * bits);
          pos += kStage, staged = 0;
        }
      }
    }
    if (staged) K.pack(bits, stage, staged, data + pos / 8 * bits);
    if (fb) { /* v = v + (-1) * decode(q), as qsgd_decode_sum_cpu's accumulate gives it (the stage
               * holds the codes of each step: its own are packed), then kept where finite */
      float* acc = v + chunk_elems;
      const uint8_t* data_end = data + qsgd_packed_bytes(numel, bits);
      for (uint64_t lo = e0; lo < e1; lo += kStage)
        K.decode_step(bits, data, data_end, scales, B, lo, std::min(kStage, e1 - lo), stage, acc, 1, FIN_ACCUMULATE,
                      v + (lo - e0), -1.0f);
      feedback_keep_range(*fb, v, e0, e1);
    }
    if (sums) {
      /* this chunk's packed bytes [d0, d1) of the payload; the words wholly inside them */
      const uint64_t d0 = data_off + b0 * B / 8 * bits;
      const uint64_t d1 = data_off + qsgd_packed_bytes(std::min(numel, b1 * B), bits);
      const uint64_t k0 = std::min((d0 + 7) / 8, d1 / 8), k1 = d1 / 8;
      sums[3 * c] = K.checksum_terms(out, k0, k1);
      sums[3 * c + 1] = k0, sums[3 * c + 2] = k1;
    }
  });
  if (status == QSGD_OK && checksum)
    qsgd_store_le(out + 48, qsgd_checksum_final(checksum_with_chunks(K, out, need, sums, nchunks), need), 8);
  free(sums);
  return status;
}

/* QSGD_OK when a segmented encode can take these arguments: the fixed coding, buckets it pads, the
 * segments sorted, apart and inside the tensor, each with its source (and its residual when
 * residuals is not null) */
static int32_t check_segments(const float* const* srcs, float* const* residuals, const uint64_t* offsets,
                              const uint64_t* counts, int32_t nseg, uint64_t numel, const qsgd_config* cfg,
                              const uint8_t* out) {
  const int32_t st = qsgd_check_config(cfg);
  if (st != QSGD_OK) return st;
  if (!out || numel > (1ull << 56) || nseg < 0 || (nseg && (!srcs || !offsets || !counts)) ||
      cfg->coding != QSGD_CODING_FIXED || cfg->bucket_size > kSegmentBucketMax)
    return QSGD_E_ARG;
  uint64_t end = 0;
  for (int32_t i = 0; i < nseg; ++i) {
    if (offsets[i] < end || counts[i] > numel || offsets[i] > numel - counts[i] || (counts[i] && !srcs[i]) ||
        (residuals && counts[i] && !residuals[i]))
      return QSGD_E_ARG;
    end = offsets[i] + counts[i];
  }
  return QSGD_OK;
}

extern "C" int32_t qsgd_encode_segments_cpu(const float* const* srcs, const uint64_t* offsets,
                                            const uint64_t* counts, int32_t nseg, uint64_t numel,
                                            const qsgd_config* cfg, uint8_t* out, uint64_t cap,
                                            uint64_t* out_len) {
  const int32_t st = check_segments(srcs, nullptr, offsets, counts, nseg, numel, cfg, out);
  if (st != QSGD_OK) return st;
  const Segments segs{srcs, offsets, counts, nseg};
  return encode_fixed(nullptr, numel, cfg, out, cap, out_len, &segs);
}

extern "C" int32_t qsgd_encode_segments_ef_cpu(const float* const* srcs, float* const* residuals,
                                               const uint64_t* offsets, const uint64_t* counts, int32_t nseg,
                                               uint64_t numel, const qsgd_config* cfg, int32_t residual_valid,
                                               uint8_t* out, uint64_t cap, uint64_t* out_len) {
  if (!out_len || (nseg > 0 && !residuals)) return QSGD_E_ARG;
  const int32_t st = check_segments(srcs, residuals, offsets, counts, nseg, numel, cfg, out);
  if (st != QSGD_OK) return st;
  const Segments segs{srcs, offsets, counts, nseg};
  Feedback fb{nullptr, residual_valid != 0};
  fb.segs = &segs;
  fb.residuals = residuals;
  /* (a chunk of buckets of at most kSegmentBucketMax elements stays under kFeedbackChunkMax) */
  return encode_fixed(nullptr, numel, cfg, out, cap, out_len, nullptr, &fb);
}

extern "C" int32_t qsgd_encode_cpu(const float* x, uint64_t numel, const qsgd_config* cfg,
                                   uint8_t* out, uint64_t cap, uint64_t* out_len) {
  const int32_t st = qsgd_check_config(cfg);
  if (st != QSGD_OK) return st;
  if (!out || numel > (1ull << 56)) return QSGD_E_ARG;
  if (cfg->coding == QSGD_CODING_ELIAS) return elias_encode(x, numel, cfg, out, cap, out_len);
  return encode_fixed(x, numel, cfg, out, cap, out_len);
}

/* qsgd_encode_ef_cpu where a chunk would stage too much (long buckets) or the coding is Elias: the
 * same steps on the whole tensor, composed from the codec's calls */
static int32_t encode_ef_composed(const float* x, uint64_t numel, const qsgd_config* cfg, const Feedback& fb,
                                  uint8_t* out, uint64_t cap, uint64_t* out_len) {
  float* v = (float*)malloc(sizeof(float) * (numel ? numel : 1));
  if (!v) return QSGD_E_NOMEM;
  IeeeFpScope fp;
  feedback_add(x, fb, numel, v);
  int32_t st = qsgd_encode_cpu(v, numel, cfg, out, cap, out_len);
  if (st == QSGD_OK) {
    const uint8_t* q = out;
    const uint64_t qlen = *out_len;
    st = qsgd_decode_sum_cpu(&q, &qlen, 1, -1.0f, v, numel, 1);
  }
  if (st == QSGD_OK) feedback_keep(fb, v, numel);
  free(v);
  return st;
}

extern "C" int32_t qsgd_encode_ef_cpu(const float* x, uint64_t numel, const qsgd_config* cfg, float* residual,
                                      int32_t residual_valid, uint8_t* out, uint64_t cap, uint64_t* out_len) {
  const int32_t st = qsgd_check_config(cfg);
  if (st != QSGD_OK) return st;
  if (!out || !out_len || numel > (1ull << 56) || (numel && (!x || !residual))) return QSGD_E_ARG;
  const Feedback fb{residual, residual_valid != 0};
  if (cfg->coding == QSGD_CODING_ELIAS || encode_chunk_buckets(cfg->bucket_size) * cfg->bucket_size > kFeedbackChunkMax)
    return encode_ef_composed(x, numel, cfg, fb, out, cap, out_len);
  return encode_fixed(x, numel, cfg, out, cap, out_len, nullptr, &fb);
}

/* ---- validation ---------------------------------------------------------------------------- */
static int32_t validate(const uint8_t* p, uint64_t len, qsgd_header* h) {
  int32_t st = qsgd_parse_header(p, len, h);
  if (st != QSGD_OK) return st;
  if (h->payload_len != len) return QSGD_E_LENGTH; /* trailing bytes */
  if ((h->flags & QSGD_FLAG_CHECKSUM) && qsgd_checksum_cpu(p, len) != h->checksum)
    return QSGD_E_CHECKSUM;
  const uint64_t nb = qsgd_num_buckets(h->numel, h->bucket_size);
  st = check_scales(p + QSGD_HEADER_BYTES, nb);
  if (st != QSGD_OK) return st;
  if (h->coding == QSGD_CODING_ELIAS) return elias_validate(p, h);
  /* fixed: the padding bits of the last byte must be zero */
  const uint64_t used_bits = (h->numel % 8) * h->bits % 8;
  if (used_bits && (p[len - 1] >> used_bits)) return QSGD_E_PADDING;
  return QSGD_OK;
}

extern "C" int32_t qsgd_validate_cpu(const uint8_t* p, uint64_t len) {
  qsgd_header h;
  return validate(p, len, &h);
}

/* ---- decode-and-accumulate ---------------------------------------------------------------- */
static int same_tensor(const qsgd_header* a, const qsgd_header* b) {
  return a->numel == b->numel && a->fingerprint == b->fingerprint && a->bits == b->bits &&
         a->bucket_size == b->bucket_size && a->coding == b->coding && a->norm == b->norm &&
         a->dtype == b->dtype;
}

/* One payload's step of the fixed coding's decode_sum over [lo, lo+n) (Kernels::decode_step) */
static void fixed_decode_step(const Kernels& K, const uint8_t* p, const qsgd_header* h, uint64_t lo, uint64_t n,
                              uint8_t* codes, float* acc, int first, int fin, float* out, float alpha) {
  const uint64_t B = h->bucket_size, nb = qsgd_num_buckets(h->numel, B);
  const uint8_t* scales = p + QSGD_HEADER_BYTES;
  const uint8_t* data = scales + 4 * nb;
  K.decode_step(h->bits, data, data + qsgd_packed_bytes(h->numel, h->bits), scales, B, lo, n, codes, acc, first,
                fin, out, alpha);
}

extern "C" int32_t qsgd_decode_sum_cpu(const uint8_t* const* payloads, const uint64_t* lens,
                                       int32_t count, float alpha, float* out, uint64_t n,
                                       int32_t accumulate) {
  if (count < 1 || !payloads || !lens || (n && !out)) return QSGD_E_ARG;
  qsgd_header* hs = (qsgd_header*)malloc(sizeof(qsgd_header) * (size_t)count);
  if (!hs) return QSGD_E_NOMEM;
  int32_t st = QSGD_OK;
  for (int32_t p = 0; p < count && st == QSGD_OK; ++p) {
    st = validate(payloads[p], lens[p], &hs[p]);
    if (st == QSGD_OK && (!same_tensor(&hs[0], &hs[p]) || hs[p].numel != n)) st = QSGD_E_MISMATCH;
  }
  if (st != QSGD_OK) {
    free(hs);
    return st;
  }
  const qsgd_header* h0 = &hs[0];
  const Kernels& K = active_kernels();
  /* the last payload's step writes out: added to it, set, or set with streaming stores where out is
   * too large for the caches (Kernels::decode_step's FIN) */
  const int last = accumulate ? FIN_ACCUMULATE
                   : (n * sizeof(float) >= stream_bytes() && (uintptr_t)out % 16 == 0) ? FIN_STREAM : FIN_SET;
  const int elias = h0->coding == QSGD_CODING_ELIAS;
  /* parallel units: Elias segments, or runs of kStage elements */
  uint64_t unit;
  if (elias) unit = (uint64_t)h0->segment_buckets * h0->bucket_size;
  else unit = kStage;
  const uint64_t nunits = (n + unit - 1) / unit;
  const uint64_t scratch = std::min<uint64_t>(unit, n);
  /* per thread: the accumulator, then (fixed coding) the unpacked codes of one unit */
  const size_t acc_bytes = sizeof(float) * scratch;
  st = parallel_for_with_scratch(threads_for(n), nunits, acc_bytes + (elias ? 0 : scratch),
                                 [&](uint64_t u, void* buf) {
    float* acc = (float*)buf;
    uint8_t* codes = (uint8_t*)buf + acc_bytes;
    const uint64_t lo = u * unit, m = std::min(unit, n - lo);
    if (!elias) { /* the first payload starts the sum, the last one finishes it into out */
      for (int32_t p = 0; p < count; ++p)
        fixed_decode_step(K, payloads[p], &hs[p], lo, m, codes, acc, p == 0,
                          p == count - 1 ? last : FIN_KEEP, out + lo, alpha);
      return;
    }
    memset(acc, 0, sizeof(float) * m);
    for (int32_t p = 0; p < count; ++p) elias_decode_segment_add(payloads[p], &hs[p], u, acc);
    K.finish(out + lo, acc, m, alpha, accumulate);
  });
  free(hs);
  return st;
}

extern "C" int32_t qsgd_decode_gathered_cpu(const uint8_t* buf, uint64_t len, int32_t count,
                                            const qsgd_header* expect, float alpha, float* out, uint64_t n,
                                            uint64_t* lens) {
  if (count < 1 || !expect || !lens || (len && !buf) || expect->numel != n) return QSGD_E_ARG;
  const uint8_t** ptrs = (const uint8_t**)malloc(sizeof(const uint8_t*) * (size_t)count);
  if (!ptrs) return QSGD_E_NOMEM;
  int32_t st = QSGD_OK;
  uint64_t off = 0;
  for (int32_t p = 0; p < count && st == QSGD_OK; ++p) {
    qsgd_header h;
    st = off < len ? qsgd_parse_header(buf + off, len - off, &h) : QSGD_E_LENGTH;
    if (st != QSGD_OK) break;
    if (!same_tensor(expect, &h)) st = QSGD_E_MISMATCH;
    ptrs[p] = buf + off;
    lens[p] = h.payload_len;
    off += h.payload_len;
  }
  if (st == QSGD_OK && off != len) st = QSGD_E_LENGTH;
  if (st == QSGD_OK) st = qsgd_decode_sum_cpu(ptrs, lens, count, alpha, out, n, 0);
  free(ptrs);
  return st;
}

extern "C" void qsgd_set_num_threads(int32_t n) { g_threads.store(n > 0 ? n : 0); }
extern "C" void qsgd_set_stream_bytes(uint64_t bytes) { g_stream_bytes.store(bytes ? bytes : default_stream_bytes()); }
extern "C" uint64_t qsgd_get_stream_bytes(void) { return stream_bytes(); }
extern "C" int32_t qsgd_get_num_threads(void) {
  const int t = g_threads.load();
  return t > 0 ? t : omp_get_max_threads();
}

extern "C" const char* qsgd_status_string(int32_t st) {
  switch (st) {
    case QSGD_OK: return "ok";
    case QSGD_E_ARG: return "invalid argument";
    case QSGD_E_CAPACITY: return "output buffer too small";
    case QSGD_E_TRUNCATED: return "payload truncated: shorter than its header or declared length";
    case QSGD_E_MAGIC: return "bad magic: not a hvd_qsgd payload";
    case QSGD_E_VERSION: return "unsupported wire-format version";
    case QSGD_E_HEADER: return "header field out of range or inconsistent";
    case QSGD_E_LENGTH: return "declared payload length disagrees with the layout";
    case QSGD_E_CHECKSUM: return "checksum mismatch: payload corrupted";
    case QSGD_E_SCALE: return "negative bucket scale";
    case QSGD_E_STREAM: return "malformed Elias stream";
    case QSGD_E_PADDING: return "nonzero padding bits";
    case QSGD_E_MISMATCH: return "payloads disagree on the tensor (numel, fingerprint, bits, bucket size, coding, norm or dtype)";
    case QSGD_E_NOMEM: return "out of memory";
    case QSGD_E_CUDA: return "CUDA runtime error";
    case QSGD_E_ISA: return "this CPU cannot run the requested instruction-set variant of the codec";
    case QSGD_E_CTRL_LENGTH: return "the control tensor came back with the wrong length: QSGD compression works with allreduce (Sum or Average), not with reducescatter or other collectives";
    case QSGD_E_CTRL_OP: return "the reduction op is not a sum or an average; QSGD payloads are averaged (op=Average) or summed (op=Sum), other ops (Min, Max, Product, Adasum) are not supported";
    case QSGD_E_CTRL_FAULT: return "some rank(s) could not encode this tensor (their error says why)";
    case QSGD_E_CTRL_MEMBERS: return "the ranks that reduced this tensor are not the compressor's process set: pass the optimizer's (or allreduce's) process_set to the compressor, and use the compressor on every rank of that set";
    case QSGD_E_CTRL_TAG: return "ranks disagree on the exchange: different compressor settings, compressor objects, process sets, or tensor order";
    default: return "unknown status";
  }
}
