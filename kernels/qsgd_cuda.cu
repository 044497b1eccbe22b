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

#include <vector>

#include "qsgd.h"
#include "qsgd_math.h"

/* Kernel launch; a host emulation of the CUDA runtime (tests/cuda_emu) replaces it. */
#ifndef QSGD_LAUNCH
#define QSGD_LAUNCH(kernel, grid, block, stream) kernel<<<(grid), (block), 0, (stream)>>>
#endif

namespace {

constexpr int kThreads = 256;

__host__ __device__ __forceinline__ uint64_t umin64(uint64_t a, uint64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ uint64_t umax64(uint64_t a, uint64_t b) { return a > b ? a : b; }

#define QSGD_CUDA_TRY(expr)                \
  do {                                     \
    if ((expr) != cudaSuccess) {           \
      (void)cudaGetLastError();            \
      return QSGD_E_CUDA;                  \
    }                                      \
  } while (0)

__global__ void header_kernel(uint8_t* out, qsgd_config cfg, uint64_t numel, uint64_t len) {
  qsgd_write_header(out, &cfg, numel, len, 0);
}

/* One warp per bucket. */
__global__ void scales_kernel(const float* __restrict__ x, uint64_t numel, uint32_t B, int norm,
                              uint64_t nb, float* __restrict__ scales) {
  const uint64_t b = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (b >= nb) return; /* whole warps exit together: b is uniform in a warp */
  const uint64_t lo = b * B, hi = umin64(numel, lo + B);
  float scale;
  uint32_t m = 0;
  for (uint64_t i = lo + lane; i < hi; i += 32) m = max(m, __float_as_uint(x[i]) & 0x7FFFFFFFu);
  for (int off = 16; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  if (norm == QSGD_NORM_MAX) {
    scale = qsgd_scale_from_absmax_bits(m);
  } else {
    /* lane j sums the terms (x^2, or |x| for the sign norm) of elements j, j+32, ... in order */
    double acc = 0.0;
    for (uint64_t i = lo + lane; i < hi; i += 32) acc += qsgd_lane_term(x[i], norm);
    /* lane j += lane j + off, off = 16, 8, 4, 2, 1: the fold of qsgd_math.h */
    for (int off = 16; off > 0; off /= 2) acc = acc + __shfl_xor_sync(0xFFFFFFFFu, acc, off);
    scale = norm == QSGD_NORM_SIGN ? qsgd_scale_from_l1(acc, hi - lo, m) : qsgd_scale_from_sumsq(acc, m);
  }
  if (lane == 0) scales[b] = scale;
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

/* One thread per group of 8 elements. data is 4-byte aligned (56 + 4 * nb bytes from a 4-byte
 * aligned payload), so the group stores of 1, 2, 4 and 8 bits are aligned. */
template <int BITS>
__global__ void pack_kernel(const float* __restrict__ x, uint64_t numel, uint32_t B, uint64_t seed, int norm,
                            const float* __restrict__ scales, uint8_t* __restrict__ data) {
  const uint64_t g = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t i0 = 8 * g;
  if (i0 >= numel) return;
  const uint64_t key = qsgd_page_key(seed, i0); /* a group never crosses a 2^32 page */
  const float s = (float)qsgd_levels_of(BITS);
  const int n = (int)umin64(8, numel - i0);
  uint64_t v = 0;
  for (int j = 0; j < n; ++j) {
    const uint64_t i = i0 + j;
    const float scale = scales[i / B];
    uint32_t code = 0u;
    if (qsgd_scale_quantizes(scale))
      code = norm == QSGD_NORM_SIGN ? qsgd_sign_code(x[i])
                                    : qsgd_quantize(x[i], scale, s, qsgd_u24(key, (uint32_t)i), BITS);
    v |= (uint64_t)code << (j * BITS);
  }
  uint8_t* dst = data + g * BITS;
  if (n == 8) store_group<BITS>(dst, v);
  else qsgd_store_le(dst, v, (n * BITS + 7) / 8);
}

/* sum of the checksum terms of payload p (blockIdx.y) into sums[p] */
struct PayloadJob {
  const uint8_t* ptr;
  uint64_t len;
  uint64_t checksum;
  uint64_t nb;
  uint32_t flags;
};

__global__ void verify_terms_kernel(const PayloadJob* __restrict__ jobs,
                                    unsigned long long* __restrict__ sums,
                                    int32_t* __restrict__ status) {
  const PayloadJob job = jobs[blockIdx.y];
  const uint64_t words = job.len / 8;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  uint64_t sum = 0;
  const uint64_t t0 = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (job.flags & QSGD_FLAG_CHECKSUM) {
    for (uint64_t k = t0; k < words; k += stride) {
      uint64_t w = qsgd_load_le(job.ptr + 8 * k, 8);
      if (k == QSGD_CHECKSUM_OFFSET / 8) w = 0;
      sum += qsgd_checksum_term(w, k);
    }
    if (t0 == 0 && job.len % 8)
      sum += qsgd_checksum_term(qsgd_load_le(job.ptr + 8 * words, (int)(job.len % 8)), words);
  }
  for (uint64_t b = t0; b < job.nb; b += stride) {
    const uint32_t u = (uint32_t)qsgd_load_le(job.ptr + QSGD_HEADER_BYTES + 4 * b, 4);
    if ((u & 0x80000000u) && (u & 0x7FFFFFFFu) <= 0x7F800000u) atomicCAS(status, 0, QSGD_E_SCALE);
  }
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
  if ((threadIdx.x & 31) == 0 && sum) atomicAdd(&sums[blockIdx.y], (unsigned long long)sum);
}

__global__ void verify_final_kernel(const PayloadJob* __restrict__ jobs, int count, uint64_t numel,
                                    int bits, const unsigned long long* __restrict__ sums,
                                    int32_t* __restrict__ status) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= count) return;
  const PayloadJob job = jobs[p];
  if ((job.flags & QSGD_FLAG_CHECKSUM) && qsgd_checksum_final(sums[p], job.len) != job.checksum)
    atomicCAS(status, 0, QSGD_E_CHECKSUM);
  const uint64_t used_bits = (numel % 8) * (uint64_t)bits % 8;
  if (used_bits && (job.ptr[job.len - 1] >> used_bits)) atomicCAS(status, 0, QSGD_E_PADDING);
}

template <int BITS>
__global__ void decode_sum_kernel(const PayloadJob* __restrict__ jobs, int count, uint64_t numel,
                                  uint32_t B, float alpha, float* __restrict__ out, int accumulate,
                                  const int32_t* __restrict__ status) {
  if (*status != QSGD_OK) return;
  const uint64_t g = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t i0 = 8 * g;
  if (i0 >= numel) return;
  const int n = (int)umin64(8, numel - i0);
  const uint64_t nb = qsgd_num_buckets(numel, B);
  const float s = (float)qsgd_levels_of(BITS);
  const uint32_t mask = (1u << BITS) - 1u;
  float acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
  for (int p = 0; p < count; ++p) {
    const uint8_t* scales = jobs[p].ptr + QSGD_HEADER_BYTES;
    const uint8_t* src = scales + 4 * nb + g * BITS;
    const uint64_t v = n == 8 ? load_group<BITS>(src) : qsgd_load_le(src, (n * BITS + 7) / 8);
    const float* fscales = reinterpret_cast<const float*>(scales);
    for (int j = 0; j < n; ++j) {
      const float step = qsgd_step_of(fscales[(i0 + j) / B], s);
      acc[j] += qsgd_dequantize((uint32_t)(v >> (j * BITS)) & mask, step, BITS);
    }
  }
  for (int j = 0; j < n; ++j)
    out[i0 + j] = accumulate ? out[i0 + j] + alpha * acc[j] : alpha * acc[j];
}

__global__ void checksum_kernel(const uint8_t* __restrict__ p, uint64_t len,
                                unsigned long long* __restrict__ sum) {
  const uint64_t words = len / 8;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  const uint64_t t0 = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint64_t acc = 0;
  for (uint64_t k = t0; k < words; k += stride) {
    uint64_t w = qsgd_load_le(p + 8 * k, 8);
    if (k == QSGD_CHECKSUM_OFFSET / 8) w = 0;
    acc += qsgd_checksum_term(w, k);
  }
  if (t0 == 0 && len % 8) acc += qsgd_checksum_term(qsgd_load_le(p + 8 * words, (int)(len % 8)), words);
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, off);
  if ((threadIdx.x & 31) == 0 && acc) atomicAdd(sum, (unsigned long long)acc);
}

__global__ void checksum_store_kernel(uint8_t* p, uint64_t len, const unsigned long long* sum) {
  qsgd_store_le(p + QSGD_CHECKSUM_OFFSET, qsgd_checksum_final(*sum, len), 8);
}

inline unsigned blocks_for(uint64_t threads) {
  const uint64_t b = (threads + kThreads - 1) / kThreads;
  return (unsigned)(b ? b : 1);
}

template <int BITS>
void launch_pack(const float* x, uint64_t numel, uint32_t B, uint64_t seed, int norm, const float* scales,
                 uint8_t* data, cudaStream_t st) {
  const uint64_t groups = (numel + 7) / 8;
  if (groups) QSGD_LAUNCH(pack_kernel<BITS>, blocks_for(groups), kThreads, st)(x, numel, B, seed, norm, scales, data);
}

template <int BITS>
void launch_decode(const PayloadJob* jobs, int count, uint64_t numel, uint32_t B, float alpha,
                   float* out, int accumulate, const int32_t* status, cudaStream_t st) {
  const uint64_t groups = (numel + 7) / 8;
  if (groups)
    QSGD_LAUNCH(decode_sum_kernel<BITS>, blocks_for(groups), kThreads, st)(jobs, count, numel, B, alpha, out,
                                                                      accumulate, status);
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

extern "C" int32_t qsgd_encode_cuda(const float* x, uint64_t numel, const qsgd_config* cfg,
                                    uint8_t* out, uint64_t cap, void* stream) {
  const int32_t st = qsgd_check_config(cfg);
  if (st != QSGD_OK) return st;
  if (cfg->coding != QSGD_CODING_FIXED) return QSGD_E_ARG; /* Elias coding is CPU only */
  if (!out || ((uintptr_t)out & 3) || (numel && !x) || numel > (1ull << 56)) return QSGD_E_ARG;
  const uint64_t len = fixed_nbytes(numel, cfg->bits, cfg->bucket_size);
  if (cap < len) return QSGD_E_CAPACITY;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uint64_t nb = qsgd_num_buckets(numel, cfg->bucket_size);
  float* scales = reinterpret_cast<float*>(out + QSGD_HEADER_BYTES);
  uint8_t* data = out + QSGD_HEADER_BYTES + 4 * nb;
  QSGD_LAUNCH(header_kernel, 1, 1, s)(out, *cfg, numel, len);
  if (nb) QSGD_LAUNCH(scales_kernel, blocks_for(nb * 32), kThreads, s)(x, numel, cfg->bucket_size, cfg->norm, nb, scales);
  QSGD_BITS_DISPATCH(cfg->bits, launch_pack, x, numel, cfg->bucket_size, cfg->seed, cfg->norm, scales, data, s);
  if (cfg->flags & QSGD_FLAG_CHECKSUM) {
    unsigned long long* sum = nullptr;
    QSGD_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&sum), sizeof(*sum), s));
    QSGD_CUDA_TRY(cudaMemsetAsync(sum, 0, sizeof(*sum), s));
    const unsigned blocks = (unsigned)umin64(blocks_for((len + 7) / 8), 1024);
    QSGD_LAUNCH(checksum_kernel, blocks, kThreads, s)(out, len, sum);
    QSGD_LAUNCH(checksum_store_kernel, 1, 1, s)(out, len, sum);
    QSGD_CUDA_TRY(cudaFreeAsync(sum, s));
  }
  QSGD_CUDA_TRY(cudaGetLastError());
  return QSGD_OK;
}

extern "C" int32_t qsgd_decode_sum_cuda(const uint8_t* const* d_payloads, const qsgd_header* headers,
                                        int32_t count, float alpha, float* out, uint64_t n,
                                        int32_t accumulate, int32_t* d_status, void* stream) {
  if (count < 1 || !d_payloads || !headers || !d_status || (n && !out)) return QSGD_E_ARG;
  const qsgd_header& h0 = headers[0];
  for (int p = 0; p < count; ++p) {
    const qsgd_header& h = headers[p];
    if (h.coding != QSGD_CODING_FIXED) return QSGD_E_ARG;
    if (h.numel != n || h.fingerprint != h0.fingerprint || h.bits != h0.bits ||
        h.bucket_size != h0.bucket_size || h.norm != h0.norm || h.dtype != h0.dtype)
      return QSGD_E_MISMATCH;
    if (h.payload_len != fixed_nbytes(h.numel, h.bits, h.bucket_size)) return QSGD_E_LENGTH;
    if (!d_payloads[p] || ((uintptr_t)d_payloads[p] & 3)) return QSGD_E_ARG;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uint64_t nb = qsgd_num_buckets(n, h0.bucket_size);
  std::vector<PayloadJob> jobs(count);
  for (int p = 0; p < count; ++p)
    jobs[p] = PayloadJob{d_payloads[p], headers[p].payload_len, headers[p].checksum, nb,
                         headers[p].flags};
  /* one device allocation: the jobs, then the checksum sums */
  const size_t jobs_bytes = sizeof(PayloadJob) * count;
  const size_t sums_off = (jobs_bytes + 15) / 16 * 16;
  uint8_t* scratch = nullptr;
  QSGD_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&scratch), sums_off + 8 * (size_t)count, s));
  PayloadJob* d_jobs = reinterpret_cast<PayloadJob*>(scratch);
  unsigned long long* d_sums = reinterpret_cast<unsigned long long*>(scratch + sums_off);
  QSGD_CUDA_TRY(cudaMemcpyAsync(d_jobs, jobs.data(), jobs_bytes, cudaMemcpyHostToDevice, s));
  QSGD_CUDA_TRY(cudaMemsetAsync(d_sums, 0, 8 * (size_t)count, s));
  QSGD_CUDA_TRY(cudaMemsetAsync(d_status, 0, sizeof(int32_t), s));
  const uint64_t work = umax64((h0.payload_len + 7) / 8, nb);
  dim3 grid((unsigned)umin64(blocks_for(work), 1024), (unsigned)count);
  QSGD_LAUNCH(verify_terms_kernel, grid, kThreads, s)(d_jobs, d_sums, d_status);
  QSGD_LAUNCH(verify_final_kernel, blocks_for(count), kThreads, s)(d_jobs, count, n, h0.bits, d_sums, d_status);
  QSGD_BITS_DISPATCH(h0.bits, launch_decode, d_jobs, count, n, h0.bucket_size, alpha, out, accumulate,
                     d_status, s);
  QSGD_CUDA_TRY(cudaFreeAsync(scratch, s));
  QSGD_CUDA_TRY(cudaGetLastError());
  return QSGD_OK;
}
