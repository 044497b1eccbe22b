// The chunk steps of the scatter_allgather reduction (hvd_qsgd/reduction.py states the algorithm):
// one implementation for the NumPy/PyTorch binding (ctypes) and the TensorFlow ops. Each step is a
// composition of the codec's encode and decode_sum over bucket-aligned chunks.
#include <vector>

#include "qsgd.h"
#include "qsgd_math.h"

namespace {

// The reduce step of both qsgd_reduce_chunk_cpu and, with feedback, qsgd_reduce_chunk_ef_cpu (qsgd.h):
// scratch = S, the fp32 sum of the payloads in rank order; with feedback v = S + residual; q = encode
// with the chunk's phase-1 seed; with feedback residual = v - decode(q) where that is finite.
int32_t reduce_chunk(const uint8_t* const* payloads, const uint64_t* lens, int32_t count, const qsgd_config* cfg,
                     int32_t j, float* scratch, uint64_t scratch_n, uint8_t* out, uint64_t cap, uint64_t* out_len,
                     bool feedback, float* residual, uint64_t residual_n) {
  if (!payloads || !lens || count < 1 || !cfg || j < 0 || !out || !out_len) return QSGD_E_ARG;
  qsgd_header h;
  int32_t st = qsgd_parse_header(payloads[0], lens[0], &h);
  if (st != QSGD_OK) return st;
  const uint64_t n = h.numel;
  if (feedback && (residual_n != n || (n && !residual))) return QSGD_E_ARG;
  if (n > scratch_n || (n && !scratch)) return QSGD_E_CAPACITY;
  st = qsgd_decode_sum_cpu(payloads, lens, count, 1.0f, scratch, n, 0);
  if (st != QSGD_OK) return st;
  qsgd_config c = *cfg;
  c.seed = qsgd_chunk_seed(cfg->seed, j, 1);
  // with feedback, the worker's step on the sum: v = S + residual, q = encode(v), the residual kept
  if (feedback) return qsgd_encode_ef_cpu(scratch, n, &c, residual, 1, out, cap, out_len);
  return qsgd_encode_cpu(scratch, n, &c, out, cap, out_len);
}

// Chunk j of the n chunks of a numel-element tensor, for each j in order, encoded by
// encode_one(begin, end, config with chunk j's phase-1 seed, out, room, &len) back to back into
// out[0:cap); lens[j] receives its length.
template <typename EncodeOne>
int32_t encode_each_chunk(uint64_t numel, const qsgd_config* cfg, int32_t n, uint8_t* out, uint64_t cap,
                          uint64_t* lens, EncodeOne encode_one) {
  uint64_t off = 0, b, e;
  for (int32_t j = 0; j < n; ++j) {
    int32_t st = qsgd_chunk_range(numel, cfg->bucket_size, n, j, &b, &e);
    if (st != QSGD_OK) return st;
    qsgd_config c = *cfg;
    c.seed = qsgd_chunk_seed(cfg->seed, j, 0);
    uint64_t len = 0;
    st = encode_one(b, e, &c, out + off, cap - off, &len);
    if (st != QSGD_OK) return st;
    lens[j] = len;
    off += len;
  }
  return QSGD_OK;
}

}  // namespace

extern "C" {

int32_t qsgd_chunk_range(uint64_t numel, uint32_t bucket_size, int32_t n, int32_t j, uint64_t* begin,
                         uint64_t* end) {
  return qsgd_chunk_bounds(numel, bucket_size, n, j, begin, end);
}

uint64_t qsgd_chunk_seed(uint64_t step_seed, int32_t j, int32_t phase) { return qsgd_seed_of_chunk(step_seed, j, phase); }

uint64_t qsgd_chunks_max_nbytes(uint64_t numel, int32_t bits, uint32_t bucket_size, int32_t coding, int32_t n) {
  uint64_t total = 0, b, e;
  for (int32_t j = 0; j < n; ++j) {
    if (qsgd_chunk_range(numel, bucket_size, n, j, &b, &e) != QSGD_OK) return 0;
    const uint64_t one = coding == QSGD_CODING_ELIAS ? qsgd_elias_max_nbytes(e - b, bits, bucket_size)
                                                     : qsgd_fixed_nbytes(e - b, bits, bucket_size);
    if (one == 0) return 0;
    total += one;
  }
  return total;
}

int32_t qsgd_encode_chunks_cpu(const float* x, uint64_t numel, const qsgd_config* cfg, int32_t n,
                               uint8_t* out, uint64_t cap, uint64_t* lens) {
  if (!cfg || !out || !lens || n < 1 || (numel && !x)) return QSGD_E_ARG;
  return encode_each_chunk(numel, cfg, n, out, cap, lens,
                           [&](uint64_t b, uint64_t e, const qsgd_config* c, uint8_t* o, uint64_t room, uint64_t* len) {
                             return qsgd_encode_cpu(x + b, e - b, c, o, room, len);
                           });
}

int32_t qsgd_encode_chunks_ef_cpu(const float* x, uint64_t numel, const qsgd_config* cfg, int32_t n, float* residual,
                                  int32_t residual_valid, uint8_t* out, uint64_t cap, uint64_t* lens) {
  if (!cfg || !out || !lens || n < 1 || (numel && (!x || !residual))) return QSGD_E_ARG;
  int32_t st = qsgd_check_config(cfg);
  if (st != QSGD_OK) return st;
  // every chunk's room first: past this, a chunk's encode fails only for want of memory
  if (cap < qsgd_chunks_max_nbytes(numel, cfg->bits, cfg->bucket_size, cfg->coding, n)) return QSGD_E_CAPACITY;
  return encode_each_chunk(numel, cfg, n, out, cap, lens,
                           [&](uint64_t b, uint64_t e, const qsgd_config* c, uint8_t* o, uint64_t room, uint64_t* len) {
                             return qsgd_encode_ef_cpu(x + b, e - b, c, residual + b, residual_valid, o, room, len);
                           });
}

int32_t qsgd_reduce_chunk_cpu(const uint8_t* const* payloads, const uint64_t* lens, int32_t count,
                              const qsgd_config* cfg, int32_t j, float* scratch, uint64_t scratch_n,
                              uint8_t* out, uint64_t cap, uint64_t* out_len) {
  return reduce_chunk(payloads, lens, count, cfg, j, scratch, scratch_n, out, cap, out_len, false, nullptr, 0);
}

int32_t qsgd_reduce_chunk_ef_cpu(const uint8_t* const* payloads, const uint64_t* lens, int32_t count,
                                 const qsgd_config* cfg, int32_t j, float* scratch, uint64_t scratch_n,
                                 uint8_t* out, uint64_t cap, uint64_t* out_len, float* residual,
                                 uint64_t residual_n) {
  return reduce_chunk(payloads, lens, count, cfg, j, scratch, scratch_n, out, cap, out_len, true, residual,
                      residual_n);
}

int32_t qsgd_decode_chunks_cpu(const uint8_t* const* payloads, const uint64_t* lens, int32_t n, float alpha,
                               float* out, uint64_t numel, uint32_t bucket_size) {
  if (!payloads || !lens || n < 1 || (numel && !out)) return QSGD_E_ARG;
  uint64_t b, e;
  for (int32_t j = 0; j < n; ++j) {
    int32_t st = qsgd_chunk_range(numel, bucket_size, n, j, &b, &e);
    if (st != QSGD_OK) return st;
    qsgd_header h;
    st = qsgd_parse_header(payloads[j], lens[j], &h);
    if (st != QSGD_OK) return st;
    if (h.numel != e - b || h.bucket_size != bucket_size) return QSGD_E_MISMATCH;
    st = qsgd_decode_sum_cpu(payloads + j, lens + j, 1, alpha, out + b, e - b, 0);
    if (st != QSGD_OK) return st;
  }
  return QSGD_OK;
}

}  // extern "C"
