/*
 * The Elias-coded mode (QSGD paper, section 3.1), CPU only.
 *
 * The quantized levels are exactly those of the fixed coding (same scales, same random stream);
 * only their representation differs. Per bucket, the stream holds
 *     omega(nnz + 1), then for each nonzero level in increasing index order:
 *     omega(gap), sign bit (1 = negative), omega(level)
 * where gap = index - previous index (the first previous index is -1, so gap >= 1), level in 1..s
 * and omega is Elias' recursive (omega) code. Buckets are grouped into segments of
 * segment_buckets buckets; each segment's stream is byte-aligned, zero-padded, and its end offset is
 * listed in a table, so segments are encoded and decoded in parallel.
 *
 * Bits are written least-significant first within each byte; each omega group is written most
 * significant bit first.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "qsgd.h"
#include "qsgd_cpu_internal.h"
#include "qsgd_math.h"

namespace qsgd_cpu {

static const uint64_t kStage = 4096;

static inline int omega_len(uint64_t k) { return qsgd_omega_len(k); }

uint64_t elias_max_bits_per_element(int bits) { return qsgd_elias_bits_bound(bits); }

struct BitWriter {
  uint8_t* p;
  uint64_t acc = 0;
  int n = 0;
  explicit BitWriter(uint8_t* dst) : p(dst) {}
  inline void bit(uint32_t b) {
    acc |= (uint64_t)b << n;
    if (++n == 64) {
      qsgd_store_le(p, acc, 8);
      p += 8, acc = 0, n = 0;
    }
  }
  inline void omega(uint64_t k) { qsgd_write_omega(*this, k); }
  inline void flush() {
    if (n) qsgd_store_le(p, acc, (n + 7) / 8);
  }
};

struct EliasLayout {
  uint64_t nb, seg_buckets, nseg;
  const uint8_t* scales;
  const uint8_t* table;
  const uint8_t* streams;
  uint64_t streams_len;
  EliasLayout(const uint8_t* p, uint64_t numel, uint32_t bucket, uint64_t payload_len) {
    nb = qsgd_num_buckets(numel, bucket);
    seg_buckets = qsgd_elias_segment_buckets(bucket);
    nseg = (nb + seg_buckets - 1) / seg_buckets;
    scales = p + QSGD_HEADER_BYTES;
    table = scales + 4 * nb;
    streams = table + 8 * nseg;
    streams_len = payload_len - (uint64_t)(streams - p);
  }
  uint64_t seg_begin(uint64_t k) const { return k ? qsgd_load_le(table + 8 * (k - 1), 8) : 0; }
  uint64_t seg_end(uint64_t k) const { return qsgd_load_le(table + 8 * k, 8); }
};

/* Bits of one bucket's stream, given its codes in pieces; counts only. */
struct BucketCounter {
  uint64_t nnz = 0, bits = 0;
  int64_t prev = -1;
  void add(const uint8_t* codes, uint64_t n, uint64_t offset, int b) {
    const uint32_t lmask = (1u << (b - 1)) - 1u;
    for (uint64_t k = 0; k < n; ++k) {
      const uint32_t l = codes[k] & lmask;
      if (!l) continue;
      const int64_t idx = (int64_t)(offset + k);
      bits += (uint64_t)omega_len((uint64_t)(idx - prev)) + 1 + (uint64_t)omega_len(l);
      prev = idx, ++nnz;
    }
  }
};

int32_t elias_encode(const float* x, uint64_t numel, const qsgd_config* cfg, uint8_t* out,
                     uint64_t cap, uint64_t* out_len) {
  if (numel && !x) return QSGD_E_ARG;
  const uint64_t B = cfg->bucket_size;
  const uint64_t nb = qsgd_num_buckets(numel, cfg->bucket_size);
  const uint64_t seg_buckets = qsgd_elias_segment_buckets(cfg->bucket_size);
  const uint64_t nseg = (nb + seg_buckets - 1) / seg_buckets;
  const uint64_t fixed_part = QSGD_HEADER_BYTES + 4 * nb + 8 * nseg;
  if (cap < fixed_part) {
    if (out_len) *out_len = qsgd_elias_max_nbytes(numel, cfg->bits, cfg->bucket_size);
    return QSGD_E_CAPACITY;
  }
  uint8_t* scales = out + QSGD_HEADER_BYTES;
  uint8_t* table = scales + 4 * nb;
  uint8_t* streams = table + 8 * nseg;
  uint32_t* nnz = (uint32_t*)malloc(sizeof(uint32_t) * (nb ? nb : 1));
  uint64_t* seg_bytes = (uint64_t*)malloc(sizeof(uint64_t) * (nseg ? nseg : 1));
  if (!nnz || !seg_bytes) {
    free(nnz), free(seg_bytes);
    return QSGD_E_NOMEM;
  }
  const int bits = cfg->bits;
  const int nt = threads_for(numel);
  /* pass 1: scales, nonzero counts and the exact length of every segment */
  int32_t status = parallel_for_with_scratch(nt, nseg, kStage, [&](uint64_t sg, void* scratch) {
    uint8_t* stage = (uint8_t*)scratch;
    uint64_t total = 0;
    for (uint64_t b = sg * seg_buckets; b < std::min(nb, (sg + 1) * seg_buckets); ++b) {
      const uint64_t lo = b * B, hi = std::min(numel, lo + B);
      const float scale = bucket_scale(x + lo, hi - lo, cfg->norm);
      store_scale(scales, b, scale);
      BucketCounter cnt;
      for (uint64_t i = lo; i < hi; i += kStage) {
        const uint64_t m = std::min(kStage, hi - i);
        quantize_run(x + i, m, i, cfg->seed, scale, bits, qsgd_encoder_of(cfg->flags), stage);
        cnt.add(stage, m, i - lo, bits);
      }
      nnz[b] = (uint32_t)cnt.nnz;
      total += (uint64_t)omega_len(cnt.nnz + 1) + cnt.bits;
    }
    seg_bytes[sg] = (total + 7) / 8;
  });
  uint64_t total = fixed_part;
  for (uint64_t sg = 0; sg < nseg; ++sg) total += seg_bytes[sg];
  if (out_len) *out_len = total;
  if (status == QSGD_OK && total > cap) status = QSGD_E_CAPACITY;
  if (status != QSGD_OK) {
    free(nnz), free(seg_bytes);
    return status;
  }
  uint64_t end = 0;
  for (uint64_t sg = 0; sg < nseg; ++sg) {
    end += seg_bytes[sg];
    qsgd_store_le(table + 8 * sg, end, 8);
  }
  qsgd_write_header(out, cfg, numel, total, (uint32_t)seg_buckets);
  /* pass 2: write the streams (same codes: same scales, same random stream) */
  status = parallel_for_with_scratch(nt, nseg, kStage, [&](uint64_t sg, void* scratch) {
    uint8_t* stage = (uint8_t*)scratch;
    uint8_t* dst = streams + (sg ? qsgd_load_le(table + 8 * (sg - 1), 8) : 0);
    memset(dst, 0, seg_bytes[sg]);
    BitWriter w(dst);
    const uint32_t lmask = (1u << (bits - 1)) - 1u;
    for (uint64_t b = sg * seg_buckets; b < std::min(nb, (sg + 1) * seg_buckets); ++b) {
      const uint64_t lo = b * B, hi = std::min(numel, lo + B);
      const float scale = load_scale(scales, b);
      w.omega((uint64_t)nnz[b] + 1);
      int64_t prev = -1;
      for (uint64_t i = lo; i < hi; i += kStage) {
        const uint64_t m = std::min(kStage, hi - i);
        quantize_run(x + i, m, i, cfg->seed, scale, bits, qsgd_encoder_of(cfg->flags), stage);
        for (uint64_t k = 0; k < m; ++k) {
          const uint32_t l = stage[k] & lmask;
          if (!l) continue;
          const int64_t idx = (int64_t)(i - lo + k);
          w.omega((uint64_t)(idx - prev));
          w.bit((stage[k] >> (bits - 1)) & 1u);
          w.omega(l);
          prev = idx;
        }
      }
    }
    w.flush();
  });
  free(nnz), free(seg_bytes);
  if (status != QSGD_OK) return status;
  if (cfg->flags & QSGD_FLAG_CHECKSUM) qsgd_store_le(out + 48, qsgd_checksum_cpu(out, total), 8);
  return QSGD_OK;
}

/* Parse segment sg (qsgd_math.h's qsgd_elias_parse_segment); when acc is given, acc[k] += decoded
 * element (segment start + k). */
static int32_t parse_segment(const EliasLayout& L, const qsgd_header* h, uint64_t sg, float* acc) {
  const uint64_t begin = L.seg_begin(sg), end = L.seg_end(sg);
  const uint64_t b0 = sg * L.seg_buckets, b1 = std::min(L.nb, b0 + L.seg_buckets);
  return qsgd_elias_parse_segment(L.streams + begin, end - begin, L.scales, b0, b1, h->numel, h->bucket_size,
                                  h->bits, acc);
}

int32_t elias_validate(const uint8_t* p, const qsgd_header* h) {
  const EliasLayout L(p, h->numel, h->bucket_size, h->payload_len);
  uint64_t prev = 0;
  for (uint64_t k = 0; k < L.nseg; ++k) {
    const uint64_t e = L.seg_end(k);
    if (e < prev || e > L.streams_len) return QSGD_E_STREAM;
    prev = e;
  }
  if (prev != L.streams_len) return QSGD_E_LENGTH;
  int32_t status = QSGD_OK;
  const int nt = threads_for(h->numel);
  if (nt <= 1) { /* on the calling thread (see parallel_for_with_scratch) */
    for (uint64_t k = 0; k < L.nseg && status == QSGD_OK; ++k) status = parse_segment(L, h, k, nullptr);
    return status;
  }
#pragma omp parallel for num_threads(nt) schedule(static)
  for (uint64_t k = 0; k < L.nseg; ++k) {
    const int32_t st = parse_segment(L, h, k, nullptr);
    if (st != QSGD_OK) {
#pragma omp critical(qsgd_elias_status)
      if (status == QSGD_OK) status = st;
    }
  }
  return status;
}

void elias_decode_segment_add(const uint8_t* p, const qsgd_header* h, uint64_t seg, float* acc) {
  const EliasLayout L(p, h->numel, h->bucket_size, h->payload_len);
  (void)parse_segment(L, h, seg, acc); /* validated before: cannot fail */
}

}  // namespace qsgd_cpu
