/* Pieces the CPU translation units share (not part of the C ABI). */
#ifndef HVD_QSGD_CPU_INTERNAL_H_
#define HVD_QSGD_CPU_INTERNAL_H_

#include <stdint.h>
#include <stdlib.h>

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
#pragma omp parallel num_threads(nt)
  {
    IeeeFpScope fp;
    void* scratch = malloc(scratch_bytes ? scratch_bytes : 1);
    if (!scratch) {
#pragma omp atomic write
      status = QSGD_E_NOMEM;
    }
#pragma omp for schedule(static)
    for (uint64_t u = 0; u < n; ++u)
      if (scratch) fn(u, scratch);
    free(scratch);
  }
  return status;
}

/* The bucket's stored scale (qsgd_math.h: max, L2 or the sign norm's mean |x|). */
float bucket_scale(const float* x, uint64_t n, int norm);

/* codes[k] = quantized code of x[k], element index i0 + k, for one bucket's scale. */
void quantize_run(const float* x, uint64_t n, uint64_t i0, uint64_t seed, float scale, int bits,
                  uint8_t* codes);

/* codes[k] = the sign norm's code of x[k] (qsgd_sign_code), all zero where the scale does not
 * quantize. */
void sign_run(const float* x, uint64_t n, float scale, uint8_t* codes);

/* Scales are stored little-endian fp32 right after the header. */
float load_scale(const uint8_t* scales, uint64_t b);
void store_scale(uint8_t* scales, uint64_t b, float v);

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
