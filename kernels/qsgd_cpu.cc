/*
 * CPU implementation of the codec (fixed-width coding, header, checksum, decode-and-accumulate),
 * multi-threaded with OpenMP and written so that the compiler vectorises the per-element loops
 * (the quantizer and the unpacking are templated on the bit width).
 *
 * Work is split into chunks of whole buckets whose first element is a multiple of 8, so every
 * chunk owns whole bytes of the packed stream (8 codes of b bits are exactly b bytes) and threads
 * never share an output byte.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <xmmintrin.h>

#include <algorithm>
#include <atomic>

#include "qsgd.h"
#include "qsgd_cpu_internal.h"
#include "qsgd_math.h"

namespace qsgd_cpu {

static std::atomic<int> g_threads{0};
static const uint64_t kStage = 4096;          /* codes staged before packing (multiple of 8) */
static const uint64_t kChunkElems = 1 << 15;  /* target elements per parallel chunk */
static const uint64_t kParallelMin = 1 << 16; /* smaller jobs run on the calling thread */

int threads_for(uint64_t n) {
  if (n < kParallelMin) return 1;
  int t = g_threads.load();
  return t > 0 ? t : omp_get_max_threads();
}

IeeeFpScope::IeeeFpScope() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~0x8040u); }
IeeeFpScope::~IeeeFpScope() { _mm_setcsr(saved); }

float load_scale(const uint8_t* scales, uint64_t b) {
  float v;
  memcpy(&v, scales + 4 * b, 4);
  return v;
}
void store_scale(uint8_t* scales, uint64_t b, float v) { memcpy(scales + 4 * b, &v, 4); }

/* The folded lane sum of qsgd_lane_term over a bucket (qsgd_math.h: 32 lanes, lane j holding
 * elements j, j+32, ... in order, folded j += j+16, 8, 4, 2, 1). */
template <int NORM>
static double lane_sum(const float* x, uint64_t n) {
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

float bucket_scale(const float* x, uint64_t n, int norm) {
  uint32_t m = 0;
  for (uint64_t k = 0; k < n; ++k) m = std::max(m, qsgd_f2u(x[k]) & 0x7FFFFFFFu);
  if (norm == QSGD_NORM_MAX) return qsgd_scale_from_absmax_bits(m);
  if (norm == QSGD_NORM_SIGN) return qsgd_scale_from_l1(lane_sum<QSGD_NORM_SIGN>(x, n), n, m);
  return qsgd_scale_from_sumsq(lane_sum<QSGD_NORM_L2>(x, n), m);
}

template <int BITS>
static void quantize_page(const float* __restrict x, uint64_t n, uint64_t key, uint32_t lo,
                          float scale, uint8_t* __restrict codes) {
  const float s = (float)qsgd_levels_of(BITS);
  for (uint64_t k = 0; k < n; ++k)
    codes[k] = (uint8_t)qsgd_quantize(x[k], scale, s, qsgd_u24(key, lo + (uint32_t)k), BITS);
}

void quantize_run(const float* x, uint64_t n, uint64_t i0, uint64_t seed, float scale, int bits,
                  uint8_t* codes) {
  if (!qsgd_scale_quantizes(scale)) {
    memset(codes, 0, n);
    return;
  }
  while (n) {
    /* the random stream is keyed per page of 2^32 elements: never cross a page in one call */
    const uint64_t page_end = ((i0 >> 32) + 1) << 32;
    const uint64_t m = std::min<uint64_t>(n, page_end - i0);
    const uint64_t key = qsgd_page_key(seed, i0);
    const uint32_t lo = (uint32_t)i0;
    dispatch_bits(bits, [&](auto b) { quantize_page<b.value>(x, m, key, lo, scale, codes); });
    x += m, codes += m, i0 += m, n -= m;
  }
}

void sign_run(const float* __restrict x, uint64_t n, float scale, uint8_t* __restrict codes) {
  if (!qsgd_scale_quantizes(scale)) {
    memset(codes, 0, n);
    return;
  }
  for (uint64_t k = 0; k < n; ++k) codes[k] = (uint8_t)qsgd_sign_code(x[k]);
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

/* ---- packing: m codes -> qsgd_packed_bytes(m, BITS) bytes, code j of a group of 8 at bit j*BITS */
template <int BITS>
static void pack(const uint8_t* __restrict codes, uint64_t m, uint8_t* __restrict dst) {
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

/* ---- unpacking: the inverse of pack */
template <int BITS>
static void unpack(const uint8_t* __restrict src, uint64_t m, uint8_t* __restrict codes) {
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

static void pack_bits(int bits, const uint8_t* codes, uint64_t m, uint8_t* dst) {
  dispatch_bits(bits, [&](auto b) { pack<b.value>(codes, m, dst); });
}

static void unpack_bits(int bits, const uint8_t* src, uint64_t m, uint8_t* codes) {
  dispatch_bits(bits, [&](auto b) { unpack<b.value>(src, m, codes); });
}

template <int BITS>
static void dequantize_add(const uint8_t* __restrict codes, uint64_t n, float step,
                           float* __restrict acc) {
  for (uint64_t k = 0; k < n; ++k) acc[k] += qsgd_dequantize(codes[k], step, BITS);
}

static void dequantize_add_bits(int bits, const uint8_t* codes, uint64_t n, float step, float* acc) {
  dispatch_bits(bits, [&](auto b) { dequantize_add<b.value>(codes, n, step, acc); });
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
      h->dtype > QSGD_DTYPE_BF16 || (h->flags & ~QSGD_FLAG_CHECKSUM) || h->reserved0 ||
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

extern "C" uint64_t qsgd_checksum_cpu(const uint8_t* p, uint64_t len) {
  const uint64_t words = len / 8;
  uint64_t sum = 0;
  const int nt = threads_for(len / 4);
#pragma omp parallel for num_threads(nt) reduction(+ : sum) schedule(static)
  for (uint64_t k = 0; k < words; ++k) {
    uint64_t w;
    memcpy(&w, p + 8 * k, 8);
    if (k == QSGD_CHECKSUM_OFFSET / 8) w = 0;
    sum += qsgd_checksum_term(w, k);
  }
  if (len % 8) sum += qsgd_checksum_term(qsgd_load_le(p + 8 * words, (int)(len % 8)), words);
  return qsgd_checksum_final(sum, len);
}

/* ---- encode (fixed) ------------------------------------------------------------------------ */
static int32_t encode_fixed(const float* x, uint64_t numel, const qsgd_config* cfg, uint8_t* out,
                            uint64_t cap, uint64_t* out_len) {
  const uint64_t need = qsgd_fixed_nbytes(numel, cfg->bits, cfg->bucket_size);
  if (out_len) *out_len = need;
  if (cap < need) return QSGD_E_CAPACITY;
  if (numel && !x) return QSGD_E_ARG;
  qsgd_write_header(out, cfg, numel, need, 0);
  uint8_t* scales = out + QSGD_HEADER_BYTES;
  const uint64_t B = cfg->bucket_size, nb = qsgd_num_buckets(numel, cfg->bucket_size);
  uint8_t* data = scales + 4 * nb;
  const int bits = cfg->bits;
  /* chunks of whole buckets starting at multiples of 8 elements */
  uint64_t g = 1; /* g = 8 / gcd(B, 8): the fewest buckets spanning a multiple of 8 elements */
  while ((g * B) % 8) g *= 2;
  uint64_t chunk_buckets = std::max<uint64_t>(1, kChunkElems / B);
  chunk_buckets = (chunk_buckets + g - 1) / g * g;
  const uint64_t nchunks = (nb + chunk_buckets - 1) / chunk_buckets;
  const int nt = threads_for(numel);
  const int32_t status = parallel_for_with_scratch(nt, nchunks, kStage, [&](uint64_t c, void* scratch) {
    uint8_t* stage = (uint8_t*)scratch;
    const uint64_t b0 = c * chunk_buckets, b1 = std::min(nb, b0 + chunk_buckets);
    uint64_t pos = b0 * B, staged = 0;
    for (uint64_t b = b0; b < b1; ++b) {
      const uint64_t lo = b * B, hi = std::min(numel, lo + B);
      const float scale = bucket_scale(x + lo, hi - lo, cfg->norm);
      store_scale(scales, b, scale);
      for (uint64_t i = lo; i < hi;) {
        const uint64_t take = std::min(hi - i, kStage - staged);
        if (cfg->norm == QSGD_NORM_SIGN) sign_run(x + i, take, scale, stage + staged);
        else quantize_run(x + i, take, i, cfg->seed, scale, bits, stage + staged);
        staged += take, i += take;
        if (staged == kStage) {
          pack_bits(bits, stage, kStage, data + pos / 8 * bits);
          pos += kStage, staged = 0;
        }
      }
    }
    if (staged) pack_bits(bits, stage, staged, data + pos / 8 * bits);
  });
  if (status != QSGD_OK) return status;
  if (cfg->flags & QSGD_FLAG_CHECKSUM) qsgd_store_le(out + 48, qsgd_checksum_cpu(out, need), 8);
  return QSGD_OK;
}

extern "C" int32_t qsgd_encode_cpu(const float* x, uint64_t numel, const qsgd_config* cfg,
                                   uint8_t* out, uint64_t cap, uint64_t* out_len) {
  const int32_t st = qsgd_check_config(cfg);
  if (st != QSGD_OK) return st;
  if (!out || numel > (1ull << 56)) return QSGD_E_ARG;
  if (cfg->coding == QSGD_CODING_ELIAS) return elias_encode(x, numel, cfg, out, cap, out_len);
  return encode_fixed(x, numel, cfg, out, cap, out_len);
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

/* acc[0:n) += payload's elements [lo, lo+n), lo a multiple of 8 (fixed coding) */
static void fixed_decode_add(const uint8_t* p, const qsgd_header* h, uint64_t lo, uint64_t n,
                             uint8_t* codes, float* acc) {
  const uint64_t B = h->bucket_size, nb = qsgd_num_buckets(h->numel, B);
  const uint8_t* scales = p + QSGD_HEADER_BYTES;
  const uint8_t* data = scales + 4 * nb;
  const int bits = h->bits;
  unpack_bits(bits, data + lo / 8 * bits, n, codes);
  const float s = (float)qsgd_levels_of(bits);
  for (uint64_t i = lo; i < lo + n;) {
    const uint64_t b = i / B, hi = std::min(lo + n, (b + 1) * B);
    dequantize_add_bits(bits, codes + (i - lo), hi - i, qsgd_step_of(load_scale(scales, b), s),
                        acc + (i - lo));
    i = hi;
  }
}

static void finish(float* out, const float* acc, uint64_t n, float alpha, int accumulate) {
  if (accumulate)
    for (uint64_t k = 0; k < n; ++k) out[k] = out[k] + alpha * acc[k];
  else
    for (uint64_t k = 0; k < n; ++k) out[k] = alpha * acc[k];
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
    memset(acc, 0, sizeof(float) * m);
    for (int32_t p = 0; p < count; ++p) {
      if (elias) elias_decode_segment_add(payloads[p], &hs[p], u, acc);
      else fixed_decode_add(payloads[p], &hs[p], lo, m, codes, acc);
    }
    finish(out + lo, acc, m, alpha, accumulate);
  });
  free(hs);
  return st;
}

extern "C" void qsgd_set_num_threads(int32_t n) { g_threads.store(n > 0 ? n : 0); }
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
    case QSGD_E_CTRL_LENGTH: return "the control tensor came back with the wrong length: QSGD compression works with allreduce (Sum or Average), not with reducescatter or other collectives";
    case QSGD_E_CTRL_OP: return "the reduction op is not a sum or an average; QSGD payloads are averaged (op=Average) or summed (op=Sum), other ops (Min, Max, Product, Adasum) are not supported";
    case QSGD_E_CTRL_FAULT: return "some rank(s) could not encode this tensor (their error says why)";
    case QSGD_E_CTRL_MEMBERS: return "the ranks that reduced this tensor are not the compressor's process set: pass the optimizer's (or allreduce's) process_set to the compressor, and use the compressor on every rank of that set";
    case QSGD_E_CTRL_TAG: return "ranks disagree on the exchange: different compressor settings, compressor objects, process sets, or tensor order";
    default: return "unknown status";
  }
}
