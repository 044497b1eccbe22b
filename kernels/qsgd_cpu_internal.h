/* Pieces the CPU translation units share (not part of the C ABI). */
#ifndef HVD_QSGD_CPU_INTERNAL_H_
#define HVD_QSGD_CPU_INTERNAL_H_

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "qsgd.h"

namespace qsgd_cpu {

/* Threads for a job of n elements (1 for small jobs, where a parallel region costs more). */
int threads_for(uint64_t n);

/* Sets the SSE control word to IEEE behaviour (no flush-to-zero, no denormals-are-zero) for the
 * lifetime of the object, so results do not depend on what the host framework set on its threads:
 * the CUDA library computes with denormals too. */
struct IeeeFpScope {
  unsigned saved;
  IeeeFpScope();
  ~IeeeFpScope();
};

/* f(std::integral_constant<int, bits>{}) for bits in 1..8: calls a kernel templated on the width. */
template <class F>
void dispatch_bits(int bits, F&& f) {
  switch (bits) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

/* fn(u, scratch) for u in [0, n) on nt OpenMP threads (static schedule), each thread with IEEE
 * floating point (IeeeFpScope) and its own scratch buffer of scratch_bytes. Returns QSGD_E_NOMEM,
 * without running fn, where a thread's buffer cannot be allocated. */
template <class F>
int32_t parallel_for_with_scratch(int nt, uint64_t n, size_t scratch_bytes, F&& fn) {
  int32_t status = QSGD_OK;
  if (nt <= 1 || n <= 1) { /* on the calling thread: an OpenMP region costs microseconds even for one */
    IeeeFpScope fp;
    void* scratch = malloc(scratch_bytes ? scratch_bytes : 1);
    if (!scratch) return QSGD_E_NOMEM;
    for (uint64_t u = 0; u < n; ++u) fn(u, scratch);
    free(scratch);
    return status;
  }
#pragma omp parallel num_threads(nt)
  {
    IeeeFpScope fp;
    void* scratch = malloc(scratch_bytes ? scratch_bytes : 1);
    if (!scratch) {
#pragma omp atomic write
      status = QSGD_E_NOMEM;
    }
#pragma omp barrier
    /* every thread's buffer, or no thread runs fn (a failed call writes nothing) */
    int32_t ok;
#pragma omp atomic read
    ok = status;
#pragma omp for schedule(static)
    for (uint64_t u = 0; u < n; ++u)
      if (ok == QSGD_OK) fn(u, scratch);
    free(scratch);
  }
  return status;
}

/* The per-element loops, compiled once per instruction-set variant (qsgd_cpu_isa.cc). Every
 * variant computes the same bytes and the same sums; active_kernels() is the one in use. */
/* What a payload's step of decode_sum does with its sums (Kernels::decode_step's fin) */
enum DecodeFinish { FIN_KEEP = 0, FIN_SET = 1, FIN_ACCUMULATE = 2, FIN_STREAM = 3 };

struct Kernels {
  const char* name;
  /* the bucket's stored scale (qsgd_math.h: max, L2 or the sign norm's mean |x|) */
  float (*bucket_scale)(const float* x, uint64_t n, int norm);
  /* codes[k] = the code of x[k], element lo + k, for k < n, within one page of 2^32 elements
   * (lo + n <= 2^32) and a scale that quantizes: encoder 1 qsgd_quantize(x[k], scale, s,
   * qsgd_u24(key, lo + k), bits), encoder 2 qsgd_quantize2(x[k], pre, rs, s, qsgd_u16(key, lo + k),
   * bits) with the bucket's pre and rs (qsgd_math.h) */
  void (*quantize)(const float* x, uint64_t n, uint64_t key, uint32_t lo, float scale, int bits, int encoder,
                   uint8_t* codes);
  /* Encoder 2, 2 to 8 bits, a scale that quantizes, lo a multiple of 8, within one page: the packed
   * codes of x[0:n) (elements lo .. lo+n-1) at dst, the bytes quantize then pack would give; nullptr
   * in variants without it (the encoder then stages byte codes and packs them) */
  void (*quantize_packed)(const float* x, uint64_t n, uint64_t key, uint32_t lo, float scale, int bits,
                          uint8_t* dst);
  /* codes[k] = qsgd_sign_code(x[k]) */
  void (*sign)(const float* x, uint64_t n, uint8_t* codes);
  /* m byte codes -> qsgd_packed_bytes(m, bits) bytes at dst */
  void (*pack)(int bits, const uint8_t* codes, uint64_t m, uint8_t* dst);
  /* One payload's step of decode_sum over elements [lo, lo+n) of a fixed-coding payload (data: its
   * packed codes, data_end one past their last byte; scales: its bucket scales; lo a multiple of 8;
   * codes: scratch of n bytes). With v the decoded values: s = (first ? 0 : acc) + v; then fin
   * (DecodeFinish) FIN_KEEP keeps s in acc[0:n), FIN_SET writes out[0:n) = alpha * s, FIN_ACCUMULATE
   * out = out + alpha * s, FIN_STREAM as FIN_SET with streaming stores (out + lo 16-byte aligned). */
  void (*decode_step)(int bits, const uint8_t* data, const uint8_t* data_end, const uint8_t* scales,
                      uint64_t bucket, uint64_t lo, uint64_t n, uint8_t* codes, float* acc, int first,
                      int fin, float* out, float alpha);
  /* out = alpha * acc (accumulate == 0) or out = out + alpha * acc */
  void (*finish)(float* out, const float* acc, uint64_t n, float alpha, int accumulate);
  /* the sum (mod 2^64) of qsgd_checksum_term over the 64-bit words k0 .. k1-1 of the payload p,
   * the checksum field read as zero */
  uint64_t (*checksum_terms)(const uint8_t* p, uint64_t k0, uint64_t k1);
};

/* The variant in use: chosen once, at the first call, by CPUID (the widest the CPU and the OS
 * support) or by HVD_QSGD_ISA; qsgd_set_cpu_isa changes it. */
const Kernels& active_kernels();

/* The bucket's stored scale, with the active variant (the Elias encoder's entry). */
float bucket_scale(const float* x, uint64_t n, int norm);

/* codes[k] = quantized code of x[k], element index i0 + k, for one bucket's scale, by encoder 1 or 2. */
void quantize_run(const float* x, uint64_t n, uint64_t i0, uint64_t seed, float scale, int bits, int encoder,
                  uint8_t* codes);

/* Scales are stored little-endian fp32 right after the header. */
inline float load_scale(const uint8_t* scales, uint64_t b) {
  float v;
  memcpy(&v, scales + 4 * b, 4);
  return v;
}
inline void store_scale(uint8_t* scales, uint64_t b, float v) { memcpy(scales + 4 * b, &v, 4); }

/* Full validation of scales (no negative value). */
int32_t check_scales(const uint8_t* scales, uint64_t nb);

/* Elias coding (qsgd_elias_cpu.cc). */
int32_t elias_encode(const float* x, uint64_t numel, const qsgd_config* cfg, uint8_t* out,
                     uint64_t cap, uint64_t* out_len);
/* Validate the Elias streams of a payload whose header and checksum were checked. */
int32_t elias_validate(const uint8_t* payload, const qsgd_header* h);
/* acc[0:n) += decoded elements [lo, lo+n) of a validated Elias payload; [lo, lo+n) must be a whole
 * segment. */
void elias_decode_segment_add(const uint8_t* payload, const qsgd_header* h, uint64_t seg,
                              float* acc);
uint64_t elias_max_bits_per_element(int bits);

}  // namespace qsgd_cpu

#endif
